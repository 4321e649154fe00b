"""Record the gradient a client shares (after every defense) for attacks and audits."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_gp.callbacks.base import SharedGradientObserver


@dataclass
class TappedGradient:
    """What the server received from one client in one round, and what the audit needs to score it.

    ``gradients`` is the shared gradient exactly as it left the client (after every defense);
    ``model_state`` holds the parameters and buffers of the model that gradient was computed at.
    ``batch`` is the client's private data, kept only so reconstructions can be scored: an attack's
    view of the round must never include it.
    """

    round: int
    client_id: int
    gradients: dict[str, Tensor]
    model_state: dict[str, Tensor]
    model_class: str
    batch: Any = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def inputs(self) -> Tensor | None:
        return self.batch[0] if isinstance(self.batch, (tuple, list)) and len(self.batch) >= 1 else None

    @property
    def targets(self) -> Tensor | None:
        return self.batch[1] if isinstance(self.batch, (tuple, list)) and len(self.batch) >= 2 else None

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.__dict__, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> TappedGradient:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tapped gradient at {path}")
        fields = torch.load(path, map_location="cpu", weights_only=False)
        expected = set(cls.__dataclass_fields__)
        if not isinstance(fields, dict) or not expected <= set(fields):
            raise ValueError(
                f"{path} is not a tapped gradient written by GradientTap (missing {expected - set(fields or {})})"
            )
        return cls(**{k: fields[k] for k in expected})


class GradientTap(SharedGradientObserver):
    """Keep the shared (post-defense) gradient of one client in chosen rounds.

    Args:
        client_id: the client to record (the global rank under DDP, 0 on a single device).
        rounds: the round (optimizer step) indices to record; ``None`` records every round.
        dirpath: if set, each record is also written to ``dirpath/round{r}_client{c}.pt``.
        record_data: keep the client's batch with the record, for scoring reconstructions.
    """

    def __init__(
        self,
        client_id: int = 0,
        rounds: int | Sequence[int] | None = 0,
        dirpath: str | None = None,
        record_data: bool = True,
    ) -> None:
        if isinstance(client_id, bool) or not isinstance(client_id, int) or client_id < 0:
            raise ValueError(f"client_id must be a non-negative int, got {client_id!r}")
        if isinstance(rounds, int):
            rounds = [rounds]
        if rounds is not None and any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in rounds):
            raise ValueError(f"rounds must be non-negative ints or None, got {rounds!r}")
        self.client_id = client_id
        self.rounds = None if rounds is None else sorted(set(rounds))
        self.dirpath = dirpath
        self.record_data = record_data
        self.records: list[TappedGradient] = []
        self._local_batches: dict[int, list[Any]] = {}

    def wants(self, client_id: int, round: int) -> bool:
        return client_id == self.client_id and (self.rounds is None or round in self.rounds)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # On the local and DDP paths the hook that sees the gradient does not see the batch:
        # keep the batches of the optimizer step in progress (several with accumulation).
        step = trainer.global_step
        for old in [s for s in self._local_batches if s < step]:
            del self._local_batches[old]
        if (
            not getattr(pl_module, "defends_per_client", False)
            and self.record_data
            and self.wants(trainer.global_rank, step)
        ):
            self._local_batches.setdefault(step, []).append(_to_cpu(batch))

    def observe(
        self,
        gradients: Mapping[str, Tensor],
        *,
        client_id: int,
        round: int,
        model: nn.Module,
        batch: Any,
        meta: Mapping[str, Any],
    ) -> None:
        if not self.wants(client_id, round):
            return
        if batch is None and round in self._local_batches:
            batch = _concat_batches(self._local_batches.pop(round))
        record = TappedGradient(
            round=round,
            client_id=client_id,
            gradients={n: g.detach().to("cpu", copy=True) for n, g in gradients.items()},
            model_state={n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()},
            model_class=f"{type(model).__module__}.{type(model).__qualname__}",
            batch=_to_cpu(batch) if self.record_data else None,
            meta=dict(meta),
        )
        self.records.append(record)
        if self.dirpath is not None:
            record.save(Path(self.dirpath) / f"round{round}_client{client_id}.pt")

    def latest(self) -> TappedGradient:
        if not self.records:
            raise LookupError(
                f"GradientTap recorded nothing: client {self.client_id} shared no gradient in rounds {self.rounds}"
            )
        return self.records[-1]


def _to_cpu(batch: Any) -> Any:
    if isinstance(batch, Tensor):
        return batch.detach().to("cpu", copy=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_cpu(b) for b in batch)
    if isinstance(batch, Mapping):
        return {k: _to_cpu(v) for k, v in batch.items()}
    return batch


def _concat_batches(batches: list[Any]) -> Any:
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    if isinstance(first, (tuple, list)) and all(isinstance(t, Tensor) for t in first):
        return type(first)(torch.cat([b[i] for b in batches]) for i in range(len(first)))
    return batches
