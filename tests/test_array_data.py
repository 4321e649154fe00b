"""Bring your own data: ArrayDataModule from arrays, tensors and .npz files, its checks, and where it runs.

Also: a 0-image idx file is a clear error at setup, and the docs' "Bring your own data"
example runs exactly as written.
"""

import re
import struct
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from lightning_gp.data import ArrayDataModule, CorruptDatasetError, DatasetNotFoundError, FashionMNISTDataModule
from lightning_gp.federated import FederatedSimulation
from lightning_gp.models import LeNetZhu

ROOT = Path(__file__).resolve().parents[1]
README_MARKER = "<!-- docs example: bring your own data"

pytestmark = pytest.mark.usefixtures("one_thread")


def arrays(n: int = 30, shape: tuple[int, ...] = (3, 8, 8), classes: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    y = (np.arange(n) % classes).astype(np.int64)
    return x, y


def all_items(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(images), torch.stack(labels)


# ------------------------------------------------------------------------------ arrays and tensors


def test_uint8_arrays_with_a_test_split_round_trip() -> None:
    x, y = arrays(20)
    x_test, y_test = arrays(6, seed=1)
    dm = ArrayDataModule(x, y, x_test, y_test, normalize=False, batch_size=4)
    dm.setup("fit")
    assert dm.image_shape == (3, 8, 8) and dm.num_classes == 4 and dm.classes is None
    images, labels = all_items(dm.train_dataset)
    torch.testing.assert_close(images, torch.from_numpy(x).float() / 255, rtol=0, atol=0)
    assert labels.dtype == torch.int64 and labels.tolist() == y.tolist()
    assert dm.train_dataset.targets.tolist() == y.tolist()
    assert dm.test_dataset.targets.tolist() == y_test.tolist() and dm.val_dataset is dm.test_dataset
    x[0] = 0  # the module holds its own copy, checked once
    assert torch.equal(dm.train_dataset[0][0], images[0])
    batch_x, batch_y = next(iter(dm.train_dataloader()))
    assert batch_x.shape == (4, 3, 8, 8) and batch_y.shape == (4,)


def test_float_tensors_and_one_channel_images() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(12, 5, 7, generator=g, dtype=torch.float64)  # [N, H, W]: one channel
    y = torch.arange(12) % 3
    dm = ArrayDataModule(x, y, x_test=x[:4], y_test=y[:4], mean=(0.5,), std=(0.25,))
    dm.setup("fit")
    assert dm.image_shape == (1, 5, 7) and dm.num_classes == 3
    image, label = dm.train_dataset[7]
    expected = (x[7].float() - 0.5) / 0.25
    torch.testing.assert_close(image, expected[None], rtol=0, atol=1e-6)
    assert label.item() == 1


def test_default_mean_and_std_are_the_training_images_statistics() -> None:
    x, y = arrays(40)
    dm = ArrayDataModule(x, y, test_fraction=0.25, seed=3)
    kept, held = dm.holdout
    assert len(held) == 10 and sorted(kept + held) == list(range(40))
    pixels = x[kept].astype(np.float64) / 255  # the training split only, not the held-out test images
    np.testing.assert_allclose(dm.mean, pixels.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(dm.std, pixels.std(axis=(0, 2, 3)), rtol=1e-9)
    dm.setup()
    assert dm.train_dataset.indices == kept and dm.test_dataset.indices == held
    assert torch.equal(dm.train_dataset.targets, torch.from_numpy(y[kept]))
    normalised, _ = all_items(dm.train_dataset)
    channel_mean = normalised.transpose(0, 1).reshape(3, -1).mean(dim=1)
    channel_std = normalised.transpose(0, 1).reshape(3, -1).std(dim=1, unbiased=False)
    torch.testing.assert_close(channel_mean, torch.zeros(3), rtol=0, atol=1e-5)
    torch.testing.assert_close(channel_std, torch.ones(3), rtol=0, atol=1e-5)
    assert ArrayDataModule(x, y, test_fraction=0.25, seed=3).holdout == (kept, held)
    assert ArrayDataModule(x, y, test_fraction=0.25, seed=4).holdout != (kept, held)


def test_constant_channel_gets_a_floored_std() -> None:
    x = np.zeros((10, 1, 4, 4), np.uint8)
    dm = ArrayDataModule(x, np.zeros(10, np.int64), num_classes=2)
    assert dm.mean == (0.0,) and dm.std == (1e-6,) and dm.num_classes == 2


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"x": "float255"}, ValueError, r"^x is floating point with values up to 255: .*\[0, 1\].*uint8"),
        ({"x": "normalised"}, ValueError, r"^x holds negative values .*normalised"),
        ({"x": "nan"}, ValueError, r"^x holds 1 NaN or infinite value"),
        ({"x": "int64"}, ValueError, r"^x must be uint8 .* got int64"),
        ({"x": "5d"}, ValueError, r"^x must be images \[N, C, H, W\] \(or \[N, H, W\]"),
        ({"x": "empty"}, ValueError, r"^x holds no images"),
        ({"y": "float"}, ValueError, r"^y must hold integer class labels, got float32"),
        ({"y": "2d"}, ValueError, r"^y must be 1-D integer labels"),
        ({"y": "short"}, ValueError, r"^y holds 29 labels but x holds 30 images"),
        ({"y": "negative"}, ValueError, r"^y must lie in \[0, num_classes=3\), found labels in \[-1, 2\]"),
        ({"num_classes": 3}, ValueError, r"^y must lie in \[0, num_classes=3\)"),
        ({"classes": ("a", "b")}, ValueError, r"^y must lie in \[0, num_classes=2\)"),
        ({"classes": ("a", "b", "c", "d"), "num_classes": 5}, ValueError, r"num_classes=5 disagrees .* classes"),
        ({"classes": "abcd"}, TypeError, r"^classes must be a sequence of class names"),
        ({"mean": (0.5,)}, ValueError, r"^mean needs one value per channel \(3\)"),
        ({"std": (0.2, 0.0, 0.2)}, ValueError, r"^std must be positive"),
        ({"x_test": "other_size", "y_test": "ok"}, ValueError, r"^x_test images are \[C, H, W\] = \(3, 4, 4\)"),
        ({"x_test": "ok"}, ValueError, r"^x_test was given without y_test"),
        ({"x": None}, ValueError, r"needs the training images x and labels y"),
        ({"path": "data.npz"}, ValueError, r"either path .* or the arrays, not both"),
        ({"test_fraction": 1.0}, ValueError, r"^test_fraction must be in \(0, 1\)"),
        ({"batch_size": 0}, ValueError, r"^batch_size must be a positive int"),
    ],
)
def test_bad_arguments_are_errors_naming_them(change: dict, error: type, match: str) -> None:
    x, y = arrays(30)
    variants = {
        "x": {
            "float255": x.astype(np.float32),
            "normalised": (x / 255.0 - 0.5) / 0.25,
            "nan": np.where(np.arange(x.size).reshape(x.shape) == 5, np.nan, x / 255.0),
            "int64": x.astype(np.int64),
            "5d": x[:, None],
            "empty": x[:0],
            None: None,
        },
        "y": {"float": y.astype(np.float32), "2d": y[:, None], "short": y[1:], "negative": y - 1},
        "x_test": {"other_size": x[:3, :, :4, :4], "ok": x[:3]},
        "y_test": {"ok": y[:3]},
    }
    kwargs = {"x": x, "y": y}
    for key, value in change.items():
        kwargs[key] = variants[key][value] if key in variants else value
    with pytest.raises(error, match=match):
        ArrayDataModule(**kwargs)


# ------------------------------------------------------------------------------------------- .npz


def test_npz_with_every_optional_array(tmp_path) -> None:
    x, y = arrays(16, shape=(1, 6, 6), classes=2)
    x_test, y_test = arrays(4, shape=(1, 6, 6), classes=2, seed=1)
    path = tmp_path / "mine.npz"
    np.savez(path, x=x, y=y, x_test=x_test, y_test=y_test, mean=[0.25], std=[0.5], classes=np.array(["no", "yes"]))
    dm = ArrayDataModule(path=str(path))
    assert (dm.mean, dm.std, dm.classes, dm.num_classes) == ((0.25,), (0.5,), ("no", "yes"), 2)
    dm.setup()
    expected = (torch.from_numpy(x_test[2]).float() / 255 - 0.25) / 0.5
    torch.testing.assert_close(dm.test_dataset[2][0], expected, rtol=0, atol=1e-6)
    assert dm.train_dataset.targets.tolist() == y.tolist()
    assert ArrayDataModule(path=str(path), mean=(0.5,)).mean == (0.5,)  # arguments take precedence


@pytest.mark.parametrize(
    "content, error, match",
    [
        (None, DatasetNotFoundError, r"the \.npz file .*missing\.npz does not exist"),
        ({"x": "x"}, CorruptDatasetError, r"mine\.npz: lacks array\(s\) \['y'\]; found \['x'\]"),
        ({"x": "x", "y": "y", "labels": "y"}, CorruptDatasetError, r"mine\.npz: unknown array\(s\) \['labels'\]"),
        ({"x": "x", "y": "y", "classes": "objects"}, CorruptDatasetError, r"mine\.npz: cannot read array 'classes'"),
        ({"x": "float255", "y": "y"}, CorruptDatasetError, r"mine\.npz\['x'\] is floating point with values up to"),
        ({"x": "x", "y": "y", "std": "zero"}, ValueError, r"mine\.npz\['std'\] must be positive"),
        ("garbage", CorruptDatasetError, r"mine\.npz: not a valid \.npz file \(neither an \.npz archive"),
    ],
    ids=["missing-file", "missing-key", "unknown-key", "object-array", "bad-array", "bad-std", "garbage"],
)
def test_npz_errors_name_the_file_and_array(tmp_path, content, error, match) -> None:
    x, y = arrays(10)
    values = {
        "x": x,
        "y": y,
        "float255": x.astype(np.float32),
        "objects": np.array(["a", 1], dtype=object),
        "zero": np.zeros(3),
    }
    path = tmp_path / "mine.npz"
    if content == "garbage":
        path.write_bytes(b"not a zip archive")
    elif content is not None:
        np.savez(path, **{key: values[name] for key, name in content.items()})
    else:
        path = tmp_path / "missing.npz"
    with pytest.raises(error, match=match) as info:
        ArrayDataModule(path=str(path))
    assert "pickle" not in str(info.value)  # never a hint to unpickle an untrusted file


# ------------------------------------------------------------------------- where the module runs


def test_federated_simulation_partitions_array_data_by_label() -> None:
    x, y = arrays(80, shape=(1, 12, 12), classes=4)
    dm = ArrayDataModule(x, y, batch_size=20)
    torch.manual_seed(0)
    simulation = FederatedSimulation(
        LeNetZhu(num_classes=4, in_channels=1, image_size=12),
        datamodule=dm,
        num_clients=4,
        clients_per_round=2,
        local_batch_size=3,
        partition="shards",
        shards_per_client=1,
    )
    trainer = L.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(simulation)
    assert trainer.global_step == 2
    targets = dm.train_dataset.targets
    for owned in simulation.client_indices:  # one label shard each: label-based partitions read targets
        assert len(owned) > 0 and len(set(targets[owned].tolist())) <= 2


def test_typed_signature_builds_the_module_from_a_cli_config(tmp_path) -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    x, y = arrays(12)
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(ArrayDataModule, "data")
    cfg = parser.parse_args(
        [f"--data.path={tmp_path / 'mine.npz'}", "--data.batch_size=4", "--data.mean=[0.5,0.5,0.5]"]
    )
    assert cfg.data.path == str(tmp_path / "mine.npz") and cfg.data.mean == (0.5, 0.5, 0.5)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    dm = instantiate(cfg).data
    assert isinstance(dm, ArrayDataModule) and dm.batch_size == 4 and dm.num_classes == 4


def test_lightning_cli_fits_a_classifier_on_an_npz(tmp_path, monkeypatch) -> None:
    from lightning_gp.cli import LightningGPCLI

    x, y = arrays(24, shape=(1, 12, 12), classes=3)
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    config = tmp_path / "fit.yaml"
    config.write_text(
        "model:\n"
        "  class_path: lightning_gp.models.ImageClassifier\n"
        "  init_args:\n"
        "    model: {class_path: lightning_gp.models.LeNetZhu, init_args: {num_classes: 3, image_size: 12}}\n"
        "data:\n"
        "  class_path: lightning_gp.data.ArrayDataModule\n"
        f"  init_args: {{path: {tmp_path / 'mine.npz'}, batch_size: 8}}\n"
        "trainer: {fast_dev_run: true, logger: false, enable_progress_bar: false, enable_model_summary: false}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-gp"])
    cli = LightningGPCLI(args=["fit", "--config", str(config)])
    assert isinstance(cli.datamodule, ArrayDataModule) and cli.datamodule.num_classes == 3
    assert cli.trainer.state.finished and cli.trainer.global_step == 1


# --------------------------------------------------------------------------- idx with zero images


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


@pytest.mark.parametrize("empty", ["train", "t10k"])
def test_an_idx_file_with_zero_images_is_a_clear_error_at_setup(tmp_path, empty) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "t10k"):
        n = 0 if split == empty else 5
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        (tmp_path / f"{split}-images-idx3-ubyte").write_bytes(idx_bytes(images))
        (tmp_path / f"{split}-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(n, np.uint8)))
    dm = FashionMNISTDataModule(data_dir=str(tmp_path))
    with pytest.raises(CorruptDatasetError, match=rf"{empty}-images-idx3-ubyte: holds no images .*\(0, 28, 28\)"):
        dm.setup()


# --------------------------------------------------------------------------------- README example


def readme_example() -> str:
    text = (ROOT / "docs" / "guide" / "data-and-models.md").read_text()
    assert README_MARKER in text, "the data page lost its bring-your-own-data example marker"
    match = re.search(r"```python\n(.*?)```", text[text.index(README_MARKER) :], re.DOTALL)
    assert match is not None
    return match.group(1)


def test_readme_bring_your_own_data_example_runs_as_written(tmp_path) -> None:
    code = readme_example()
    assert "ArrayDataModule" in code and "tap_fedsgd_round" in code
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, f"README example failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "Reconstruction report (InvertingGradients)" in result.stdout


@pytest.mark.parametrize("channels", [1, 3])
def test_channels_last_images_are_refused_with_the_transpose_to_use(channels: int) -> None:
    x, y = arrays(10, shape=(channels, 8, 8))
    with pytest.raises(ValueError, match=r"channels last \[N, H, W, C\]\? Give \[N, C, H, W\]") as info:
        ArrayDataModule(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), y)
    assert "x.transpose(0, 3, 1, 2)" in str(info.value)
    ArrayDataModule(x, y)  # channels first is accepted
