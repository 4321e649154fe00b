"""In-memory image dataset, the labelled subset used for hold-outs, and the per-item scaling."""

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils.data import Dataset, Subset

from lightning_gp.normalization import channel_tensor, per_channel


def channel_stats(values: Sequence[float], channels: int, name: str) -> Tensor:
    """Per-channel ``mean``/``std`` values (exactly one per channel) as a float32 ``[C, 1, 1]`` tensor."""
    return channel_tensor(per_channel(values, channels, name, broadcast=False, positive=name == "std"))


def scale_image(image: Tensor, mean: Tensor | None, std: Tensor | None) -> Tensor:
    """uint8 -> float32 in [0, 1] (float images are taken as already in [0, 1]), then ``(x - mean) / std``."""
    x = image.to(torch.float32) / 255.0 if image.dtype == torch.uint8 else image.to(torch.float32)
    if mean is not None and std is not None:
        x = (x - mean) / std  # out of place: never writes into the stored image
    return x


class ImageTensorDataset(Dataset):
    """Images held in memory, converted to float (and normalised) one item at a time.

    Args:
        images: ``[N, C, H, W]`` uint8 (0-255, kept as uint8 to save memory) or float in [0, 1].
        targets: ``[N]`` integer labels, exposed as the int64 tensor ``targets``.
        mean: Per-channel mean used when ``normalize`` is true.
        std: Per-channel standard deviation used when ``normalize`` is true.
        normalize: Return ``(x - mean) / std`` instead of ``x`` in [0, 1].
    """

    def __init__(
        self,
        images: Tensor,
        targets: Tensor,
        mean: Sequence[float],
        std: Sequence[float],
        normalize: bool = True,
    ) -> None:
        if images.ndim != 4:
            raise ValueError(f"images must be [N, C, H, W], got shape {tuple(images.shape)}")
        targets = torch.as_tensor(targets).to(torch.int64)
        if targets.shape != (images.shape[0],):
            raise ValueError(f"targets must be [N={images.shape[0]}], got shape {tuple(targets.shape)}")
        if not (images.dtype == torch.uint8 or images.is_floating_point()):
            raise ValueError(f"images must be uint8 or floating point, got {images.dtype}")
        channels = images.shape[1]
        self.images = images
        self.targets = targets
        self.normalize = normalize
        self._mean = channel_stats(mean, channels, "mean") if normalize else None
        self._std = channel_stats(std, channels, "std") if normalize else None

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return scale_image(self.images[index], self._mean, self._std), self.targets[index]


class TargetSubset(Subset):
    """A :class:`~torch.utils.data.Subset` that keeps the ``targets`` of its items, in subset order."""

    def __init__(self, dataset: Dataset, indices: Sequence[int]) -> None:
        super().__init__(dataset, list(indices))
        self.targets = torch.as_tensor(cast(Any, dataset).targets)[torch.as_tensor(self.indices, dtype=torch.long)]
