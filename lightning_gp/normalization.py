"""Per-channel ``mean``/``std`` normalisation of image inputs, in one place.

Models see normalised inputs ``(x - mean) / std`` with pixels ``x`` in [0, 1]; attacks need the
box of valid normalised values, and metrics need pixels back. Datasets, the server's view of a
round, Robbing the Fed's bins and the reconstruction report all use these helpers, so the
channel axis, the broadcasting rule and the checks are the same everywhere.

Shapes: a sample has ``sample_ndim`` dimensions (3 for ``[C, H, W]``) and its first one is the
channel axis; a tensor of samples may have any leading batch dimensions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gp.validation import is_number


def per_channel(
    values: Sequence[float] | float, channels: int, name: str, *, broadcast: bool = True, positive: bool = False
) -> tuple[float, ...]:
    """``values`` as one float per channel.

    Args:
        values: a sequence with one value per channel (or a single value, see ``broadcast``).
        channels: the number of channels.
        name: the argument's name, for errors (e.g. ``"mean"``).
        broadcast: let a single value stand for every channel.
        positive: require every value ``> 0`` (a standard deviation).
    """
    if is_number(values):
        values = (values,)  # type: ignore[assignment]
    try:
        floats = tuple(float(v) for v in values)  # type: ignore[union-attr]
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be a sequence of numbers, one per channel, got {values!r}") from err
    if broadcast and len(floats) == 1 and channels > 1:
        floats = floats * channels
    if len(floats) != channels:
        raise ValueError(f"{name} needs one value per channel ({channels}), got {floats}")
    if not all(torch.isfinite(torch.tensor(floats, dtype=torch.float64))):
        raise ValueError(f"{name} must be finite, got {floats}")
    if positive and min(floats) <= 0:
        raise ValueError(f"{name} must be positive, got {floats}")
    return floats


def channel_tensor(
    values: Sequence[float],
    *,
    sample_ndim: int = 3,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """``values`` shaped ``[C, 1, ..., 1]`` (``sample_ndim`` dims) to broadcast over samples."""
    return torch.tensor(tuple(values), dtype=dtype, device=device).view(-1, *([1] * (sample_ndim - 1)))


def normalize(pixels: Tensor, mean: Sequence[float], std: Sequence[float], *, sample_ndim: int = 3) -> Tensor:
    """Pixels in [0, 1] to model inputs ``(x - mean) / std`` (out of place)."""
    m = channel_tensor(mean, sample_ndim=sample_ndim, dtype=pixels.dtype, device=pixels.device)
    s = channel_tensor(std, sample_ndim=sample_ndim, dtype=pixels.dtype, device=pixels.device)
    return (pixels - m) / s


def denormalize(
    inputs: Tensor, mean: Sequence[float], std: Sequence[float], *, sample_ndim: int = 3, clamp: bool = True
) -> Tensor:
    """Model inputs back to pixels ``x * std + mean``, clamped to [0, 1] unless ``clamp=False``."""
    m = channel_tensor(mean, sample_ndim=sample_ndim, dtype=inputs.dtype, device=inputs.device)
    s = channel_tensor(std, sample_ndim=sample_ndim, dtype=inputs.dtype, device=inputs.device)
    pixels = inputs * s + m
    return pixels.clamp(0, 1) if clamp else pixels


def input_bounds(
    mean: Sequence[float],
    std: Sequence[float],
    *,
    sample_ndim: int = 3,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """The smallest and largest valid normalised input of each channel (pixels 0 and 1),
    shaped ``[C, 1, ..., 1]``."""
    m = channel_tensor(mean, sample_ndim=sample_ndim, dtype=dtype, device=device)
    s = channel_tensor(std, sample_ndim=sample_ndim, dtype=dtype, device=device)
    return (0 - m) / s, (1 - m) / s
