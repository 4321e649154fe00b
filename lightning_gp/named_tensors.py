"""Named per-layer tensors as one flat vector and back (and into caller-given tensors).

Global thresholds across layers, one broadcast of a whole model's mask, and one all-reduce per
DDP bucket all need the model's named tensors as a single vector, then split again in the same
order. Booleans travel as ``uint8`` (collectives do not take ``bool``) and come back as ``bool``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


def flatten_named(tensors: Mapping[str, Tensor], *, dtype: torch.dtype | None = None) -> Tensor:
    """The tensors' entries in mapping order as one 1-D tensor (``bool`` as ``uint8``).

    ``dtype`` casts every part; by default all parts must share one dtype.
    """
    if not tensors:
        raise ValueError("flatten_named needs at least one tensor")
    parts = [t.reshape(-1) for t in tensors.values()]
    if dtype is None:
        dtypes = {p.dtype for p in parts}
        if len(dtypes) != 1:
            raise ValueError(f"flatten_named: the tensors have several dtypes {sorted(map(str, dtypes))}; pass dtype=")
        dtype = parts[0].dtype
    if dtype == torch.bool:
        dtype = torch.uint8
    return torch.cat([p.to(dtype) for p in parts])


def unflatten_named(flat: Tensor, like: Mapping[str, Tensor], *, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Split ``flat`` into views shaped (and typed) like the tensors of ``like``, in its order.

    ``dtype`` types every part (e.g. ``torch.bool`` for a mask shaped like float tensors); by
    default each part takes its ``like`` tensor's dtype. A part already of that dtype stays a view.
    """
    total = sum(t.numel() for t in like.values())
    if flat.ndim != 1 or flat.numel() != total:
        raise ValueError(f"unflatten_named: expected a 1-D tensor of {total} entries, got shape {tuple(flat.shape)}")
    out, offset = {}, 0
    for name, t in like.items():
        part = flat[offset : offset + t.numel()].view(t.shape)
        target = t.dtype if dtype is None else dtype
        out[name] = part if part.dtype == target else part.to(target)
        offset += t.numel()
    return out


def write_into(out: Mapping[str, Tensor], shared: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Copy ``shared`` into the tensors of ``out`` (skipping those that already are them); ``out`` as a dict."""
    if shared.keys() != out.keys():
        raise ValueError(f"out names other layers than the shared gradient: {sorted(set(out) ^ set(shared))[:5]}")
    for name, target in out.items():
        if shared[name] is not target:
            target.copy_(shared[name])
    return dict(out)
