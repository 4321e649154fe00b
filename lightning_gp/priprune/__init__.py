"""PriPrune (Chu et al., "PriPrune: Quantifying and Preserving Privacy in Pruned Federated Learning", ACM TOMPECS): pruned FedAvg, its base pruning schemes and the learned defense mask.

``FederatedSimulation(module=PriPruneModule(model, base_scheme="magnitude"), algorithm="fedavg")``
trains with PriPrune; :class:`PrunedFedAvgModule` is the same pruned FedAvg without the defense.
The attack on both is :class:`~lightning_gp.attacks.SGI`; the privacy metric is
:func:`~lightning_gp.metrics.nmi`.
"""

from lightning_gp.priprune.mask import (
    final_share_mask,
    privacy_loss,
    sample_share_mask,
    withhold_probability,
)
from lightning_gp.priprune.module import AGGREGATIONS, PriPruneModule, PrunedFedAvgModule, server_view
from lightning_gp.priprune.schemes import (
    BASE_SCHEMES,
    BasePruningScheme,
    MagnitudeScheme,
    PruningContext,
    RandomScheme,
    SNIPScheme,
    SynFlowScheme,
    keep_top,
    make_scheme,
    prunable_weights,
    register_scheme,
)

__all__ = [
    "AGGREGATIONS",
    "BASE_SCHEMES",
    "BasePruningScheme",
    "MagnitudeScheme",
    "PriPruneModule",
    "PrunedFedAvgModule",
    "PruningContext",
    "RandomScheme",
    "SNIPScheme",
    "SynFlowScheme",
    "final_share_mask",
    "keep_top",
    "make_scheme",
    "privacy_loss",
    "prunable_weights",
    "register_scheme",
    "sample_share_mask",
    "server_view",
    "withhold_probability",
]
