"""Refiner's evaluation network D: the predicted noise ratio r of an image (Sec. 3.3, App. C, App. D).

D is trained to regress r on mixes ``(1 - r) x + r u`` of a natural image x with uniform noise
u ~ U[0, 1] (Sec. 3.3.2), so D(x*) scores how much of x* is noise: 0 for a natural image, 1 for
pure noise. Refiner maximises it as its privacy metric PM (Eq. 2), and it scores reconstructions
(App. N: a reconstruction with ratio < 0.4 still shows the private image).

Architecture (App. D): three 3x3 convolutions with stride 2 and padding 1, each followed by ReLU,
with 128, 256 and 512 filters; a linear layer; a sigmoid. What we changed:

* global average pooling before the linear layer, so one network scores any image size (the
  paper does not say how its convolutional features reach the linear layer);
* ``width``: the filter counts are scaled by it (``width=0.125`` gives 16/32/64), so D costs
  about one LeNet step on a CPU; the shipped checkpoints use a reduced width;
* the loss: binary cross-entropy against the soft target r (the paper names no loss for its
  regression; Eq. 5 is the JS-divergence objective it motivates D with).

The shipped checkpoints (1 channel, trained on 28x28 Fashion-MNIST test images; 3 channels,
trained on 32x32 crops of public-domain photographs) live in ``lightning_gp/refiner/checkpoints``
(see its README); :func:`load_evaluator` loads them, or a file written by
``lightning-gp refiner train-evaluator``. Nothing here ever falls back to random weights.
"""

from __future__ import annotations

import pickle
import zipfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.validation import check_positive, check_positive_int

#: ``format`` value of a checkpoint file written by :func:`lightning_gp.refiner.training.train_evaluator`.
CHECKPOINT_FORMAT = "lightning_gp.EvaluationNetwork/1"
#: Keys every checkpoint dict holds.
CHECKPOINT_KEYS = (
    "format",
    "in_channels",
    "width",
    "image_size",
    "state_dict",
    "trained_on",
    "command",
    "heldout_mae",
)
#: Shipped checkpoint file per channel count, inside the package ``lightning_gp.refiner.checkpoints``.
SHIPPED_CHECKPOINTS: dict[int, str] = {1: "evaluator_1ch.pt", 3: "evaluator_3ch.pt"}
CHECKPOINT_PACKAGE = "lightning_gp.refiner.checkpoints"
#: The paper's filter counts (App. D), scaled by ``width``.
BASE_FILTERS = (128, 256, 512)
# Pixels in [0, 1] pass; normalised inputs (far below 0 or above 1) are caught.
_RANGE_SLACK = 1e-3


class EvaluatorUnavailableError(ValueError):
    """No shipped evaluation network exists for the requested channel count."""


def filters_for(width: float) -> tuple[int, int, int]:
    """The three convolutions' filter counts for ``width`` (at least 1 each)."""
    width = check_positive(width, "width")
    first, second, third = (max(1, round(f * width)) for f in BASE_FILTERS)
    return first, second, third


class EvaluationNetwork(nn.Module):
    """Refiner's evaluation network D (App. D, with global average pooling and a ``width`` factor).

    ``forward`` takes pixel images in [0, 1], ``[N, C, H, W]`` with ``C == in_channels`` (any
    H, W), and returns the predicted noise ratio ``[N]`` in (0, 1); :meth:`logits` returns the
    pre-sigmoid scores (used by the BCE training loss).

    Args:
        in_channels: image channels (1 grey, 3 RGB).
        width: factor on the paper's 128/256/512 filters (> 0; 0.125 gives 16/32/64).
    """

    def __init__(self, in_channels: int = 3, width: float = 1.0) -> None:
        super().__init__()
        self.in_channels = check_positive_int(in_channels, "in_channels")
        self.width = check_positive(width, "width")
        layers: list[nn.Module] = []
        previous = in_channels
        for filters in filters_for(self.width):
            layers += [nn.Conv2d(previous, filters, kernel_size=3, stride=2, padding=1), nn.ReLU()]
            previous = filters
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(previous, 1)
        #: Metadata of the checkpoint it was loaded from (see :func:`load_evaluator`); empty otherwise.
        self.checkpoint_info: dict[str, Any] = {}

    def check_images(self, images: Tensor, name: str = "images") -> None:
        """Raise unless ``images`` is a finite floating ``[N, in_channels, H, W]`` batch in [0, 1]."""
        if not isinstance(images, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of pixel images, got {type(images).__name__}")
        if images.ndim != 4:
            raise ValueError(f"{name} must be a [N, C, H, W] batch of images, got shape {tuple(images.shape)}")
        if images.shape[1] != self.in_channels:
            raise ValueError(
                f"{name} has {images.shape[1]} channel(s) but this evaluation network takes {self.in_channels} "
                f"(shape {tuple(images.shape)}); load the network for {images.shape[1]} channel(s)"
            )
        if not images.is_floating_point():
            raise TypeError(
                f"{name} must be a floating tensor of pixel values in [0, 1], got {images.dtype} "
                "(divide 8-bit images by 255)"
            )
        if images.numel() == 0:
            return
        values = images.detach()
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"{name} holds NaN or inf; the evaluation network needs finite pixel values in [0, 1]")
        low, high = float(values.min()), float(values.max())
        if low < -_RANGE_SLACK or high > 1 + _RANGE_SLACK:
            raise ValueError(
                f"{name} must hold pixel values in [0, 1] (normalised images must be denormalised first, "
                f"e.g. ServerView.denormalize), got values in [{low:.4g}, {high:.4g}]"
            )

    def logits(self, images: Tensor, *, check: bool = True) -> Tensor:
        """Pre-sigmoid scores ``[N]`` of pixel images in [0, 1] (checked as in :meth:`forward`).

        ``check=False`` skips the input checks (for the training loop, whose mixes are in range
        by construction).
        """
        if check:
            self.check_images(images)
        weight = self.head.weight
        features = self.features(images.to(dtype=weight.dtype, device=weight.device))
        return self.head(features.mean(dim=(2, 3))).squeeze(1)

    def forward(self, images: Tensor) -> Tensor:
        """Predicted noise ratio r ``[N]`` of pixel images ``[N, C, H, W]`` in [0, 1]."""
        return torch.sigmoid(self.logits(images))

    def extra_repr(self) -> str:
        return f"in_channels={self.in_channels}, width={self.width:g}"


def shipped_checkpoint(channels: int) -> Any:
    """The packaged checkpoint file (an ``importlib.resources`` traversable) for ``channels``."""
    check_positive_int(channels, "channels")
    if channels not in SHIPPED_CHECKPOINTS:
        raise EvaluatorUnavailableError(
            f"no shipped evaluation network for {channels}-channel images (shipped: "
            f"{', '.join(map(str, sorted(SHIPPED_CHECKPOINTS)))} channel(s)); train one with "
            "`lightning-gp refiner train-evaluator` and pass its file as path="
        )
    return resources.files(CHECKPOINT_PACKAGE).joinpath(SHIPPED_CHECKPOINTS[channels])


def _read_checkpoint(source: Any, where: str, map_location: Any) -> Any:
    try:
        with source.open("rb") as handle:
            if not zipfile.is_zipfile(handle):  # torch.save writes a zip archive
                raise ValueError(
                    f"evaluation network checkpoint {where} is not a readable torch.save file (not a zip archive; "
                    f"expected format {CHECKPOINT_FORMAT!r})"
                )
            handle.seek(0)
            return torch.load(handle, map_location=map_location, weights_only=True)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"evaluation network checkpoint {where} does not exist") from err
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"evaluation network checkpoint {where} holds objects that weights_only loading refuses "
            f"(expected a plain dict of tensors and numbers, format {CHECKPOINT_FORMAT!r}): {err}"
        ) from err
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as err:
        raise ValueError(
            f"evaluation network checkpoint {where} is not a readable torch.save file "
            f"(expected format {CHECKPOINT_FORMAT!r}): {err}"
        ) from err


def check_checkpoint(checkpoint: Any, where: str) -> dict[str, Any]:
    """``checkpoint`` if it is an evaluation network checkpoint dict, else a ``ValueError`` naming ``where``."""
    if not isinstance(checkpoint, dict):
        raise ValueError(
            f"evaluation network checkpoint {where} holds a {type(checkpoint).__name__}, expected a dict with "
            f"format {CHECKPOINT_FORMAT!r}"
        )
    if checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"evaluation network checkpoint {where} has format {checkpoint.get('format')!r}, "
            f"expected {CHECKPOINT_FORMAT!r}"
        )
    missing = [key for key in CHECKPOINT_KEYS if key not in checkpoint]
    if missing:
        raise ValueError(f"evaluation network checkpoint {where} lacks key(s) {missing}")
    if not isinstance(checkpoint["state_dict"], dict):
        raise ValueError(f"evaluation network checkpoint {where}: state_dict must be a dict of tensors")
    return checkpoint


def load_evaluator(channels: int, *, path: str | Path | None = None, map_location: Any = "cpu") -> EvaluationNetwork:
    """The trained evaluation network for ``channels``-channel images, frozen and in eval mode.

    Loads the shipped checkpoint (1 or 3 channels) or the file ``path`` (written by
    ``lightning-gp refiner train-evaluator``) with ``torch.load(weights_only=True)``. A missing,
    unreadable or malformed file, or one for another channel count, is an error naming the path:
    never a network with random weights. ``checkpoint_info`` on the returned network holds the
    file's metadata (``trained_on``, ``command``, ``heldout_mae``, ``image_size``).
    """
    check_positive_int(channels, "channels")
    if path is None:
        source = shipped_checkpoint(channels)
        where = f"{source} (shipped with lightning_gp)"
    else:
        if not isinstance(path, (str, Path)):
            raise TypeError(f"path must be a str or pathlib.Path, got {type(path).__name__}")
        source = Path(path)
        where = str(source)
        if not source.is_file():
            raise FileNotFoundError(f"evaluation network checkpoint {where} does not exist (path={str(path)!r})")
    checkpoint = check_checkpoint(_read_checkpoint(source, where, map_location), where)
    in_channels, width = checkpoint["in_channels"], checkpoint["width"]
    if in_channels != channels:
        raise ValueError(
            f"evaluation network checkpoint {where} is for {in_channels}-channel images, expected {channels}"
        )
    try:
        network = EvaluationNetwork(in_channels=in_channels, width=width)
        network.load_state_dict(checkpoint["state_dict"])
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"evaluation network checkpoint {where} does not fit EvaluationNetwork(in_channels={in_channels!r}, "
            f"width={width!r}): {err}"
        ) from err
    if isinstance(map_location, (str, torch.device)):
        network.to(map_location)
    network.eval()
    network.requires_grad_(False)
    network.checkpoint_info = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    return network
