"""Tests for lightning_gp.data: the built-in sample, the file readers, the datamodules and their errors."""

import dataclasses
import functools
import gzip
import hashlib
import http.server
import io
import pickle
import re
import struct
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.io import savemat

from lightning_gp.data import (
    FASHION_MNIST_CLASSES,
    CIFAR10DataModule,
    CIFAR100DataModule,
    CorruptDatasetError,
    DatasetNotFoundError,
    FashionMNISTDataModule,
    FashionMNISTSampleDataModule,
    ImageClassificationDataModule,
    ImageFolderDataModule,
    ImageTensorDataset,
    MNISTDataModule,
    SVHNDataModule,
)
from lightning_gp.data.builtin_sample import load_sample_arrays
from lightning_gp.data.download import fetch
from lightning_gp.data.locate import DATA_DIR_ENV, RemoteFile
from lightning_gp.data.readers import read_idx

FULL_FASHION = Path("/usr/share/datasets/fashion-mnist")
IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
needs_full_fashion = pytest.mark.skipif(
    not FULL_FASHION.is_dir(), reason="full Fashion-MNIST absent (apt-get install dataset-fashion-mnist)"
)


# ---------------------------------------------------------------------------------------------- helpers


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode ``array`` in the idx format (big-endian data, header 00 00 <type> <ndim> <dims>)."""
    code = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}
    header = bytes([0, 0, code[array.dtype.type], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx_set(folder: Path, n_train: int = 20, n_test: int = 10, gz: bool = True, seed: int = 0) -> dict:
    """Write the four idx files of a tiny MNIST-like set; return the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test)[::-1] % 10).astype(np.uint8),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        data = idx_bytes(array)
        (folder / (name + ".gz" if gz else name)).write_bytes(gzip.compress(data) if gz else data)
    return arrays


def write_cifar_batch(
    path: Path, n: int, label_key: str, num_classes: int, seed: int, bytes_keys: bool = False
) -> dict:
    rng = np.random.default_rng(seed)
    batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), label_key: list(rng.integers(0, num_classes, n))}
    batch[label_key] = [int(v) for v in batch[label_key]]
    stored = {k.encode(): v for k, v in batch.items()} if bytes_keys else batch
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(stored))
    return batch


def write_cifar10(folder: Path, n: int = 4) -> dict[str, dict]:
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    # The last batch uses bytes keys, as Python-2 pickles decoded with encoding="bytes" would.
    return {
        name: write_cifar_batch(folder / name, n, "labels", 10, i, bytes_keys=i == 5) for i, name in enumerate(names)
    }


def all_items(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(images), torch.stack(labels)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Undo the [0, 1] scaling of un-normalised images."""
    return (images * 255).round().to(torch.uint8).numpy()


def png(path: Path, color: tuple[int, int, int], size: tuple[int, int] = (10, 6)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


@pytest.fixture(scope="module")
def sample() -> FashionMNISTSampleDataModule:
    dm = FashionMNISTSampleDataModule()
    dm.setup()
    return dm


@pytest.fixture
def http_dir(tmp_path):
    """A local HTTP server (127.0.0.1, no outside network) serving a temporary folder; yields (folder, url)."""
    root = tmp_path / "served"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


# ------------------------------------------------------------------------------------ built-in sample


def test_sample_sizes_shapes_and_balance(sample) -> None:
    assert (len(sample.train_dataset), len(sample.test_dataset)) == (3000, 1000)
    assert sample.val_dataset is sample.test_dataset  # val_fraction=0: validation uses the test split
    assert sample.num_classes == 10 and sample.image_shape == (1, 28, 28)
    assert sample.classes == FASHION_MNIST_CLASSES and FASHION_MNIST_CLASSES[9] == "Ankle boot"
    assert torch.bincount(sample.train_dataset.targets).tolist() == [300] * 10
    assert torch.bincount(sample.test_dataset.targets).tolist() == [100] * 10
    image, target = sample.train_dataset[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert target.dtype == torch.int64 and target.ndim == 0
    assert sample.train_dataset.images.dtype == torch.uint8  # stored compactly, converted per item


def test_sample_is_normalised_and_targets_match_items(sample) -> None:
    images, labels = all_items(sample.train_dataset)
    assert abs(images.mean().item()) < 0.05 and abs(images.std().item() - 1) < 0.05
    assert torch.equal(labels, sample.train_dataset.targets)
    assert sample.train_dataset.targets.dtype == torch.int64
    assert torch.equal(all_items(sample.test_dataset)[1], sample.test_dataset.targets)

    raw = FashionMNISTSampleDataModule(normalize=False)
    raw.setup()
    x = raw.train_dataset[5][0]
    assert x.min() >= 0 and x.max() <= 1
    assert torch.allclose(images[5], (x - 0.2860) / 0.3530, atol=1e-6)


@needs_full_fashion
def test_sample_follows_the_selection_rule() -> None:
    sample_arrays = load_sample_arrays()
    for split, per_class in (("train", 300), ("t10k", 100)):
        full_x = read_idx(FULL_FASHION / f"{split}-images-idx3-ubyte.gz")
        full_y = read_idx(FULL_FASHION / f"{split}-labels-idx1-ubyte.gz")
        picked = np.sort(np.concatenate([np.flatnonzero(full_y == c)[:per_class] for c in range(10)]))
        key = "train" if split == "train" else "test"
        images, labels = sample_arrays[f"{key}_images"], sample_arrays[f"{key}_labels"]
        assert images.dtype == np.uint8 and labels.dtype == np.int64
        np.testing.assert_array_equal(images, full_x[picked][:, None])
        np.testing.assert_array_equal(labels, full_y[picked])


# --------------------------------------------------------------------------------------- idx format


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "plain"])
def test_idx_datamodule_round_trip(tmp_path, gz) -> None:
    arrays = write_idx_set(tmp_path / "fm", gz=gz)
    dm = FashionMNISTDataModule(data_dir=str(tmp_path / "fm"), normalize=False)
    dm.setup()
    images, labels = all_items(dm.train_dataset)
    assert images.shape == (20, 1, 28, 28)
    np.testing.assert_array_equal(to_uint8(images[:, 0]), arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(labels.numpy(), arrays["train-labels-idx1-ubyte"])
    assert torch.equal(dm.test_dataset.targets, torch.from_numpy(arrays["t10k-labels-idx1-ubyte"]).long())

    mnist = MNISTDataModule(data_dir=str(tmp_path / "fm"))  # same format, MNIST's statistics
    mnist.setup()
    expected = (arrays["t10k-images-idx3-ubyte"][3] / 255.0 - 0.1307) / 0.3081
    np.testing.assert_allclose(mnist.test_dataset[3][0][0].numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.float32, np.float64])
def test_read_idx_decodes_every_type_code(tmp_path, dtype) -> None:
    array = (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype) if dtype != np.uint8 else np.arange(24, dtype=np.uint8)
    (tmp_path / "a.idx").write_bytes(idx_bytes(array))
    out = read_idx(tmp_path / "a.idx")
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative
    np.testing.assert_array_equal(out, array)


def test_idx_bad_magic_wrong_size_and_truncated_gzip(tmp_path) -> None:
    bad = tmp_path / "bad-magic"
    bad.write_bytes(b"\x12\x34\x08\x01" + struct.pack(">I", 1) + b"\x00")
    with pytest.raises(CorruptDatasetError, match=r"bad-magic.*magic number"):
        read_idx(bad)

    short = tmp_path / "short"
    short.write_bytes(idx_bytes(np.zeros((3, 2, 2), np.uint8))[:-1])
    with pytest.raises(CorruptDatasetError, match=r"short.*shape"):
        read_idx(short)

    truncated = tmp_path / "train-images-idx3-ubyte.gz"
    noise = np.random.default_rng(0).integers(0, 256, (50, 28, 28), dtype=np.uint8)
    truncated.write_bytes(gzip.compress(idx_bytes(noise))[:5000])
    with pytest.raises(CorruptDatasetError, match=r"train-images-idx3-ubyte.gz.*gzip"):
        read_idx(truncated)


def test_idx_labels_must_match_images(tmp_path) -> None:
    write_idx_set(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.zeros(3, np.uint8))))
    with pytest.raises(CorruptDatasetError, match=r"t10k-labels-idx1-ubyte.gz.*10 labels"):
        FashionMNISTDataModule(data_dir=str(tmp_path)).setup()


def test_missing_directory_names_dir_and_every_file(tmp_path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetNotFoundError) as info:
        FashionMNISTDataModule(data_dir=str(missing)).setup()
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert str(missing) in message and "apt-get install dataset-fashion-mnist" in message
    assert all(name + ".gz" in message for name in IDX_NAMES)
    assert not missing.exists()  # nothing is created or downloaded without download=True


def test_partially_missing_files_are_listed(tmp_path) -> None:
    write_idx_set(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(DatasetNotFoundError, match=r"missing: t10k-images-idx3-ubyte.gz\)"):
        MNISTDataModule(data_dir=str(tmp_path)).setup()


def test_default_search_uses_the_environment_variable(tmp_path, monkeypatch) -> None:
    write_idx_set(tmp_path / "fashion-mnist", n_train=7, n_test=3)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    dm = FashionMNISTDataModule()
    dm.setup()
    assert (len(dm.train_dataset), len(dm.test_dataset)) == (7, 3)

    with pytest.raises(DatasetNotFoundError, match=str(tmp_path / "mnist")):
        MNISTDataModule().setup()  # MNIST has no system folder: only the variable's folder is searched


@needs_full_fashion
def test_full_fashion_mnist_found_by_itself(monkeypatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    dm = FashionMNISTDataModule(batch_size=256)
    dm.setup()
    assert (len(dm.train_dataset), len(dm.test_dataset)) == (60000, 10000)
    assert torch.bincount(dm.train_dataset.targets).tolist() == [6000] * 10
    images, _ = next(iter(dm.test_dataloader()))
    assert images.shape == (256, 1, 28, 28)


# ------------------------------------------------------------------------------------ CIFAR and SVHN


@pytest.mark.parametrize("layout", ["parent", "batches-folder"])
def test_cifar10_both_layouts(tmp_path, layout) -> None:
    batches = write_cifar10(tmp_path / "cifar-10-batches-py")
    data_dir = tmp_path if layout == "parent" else tmp_path / "cifar-10-batches-py"
    dm = CIFAR10DataModule(str(data_dir), normalize=False)
    dm.setup()
    assert (len(dm.train_dataset), len(dm.test_dataset)) == (20, 4)
    assert dm.image_shape == (3, 32, 32) and dm.num_classes == 10
    first = batches["data_batch_1"]
    image, target = dm.train_dataset[0]
    # CIFAR rows are 1024 red, 1024 green, 1024 blue values, each row-major 32x32.
    np.testing.assert_array_equal(to_uint8(image), first["data"][0].reshape(3, 32, 32))
    assert target.item() == first["labels"][0]
    expected_targets = [label for i in range(1, 6) for label in batches[f"data_batch_{i}"]["labels"]]
    assert dm.train_dataset.targets.tolist() == expected_targets
    assert dm.test_dataset.targets.tolist() == batches["test_batch"]["labels"]


def test_cifar100_fine_labels_and_normalisation(tmp_path) -> None:
    folder = tmp_path / "cifar-100-python"
    train = write_cifar_batch(folder / "train", 6, "fine_labels", 100, 0)
    test = write_cifar_batch(folder / "test", 3, "fine_labels", 100, 1)
    dm = CIFAR100DataModule(data_dir=str(tmp_path))
    dm.setup()
    assert dm.num_classes == 100
    assert dm.train_dataset.targets.tolist() == train["fine_labels"]
    assert dm.test_dataset.targets.tolist() == test["fine_labels"]
    x = dm.test_dataset[2][0]
    mean, std = torch.tensor(dm.mean).view(3, 1, 1), torch.tensor(dm.std).view(3, 1, 1)
    expected = (torch.from_numpy(test["data"][2].reshape(3, 32, 32)).float() / 255 - mean) / std
    assert torch.allclose(x, expected, atol=1e-5)


class _Exploit:
    def __reduce__(self):
        return (exec, ("raise SystemExit('pickle code ran')",))


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"not a pickle at all", "not a readable CIFAR batch"),
        (pickle.dumps({"data": np.zeros((2, 3072), np.uint8)}), r"lacks key\(s\) \['labels'\]"),
        (pickle.dumps({"data": np.zeros((2, 10), np.uint8), "labels": [0, 1]}), r"uint8 \[N, 3072\]"),
        (pickle.dumps({"data": np.zeros((2, 3072), np.uint8), "labels": [0, 12]}), r"labels must lie in \[0, 10\)"),
        (pickle.dumps(_Exploit()), "refusing to load builtins.exec"),
    ],
    ids=["garbage", "missing-key", "wrong-size", "label-range", "code"],
)
def test_cifar_corrupt_batches(tmp_path, content, match) -> None:
    write_cifar10(tmp_path)
    (tmp_path / "data_batch_3").write_bytes(content)
    with pytest.raises(CorruptDatasetError, match=f"data_batch_3.*{match}"):
        CIFAR10DataModule(str(tmp_path)).setup()


def test_cifar_missing_files_explain_where_they_come_from(tmp_path) -> None:
    with pytest.raises(DatasetNotFoundError) as info:
        CIFAR10DataModule(str(tmp_path)).setup()
    message = str(info.value)
    assert str(tmp_path / "cifar-10-batches-py") in message and "test_batch" in message
    assert "cifar-10-python.tar.gz" in message and "download=True" in message


def test_svhn_from_mat_maps_label_10_to_0(tmp_path) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (32, 32, 3, 5), dtype=np.uint8)
    y = np.array([[10], [1], [2], [10], [9]], dtype=np.uint8)
    savemat(tmp_path / "train_32x32.mat", {"X": x, "y": y})
    savemat(tmp_path / "test_32x32.mat", {"X": x[..., :2], "y": y[:2]})
    dm = SVHNDataModule(str(tmp_path), normalize=False)
    dm.setup()
    assert dm.train_dataset.targets.tolist() == [0, 1, 2, 0, 9]
    assert dm.test_dataset.targets.tolist() == [0, 1]
    image = dm.train_dataset[4][0]
    assert image.shape == (3, 32, 32)
    np.testing.assert_array_equal(to_uint8(image), x[..., 4].transpose(2, 0, 1))


def test_svhn_mat_without_x_is_corrupt(tmp_path) -> None:
    savemat(tmp_path / "train_32x32.mat", {"y": np.ones((3, 1))})
    savemat(tmp_path / "test_32x32.mat", {"X": np.zeros((32, 32, 3, 1), np.uint8), "y": np.ones((1, 1))})
    with pytest.raises(CorruptDatasetError, match=r"train_32x32.mat.*lacks variable\(s\) \['X'\]"):
        SVHNDataModule(str(tmp_path)).setup()


# --------------------------------------------------------------------------------------- image folder


def test_image_folder_with_train_and_test_folders(tmp_path) -> None:
    colors = {"zebra": (250, 0, 0), "apple": (0, 250, 0), "mango": (0, 0, 250)}
    for split, count in (("train", 2), ("test", 1)):
        for name, color in colors.items():
            for i in range(count):
                png(tmp_path / split / name / f"{i}.png", color)
    (tmp_path / "train" / "apple" / "notes.txt").write_text("not an image")
    dm = ImageFolderDataModule(str(tmp_path), image_size=8, normalize=False)
    dm.setup()
    assert dm.classes == ("apple", "mango", "zebra") and dm.num_classes == 3
    assert dm.class_to_idx == {"apple": 0, "mango": 1, "zebra": 2}
    assert dm.train_dataset.targets.tolist() == [0, 0, 1, 1, 2, 2]
    assert dm.test_dataset.targets.tolist() == [0, 1, 2]
    image, target = dm.test_dataset[2]  # zebra: red
    assert image.shape == (3, 8, 8) == dm.image_shape and target.item() == 2
    assert torch.allclose(image[:, 0, 0], torch.tensor([250, 0, 0]) / 255.0)

    grey = ImageFolderDataModule(str(tmp_path), image_size=5, grayscale=True)
    grey.setup()
    assert grey.train_dataset[0][0].shape == (1, 5, 5) and grey.mean == (0.5,)


def test_image_folder_flat_layout_gets_a_seeded_test_split(tmp_path) -> None:
    for name, color in (("b", (0, 0, 0)), ("a", (255, 255, 255))):
        for i in range(5):
            png(tmp_path / name / f"{i}.png", color)

    def split(seed):
        dm = ImageFolderDataModule(str(tmp_path), image_size=4, test_fraction=0.3, seed=seed)
        dm.setup()
        return [str(p) for p in dm.train_dataset.paths], [str(p) for p in dm.test_dataset.paths]

    train, test = split(0)
    assert len(test) == 3 and len(train) == 7 and not set(train) & set(test)
    assert split(0) == (train, test) and split(1) != (train, test)

    dm = ImageFolderDataModule(str(tmp_path), image_size=4)
    dm.setup()
    image = dm.train_dataset[0][0]  # class "a" (white) is label 0 after sorting
    assert dm.train_dataset.targets[0] == 0 and torch.allclose(image, torch.ones_like(image))  # (1-0.5)/0.5


def test_image_folder_compute_stats(tmp_path) -> None:
    png(tmp_path / "x" / "0.png", (255, 0, 51))
    png(tmp_path / "x" / "1.png", (255, 0, 51))
    png(tmp_path / "y" / "0.png", (0, 0, 51))
    png(tmp_path / "y" / "1.png", (0, 0, 51))
    dm = ImageFolderDataModule(str(tmp_path), image_size=4, test_fraction=0.5, compute_stats=True)
    dm.setup()
    pool = dm.train_dataset.targets.tolist()  # stats come from the training pool only
    red = sum(1 for t in pool if t == 0) / len(pool)
    assert dm.mean == pytest.approx((red, 0.0, 0.2), abs=1e-6)
    assert dm.std[0] == pytest.approx((red * (1 - red)) ** 0.5, abs=1e-6)
    assert dm.std[1] == pytest.approx(1e-6) and dm.std[2] == pytest.approx(1e-6)


def test_image_folder_errors(tmp_path) -> None:
    with pytest.raises(DatasetNotFoundError, match=f"{tmp_path / 'none'} does not exist"):
        ImageFolderDataModule(str(tmp_path / "none")).setup()
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(DatasetNotFoundError, match="no class folders with images"):
        ImageFolderDataModule(str(tmp_path / "empty")).setup()
    png(tmp_path / "odd" / "train" / "cat" / "0.png", (1, 2, 3))
    png(tmp_path / "odd" / "val" / "dog" / "0.png", (1, 2, 3))
    with pytest.raises(CorruptDatasetError, match=r"\['dog'\] are not among the training classes"):
        ImageFolderDataModule(str(tmp_path / "odd")).setup()
    (tmp_path / "broken" / "cat").mkdir(parents=True)
    for i in range(2):
        (tmp_path / "broken" / "cat" / f"{i}.png").write_bytes(b"no png")
    dm = ImageFolderDataModule(str(tmp_path / "broken"))
    dm.setup()  # images are decoded on access
    with pytest.raises(CorruptDatasetError, match=f"{dm.train_dataset.paths[0]}: cannot read image"):
        dm.train_dataset[0]


# ------------------------------------------------------------------- splits, loaders and arguments


def test_val_fraction_holds_out_a_seeded_disjoint_subset(sample) -> None:
    def split(seed):
        dm = FashionMNISTSampleDataModule(val_fraction=0.1, seed=seed)
        dm.setup()
        return dm

    dm = split(3)
    train_idx, val_idx = dm.train_dataset.indices, dm.val_dataset.indices
    assert (len(train_idx), len(val_idx)) == (2700, 300)
    assert not set(train_idx) & set(val_idx) and sorted(train_idx + val_idx) == list(range(3000))
    assert dm.test_dataset is not dm.val_dataset and len(dm.test_dataset) == 1000
    assert torch.equal(dm.val_dataset.targets, sample.train_dataset.targets[val_idx])
    assert torch.equal(all_items(dm.val_dataset)[1], dm.val_dataset.targets)
    assert torch.equal(dm.val_dataset[0][0], sample.train_dataset[val_idx[0]][0])
    assert split(3).val_dataset.indices == val_idx and split(4).val_dataset.indices != val_idx


def test_train_loader_is_deterministic_under_the_seed() -> None:
    def order(seed, calls=1):
        dm = FashionMNISTSampleDataModule(batch_size=500, seed=seed)
        dm.setup()
        loader = dm.train_dataloader()
        return [torch.cat([y for _, y in loader]) for _ in range(calls)]

    first, second_epoch = order(0, calls=2)
    assert torch.equal(first, order(0)[0])  # a fresh module with the same seed replays the order
    assert not torch.equal(first, order(1)[0])
    assert not torch.equal(first, second_epoch)  # epochs still differ
    assert sorted(first.tolist()) == [c for c in range(10) for _ in range(300)]


def test_val_and_test_loaders_keep_dataset_order(sample) -> None:
    labels = torch.cat([y for _, y in sample.test_dataloader()])
    assert torch.equal(labels, sample.test_dataset.targets)
    x, y = next(iter(sample.val_dataloader()))
    assert x.shape == (64, 1, 28, 28) and torch.equal(y, sample.test_dataset.targets[:64])


def test_loaders_set_up_the_module_when_needed() -> None:
    dm = FashionMNISTSampleDataModule(batch_size=8)
    assert dm.train_dataset is None
    assert next(iter(dm.test_dataloader()))[0].shape == (8, 1, 28, 28)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": -0.1}, "val_fraction"),
    ],
)
def test_arguments_are_validated(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        FashionMNISTSampleDataModule(**kwargs)


def test_image_tensor_dataset_accepts_float_images_and_checks_channels() -> None:
    images = torch.rand(4, 3, 2, 2)
    ds = ImageTensorDataset(images, torch.tensor([0, 1, 2, 3]), mean=(0.5,) * 3, std=(0.25,) * 3)
    assert torch.allclose(ds[1][0], (images[1] - 0.5) / 0.25)
    assert torch.equal(images, images.clone())  # normalising never writes into the stored images
    with pytest.raises(ValueError, match="mean needs one value per channel"):
        ImageTensorDataset(images, torch.zeros(4, dtype=torch.long), mean=(0.5,), std=(0.5,) * 3)
    with pytest.raises(ValueError, match="targets must be"):
        ImageTensorDataset(images, torch.zeros(3, dtype=torch.long), mean=(0.5,) * 3, std=(0.5,) * 3)


def test_datamodules_expose_typed_signatures_for_the_cli() -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(FashionMNISTDataModule, "data")
    cfg = parser.parse_args(["--data.batch_size=32", "--data.val_fraction=0.2", "--data.mirror=http://m/"])
    assert (cfg.data.batch_size, cfg.data.val_fraction, cfg.data.mirror) == (32, 0.2, "http://m/")
    assert cfg.data.data_dir is None and cfg.data.download is False
    assert issubclass(ImageFolderDataModule, ImageClassificationDataModule)


# -------------------------------------------------------------------------------------------- download


def test_download_from_an_unreachable_mirror_fails_fast_and_clearly(tmp_path, monkeypatch) -> None:
    # "Fast" without a clock: one connection attempt with a finite timeout, then the error. A retry
    # loop, a backoff sleep, trying the other three files after the first failed, or a missing/None
    # timeout (a blackholed mirror would then hang forever) each fail one of the checks below.
    from lightning_gp.data import download

    attempts, sleeps = [], []
    real_urlopen = download.urllib.request.urlopen

    def counting_urlopen(url, *args, **kwargs):
        attempts.append((url, kwargs.get("timeout", args[1] if len(args) > 1 else None)))
        return real_urlopen(url, *args, **kwargs)  # the real refusal from a closed local port

    monkeypatch.setattr(download.urllib.request, "urlopen", counting_urlopen)
    monkeypatch.setattr(time, "sleep", lambda seconds: sleeps.append(seconds))
    dm = FashionMNISTDataModule(data_dir=str(tmp_path / "fm"), download=True, mirror="http://127.0.0.1:9/")
    with pytest.raises(RuntimeError) as info:
        dm.prepare_data()
    assert len(attempts) == 1, attempts
    ((url, timeout),) = attempts
    assert url.startswith("http://127.0.0.1:9/")
    assert isinstance(timeout, (int, float)) and 0 < timeout <= download.DOWNLOAD_TIMEOUT_S
    assert sleeps == []
    message = str(info.value)
    assert "Downloading Fashion-MNIST from http://127.0.0.1:9/ failed" in message
    assert str(tmp_path / "fm") in message and all(name + ".gz" in message for name in IDX_NAMES)
    assert not list((tmp_path / "fm").glob("*.part"))


def test_download_needs_somewhere_to_put_the_files(monkeypatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=re.escape(f"download=True needs a data_dir (or ${DATA_DIR_ENV})")):
        MNISTDataModule(download=True, mirror="http://127.0.0.1:9/").prepare_data()


def test_download_fetches_verifies_and_uses_the_files(tmp_path, http_dir, monkeypatch) -> None:
    served, url = http_dir
    arrays = write_idx_set(served, n_train=5, n_test=2)
    md5 = {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in served.iterdir()}
    spec = MNISTDataModule.dataset_files
    remote = tuple(RemoteFile(r.name, md5[r.name]) for r in spec.remote)
    monkeypatch.setattr(MNISTDataModule, "dataset_files", dataclasses.replace(spec, remote=remote))
    dm = MNISTDataModule(data_dir=str(tmp_path / "mnist"), download=True, mirror=url)
    dm.prepare_data()
    dm.setup()
    assert sorted(p.name for p in (tmp_path / "mnist").iterdir()) == sorted(md5)
    assert dm.train_dataset.targets.tolist() == arrays["train-labels-idx1-ubyte"].tolist()

    with pytest.raises(RuntimeError, match=r"does not match the expected 0+"):
        fetch(url + "t10k-labels-idx1-ubyte.gz", tmp_path / "x.gz", md5="0" * 32)
    assert not (tmp_path / "x.gz").exists()


def test_download_extracts_the_cifar_archive(tmp_path, http_dir, monkeypatch) -> None:
    served, url = http_dir
    write_cifar10(tmp_path / "src" / "cifar-10-batches-py", n=2)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    (served / "cifar-10-python.tar.gz").write_bytes(buffer.getvalue())
    spec = CIFAR10DataModule.dataset_files
    remote = (RemoteFile("cifar-10-python.tar.gz", hashlib.md5(buffer.getvalue()).hexdigest(), archive=True),)
    monkeypatch.setattr(CIFAR10DataModule, "dataset_files", dataclasses.replace(spec, remote=remote))
    dm = CIFAR10DataModule(str(tmp_path / "data"), download=True, mirror=url)
    dm.setup()
    assert len(dm.train_dataset) == 10 and (tmp_path / "data" / "cifar-10-batches-py" / "test_batch").is_file()
