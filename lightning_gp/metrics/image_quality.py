"""Per-image MSE, PSNR and SSIM between pixel images (``[B, C, H, W]`` in, ``[B]`` out).

Pixels must be in [0, 1] (MSE) or [0, data_range] (PSNR, SSIM): a normalised or 8-bit image
given by mistake is refused (:func:`check_pixel_range`), never scored. The arithmetic is
torchmetrics' (``mean_squared_error``, ``peak_signal_noise_ratio``,
``structural_similarity_index_measure``), one value per image.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics.functional import mean_squared_error
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

from lightning_gp.validation import check_positive

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


def check_pixel_range(t: Tensor, name: str, data_range: float = 1.0, *, takes_data_range: bool = False) -> None:
    """Raise unless ``t`` holds finite pixel values in ``[0, data_range]`` (up to a rounding slack).

    Catches the quiet failures of an image metric: inputs still normalised with the data
    mean/std (values below 0 or above 1), 8-bit pixels (0..255) where [0, 1] is expected, NaN
    or inf. The slack, ``1e-3 * data_range`` either side, lets float rounding through.
    ``takes_data_range`` adds the hint to pass ``data_range=255`` (for metrics that have it).
    """
    if t.numel() == 0:
        return
    if not bool(torch.isfinite(t).all()):
        raise ValueError(
            f"{name} holds NaN or inf; it must hold finite pixel values in [0, {data_range:g}] "
            "(e.g. a diverged reconstruction)"
        )
    low, high = float(t.min()), float(t.max())
    slack = _RANGE_SLACK * data_range
    if low < -slack or high > data_range + slack:
        advice = "denormalise first, e.g. ServerView.denormalize"
        if takes_data_range:
            advice += "; for 8-bit pixels in [0, 255] pass data_range=255"
        raise ValueError(
            f"{name} must hold pixel values in [0, {data_range:g}] ({advice}), got values in [{low:.4g}, {high:.4g}]"
        )


def _check_pixels(x: Tensor, y: Tensor, data_range: float = 1.0, *, takes_data_range: bool = False) -> None:
    check_image_pair(x, y)
    check_pixel_range(x, "x", data_range, takes_data_range=takes_data_range)
    check_pixel_range(y, "y", data_range, takes_data_range=takes_data_range)


def mse(x: Tensor, y: Tensor) -> Tensor:
    """Mean squared error per image: ``mean((x - y)^2)`` over C, H, W, for pixel images in [0, 1].

    Computed by ``torchmetrics.functional.mean_squared_error`` with one output per image.
    """
    _check_pixels(x, y)
    return unchecked_mse(x, y)


def unchecked_mse(x: Tensor, y: Tensor) -> Tensor:
    """:func:`mse` without its checks, for a caller that checked the whole batch once (pairs by the chunk)."""
    batch = x.shape[0]
    # num_outputs=B: each column of the [C*H*W, B] views is one image (B == 1 gives a 0-dim value).
    values = mean_squared_error(x.flatten(1).T, y.flatten(1).T, num_outputs=batch)
    return values.reshape(batch)


def psnr(x: Tensor, y: Tensor, data_range: float = 1.0) -> Tensor:
    """Peak signal-to-noise ratio per image in dB: ``10 log10(data_range^2 / MSE)``, pixels in [0, data_range].

    Computed by ``torchmetrics.functional.image.peak_signal_noise_ratio`` over (C, H, W). Identical
    images have MSE 0 and PSNR ``+inf`` (torchmetrics does not clip it either), so a mean over
    images that contains a perfect reconstruction is ``inf`` too. Higher is less private.
    """
    data_range = check_positive(data_range, "data_range")
    _check_pixels(x, y, data_range, takes_data_range=True)
    return unchecked_psnr(x, y, data_range)


def unchecked_psnr(x: Tensor, y: Tensor, data_range: float = 1.0) -> Tensor:
    """:func:`psnr` without its checks, for a caller that checked the whole batch once (pairs by the chunk)."""
    # data_range as a float, not a (min, max) tuple: with a tuple torchmetrics clamps the inputs,
    # and PSNR would disagree with ``mse`` on values inside the rounding slack. torchmetrics
    # holds log(data_range) and 10/ln(10) as float32 scalars, so float64 inputs agree with the
    # float64 formula to ~1e-7 relative (float32 inputs: to float32 rounding).
    return peak_signal_noise_ratio(x, y, data_range=data_range, reduction="none", dim=(1, 2, 3))


def ssim(x: Tensor, y: Tensor, data_range: float = 1.0) -> Tensor:
    """Structural similarity per image (Wang et al. 2004) via torchmetrics, pixels in [0, data_range].

    torchmetrics' defaults: Gaussian window 11x11, sigma 1.5, K1 0.01, K2 0.03; the mean of the
    SSIM map per image (``reduction="none"``). 1 for identical images; higher is less private.
    """
    data_range = check_positive(data_range, "data_range")
    _check_pixels(x, y, data_range, takes_data_range=True)
    if min(x.shape[-2:]) < 11:
        raise ValueError(f"ssim needs images of at least 11x11 (its Gaussian window), got {tuple(x.shape[-2:])}")
    values = structural_similarity_index_measure(x, y, data_range=data_range, reduction="none")
    assert isinstance(values, Tensor)  # a tuple only with return_full_image / return_contrast_sensitivity
    return values.reshape(x.shape[0])


def check_pair_batches(reconstructed: Tensor, original: Tensor) -> None:
    """``reconstructed`` and ``original`` are ``[B, C, H, W]`` batches of one image shape (their sizes may
    differ): what every all-pairs score takes."""
    if reconstructed.ndim != 4 or original.ndim != 4 or reconstructed.shape[1:] != original.shape[1:]:
        raise ValueError(
            "reconstructed and original must be [B, C, H, W] batches of one image shape, got "
            f"{tuple(reconstructed.shape)} and {tuple(original.shape)}"
        )


def pair_indices(n_orig: int, n_rec: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """``(rows, cols)``, each ``[n_orig * n_rec]``: every (original, reconstruction) pair, original-major, so
    values computed pair by pair ``.view(n_orig, n_rec)`` into an all-pairs table."""
    rows = torch.arange(n_orig, device=device).repeat_interleave(n_rec)
    cols = torch.arange(n_rec, device=device).repeat(n_orig)
    return rows, cols


def _band(window: Tensor, size: int) -> Tensor:
    """``[size, size + len(window) - 1]``: row ``i`` holds ``window`` from column ``i``, so that
    ``band @ v`` is the valid 1-D filtering of a padded ``v`` by ``window``."""
    band = torch.zeros(size, size + window.numel() - 1, dtype=window.dtype, device=window.device)
    for i in range(size):
        band[i, i : i + window.numel()] = window
    return band


def ssim_pairwise(reconstructed: Tensor, original: Tensor, chunk: int = 512) -> Tensor:
    """``[B_orig, B_rec]``: :func:`ssim` of every reconstruction against every original (pixels in [0, 1]).

    The same computation as torchmetrics' (reflect padding, the 11x11 Gaussian window of sigma 1.5,
    K1 0.01, K2 0.03, the mean of the SSIM map), arranged for pairs: each image's local means and
    second moments are filtered once, and each pair only its cross moment (one filtering a pair, not
    five). The window is separable (the outer product of two 1-D Gaussians), so each filtering is two
    matrix products with a banded matrix, several times faster on a CPU than the 11x11 convolution.
    Equal to :func:`ssim` pair by pair up to float rounding.
    """
    from torchmetrics.functional.image.utils import _gaussian

    check_pair_batches(reconstructed, original)
    check_pixel_range(reconstructed, "reconstructed")
    check_pixel_range(original, "original")
    if min(original.shape[-2:]) < 11:
        raise ValueError(f"ssim needs images of at least 11x11 (its Gaussian window), got {tuple(original.shape[-2:])}")
    dtype = original.dtype
    size = int(3.5 * 1.5 + 0.5) * 2 + 1
    pad = (size - 1) // 2
    window = _gaussian(size, 1.5, dtype, original.device)[0]
    height, width = original.shape[-2:]
    rows_band, cols_band = _band(window, height), _band(window, width)
    c1, c2 = 0.01**2, 0.03**2

    def filtered(images: Tensor) -> Tensor:  # the valid 2-D filtering of each channel by the window
        return rows_band @ images @ cols_band.T

    x = torch.nn.functional.pad(reconstructed.to(dtype), (pad, pad, pad, pad), mode="reflect")
    y = torch.nn.functional.pad(original, (pad, pad, pad, pad), mode="reflect")
    mu_x, xx = filtered(x), filtered(x * x)
    mu_y, yy = filtered(y), filtered(y * y)
    sigma_x = torch.clamp(xx - mu_x.pow(2), min=0.0)
    sigma_y = torch.clamp(yy - mu_y.pow(2), min=0.0)
    rows, cols = pair_indices(original.shape[0], reconstructed.shape[0])
    values = []
    for start in range(0, rows.numel(), chunk):
        r, c = rows[start : start + chunk], cols[start : start + chunk]
        mu_xy = mu_x[c] * mu_y[r]
        upper = 2 * (filtered(x[c] * y[r]) - mu_xy) + c2
        lower = sigma_x[c] + sigma_y[r] + c2
        full = ((2 * mu_xy + c1) * upper) / ((mu_x[c].pow(2) + mu_y[r].pow(2) + c1) * lower)
        values.append(full.reshape(full.shape[0], -1).mean(-1))
    return torch.cat(values).view(original.shape[0], reconstructed.shape[0])
