"""ROG's postprocessing: a restoration network trained on the server's public images, and its cache.

Yue et al., "Gradient Obfuscation Gives a False Sense of Security in Federated Learning" (USENIX
Security 2023; the postprocessing of their attack, ROG): the low-resolution image the inversion finds is noisy (the obfuscation's
error lands in it), so it is refined by networks trained on public data only. Theirs are a
class-conditional encoder-decoder fed the bicubic upsampling of the inversion, and a denoiser
followed by USRNet super-resolution (Zhang et al., CVPR 2020), the two outputs averaged. Ours is one
small network of the first kind, sized to train in a minute or two on a CPU thread for 28x28 grey
or 32x32 RGB images:

- **The network** (:class:`RestorationNetwork`): a U-Net-like encoder-decoder (Ronneberger et al.,
  MICCAI 2015) over three scales (``w``, ``2w``, ``4w`` channels; stride-2 convolutions down,
  upsampling and skip connections back), conditioned on the label by FiLM (Perez et al., AAAI 2018:
  a learned per-class scale and shift of the two coarsest scales' features), predicting a residual
  added to its input. Any image size works (the decoder upsamples to each skip's size).
- **What it learns** (:func:`degrade`): a public image ``x`` in pixels, average-pooled by the
  attack's scale factor ``s`` (the low-resolution image whose bicubic upsampling best stands for
  ``x``), Gaussian noise of std ``sigma ~ U[0, noise_max]`` added at the low resolution and clipped
  to [0, 1] (the inversion's low-resolution image is boxed to [0, 1] too), bicubic-upsampled back:
  the input; ``x`` the target; squared error. ``noise_max = 0.3``: on Fashion-MNIST with LeNetZhu at
  initialisation, the inversion's low-resolution image is off the pooled original by an RMS of 0.10
  undefended, 0.13 under Gaussian noise of std 0.1, 0.18 / 0.31 under Top-k 80% / 90% and 0.32
  under 2-bit quantisation (0.50, uninformative, under Top-k 99%).
- **When training stops**: every ``check_every`` steps, the squared error on the held-out public
  images (``val_fraction`` of them, degraded once with fixed noise); training stops when it has not
  fallen by a fraction ``min_improvement`` of its best for ``patience`` checks, or at ``max_steps``;
  the network of the best check is kept.

A trained network is cached (:class:`RestorationCache`, a
:class:`~lightning_gp.attacks.trained_cache.TrainedCache` as the generative prior's) by what it
depends on (:class:`RestorationKey`): fingerprints of the public pixels and labels, the image
shape, the classes, the scale factor, the configuration and the seed; not the model attacked, so one
network serves every setting, round and client of a data set.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gp.attacks.generative.training import split_public
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
from lightning_gp.validation import check_int, check_number, check_positive, check_positive_int

#: ``report(step, total, value)``: a heartbeat (and a place to stop) during training.
Report = Callable[[int, int, float], None]


@dataclass(frozen=True)
class RestorationConfig:
    """The restoration network's architecture and training (part of its cache key).

    Attributes:
        width: ``w``, the channels at full resolution (``2w`` and ``4w`` at the coarser scales).
        max_steps: the cap on training steps (one minibatch each).
        check_every: steps between two validation errors (module docstring).
        patience: checks without an improvement before training stops.
        min_improvement: the relative fall of the best validation error that counts as one.
        val_fraction: the share of the public images held out (validation, and the attack's decoys).
        batch, lr: minibatch size and Adam's learning rate.
        noise_max: the largest std of the low-resolution noise of a training input (pixels in [0, 1]).
    """

    width: int = 16
    max_steps: int = 2000
    check_every: int = 100
    patience: int = 4
    min_improvement: float = 0.01
    val_fraction: float = 0.1
    batch: int = 64
    lr: float = 2e-3
    noise_max: float = 0.3

    def __post_init__(self) -> None:
        for name in ("width", "max_steps", "check_every", "patience", "batch"):
            check_positive_int(getattr(self, name), name)
        check_number(self.min_improvement, "min_improvement", low=0.0, high=1.0, high_open=True)
        check_number(self.val_fraction, "val_fraction", low=0.0, high=1.0, low_open=True, high_open=True)
        check_positive(self.lr, "lr")
        check_number(self.noise_max, "noise_max", low=0.0, high=1.0)


# ------------------------------------------------------------------------------ resolution changes
def upsample(low: Tensor, size: tuple[int, int]) -> Tensor:
    """The bicubic upsampling of ``low`` ``[N, C, h, w]`` to ``size`` (ROG's dummy image from its
    low-resolution representation, Yue et al., USENIX Security 2023); ``low`` itself where the sizes agree."""
    if tuple(low.shape[-2:]) == tuple(size):
        return low
    return F.interpolate(low, size=size, mode="bicubic", align_corners=False)


def degrade(pixels: Tensor, scale_factor: int, sigma: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """A restoration input made from public ``pixels`` ``[N, C, H, W]`` in [0, 1]: average-pooled by
    ``scale_factor``, plus Gaussian noise of std ``sigma`` ``[N]`` at that resolution, clipped to
    [0, 1], bicubic-upsampled back and clipped (module docstring)."""
    low = F.avg_pool2d(pixels, scale_factor) if scale_factor > 1 else pixels
    noise = torch.randn(low.shape, generator=generator, device=low.device, dtype=low.dtype)
    noisy = (low + sigma.reshape(-1, 1, 1, 1) * noise).clamp(0, 1)
    return upsample(noisy, (int(pixels.shape[-2]), int(pixels.shape[-1]))).clamp(0, 1)


# -------------------------------------------------------------------------------------- network
class _LabelFilm(nn.Module):
    """FiLM by the label: ``h * (1 + gamma_y) + beta_y`` per channel, ``gamma`` and ``beta`` learned
    per class and zero at initialisation (the network starts unconditional)."""

    def __init__(self, num_classes: int, channels: int) -> None:
        super().__init__()
        self.table = nn.Embedding(num_classes, 2 * channels)
        nn.init.zeros_(self.table.weight)

    def forward(self, features: Tensor, labels: Tensor) -> Tensor:
        gamma, beta = self.table(labels).chunk(2, dim=1)
        return features * (1 + gamma[:, :, None, None]) + beta[:, :, None, None]


def _block(inputs: int, outputs: int, stride: int = 1) -> nn.Sequential:
    """Two 3x3 convolutions with LeakyReLU(0.2), the first of ``stride``."""
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1),
        nn.LeakyReLU(0.2),
        nn.Conv2d(outputs, outputs, 3, padding=1),
        nn.LeakyReLU(0.2),
    )


class RestorationNetwork(nn.Module):
    """The label-conditioned encoder-decoder ``(pixels [N, C, H, W], labels [N]) -> pixels`` (module
    docstring); the output is the input plus a learned residual, unclipped.

    Args:
        image_shape: ``(C, H, W)``.
        num_classes: the classes a label may name.
        width: ``w``, the channels at full resolution.
    """

    def __init__(self, image_shape: tuple[int, ...], num_classes: int, width: int) -> None:
        super().__init__()
        if len(image_shape) != 3 or any(int(s) < 1 for s in image_shape):
            raise ValueError(f"image_shape must be (C, H, W), got {tuple(image_shape)}")
        self.image_shape = tuple(int(s) for s in image_shape)
        self.num_classes = check_int(num_classes, "num_classes", low=2)
        self.width = check_positive_int(width, "width")
        channels = self.image_shape[0]
        self.fine = _block(channels, width)
        self.middle = _block(width, 2 * width, stride=2)
        self.coarse = _block(2 * width, 4 * width, stride=2)
        self.coarse_film = _LabelFilm(num_classes, 4 * width)
        self.middle_film = _LabelFilm(num_classes, 2 * width)
        self.up_middle = _block(4 * width + 2 * width, 2 * width)
        self.up_fine = _block(2 * width + width, width)
        self.head = nn.Conv2d(width, channels, 1)

    def forward(self, pixels: Tensor, labels: Tensor) -> Tensor:
        fine = self.fine(pixels)
        middle = self.middle(fine)
        coarse = self.coarse_film(self.coarse(middle), labels)
        up = F.interpolate(coarse, size=middle.shape[-2:], mode="nearest")
        up = self.middle_film(self.up_middle(torch.cat([up, middle], dim=1)), labels)
        up = F.interpolate(up, size=fine.shape[-2:], mode="nearest")
        return pixels + self.head(self.up_fine(torch.cat([up, fine], dim=1)))


# ------------------------------------------------------------------------------------- training
@dataclass
class RestorationCost:
    """What training the restoration network cost and reached: wall and CPU seconds (all threads),
    the steps, the public images trained on, the best held-out squared error (per pixel), that of
    the degraded held-out inputs themselves (the scale to read it on), and why training stopped."""

    seconds: float
    cpu_seconds: float
    steps: int
    images: int
    validation_mse: float
    input_mse: float
    stopped: str


@dataclass
class TrainedRestoration:
    """A trained restoration network (eval mode, frozen), what it cost, and the public images held out from it."""

    network: RestorationNetwork
    cost: RestorationCost
    held_out: Tensor


def held_out_public(count: int, config: RestorationConfig, seed: int) -> tuple[Tensor, Tensor]:
    """``(held_out, train)`` indices of ``count`` public images (as the generative prior splits them,
    :func:`~lightning_gp.attacks.generative.training.split_public`): the network never trains on
    the held-out ones, and the attack's decoys come from them."""
    return split_public(count, config.val_fraction, seed)


def train_restoration(
    pixels: Tensor,
    labels: Tensor,
    num_classes: int,
    scale_factor: int,
    config: RestorationConfig,
    seed: int,
    *,
    report: Report | None = None,
) -> TrainedRestoration:
    """The restoration network trained on public ``pixels`` ``[N, C, H, W]`` in [0, 1] with their
    ``labels`` to undo :func:`degrade` at ``scale_factor`` (ROG's postprocessing, Yue et al., USENIX
    Security 2023: ``min_w E ||R_w(degrade(x), y) - x||^2`` over public ``(x, y)``), seeded by ``seed``."""
    start, cpu_start = time.perf_counter(), time.process_time()
    pixels, labels = pixels.detach().float().cpu(), labels.detach().long().cpu()
    held_out, train_idx = held_out_public(len(pixels), config, seed)
    stream = seeded_generator(seed, 0x2E5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=stream)))
        network = RestorationNetwork(tuple(pixels.shape[1:]), num_classes, config.width)
    optimizer = fused_adam(network.parameters(), lr=config.lr)
    val_pixels, val_labels = pixels[held_out], labels[held_out]
    val_inputs = degrade(
        val_pixels, scale_factor, config.noise_max * torch.rand(len(held_out), generator=stream), stream
    )
    best, anchor, best_state = math.inf, math.inf, copy.deepcopy(network.state_dict())
    since, steps, stopped = 0, 0, "max_steps"
    for step in range(config.max_steps):
        rows = train_idx[torch.randint(0, len(train_idx), (config.batch,), generator=stream)]
        sigma = config.noise_max * torch.rand(config.batch, generator=stream)
        _training_step(
            network, optimizer, degrade(pixels[rows], scale_factor, sigma, stream), pixels[rows], labels[rows]
        )
        steps = step + 1
        if steps % config.check_every and steps != config.max_steps:
            continue
        error = _validation_mse(network, val_inputs, val_labels, val_pixels)
        if report is not None:
            report(step, config.max_steps, error)
        if not math.isfinite(error):
            stopped = "non-finite validation error"
            break
        if error < best:
            best, best_state = error, copy.deepcopy(network.state_dict())
        if not math.isfinite(anchor) or error < anchor - config.min_improvement * abs(anchor):
            anchor, since = error, 0
            continue
        since += 1
        if since >= config.patience:
            stopped = (
                f"converged (no validation error {config.min_improvement:.0%} below {anchor:.4g} in {since} checks)"
            )
            break
    network.load_state_dict(best_state)
    network.eval().requires_grad_(False)
    cost = RestorationCost(
        seconds=time.perf_counter() - start,
        cpu_seconds=time.process_time() - cpu_start,
        steps=steps,
        images=len(train_idx),
        validation_mse=best,
        input_mse=float(F.mse_loss(val_inputs, val_pixels)),
        stopped=stopped,
    )
    return TrainedRestoration(network, cost, held_out)


def _training_step(
    network: RestorationNetwork, optimizer: torch.optim.Optimizer, inputs: Tensor, targets: Tensor, labels: Tensor
) -> None:
    """One Adam step on the squared error of the restored ``inputs`` to ``targets``."""
    network.train()
    optimizer.zero_grad(set_to_none=True)
    with torch.enable_grad():
        F.mse_loss(network(inputs, labels), targets).backward()
    optimizer.step()


@torch.no_grad()
def _validation_mse(network: RestorationNetwork, inputs: Tensor, labels: Tensor, targets: Tensor) -> float:
    """The squared error per pixel of the restored held-out ``inputs`` (clipped to [0, 1], as the attack clips)."""
    network.eval()
    return float(F.mse_loss(network(inputs, labels).clamp(0, 1), targets))


# ------------------------------------------------------------------------------------------- cache
@dataclass(frozen=True)
class RestorationKey(DigestedKey):
    """What a trained restoration network depends on: the public pixels and labels (fingerprints),
    the image shape, the classes, the scale factor, the configuration and the training seed."""

    data: str
    labels: str
    shape: tuple[int, ...]
    num_classes: int
    scale_factor: int
    config: str
    seed: int


#: The layout of a file of :class:`RestorationCache`; a file of another layout is retrained.
CACHE_FORMAT = "lightning-gp restoration cache 1"


class RestorationCache(TrainedCache[RestorationKey, TrainedRestoration]):
    """Trained restoration networks by :class:`RestorationKey`, in memory and, with ``directory``, on
    disk (``<directory>/restoration-<key digest>.pt``; a later process with the same key loads it
    instead of training). ``trainings`` counts the networks this cache trained. As every
    :class:`~lightning_gp.attacks.trained_cache.TrainedCache`: a file holds tensors and plain data
    only, read with ``torch.load(..., weights_only=True)``; one that does not match is ignored with
    a warning and overwritten by the network trained instead."""

    kind = "restoration network"
    file_prefix = "restoration-"

    def _payload(self, key: RestorationKey, value: TrainedRestoration) -> dict[str, Any]:
        network = value.network
        return training_payload(
            key, CACHE_FORMAT, network, value.held_out, value.cost,
            shape=list(network.image_shape), num_classes=int(network.num_classes), width=int(network.width),
        )  # fmt: skip

    def _from_payload(self, payload: Any, key: RestorationKey) -> TrainedRestoration:
        payload = checked_payload(payload, key, CACHE_FORMAT, "restoration")
        shape = tuple(int(d) for d in payload["shape"])
        network = RestorationNetwork(shape, int(payload["num_classes"]), int(payload["width"]))
        network.load_state_dict(tensor_state(payload["state"]))
        network.eval().requires_grad_(False)
        cost, held_out = training_record(payload, RestorationCost)
        return TrainedRestoration(network, cost, held_out)


#: The cache every :class:`~lightning_gp.attacks.ObfuscationRobustInversion` uses unless given its own
#: (in memory, as the generative prior's :data:`~lightning_gp.attacks.generative.DEFAULT_GENERATOR_CACHE`).
DEFAULT_RESTORATION_CACHE = RestorationCache()


__all__ = [
    "CACHE_FORMAT",
    "DEFAULT_RESTORATION_CACHE",
    "RestorationCache",
    "RestorationConfig",
    "RestorationCost",
    "RestorationKey",
    "RestorationNetwork",
    "TrainedRestoration",
    "degrade",
    "held_out_public",
    "train_restoration",
    "upsample",
]
