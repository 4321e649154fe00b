"""Training the generative prior on the server's public images, and caching it.

GGL (Li et al., CVPR 2022, Sec. 3.2) and GIAS (Jeon et al., NeurIPS 2021, Sec. 3) both start from
a generator trained on public data of the task and never on a client's. Here a DCGAN
(:mod:`~lightning_gp.attacks.generative.networks`) is trained with the non-saturating GAN loss
(Goodfellow et al., NeurIPS 2014, Sec. 3) and Adam (lr 2e-4, beta1 0.5: the DCGAN settings) on the
public images as pixels in [0, 1].

**When training stops.** A GAN's losses do not converge to a value that says the samples are
good, so the stop reads the samples: every ``check_every`` steps the squared maximum mean
discrepancy (MMD, Gretton et al., JMLR 2012, Eq. 3, unbiased; a Gaussian kernel on pixels whose
bandwidth is the median distance between held-out images) between ``eval_samples`` samples of fixed
latents and the held-out public images (``val_fraction`` of them, never trained on). Training stops
when that MMD has not fallen by a fraction ``min_improvement`` of its best for ``patience`` checks
(a plateau), or at ``max_steps`` (the cap); the generator of the best check is kept. Its
BatchNorm statistics are then recomputed over many prior samples (the attack runs the generator in
eval mode, one latent at a time).

A trained generator is cached (:class:`GeneratorCache`) by what it depends on
(:class:`GeneratorKey`): a fingerprint of the public pixels, the image shape, the configuration
(architecture and training) and the seed; the model attacked is not part of it, so one generator
serves every setting, round and client of a data set.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.attacks.generative.networks import Discriminator, Generator, check_image_shape
from lightning_gp.attacks.trained_cache import (
    DigestedKey,
    TrainedCache,
    checked_payload,
    tensor_state,
    training_payload,
    training_record,
)
from lightning_gp.optim import fused_adam
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_number, check_positive, check_positive_int

#: ``report(step, total, value)``: a heartbeat (and a place to stop) during training.
Report = Callable[[int, int, float], None]


@dataclass(frozen=True)
class GeneratorConfig:
    """The generator's architecture and training (part of its cache key).

    Attributes:
        latent_dim, width: the networks' latent size and channel width
            (:class:`~lightning_gp.attacks.generative.networks.Generator`).
        max_steps: the cap on training steps (one discriminator and one generator update each).
        check_every: steps between two validation MMDs (module docstring).
        patience: checks without an improvement before training stops.
        min_improvement: the relative fall of the best MMD that counts as an improvement.
        val_fraction: the share of the public images held out (validation, and the attack's decoys).
        batch, lr: minibatch size and Adam's learning rate of both networks.
        eval_samples: generator samples each validation MMD is computed on.
    """

    latent_dim: int = 64
    width: int = 16
    max_steps: int = 3000
    check_every: int = 150
    patience: int = 4
    min_improvement: float = 0.02
    val_fraction: float = 0.1
    batch: int = 64
    lr: float = 2e-4
    eval_samples: int = 256

    def __post_init__(self) -> None:
        for name in ("latent_dim", "width", "max_steps", "check_every", "patience", "batch", "eval_samples"):
            check_positive_int(getattr(self, name), name)
        check_number(self.min_improvement, "min_improvement", low=0.0, high=1.0, high_open=True)
        check_number(self.val_fraction, "val_fraction", low=0.0, high=1.0, low_open=True, high_open=True)
        check_positive(self.lr, "lr")


@dataclass
class GeneratorCost:
    """What training a generator cost and reached: wall and CPU seconds (all threads), the training
    steps, the public images used, the best validation MMD, the MMD of uniform-noise images to the
    same held-out images (the scale to read it on), and why training stopped."""

    seconds: float
    cpu_seconds: float
    steps: int
    images: int
    validation_mmd: float
    noise_mmd: float
    stopped: str


@dataclass
class TrainedGenerator:
    """A trained generator (eval mode), what it cost, and the public images held out from it."""

    generator: Generator
    cost: GeneratorCost
    held_out: Tensor

    @torch.no_grad()
    def sample(self, count: int, generator: torch.Generator | None = None) -> Tensor:
        """``count`` pixel images ``G(z)``, ``z ~ N(0, I)``."""
        self.generator.eval()
        device = next(self.generator.parameters()).device
        z = torch.randn(count, self.generator.latent_dim, generator=generator, device=device)
        return self.generator(z)


# ------------------------------------------------------------------------------------ the metric
def median_bandwidth(images: Tensor) -> float:
    """The median pairwise Euclidean distance between ``images`` (flattened): the kernel's bandwidth."""
    flat = images.reshape(images.shape[0], -1).double()
    distances = torch.cdist(flat, flat)
    upper = distances[torch.triu_indices(len(flat), len(flat), offset=1).unbind()]
    return float(upper.median()) if upper.numel() else 1.0


def kernel_mmd(samples: Tensor, reference: Tensor, bandwidth: float) -> float:
    """The unbiased squared MMD (Gretton et al., JMLR 2012, Eq. 3) between ``samples`` and
    ``reference`` (images, flattened) under ``k(a, b) = exp(-||a - b||^2 / (2 bandwidth^2))``."""
    x = samples.reshape(samples.shape[0], -1).double()
    y = reference.reshape(reference.shape[0], -1).double()
    if len(x) < 2 or len(y) < 2:
        raise ValueError("kernel_mmd needs at least two samples and two reference images")
    scale = 2 * check_positive(bandwidth, "bandwidth") ** 2

    def mean_kernel(a: Tensor, b: Tensor, same: bool) -> Tensor:
        k = torch.exp(-torch.cdist(a, b).pow(2) / scale)
        if same:
            return (k.sum() - k.diagonal().sum()) / (len(a) * (len(a) - 1))
        return k.mean()

    return float(mean_kernel(x, x, True) + mean_kernel(y, y, True) - 2 * mean_kernel(x, y, False))


def split_public(count: int, val_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """``(held_out, train)`` indices of ``count`` public images: a seeded shuffle, ``val_fraction``
    (at least 2) held out; ``ValueError`` when fewer than 2 are left to train on."""
    held = max(2, round(val_fraction * count))
    if count - held < 2:
        raise ValueError(f"public images: {count} are too few to train a generator and hold {held} out")
    order = torch.randperm(count, generator=seeded_generator(seed, 0x6E4))
    return order[:held], order[held:]


# ---------------------------------------------------------------------------------------- training
def train_generator(
    pixels: Tensor,
    config: GeneratorConfig,
    seed: int,
    *,
    report: Report | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainedGenerator:
    """A DCGAN trained on ``pixels`` ``[N, C, S, S]`` in [0, 1] (module docstring), seeded by ``seed``."""
    start, cpu_start = time.perf_counter(), time.process_time()
    check_image_shape(tuple(pixels.shape[1:]))
    pixels = pixels.detach().float()
    held_out, train_idx = split_public(len(pixels), config.val_fraction, seed)
    stream = seeded_generator(seed, 0x6A7)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=stream)))
    shape = tuple(pixels.shape[1:])
    net_g, net_d = Generator(shape, config.latent_dim, config.width), Discriminator(shape, config.width)
    opt_g = fused_adam(net_g.parameters(), lr=config.lr, betas=(0.5, 0.999))
    opt_d = fused_adam(net_d.parameters(), lr=config.lr, betas=(0.5, 0.999))
    validation = pixels[held_out]
    bandwidth = median_bandwidth(validation)
    eval_z = torch.randn(config.eval_samples, config.latent_dim, generator=stream)
    noise = torch.rand(config.eval_samples, *shape, generator=stream)
    best, anchor, best_state = math.inf, math.inf, copy.deepcopy(net_g.state_dict())
    since, steps, stopped = 0, 0, "max_steps"
    for step in range(config.max_steps):
        real = pixels[train_idx[torch.randint(0, len(train_idx), (config.batch,), generator=stream)]]
        z = torch.randn(config.batch, config.latent_dim, generator=stream)
        _gan_step(net_g, net_d, opt_g, opt_d, real, z)
        steps = step + 1
        if steps % config.check_every and steps != config.max_steps:
            continue
        mmd = _validation_mmd(net_g, eval_z, validation, bandwidth)
        if report is not None:
            report(step, config.max_steps, mmd)
        if log is not None:
            log(f"generator step {steps}/{config.max_steps}: validation MMD {mmd:.4g} (best {min(best, mmd):.4g})")
        if not math.isfinite(mmd):
            stopped = "non-finite validation MMD"
            break
        if mmd < best:  # the best generator is kept; only a clear improvement restarts the patience
            best, best_state = mmd, copy.deepcopy(net_g.state_dict())
        if not math.isfinite(anchor) or mmd < anchor - config.min_improvement * abs(anchor):
            anchor, since = mmd, 0
        else:
            since += 1
            if since >= config.patience:
                stopped = (
                    f"converged (no validation MMD {config.min_improvement:.0%} below {anchor:.4g} in {since} checks)"
                )
                break
    net_g.load_state_dict(best_state)
    calibrate_batchnorm(net_g, stream)
    cost = GeneratorCost(
        seconds=time.perf_counter() - start,
        cpu_seconds=time.process_time() - cpu_start,
        steps=steps,
        images=len(train_idx),
        validation_mmd=best,
        noise_mmd=kernel_mmd(noise, validation, bandwidth),
        stopped=stopped,
    )
    return TrainedGenerator(net_g, cost, held_out)


def _gan_step(
    net_g: Generator,
    net_d: Discriminator,
    opt_g: torch.optim.Optimizer,
    opt_d: torch.optim.Optimizer,
    real: Tensor,
    z: Tensor,
) -> None:
    """One discriminator and one generator update of the non-saturating GAN loss."""
    net_g.train()
    net_d.train()
    bce = nn.functional.binary_cross_entropy_with_logits
    fake = net_g(z)
    ones, zeros = torch.ones(len(real)), torch.zeros(len(fake))
    opt_d.zero_grad(set_to_none=True)
    loss_d = bce(net_d(real), ones) + bce(net_d(fake.detach()), zeros)
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad(set_to_none=True)
    loss_g = bce(net_d(fake), torch.ones(len(fake)))
    loss_g.backward()
    opt_g.step()


@torch.no_grad()
def _validation_mmd(net_g: Generator, eval_z: Tensor, validation: Tensor, bandwidth: float) -> float:
    """The MMD of the generator's samples of ``eval_z`` (batch statistics, as in training) to the held-out images."""
    modes = {m: m.training for m in net_g.modules()}
    momenta = {m: m.momentum for m in net_g.modules() if isinstance(m, nn.BatchNorm2d)}
    for bn in momenta:
        bn.momentum = 0.0  # batch statistics, running ones untouched
    net_g.train()
    try:
        return kernel_mmd(net_g(eval_z), validation, bandwidth)
    finally:
        for module, training in modes.items():
            module.training = training
        for bn, momentum in momenta.items():
            bn.momentum = momentum


@torch.no_grad()
def calibrate_batchnorm(net_g: Generator, stream: torch.Generator, batches: int = 16, size: int = 256) -> None:
    """Recompute the generator's BatchNorm running statistics as the average over ``batches``
    batches of prior samples (cumulative average), then switch it to eval mode."""
    norms = [m for m in net_g.modules() if isinstance(m, nn.BatchNorm2d)]
    for bn in norms:
        bn.reset_running_stats()
        bn.momentum = None
    net_g.train()
    for _ in range(batches):
        net_g(torch.randn(size, net_g.latent_dim, generator=stream))
    for bn in norms:
        bn.momentum = 0.1
    net_g.eval()


# ------------------------------------------------------------------------------------------- cache
@dataclass(frozen=True)
class GeneratorKey(DigestedKey):
    """What a trained generator depends on: the public pixels (a fingerprint), the image shape, the
    configuration (architecture and training) and the training seed."""

    data: str
    shape: tuple[int, ...]
    config: str
    seed: int


#: The layout of a file of :class:`GeneratorCache`; a file of another layout is retrained.
CACHE_FORMAT = "lightning-gp generator cache 1"


class GeneratorCache(TrainedCache[GeneratorKey, TrainedGenerator]):
    """Trained generators by :class:`GeneratorKey`, in memory and, with ``directory``, on disk
    (``<directory>/generator-<key digest>.pt``; a later process with the same key loads it instead
    of training). ``trainings`` counts the generators this cache trained.

    As :class:`~lightning_gp.attacks.learned.InverterCache` (both are
    :class:`~lightning_gp.attacks.trained_cache.TrainedCache`): a file holds tensors and plain data
    only, is read with ``torch.load(..., weights_only=True)`` and rebuilt from its fields; a file
    that does not match is ignored with a warning and overwritten by the generator trained instead."""

    kind = "generator"
    file_prefix = "generator-"

    def _payload(self, key: GeneratorKey, value: TrainedGenerator) -> dict[str, Any]:
        return _payload(key, value)

    def _from_payload(self, payload: Any, key: GeneratorKey) -> TrainedGenerator:
        return _from_payload(payload, key)


def _payload(key: GeneratorKey, trained: TrainedGenerator) -> dict[str, Any]:
    net = trained.generator
    return training_payload(
        key, CACHE_FORMAT, net, trained.held_out, trained.cost,
        shape=list(net.image_shape), latent_dim=int(net.latent_dim), width=int(net.width),
    )  # fmt: skip


def _from_payload(payload: Any, key: GeneratorKey) -> TrainedGenerator:
    """The generator :func:`_payload` wrote for ``key``, rebuilt (``ValueError`` on any mismatch)."""
    payload = checked_payload(payload, key, CACHE_FORMAT, "generator")
    net = Generator(tuple(int(d) for d in payload["shape"]), int(payload["latent_dim"]), int(payload["width"]))
    net.load_state_dict(tensor_state(payload["state"]))
    net.eval()
    cost, held_out = training_record(payload, GeneratorCost)
    return TrainedGenerator(net, cost, held_out)


#: The cache every :class:`~lightning_gp.attacks.generative.GenerativeGradientLeakage` uses unless
#: given its own (in memory, as the learned inverter's :data:`~lightning_gp.attacks.learned.DEFAULT_CACHE`).
DEFAULT_GENERATOR_CACHE = GeneratorCache()


__all__ = [
    "CACHE_FORMAT",
    "DEFAULT_GENERATOR_CACHE",
    "GeneratorCache",
    "GeneratorConfig",
    "GeneratorCost",
    "GeneratorKey",
    "TrainedGenerator",
    "calibrate_batchnorm",
    "kernel_mmd",
    "median_bandwidth",
    "split_public",
    "train_generator",
]
