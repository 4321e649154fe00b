"""Bring your own data: images and labels as numpy arrays, torch tensors or an ``.npz`` file."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
from lightning_gp.data.datasets import ImageTensorDataset, TargetSubset
from lightning_gp.normalization import per_channel
from lightning_gp.validation import check_number, check_positive_int

#: The arrays an ``.npz`` for :class:`ArrayDataModule` may hold; ``x`` and ``y`` are required.
NPZ_KEYS = ("x", "y", "x_test", "y_test", "mean", "std", "classes")
_REQUIRED_KEYS = ("x", "y")
#: Floor of a computed per-channel std, so a constant channel does not divide by zero.
_MIN_STD = 1e-6


class ArrayDataModule(ImageClassificationDataModule):
    """Your own labelled images, given as numpy arrays / torch tensors or as an ``.npz`` file.

    Images are ``[N, C, H, W]`` (``[N, H, W]`` is taken as one channel), either uint8 pixels
    0..255 or floating point pixels in [0, 1]: float arrays in 0..255, normalised arrays (negative
    values), NaN or infinities are refused with an error that says which. Labels are 1-D integers
    in ``[0, num_classes)``, one per image. Everything is checked when the module is built, so a
    bad array fails here and not in the middle of training.

    Without ``x_test``/``y_test`` a seeded random ``test_fraction`` of ``x`` is held out as the
    test split; ``train_dataset`` is then a subset of ``x`` whose ``indices`` are positions in ``x``.
    The audit's training-set ``indices`` index ``train_dataset``.

    Args:
        x: Training images (numpy array or torch tensor).
        y: Training labels, one per image of ``x``.
        x_test: Test images (same channels and size as ``x``); give ``y_test`` with them.
        y_test: Test labels.
        path: An ``.npz`` file (``np.savez``) with arrays ``x`` and ``y`` and optionally ``x_test``,
            ``y_test``, ``mean``, ``std`` and ``classes`` (a string array), instead of the array
            arguments. Read with ``allow_pickle=False``. ``mean``, ``std`` and ``classes`` given as
            arguments take precedence over the file's.
        mean: Per-channel mean of the [0, 1] pixels (one value per channel). Default: computed
            from the training images (after the ``test_fraction`` hold-out, before any
            ``val_fraction`` hold-out).
        std: Per-channel standard deviation, one value per channel. Default: computed from the
            training images like ``mean`` (floored at 1e-6 for a constant channel).
        classes: Class names in label order; sets ``num_classes`` to their number.
        num_classes: Number of classes. Default: ``len(classes)``, else the largest label in
            ``y``/``y_test`` plus one.
        test_fraction: Share of ``x`` held out as the test split when no test arrays are given.
        batch_size: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        num_workers: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        val_fraction: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        normalize: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        seed: Seeds the test and validation hold-outs and the training-set shuffling.

    Raises:
        DatasetNotFoundError: ``path`` does not exist (a ``FileNotFoundError``).
        CorruptDatasetError: the file is not a readable ``.npz``, lacks ``x`` or ``y``, holds an
            unknown array, or one of its arrays is invalid (a ``ValueError``).
        ValueError, TypeError: an argument is invalid; the message names it.
    """

    def __init__(
        self,
        x: np.ndarray | Tensor | None = None,
        y: np.ndarray | Tensor | None = None,
        x_test: np.ndarray | Tensor | None = None,
        y_test: np.ndarray | Tensor | None = None,
        path: str | None = None,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        classes: tuple[str, ...] | None = None,
        num_classes: int | None = None,
        test_fraction: float = 0.2,
        batch_size: int = 64,
        num_workers: int = 0,
        val_fraction: float = 0.0,
        normalize: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(
            batch_size=batch_size, num_workers=num_workers, val_fraction=val_fraction, normalize=normalize, seed=seed
        )
        self.test_fraction = check_number(
            test_fraction, "test_fraction", low=0.0, high=1.0, low_open=True, high_open=True
        )
        self.path = None if path is None else os.fspath(path)
        given = {"x": x, "y": y, "x_test": x_test, "y_test": y_test}
        if self.path is not None:
            passed = [name for name, value in given.items() if value is not None]
            if passed:
                raise ValueError(f"pass either path (an .npz file) or the arrays, not both: got path and {passed}")
            error: type[ValueError] = CorruptDatasetError
            source = _load_npz(self.path)
            names = {key: f"{self.path}['{key}']" for key in NPZ_KEYS}
        else:
            if x is None or y is None:
                raise ValueError(
                    "ArrayDataModule needs the training images x and labels y (numpy arrays or torch tensors), "
                    "or path=<file.npz> holding arrays x and y"
                )
            error = ValueError
            source = {k: _as_array(v, k) for k, v in given.items() if v is not None}
            names = {key: key for key in NPZ_KEYS}

        train_x = _images(source["x"], names["x"], error)
        train_y = _labels(source["y"], names["y"], len(train_x), names["x"], error)
        if ("x_test" in source) != ("y_test" in source):
            have, lack = ("x_test", "y_test") if "x_test" in source else ("y_test", "x_test")
            raise error(f"{names[have]} was given without {names[lack]}: the test split needs both")
        test: tuple[Tensor, Tensor] | None = None
        if "x_test" in source:
            test_x = _images(source["x_test"], names["x_test"], error)
            if test_x.shape[1:] != train_x.shape[1:]:
                raise error(
                    f"{names['x_test']} images are [C, H, W] = {tuple(test_x.shape[1:])} but {names['x']} images "
                    f"are {tuple(train_x.shape[1:])}"
                )
            test = (test_x, _labels(source["y_test"], names["y_test"], len(test_x), names["x_test"], error))
            self.holdout: tuple[list[int], list[int]] | None = None
        else:
            self.holdout = split_indices(len(train_x), self.test_fraction, seed)

        self.num_classes = _num_classes(
            classes, num_classes, source.get("classes"), names["classes"], [train_y] + ([test[1]] if test else [])
        )
        self.classes = _class_names(classes, source.get("classes"), names["classes"])
        _check_label_range(train_y, names["y"], self.num_classes)
        if test is not None:
            _check_label_range(test[1], names["y_test"], self.num_classes)

        channels = int(train_x.shape[1])
        self.image_shape = (channels, int(train_x.shape[2]), int(train_x.shape[3]))
        computed: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
        if (mean is None and "mean" not in source) or (std is None and "std" not in source):
            computed = pixel_stats(train_x, None if self.holdout is None else self.holdout[0])
        self.mean = _stat(mean, "mean", source.get("mean"), names["mean"], channels, computed[0])
        self.std = _stat(std, "std", source.get("std"), names["std"], channels, computed[1], positive=True)
        self._train = (train_x, train_y)
        self._test = test

    def load_splits(self) -> tuple[Dataset, Dataset]:
        if self._test is not None:
            return self._tensors(*self._train), self._tensors(*self._test)
        assert self.holdout is not None  # no test arrays: the test split is held out of x
        kept, held = self.holdout
        full = self._tensors(*self._train)
        return TargetSubset(full, kept), TargetSubset(full, held)

    def _tensors(self, images: Tensor, labels: Tensor) -> ImageTensorDataset:
        return ImageTensorDataset(images, labels, self.mean, self.std, self.normalize)


def pixel_stats(
    images: Tensor, indices: Sequence[int] | None = None, chunk: int = 1024
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of the pixels of ``[N, C, H, W]`` images scaled to [0, 1] (uint8 / 255).

    Over ``images[indices]`` (default: all), accumulated in float64, ``chunk`` images at a time;
    the std is floored at 1e-6.
    """
    channels = images.shape[1]
    order = torch.arange(len(images)) if indices is None else torch.as_tensor(list(indices), dtype=torch.long)
    total = torch.zeros(channels, dtype=torch.float64)
    total_sq = torch.zeros(channels, dtype=torch.float64)
    for picks in order.split(chunk):
        block = images[picks]
        pixels = block.to(torch.float64)
        if block.dtype == torch.uint8:
            pixels = pixels / 255.0
        pixels = pixels.transpose(0, 1).reshape(channels, -1)
        total += pixels.sum(dim=1)
        total_sq += pixels.square().sum(dim=1)
    count = len(order) * images[0].numel() // channels
    mean = total / count
    std = (total_sq / count - mean.square()).clamp_min(0).sqrt().clamp_min(_MIN_STD)
    return tuple(mean.tolist()), tuple(std.tolist())


def _load_npz(path: str) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` by key, after checking the keys (file errors name the file)."""
    file = Path(path).expanduser()
    if not file.is_file():
        where = "is a directory, not a file" if file.is_dir() else "does not exist"
        raise DatasetNotFoundError(f"ArrayDataModule: the .npz file {file} {where}")
    try:
        loaded = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        # numpy reads any file that is neither a zip nor a .npy as a pickle, and its message then
        # suggests unpickling it; the file is simply not an .npz, and nothing here unpickles data
        reason = "neither an .npz archive (np.savez) nor a .npy array" if "pickle" in str(exc) else str(exc)
        raise CorruptDatasetError(f"{file}: not a valid .npz file ({reason})") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise CorruptDatasetError(f"{file}: holds a single array, not an .npz archive of arrays x and y (np.savez)")
    with loaded as npz:
        keys = list(npz.files)
        missing = [key for key in _REQUIRED_KEYS if key not in keys]
        if missing:
            raise CorruptDatasetError(f"{file}: lacks array(s) {missing}; found {keys}. Expected {_expected_keys()}")
        unknown = [key for key in keys if key not in NPZ_KEYS]
        if unknown:
            raise CorruptDatasetError(f"{file}: unknown array(s) {unknown}. Expected {_expected_keys()}")
        arrays = {}
        for key in keys:
            try:
                arrays[key] = npz[key]
            except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
                reason = "it holds Python objects" if "pickle" in str(exc) else str(exc)
                raise CorruptDatasetError(
                    f"{file}: cannot read array '{key}' ({reason}); arrays of Python objects are refused "
                    "(save class names as a string array: np.array(names))"
                ) from exc
    return arrays


def _expected_keys() -> str:
    return f"x and y, and optionally {', '.join(k for k in NPZ_KEYS if k not in _REQUIRED_KEYS)}"


def _as_array(value: Any, name: str) -> np.ndarray:
    """A numpy view of an argument given as an array, a tensor or a (nested) sequence of numbers."""
    if isinstance(value, (str, bytes, os.PathLike)):
        raise TypeError(f"{name} must be a numpy array or torch tensor, got a path {value!r} (pass path= for a file)")
    if isinstance(value, Tensor):
        tensor = value.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    array = np.asarray(value)
    if array.dtype == object:
        raise TypeError(f"{name} must be a numpy array or torch tensor of numbers, got {type(value).__name__}")
    return array


def _images(array: np.ndarray, name: str, error: type[ValueError]) -> Tensor:
    """Checked images as a private ``[N, C, H, W]`` tensor: uint8 kept, floats as float32 in [0, 1]."""
    if array.ndim == 3:
        array = array[:, None]
    if array.ndim != 4:
        raise error(f"{name} must be images [N, C, H, W] (or [N, H, W] for one channel), got shape {array.shape}")
    if array.shape[0] == 0:
        raise error(f"{name} holds no images (shape {array.shape})")
    if array.shape[-1] in (1, 3) and array.shape[1] not in (1, 3):
        # channels last ([N, H, W, C], numpy/PIL order) would be read as H channels of W x C images
        raise error(
            f"{name} has shape {array.shape}: channels last [N, H, W, C]? Give [N, C, H, W] "
            f"(e.g. {name.split('[')[0]}.transpose(0, 3, 1, 2))"
        )
    if 0 in array.shape:
        raise error(f"{name} has an empty channel or spatial dimension (shape {array.shape})")
    if array.dtype == np.uint8:
        return torch.from_numpy(np.array(array, copy=True))
    if array.dtype.kind != "f":
        hint = (
            f" (integer pixels 0..255: pass {name.split('[')[0]}.astype(np.uint8))" if array.dtype.kind in "iu" else ""
        )
        raise error(f"{name} must be uint8 pixels (0..255) or floating point pixels in [0, 1], got {array.dtype}{hint}")
    finite = np.isfinite(array)
    if not finite.all():
        raise error(f"{name} holds {int(finite.size - finite.sum())} NaN or infinite value(s)")
    low, high = float(array.min()), float(array.max())
    if low < 0:
        raise error(
            f"{name} holds negative values (min {low:.4g}): it looks normalised. Give the pixels before "
            "normalisation, floats in [0, 1] or uint8 0..255; the datamodule normalises them with mean/std"
        )
    if high > 1:
        hint = "; for 0..255 pixels pass uint8 or divide by 255" if high <= 255 else ""
        raise error(f"{name} is floating point with values up to {high:.4g}: float images must lie in [0, 1]{hint}")
    return torch.from_numpy(array.astype(np.float32, copy=True))


def _labels(array: np.ndarray, name: str, count: int, images_name: str, error: type[ValueError]) -> Tensor:
    """Checked 1-D integer labels, one per image, as int64."""
    if array.ndim != 1:
        raise error(f"{name} must be 1-D integer labels [N], got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise error(f"{name} must hold integer class labels, got {array.dtype}")
    if len(array) != count:
        raise error(f"{name} holds {len(array)} labels but {images_name} holds {count} images")
    return torch.from_numpy(array.astype(np.int64, copy=True))


def _check_label_range(labels: Tensor, name: str, num_classes: int) -> None:
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= num_classes:
        raise ValueError(f"{name} must lie in [0, num_classes={num_classes}), found labels in [{low}, {high}]")


def _class_names(classes: Sequence[str] | None, stored: np.ndarray | None, stored_name: str) -> tuple[str, ...] | None:
    if classes is not None:
        return _names(classes, "classes")
    if stored is not None:
        if stored.ndim != 1 or stored.dtype.kind not in "US":
            raise CorruptDatasetError(f"{stored_name} must be a 1-D string array, got {stored.dtype} {stored.shape}")
        return _names([str(c) for c in stored.tolist()], stored_name)
    return None


def _names(classes: Sequence[str], name: str) -> tuple[str, ...]:
    if isinstance(classes, str) or not all(isinstance(c, str) for c in classes):
        raise TypeError(f"{name} must be a sequence of class names (strings), got {classes!r}")
    names = tuple(classes)
    if not names:
        raise ValueError(f"{name} must name at least one class")
    if len(set(names)) != len(names):
        raise ValueError(f"{name} must be distinct, got {names}")
    return names


def _num_classes(
    classes: Sequence[str] | None,
    num_classes: int | None,
    stored: np.ndarray | None,
    stored_name: str,
    labels: list[Tensor],
) -> int:
    """``num_classes``, else the number of class names, else the largest label plus one."""
    from_names = len(classes) if classes is not None else (len(stored) if stored is not None and stored.ndim else None)
    if num_classes is not None:
        check_positive_int(num_classes, "num_classes")
        if from_names is not None and from_names != num_classes:
            named = "classes" if classes is not None else stored_name
            raise ValueError(f"num_classes={num_classes} disagrees with the {from_names} names in {named}")
        return num_classes
    if from_names is not None:
        return from_names
    return max(int(t.max()) for t in labels) + 1


def _stat(
    value: Sequence[float] | None,
    name: str,
    stored: np.ndarray | None,
    stored_name: str,
    channels: int,
    computed: tuple[float, ...],
    positive: bool = False,
) -> tuple[float, ...]:
    """The argument, else the file's array, else the value computed from the training images."""
    if value is not None:
        return per_channel(value, channels, name, broadcast=False, positive=positive)
    if stored is not None:
        return per_channel(stored.reshape(-1).tolist(), channels, stored_name, broadcast=False, positive=positive)
    return computed
