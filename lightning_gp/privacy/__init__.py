"""Formal privacy as risk: reconstruction-robustness bounds of clipped Gaussian mechanisms and the
prior-aware reconstruction game that checks them (floor 1: no other layer of lightning_gp)."""

from lightning_gp.privacy.game import GameResult, clopper_pearson, reconstruction_game
from lightning_gp.privacy.rero import NEIGHBOURING, GaussianMechanism, Neighbouring, reconstruction_bound

__all__ = [
    "NEIGHBOURING",
    "GameResult",
    "GaussianMechanism",
    "Neighbouring",
    "clopper_pearson",
    "reconstruction_bound",
    "reconstruction_game",
]
