"""Refiner's evaluation network (Sec. 3.3, App. D): architecture, input checks, shipped checkpoints, training, CLI.

Ranking checks use images the shipped networks never saw: Fashion-MNIST TRAINING images (the
1-channel network was trained on the test split only) and, for 3 channels, smooth synthetic
images and (when scikit-image is installed) crops of the two held-out photographs.
"""

from __future__ import annotations

import importlib.util
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.refiner.evaluator import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_KEYS,
    EvaluationNetwork,
    EvaluatorUnavailableError,
    load_evaluator,
    shipped_checkpoint,
)
from lightning_gp.refiner.training import (
    HELDOUT_PHOTOS,
    NOISE_RATIOS,
    EvaluatorImages,
    mix_with_noise,
    random_crops,
    read_photo,
    smooth_images,
    train_evaluator,
)

N_PAIRS = 200
CHANCE_TAIL = 1e-6


def chance_bound(n: int, tail: float = CHANCE_TAIL) -> int:
    """Smallest k with P(Binomial(n, 1/2) >= k) < tail: more correct pairs than chance would give."""
    total, k = 0.0, n
    while k >= 0 and total + math.comb(n, k) / 2**n < tail:
        total += math.comb(n, k) / 2**n
        k -= 1
    return k + 1


def fraction_ranked(network: EvaluationNetwork, images: torch.Tensor, seed: int) -> tuple[float, float, float]:
    """Fraction of images whose r = 0.2 mix scores below their r = 0.6 mix, and the mean scores."""
    g = torch.Generator().manual_seed(seed)
    mixes, _ = mix_with_noise(images, (0.2, 0.6), g)
    with torch.no_grad():
        low, high = network(mixes).chunk(2)
    return float((low < high).double().mean()), float(low.mean()), float(high.mean())


@pytest.fixture(scope="module")
def fashion_train_pixels() -> torch.Tensor:
    """Fashion-MNIST training images of the built-in sample (never seen by the 1-channel network)."""
    datamodule = FashionMNISTSampleDataModule(normalize=False)
    datamodule.setup("fit")
    picked = torch.linspace(0, len(datamodule.train_dataset) - 1, N_PAIRS).long()
    images = torch.stack([datamodule.train_dataset[int(i)][0] for i in picked])
    assert images.min() >= 0 and images.max() <= 1
    return images


# --- architecture and inputs ---------------------------------------------------------------------


def test_architecture_follows_app_d_with_a_width_factor():
    full = EvaluationNetwork(in_channels=3)
    convs = [m for m in full.features if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [128, 256, 512]
    assert all(c.kernel_size == (3, 3) and c.stride == (2, 2) and c.padding == (1, 1) for c in convs)
    assert sum(isinstance(m, torch.nn.ReLU) for m in full.features) == 3
    assert full.head.in_features == 512 and full.head.out_features == 1
    small = EvaluationNetwork(in_channels=1, width=0.125)
    assert [m.out_channels for m in small.features if isinstance(m, torch.nn.Conv2d)] == [16, 32, 64]


@pytest.mark.parametrize("shape", [(2, 3, 32, 32), (1, 3, 17, 45), (3, 3, 1, 1), (2, 3, 64, 64)])
def test_global_pooling_scores_any_image_size(shape):
    torch.manual_seed(0)
    network = EvaluationNetwork(in_channels=3, width=0.125)
    out = network(torch.rand(shape))
    assert out.shape == (shape[0],) and bool(((out > 0) & (out < 1)).all())
    assert network.logits(torch.rand(shape)).shape == (shape[0],)


def test_gradients_flow_to_the_input():
    network = load_evaluator(1)
    x = torch.rand(2, 1, 28, 28, requires_grad=True)
    network(x).sum().backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0
    assert all(p.grad is None for p in network.parameters())


@pytest.mark.parametrize(
    "images, error, match",
    [
        (torch.rand(2, 1, 28, 28), ValueError, "1 channel.*takes 3"),
        (torch.rand(3, 28, 28), ValueError, r"\[N, C, H, W\]"),
        (torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8), TypeError, "floating"),
        (torch.full((1, 3, 8, 8), float("nan")), ValueError, "NaN"),
        (torch.rand(2, 3, 8, 8) * 2 - 1, ValueError, "denormalised"),
        (torch.rand(2, 3, 8, 8) * 255, ValueError, r"\[0, 1\]"),
        ([[0.5]], TypeError, "torch.Tensor"),
    ],
)
def test_bad_images_are_refused_naming_the_argument(images, error, match):
    network = EvaluationNetwork(in_channels=3, width=0.125)
    with pytest.raises(error, match=match) as info:
        network(images)
    assert "images" in str(info.value)


def test_values_within_float_rounding_of_the_range_pass():
    network = EvaluationNetwork(in_channels=1, width=0.125)
    x = torch.rand(2, 1, 8, 8)
    x[0, 0, 0, 0], x[1, 0, 0, 0] = -1e-5, 1 + 1e-5
    assert network(x).shape == (2,)


@pytest.mark.parametrize(
    "width, error", [(0, ValueError), (-0.5, ValueError), (float("nan"), ValueError), ("1", TypeError)]
)
def test_width_must_be_positive(width, error):
    with pytest.raises(error, match="width"):
        EvaluationNetwork(in_channels=1, width=width)


def test_in_channels_must_be_a_positive_int():
    with pytest.raises(ValueError, match="in_channels"):
        EvaluationNetwork(in_channels=0)


# --- shipped checkpoints -------------------------------------------------------------------------


@pytest.mark.parametrize("channels, size", [(1, 28), (3, 32)])
def test_shipped_checkpoint_holds_the_documented_keys(channels, size):
    resource = shipped_checkpoint(channels)
    with resource.open("rb") as handle:
        raw = handle.read()
    assert len(raw) < 1_000_000
    with resource.open("rb") as handle:
        checkpoint = torch.load(handle, weights_only=True)
    assert set(CHECKPOINT_KEYS) <= set(checkpoint)
    assert checkpoint["format"] == CHECKPOINT_FORMAT
    assert checkpoint["in_channels"] == channels and checkpoint["image_size"] == size
    assert 0 < checkpoint["width"] <= 0.25
    assert checkpoint["command"].startswith("lightning-gp refiner train-evaluator --config configs/refiner_evaluator_")
    assert isinstance(checkpoint["trained_on"], str) and len(checkpoint["trained_on"]) > 40
    assert sorted(checkpoint["heldout_mae"]) == list(NOISE_RATIOS)
    assert max(checkpoint["heldout_mae"].values()) < 0.1  # the target: within 0.1 for every r


@pytest.mark.parametrize("channels", [1, 3])
def test_loaded_network_is_frozen_in_eval_mode(channels):
    network = load_evaluator(channels)
    assert isinstance(network, EvaluationNetwork) and network.in_channels == channels
    assert not network.training
    assert all(not p.requires_grad for p in network.parameters())
    assert network.checkpoint_info["format"] == CHECKPOINT_FORMAT
    assert "state_dict" not in network.checkpoint_info


def test_shipped_1_channel_network_ranks_mixes_of_unseen_fashion_mnist_training_images(fashion_train_pixels):
    network = load_evaluator(1)
    fraction, low, high = fraction_ranked(network, fashion_train_pixels, seed=1)
    # If D ranked no better than a coin, P(>= bound correct pairs of 200) < 1e-6.
    assert fraction * N_PAIRS >= chance_bound(N_PAIRS), fraction
    assert fraction >= 0.95, fraction
    assert abs(low - 0.2) < 0.1 and abs(high - 0.6) < 0.1, (low, high)


def test_shipped_3_channel_network_ranks_mixes_of_smooth_synthetic_images():
    network = load_evaluator(3)
    fraction, low, high = fraction_ranked(network, smooth_images(N_PAIRS, 3, 32, seed=2), seed=3)
    assert fraction * N_PAIRS >= chance_bound(N_PAIRS), fraction
    assert low < high, (low, high)


@pytest.mark.skipif(importlib.util.find_spec("skimage") is None, reason="held-out photos ship with scikit-image")
def test_shipped_3_channel_network_ranks_mixes_of_the_held_out_photographs():
    from lightning_gp.refiner.training import scikit_image_photo_dir

    folder = scikit_image_photo_dir()
    crops = random_crops([read_photo(folder / name) for name in HELDOUT_PHOTOS], N_PAIRS, 32, seed=7)
    fraction, low, high = fraction_ranked(load_evaluator(3), crops.float() / 255, seed=4)
    assert fraction * N_PAIRS >= chance_bound(N_PAIRS), fraction
    assert fraction >= 0.95, fraction
    assert abs(low - 0.2) < 0.1 and abs(high - 0.6) < 0.1, (low, high)


# --- loading errors ------------------------------------------------------------------------------


def _tiny_checkpoint(**overrides) -> dict:
    network = EvaluationNetwork(in_channels=1, width=0.0625)
    checkpoint = {
        "format": CHECKPOINT_FORMAT,
        "in_channels": 1,
        "width": 0.0625,
        "image_size": 8,
        "state_dict": network.state_dict(),
        "trained_on": "nothing: a test file",
        "command": "none",
        "heldout_mae": {0.0: 0.5},
    }
    checkpoint.update(overrides)
    return checkpoint


class NotWeights:
    """A pickled object: ``torch.load(weights_only=True)`` must refuse it."""

    def __reduce__(self):
        return (print, ("this would run at load time",))


def test_no_shipped_network_for_other_channel_counts():
    with pytest.raises(EvaluatorUnavailableError, match=r"2-channel.*shipped: 1, 3"):
        load_evaluator(2)
    assert issubclass(EvaluatorUnavailableError, ValueError)
    with pytest.raises(ValueError, match="channels"):
        load_evaluator(0)


def test_a_missing_file_is_an_error_naming_the_path(tmp_path):
    path = tmp_path / "nowhere.pt"
    with pytest.raises(FileNotFoundError, match=r"nowhere.pt"):
        load_evaluator(1, path=path)


def test_a_corrupt_file_is_an_error_naming_the_path(tmp_path):
    path = tmp_path / "corrupt.pt"
    path.write_bytes(b"\x00not a torch file" * 10)
    with pytest.raises(ValueError, match=r"corrupt.pt.*not a readable"):
        load_evaluator(1, path=path)


def test_a_pickled_object_is_refused_by_weights_only_loading(tmp_path, capsys):
    path = tmp_path / "object.pt"
    torch.save({"format": CHECKPOINT_FORMAT, "payload": NotWeights()}, path)
    with pytest.raises(ValueError, match=r"object.pt.*weights_only"):
        load_evaluator(1, path=path)
    assert "this would run" not in capsys.readouterr().out
    plain_pickle = tmp_path / "plain.pkl"
    plain_pickle.write_bytes(pickle.dumps(NotWeights()))
    with pytest.raises(ValueError, match=r"plain.pkl"):
        load_evaluator(1, path=plain_pickle)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"format": "something else"}, "format 'something else'"),
        ({"in_channels": 3}, "for 3-channel images, expected 1"),
        ({"width": 0.125}, "does not fit"),
        ({"width": -1.0}, "does not fit"),
    ],
)
def test_a_malformed_or_mismatched_checkpoint_is_an_error(tmp_path, overrides, match):
    path = tmp_path / "bad.pt"
    torch.save(_tiny_checkpoint(**overrides), path)
    with pytest.raises(ValueError, match=match) as info:
        load_evaluator(1, path=path)
    assert "bad.pt" in str(info.value)


def test_missing_keys_and_non_dict_files_are_errors(tmp_path):
    checkpoint = _tiny_checkpoint()
    del checkpoint["heldout_mae"]
    torch.save(checkpoint, tmp_path / "keys.pt")
    with pytest.raises(ValueError, match=r"lacks key.*heldout_mae"):
        load_evaluator(1, path=tmp_path / "keys.pt")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="holds a list"):
        load_evaluator(1, path=tmp_path / "list.pt")


def test_the_shipped_1_channel_file_is_refused_for_3_channels(tmp_path):
    copy = tmp_path / "evaluator_1ch.pt"
    with shipped_checkpoint(1).open("rb") as handle:
        copy.write_bytes(handle.read())
    with pytest.raises(ValueError, match=r"evaluator_1ch.pt is for 1-channel images, expected 3"):
        load_evaluator(3, path=copy)
    assert load_evaluator(1, path=copy).in_channels == 1


# --- training ------------------------------------------------------------------------------------


def tiny_images(seed: int = 0) -> EvaluatorImages:
    pixels = smooth_images(80, 1, 8, seed)
    as_uint8 = (pixels * 255).round().to(torch.uint8)
    return EvaluatorImages(as_uint8[:64], as_uint8[64:], "80 smooth synthetic 8x8 test images")


def test_mixes_are_the_paper_blend_with_fresh_noise_per_ratio():
    x = torch.rand(3, 1, 4, 4)
    mixes, ratios = mix_with_noise(x, (0.0, 0.5, 1.0), torch.Generator().manual_seed(0))
    assert mixes.shape == (9, 1, 4, 4) and ratios.tolist() == [0.0] * 3 + [0.5] * 3 + [1.0] * 3
    torch.testing.assert_close(mixes[:3], x)
    noise_half = (mixes[3:6] - 0.5 * x) / 0.5
    assert float(noise_half.min()) >= 0 and float(noise_half.max()) <= 1
    assert not torch.allclose(noise_half, mixes[6:])  # a new u for each ratio


def test_a_tiny_training_run_lowers_the_loss_and_writes_a_loadable_checkpoint(tmp_path):
    output = tmp_path / "tiny.pt"
    deterministic = torch.are_deterministic_algorithms_enabled()
    checkpoint = train_evaluator(
        tiny_images(), width=0.125, epochs=4, batch_size=8, lr=1e-2, output=output, command="test", verbose=False
    )
    losses = [row["train_loss"] for row in checkpoint["history"]]
    # ln 2 = 0.693 at the start (D says 0.5 for everything); the floor is the mean entropy of r, 0.446
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, losses
    assert set(CHECKPOINT_KEYS) <= set(checkpoint) and checkpoint["image_size"] == 8
    assert sorted(checkpoint["heldout_mae"]) == list(NOISE_RATIOS)
    network = load_evaluator(1, path=output)
    assert network.width == 0.125 and network.checkpoint_info["command"] == "test"
    torch.testing.assert_close(network.state_dict(), checkpoint["state_dict"])
    assert torch.are_deterministic_algorithms_enabled() == deterministic  # the Trainer's switch is undone


# --- command line --------------------------------------------------------------------------------


def test_cli_help_lists_the_subcommand(capsys):
    from lightning_gp.cli import main

    with pytest.raises(SystemExit) as info:
        main(["refiner", "--help"])
    assert info.value.code == 0 and "train-evaluator" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["refiner", "train-evaluator", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "--images" in out and "--width" in out


def test_cli_trains_from_a_tiny_config(tmp_path, capsys):
    from lightning_gp.cli import main

    images = tiny_images(1)
    np.savez(tmp_path / "images.npz", train_images=images.train.numpy(), heldout_images=images.heldout.numpy())
    config = tmp_path / "tiny.yaml"
    output = tmp_path / "out" / "tiny.pt"
    config.write_text(
        f"images: {tmp_path / 'images.npz'}\nwidth: 0.0625\nepochs: 1\nbatch_size: 32\nlr: 1.0e-3\n"
        f"seed: 3\noutput: {output}\n"
    )
    main(["refiner", "train-evaluator", "--config", str(config)])
    out = capsys.readouterr().out
    assert "held-out MAE" in out and str(output) in out
    network = load_evaluator(1, path=output)
    assert network.checkpoint_info["command"] == f"lightning-gp refiner train-evaluator --config {config}"
    assert network.checkpoint_info["recipe"]["seed"] == 3
    # seeded and deterministic: the same run in-process gives the same weights
    again = train_evaluator(images, width=0.0625, epochs=1, batch_size=32, lr=1e-3, seed=3, verbose=False)
    torch.testing.assert_close(network.state_dict(), again["state_dict"], rtol=0, atol=0)


def test_cli_fails_clearly_when_the_training_images_are_missing(tmp_path):
    from lightning_gp.cli import main

    with pytest.raises(SystemExit, match=r"chelsea.png|astronaut.png"):
        main(["refiner", "train-evaluator", "--images", "scikit-image-photos", "--data_dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="Fashion-MNIST"):
        main(["refiner", "train-evaluator", "--images", "fashion-mnist-test", "--data_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="images must be"):
        main(["refiner", "train-evaluator", "--images", "cifar"])


@pytest.mark.parametrize("channels", [1, 3])
def test_the_shipped_configs_parse_and_name_the_shipped_files(channels):
    from lightning_gp.refiner.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    config = root / "configs" / f"refiner_evaluator_{channels}ch.yaml"
    parsed = build_parser().parse_args(["train-evaluator", "--config", str(config)])["train-evaluator"]
    assert parsed.output == f"lightning_gp/refiner/checkpoints/evaluator_{channels}ch.pt"
    assert (parsed.epochs, parsed.batch_size, parsed.lr) == (20, 128, 1e-4)  # App. D
    info = load_evaluator(channels).checkpoint_info
    assert info["width"] == parsed.width and info["recipe"]["epochs"] == parsed.epochs
