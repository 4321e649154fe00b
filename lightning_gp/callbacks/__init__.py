"""Lightning callbacks: thin adapters that put defenses on the path of the shared gradient.

Give them to a ``Trainer`` in the order the defenses should apply; observers (taps, meters)
always see the gradient after every defense. :class:`GradientDefense` adapts any pure
:class:`~lightning_gp.defenses.Defense`; the named callbacks are its one-line subclasses. The
engine they plug into (runners, the pipeline, the stage interfaces) is :mod:`lightning_gp.pipeline`.

``PrivacyAudit`` (attack the shared gradients during training and log the scores) is part of the
audit: ``from lightning_gp.audit import PrivacyAudit``.
"""

from lightning_gp.callbacks.base import GradientDefense, SharedGradientCallback, SharedGradientObserver
from lightning_gp.callbacks.communication import CommunicationMeter, dense_nbytes, encoded_nbytes
from lightning_gp.callbacks.data_dependent import DataDependentGradientDefense
from lightning_gp.callbacks.dp_sgd import DPSGD
from lightning_gp.callbacks.graddefense import GradDefense
from lightning_gp.callbacks.noise import (
    DistributedGaussianMechanism,
    GaussianNoise,
    GradientQuantization,
    LaplaceNoise,
    LocalGaussianMechanism,
)
from lightning_gp.callbacks.optimal import (
    OptimalDPSGD,
    OptimalGradientNoise,
    OptimalGradientPruning,
    SensitivityGradientDefense,
)
from lightning_gp.callbacks.outpost import Outpost
from lightning_gp.callbacks.progress import ProgressPrinter
from lightning_gp.callbacks.pruning import (
    AlignedDualGradientPruning,
    DualGradientPruning,
    MagnitudePruning,
    RandomPruning,
    TopKPruning,
)
from lightning_gp.callbacks.soteria import Soteria
from lightning_gp.callbacks.tap import GradientTap

__all__ = [
    "DPSGD",
    "AlignedDualGradientPruning",
    "CommunicationMeter",
    "DataDependentGradientDefense",
    "DistributedGaussianMechanism",
    "DualGradientPruning",
    "GaussianNoise",
    "GradDefense",
    "GradientDefense",
    "GradientQuantization",
    "GradientTap",
    "LaplaceNoise",
    "LocalGaussianMechanism",
    "MagnitudePruning",
    "OptimalDPSGD",
    "OptimalGradientNoise",
    "OptimalGradientPruning",
    "Outpost",
    "ProgressPrinter",
    "RandomPruning",
    "SensitivityGradientDefense",
    "SharedGradientCallback",
    "SharedGradientObserver",
    "Soteria",
    "TopKPruning",
    "dense_nbytes",
    "encoded_nbytes",
]
