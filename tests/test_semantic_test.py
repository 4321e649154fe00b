"""The semantic leak test fitted to a dataset (``fit_semantic_test``) and the shipped one as a ``SemanticTest``.

Fits here are small (3x16x16 synthetic RGB patterns, a few epochs, one thread): the fit under test
takes about 3-4 s, the cache and determinism fits under a second each.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from scipy.stats import betabinom

from lightning_gp.data.builtin_sample import load_sample_arrays
from lightning_gp.metrics import (
    SemanticCalibrationError,
    SemanticTest,
    fit_semantic_test,
    shipped_semantic_test,
)
from lightning_gp.metrics import semantic_test as module
from lightning_gp.metrics.semantic import (
    SEMANTIC_LINE,
    PublicClassifier,
    _outliers,
    public_classifier,
    semantic_score_matrix,
    semantic_scores,
    trivial_guesses,
)
from lightning_gp.metrics.semantic_test import conformal_line, default_epochs, fingerprint_of

COLOURS = torch.tensor([[1.0, 0.1, 0.1], [0.1, 0.9, 0.1], [0.1, 0.2, 1.0], [0.9, 0.9, 0.1]])
FALSE_ALARM = 0.05
PER_CLASS = 60  # 240 public images: 180 train, 60 calibrate (>= 1 / 0.05 - 1 = 19)


def synthetic_rgb(per_class: int, seed: int, classes: int = 4, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable 3 x size x size classes: red square, green stripes, blue ring, yellow X; random position,
    strength and background, Gaussian pixel noise (sigma 0.08)."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    images, labels = [], []
    for c in range(classes):
        for _ in range(per_class):
            cy, cx = (torch.rand(2, generator=g) * 6 + size / 2 - 3).tolist()
            phase = float(torch.rand(1, generator=g) * 4)
            radius = ((yy - cy) ** 2 + (xx - cx) ** 2).sqrt()
            mask = [
                ((yy - cy).abs() < 3.5) & ((xx - cx).abs() < 3.5),
                ((yy + phase) % 4) < 2,
                (radius > 3) & (radius < 5),
                ((yy - cy).abs() - (xx - cx).abs()).abs() < 1.2,
            ][c]
            strength, background = (
                0.6 + 0.4 * float(torch.rand(1, generator=g)),
                0.3 * float(torch.rand(1, generator=g)),
            )
            image = background + mask.float() * strength * COLOURS[c].view(3, 1, 1)
            images.append((image + 0.08 * torch.randn(3, size, size, generator=g)).clamp(0, 1))
            labels.append(c)
    return torch.stack(images), torch.tensor(labels)


@pytest.fixture(scope="module")
def public(one_thread):
    return synthetic_rgb(PER_CLASS, seed=0)


@pytest.fixture(scope="module")
def fitted(public):
    """The fit under test, made under inference mode (as an audit's scoring code would call it) on
    inference tensors; the global RNG must come back untouched."""
    module.clear_memory_cache()
    state = torch.get_rng_state()
    with torch.inference_mode():
        images, labels = public[0].clone(), public[1].clone()
        test = fit_semantic_test(images, labels, false_alarm=FALSE_ALARM, epochs=30)
    assert torch.equal(torch.get_rng_state(), state)
    return test


def tiny(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """3 classes x 12 images: 9 calibration images, enough for false_alarm 0.1 (>= 9)."""
    return synthetic_rgb(12, seed=seed, classes=3)


def beta_binomial_upper(trials: int, calibration_units: int, level: float, tail: float = 1e-3) -> int:
    """The 1 - ``tail`` quantile of the number of null hits in ``trials`` independent null tests.

    Given one calibration set, a conformal line at the k-th of n scores (one per exchangeable unit,
    k = ceil((1 - level)(n + 1))) has a false-alarm rate r ~ Beta(n + 1 - k, k) (Vovk 2012, "Conditional
    validity of inductive conformal predictors"); the hits are Binomial(trials, r), so unconditionally
    BetaBinomial(trials, n + 1 - k, k). The fitted line is the largest of its group lines and 0, and
    pooling each image's scores over classes averages them, so this is the bound for one score per image.
    """
    k = math.ceil((1 - level) * (calibration_units + 1) - 1e-9)
    return int(betabinom.ppf(1 - tail, trials, calibration_units + 1 - k, k))


# --- the shipped test -----------------------------------------------------------------------------


def test_the_shipped_test_is_the_shipped_classifier_line_and_scores(one_thread):
    arrays = load_sample_arrays()
    x = torch.from_numpy(arrays["train_images"][:40]).float() / 255
    x = x[:, None] if x.ndim == 3 else x
    labels = torch.from_numpy(arrays["train_labels"][:40]).long()
    test = shipped_semantic_test()
    assert test.line == SEMANTIC_LINE == 0.7 and test.false_alarm == 0.006
    assert test.classifier is public_classifier() and torch.equal(test.baselines, trivial_guesses())
    assert (test.image_shape, test.num_classes) == ((1, 28, 28), 10)
    assert test.source == "shipped Fashion-MNIST classifier"
    assert torch.equal(test.score_matrix(x, labels), semantic_score_matrix(x, labels))
    assert torch.equal(test.scores(x, labels), semantic_scores(x, labels))
    assert torch.equal(test.recognisable(x, labels), semantic_scores(x, labels) > SEMANTIC_LINE)


def test_the_shipped_shape_keeps_its_layers_baselines_and_outlier_draws():
    # values computed before the generalisation: the default shape draws the same numbers in the same order
    guesses = trivial_guesses()
    assert hashlib.sha256(guesses.numpy().tobytes()).hexdigest() == (
        "662077e9ee6d464a2f69be0ae9c1bcaf67f7600312324a52bd5883160e6f3e11"
    )
    assert torch.equal(trivial_guesses(shape=(1, 28, 28)), guesses)
    outliers = _outliers(32, torch.Generator().manual_seed(5))
    assert hashlib.sha256(outliers.numpy().tobytes()).hexdigest() == (
        "bf9a81c590f59136f40360fdd454f243cfcdd8221d2b50dfd1d9205299c9ba9f"
    )
    shipped = {k: v.shape for k, v in public_classifier().state_dict().items()}
    assert {k: v.shape for k, v in PublicClassifier().state_dict().items()} == shipped
    rgb = PublicClassifier(classes=4, in_channels=3, image_size=(16, 20))
    assert rgb(torch.rand(2, 3, 16, 20)).shape == (2, 4)
    assert rgb.state_dict().keys() == shipped.keys()
    assert PublicClassifier(image_size=9)(torch.rand(1, 1, 9, 9)).shape == (1, 10)


# --- the fitted test ------------------------------------------------------------------------------


def test_the_fitted_test_describes_itself(fitted, public):
    assert isinstance(fitted, SemanticTest)
    assert fitted.image_shape == (3, 16, 16) and fitted.num_classes == 4
    assert fitted.false_alarm == FALSE_ALARM and 0.0 <= fitted.line < 1.0
    assert torch.equal(fitted.baselines, trivial_guesses(public[0].mean(dim=0), 1234, (3, 16, 16)))
    # other-class: 60 calibration images x 3 classes; outliers: 200 images x 4 classes
    assert fitted.calibration_size == 60 * 3 + 200 * 4
    assert fitted.source.startswith("trained at audit time on 240 public images")
    assert not fitted.classifier.training and not any(p.requires_grad for p in fitted.classifier.parameters())
    assert "classifier" not in repr(fitted) and "line=" in repr(fitted)


def test_the_line_is_the_larger_group_conformal_line(fitted, public):
    """Recomputed from the fitted classifier: max(other-class line, outlier line, 0)."""
    images, labels = public
    _, calibration = module._stratified_split(labels, 0)
    lifts = fitted.score_matrix(images[calibration], torch.arange(4)).t()
    other = lifts[labels[calibration][:, None] != torch.arange(4)]
    outliers = module._outlier_lifts(
        fitted.classifier, module.softmax_of(fitted.classifier, fitted.baselines).amax(0), (3, 16, 16), FALSE_ALARM, 0
    )
    expected = max(conformal_line(other, FALSE_ALARM, 3), conformal_line(outliers, FALSE_ALARM, 4), 0.0)
    assert fitted.line == expected


def test_clean_images_are_recognisable_and_nulls_stay_under_the_line_at_the_stated_rate(fitted):
    fresh, labels = synthetic_rgb(100, seed=1)  # not the public images
    scores = fitted.scores(fresh, labels)
    for c in range(4):
        assert (scores[labels == c] > fitted.line).float().mean() >= 0.8, (c, scores[labels == c].median())
    # other-class: each fresh image scored for one other class (seeded), 400 independent tests given the fit
    g = torch.Generator().manual_seed(2)
    other = (labels + torch.randint(1, 4, labels.shape, generator=g)) % 4
    hits = int((fitted.scores(fresh, other) > fitted.line).sum())
    assert hits <= beta_binomial_upper(len(labels), 60, FALSE_ALARM), hits
    # outliers: fresh draws of the calibration outliers' generator (constants, noise, smooth fields), one class each
    images = _outliers(400, torch.Generator().manual_seed(3), (3, 16, 16))
    classes = torch.randint(0, 4, (400,), generator=g)
    hits = int((fitted.scores(images, classes) > fitted.line).sum())
    assert hits <= beta_binomial_upper(400, 200, FALSE_ALARM), hits
    # the trivial guesses score at most 0 (the lift over the best of them), never over a line >= 0
    every = fitted.score_matrix(fitted.baselines, torch.arange(4))
    assert every.max() <= 0.0 <= fitted.line
    assert not fitted.recognisable(fitted.baselines, torch.tensor([0, 1, 2, 3, 0])).any()


def test_the_conformal_line_is_the_stated_order_statistic():
    scores = torch.tensor(
        [7.0, 3.0, 19.0, 1.0, 12.0, 5.0, 20.0, 2.0, 9.0, 15.0, 4.0, 18.0, 6.0, 11.0, 8.0, 17.0, 10.0, 13.0, 16.0, 14.0]
    )
    # n = 20: k = ceil((1 - a)(n + 1)); the k-th smallest of 1..20 is k
    assert conformal_line(scores, 0.1) == 19.0  # ceil(18.9)
    assert conformal_line(scores, 0.05) == 20.0  # ceil(19.95)
    assert conformal_line(scores, 0.5) == 11.0  # ceil(10.5)
    assert conformal_line(scores, 0.1, block=2) == 20.0  # ceil(0.9 * 22) = ceil(19.8)
    with pytest.raises(SemanticCalibrationError, match="exceeds n"):
        conformal_line(scores, 0.04)  # ceil(20.16) = 21 > 20: 20 scores cannot set a 4% line
    # float rounding does not add one: (1 - 0.01) * 100 is 99, the 99th of 99 scores
    assert conformal_line(torch.arange(1.0, 100.0), 0.01) == 99.0
    assert conformal_line(torch.tensor([2.0, 1.0, 1.0, 1.0]), 0.4) == 1.0  # ties: ceil(0.6 * 5) = 3rd smallest


def test_default_epochs_rule():
    assert default_epochs(750) == 20  # 12 steps of 64: 240 steps
    assert default_epochs(60_000) == 3 and default_epochs(10) == 60


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda x, y: (x[0], y), "public_images must be \\[N, C, H, W\\]"),
        (lambda x, y: (x * 2, y), "public_images must hold pixel values in \\[0, 1\\]"),
        (lambda x, y: (x.index_put((torch.tensor([0]),), torch.tensor(float("nan"))), y), "public_images holds NaN"),
        (lambda x, y: (x[..., :4, :4], y), "public_images must be at least 8x8"),
        (lambda x, y: (x, y[:-1]), "public_labels must be \\[N\\] with N = 36"),
        (lambda x, y: (x, y - 1), "public_labels must be non-negative"),
        (lambda x, y: (x, y.float()), "public_labels must be integer"),
        (lambda x, y: (x, torch.zeros_like(y)), "public_labels must hold at least 2 classes"),
        (lambda x, y: (x, torch.where(y == 2, 5, y)), "public_labels: every class in \\[0, 6\\) needs at least 10"),
        (lambda x, y: (x[:-3], y[:-3]), "public_labels: .*class 2: 9"),
    ],
)
def test_bad_public_data_is_refused_naming_the_argument(change, match):
    images, labels = change(*tiny())
    with pytest.raises(ValueError, match=match):
        fit_semantic_test(images, labels, false_alarm=0.1, epochs=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"false_alarm": 0.0}, "false_alarm must be a number in \\(0, 0.5\\]"),
        ({"false_alarm": 0.6}, "false_alarm"),
        ({"false_alarm": float("nan")}, "false_alarm"),
        ({"false_alarm": True}, "false_alarm"),
        ({"false_alarm": 0.1, "epochs": 0}, "epochs must be a positive int"),
        ({"false_alarm": 0.1, "seed": 1.5}, "seed must be an int"),
    ],
)
def test_bad_options_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit_semantic_test(*tiny(), **kwargs)


def test_too_few_images_for_the_level_say_how_many_would_do():
    # 36 images, 9 calibrate: 0.1 needs 9, 0.05 needs 19 (about 76 public images)
    with pytest.raises(
        SemanticCalibrationError, match=r"public_images: false_alarm=0.05 needs at least 19 .* about 76 public"
    ):
        fit_semantic_test(*tiny(), false_alarm=0.05)
    assert issubclass(SemanticCalibrationError, ValueError)


def test_bad_reconstructions_and_labels_are_refused_naming_them(fitted):
    x = torch.rand(2, 3, 16, 16)
    with pytest.raises(ValueError, match=r"reconstructions must be \[B, 3, 16, 16\].*got shape \(2, 1, 16, 16\)"):
        fitted.scores(torch.rand(2, 1, 16, 16), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"reconstructions must be \[B, 3, 16, 16\].*got shape \(3, 16, 16\)"):
        fitted.score_matrix(torch.rand(3, 16, 16), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"reconstructions must hold pixel values in \[0, 1\]"):
        fitted.scores(x * 255, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="reconstructions holds NaN"):
        fitted.scores(torch.full_like(x, float("nan")), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        fitted.scores(x, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        fitted.score_matrix(x, torch.tensor([-1]))
    with pytest.raises(ValueError, match="labels: 2 reconstructions but 3 labels"):
        fitted.scores(x, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="image_size must be at least 8x8"):
        PublicClassifier(image_size=(4, 28))
    with pytest.raises(ValueError, match="mean_image is required for shape \\(3, 16, 16\\)"):
        trivial_guesses(shape=(3, 16, 16))


# --- caching, fingerprint, determinism -------------------------------------------------------------


def test_two_fits_are_identical(one_thread):
    module.clear_memory_cache()
    first = fit_semantic_test(*tiny(), false_alarm=0.1, epochs=2)
    module.clear_memory_cache()
    second = fit_semantic_test(*tiny(), false_alarm=0.1, epochs=2)
    assert first is not second and first.line == second.line
    for (name, a), (_, b) in zip(first.classifier.state_dict().items(), second.classifier.state_dict().items()):
        assert torch.equal(a, b), name
    assert fit_semantic_test(*tiny(), false_alarm=0.1, epochs=2) is second  # the memory cache


def test_the_disk_cache_round_trips_with_weights_only_and_a_corrupt_file_is_retrained(
    tmp_path, monkeypatch, one_thread
):
    module.clear_memory_cache()
    first = fit_semantic_test(*tiny(), false_alarm=0.1, epochs=2, cache_dir=tmp_path)
    (path,) = tmp_path.glob("semantic_test_*.pt")
    assert path.name == f"semantic_test_{first.fingerprint}.pt" and not list(tmp_path.glob(".*tmp"))
    stored = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data only
    assert stored["line"] == first.line and stored["image_shape"] == [3, 16, 16] and stored["num_classes"] == 3

    def refuse(*args, **kwargs):
        raise AssertionError("trained although the disk cache holds this fit")

    monkeypatch.setattr(module, "train_public_classifier", refuse)
    module.clear_memory_cache()
    loaded = fit_semantic_test(*tiny(), false_alarm=0.1, epochs=2, cache_dir=tmp_path)
    assert loaded is not first
    for field in ("line", "false_alarm", "calibration_size", "image_shape", "num_classes", "fingerprint", "source"):
        assert getattr(loaded, field) == getattr(first, field), field
    assert torch.equal(loaded.baselines, first.baselines)
    x, y = tiny(seed=4)
    assert torch.equal(loaded.score_matrix(x, y), first.score_matrix(x, y))
    monkeypatch.undo()
    for corrupt in (b"not a torch.save file", path.read_bytes()[:-100]):
        path.write_bytes(corrupt)
        module.clear_memory_cache()
        with pytest.warns(RuntimeWarning, match=rf"{path.name} is unusable .*; retraining and overwriting it"):
            again = fit_semantic_test(*tiny(), false_alarm=0.1, epochs=2, cache_dir=tmp_path)
        assert again.line == first.line
        assert torch.load(path, map_location="cpu", weights_only=True)["fingerprint"] == first.fingerprint
    # a readable file of another fit under this name (e.g. copied by hand) is not used either
    foreign = tmp_path / f"semantic_test_{fingerprint_of(*tiny(seed=9), false_alarm=0.1, seed=0, epochs=2)}.pt"
    foreign.write_bytes(path.read_bytes())
    with pytest.warns(RuntimeWarning, match="not a semantic test cache file for this fit"):
        fit_semantic_test(*tiny(seed=9), false_alarm=0.1, epochs=2, cache_dir=tmp_path)


def test_the_fingerprint_changes_with_the_data_and_the_recipe():
    x, y = tiny()
    base = fingerprint_of(x, y, false_alarm=0.1, seed=0, epochs=2)
    assert fingerprint_of(x.clone(), y.clone(), false_alarm=0.1, seed=0, epochs=2) == base
    pixel = x.clone()
    pixel[0, 0, 0, 0] = 1 - pixel[0, 0, 0, 0]
    relabelled = y.clone()
    relabelled[[0, -1]] = relabelled[[-1, 0]]
    others = {
        fingerprint_of(pixel, y, false_alarm=0.1, seed=0, epochs=2),
        fingerprint_of(x, relabelled, false_alarm=0.1, seed=0, epochs=2),
        fingerprint_of(x.reshape(36, 3, 8, 32), y, false_alarm=0.1, seed=0, epochs=2),
        fingerprint_of(x, y, false_alarm=0.05, seed=0, epochs=2),
        fingerprint_of(x, y, false_alarm=0.1, seed=1, epochs=2),
        fingerprint_of(x, y, false_alarm=0.1, seed=0, epochs=3),
    }
    assert len(others) == 6 and base not in others
