"""Labelled RGB crops of the photographs bundled with scikit-image: a small 3-channel dataset that needs no download."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_gp.data.arrays import pixel_stats
from lightning_gp.data.base import ImageClassificationDataModule
from lightning_gp.data.photos import (
    HELDOUT_PHOTOS,
    TRAIN_PHOTOS,
    PhotosNotFoundError,
    pyramid,
    read_photo,
    scikit_image_data_dir,
)
from lightning_gp.validation import check_int

#: The photographs, one class each in this order (file name -> licence, as in ``skimage.data``).
PHOTOS: dict[str, str] = {**TRAIN_PHOTOS, **HELDOUT_PHOTOS}
#: Class names: the photographs' file stems.
PHOTO_CLASSES: tuple[str, ...] = tuple(Path(name).stem for name in PHOTOS)
#: Smallest crop side accepted.
MIN_IMAGE_SIZE = 8
#: Side of the checkerboard's square tiles, in photo pixels, as a multiple of ``image_size``. A crop
#: with its guard spans ``(image_size + 2 * GUARD) * s`` photo pixels at a level downsampled by ``s``,
#: so a tile of 4 crop sides holds crops of the four finest levels (downsampled up to about 3x: 1,
#: √2, 2, 2√2) with room for positions, and a 512 x 512 photo still has 4 x 4 tiles at size 32.
TILE_FACTOR = 4
#: Pixels of a level kept between a crop and the borders of its tile. PIL's Lanczos filter makes a
#: level's pixel depend on the photo's pixels within 3 of that level's pixels, so a crop is computed
#: from photo pixels of its own tile only: crops of different tiles come from disjoint photo pixels.
GUARD = 4
SPLITS = ("train", "test")
#: A box of crop positions at one level: first and last top row, first and last left column.
Box = tuple[int, int, int, int]


class PhotoCrops(NamedTuple):
    """One split: uint8 crops ``[N, 3, S, S]`` and their origins ``[N, 4]`` (label, level, top, left)."""

    images: np.ndarray
    origins: np.ndarray


class PhotoCropsDataModule(ImageClassificationDataModule):
    """Random crops of 11 public-domain / CC0 photographs bundled with scikit-image; the class is the photo.

    A 3-channel dataset for tests and examples that need RGB images without CIFAR: no download, the
    photographs ship inside the scikit-image wheel (``pip install 'lightning-gp[test]'``). Classes
    are the photographs of :data:`PHOTOS` (astronaut, rocket, hubble_deep_field, retina, camera,
    brick, grass, gravel, clock_motion, chelsea, coffee; grey ones repeated to 3 channels), named by
    their file stems.

    Each crop picks, uniformly, a level of the photo's pyramid (the photo downsampled with Lanczos
    so its shorter side is ``image_size * 2^(k/2)``, up to full resolution), then a position; no two
    crops of a split share a level and position. Split scheme: each photo is cut into a checkerboard
    of square tiles of :data:`TILE_FACTOR` ``* image_size`` photo pixels (the last row and column
    may be narrower), and the tiles alternate between the splits: tile (row, col) is a training tile
    when ``(row + col + flip) % 2 == 0``, with ``flip`` drawn per photo from ``seed`` (so neither
    split always gets the top-left tile; one checkerboard serves every level of a photo, which is
    what keeps the splits apart across scales). Every crop lies
    inside one tile of its split, at every level: mapped back to the photo, its pixels and a guard
    of :data:`GUARD` level pixels around them (wider than the resampling filter) stay inside the
    tile. So the two splits are computed from disjoint photo pixels, and no test crop overlaps a
    training crop at any level or scale (the audit attacks training images and holds the test split
    as the server's public data), while both splits sample every part of every photo: the public
    images are drawn from the same distribution as the attacked ones, as the audit's calibration
    assumes (a split by halves would give the test split, say, the flag and the training split the
    shuttle). Both splits use the same levels: those where a crop of each split fits in a tile, the
    finest four or so (a crop spans at most ``TILE_FACTOR * image_size`` photo pixels; coarser
    levels, where a crop shows most of the photo, cannot keep the splits apart).

    Images are interleaved by class (image ``i`` has label ``i % 11``), so any prefix of a split,
    such as the audit's first 1000 public images, holds every class. ``mean``/``std`` are computed
    from the training crops (they depend on ``image_size``, the counts and ``seed``; computing them
    costs less than building the crops). Everything is built when the module is (about a second),
    deterministically from ``seed``.

    Attributes:
        origins: ``{"train": [N, 4], "test": [N, 4]}`` int64 arrays, one row per image of the split,
            in order: (label, pyramid level, top row, left column) of the crop in that level.
        level_shapes: per class, the (height, width) of each pyramid level, smallest first (the last
            is the photo's).
        tile: the tiles' side in photo pixels, ``TILE_FACTOR * image_size``.
        flips: per class, the ``flip`` of its checkerboard (0 or 1; see :func:`tile_split`).

    Args:
        image_size: Side of the square crops (at least 8; at most what lets every photo hold 2 x 2
            tiles: 58 for clock_motion.png, 300 x 400; see :func:`max_image_size`).
        per_class_train: Training crops per class.
        per_class_test: Test crops per class.
        data_dir: A folder holding the photographs' files (as named in :data:`PHOTOS`). Default: the
            installed scikit-image's ``skimage/data``.
        batch_size: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        num_workers: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        val_fraction: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        normalize: See :class:`~lightning_gp.data.base.ImageClassificationDataModule`.
        seed: Seeds the crops, the validation hold-out and the training-set shuffling.

    Raises:
        PhotosNotFoundError: scikit-image is not installed (and no ``data_dir``), or a photograph is
            missing (a :class:`~lightning_gp.data.base.DatasetNotFoundError`).
        CorruptDatasetError: a photograph cannot be decoded.
        ValueError: an argument is invalid; the message names it.
    """

    num_classes = len(PHOTO_CLASSES)
    classes = PHOTO_CLASSES

    def __init__(
        self,
        image_size: int = 32,
        per_class_train: int = 128,
        per_class_test: int = 128,
        data_dir: str | None = None,
        batch_size: int = 64,
        num_workers: int = 0,
        val_fraction: float = 0.0,
        normalize: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(
            batch_size=batch_size, num_workers=num_workers, val_fraction=val_fraction, normalize=normalize, seed=seed
        )
        self.image_size = check_int(image_size, "image_size", low=MIN_IMAGE_SIZE)
        self.per_class_train = check_int(per_class_train, "per_class_train", low=1)
        self.per_class_test = check_int(per_class_test, "per_class_test", low=1)
        check_int(seed, "seed", low=0)
        self.data_dir = None if data_dir is None else os.fspath(data_dir)
        photos = [read_photo(photo_folder(self.data_dir) / name) for name in PHOTOS]
        check_image_size(photos, image_size)
        self.image_shape = (3, image_size, image_size)
        counts = {"train": per_class_train, "test": per_class_test}
        self.tile = TILE_FACTOR * image_size
        splits, self.level_shapes, self.flips = photo_crops(photos, image_size, counts, seed)
        self._splits = splits
        self.origins = {split: crops.origins for split, crops in splits.items()}
        self.mean, self.std = pixel_stats(torch.from_numpy(splits["train"].images))

    def load_splits(self) -> tuple[Dataset, Dataset]:
        train, test = (self._splits[split] for split in SPLITS)
        return (
            self.tensor_dataset(train.images, train.origins[:, 0]),
            self.tensor_dataset(test.images, test.origins[:, 0]),
        )


def photo_folder(data_dir: str | None) -> Path:
    """The folder holding every photograph of :data:`PHOTOS`, or an error naming what is missing."""
    if data_dir is None:
        folder = scikit_image_data_dir()
        if folder is None:
            raise PhotosNotFoundError(
                "PhotoCropsDataModule crops the photographs bundled with scikit-image, which is not installed: "
                f"pip install 'lightning-gp[test]' (or pass data_dir= a folder holding {', '.join(PHOTOS)})"
            )
    else:
        folder = Path(data_dir).expanduser()
        if not folder.is_dir():
            raise PhotosNotFoundError(f"PhotoCropsDataModule: data_dir {folder} is not a folder")
    missing = [name for name in PHOTOS if not (folder / name).is_file()]
    if missing:
        raise PhotosNotFoundError(
            f"PhotoCropsDataModule: {folder} lacks the photograph(s) {', '.join(missing)} "
            f"(expected {', '.join(PHOTOS)}; they ship with scikit-image: pip install 'lightning-gp[test]')"
        )
    return folder


def tile_flip(seed: int, label: int) -> int:
    """The ``flip`` (0 or 1) of photo ``label``'s checkerboard, from its own stream of ``seed``."""
    return int(np.random.default_rng((seed, label, len(SPLITS))).integers(2))


def tile_split(row: int, col: int, flip: int) -> str:
    """The split of tile (``row``, ``col``) of a checkerboard: ``"train"`` when ``(row + col + flip)`` is even."""
    return SPLITS[(row + col + flip) % 2]


def tile_ranges(photo_len: int, level_len: int, size: int, tile: int) -> list[tuple[int, int, int]]:
    """Along one axis: (tile index, first, last position) of the ``size`` crops of a level ``level_len``
    long that lie, with :data:`GUARD` level pixels each side, inside the tile once mapped to the photo
    (``photo_len`` long, tiles of ``tile`` photo pixels). Tiles that hold no crop are left out.

    Level pixel ``p`` covers photo pixels ``[p, p + 1) * photo_len / level_len``: position ``p`` fits
    tile ``[start, stop)`` when ``(p - GUARD) * photo_len >= start * level_len`` and
    ``(p + size + GUARD) * photo_len <= stop * level_len`` (exact, in integers).
    """
    ranges = []
    for index in range(-(-photo_len // tile)):
        start, stop = index * tile, min((index + 1) * tile, photo_len)
        first = GUARD - (-start * level_len // photo_len)
        last = stop * level_len // photo_len - size - GUARD
        if first <= last:
            ranges.append((index, first, last))
    return ranges


def level_boxes(
    shapes: tuple[tuple[int, int], ...], size: int, tile: int, flip: int
) -> dict[int, dict[str, list[Box]]]:
    """Per level where crops of every split fit: each split's boxes of positions, one per tile of it
    that holds a crop (the photo is the last level of ``shapes``)."""
    photo_height, photo_width = shapes[-1]
    boxes = {}
    for level, (height, width) in enumerate(shapes):
        split_boxes: dict[str, list[Box]] = {split: [] for split in SPLITS}
        for row, top, bottom in tile_ranges(photo_height, height, size, tile):
            for col, left, right in tile_ranges(photo_width, width, size, tile):
                split_boxes[tile_split(row, col, flip)].append((top, bottom, left, right))
        if all(split_boxes.values()):
            boxes[level] = split_boxes
    return boxes


def max_image_size(height: int, width: int) -> int:
    """The largest ``image_size`` for which a ``height`` x ``width`` photo holds 2 x 2 tiles that fit a crop.

    Along a side ``L`` long, the second tile (``L - TILE_FACTOR * n`` pixels, or a whole tile) holds a
    crop of side ``n`` and its guards at full resolution when ``L - TILE_FACTOR * n >= n + 2 * GUARD``.
    Two tiles each way give each split two tiles, one in each column and row of tiles.
    """
    return (min(height, width) - 2 * GUARD) // (TILE_FACTOR + 1)


def check_image_size(photos: list[np.ndarray], size: int) -> None:
    """Every photo must hold 2 x 2 tiles of side ``TILE_FACTOR * size`` that fit a ``size`` crop (see :func:`max_image_size`)."""
    limits = {name: max_image_size(*photo.shape[1:]) for name, photo in zip(PHOTOS, photos)}
    name = min(limits, key=lambda n: limits[n])
    if size > limits[name]:
        height, width = photos[list(PHOTOS).index(name)].shape[1:]
        raise ValueError(
            f"image_size must be at most {limits[name]} for these photographs, got {size}: {name} is "
            f"{height} x {width}, and the splits take alternate tiles of a checkerboard of side "
            f"{TILE_FACTOR} * image_size, so a photo must hold 2 x 2 tiles that fit a crop {GUARD} pixels "
            "from their borders"
        )


def sample_origins(
    boxes: dict[int, list[Box]], count: int, split: str, rng: np.random.Generator
) -> list[tuple[int, int, int]]:
    """``count`` distinct (level, top, left): a uniform level of ``boxes`` (level -> ``split``'s boxes of
    positions), then a uniform position among its boxes'."""
    usable = sorted(boxes)
    ends = {}  # per level, the cumulative position counts of its boxes
    for level in usable:
        ends[level] = np.cumsum([(bottom - top + 1) * (right - left + 1) for top, bottom, left, right in boxes[level]])
    total = int(sum(int(ends[level][-1]) for level in usable))
    if count > total:
        raise ValueError(f"per_class_{split} must be at most {total} (the distinct crops of a photo), got {count}")
    seen: set[tuple[int, int, int]] = set()
    picks: list[tuple[int, int, int]] = []
    while len(picks) < count:
        level = usable[int(rng.integers(len(usable)))]
        draw = int(rng.integers(int(ends[level][-1])))
        number = int(np.searchsorted(ends[level], draw, side="right"))
        draw -= int(ends[level][number - 1]) if number else 0
        top, _, left, right = boxes[level][number]
        pick = (level, top + draw // (right - left + 1), left + draw % (right - left + 1))
        if pick not in seen:
            seen.add(pick)
            picks.append(pick)
    return picks


def photo_crops(
    photos: list[np.ndarray], size: int, counts: dict[str, int], seed: int
) -> tuple[dict[str, PhotoCrops], tuple[tuple[tuple[int, int], ...], ...], tuple[int, ...]]:
    """Each split's crops, interleaved by class, each photo's pyramid level shapes and checkerboard flip.

    Class ``label``'s crops of split number ``s`` come from ``numpy.random.default_rng((seed, label, s))``,
    so they do not depend on the other photos or on the other split's count; its flip from
    ``default_rng((seed, label, 2))``.
    """
    n = len(photos)
    images = {split: np.empty((counts[split], n, 3, size, size), dtype=np.uint8) for split in SPLITS}
    origins = {split: np.empty((counts[split], n, 4), dtype=np.int64) for split in SPLITS}
    all_shapes, flips = [], []
    for label, photo in enumerate(photos):
        levels = pyramid(photo, size)
        shapes = tuple((int(level.shape[1]), int(level.shape[2])) for level in levels)
        all_shapes.append(shapes)
        flips.append(tile_flip(seed, label))
        boxes = level_boxes(shapes, size, TILE_FACTOR * size, flips[-1])
        for number, split in enumerate(SPLITS):
            rng = np.random.default_rng((seed, label, number))
            split_boxes = {level: by_split[split] for level, by_split in boxes.items()}
            for j, (level, top, left) in enumerate(sample_origins(split_boxes, counts[split], split, rng)):
                images[split][j, label] = levels[level][:, top : top + size, left : left + size]
                origins[split][j, label] = (label, level, top, left)
    splits = {
        split: PhotoCrops(images[split].reshape(-1, 3, size, size), origins[split].reshape(-1, 4)) for split in SPLITS
    }
    return splits, tuple(all_shapes), tuple(flips)
