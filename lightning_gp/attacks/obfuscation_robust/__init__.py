"""ROG, the obfuscation-robust gradient inversion (Yue et al., "Gradient Obfuscation Gives a False
Sense of Security in Federated Learning", USENIX Security 2023): gradient matching over a
low-resolution image, then a restoration network trained on the server's public images.

- :mod:`~lightning_gp.attacks.obfuscation_robust.restoration`: the restoration network, its training
  on degraded public images, the on-disk cache;
- :mod:`~lightning_gp.attacks.obfuscation_robust.attack`: the attack, registered as the published ``"ROG"``.
"""

from lightning_gp.attacks.obfuscation_robust.attack import (
    DECOYS,
    PAPER_SCALE_FROM,
    ObfuscationRobustInversion,
    default_scale_factor,
)
from lightning_gp.attacks.obfuscation_robust.restoration import (
    DEFAULT_RESTORATION_CACHE,
    RestorationCache,
    RestorationConfig,
    RestorationCost,
    RestorationKey,
    RestorationNetwork,
    TrainedRestoration,
    degrade,
    train_restoration,
    upsample,
)

__all__ = [
    "DECOYS",
    "DEFAULT_RESTORATION_CACHE",
    "PAPER_SCALE_FROM",
    "ObfuscationRobustInversion",
    "RestorationCache",
    "RestorationConfig",
    "RestorationCost",
    "RestorationKey",
    "RestorationNetwork",
    "TrainedRestoration",
    "default_scale_factor",
    "degrade",
    "train_restoration",
    "upsample",
]
