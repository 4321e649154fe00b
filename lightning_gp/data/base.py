"""The base datamodule shared by every image-classification dataset, and the data errors."""

from collections.abc import Sequence, Sized
from typing import cast

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_gp.data.datasets import ImageTensorDataset, TargetSubset
from lightning_gp.validation import check_int, check_number, check_positive_int


class DatasetNotFoundError(FileNotFoundError):
    """The dataset directory or some of its files are missing."""


class CorruptDatasetError(ValueError):
    """A dataset file exists but cannot be decoded (bad header, wrong size, wrong keys...)."""


def split_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split ``range(n)`` into (kept, held out) with ``round(n * fraction)`` held out (at least one).

    The split is a seeded random permutation; both index lists are returned sorted so that the
    subsets keep the order of the underlying dataset.
    """
    n_held = max(1, round(n * fraction))
    if n_held >= n:
        raise ValueError(f"holding out a fraction {fraction} of {n} items leaves nothing to train on")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return sorted(perm[n_held:].tolist()), sorted(perm[:n_held].tolist())


class ImageClassificationDataModule(L.LightningDataModule):
    """Base of all datamodules: train/val/test splits of ``(image [C,H,W] float32, label int64)``.

    Subclasses set ``num_classes``, ``image_shape`` (C, H, W), ``mean`` and ``std`` (per channel) and
    implement :meth:`load_splits`, returning the official (train, test) datasets. Images are scaled
    to [0, 1] and, with ``normalize=True``, standardised as ``(x - mean) / std``.

    Args:
        batch_size: Samples per batch for every dataloader.
        num_workers: DataLoader worker processes (0 loads in the main process).
        val_fraction: 0 makes the validation set *the test split* (no hold-out); a value in (0, 1)
            holds out that fraction of the training split, chosen at random with ``seed``.
        normalize: Standardise images with the dataset's per-channel ``mean``/``std``.
        seed: Seeds the validation hold-out and the training-set shuffling.
    """

    num_classes: int
    image_shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    #: Class names in label order where known, else None.
    classes: tuple[str, ...] | None = None

    def __init__(
        self,
        batch_size: int = 64,
        num_workers: int = 0,
        val_fraction: float = 0.0,
        normalize: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.num_workers = check_int(num_workers, "num_workers", low=0)
        self.val_fraction = check_number(val_fraction, "val_fraction", low=0.0, high=1.0, high_open=True)
        self.normalize = normalize
        self.seed = seed
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None

    def load_splits(self) -> tuple[Dataset, Dataset]:
        """Return the (train, test) datasets; each must have a ``targets`` attribute."""
        raise NotImplementedError

    def tensor_dataset(self, images: np.ndarray, labels: np.ndarray | Sequence[int]) -> ImageTensorDataset:
        """Wrap decoded uint8 images [N, C, H, W] and labels with this module's normalisation."""
        return ImageTensorDataset(
            torch.from_numpy(np.ascontiguousarray(images)),
            torch.as_tensor(np.asarray(labels), dtype=torch.int64),
            self.mean,
            self.std,
            self.normalize,
        )

    def setup(self, stage: str | None = None) -> None:
        """Load the data once (every stage gets all three splits)."""
        if self.train_dataset is not None:
            return
        train, test = self.load_splits()
        size = len(cast(Sized, train))
        if size == 0:
            raise CorruptDatasetError(f"{type(self).__name__}: the training split holds no images")
        if self.val_fraction > 0:
            kept, held = split_indices(size, self.val_fraction, self.seed)
            self.train_dataset = TargetSubset(train, kept)
            self.val_dataset = TargetSubset(train, held)
        else:
            self.train_dataset, self.val_dataset = train, test
        self.test_dataset = test

    def train_dataloader(self) -> DataLoader:
        """Shuffled batches; each call replays the same order (a fresh generator seeded with ``seed``)."""
        return self._loader(self._dataset("train_dataset"), shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("val_dataset"), shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._dataset("test_dataset"), shuffle=False)

    def _dataset(self, name: str) -> Dataset:
        if getattr(self, name) is None:
            self.setup()
        return getattr(self, name)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
