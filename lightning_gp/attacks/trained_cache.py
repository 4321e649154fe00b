"""What a server trained once, kept by key: in memory and, with a directory, on disk.

One implementation for every network an attack trains on the server's public data (the learned
inverter's, :class:`~lightning_gp.attacks.learned.InverterCache`; the generative prior's,
:class:`~lightning_gp.attacks.generative.GeneratorCache`; ROG's restoration network's,
:class:`~lightning_gp.attacks.obfuscation_robust.RestorationCache`): a later call, or a later process with the
same key, loads it instead of training. A file holds tensors and plain data only and is read with
``torch.load(..., weights_only=True)``, which unpickles no object of any other kind; each subclass
rebuilds its network from those fields, so whoever can write into the directory can at worst make the
server retrain, never run code in it. A file that does not match (another key, a missing or malformed
field, an older version's layout, anything ``weights_only`` refuses) is ignored with a warning and
overwritten by the network trained instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast

import torch
from torch import Tensor, nn


class CacheKey(Protocol):
    """What a key needs: hashable, and a stable digest that names its file."""

    def __hash__(self) -> int: ...

    def digest(self) -> str: ...


class DigestedKey:
    """A key whose digest is a hash of its ``repr`` (a frozen dataclass of plain fields: the ``repr``
    says everything the cached value depends on)."""

    def digest(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:24]


K = TypeVar("K", bound=CacheKey)
V = TypeVar("V")


class TrainedCache(Generic[K, V]):
    """Trained values by key, in memory and, with ``directory``, on disk (``<directory>/<prefix><key
    digest>.pt``). ``trainings`` counts the values this cache trained. Subclasses say what a file holds
    (:meth:`_payload`) and how a value is rebuilt from it (:meth:`_from_payload`)."""

    #: What is trained, as messages name it; the prefix of its files.
    kind: ClassVar[str] = "network"
    file_prefix: ClassVar[str] = ""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = None if directory is None else Path(directory)
        self._trained: dict[K, V] = {}
        self.trainings = 0

    def __len__(self) -> int:
        return len(self._trained)

    def get(self, key: K, train: Callable[[], V]) -> V:
        """The value of ``key``: from memory, from disk, or ``train()`` (then stored)."""
        found = self._trained.get(key)
        if found is None and self.directory is not None:
            found = self._load(key)
        if found is None:
            found = train()
            self.trainings += 1
            if self.directory is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
                torch.save(self._payload(key, found), self._path(key))
        self._trained[key] = found
        return found

    def clear(self) -> None:
        self._trained.clear()

    def _path(self, key: K) -> Path:
        assert self.directory is not None
        return self.directory / f"{self.file_prefix}{key.digest()}.pt"

    def _load(self, key: K) -> V | None:
        path = self._path(key)
        if not path.exists():
            return None
        try:
            return self._from_payload(torch.load(path, map_location="cpu", weights_only=True), key)
        except Exception as err:  # a pickled object, another key or layout, a truncated file: never run, retrain
            first = str(err).splitlines()[0] if str(err) else ""
            warnings.warn(
                f"{type(self).__name__}: ignoring {path} ({type(err).__name__}: {first}); the {self.kind} is "
                "trained again and the file overwritten",
                stacklevel=3,
            )
            return None

    def _payload(self, key: K, value: V) -> dict[str, Any]:
        """What a file holds of ``value``: tensors, numbers, strings and containers."""
        raise NotImplementedError

    def _from_payload(self, payload: Any, key: K) -> V:
        """The value :meth:`_payload` wrote for ``key``, rebuilt (``ValueError`` on any mismatch)."""
        raise NotImplementedError


def checked_payload(payload: Any, key: Any, file_format: str, kind: str) -> dict[str, Any]:
    """``payload`` if it is a ``kind`` file of ``file_format`` written for ``key`` (else ``ValueError``)."""
    if not isinstance(payload, dict) or payload.get("format") != file_format:
        raise ValueError(f"not a {kind} file of this version (no {file_format!r} header)")
    if payload.get("key") != repr(key):
        raise ValueError(f"the file was written for another {kind} key")
    return payload


def tensor_state(state: Any) -> dict[str, Tensor]:
    """``state`` if it is a mapping of names to tensors, as a module's ``state_dict`` (else ``ValueError``)."""
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise ValueError("a state dict of the file is not a mapping of names to tensors")
    return state


C = TypeVar("C")


def training_payload(
    key: Any, file_format: str, network: nn.Module, held_out: Tensor, cost: Any, **fields: Any
) -> dict[str, Any]:
    """What a file holds of a network trained on public data with some images held out: the format and
    the key's ``repr``, the network's constructor ``fields``, its state dict on the CPU, the held-out
    indices and the training cost (a dataclass); read back by :func:`checked_payload`,
    :func:`tensor_state` and :func:`training_record`."""
    return {
        "format": file_format,
        "key": repr(key),
        **fields,
        "state": {n: t.detach().cpu() for n, t in network.state_dict().items()},
        "held_out": held_out.cpu(),
        "cost": dataclasses.asdict(cost),
    }


def training_record(payload: dict[str, Any], cost_type: type[C]) -> tuple[C, Tensor]:
    """The training cost (``cost_type``, a dataclass, from its fields) and the held-out public indices
    that ``payload`` records (``ValueError`` on a field that does not match)."""
    cost, held_out = payload["cost"], payload["held_out"]
    if not isinstance(cost, dict) or set(cost) != {f.name for f in dataclasses.fields(cast(Any, cost_type))}:
        raise ValueError(f"the training cost's fields are {sorted(cost) if isinstance(cost, dict) else cost!r}")
    if not isinstance(held_out, Tensor) or held_out.dtype != torch.long:
        raise ValueError("the held-out indices are not an integer tensor")
    return cost_type(**cost), held_out
