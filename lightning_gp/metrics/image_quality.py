"""Per-image MSE, PSNR and SSIM between pixel images in [0, 1] (``[B, C, H, W]`` in, ``[B]`` out)."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics.functional.image import structural_similarity_index_measure

# Images in [0, 1] pass; normalised inputs (values far below 0 or above 1) are caught.
_RANGE_SLACK = 1e-3


def check_image_pair(x: Tensor, y: Tensor, *, names: tuple[str, str] = ("x", "y")) -> tuple[Tensor, Tensor]:
    """Both ``[B, C, H, W]`` floating tensors of one shape on one device; returned unchanged."""
    for name, t in zip(names, (x, y)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be a [B, C, H, W] batch of images, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor of pixel values in [0, 1], got {t.dtype}")
    if x.shape != y.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.device != y.device:
        raise ValueError(f"{names[0]} and {names[1]} must be on one device, got {x.device} and {y.device}")
    return x, y


def check_pixel_range(t: Tensor, name: str) -> None:
    """Raise if ``t`` is clearly not in [0, 1] (e.g. still normalised with the data mean/std)."""
    if t.numel() == 0:
        return
    low, high = float(t.min()), float(t.max())
    if low < -_RANGE_SLACK or high > 1 + _RANGE_SLACK or not torch.isfinite(t).all():
        raise ValueError(
            f"{name} must hold pixel values in [0, 1] (denormalise first, e.g. ServerView.denormalize), "
            f"got values in [{low:.4g}, {high:.4g}]"
        )


def mse(x: Tensor, y: Tensor) -> Tensor:
    """Mean squared error per image: ``mean((x - y)^2)`` over C, H, W."""
    check_image_pair(x, y)
    return (x - y).pow(2).flatten(1).mean(dim=1)


def psnr(x: Tensor, y: Tensor, data_range: float = 1.0) -> Tensor:
    """Peak signal-to-noise ratio per image in dB: ``10 log10(data_range^2 / MSE)``.

    Identical images have MSE 0 and PSNR ``+inf``; it is kept (not clipped), so a mean over
    images that contains a perfect reconstruction is ``inf`` too. Higher is less private.
    """
    if data_range <= 0:
        raise ValueError(f"data_range must be positive, got {data_range}")
    error = mse(x, y)
    return 10.0 * torch.log10(data_range**2 / error)


def ssim(x: Tensor, y: Tensor, data_range: float = 1.0) -> Tensor:
    """Structural similarity per image (Wang et al. 2004), via torchmetrics.

    torchmetrics' defaults: Gaussian window 11x11, sigma 1.5, K1 0.01, K2 0.03; the mean of the
    SSIM map per image (``reduction="none"``). 1 for identical images; higher is less private.
    """
    check_image_pair(x, y)
    if data_range <= 0:
        raise ValueError(f"data_range must be positive, got {data_range}")
    if min(x.shape[-2:]) < 11:
        raise ValueError(f"ssim needs images of at least 11x11 (its Gaussian window), got {tuple(x.shape[-2:])}")
    values = structural_similarity_index_measure(x, y, data_range=data_range, reduction="none")
    return values.reshape(x.shape[0])
