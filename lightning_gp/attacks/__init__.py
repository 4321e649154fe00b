"""Gradient inversion attacks: what a server can rebuild from one shared gradient.

Every attack takes a :class:`ServerView` (the model sent, the shared gradient, what the threat
model allows) and returns a :class:`Reconstruction`. Attacks never see the client's data.

Each module registers its attacks where it defines them (:mod:`lightning_gp.attacks.registry`):
the adaptive attack of each defense class, and the published attacks by name. Importing this
package imports every such module, so the registries are complete before any lookup.
"""

from lightning_gp.attacks.adaptive import (
    ComposedTransform,
    DefenseAwareIDLG,
    DefenseAwareInversion,
    DefenseKnowledge,
    UnmodelledDefenseWarning,
    compose_knowledge,
    coordinate_clip,
    defense_aware_attacks,
    defense_aware_inversion,
    layer_noise_weights,
    mark_fallback,
    straight_through_quantization,
    update_clip,
)
from lightning_gp.attacks.ats_aware import ATSAwareInversion, ATSAwareRobbing
from lightning_gp.attacks.base import ATTACK_REVISION, AttackNotApplicable, GradientAttack, Reconstruction
from lightning_gp.attacks.cocktail_party import CocktailParty, first_linear_layer
from lightning_gp.attacks.fedavg import FedAvgInversion, fedavg_client_view, local_sgd_update
from lightning_gp.attacks.generative import GenerativeGradientLeakage, GeneratorCache, GeneratorConfig
from lightning_gp.attacks.gradient_matching import (
    cosine_distance,
    gaussian_nll,
    laplace_nll,
    parameter_gradients,
    per_example_gradients,
    squared_l2_distance,
    total_variation,
)
from lightning_gp.attacks.labels import (
    LABEL_RECOVERY_REVISION,
    classification_layer,
    label_counts,
    label_estimates_differ,
    recover_labels,
)
from lightning_gp.attacks.learned import (
    InverterCache,
    InverterConfig,
    LearnedInversion,
    RefinedLearnedInversion,
)
from lightning_gp.attacks.model_inconsistency import LOKI
from lightning_gp.attacks.monitor import AttackInterrupted, monitored
from lightning_gp.attacks.noise_aware import NoiseAwareMAP, noise_aware_attacks
from lightning_gp.attacks.obfuscation_robust import ObfuscationRobustInversion, RestorationCache, RestorationConfig
from lightning_gp.attacks.optimization import DLG, IDLG, GradInversion, InvertingGradients, optimize_images
from lightning_gp.attacks.perturbation_aware import graddefense_knowledge, outpost_knowledge
from lightning_gp.attacks.precode_aware import PRECODEAwareInversion, find_precode, recover_features
from lightning_gp.attacks.refiner_aware import RefinerAwareInversion
from lightning_gp.attacks.registry import (
    AdaptiveDeclaration,
    PublishedAttack,
    attacks_by_name,
    declaration_of,
    declared_defenses,
    published_attack_names,
    register_adaptive_attack,
    register_attack,
    register_defense_knowledge,
)
from lightning_gp.attacks.resolution import (
    adaptive_attacks,
    adaptive_attacks_of,
    composed_knowledge,
    composition_fallback_reason,
    defense_knowledge,
    has_adaptive_attack,
    modelled_defense,
)
from lightning_gp.attacks.rgap import RGAP
from lightning_gp.attacks.robbing_the_fed import ImprintBlock, ImprintedModel, RobbingTheFed
from lightning_gp.attacks.sgi import SGI, received_weights, recover_mask
from lightning_gp.attacks.threat_models import CAPABILITIES, SOK_THREAT_MODELS, SoKThreatModel, threat_class_of
from lightning_gp.attacks.view import ServerView

__all__ = [
    "ATTACK_REVISION",
    "CAPABILITIES",
    "DLG",
    "IDLG",
    "LABEL_RECOVERY_REVISION",
    "LOKI",
    "RGAP",
    "SGI",
    "SOK_THREAT_MODELS",
    "ATSAwareInversion",
    "ATSAwareRobbing",
    "AdaptiveDeclaration",
    "AttackInterrupted",
    "AttackNotApplicable",
    "CocktailParty",
    "ComposedTransform",
    "DefenseAwareIDLG",
    "DefenseAwareInversion",
    "DefenseKnowledge",
    "FedAvgInversion",
    "GenerativeGradientLeakage",
    "GeneratorCache",
    "GeneratorConfig",
    "GradInversion",
    "GradientAttack",
    "ImprintBlock",
    "ImprintedModel",
    "InverterCache",
    "InverterConfig",
    "InvertingGradients",
    "LearnedInversion",
    "NoiseAwareMAP",
    "ObfuscationRobustInversion",
    "PRECODEAwareInversion",
    "PublishedAttack",
    "Reconstruction",
    "RefinedLearnedInversion",
    "RefinerAwareInversion",
    "RestorationCache",
    "RestorationConfig",
    "RobbingTheFed",
    "ServerView",
    "SoKThreatModel",
    "UnmodelledDefenseWarning",
    "adaptive_attacks",
    "adaptive_attacks_of",
    "attacks_by_name",
    "classification_layer",
    "compose_knowledge",
    "composed_knowledge",
    "composition_fallback_reason",
    "coordinate_clip",
    "cosine_distance",
    "declaration_of",
    "declared_defenses",
    "defense_aware_attacks",
    "defense_aware_inversion",
    "defense_knowledge",
    "fedavg_client_view",
    "find_precode",
    "first_linear_layer",
    "gaussian_nll",
    "graddefense_knowledge",
    "has_adaptive_attack",
    "label_counts",
    "label_estimates_differ",
    "laplace_nll",
    "layer_noise_weights",
    "local_sgd_update",
    "mark_fallback",
    "modelled_defense",
    "monitored",
    "noise_aware_attacks",
    "optimize_images",
    "outpost_knowledge",
    "parameter_gradients",
    "per_example_gradients",
    "published_attack_names",
    "received_weights",
    "recover_features",
    "recover_labels",
    "recover_mask",
    "register_adaptive_attack",
    "register_attack",
    "register_defense_knowledge",
    "squared_l2_distance",
    "straight_through_quantization",
    "threat_class_of",
    "total_variation",
    "update_clip",
]
