"""Pruning defense callbacks."""

from __future__ import annotations

from lightning_gp.callbacks.base import GradientDefense
from lightning_gp.defenses import pruning


class MagnitudePruning(GradientDefense):
    """Zero the ``rate`` fraction of smallest-magnitude gradient entries of every layer (DLG, Sec. 5).

    The callback form of :class:`lightning_gp.defenses.MagnitudePruning`; see it for the exact rule.

    Args:
        rate: fraction of each layer's entries to zero, in [0, 1].
        error_feedback: keep what was pruned per client and add it to the next gradient.
        seed: seeds the defense's per-client random streams (``None``: from torch's global seed).
        nonfinite: ``"error"`` (default) or ``"zero"`` for NaN/inf gradients.
    """

    def __init__(
        self, rate: float = 0.8, error_feedback: bool = False, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(pruning.MagnitudePruning(rate, error_feedback=error_feedback, seed=seed, nonfinite=nonfinite))
