"""Magnitude pruning of the shared gradient (the pruning defense of DLG, Zhu et al. 2019, Sec. 5)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_gp.defenses.selection import count_for_rate, largest_magnitude_mask
from lightning_gp.defenses.sparsification import SparsifyingDefense
from lightning_gp.defenses.validation import check_rate


class MagnitudePruning(SparsifyingDefense):
    """Zero the ``rate`` fraction of smallest-magnitude entries of every layer.

    Exactly ``round(rate * n)`` entries of an ``n``-entry layer are zeroed (half rounds up), so a
    size-1 bias is zeroed when ``rate >= 0.5``. DLG (Zhu et al. 2019, Fig. 7) reports that
    pruning above ~20% starts to hamper its attack; this is the defense the DGP paper shows to
    still leak, because it sends exactly the largest entries.

    Args:
        rate: fraction of each layer's entries to zero, in [0, 1].
        error_feedback: keep the pruned remainder per client and add it to the next gradient.
    """

    def __init__(
        self, rate: float, *, error_feedback: bool = False, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(error_feedback=error_feedback, seed=seed, nonfinite=nonfinite)
        self.rate = check_rate(rate, "rate")

    def config(self) -> dict[str, Any]:
        return {"rate": self.rate, "error_feedback": self.error_feedback}

    def select(self, values: Mapping[str, Tensor], generator: torch.Generator) -> dict[str, Tensor]:
        return {
            name: largest_magnitude_mask(v, v.numel() - count_for_rate(self.rate, v.numel()))
            for name, v in values.items()
        }
