"""Lightning callbacks: thin adapters that put defenses on the path of the shared gradient.

Give them to a ``Trainer`` in the order the defenses should apply; observers (taps, meters)
always see the gradient after every defense.
"""

from lightning_gp.callbacks.base import GradientDefense, SharedGradientCallback, SharedGradientObserver
from lightning_gp.callbacks.communication import CommunicationMeter, dense_nbytes, encoded_nbytes
from lightning_gp.callbacks.dp_sgd import DPSGD
from lightning_gp.callbacks.noise import GaussianNoise, GradientQuantization, LaplaceNoise
from lightning_gp.callbacks.optimal import (
    OptimalDPSGD,
    OptimalGradientNoise,
    OptimalGradientPruning,
    SensitivityGradientDefense,
)
from lightning_gp.callbacks.pipeline import SharedGradientPipeline
from lightning_gp.callbacks.progress import ProgressPrinter
from lightning_gp.callbacks.pruning import (
    AlignedDualGradientPruning,
    DualGradientPruning,
    MagnitudePruning,
    RandomPruning,
    TopKPruning,
)
from lightning_gp.callbacks.tap import GradientTap, TappedGradient

__all__ = [
    "DPSGD",
    "AlignedDualGradientPruning",
    "CommunicationMeter",
    "DualGradientPruning",
    "GaussianNoise",
    "GradientDefense",
    "GradientQuantization",
    "GradientTap",
    "LaplaceNoise",
    "MagnitudePruning",
    "OptimalDPSGD",
    "OptimalGradientNoise",
    "OptimalGradientPruning",
    "ProgressPrinter",
    "RandomPruning",
    "SensitivityGradientDefense",
    "SharedGradientCallback",
    "SharedGradientObserver",
    "SharedGradientPipeline",
    "TappedGradient",
    "TopKPruning",
    "dense_nbytes",
    "encoded_nbytes",
]
