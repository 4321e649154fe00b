"""Image-classification datamodules (built-in Fashion-MNIST sample, idx, CIFAR, SVHN, image folders, your arrays,
crops of scikit-image's bundled photographs).

Every datamodule derives from :class:`ImageClassificationDataModule`; its datasets yield
``(image float32 [C, H, W], label int64)`` and carry a ``targets`` tensor for label-based partitioning.
"""

from lightning_gp.data.arrays import ArrayDataModule
from lightning_gp.data.base import CorruptDatasetError, DatasetNotFoundError, ImageClassificationDataModule
from lightning_gp.data.builtin_sample import FashionMNISTSampleDataModule
from lightning_gp.data.cifar import CIFAR10_CLASSES, CIFAR10DataModule, CIFAR100DataModule
from lightning_gp.data.datasets import ImageTensorDataset, TargetSubset
from lightning_gp.data.download import DownloadError
from lightning_gp.data.file_datamodule import FileDataModule
from lightning_gp.data.image_folder import ImageFileDataset, ImageFolderDataModule
from lightning_gp.data.mnist import FASHION_MNIST_CLASSES, FashionMNISTDataModule, MNISTDataModule
from lightning_gp.data.photo_crops import PhotoCropsDataModule
from lightning_gp.data.photos import PhotosNotFoundError
from lightning_gp.data.svhn import SVHNDataModule

__all__ = [
    "CIFAR10_CLASSES",
    "FASHION_MNIST_CLASSES",
    "ArrayDataModule",
    "CIFAR10DataModule",
    "CIFAR100DataModule",
    "CorruptDatasetError",
    "DatasetNotFoundError",
    "DownloadError",
    "FashionMNISTDataModule",
    "FashionMNISTSampleDataModule",
    "FileDataModule",
    "ImageClassificationDataModule",
    "ImageFileDataset",
    "ImageFolderDataModule",
    "ImageTensorDataset",
    "MNISTDataModule",
    "PhotoCropsDataModule",
    "PhotosNotFoundError",
    "SVHNDataModule",
    "TargetSubset",
]
