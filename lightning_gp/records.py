"""What the server received from one client in one round: the record attacks and audits read.

:class:`~lightning_gp.callbacks.GradientTap` writes these records during training; attacks build
their :class:`~lightning_gp.attacks.ServerView` from them. The record is plain data (tensors,
numbers, strings), saved without pickled code and loaded with ``torch.load(weights_only=True)``,
so a tap file received from someone else cannot run code when it is opened.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

_FORMAT = "lightning_gp.TappedGradient/1"
_PLAIN_SCALARS = (str, int, float, bool, type(None))


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
        """Write the record as plain tensors and containers (readable with ``weights_only=True``).

        ``meta`` values must be numbers, strings, tensors or containers of them; anything else
        is a ``TypeError`` here rather than a file that cannot be loaded safely later.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": _FORMAT,
            "round": int(self.round),
            "client_id": int(self.client_id),
            "gradients": dict(self.gradients),
            "model_state": dict(self.model_state),
            "model_class": str(self.model_class),
            "batch": _plain(self.batch, "batch"),
            "meta": _plain(dict(self.meta), "meta"),
        }
        torch.save(payload, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> TappedGradient:
        """Read a record written by :meth:`save`, without unpickling code (``weights_only=True``)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tapped gradient at {path}")
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # a pickle with code, a truncated file, another format
            raise ValueError(
                f"{path} is not a tapped gradient this version can load safely ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}); tap files hold plain tensors only"
            ) from err
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a tapped gradient written by GradientTap (no {_FORMAT!r} header)")
        batch = payload["batch"]
        return cls(
            round=int(payload["round"]),
            client_id=int(payload["client_id"]),
            gradients=dict(payload["gradients"]),
            model_state=dict(payload["model_state"]),
            model_class=str(payload["model_class"]),
            batch=tuple(batch) if isinstance(batch, list) else batch,
            meta=dict(payload["meta"]),
        )


def _plain(value: Any, where: str) -> Any:
    """``value`` with tuples as lists and mappings as str-keyed dicts; only tensors and scalars inside."""
    if isinstance(value, (Tensor, *_PLAIN_SCALARS)):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v, where) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where) for k, v in value.items()}
    raise TypeError(
        f"TappedGradient.{where} holds a value of type {type(value).__name__}; a tap file stores only tensors, numbers, "
        "strings and lists/dicts of them"
    )
