"""Server-side aggregation of the updates clients shared."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gp.defenses.base import Gradients


def weighted_mean(updates: Sequence[Gradients], weights: Sequence[float] | Tensor | None = None) -> Gradients:
    """Average named updates, uniformly or with non-negative weights that need not sum to 1."""
    if len(updates) == 0:
        raise ValueError("updates is empty: no client shared anything this round")
    names = list(updates[0])
    for i, update in enumerate(updates):
        if update.keys() != set(names):
            raise ValueError(f"update {i} has layers {sorted(update)}, expected {sorted(names)}")
    if weights is None:
        return {n: torch.stack([u[n] for u in updates]).mean(0) for n in names}
    w = torch.as_tensor(weights, dtype=torch.float64)
    if w.shape != (len(updates),) or not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(
            f"weights must be {len(updates)} non-negative numbers (finite, with a positive sum), got {weights!r}"
        )
    w = w / w.sum()
    return {
        n: torch.einsum(
            "c,c...->...", w.to(updates[0][n].dtype).to(updates[0][n].device), torch.stack([u[n] for u in updates])
        )
        for n in names
    }
