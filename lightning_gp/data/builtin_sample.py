"""The Fashion-MNIST sample shipped inside the package (3000 train / 1000 test images)."""

from importlib import resources

import numpy as np
from torch.utils.data import Dataset

from lightning_gp.data.base import CorruptDatasetError, ImageClassificationDataModule
from lightning_gp.data.mnist import FASHION_MNIST_CLASSES

SAMPLE_PACKAGE = "lightning_gp.data.sample"
SAMPLE_FILE = "fashion_mnist_sample.npz"
SAMPLE_KEYS = ("train_images", "train_labels", "test_images", "test_labels")


def load_sample_arrays() -> dict[str, np.ndarray]:
    """The sample's arrays by key (works from a source tree, a wheel or a zip import)."""
    resource = resources.files(SAMPLE_PACKAGE).joinpath(SAMPLE_FILE)
    with resource.open("rb") as f, np.load(f) as npz:
        missing = [key for key in SAMPLE_KEYS if key not in npz.files]
        if missing:
            raise CorruptDatasetError(f"{resource}: sample lacks array(s) {missing}")
        return {key: npz[key] for key in SAMPLE_KEYS}


class FashionMNISTSampleDataModule(ImageClassificationDataModule):
    """A class-balanced Fashion-MNIST sample bundled with the package; needs no files or network.

    Train: the first 300 images of each class of the official training set (3000); test: the first
    100 of each class of the official test set (1000). 1x28x28, 10 classes, Fashion-MNIST's
    mean/std. See ``lightning_gp/data/sample/README.md``. Arguments as in
    :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
    """

    num_classes = 10
    image_shape = (1, 28, 28)
    mean = (0.2860,)
    std = (0.3530,)
    classes = FASHION_MNIST_CLASSES

    def load_splits(self) -> tuple[Dataset, Dataset]:
        arrays = load_sample_arrays()
        return (
            self.tensor_dataset(arrays["train_images"], arrays["train_labels"]),
            self.tensor_dataset(arrays["test_images"], arrays["test_labels"]),
        )
