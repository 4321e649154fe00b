"""Readers for the on-disk dataset formats: idx (MNIST family), CIFAR pickles, SVHN .mat, image files.

Every reader returns numpy arrays (images uint8, labels int64) and raises
:class:`~lightning_gp.data.base.CorruptDatasetError` naming the file when it cannot be decoded.
"""

import gzip
import pickle
import struct
import warnings
import zlib
from pathlib import Path
from typing import ClassVar

import numpy as np
from PIL import Image

from lightning_gp.data.base import CorruptDatasetError

# idx type codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT"); multi-byte data is big-endian.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_GZIP_MAGIC = b"\x1f\x8b"

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"})


def read_idx(path: str | Path) -> np.ndarray:
    """Read an idx file, gzip-compressed or plain (detected from the content, not the name)."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise CorruptDatasetError(f"{path}: cannot decompress gzip data ({exc})") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise CorruptDatasetError(
            f"{path}: not an idx file (bad magic number {raw[:4].hex() or 'empty'}; "
            "expected 00 00 <type code> <number of dimensions>)"
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise CorruptDatasetError(f"{path}: idx header truncated ({len(raw)} bytes for {ndim} dimensions)")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise CorruptDatasetError(
            f"{path}: idx header declares shape {shape} ({expected} data bytes) "
            f"but the file holds {len(raw) - header} data bytes"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def read_idx_split(images_path: str | Path, labels_path: str | Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Read an idx image file ``[N, H, W]`` and its label file ``[N]`` as ([N, 1, H, W] uint8, [N] int64)."""
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise CorruptDatasetError(f"{images_path}: expected uint8 images [N, H, W], got {images.dtype} {images.shape}")
    if 0 in images.shape:
        raise CorruptDatasetError(f"{images_path}: holds no images (the idx header declares shape {images.shape})")
    if labels.ndim != 1 or len(labels) != len(images):
        raise CorruptDatasetError(
            f"{labels_path}: expected {len(images)} labels to match {images_path}, got shape {labels.shape}"
        )
    return images[:, None], _checked_labels(labels, num_classes, labels_path)


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only, so a CIFAR batch file cannot run code."""

    _ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"),
            ("numpy.core.numeric", "_frombuffer"),
            ("numpy._core.numeric", "_frombuffer"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
        }
    )

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        with warnings.catch_warnings():  # numpy 2 warns about the numpy.core alias old pickles use
            warnings.simplefilter("ignore", DeprecationWarning)
            return super().find_class(module, name)


def read_cifar_batch(path: str | Path, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Read a CIFAR "python version" batch: ``data`` [N, 3072] uint8 and ``label_key`` labels.

    Returns ([N, 3, 32, 32] uint8, [N] int64). ``label_key`` is ``labels`` (CIFAR-10) or
    ``fine_labels`` (CIFAR-100).
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            # The official batches were written by Python 2; latin1 decodes their byte strings losslessly.
            batch = _ArrayOnlyUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise CorruptDatasetError(f"{path}: not a readable CIFAR batch pickle ({exc})") from exc
    if not isinstance(batch, dict):
        raise CorruptDatasetError(f"{path}: expected a dict in the CIFAR batch, got {type(batch).__name__}")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}
    missing = [key for key in ("data", label_key) if key not in batch]
    if missing:
        raise CorruptDatasetError(f"{path}: CIFAR batch lacks key(s) {missing}; found {sorted(map(str, batch))}")
    data = np.asarray(batch["data"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise CorruptDatasetError(f"{path}: 'data' must be uint8 [N, 3072], got {data.dtype} {data.shape}")
    labels = np.asarray(batch[label_key])
    if labels.shape != (data.shape[0],):
        raise CorruptDatasetError(f"{path}: '{label_key}' must hold {data.shape[0]} labels, got shape {labels.shape}")
    return data.reshape(-1, 3, 32, 32), _checked_labels(labels, num_classes, path)


def read_svhn_mat(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read an SVHN cropped-digits ``.mat`` (``X`` [32, 32, 3, N], ``y`` [N, 1] with 10 for digit 0).

    Returns ([N, 3, 32, 32] uint8, [N] int64 with digit 0 as label 0).
    """
    from scipy.io import loadmat  # scipy is slow to import; only SVHN needs it

    path = Path(path)
    try:
        mat = loadmat(path, variable_names=["X", "y"])
    except Exception as exc:  # scipy raises many types (ValueError, TypeError, MatReadError, OSError...)
        raise CorruptDatasetError(f"{path}: not a readable MATLAB .mat file ({exc})") from exc
    missing = [key for key in ("X", "y") if key not in mat]
    if missing:
        raise CorruptDatasetError(f"{path}: SVHN .mat file lacks variable(s) {missing}")
    images, labels = np.asarray(mat["X"]), np.asarray(mat["y"]).reshape(-1)
    if images.ndim != 4 or images.shape[2] != 3 or images.shape[3] != len(labels):
        raise CorruptDatasetError(
            f"{path}: expected X [H, W, 3, N] with N = {len(labels)} labels, got X {images.shape}"
        )
    labels = np.where(labels == 10, 0, labels)
    return np.ascontiguousarray(images.transpose(3, 2, 0, 1), dtype=np.uint8), _checked_labels(labels, 10, path)


def read_image(path: str | Path, image_size: int, grayscale: bool) -> np.ndarray:
    """Load an image file as uint8 [C, image_size, image_size] (C = 1 grey or 3 RGB), bilinear resize."""
    path = Path(path)
    try:
        with Image.open(path) as image:
            image = image.convert("L" if grayscale else "RGB")
            if image.size != (image_size, image_size):
                image = image.resize((image_size, image_size), Image.Resampling.BILINEAR)
            array = np.array(image, dtype=np.uint8)  # a writable copy (asarray is read-only)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise CorruptDatasetError(f"{path}: cannot read image ({exc})") from exc
    return array[None] if array.ndim == 2 else np.ascontiguousarray(array.transpose(2, 0, 1))


def list_images(folder: Path) -> list[Path]:
    """Image files under ``folder`` (recursively), sorted, skipping hidden files and folders."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.suffix.lower() in IMAGE_EXTENSIONS
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _checked_labels(labels: np.ndarray, num_classes: int, path: str | Path) -> np.ndarray:
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise CorruptDatasetError(
            f"{path}: labels must lie in [0, {num_classes}), found range [{labels.min()}, {labels.max()}]"
        )
    return labels
