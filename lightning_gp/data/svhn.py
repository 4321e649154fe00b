"""SVHN cropped digits (format 2) from ``train_32x32.mat`` and ``test_32x32.mat``."""

from pathlib import Path

from lightning_gp.data.file_datamodule import FileDataModule, Split
from lightning_gp.data.locate import DatasetFiles, RemoteFile
from lightning_gp.data.readers import read_svhn_mat

_SVHN_HOME = "http://ufldl.stanford.edu/housenumbers/"


class SVHNDataModule(FileDataModule):
    """SVHN: 73257/26032 RGB 32x32 digit crops, 10 classes (the files' label 10 is digit 0, mapped to 0).

    The ``extra`` split is not used. With ``data_dir=None``, ``$LIGHTNING_GP_DATA_DIR/svhn`` is searched.
    See :class:`~lightning_gp.data.file_datamodule.FileDataModule` for the arguments.
    """

    dataset_files = DatasetFiles(
        title="SVHN",
        files=(("train_32x32.mat",), ("test_32x32.mat",)),
        folder="svhn",
        mirror=_SVHN_HOME,
        remote=(
            RemoteFile("train_32x32.mat", "e26dedcc434d2e4c54c9b2d4a06d8373"),
            RemoteFile("test_32x32.mat", "eb5a983be6a315427106f1b164d9cef3"),
        ),
        how_to_get=(
            f"The standard files come from {_SVHN_HOME} (format 2, cropped digits); "
            "download=True fetches them when online."
        ),
    )
    num_classes = 10
    image_shape = (3, 32, 32)
    mean = (0.4377, 0.4438, 0.4728)
    std = (0.1980, 0.2010, 0.1970)
    classes = tuple(str(d) for d in range(10))

    def read_splits(self, paths: dict[str, Path]) -> tuple[Split, Split]:
        return read_svhn_mat(paths["train_32x32.mat"]), read_svhn_mat(paths["test_32x32.mat"])
