"""Training recipe of Refiner's evaluation network (Sec. 3.3.2, App. D) and the images it learns from.

Every batch of clean images x (pixels in [0, 1]) is mixed with uniform noise once per noise
ratio r in {0, 0.1, ..., 1}: ``(1 - r) x + r u``, u ~ U[0, 1] drawn afresh for each mix (App. D:
"each batch is mixed with random noise 11 times"). The 11 mixes form one optimizer step (the
paper does not say whether they are 11 steps or one). D regresses r with binary cross-entropy
against the soft target r (the paper names no loss), Adam (lr 1e-4), batch 128, 20 epochs.
Held-out images, never trained on, give the mean absolute error of the predicted r per r.

Images (the paper used TinyImageNet, which is not on hand); all are public and disjoint from the
clients' data of the demo, tests and benchmarks, which always come from Fashion-MNIST's TRAINING
split:

* ``"fashion-mnist-test"`` (1 channel, 28x28): Fashion-MNIST's test split without the first 100
  images of each class (those are the built-in sample's test split); of the rest, the last 100
  of each class are held out. Images byte-identical to a training-split image are dropped.
* ``"scikit-image-photos"`` (3 channels): public-domain / CC0 photographs bundled in the
  scikit-image wheel (``pip install 'lightning-gp[refiner-train]'``), cut into random crops at
  several scales with horizontal flips; two whole photographs (chelsea, coffee) are held out.
* a path to an ``.npz`` file with ``train_images`` and ``heldout_images`` (uint8 or float in
  [0, 1], ``[N, C, H, W]``): bring your own images.

``lightning-gp refiner train-evaluator --config configs/refiner_evaluator_1ch.yaml`` runs
:func:`train_evaluator` (see :mod:`lightning_gp.refiner.cli`).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.data.base import CorruptDatasetError, DatasetNotFoundError
from lightning_gp.data.photos import HELDOUT_PHOTOS, TRAIN_PHOTOS, read_photo, scikit_image_data_dir
from lightning_gp.data.photos import pyramid as _pyramid
from lightning_gp.refiner.evaluator import CHECKPOINT_FORMAT, EvaluationNetwork
from lightning_gp.validation import check_int, check_positive, check_positive_int

#: The 11 noise ratios of App. D.
NOISE_RATIOS: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))

FASHION_MNIST_SOURCE = "fashion-mnist-test"
PHOTOS_SOURCE = "scikit-image-photos"
#: Images per class of Fashion-MNIST's test split that the built-in sample uses (skipped here).
SAMPLE_TEST_PER_CLASS = 100
#: Images per class of the remaining test split held out for the MAE (the last ones, in file order).
FASHION_HELDOUT_PER_CLASS = 100


class TrainingImagesError(FileNotFoundError):
    """The images an evaluation network is trained on are not installed (or not readable)."""


@dataclass
class EvaluatorImages:
    """Clean training and held-out images for the evaluation network (uint8 ``[N, C, H, W]``)."""

    train: Tensor
    heldout: Tensor
    description: str

    @property
    def channels(self) -> int:
        return int(self.train.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train.shape[-1])


# --- images -----------------------------------------------------------------------------------


def _digests(images: np.ndarray) -> list[bytes]:
    return [hashlib.blake2b(image.tobytes(), digest_size=16).digest() for image in images]


def fashion_mnist_images(data_dir: str | None = None) -> EvaluatorImages:
    """Fashion-MNIST test images that are not the built-in sample's, split into train / held-out.

    Per class, in file order: the first 100 are the built-in sample's test split (skipped; checked
    against the shipped sample), the last 100 are held out, the rest (800) are for training.
    Images byte-identical to one of the 60000 training-split images are dropped.
    """
    from lightning_gp.data import FashionMNISTDataModule
    from lightning_gp.data.builtin_sample import load_sample_arrays

    datamodule = FashionMNISTDataModule(data_dir=data_dir)
    try:
        (train_x, _), (test_x, test_y) = datamodule.read_splits(datamodule.locate())
    except DatasetNotFoundError as err:
        raise TrainingImagesError(
            f"the 1-channel evaluation network is trained on Fashion-MNIST's test split, which is not installed: {err}"
        ) from err
    sample_test = load_sample_arrays()["test_images"]
    skipped, heldout, train = [], [], []
    for label in range(10):
        positions = np.flatnonzero(test_y == label)
        skipped.append(positions[:SAMPLE_TEST_PER_CLASS])
        heldout.append(positions[-FASHION_HELDOUT_PER_CLASS:])
        train.append(positions[SAMPLE_TEST_PER_CLASS:-FASHION_HELDOUT_PER_CLASS])
    skipped_sorted = np.sort(np.concatenate(skipped))
    if not np.array_equal(test_x[skipped_sorted], sample_test):
        raise ValueError(
            "the first 100 test images per class of the Fashion-MNIST files do not match the built-in sample's "
            "test split; the evaluation network's images could overlap the clients' data"
        )
    train_idx, heldout_idx = np.sort(np.concatenate(train)), np.sort(np.concatenate(heldout))
    client_digests = set(_digests(train_x))
    keep = np.array([d not in client_digests for d in _digests(test_x)])
    dropped = int((~keep[train_idx]).sum() + (~keep[heldout_idx]).sum())
    train_idx, heldout_idx = train_idx[keep[train_idx]], heldout_idx[keep[heldout_idx]]
    description = (
        f"Fashion-MNIST test split (t10k, MIT licence) without the first {SAMPLE_TEST_PER_CLASS} images per class "
        f"(the built-in sample's test split): {len(train_idx)} training images; the last "
        f"{FASHION_HELDOUT_PER_CLASS} per class held out ({len(heldout_idx)} images); {dropped} image(s) "
        "byte-identical to a training-split image dropped. Disjoint from the clients' data (Fashion-MNIST's "
        "training split)."
    )
    return EvaluatorImages(torch.from_numpy(test_x[train_idx]), torch.from_numpy(test_x[heldout_idx]), description)


def scikit_image_photo_dir() -> Path:
    """``skimage/data`` of the installed scikit-image (without importing it), or a clear error."""
    folder = scikit_image_data_dir()
    if folder is None:
        raise TrainingImagesError(
            "the 3-channel evaluation network is trained on the photographs bundled with scikit-image, which is "
            "not installed: pip install 'lightning-gp[refiner-train]' (or pass data_dir= a folder holding "
            f"{', '.join([*TRAIN_PHOTOS, *HELDOUT_PHOTOS])})"
        )
    return folder


def smooth_images(n: int, channels: int, size: int, seed: int) -> Tensor:
    """Smooth synthetic pictures in [0, 1]: a random 4x4 colour grid upsampled bilinearly plus a gradient
    (images no evaluation network trained on, for checks that need no dataset)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.rand(n, channels, 4, 4, generator=g)
    images = torch.nn.functional.interpolate(grid, size=(size, size), mode="bilinear", align_corners=True)
    ramp = torch.linspace(-0.2, 0.2, size).view(1, 1, 1, size) * torch.randn(n, 1, 1, 1, generator=g)
    return (images + ramp).clamp(0, 1)


def random_crops(photos: Sequence[np.ndarray], count: int, size: int, seed: int, tint_grey: bool = True) -> Tensor:
    """``count`` random ``size`` x ``size`` crops (uint8 ``[count, 3, size, size]``) at several scales.

    Each crop picks a photo, a scale (the photo downsampled so its shorter side is ``size``,
    ``size * sqrt(2)``, ``2 * size``, ... up to full resolution), a position and a horizontal flip,
    uniformly, from ``numpy.random.default_rng(seed)``. With ``tint_grey``, a crop of a grey photo
    (three equal channels) gets a random colour cast: each channel times a gain from U[0.5, 1.5],
    clipped (otherwise D learns "equal channels = clean" and calls coloured photos noisy).
    """
    check_positive_int(count, "count")
    check_positive_int(size, "size")
    rng = np.random.default_rng(seed)
    pyramids = [_pyramid(photo, size) for photo in photos]
    grey = [bool(np.array_equal(p[0], p[1]) and np.array_equal(p[1], p[2])) for p in photos]
    crops = np.empty((count, 3, size, size), dtype=np.uint8)
    for i in range(count):
        which = rng.integers(len(pyramids))
        levels = pyramids[which]
        level = levels[rng.integers(len(levels))]
        top = rng.integers(level.shape[1] - size + 1)
        left = rng.integers(level.shape[2] - size + 1)
        crop = level[:, top : top + size, left : left + size]
        crop = crop[:, :, ::-1] if rng.random() < 0.5 else crop
        if tint_grey and grey[which]:
            gains = rng.uniform(0.5, 1.5, size=(3, 1, 1))
            crop = np.clip(np.round(crop * gains), 0, 255).astype(np.uint8)
        crops[i] = crop
    return torch.from_numpy(crops)


def photo_images(
    data_dir: str | None = None, crop_size: int = 32, train_crops: int = 25600, heldout_crops: int = 2000, seed: int = 0
) -> EvaluatorImages:
    """Random multi-scale crops of the training photographs, and of the two held-out photographs."""
    folder = Path(data_dir) if data_dir is not None else scikit_image_photo_dir()
    try:
        train = [read_photo(folder / name) for name in TRAIN_PHOTOS]
        heldout = [read_photo(folder / name) for name in HELDOUT_PHOTOS]
    except (DatasetNotFoundError, CorruptDatasetError) as err:
        raise TrainingImagesError(f"training {err}") from err
    description = (
        f"{train_crops} random {crop_size}x{crop_size} crops (several scales, horizontal flips, a random colour "
        f"cast on grey photos, seed {seed}) of "
        f"{len(TRAIN_PHOTOS)} public-domain / CC0 photographs bundled with scikit-image "
        f"({', '.join(TRAIN_PHOTOS)}); held out: {heldout_crops} crops of {', '.join(HELDOUT_PHOTOS)}. "
        "No client data (clients use Fashion-MNIST's training split, CIFAR or your own data)."
    )
    return EvaluatorImages(
        random_crops(train, train_crops, crop_size, seed),
        random_crops(heldout, heldout_crops, crop_size, seed + 1),
        description,
    )


def _as_uint8_images(array: np.ndarray, name: str) -> Tensor:
    if array.ndim != 4 or array.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty [N, C, H, W] array, got shape {array.shape}")
    if array.dtype == np.uint8:
        return torch.from_numpy(np.ascontiguousarray(array))
    if not np.issubdtype(array.dtype, np.floating):
        raise TypeError(f"{name} must be uint8 (0..255) or float pixels in [0, 1], got {array.dtype}")
    if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
        raise ValueError(f"{name} must hold float pixel values in [0, 1], got [{array.min():.4g}, {array.max():.4g}]")
    return torch.from_numpy(np.round(array * 255).astype(np.uint8))


def npz_images(path: str | Path) -> EvaluatorImages:
    """Your own images: an ``.npz`` with ``train_images`` and ``heldout_images`` ``[N, C, H, W]``."""
    path = Path(path)
    if not path.is_file():
        raise TrainingImagesError(f"images file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in ("train_images", "heldout_images") if k not in npz.files]
            if missing:
                raise ValueError(f"images file {path} lacks array(s) {missing}; it holds {npz.files}")
            train = _as_uint8_images(npz["train_images"], f"{path}: train_images")
            heldout = _as_uint8_images(npz["heldout_images"], f"{path}: heldout_images")
    except (OSError, EOFError) as err:
        raise ValueError(f"images file {path} is not a readable .npz ({err})") from err
    if train.shape[1:] != heldout.shape[1:]:
        raise ValueError(
            f"{path}: train_images {tuple(train.shape)} and heldout_images {tuple(heldout.shape)} must share C, H, W"
        )
    return EvaluatorImages(train, heldout, f"{len(train)} training and {len(heldout)} held-out images from {path.name}")


def evaluator_images(
    images: str,
    data_dir: str | None = None,
    crop_size: int = 32,
    train_crops: int = 25600,
    heldout_crops: int = 2000,
    seed: int = 0,
) -> EvaluatorImages:
    """The images named by ``images``: ``"fashion-mnist-test"``, ``"scikit-image-photos"`` or an ``.npz`` path."""
    if images == FASHION_MNIST_SOURCE:
        return fashion_mnist_images(data_dir)
    if images == PHOTOS_SOURCE:
        return photo_images(data_dir, crop_size, train_crops, heldout_crops, seed)
    if isinstance(images, str) and images.endswith(".npz"):
        return npz_images(images)
    raise ValueError(
        f"images must be {FASHION_MNIST_SOURCE!r}, {PHOTOS_SOURCE!r} or the path of an .npz file, got {images!r}"
    )


# --- mixing and evaluation --------------------------------------------------------------------


def to_pixels(images: Tensor) -> Tensor:
    """uint8 images as float32 pixels in [0, 1] (floating images are returned as float32)."""
    return images.float() / 255 if images.dtype == torch.uint8 else images.float()


def mix_with_noise(
    images: Tensor, ratios: Sequence[float] = NOISE_RATIOS, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Every image mixed once per ratio: ``(1 - r) x + r u``, u ~ U[0, 1] afresh (Sec. 3.3.2, App. D).

    Returns the mixes ``[len(ratios) * N, C, H, W]`` (ratio-major) and their ratios ``[len(ratios) * N]``.
    """
    pixels = to_pixels(images)
    ratio = torch.tensor(list(ratios), dtype=pixels.dtype, device=pixels.device)
    ratio = ratio.repeat_interleave(pixels.shape[0])
    noise = torch.rand(
        (ratio.numel(), *pixels.shape[1:]), generator=generator, dtype=pixels.dtype, device=pixels.device
    )
    clean = pixels.repeat(len(ratios), 1, 1, 1)
    r = ratio.view(-1, 1, 1, 1)
    return ((1 - r) * clean + r * noise).clamp(0, 1), ratio


@torch.no_grad()
def evaluate_noise_ratio(
    network: EvaluationNetwork,
    images: Tensor,
    ratios: Sequence[float] = NOISE_RATIOS,
    seed: int = 0,
    batch_size: int = 256,
) -> dict[float, dict[str, float]]:
    """Per ratio r: mean absolute error and mean of D's predicted r on mixes of ``images`` (seeded noise)."""
    generator = torch.Generator().manual_seed(seed)
    errors: dict[float, list[Tensor]] = {r: [] for r in ratios}
    predictions: dict[float, list[Tensor]] = {r: [] for r in ratios}
    device = next(network.parameters()).device
    for start in range(0, images.shape[0], batch_size):
        mixed, _ = mix_with_noise(images[start : start + batch_size], ratios, generator)
        predicted = network(mixed.to(device)).cpu()
        for r, chunk_pred in zip(ratios, predicted.chunk(len(ratios))):
            predictions[r].append(chunk_pred)
            errors[r].append((chunk_pred - r).abs())
    return {
        r: {
            "mae": float(torch.cat(errors[r]).double().mean()),
            "mean_prediction": float(torch.cat(predictions[r]).double().mean()),
        }
        for r in ratios
    }


# --- Lightning --------------------------------------------------------------------------------


class EvaluatorDataModule(L.LightningDataModule):
    """Clean images for the evaluation network: shuffled training batches and the held-out images."""

    def __init__(self, images: EvaluatorImages, batch_size: int = 128, seed: int = 0) -> None:
        super().__init__()
        self.images = images
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.seed = check_int(seed, "seed", low=0)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            TensorDataset(self.images.train), batch_size=self.batch_size, shuffle=True, generator=generator
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.images.heldout), batch_size=256, shuffle=False)


class EvaluatorTraining(L.LightningModule):
    """Trains an :class:`EvaluationNetwork` on noise mixes (App. D): BCE against the soft target r, Adam.

    Noise is drawn from a generator seeded with ``seed`` and the step (training) or the batch
    (validation: the same held-out mixes every epoch), so a run is reproducible.
    """

    def __init__(
        self,
        in_channels: int = 1,
        width: float = 0.125,
        lr: float = 1e-4,
        ratios: Sequence[float] = NOISE_RATIOS,
        seed: int = 0,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        self.network = EvaluationNetwork(in_channels=in_channels, width=width)
        self.lr = check_positive(lr, "lr")
        self.ratios = tuple(float(r) for r in ratios)
        if not self.ratios or any(not 0 <= r <= 1 for r in self.ratios):
            raise ValueError(f"ratios must be a non-empty list of noise ratios in [0, 1], got {list(ratios)}")
        self.seed = check_int(seed, "seed", low=0)
        self.verbose = verbose
        self.history: list[dict[str, float]] = []
        self._epoch_losses: list[float] = []
        self._val_errors: dict[float, list[Tensor]] = {}
        self._start = 0.0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.network.parameters(), lr=self.lr)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.global_step)
        mixed, target = mix_with_noise(batch[0], self.ratios, generator)
        # channels_last: CPU convolutions with few filters run ~1.4x faster (mixes are in range: no checks)
        logits = self.network.logits(mixed.contiguous(memory_format=torch.channels_last), check=False)
        loss = F.binary_cross_entropy_with_logits(logits, target)
        self._epoch_losses.append(float(loss.detach()))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_train_start(self) -> None:
        self._start = time.perf_counter()
        self.network.to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    def on_validation_epoch_start(self) -> None:
        self._val_errors = {r: [] for r in self.ratios}

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + 999_983 + batch_idx)
        mixed, _ = mix_with_noise(batch[0], self.ratios, generator)
        predicted = torch.sigmoid(self.network.logits(mixed.contiguous(memory_format=torch.channels_last)))
        for r, chunk in zip(self.ratios, predicted.chunk(len(self.ratios))):
            self._val_errors[r].append((chunk - r).abs())

    def on_validation_epoch_end(self) -> None:
        mae = {r: float(torch.cat(v).mean()) for r, v in self._val_errors.items() if v}
        if not mae or self.trainer.sanity_checking:
            return
        worst = max(mae.values())
        self.log("val_mae_worst", worst)
        loss = sum(self._epoch_losses) / len(self._epoch_losses) if self._epoch_losses else math.nan
        self.history.append(
            {"epoch": self.current_epoch, "train_loss": loss, "val_mae_mean": sum(mae.values()) / len(mae)}
            | {f"val_mae_{r:g}": v for r, v in mae.items()}
        )
        self._epoch_losses = []
        if self.verbose:
            per_r = " ".join(f"{r:g}:{v:.3f}" for r, v in mae.items())
            print(
                f"[evaluator] epoch {self.current_epoch + 1}/{self.trainer.max_epochs} train_loss {loss:.4f} "
                f"held-out MAE mean {self.history[-1]['val_mae_mean']:.4f} worst {worst:.4f} ({per_r}) "
                f"({time.perf_counter() - self._start:.0f}s)",
                flush=True,
            )


def train_evaluator(
    images: EvaluatorImages,
    *,
    width: float = 0.125,
    epochs: int = 20,
    batch_size: int = 128,
    lr: float = 1e-4,
    ratios: Sequence[float] = NOISE_RATIOS,
    seed: int = 0,
    output: str | Path | None = None,
    command: str = "",
    verbose: bool = True,
) -> dict[str, Any]:
    """Train an evaluation network on ``images`` (App. D recipe) and return its checkpoint dict.

    The dict (see :data:`~lightning_gp.refiner.evaluator.CHECKPOINT_KEYS`) holds the weights,
    the image size trained at, a sentence on the images (``trained_on``), ``command`` and the
    held-out MAE per ratio (``heldout_mae``), plus the per-epoch ``history``. It is written to
    ``output`` (``torch.save``) when given; :func:`~lightning_gp.refiner.evaluator.load_evaluator`
    reads it back.
    """
    check_positive_int(epochs, "epochs")
    L.seed_everything(seed, verbose=False)
    module = EvaluatorTraining(images.channels, width, lr, ratios, seed, verbose)
    datamodule = EvaluatorDataModule(images, batch_size, seed)
    seconds = _fit_deterministically(module, datamodule, epochs)
    network = module.network.eval().to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
    results = evaluate_noise_ratio(network, images.heldout, module.ratios, seed=seed + 12345)
    checkpoint: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "in_channels": images.channels,
        "width": float(width),
        "image_size": images.image_size,
        "state_dict": {k: v.detach().cpu().clone() for k, v in network.state_dict().items()},
        "trained_on": images.description,
        "command": command,
        "heldout_mae": {r: v["mae"] for r, v in results.items()},
        "heldout_mean_prediction": {r: v["mean_prediction"] for r, v in results.items()},
        "recipe": _recipe(epochs, batch_size, lr, module.ratios, seed),
        "train_images": int(images.train.shape[0]),
        "heldout_images": int(images.heldout.shape[0]),
        "train_seconds": seconds,
        "torch_version": str(torch.__version__),
        "history": module.history,
    }
    if output is not None:
        output = Path(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, output)
    return checkpoint


def _fit_deterministically(module: EvaluatorTraining, datamodule: EvaluatorDataModule, epochs: int) -> float:
    """Fit ``module`` for ``epochs`` on the CPU in a deterministic Trainer; the seconds it took.

    ``Trainer(deterministic=True)`` switches torch's deterministic mode on for the whole process:
    the mode and ``CUBLAS_WORKSPACE_CONFIG`` are restored afterwards.
    """
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas
    return time.perf_counter() - start


def _recipe(epochs: int, batch_size: int, lr: float, ratios: Sequence[float], seed: int) -> dict[str, Any]:
    """The checkpoint's training recipe (App. D): what a rerun needs to train the same network."""
    return {
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": float(lr),
        "ratios": list(ratios),
        "seed": seed,
        "loss": "binary cross-entropy against the soft target r",
        "optimizer": "Adam",
        "mixes_per_step": len(ratios),
    }
