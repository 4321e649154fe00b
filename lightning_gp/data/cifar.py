"""CIFAR-10 and CIFAR-100 from the "python version" pickled batches."""

from pathlib import Path

import numpy as np

from lightning_gp.data.file_datamodule import FileDataModule, Split
from lightning_gp.data.locate import DatasetFiles, RemoteFile
from lightning_gp.data.readers import read_cifar_batch

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_CIFAR_HOME = "https://www.cs.toronto.edu/~kriz/"


class _CIFARDataModule(FileDataModule):
    image_shape = (3, 32, 32)
    _label_key: str
    _train_batches: tuple[str, ...]
    _test_batches: tuple[str, ...]

    def read_splits(self, paths: dict[str, Path]) -> tuple[Split, Split]:
        return self._read(paths, self._train_batches), self._read(paths, self._test_batches)

    def _read(self, paths: dict[str, Path], names: tuple[str, ...]) -> Split:
        batches = [read_cifar_batch(paths[name], self._label_key, self.num_classes) for name in names]
        return np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches])


def _cifar_files(
    title: str, folder: str, extracted: str, archive: str, md5: str, names: tuple[str, ...]
) -> DatasetFiles:
    return DatasetFiles(
        title=title,
        files=tuple((name,) for name in names),
        folder=folder,
        mirror=_CIFAR_HOME,
        remote=(RemoteFile(archive, md5, archive=True),),
        how_to_get=(
            f"The standard files come from {_CIFAR_HOME}{archive} (see {_CIFAR_HOME}cifar.html); extract it "
            f"so that data_dir/{extracted}/ holds them (data_dir may also point at {extracted}/ itself). "
            "download=True fetches and extracts it when online."
        ),
        layouts=(extracted, ""),
    )


class CIFAR10DataModule(_CIFARDataModule):
    """CIFAR-10: 50000/10000 RGB 32x32 images, 10 classes.

    ``data_dir`` may hold ``cifar-10-batches-py/`` or be that folder (``data_batch_1`` ... ``data_batch_5``,
    ``test_batch``). With ``data_dir=None``, ``$LIGHTNING_GP_DATA_DIR/cifar-10`` is searched. See
    :class:`~lightning_gp.data.file_datamodule.FileDataModule` for the arguments.
    """

    _train_batches = tuple(f"data_batch_{i}" for i in range(1, 6))
    _test_batches = ("test_batch",)
    _label_key = "labels"
    dataset_files = _cifar_files(
        "CIFAR-10",
        folder="cifar-10",
        extracted="cifar-10-batches-py",
        archive="cifar-10-python.tar.gz",
        md5="c58f30108f718f92721af3b95e74349a",
        names=_train_batches + _test_batches,
    )
    num_classes = 10
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)
    classes = CIFAR10_CLASSES


class CIFAR100DataModule(_CIFARDataModule):
    """CIFAR-100: 50000/10000 RGB 32x32 images with the 100 fine labels.

    ``data_dir`` may hold ``cifar-100-python/`` or be that folder (``train``, ``test``). With
    ``data_dir=None``, ``$LIGHTNING_GP_DATA_DIR/cifar-100`` is searched. See
    :class:`~lightning_gp.data.file_datamodule.FileDataModule` for the arguments.
    """

    _train_batches = ("train",)
    _test_batches = ("test",)
    _label_key = "fine_labels"
    dataset_files = _cifar_files(
        "CIFAR-100",
        folder="cifar-100",
        extracted="cifar-100-python",
        archive="cifar-100-python.tar.gz",
        md5="eb9058c3a382ffc7106e4002c42a8d85",
        names=_train_batches + _test_batches,
    )
    num_classes = 100
    mean = (0.5071, 0.4865, 0.4409)
    std = (0.2673, 0.2564, 0.2762)
