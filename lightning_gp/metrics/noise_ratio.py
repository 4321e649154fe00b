"""Refiner's noise ratio of a reconstruction: the evaluation network's score (Sec. 3.3, Sec. 5, App. N).

The evaluation network D (:mod:`lightning_gp.refiner.evaluator`) predicts the ratio r of a mix
``(1 - r) x + r u`` of a natural image with uniform noise: about 0 for a clean picture, 1 for
pure noise. Higher is more private: Refiner counts a reconstruction with ratio < 0.4 as still
showing the private image (App. N). Unlike PSNR/SSIM/LPIPS it needs no original: it scores
each image alone. By default the shipped network for the images' channel count is used (1 or
3 channels; others raise :class:`~lightning_gp.refiner.evaluator.EvaluatorUnavailableError`).
"""

from __future__ import annotations

import functools

from torch import Tensor, nn

from lightning_gp.metrics.image_quality import check_pixel_range
from lightning_gp.validation import check_positive


@functools.lru_cache(maxsize=8)
def shipped_evaluator(channels: int, device: str = "cpu") -> nn.Module:
    """The shipped evaluation network for ``channels`` on ``device``, loaded once per process."""
    from lightning_gp.refiner.evaluator import load_evaluator

    return load_evaluator(channels, map_location=device)


def noise_ratio(images: Tensor, *, evaluator: nn.Module | None = None, data_range: float = 1.0) -> Tensor:
    """The evaluation network's predicted noise ratio ``[N]`` of each image (higher is more private).

    Args:
        images: ``[N, C, H, W]`` pixel images in [0, ``data_range``] (normalised or NaN/inf
            images are refused); any size (the network pools globally).
        evaluator: the network to use (pixels in [0, 1] -> ``[N]``); default: the shipped one
            for ``C`` channels (:func:`~lightning_gp.refiner.evaluator.load_evaluator`).
        data_range: the images' pixel scale (255 for 8-bit values held as floats).
    """
    data_range = check_positive(data_range, "data_range")
    if not isinstance(images, Tensor):
        raise TypeError(f"images must be a torch.Tensor, got {type(images).__name__}")
    if images.ndim != 4:
        raise ValueError(f"images must be a [N, C, H, W] batch of images, got shape {tuple(images.shape)}")
    if not images.is_floating_point():
        raise TypeError(f"images must be a floating tensor of pixel values in [0, {data_range:g}], got {images.dtype}")
    check_pixel_range(images.detach(), "images", data_range, takes_data_range=True)
    if evaluator is None:
        evaluator = shipped_evaluator(int(images.shape[1]), str(images.device))
    elif not isinstance(evaluator, nn.Module):
        raise TypeError(f"evaluator must be an nn.Module (an EvaluationNetwork), got {type(evaluator).__name__}")
    pixels = (images / data_range).clamp(0, 1)
    if images.shape[0] == 0:
        return images.new_zeros(0)
    values = evaluator(pixels)
    if not isinstance(values, Tensor) or tuple(values.shape) != (images.shape[0],):
        raise ValueError(
            f"evaluator must return one noise ratio per image (shape ({images.shape[0]},)), got "
            f"{getattr(values, 'shape', type(values).__name__)}"
        )
    return values.to(images.dtype) if values.dtype != images.dtype else values
