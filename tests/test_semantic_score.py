"""The semantic leak test (issue 22, item 4): trivial guesses are not recognisable, degraded originals are.

Real Fashion-MNIST images from the built-in sample's TRAINING split (the classifier was trained on
its test split). The classifier's weights ship in the package (sha256-checked); nothing here trains
it or reads a cache file.
"""

from __future__ import annotations

import configparser
import hashlib
from pathlib import Path

import pytest
import torch

from lightning_gp.data.builtin_sample import load_sample_arrays
from lightning_gp.metrics import semantic
from lightning_gp.metrics.image_quality import psnr
from lightning_gp.metrics.semantic import (
    CLASSIFIER_SHA256,
    SEMANTIC_LINE,
    ClassifierFileError,
    PublicClassifier,
    load_classifier,
    low_resolution,
    public_classifier,
    recognisable,
    semantic_scores,
    serialize_classifier,
    shipped_classifier_file,
    trivial_guesses,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def images(one_thread):
    """Three training images per class, pixels in [0, 1], with labels and the sample's mean image."""
    arrays = load_sample_arrays()
    x = torch.from_numpy(arrays["train_images"]).float() / 255
    x = x[:, None] if x.ndim == 3 else x
    y = torch.from_numpy(arrays["train_labels"]).long()
    pick = torch.cat([torch.nonzero(y == c).flatten()[:3] for c in range(10)])
    return x[pick], y[pick], x.mean(dim=0)


@pytest.fixture(scope="module")
def score(images):
    classifier = public_classifier()
    baselines = trivial_guesses(images[2])
    return lambda recon: semantic_scores(recon, images[1], classifier=classifier, baselines=baselines)


def _noise_to_11db(x: torch.Tensor) -> torch.Tensor:
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    low, high = torch.zeros(len(x), 1, 1, 1), torch.full((len(x), 1, 1, 1), 3.0)
    for _ in range(30):
        mid = (low + high) / 2
        clean = (psnr((x + mid * z).clamp(0, 1), x) > 11.0).view(-1, 1, 1, 1)
        low, high = torch.where(clean, mid, low), torch.where(clean, high, mid)
    return (x + high * z).clamp(0, 1)


def test_blank_grey_mean_and_noise_are_not_recognisable_by_a_wide_margin(images, score):
    x, _, mean = images
    g = torch.Generator().manual_seed(9)  # other draws than the baselines' noise
    guesses = {
        "zeros": torch.zeros_like(x),
        "grey": torch.full_like(x, 0.5),
        "mean": mean.expand_as(x),
        "uniform": torch.rand(x.shape, generator=g),
        "gaussian": (0.5 + 0.25 * torch.randn(x.shape, generator=g)).clamp(0, 1),
    }
    for name, guess in guesses.items():
        s = score(guess)
        assert not recognisable(s).any(), name
        assert s.max() < SEMANTIC_LINE - 0.5, (name, s.max())


def test_degraded_originals_are_recognisable_far_more_often_than_guesses(images, score):
    x, _, _ = images
    noisy = _noise_to_11db(x)
    assert psnr(noisy, x).median() == pytest.approx(11.0, abs=0.05)
    for name, recon in {
        "noise to 11 dB": noisy,
        "silhouette": (x > 0.1).float(),
        "low-res x2": low_resolution(x, 2),
        "low-res x4": low_resolution(x, 4),
    }.items():
        s = score(recon)
        # per image the classifier misses some (see the calibration); over 30 images many are well past the line
        assert (s > SEMANTIC_LINE + 0.1).float().mean() >= 0.2, (name, s)
        assert s.median() > 0.3, (name, s.median())


def test_the_original_itself_is_recognisable_when_the_classifier_names_it(images, score):
    x, _, _ = images
    s = score(x)
    assert (s > SEMANTIC_LINE + 0.1).float().mean() >= 0.5
    assert recognisable(s).dtype == torch.bool and recognisable(s).shape == (30,)


def test_semantic_scores_refuse_other_shapes(score):
    with pytest.raises(ValueError, match="28, 28"):
        semantic_scores(torch.rand(2, 3, 32, 32), torch.tensor([0, 1]))


def test_calibration_benchmark_quick_writes_every_group(tmp_path):
    import csv

    from helpers import run_benchmark

    result = run_benchmark("semantic_calibration.py", "--quick", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "semantic_calibration_quick.csv") as handle:
        rows = {r["group"]: r for r in csv.DictReader(handle)}
    assert len(rows) == 18
    for name in ("zeros", "grey", "mean image", "uniform noise", "gaussian noise"):
        assert float(rows[name]["called_recognisable"]) == 0.0, name
    assert "QUICK RUN" in (tmp_path / "semantic_calibration_quick.md").read_text()
    assert (tmp_path / "semantic_calibration_quick.png").stat().st_size > 0


@pytest.fixture
def no_training(monkeypatch, tmp_path):
    """Loading must not train nor read a cache: training raises, HOME and the cache variables are empty."""

    def refuse(*args, **kwargs):
        raise AssertionError("train_public_classifier was called while loading the classifier")

    monkeypatch.setattr(semantic, "train_public_classifier", refuse)
    for var in ("HOME", "XDG_CACHE_HOME", "LIGHTNING_GP_CACHE"):
        monkeypatch.setenv(var, str(tmp_path / "empty_home"))
    semantic._shipped_classifier.cache_clear()
    yield
    semantic._shipped_classifier.cache_clear()  # later tests load the real shipped file again


def test_the_shipped_weights_load_fast_match_their_sha256_and_are_not_trained(no_training, one_thread):
    data = shipped_classifier_file().read_bytes()
    assert hashlib.sha256(data).hexdigest() == CLASSIFIER_SHA256
    assert len(data) < 2 * 2**20  # a state_dict of 421,642 float32 parameters, ~1.6 MiB
    net = public_classifier()  # no_training: loading never trains
    assert public_classifier() is net  # loaded once per process
    assert isinstance(net, PublicClassifier) and not net.training
    assert sum(p.numel() for p in net.parameters()) == 421_642
    assert not any(p.requires_grad for p in net.parameters())
    assert serialize_classifier(net) == data  # the bytes are the weights, reproducibly serialised
    blank = semantic.class_probabilities(torch.zeros(1, 1, 28, 28))
    assert blank.max() < 0.3  # outlier exposure: a blank image is near-uniform over the 10 classes


def test_a_corrupt_or_different_weights_file_is_an_error_naming_it_never_a_retrain(no_training, tmp_path, monkeypatch):
    data = bytearray(shipped_classifier_file().read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt = tmp_path / "corrupt_classifier.pt"
    corrupt.write_bytes(bytes(data))
    with pytest.raises(ClassifierFileError, match=r"corrupt_classifier\.pt.*sha256"):
        load_classifier(corrupt, sha256=CLASSIFIER_SHA256)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ClassifierFileError, match=r"garbage\.pt.*not a torch\.save file"):
        load_classifier(garbage)
    other = tmp_path / "three_classes.pt"
    other.write_bytes(serialize_classifier(PublicClassifier(classes=3)))
    with pytest.raises(ClassifierFileError, match=r"three_classes\.pt.*do not fit"):
        load_classifier(other)
    with pytest.raises(ClassifierFileError, match=r"missing\.pt.*cannot be read"):
        load_classifier(tmp_path / "missing.pt")
    # the default (shipped) path refuses a file that is not the recorded one, naming it
    monkeypatch.setattr(semantic, "shipped_classifier_file", lambda: corrupt)
    with pytest.raises(ClassifierFileError, match=r"corrupt_classifier\.pt.*expected " + CLASSIFIER_SHA256):
        semantic_scores(torch.zeros(1, 1, 28, 28), torch.tensor([0]))


def test_the_weights_are_package_data_and_trivial_guesses_is_the_only_name():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    patterns = config["options.package_data"][semantic.CLASSIFIER_PACKAGE].replace(",", " ").split()
    assert "*.pt" in patterns
    assert (REPO / "lightning_gp" / "metrics" / "checkpoints" / "__init__.py").is_file()
    assert not hasattr(semantic, "trivial_baselines")  # the audit's trivial_baselines is another concept
