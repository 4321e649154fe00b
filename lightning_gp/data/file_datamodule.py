"""Base of the datamodules that read a standard set of files from a data directory."""

from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from lightning_gp.data.base import ImageClassificationDataModule
from lightning_gp.data.locate import DatasetFiles, locate_files

Split = tuple[np.ndarray, np.ndarray]


class FileDataModule(ImageClassificationDataModule):
    """A dataset stored as standard files (idx, CIFAR pickles, SVHN .mat) in a data directory.

    Subclasses set ``dataset_files`` (which files, where they come from) and implement
    :meth:`read_splits`. Nothing is downloaded unless ``download=True``.

    Args:
        data_dir: Folder holding the files. None searches ``$LIGHTNING_GP_DATA_DIR/<dataset folder>``
            and then the dataset's system folder, if it has one.
        download: Fetch the standard files into ``data_dir`` (or ``$LIGHTNING_GP_DATA_DIR/<dataset
            folder>``) when they are missing, verifying their md5. Needs network access.
        mirror: Base URL to download from instead of the official one.
        batch_size: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        num_workers: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        val_fraction: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        normalize: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        seed: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
    """

    dataset_files: DatasetFiles

    def __init__(
        self,
        data_dir: str | None = None,
        download: bool = False,
        mirror: str | None = None,
        batch_size: int = 64,
        num_workers: int = 0,
        val_fraction: float = 0.0,
        normalize: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(
            batch_size=batch_size, num_workers=num_workers, val_fraction=val_fraction, normalize=normalize, seed=seed
        )
        self.data_dir = None if data_dir is None else str(data_dir)
        self.download = download
        self.mirror = mirror

    def locate(self) -> dict[str, Path]:
        """Paths of the dataset files by canonical name (downloading them first if allowed)."""
        return locate_files(self.dataset_files, self.data_dir, self.download, self.mirror)

    def prepare_data(self) -> None:
        """Download the files when ``download=True`` (Lightning runs this once per node)."""
        if self.download:
            self.locate()

    def read_splits(self, paths: dict[str, Path]) -> tuple[Split, Split]:
        """Decode ((train images, labels), (test images, labels)) from the located files."""
        raise NotImplementedError

    def load_splits(self) -> tuple[Dataset, Dataset]:
        (train_x, train_y), (test_x, test_y) = self.read_splits(self.locate())
        return self.tensor_dataset(train_x, train_y), self.tensor_dataset(test_x, test_y)
