"""Gradient inversion through a generative image prior (GGL, Li et al., CVPR 2022; GIAS, Jeon et al.,
NeurIPS 2021): a DCGAN trained on the server's public images, searched by Adam or CMA-ES.

- :mod:`~lightning_gp.attacks.generative.networks`: the generator and discriminator;
- :mod:`~lightning_gp.attacks.generative.training`: training on public images, the plateau stop,
  the on-disk cache;
- :mod:`~lightning_gp.attacks.generative.cmaes`: CMA-ES (Hansen 2016);
- :mod:`~lightning_gp.attacks.generative.attack`: the attack, registered as the published ``"GGL"``.
"""

from lightning_gp.attacks.generative.attack import DECOYS, GenerativeGradientLeakage
from lightning_gp.attacks.generative.cmaes import CMAResult, cma_es
from lightning_gp.attacks.generative.networks import SUPPORTED_SIZES, Discriminator, Generator, check_image_shape
from lightning_gp.attacks.generative.training import (
    DEFAULT_GENERATOR_CACHE,
    GeneratorCache,
    GeneratorConfig,
    GeneratorCost,
    GeneratorKey,
    TrainedGenerator,
    kernel_mmd,
    train_generator,
)

__all__ = [
    "DECOYS",
    "DEFAULT_GENERATOR_CACHE",
    "SUPPORTED_SIZES",
    "CMAResult",
    "Discriminator",
    "GenerativeGradientLeakage",
    "Generator",
    "GeneratorCache",
    "GeneratorConfig",
    "GeneratorCost",
    "GeneratorKey",
    "TrainedGenerator",
    "check_image_shape",
    "cma_es",
    "kernel_mmd",
    "train_generator",
]
