"""The Outpost callback: the defense reads the current weights of the layers the client shares."""

from __future__ import annotations

from lightning_gp.callbacks.base import GradientDefense
from lightning_gp.defenses import outpost


class Outpost(GradientDefense, defense=outpost.Outpost):
    """Outpost (Wang et al., INFOCOM 2023) on every path (plain Trainer, DDP, FederatedSimulation).

    Perturbs a client's ``t``-th step with probability ``1 / (1 + beta t)``: prunes the ``rho``
    percent smallest entries of each layer, then adds ``N(0, (lam min(Var(W_l), 1))^2)`` to the
    ``phi`` percent of entries with the largest ``g^2``. The weights are the model's at the time of
    the gradient (the module itself on the local and DDP paths, the server model in the
    simulation), named like the gradient on every path. Each client's step counter is saved in
    checkpoints. See :class:`lightning_gp.defenses.Outpost`. No formal privacy guarantee.
    """
