"""Image classification from a folder tree of image files, one sub-folder per class."""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_gp.data.base import (
    CorruptDatasetError,
    DatasetNotFoundError,
    ImageClassificationDataModule,
    split_indices,
)
from lightning_gp.data.datasets import channel_stats, scale_image
from lightning_gp.data.readers import IMAGE_EXTENSIONS, list_images, read_image
from lightning_gp.validation import check_number, check_positive_int

_TEST_DIRS = ("test", "val")


class ImageFileDataset(Dataset):
    """Image files decoded, resized and normalised on access; ``targets`` holds all labels."""

    def __init__(
        self,
        paths: Sequence[Path],
        targets: Sequence[int],
        image_size: int,
        grayscale: bool,
        mean: Sequence[float],
        std: Sequence[float],
        normalize: bool = True,
    ) -> None:
        if len(paths) != len(targets):
            raise ValueError(f"{len(paths)} paths but {len(targets)} targets")
        channels = 1 if grayscale else 3
        self.paths = list(paths)
        self.targets = torch.as_tensor(list(targets), dtype=torch.int64)
        self.image_size = image_size
        self.grayscale = grayscale
        self._mean = channel_stats(mean, channels, "mean") if normalize else None
        self._std = channel_stats(std, channels, "std") if normalize else None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image = torch.from_numpy(read_image(self.paths[index], self.image_size, self.grayscale))
        return scale_image(image, self._mean, self._std), self.targets[index]


def _class_folders(folder: Path) -> tuple[str, ...]:
    """Sorted names of the non-hidden sub-folders of ``folder``."""
    return tuple(sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")))


@dataclass(frozen=True)
class _Layout:
    classes: tuple[str, ...]
    train: tuple[tuple[Path, int], ...]
    test: tuple[tuple[Path, int], ...]


class ImageFolderDataModule(ImageClassificationDataModule):
    """Images in class folders: ``root/train/<class>/*`` and ``root/test/<class>/*`` (or ``root/val/``).

    Without a ``train`` folder, ``root/<class>/*`` is the whole pool and a seeded, random
    ``test_fraction`` of it becomes the test split (likewise when ``root/train`` has no ``test``/``val``
    sibling). Classes are the sub-folder names of the training folder, sorted, mapped to 0..K-1;
    images are found recursively (hidden files skipped), converted to grey or RGB and resized to
    ``image_size`` x ``image_size`` (bilinear, aspect ratio not kept).

    Normalisation: ``mean``/``std`` default to 0.5 per channel (so images land in [-1, 1]). With
    ``compute_stats=True`` they are computed instead over the training pool (before any
    ``val_fraction`` hold-out) during :meth:`setup`, which reads every training image once.

    Args:
        root: The dataset folder.
        image_size: Side of the square images produced.
        grayscale: Produce 1-channel images instead of RGB.
        test_fraction: Share of the pool used as test split when there is no test/val folder.
        mean: Per-channel means (1 or 3 values); None means 0.5.
        std: Per-channel standard deviations; None means 0.5.
        compute_stats: Compute ``mean``/``std`` from the training images (overrides ``mean``/``std``).
        batch_size: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        num_workers: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        val_fraction: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        normalize: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        seed: Seeds the test split, the validation hold-out and the shuffling.
    """

    def __init__(
        self,
        root: str,
        image_size: int = 32,
        grayscale: bool = False,
        test_fraction: float = 0.2,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        compute_stats: bool = False,
        batch_size: int = 64,
        num_workers: int = 0,
        val_fraction: float = 0.0,
        normalize: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(
            batch_size=batch_size, num_workers=num_workers, val_fraction=val_fraction, normalize=normalize, seed=seed
        )
        channels = 1 if grayscale else 3
        self.root = str(root)
        self.image_size = check_positive_int(image_size, "image_size")
        self.grayscale = grayscale
        self.test_fraction = check_number(
            test_fraction, "test_fraction", low=0.0, high=1.0, low_open=True, high_open=True
        )
        self.compute_stats = compute_stats
        self.image_shape = (channels, image_size, image_size)
        self.mean = tuple(mean) if mean is not None else (0.5,) * channels
        self.std = tuple(std) if std is not None else (0.5,) * channels
        channel_stats(self.mean, channels, "mean")  # fail at construction, not at setup
        channel_stats(self.std, channels, "std")

    @property
    def classes(self) -> tuple[str, ...]:  # type: ignore[override]  # read from the folders, not set
        """Class names (sorted folder names); index i is label i."""
        return self._layout.classes

    @property
    def num_classes(self) -> int:  # type: ignore[override]
        return len(self._layout.classes)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.classes)}

    @cached_property
    def _layout(self) -> _Layout:
        root = Path(self.root).expanduser()
        expected = (
            f"expected {root}/train/<class>/<image> with {root}/test/<class>/<image> (or val/), "
            f"or {root}/<class>/<image>; image types: {', '.join(sorted(IMAGE_EXTENSIONS))}"
        )
        if not root.is_dir():
            raise DatasetNotFoundError(f"image folder {root} does not exist; {expected}")
        train_dir = root / "train" if (root / "train").is_dir() else root
        test_dir = next((root / d for d in _TEST_DIRS if train_dir != root and (root / d).is_dir()), None)
        classes = _class_folders(train_dir)
        train = self._samples(train_dir, classes)
        if not train:
            raise DatasetNotFoundError(f"no class folders with images in {train_dir}; {expected}")
        if test_dir is not None:
            unknown = sorted(set(_class_folders(test_dir)) - set(classes))
            if unknown:
                raise CorruptDatasetError(
                    f"{test_dir}: class folders {unknown} are not among the training classes {list(classes)}"
                )
            return _Layout(classes, train, self._samples(test_dir, classes))
        kept, held = split_indices(len(train), self.test_fraction, self.seed)
        return _Layout(classes, tuple(train[i] for i in kept), tuple(train[i] for i in held))

    @staticmethod
    def _samples(folder: Path, classes: tuple[str, ...]) -> tuple[tuple[Path, int], ...]:
        return tuple((path, label) for label, name in enumerate(classes) for path in list_images(folder / name))

    def _file_dataset(self, samples: tuple[tuple[Path, int], ...]) -> ImageFileDataset:
        paths, targets = zip(*samples) if samples else ((), ())
        return ImageFileDataset(paths, targets, self.image_size, self.grayscale, self.mean, self.std, self.normalize)

    def load_splits(self) -> tuple[Dataset, Dataset]:
        layout = self._layout
        if self.compute_stats:
            self.mean, self.std = self._pixel_stats([path for path, _ in layout.train])
        return self._file_dataset(layout.train), self._file_dataset(layout.test)

    def _pixel_stats(self, paths: list[Path]) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-channel mean and std of the pixels (scaled to [0, 1]) of the given images."""
        channels = self.image_shape[0]
        total, total_sq, count = np.zeros(channels), np.zeros(channels), 0
        for path in paths:
            pixels = read_image(path, self.image_size, self.grayscale).reshape(channels, -1) / 255.0
            total += pixels.sum(axis=1)
            total_sq += (pixels**2).sum(axis=1)
            count += pixels.shape[1]
        mean = total / count
        std = np.sqrt(np.maximum(total_sq / count - mean**2, 0.0))
        return tuple(mean.tolist()), tuple(np.maximum(std, 1e-6).tolist())
