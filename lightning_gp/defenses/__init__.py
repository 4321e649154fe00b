"""Pure gradient defenses: named per-layer gradients of one client in, shared gradients out.

No Lightning imports here; :mod:`lightning_gp.callbacks` adapts these to a ``Trainer``.
"""

from lightning_gp.defenses.base import Defense, Gradients, Share, share_in_process
from lightning_gp.defenses.clipping import clip_update, dp_sgd_gradient, update_norm
from lightning_gp.defenses.graddefense import GradDefense, root_set_sensitivity
from lightning_gp.defenses.noise import (
    DistributedGaussianMechanism,
    GaussianNoise,
    LaplaceNoise,
    LocalGaussianMechanism,
)
from lightning_gp.defenses.optimal import (
    OptimalDPSGD,
    OptimalGradientNoise,
    OptimalGradientPruning,
    SensitivityDefense,
    optimal_noise_variance,
    optimal_pruning_scores,
)
from lightning_gp.defenses.outpost import Outpost
from lightning_gp.defenses.pruning import (
    AlignedDualGradientPruning,
    DualGradientPruning,
    MagnitudePruning,
    RandomPruning,
    TopKPruning,
)
from lightning_gp.defenses.quantization import GradientQuantization
from lightning_gp.defenses.selection import (
    count_for_rate,
    count_sent,
    kth_largest,
    largest_entries_mask,
    largest_magnitude_mask,
    magnitude_band_mask,
)
from lightning_gp.defenses.sensitivity import gradient_sensitivity
from lightning_gp.defenses.soteria import Soteria, defended_layer, representation_scores
from lightning_gp.defenses.sparsification import SparsifyingDefense
from lightning_gp.defenses.validation import NonFiniteGradientError, check_rate

__all__ = [
    "AlignedDualGradientPruning",
    "Defense",
    "DistributedGaussianMechanism",
    "DualGradientPruning",
    "GaussianNoise",
    "GradDefense",
    "GradientQuantization",
    "Gradients",
    "LaplaceNoise",
    "LocalGaussianMechanism",
    "MagnitudePruning",
    "NonFiniteGradientError",
    "OptimalDPSGD",
    "OptimalGradientNoise",
    "OptimalGradientPruning",
    "Outpost",
    "RandomPruning",
    "SensitivityDefense",
    "Share",
    "Soteria",
    "SparsifyingDefense",
    "TopKPruning",
    "check_rate",
    "clip_update",
    "count_for_rate",
    "count_sent",
    "defended_layer",
    "dp_sgd_gradient",
    "gradient_sensitivity",
    "kth_largest",
    "largest_entries_mask",
    "largest_magnitude_mask",
    "magnitude_band_mask",
    "optimal_noise_variance",
    "optimal_pruning_scores",
    "representation_scores",
    "root_set_sensitivity",
    "share_in_process",
    "update_norm",
]
