"""Pruning defense callbacks: the pruning defenses of :mod:`lightning_gp.defenses.pruning`, adapted."""

from __future__ import annotations

from typing import Any

from lightning_gp.callbacks.base import GradientDefense
from lightning_gp.defenses import pruning


class MagnitudePruning(GradientDefense, defense=pruning.MagnitudePruning):
    """Zero the ``rate`` fraction of smallest-magnitude gradient entries of every layer (DLG, Sec. 5).
    See :class:`lightning_gp.defenses.MagnitudePruning`."""


class TopKPruning(GradientDefense, defense=pruning.TopKPruning):
    """Share each layer's largest-magnitude entries (DGC-style Top-k), with per-client error feedback.
    See :class:`lightning_gp.defenses.TopKPruning`."""


class RandomPruning(GradientDefense, defense=pruning.RandomPruning):
    """Zero a random ``rate`` fraction of each layer, with per-client error feedback.
    See :class:`lightning_gp.defenses.RandomPruning`."""


class DualGradientPruning(GradientDefense, defense=pruning.DualGradientPruning):
    """Dual gradient pruning (DGP): drop each layer's top-``k1`` and bottom-``k2`` entries by
    magnitude, share the band between, keep the rest as per-client error feedback.
    See :class:`lightning_gp.defenses.DualGradientPruning`.

    Example::

        Trainer(callbacks=[DualGradientPruning(k1=0.05, k2=0.75)])
        Trainer(callbacks=[DualGradientPruning.from_send_rate(0.2, p=1 / 15)])
    """

    @classmethod
    def from_send_rate(cls, send_rate: float = 0.2, p: float = 1 / 15, **kwargs: Any) -> DualGradientPruning:
        """Build from the fraction sent (``1 - k1 - k2``) and ``p = k1 / k2``."""
        defense = pruning.DualGradientPruning.from_send_rate(send_rate, p)
        return cls(k1=defense.k1, k2=defense.k2, **kwargs)


class AlignedDualGradientPruning(GradientDefense, defense=pruning.AlignedDualGradientPruning):
    """Aligned DGP (ADGP): each round one client's top-``2k`` positions become everyone's mask;
    every client drops its own top-``k1`` and sends its ``k`` largest entries inside the mask.

    In a :class:`~lightning_gp.federated.FederatedSimulation` the mask comes from a client drawn
    among the round's participants; under DDP the drawn rank broadcasts it before the clients
    prune. See :class:`lightning_gp.defenses.AlignedDualGradientPruning`.
    """
