"""PhotoCropsDataModule: labelled RGB crops of scikit-image's bundled photographs (the test extra installs it)."""

from __future__ import annotations

import importlib.util

import lightning as L
import numpy as np
import pytest
import torch

from lightning_gp.data import DatasetNotFoundError, PhotoCropsDataModule, PhotosNotFoundError
from lightning_gp.data.base import CorruptDatasetError
from lightning_gp.data.photo_crops import GUARD, PHOTOS, TILE_FACTOR, tile_split
from lightning_gp.data.photos import pyramid, read_photo, scikit_image_data_dir

STEMS = (
    "astronaut",
    "rocket",
    "hubble_deep_field",
    "retina",
    "camera",
    "brick",
    "grass",
    "gravel",
    "clock_motion",
    "chelsea",
    "coffee",
)


@pytest.fixture(scope="module")
def raw():
    """The defaults (11 x 128 crops per split, 32x32), as pixels in [0, 1]."""
    datamodule = PhotoCropsDataModule(normalize=False)
    datamodule.setup()
    return datamodule


@pytest.fixture(scope="module")
def small():
    """A small normalised module for the determinism and end-to-end checks."""
    datamodule = PhotoCropsDataModule(per_class_train=8, per_class_test=4, batch_size=16, seed=3)
    datamodule.setup()
    return datamodule


def test_the_defaults_are_11_photo_classes_of_128_rgb_32x32_crops_per_split(raw):
    assert raw.classes == STEMS and raw.num_classes == 11
    assert raw.image_shape == (3, 32, 32)
    for dataset in (raw.train_dataset, raw.test_dataset):
        assert len(dataset) == 11 * 128
        # interleaved by class: any prefix (the audit's public images) holds every class
        assert torch.equal(dataset.targets, torch.arange(11 * 128) % 11)
        image, label = dataset[12]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and int(label) == 1
        pixels = torch.stack([dataset[i][0] for i in range(0, len(dataset), 7)])
        assert pixels.min() >= 0 and pixels.max() <= 1 and pixels.std() > 0.1
    assert raw.val_dataset is raw.test_dataset  # val_fraction=0: validation is the test split
    # mean/std: the training crops' per-channel statistics
    train = raw.train_dataset.images.double() / 255
    assert np.allclose(raw.mean, train.mean(dim=(0, 2, 3)), atol=1e-6)
    assert np.allclose(raw.std, train.std(dim=(0, 2, 3), correction=0), atol=1e-6)
    # grey photographs are repeated to 3 channels, colour ones are not
    camera, astronaut = raw.train_dataset.images[4], raw.train_dataset.images[0]
    assert torch.equal(camera[0], camera[1]) and torch.equal(camera[1], camera[2])
    assert not torch.equal(astronaut[0], astronaut[2])


def test_a_crop_is_the_pixels_of_its_pyramid_level_at_its_origin(raw):
    levels = pyramid(read_photo(scikit_image_data_dir() / "astronaut.png"), 32)
    assert tuple(level.shape[1:] for level in levels) == raw.level_shapes[0]
    for split, dataset in (("train", raw.train_dataset), ("test", raw.test_dataset)):
        for i in range(0, 11 * 128, 11 * 16):  # class 0: astronaut
            label, level, top, left = raw.origins[split][i].tolist()
            assert label == 0
            crop = levels[level][:, top : top + 32, left : left + 32]
            assert np.array_equal(dataset.images[i].numpy(), crop)
        assert len({tuple(row) for row in raw.origins[split].tolist()}) == 11 * 128  # no crop twice
    assert len(set(raw.origins["train"][:, 1].tolist())) > 4  # several scales


def photo_boxes(datamodule, origins, reach=3):
    """Per crop: (top, bottom, left, right) of the photo pixels it is computed from, in photo
    coordinates: the crop widened by the Lanczos filter's ``reach`` level pixels, times the level's scale."""
    size = datamodule.image_size
    shapes = [datamodule.level_shapes[label][level] for label, level in origins[:, :2].tolist()]
    photo = np.array([datamodule.level_shapes[label][-1] for label in origins[:, 0].tolist()], dtype=float)
    scale = photo / np.array(shapes, dtype=float)  # (rows, columns) per crop
    tops, lefts = origins[:, 2], origins[:, 3]
    return np.stack(
        [
            (tops - reach) * scale[:, 0],
            (tops + size + reach) * scale[:, 0],
            (lefts - reach) * scale[:, 1],
            (lefts + size + reach) * scale[:, 1],
        ],
        axis=1,
    )


def test_no_test_crop_overlaps_a_training_crop_at_any_level_or_scale(raw):
    train, test, size = raw.origins["train"], raw.origins["test"], 32
    same = (train[:, None, 0] == test[None, :, 0]) & (train[:, None, 1] == test[None, :, 1])  # label and level
    rows = (train[:, None, 2] < test[None, :, 2] + size) & (test[None, :, 2] < train[:, None, 2] + size)
    cols = (train[:, None, 3] < test[None, :, 3] + size) & (test[None, :, 3] < train[:, None, 3] + size)
    assert same.any() and not (same & rows & cols).any()
    # in the photo's own pixels, at any pair of levels: the photo pixels a training crop is computed
    # from (its pixels widened by the 3-pixel reach of the Lanczos filter) are not those of a test crop
    a, b = photo_boxes(raw, train), photo_boxes(raw, test)
    photo = train[:, None, 0] == test[None, :, 0]
    rows = (a[:, None, 0] < b[None, :, 1]) & (b[None, :, 0] < a[:, None, 1])
    cols = (a[:, None, 2] < b[None, :, 3]) & (b[None, :, 2] < a[:, None, 3])
    assert not (photo & rows & cols).any()
    # each of them lies inside one tile of its split's checkerboard squares
    tile = TILE_FACTOR * size
    assert raw.tile == tile and set(raw.flips) == {0, 1}  # seeded per photo: each split gets the top-left tile
    for split, origins in raw.origins.items():
        boxes = photo_boxes(raw, origins)
        assert (boxes[:, [0, 2]] >= 0).all()
        first, last = np.floor(boxes[:, [0, 2]] / tile), np.floor(np.nextafter(boxes[:, [1, 3]], 0) / tile)
        assert np.array_equal(first, last)
        tiles = [(label, int(row), int(col)) for label, (row, col) in zip(origins[:, 0].tolist(), first)]
        assert all(tile_split(row, col, raw.flips[label]) == split for label, row, col in tiles)
    assert GUARD > 3


@pytest.mark.parametrize("label", [0, 8])  # astronaut, clock_motion (its tiles at the bottom are cut short)
def test_the_crops_of_a_split_are_computed_from_its_own_tiles_only(raw, label):
    photo = read_photo(scikit_image_data_dir() / list(PHOTOS)[label])
    tile, height, width = raw.tile, *photo.shape[1:]
    rows, cols = np.arange(height)[:, None] // tile, np.arange(width)[None, :] // tile
    noise = np.random.default_rng(0).integers(0, 256, size=photo.shape, dtype=np.uint8)
    for split, dataset in (("train", raw.train_dataset), ("test", raw.test_dataset)):
        mine = (rows + cols + raw.flips[label]) % 2 == (0 if split == "train" else 1)
        levels = pyramid(np.where(mine, photo, noise), 32)  # every other tile replaced by noise
        for i in range(label, len(dataset), 11):
            _, level, top, left = raw.origins[split][i].tolist()
            assert np.array_equal(dataset.images[i].numpy(), levels[level][:, top : top + 32, left : left + 32])


def test_both_splits_draw_crops_from_every_half_of_every_photo_and_several_scales(raw):
    # a checkerboard, not a split by halves: each split's crops of a photo have their centres on
    # both sides of its middle column and of its middle row
    for split, origins in raw.origins.items():
        boxes = photo_boxes(raw, origins, reach=0)
        centres = (boxes[:, [0, 2]] + boxes[:, [1, 3]]) / 2
        for label in range(11):
            height, width = raw.level_shapes[label][-1]
            mine = centres[origins[:, 0] == label]
            for axis, middle in ((0, height / 2), (1, width / 2)):
                assert 0.15 < (mine[:, axis] < middle).mean() < 0.85, (split, label, axis)
            assert len(set(origins[origins[:, 0] == label, 1].tolist())) >= 4  # scales


def test_two_modules_with_one_seed_give_identical_tensors_and_another_seed_differs(small):
    again = PhotoCropsDataModule(per_class_train=8, per_class_test=4, batch_size=16, seed=3)
    again.setup()
    assert again.mean == small.mean and again.std == small.std
    for name in ("train_dataset", "test_dataset"):
        first, second = getattr(small, name), getattr(again, name)
        assert torch.equal(torch.stack([x for x, _ in first]), torch.stack([x for x, _ in second]))
        assert torch.equal(first.targets, second.targets)
    assert len(small.train_dataset) == 88 and len(small.test_dataset) == 44
    images, _ = next(iter(small.train_dataloader()))
    assert images.shape == (16, 3, 32, 32)
    assert images.mean().abs() < 0.5  # normalised with the training crops' mean/std
    other = PhotoCropsDataModule(per_class_train=8, per_class_test=4, seed=4, val_fraction=0.25)
    other.setup()
    assert not np.array_equal(other.origins["train"], small.origins["train"])
    assert len(other.train_dataset) == 66 and len(other.val_dataset) == 22 and len(other.test_dataset) == 44


def test_a_convnet_trains_on_it_and_idlg_attacks_one_of_its_training_images(small):
    from lightning_gp.attacks import IDLG
    from lightning_gp.audit import attack_record, tap_fedsgd_round
    from lightning_gp.audit.rounds import public_examples
    from lightning_gp.models import ConvNet, ImageClassifier

    torch.manual_seed(0)
    net = ConvNet(num_classes=small.num_classes, in_channels=3, image_size=32)
    trainer = L.Trainer(
        max_steps=2, limit_val_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    before = [p.detach().clone() for p in net.parameters()]
    trainer.fit(ImageClassifier(net, optimizer="adam", lr=1e-3), small)
    assert any(not torch.equal(b, p) for b, p in zip(before, net.parameters()))

    records, model, _ = tap_fedsgd_round(net, small, indices=[[3]], num_clients=4)
    public = public_examples(small, 22)
    assert set(public[1].tolist()) == set(range(11))  # the public prefix holds every class
    result = attack_record(
        records[0],
        model,
        IDLG(iterations=2, max_iter=2),
        num_classes=small.num_classes,
        mean=small.mean,
        std=small.std,
        lpips=False,
        public_data=public,
    )
    assert result.reconstruction.images.shape == (1, 3, 32, 32)
    assert int(result.reconstruction.labels[0]) == 3  # label of training image 3 (class 3: retina)
    assert np.isfinite(result.report.means["psnr"])


def test_without_scikit_image_the_error_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "skimage" else real(name, *a))
    with pytest.raises(PhotosNotFoundError, match=r"pip install 'lightning-gp\[test\]'") as info:
        PhotoCropsDataModule()
    assert isinstance(info.value, DatasetNotFoundError) and isinstance(info.value, FileNotFoundError)
    assert "data_dir=" in str(info.value)


def test_a_missing_or_unreadable_photograph_is_named(tmp_path):
    names = list(PHOTOS)
    for name in names[:-2]:
        (tmp_path / name).write_bytes(b"not an image")
    with pytest.raises(PhotosNotFoundError, match=r"chelsea\.png, coffee\.png") as info:
        PhotoCropsDataModule(data_dir=str(tmp_path))
    assert "astronaut.png" not in str(info.value).split("(expected")[0]
    with pytest.raises(PhotosNotFoundError, match="not a folder"):
        PhotoCropsDataModule(data_dir=str(tmp_path / "nowhere"))
    for name in names[-2:]:
        (tmp_path / name).write_bytes(b"not an image")
    with pytest.raises(CorruptDatasetError, match=r"astronaut\.png cannot be read"):
        PhotoCropsDataModule(data_dir=tmp_path)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"image_size": 7}, "image_size"),
        ({"image_size": 32.0}, "image_size"),
        ({"image_size": True}, "image_size"),
        ({"per_class_train": 0}, "per_class_train"),
        ({"per_class_train": 2.5}, "per_class_train"),
        ({"per_class_test": 0}, "per_class_test"),
        ({"per_class_test": "8"}, "per_class_test"),
        ({"seed": -1}, "seed"),
    ],
)
def test_a_bad_argument_is_a_value_error_that_names_it(kwargs, name, monkeypatch):
    # checked before any photograph is looked for: the same error with or without scikit-image
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "skimage" else real(name, *a))
    with pytest.raises(ValueError, match=name):
        PhotoCropsDataModule(**kwargs)


def test_an_image_size_the_smallest_photograph_cannot_split_is_refused():
    # clock_motion.png is 300 x 400: 300 rows hold a tile of 4 * 58 and a second one of 68 rows, which
    # fits a 58-pixel crop 4 pixels from its borders; with 59, the second has 64 rows and needs 67
    with pytest.raises(ValueError, match=r"image_size must be at most 58 .*clock_motion\.png .*2 x 2 tiles"):
        PhotoCropsDataModule(image_size=59)
    largest = PhotoCropsDataModule(image_size=58, per_class_train=2, per_class_test=2)
    assert largest.tile == 232
    for origins in largest.origins.values():
        assert set(origins[:, 0].tolist()) == set(range(11))


def test_the_refiner_keeps_its_names_and_its_error_for_the_moved_photo_helpers(monkeypatch, tmp_path):
    from lightning_gp.refiner import training

    assert list(training.TRAIN_PHOTOS) + list(training.HELDOUT_PHOTOS) == list(PHOTOS)
    assert training.read_photo is read_photo and training._pyramid is pyramid
    assert training.scikit_image_photo_dir() == scikit_image_data_dir()
    with pytest.raises(training.TrainingImagesError, match=r"training photograph .*astronaut\.png is missing"):
        training.photo_images(data_dir=str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "skimage" else real(name, *a))
    with pytest.raises(training.TrainingImagesError, match=r"refiner-train"):
        training.scikit_image_photo_dir()
