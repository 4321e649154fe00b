"""Pruning defense callbacks."""

from __future__ import annotations

from typing import Any

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


class TopKPruning(GradientDefense):
    """Share each layer's ``k`` fraction of largest-magnitude gradient entries (DGC-style Top-k),
    with per-client error feedback. See :class:`lightning_gp.defenses.TopKPruning`."""

    def __init__(
        self, k: float = 0.2, error_feedback: bool = True, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(pruning.TopKPruning(k, error_feedback=error_feedback, seed=seed, nonfinite=nonfinite))


class RandomPruning(GradientDefense):
    """Zero a random ``rate`` fraction of each layer, with per-client error feedback.
    See :class:`lightning_gp.defenses.RandomPruning`."""

    def __init__(
        self, rate: float = 0.8, error_feedback: bool = True, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(pruning.RandomPruning(rate, error_feedback=error_feedback, seed=seed, nonfinite=nonfinite))


class DualGradientPruning(GradientDefense):
    """Dual gradient pruning (DGP): drop each layer's top-``k1`` and bottom-``k2`` entries by
    magnitude, share the band between, keep the rest as per-client error feedback.
    See :class:`lightning_gp.defenses.DualGradientPruning`.

    Example::

        Trainer(callbacks=[DualGradientPruning(k1=0.05, k2=0.75)])
        Trainer(callbacks=[DualGradientPruning.from_send_rate(0.2, p=1 / 15)])
    """

    def __init__(
        self,
        k1: float = 0.05,
        k2: float = 0.75,
        error_feedback: bool = True,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        super().__init__(
            pruning.DualGradientPruning(k1, k2, error_feedback=error_feedback, seed=seed, nonfinite=nonfinite)
        )

    @classmethod
    def from_send_rate(cls, send_rate: float = 0.2, p: float = 1 / 15, **kwargs: Any) -> DualGradientPruning:
        """Build from the fraction sent (``1 - k1 - k2``) and ``p = k1 / k2``."""
        defense = pruning.DualGradientPruning.from_send_rate(send_rate, p)
        return cls(k1=defense.k1, k2=defense.k2, **kwargs)


class AlignedDualGradientPruning(GradientDefense):
    """Aligned DGP (ADGP): each round one client's top-``2k`` positions become everyone's mask;
    every client drops its own top-``k1`` and sends its ``k`` largest entries inside the mask.

    In a :class:`~lightning_gp.federated.FederatedSimulation` the mask comes from a client drawn
    among the round's participants; under DDP the drawn rank broadcasts it before the clients
    prune. See :class:`lightning_gp.defenses.AlignedDualGradientPruning`.
    """

    def __init__(
        self,
        k: float = 0.2,
        k1: float = 0.05,
        error_feedback: bool = True,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        super().__init__(
            pruning.AlignedDualGradientPruning(k, k1, error_feedback=error_feedback, seed=seed, nonfinite=nonfinite)
        )
