"""Lightning callbacks: thin adapters that put defenses on the path of the shared gradient.

Give them to a ``Trainer`` in the order the defenses should apply; observers (taps, meters)
always see the gradient after every defense. :mod:`lightning_gp.callbacks.interfaces` defines the
three roles (runs the client step, defends, observes) the pipeline is built from.

``PrivacyAudit`` (attack the shared gradients during training and log the scores) is part of the
audit: ``from lightning_gp.audit import PrivacyAudit``.
"""

from lightning_gp.callbacks.base import GradientDefense, SharedGradientCallback, SharedGradientObserver
from lightning_gp.callbacks.communication import CommunicationMeter, dense_nbytes, encoded_nbytes
from lightning_gp.callbacks.data_dependent import DataDependentGradientDefense
from lightning_gp.callbacks.dp_sgd import DPSGD
from lightning_gp.callbacks.graddefense import GradDefense
from lightning_gp.callbacks.interfaces import ClientSetup, ClientStepRunner, DefenseStage, ObserverStage
from lightning_gp.callbacks.noise import GaussianNoise, GradientQuantization, LaplaceNoise
from lightning_gp.callbacks.optimal import (
    OptimalDPSGD,
    OptimalGradientNoise,
    OptimalGradientPruning,
    SensitivityGradientDefense,
)
from lightning_gp.callbacks.outpost import Outpost
from lightning_gp.callbacks.pipeline import LocalClientStep, SharedGradientPipeline
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
from lightning_gp.records import TappedGradient  # re-exported: it moved to lightning_gp.records

__all__ = [
    "DPSGD",
    "AlignedDualGradientPruning",
    "ClientSetup",
    "ClientStepRunner",
    "CommunicationMeter",
    "DataDependentGradientDefense",
    "DefenseStage",
    "DualGradientPruning",
    "GaussianNoise",
    "GradDefense",
    "GradientDefense",
    "GradientQuantization",
    "GradientTap",
    "LaplaceNoise",
    "LocalClientStep",
    "MagnitudePruning",
    "ObserverStage",
    "OptimalDPSGD",
    "OptimalGradientNoise",
    "OptimalGradientPruning",
    "Outpost",
    "ProgressPrinter",
    "RandomPruning",
    "SensitivityGradientDefense",
    "SharedGradientCallback",
    "SharedGradientObserver",
    "SharedGradientPipeline",
    "Soteria",
    "TappedGradient",
    "TopKPruning",
    "dense_nbytes",
    "encoded_nbytes",
]
