"""MNIST and Fashion-MNIST from their idx files (gzip-compressed or plain)."""

from pathlib import Path

from lightning_gp.data.file_datamodule import FileDataModule, Split
from lightning_gp.data.locate import DatasetFiles, RemoteFile
from lightning_gp.data.readers import read_idx_split

FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
FASHION_MNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"

_TRAIN_IMAGES, _TRAIN_LABELS = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"
_TEST_IMAGES, _TEST_LABELS = "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"
_IDX_NAMES = (_TRAIN_IMAGES, _TRAIN_LABELS, _TEST_IMAGES, _TEST_LABELS)


def _idx_files(title: str, folder: str, mirror: str, md5s: tuple[str, ...], how_to_get: str, **kw) -> DatasetFiles:
    """The four idx files, accepted as ``<name>.gz`` or plain ``<name>``; the ``.gz`` ones are downloaded."""
    return DatasetFiles(
        title=title,
        files=tuple((name + ".gz", name) for name in _IDX_NAMES),
        folder=folder,
        mirror=mirror,
        remote=tuple(RemoteFile(name + ".gz", md5) for name, md5 in zip(_IDX_NAMES, md5s, strict=True)),
        how_to_get=how_to_get,
        **kw,
    )


class _IdxDataModule(FileDataModule):
    num_classes = 10
    image_shape = (1, 28, 28)

    def read_splits(self, paths: dict[str, Path]) -> tuple[Split, Split]:
        return (
            read_idx_split(paths[_TRAIN_IMAGES + ".gz"], paths[_TRAIN_LABELS + ".gz"], self.num_classes),
            read_idx_split(paths[_TEST_IMAGES + ".gz"], paths[_TEST_LABELS + ".gz"], self.num_classes),
        )


class FashionMNISTDataModule(_IdxDataModule):
    """Fashion-MNIST (Zalando Research): 60000/10000 grey 28x28 images of 10 clothing classes.

    With ``data_dir=None`` the files are looked for in ``$LIGHTNING_GP_DATA_DIR/fashion-mnist`` and
    then in ``/usr/share/datasets/fashion-mnist`` (Debian/Ubuntu: ``apt-get install
    dataset-fashion-mnist``). See :class:`~lightning_gp.data.file_datamodule.FileDataModule` for the
    arguments.
    """

    dataset_files = _idx_files(
        "Fashion-MNIST",
        folder="fashion-mnist",
        mirror="http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        md5s=(  # from https://github.com/zalandoresearch/fashion-mnist#get-the-data
            "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "25c81989df183df01b3e8a0aad5dffbe",
            "bef4ecab320f06d8554ea6380940ec79",
            "bb300cfdad3c16e7a12a480ee83cd310",
        ),
        how_to_get=(
            "Install them with `apt-get install dataset-fashion-mnist` (into "
            f"{FASHION_MNIST_SYSTEM_DIR}), copy them from https://github.com/zalandoresearch/fashion-mnist "
            "(data/fashion), or pass download=True to fetch them when online."
        ),
        system_dirs=(FASHION_MNIST_SYSTEM_DIR,),
    )
    mean = (0.2860,)
    std = (0.3530,)
    classes = FASHION_MNIST_CLASSES


class MNISTDataModule(_IdxDataModule):
    """MNIST handwritten digits: 60000/10000 grey 28x28 images, 10 classes.

    With ``data_dir=None`` the files are looked for in ``$LIGHTNING_GP_DATA_DIR/mnist``. See
    :class:`~lightning_gp.data.file_datamodule.FileDataModule` for the arguments.
    """

    dataset_files = _idx_files(
        "MNIST",
        folder="mnist",
        mirror="https://ossci-datasets.s3.amazonaws.com/mnist/",
        md5s=(
            "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "d53e105ee54ea40749a09fcbcd1e9432",
            "9fb629c4189551a2d022fa330f9573f3",
            "ec29112dd5afa0611ce80d1b7f02629c",
        ),
        how_to_get=(
            "The standard files are published at http://yann.lecun.com/exdb/mnist/ (mirrored at "
            "https://ossci-datasets.s3.amazonaws.com/mnist/); download=True fetches them when online."
        ),
    )
    mean = (0.1307,)
    std = (0.3081,)
    classes = tuple(str(d) for d in range(10))
