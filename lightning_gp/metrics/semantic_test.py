"""The semantic leak test fitted to a dataset: a public-data classifier and a line calibrated at audit time.

:mod:`lightning_gp.metrics.semantic` ships one semantic test, for Fashion-MNIST-like 1x28x28 images: a
small CNN trained on the built-in sample's public split and a hand-calibrated line. This module builds
the same test for any image data, ``[C, H, W]`` (RGB included, at least 8x8) and any number of classes,
from the data's PUBLIC split (images an audit never attacks):

    score(r, c) = p_f(c | r) - max_b p_f(c | b)        (lift over the best trivial guess b)
    recognisable  <=>  score > line

1. Split the public images, stratified by class and seeded, into a training part (75%) and a
   calibration part (25%).
2. Train :class:`~lightning_gp.metrics.semantic.PublicClassifier` for this image shape and class count
   on the training part with the shipped recipe (:func:`~lightning_gp.metrics.semantic.train_public_classifier`:
   robustness augmentation and outlier exposure, Hendrycks et al. 2019, "Deep Anomaly Detection with
   Outlier Exposure", so blank, noise and smooth random images get a near-uniform output).
3. Set the line as a split-conformal quantile (Vovk et al. 2005, "Algorithmic Learning in a Random
   World"; Lei et al. 2018, "Distribution-free predictive inference for regression") of NULL scores,
   i.e. scores of image-label pairs where the image does NOT show the label's class:

   * other-class: each calibration image of class c' scored for every class c != c' (an image of
     another class is not a recognisable reconstruction of a class-c original);
   * outliers: fresh draws of the outlier-exposure generator (constants, uniform and Gaussian noise,
     smooth random fields; not the training draws) scored for every class.

   For each group the line is its ``k``-th smallest score with ``k = ceil((1 - false_alarm) (n + b))``,
   ``n`` the group's scores and ``b`` the scores each image contributes (``K - 1`` other-class scores
   per calibration image, ``K`` per outlier image; ``b = 1`` is the textbook ``ceil((1 - a)(n + 1))``).
   The fitted line is the larger of the two group lines, and never below 0.

What the level means. ``false_alarm`` bounds, per image-label test, the probability that a null pair is
called recognisable: for a held-out image X exchangeable with the calibration images (a new image of
the public data's distribution, classes in the public split's proportions) and a class c drawn
uniformly from the classes other than X's, ``P(score(X, c) > line) <= false_alarm``; likewise for a
new outlier image and a uniform class. The probability is over the calibration split and the new draw
(marginal, not conditional on one fit), exactly for exchangeable data (the stratified split fixes the
calibration part's class counts at the public split's, a small departure from it). The block size ``b`` makes this exact although one image's
scores are dependent (the line is at least the conformal line of the calibration plus test images'
pooled scores). Each group is bounded separately, so a mixture of them is too; pooling the groups
instead would let the many low outlier scores lower the line for other-class images. The trivial
guesses themselves (zeros, grey, the public mean image, one uniform and one Gaussian noise image) score
at most 0 by definition (the score subtracts their maximum), hence never above a line >= 0. It is a
CLASS-level test, not an identity test: another image of the same class scores like a recognisable
reconstruction. A group of ``n`` null scores from images of ``b`` scores each can only set a line at
level ``false_alarm`` when ``n / b >= 1 / false_alarm - 1``: here at least ``1 / false_alarm - 1``
calibration images (about four times that many public images), else :class:`SemanticCalibrationError`.
"Not recognisable" is no evidence of privacy (the classifier misses some clean originals).

Caching. A fit is keyed by a fingerprint: sha256 of the public images' and labels' bytes and shape,
``false_alarm``, ``seed``, ``epochs``, :data:`RECIPE_VERSION` and the torch version (not the thread
count: a cached fit made on another thread count is reused). Fits are kept in memory (the last
:data:`MEMORY_CACHE_SIZE`), and with ``cache_dir`` on disk as ``semantic_test_<fingerprint>.pt``:
``torch.save`` of the state_dict, the baselines and plain metadata, read back with
``torch.load(..., weights_only=True)``, written atomically (temporary file, then ``os.replace``). A cache
file that cannot be read or is not this fit's is a warning naming the file, and the test is retrained
and the file overwritten (a cache holds nothing that cannot be recomputed); a cache directory that
cannot be written is a warning, not an error.

Determinism: under the same seed, torch build and thread count two fits give identical weights and
line. The global RNG is left as it was, and fitting works under ``torch.no_grad()`` or
``torch.inference_mode()`` callers.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import threading
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.metrics.image_quality import check_pixel_range
from lightning_gp.metrics.semantic import (
    _BATCH,
    CLASSIFIER_SHA256,
    IMAGE_SHAPE,
    NUM_CLASSES,
    SEMANTIC_LINE,
    PublicClassifier,
    _outliers,
    lift_matrix,
    public_classifier,
    softmax_of,
    train_public_classifier,
    trivial_guesses,
)

#: Bump when the fitting recipe changes (part of every fingerprint, so old cache files are not reused).
RECIPE_VERSION = 1
#: Every class in ``[0, K)`` needs at least this many public images (a quarter go to calibration).
MIN_IMAGES_PER_CLASS = 10
#: The fraction of each class held out to calibrate the line (the rest trains the classifier).
CALIBRATION_FRACTION = 0.25
#: Default epochs: about this many optimiser steps (batches of 64), within [MIN_EPOCHS, MAX_EPOCHS].
STEP_BUDGET = 240
MIN_EPOCHS = 3
MAX_EPOCHS = 60
#: Outlier images scored for the outlier group's line: max(MIN_OUTLIERS, 2 ceil(1 / false_alarm)).
MIN_OUTLIERS = 200
#: How many fits the in-memory cache keeps.
MEMORY_CACHE_SIZE = 8
#: The shipped test's stated level: the fraction of other-class images over SEMANTIC_LINE in its calibration.
SHIPPED_FALSE_ALARM = 0.006
_BASELINE_SEED = 1234
_CHUNK = 256
_CACHE_FORMAT = "lightning_gp.semantic_test/1"


class SemanticCalibrationError(ValueError):
    """Too few public images to set the semantic line at the asked ``false_alarm``."""


@dataclass(frozen=True, eq=False)
class SemanticTest:
    """A semantic leak test: ``score(r, c) = p(c | r) - max over baselines of p(c | baseline)``, over ``line``.

    Attributes:
        classifier: the public-data classifier on pixels in [0, 1] (eval mode, no gradients; shared, do
            not modify).
        baselines: ``[5, *image_shape]`` trivial guesses (zeros, grey, the public images' mean, uniform
            and Gaussian noise).
        line: a reconstruction with ``score > line`` is "recognisable" (shows the label's class).
        false_alarm: the stated level the line was set at (see the module docstring for what it bounds).
        calibration_size: how many null scores set the line.
        image_shape: ``(C, H, W)`` of the images it takes.
        num_classes: the classifier's class count (labels in ``[0, num_classes)``).
        fingerprint: identifies the public data and recipe the test was fitted with.
        source: where the classifier comes from, in words.
    """

    classifier: nn.Module = field(repr=False)
    baselines: Tensor = field(repr=False)
    line: float
    false_alarm: float
    calibration_size: int
    image_shape: tuple[int, int, int]
    num_classes: int
    fingerprint: str
    source: str

    def score_matrix(self, reconstructions: Tensor, labels: Tensor) -> Tensor:
        """Scores of every reconstruction for every label, ``[len(labels), len(reconstructions)]``: entry
        ``[i, j]`` = ``p(labels[i] | reconstructions[j]) - max over baselines of p(labels[i] | baseline)``
        (as :func:`~lightning_gp.metrics.semantic.semantic_score_matrix`)."""
        pixels = self._checked_reconstructions(reconstructions)
        labels = self._checked_labels(labels)
        return lift_matrix(softmax_of(self.classifier, pixels), softmax_of(self.classifier, self.baselines), labels)

    def scores(self, reconstructions: Tensor, labels: Tensor) -> Tensor:
        """Per reconstruction, its score for its own label: ``[B]`` (the diagonal of :meth:`score_matrix`)."""
        pixels = self._checked_reconstructions(reconstructions)
        labels = self._checked_labels(labels)
        if len(labels) != len(pixels):
            raise ValueError(f"labels: {len(pixels)} reconstructions but {len(labels)} labels")
        probs = softmax_of(self.classifier, pixels)
        base = softmax_of(self.classifier, self.baselines).amax(dim=0)
        return probs[torch.arange(len(labels)), labels] - base[labels]

    def recognisable(self, reconstructions: Tensor, labels: Tensor) -> Tensor:
        """``scores(reconstructions, labels) > line`` (bool ``[B]``)."""
        return self.scores(reconstructions, labels) > self.line

    def _checked_reconstructions(self, reconstructions: Tensor) -> Tensor:
        if not isinstance(reconstructions, Tensor):
            raise ValueError(f"reconstructions must be a tensor, got {type(reconstructions).__name__}")
        if reconstructions.ndim != 4 or tuple(reconstructions.shape[1:]) != tuple(self.image_shape):
            c, h, w = self.image_shape
            raise ValueError(
                f"reconstructions must be [B, {c}, {h}, {w}] pixels in [0, 1] (this semantic test's image shape, "
                f"{self.source}), got shape {tuple(reconstructions.shape)}"
            )
        check_pixel_range(reconstructions, "reconstructions")
        return reconstructions

    def _checked_labels(self, labels: Tensor) -> Tensor:
        labels = torch.as_tensor(labels)
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"labels must be integer class indices, got dtype {labels.dtype}")
        labels = labels.long().cpu().reshape(-1)
        if labels.numel() and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes}), got {labels.tolist()}")
        return labels


_memory_cache: collections.OrderedDict[str, SemanticTest] = collections.OrderedDict()
_memory_lock = threading.Lock()


def shipped_semantic_test() -> SemanticTest:
    """The shipped Fashion-MNIST test (1x28x28, 10 classes): :func:`~lightning_gp.metrics.semantic.public_classifier`,
    :data:`~lightning_gp.metrics.semantic.SEMANTIC_LINE` and the default trivial guesses.

    Its scores equal :func:`~lightning_gp.metrics.semantic.semantic_score_matrix`'s with the defaults.
    ``false_alarm`` is :data:`SHIPPED_FALSE_ALARM` = 0.006: the MEASURED fraction of the 1000 other-class
    images of ``benchmarks/semantic_calibration.py`` (full Fashion-MNIST, indices 59000-59999) over the
    line, the images the hand calibration set the line from (``calibration_size`` 1000; every trivial
    guess scored under 0.004). It is an empirical rate on the calibration images, not a conformal bound
    (6 of 1000: a one-sided 95% Clopper-Pearson upper bound is about 1.2%), and it was measured with the
    full training split's mean image as the mean-image baseline: with these default baselines (a
    constant image of the mean pixel, as the audit's report uses) the same 1000 pairs give 0.9%, and
    each held-out image scored for all 9 other classes 0.43% (``benchmarks/results/semantic_any_data.md``).
    """
    return SemanticTest(
        classifier=public_classifier(),
        baselines=trivial_guesses(),
        line=SEMANTIC_LINE,
        false_alarm=SHIPPED_FALSE_ALARM,
        calibration_size=1000,
        image_shape=IMAGE_SHAPE,
        num_classes=NUM_CLASSES,
        fingerprint=f"shipped:{CLASSIFIER_SHA256}",
        source="shipped Fashion-MNIST classifier",
    )


def default_epochs(training_images: int) -> int:
    """Epochs for ``training_images`` when ``epochs=None``: about :data:`STEP_BUDGET` steps of 64 images.

    ``clamp(round(240 / ceil(n / 64)), 3, 60)``: 750 training images (1000 public) get 20 epochs (240
    steps, about 30 s for 1x28x28 on one CPU thread); sets over about 19,000 training images get 3
    epochs, so the time grows linearly with the set beyond that (60,000 1x28x28 images: a few
    minutes). The cost of one step grows with the pixels per image (3x32x32: about 1.3x 1x28x28's).
    """
    steps = max(1, math.ceil(training_images / _BATCH))
    return min(MAX_EPOCHS, max(MIN_EPOCHS, round(STEP_BUDGET / steps)))


def conformal_line(null_scores: Tensor, false_alarm: float, block: int = 1) -> float:
    """The split-conformal line: the ``k``-th smallest of the ``n`` null scores, ``k = ceil((1 - false_alarm)(n + block))``.

    With ``block = 1`` (one score per exchangeable unit) a new null score exceeds the line with
    probability at most ``false_alarm`` (Vovk et al. 2005; Lei et al. 2018). With units of ``block``
    dependent scores each (one image scored for several classes) the same holds for a score of a new
    unit, taken at a uniformly random position in it. Needs ``k <= n``, i.e. ``n / block >= 1 /
    false_alarm - 1`` (:class:`SemanticCalibrationError` otherwise). ``k`` is computed with a 1e-9
    slack so that float rounding of ``(1 - false_alarm)`` does not add one.
    """
    scores = torch.as_tensor(null_scores).detach().flatten().cpu()
    n = scores.numel()
    k = _order_index(n, false_alarm, block)
    if k > n:
        raise SemanticCalibrationError(
            f"{n} null scores ({n // max(block, 1)} units of {block}) cannot set a line at false_alarm={false_alarm}: "
            f"the conformal rank ceil((1 - false_alarm)(n + {block})) = {k} exceeds n (needs n / {block} >= "
            f"1 / false_alarm - 1 = {1 / false_alarm - 1:.4g})"
        )
    return float(scores.sort().values[k - 1])


def _order_index(n: int, false_alarm: float, block: int) -> int:
    return math.ceil((1 - false_alarm) * (n + block) - 1e-9)


def fit_semantic_test(
    public_images: Tensor,
    public_labels: Tensor,
    *,
    false_alarm: float = 0.01,
    seed: int = 0,
    epochs: int | None = None,
    cache_dir: str | Path | None = None,
) -> SemanticTest:
    """Train and calibrate a semantic test on public data (see the module docstring for the method).

    Args:
        public_images: ``[N, C, H, W]`` pixels in [0, 1] (H, W >= 8), images an audit does not attack.
        public_labels: ``[N]`` integer classes; every class in ``[0, max + 1)`` needs at least
            :data:`MIN_IMAGES_PER_CLASS` images, and there must be at least 2 classes.
        false_alarm: the level in (0, 0.5]: per image-label test, the probability that an image of
            another class (or an outlier image) is called recognisable. Needs at least
            ``1 / false_alarm - 1`` calibration images (a quarter of the public images), else
            :class:`SemanticCalibrationError` saying how many public images would do.
        seed: seeds the split, the training and the calibration outliers.
        epochs: training epochs (default :func:`default_epochs` of the training part's size).
        cache_dir: also cache the fit on disk there (default: in memory only).

    Raises:
        ValueError: bad input, naming the argument (a :class:`SemanticCalibrationError` for too few images).
    """
    _check_false_alarm(false_alarm)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise ValueError(f"epochs must be a positive int or None, got {epochs!r}")
    images, labels = _checked_public_data(public_images, public_labels)
    training, calibration = _stratified_split(labels, seed)
    _check_enough_calibration(len(calibration), len(labels), false_alarm)
    epochs = default_epochs(len(training)) if epochs is None else epochs
    key = fingerprint_of(images, labels, false_alarm=false_alarm, seed=seed, epochs=epochs)
    path = None if cache_dir is None else Path(cache_dir).expanduser() / f"semantic_test_{key}.pt"
    with _memory_lock:
        test = _memory_cache.get(key)
        if test is not None:
            _memory_cache.move_to_end(key)
    if test is not None:
        if path is not None and not path.exists():
            _save_cached(test, path)
        return test
    test = _load_cached(path, key) if path is not None and path.exists() else None
    if test is None:
        with torch.inference_mode(False):  # callers may score under inference mode; training needs autograd
            test = _fit(
                images, labels, training, calibration, false_alarm=false_alarm, seed=seed, epochs=epochs, key=key
            )
        if path is not None:
            _save_cached(test, path)
    with _memory_lock:
        _memory_cache[key] = test
        while len(_memory_cache) > MEMORY_CACHE_SIZE:
            _memory_cache.popitem(last=False)
    return test


def clear_memory_cache() -> None:
    """Forget every fit kept in memory (disk cache files stay)."""
    with _memory_lock:
        _memory_cache.clear()


def fingerprint_of(images: Tensor, labels: Tensor, *, false_alarm: float, seed: int, epochs: int) -> str:
    """sha256 (hex) of the public data's bytes and shape and the recipe (level, seed, epochs, version, torch)."""
    digest = hashlib.sha256()
    pixels = images.detach().to("cpu", torch.float32).contiguous().numpy()
    classes = labels.detach().to("cpu", torch.int64).contiguous().numpy()
    header = (
        f"{_CACHE_FORMAT}|recipe={RECIPE_VERSION}|torch={torch.__version__}|shape={tuple(pixels.shape)}|"
        f"labels={tuple(classes.shape)}|false_alarm={false_alarm!r}|seed={seed}|epochs={epochs}|"
    )
    digest.update(header.encode())
    digest.update(pixels.tobytes())
    digest.update(b"|")
    digest.update(classes.tobytes())
    return digest.hexdigest()


def _check_false_alarm(false_alarm: float) -> None:
    ok = isinstance(false_alarm, (int, float)) and not isinstance(false_alarm, bool)
    if not ok or not math.isfinite(false_alarm) or not 0 < false_alarm <= 0.5:
        raise ValueError(f"false_alarm must be a number in (0, 0.5], got {false_alarm!r}")


def _checked_public_data(public_images: Any, public_labels: Any) -> tuple[Tensor, Tensor]:
    """Float32 CPU copies (plain tensors, also when the caller is in inference mode), validated."""
    with torch.inference_mode(False):
        images = torch.as_tensor(public_images).detach()
        if images.ndim != 4:
            raise ValueError(f"public_images must be [N, C, H, W] pixels in [0, 1], got shape {tuple(images.shape)}")
        if min(images.shape[2:]) < 8:
            raise ValueError(f"public_images must be at least 8x8 pixels, got {tuple(images.shape[1:])}")
        if images.is_complex() or images.dtype == torch.bool:
            raise ValueError(f"public_images must hold real pixel values in [0, 1], got dtype {images.dtype}")
        images = images.to("cpu", torch.float32).clone()
        check_pixel_range(images, "public_images")
        labels = torch.as_tensor(public_labels).detach()
        if labels.ndim != 1 or len(labels) != len(images):
            raise ValueError(
                f"public_labels must be [N] with N = {len(images)} (one per public image), got shape {tuple(labels.shape)}"
            )
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"public_labels must be integer class indices, got dtype {labels.dtype}")
        labels = labels.to("cpu", torch.int64).clone()
    if len(labels) and int(labels.min()) < 0:
        raise ValueError(f"public_labels must be non-negative class indices, got {int(labels.min())}")
    _check_classes(labels)
    return images, labels


def _check_classes(labels: Tensor) -> None:
    counts = torch.bincount(labels) if len(labels) else torch.zeros(0, dtype=torch.int64)
    if int((counts > 0).sum()) < 2:
        raise SemanticCalibrationError(f"public_labels must hold at least 2 classes, got {int((counts > 0).sum())}")
    short = [(c, int(n)) for c, n in enumerate(counts.tolist()) if n < MIN_IMAGES_PER_CLASS]
    if short:
        listed = ", ".join(f"class {c}: {n}" for c, n in short[:8]) + (", ..." if len(short) > 8 else "")
        raise SemanticCalibrationError(
            f"public_labels: every class in [0, {len(counts)}) needs at least {MIN_IMAGES_PER_CLASS} public images "
            f"({len(short)} have fewer: {listed}); relabel the classes to 0..K-1 or add public images"
        )


def _stratified_split(labels: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """(training, calibration) indices: per class, a seeded random ``floor(n_c / 4)`` to calibration."""
    g = torch.Generator().manual_seed(_derived_seed("split", seed))
    training, calibration = [], []
    for c in range(int(labels.max()) + 1):
        members = torch.nonzero(labels == c).flatten()
        members = members[torch.randperm(len(members), generator=g)]
        held = int(len(members) * CALIBRATION_FRACTION)
        calibration.append(members[:held])
        training.append(members[held:])
    return torch.cat(training).sort().values, torch.cat(calibration).sort().values


def _derived_seed(purpose: str, seed: int) -> int:
    """A seed for ``purpose`` that shares no stream with the training's generator (seeded with ``seed``)."""
    return int.from_bytes(hashlib.sha256(f"semantic_test:{purpose}:{seed}".encode()).digest()[:8], "big") >> 1


def _check_enough_calibration(calibration_images: int, public_images: int, false_alarm: float) -> None:
    """Raise unless ``calibration_images`` other-class units can set a line at ``false_alarm``."""
    needed = max(1, math.floor((1 - false_alarm) / false_alarm) - 1)
    while _order_index(needed, false_alarm, 1) > needed:  # smallest n with ceil((1 - a)(n + 1)) <= n
        needed += 1
    if calibration_images < needed:
        raise SemanticCalibrationError(
            f"public_images: false_alarm={false_alarm} needs at least {needed} calibration images (1 / false_alarm "
            f"- 1), i.e. about {math.ceil(needed / CALIBRATION_FRACTION)} public images (a quarter of each class "
            f"calibrates), got {public_images} public images giving {calibration_images}; pass more public "
            "images or a larger false_alarm"
        )


def _fit(
    images: Tensor,
    labels: Tensor,
    training: Tensor,
    calibration: Tensor,
    *,
    false_alarm: float,
    seed: int,
    epochs: int,
    key: str,
) -> SemanticTest:
    shape = (int(images.shape[1]), int(images.shape[2]), int(images.shape[3]))
    num_classes = int(labels.max()) + 1
    net = train_public_classifier(images[training], labels[training], epochs=epochs, seed=seed, classes=num_classes)
    baselines = trivial_guesses(images.mean(dim=0), _BASELINE_SEED, shape)
    base = softmax_of(net, baselines).amax(dim=0)
    lifts = _probabilities(net, images[calibration]) - base
    other = lifts[labels[calibration][:, None] != torch.arange(num_classes)]
    outliers = _outlier_lifts(net, base, shape, false_alarm, seed)
    line = max(
        conformal_line(other, false_alarm, block=num_classes - 1),
        conformal_line(outliers, false_alarm, block=num_classes),
        0.0,
    )
    return SemanticTest(
        classifier=net,
        baselines=baselines,
        line=line,
        false_alarm=float(false_alarm),
        calibration_size=other.numel() + outliers.numel(),
        image_shape=shape,
        num_classes=num_classes,
        fingerprint=key,
        source=(
            f"trained at audit time on {len(labels)} public images ({len(training)} to train for {epochs} epochs, "
            f"{len(calibration)} to calibrate)"
        ),
    )


def _probabilities(net: nn.Module, images: Tensor) -> Tensor:
    """``net``'s softmax on ``images`` in chunks of 256 (bounded memory)."""
    return torch.cat([softmax_of(net, images[i : i + _CHUNK]) for i in range(0, len(images), _CHUNK)])


def _outlier_lifts(net: nn.Module, base: Tensor, shape: tuple[int, int, int], false_alarm: float, seed: int) -> Tensor:
    """Scores ``[M, K]`` of M fresh outlier images (not the training draws) for every class."""
    count = max(MIN_OUTLIERS, 2 * math.ceil(1 / false_alarm))
    g = torch.Generator().manual_seed(_derived_seed("outliers", seed))
    chunks = [softmax_of(net, _outliers(min(_CHUNK, count - i), g, shape)) for i in range(0, count, _CHUNK)]
    return torch.cat(chunks) - base


def _load_cached(path: Path, key: str) -> SemanticTest | None:
    """The cached test in ``path``; None (with a warning naming the file) when it is unusable."""
    try:
        if not zipfile.is_zipfile(path):  # torch.save writes a zip archive
            raise ValueError("not a torch.save file (not a zip archive)")
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or data.get("format") != _CACHE_FORMAT or data.get("fingerprint") != key:
            raise ValueError("not a semantic test cache file for this fit")
        c, h, w = (int(s) for s in data["image_shape"])
        net = PublicClassifier(int(data["num_classes"]), c, (h, w))
        net.load_state_dict(data["state_dict"])
        baselines = data["baselines"]
        if not isinstance(baselines, Tensor) or tuple(baselines.shape[1:]) != (c, h, w):
            raise ValueError("its baselines do not fit its image shape")
        return SemanticTest(
            classifier=net.eval().requires_grad_(False),
            baselines=baselines.float(),
            line=float(data["line"]),
            false_alarm=float(data["false_alarm"]),
            calibration_size=int(data["calibration_size"]),
            image_shape=(c, h, w),
            num_classes=int(data["num_classes"]),
            fingerprint=key,
            source=str(data["source"]),
        )
    except Exception as err:  # any unreadable or foreign file: retrain and overwrite (documented)
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        warnings.warn(
            f"semantic test cache file {path} is unusable ({type(err).__name__}: {reason}); retraining and overwriting it",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _save_cached(test: SemanticTest, path: Path) -> None:
    """Write ``test`` to ``path`` atomically (tensors and plain Python data only); a failure is a warning."""
    data = {
        "format": _CACHE_FORMAT,
        "fingerprint": test.fingerprint,
        "state_dict": {k: v.detach().cpu().contiguous() for k, v in test.classifier.state_dict().items()},
        "baselines": test.baselines.detach().cpu().contiguous(),
        "line": float(test.line),
        "false_alarm": float(test.false_alarm),
        "calibration_size": int(test.calibration_size),
        "image_shape": [int(s) for s in test.image_shape],
        "num_classes": int(test.num_classes),
        "source": test.source,
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, tmp)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        warnings.warn(
            f"semantic test cache file {path} could not be written ({err}); kept in memory only", stacklevel=3
        )
