"""A semantic leak test: does a public-data classifier name the original's class on a reconstruction?

PSNR and SSIM miss what a person recognises: a Top-k pruning reconstruction at 11 dB can show a
clear dress silhouette. This module adds a per-image test of *class* recognisability for
Fashion-MNIST-like images (1x28x28 grey clothing):

    score(r, c) = p_f(c | r) - max_b p_f(c | b)        (the "lift" over the best trivial guess)
    recognisable  <=>  score > SEMANTIC_LINE

where ``f`` is a small CNN trained on public data only (the built-in sample's *test* split, 1000
images, 100 per class; an audit attacks *training* images, never these), ``c`` is the original's
true class and ``b`` runs over gradient-free guesses (all zeros, mid-grey 0.5, the dataset-mean
image, a uniform and a Gaussian noise image). Training uses generic robustness augmentation
(shifts, flips, noise, blur, contrast, thresholding, down-sampling) and outlier exposure (Hendrycks
et al. 2019, "Deep Anomaly Detection with Outlier Exposure": constant, noise and smooth random
images trained to a uniform output), so blank and noise images get about 1/10 on every class.

Where the weights come from. The classifier is NOT trained at run time: its weights ship inside
the package, ``lightning_gp/metrics/checkpoints/semantic_classifier.pt`` (a ``state_dict``,
float32, 421,642 parameters, about 1.6 MiB), and :func:`public_classifier` loads that file
(``importlib.resources``; cached in memory) after checking its sha256 against
:data:`CLASSIFIER_SHA256` (a missing, corrupt or different file is an error naming the file,
never a silent retrain). The file was written once by :func:`write_public_classifier`, i.e.
``train_public_classifier(*load_public_split())`` (seed 0, 40 epochs) with one CPU thread on
torch 2.13.0+cpu. To reproduce it::

    OMP_NUM_THREADS=1 python benchmarks/semantic_calibration.py --retrain-classifier /tmp/semantic_classifier.pt

which trains (about 75 s), writes the file and says whether its sha256 is the shipped one. The
recipe is seeded and deterministic for one torch build and thread count; another build, thread
count or CPU may round differently and give slightly different weights (a different sha256). The
calibration below describes the shipped file, so the shipped file is the reference: to use new
weights, rerun the calibration and update :data:`CLASSIFIER_SHA256` and :data:`SEMANTIC_LINE`.
Nothing is downloaded.

Why not an LPIPS line. LPIPS-AlexNet (Zhang et al. 2018, "The Unreasonable Effectiveness of Deep
Features as a Perceptual Metric"; :mod:`lightning_gp.metrics.lpips`, 28x28 grey repeated to RGB
and upsampled to 32x32) does not separate the groups on Fashion-MNIST. On 1000 full-dataset
images (``benchmarks/semantic_calibration.py``; 1st / 50th / 99th percentile): a random image of
ANOTHER class 0.04 / 0.15 / 0.34 and the dataset-mean image 0.18 / 0.25 / 0.45 (not
recognisable), but the original with Gaussian noise at 11 dB PSNR 0.08 / 0.27 / 0.46, a x4
low-resolution original 0.15 / 0.27 / 0.45 and a blur (sigma 2) 0.19 / 0.32 / 0.50
(recognisable). No line puts another garment and the mean image above it and a noisy original
below it: LPIPS measures texture similarity, not what a person names. LPIPS stays in the report
beside PSNR/SSIM; this test does not use it.

Calibration (``benchmarks/results/semantic_calibration.md``; 1000 images of the full
Fashion-MNIST *training* split, indices 59000-59999, none in the classifier's training data or
the built-in sample; rerun with the shipped file, whose weights are bit-identical to those the
line was first calibrated with, so every number below is unchanged). The groups overlap per image (some recognisable reconstructions score low,
e.g. of originals the classifier gets wrong even when clean), so the line is set as a detector
with a bounded false-alarm rate, not as a gap between the groups. Score percentiles
(1st / 50th / 99th): zeros, grey, mean image, uniform and Gaussian noise all <= 0.004 at the
99th; a random image of ANOTHER class -0.36 / -0.11 / 0.61. The line 0.7 is that 0.61 plus a
margin of 0.09: at it none of the trivial guesses and 0.6% of other-class images are called
recognisable. A blob (Gaussian blur sigma 6, -0.23 / 0.05 / 0.79) is the known weak spot: the
coarse outline of some garments survives such a blur for the classifier, and 2.9% of blobs are
called recognisable. Recognisable groups, median score and fraction called recognisable:
noise to 11 dB PSNR 0.42 (30%), binarised silhouette 0.84 (61%), blur sigma 1 0.73 (53%),
blur sigma 2 0.50 (34%), x2 / x4 low resolution 0.72 (52%) / 0.52 (34%), brightened +0.3
0.65 (46%), dimmed 0.3x 0.37 (19%), contrast 0.3 around grey 0.17 (10%). Every recognisable
group's 99th percentile is 0.85-0.90.

What the test means. "Recognisable" is strong evidence that the reconstruction shows the
original's class (a dress, a sandal) to a classifier that never saw it; "not recognisable" is no
evidence of privacy (the classifier misses about one in five originals even when clean), which is
why the test is added to the pixel rules, never in place of them. It is a test of the class, not
of the identity: another image of the same class scores like a recognisable reconstruction.
Calibrated on Fashion-MNIST only; for other image shapes :func:`semantic_scores` refuses.

Other data. :class:`PublicClassifier`, :func:`train_public_classifier` and :func:`trivial_guesses`
take any image shape ``[C, H, W]`` (at least 8x8) and class count; for 1x28x28 and 10 classes they are
the shipped recipe, draw for draw. :func:`lightning_gp.metrics.semantic_test.fit_semantic_test`
trains this recipe on a dataset's public split at audit time and sets the line by a split-conformal
quantile at a stated false-alarm level (``benchmarks/semantic_any_data.py`` compares it with the
shipped test on Fashion-MNIST).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import zipfile
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gp.metrics.image_quality import check_pixel_range

#: Per-image line on the score (lift of the true class's probability over the best trivial guess):
#: above it a reconstruction is "recognisable". Calibrated in ``benchmarks/semantic_calibration.py``
#: (see the module docstring).
SEMANTIC_LINE: float = 0.7
#: The image shape the shipped classifier and the calibration are for.
IMAGE_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
#: Fashion-MNIST's training-set mean pixel (the constant mean image when no mean image is given).
FASHION_MNIST_MEAN = 0.2860
#: The shipped classifier's weights: file ``CLASSIFIER_FILE`` inside the package ``CLASSIFIER_PACKAGE``.
CLASSIFIER_PACKAGE = "lightning_gp.metrics.checkpoints"
CLASSIFIER_FILE = "semantic_classifier.pt"
#: sha256 of the shipped file's bytes, checked at every load (the calibrated line is for these weights).
CLASSIFIER_SHA256 = "47b53072f5cd50870c2879a8da6e17717fb50fffc28cd46b59be3ae769ff45f1"
_SAMPLE_FILE = Path(__file__).resolve().parents[1] / "data" / "sample" / "fashion_mnist_sample.npz"
_TRAIN_SEED = 0
_EPOCHS = 40
_BATCH = 64
_OUTLIER_BATCH = 32
_OUTLIER_WEIGHT = 0.5


class PublicClassifier(nn.Module):
    """Small CNN for ``in_channels x H x W`` images in [0, 1] (pixels, not normalised); ``forward -> logits
    [B, classes]``.

    Two 3x3 convolutions, each followed by a 2x2 max-pool, then two linear layers: the flatten size is
    ``64 * (H // 4) * (W // 4)``. The defaults (10 classes, 1x28x28) are the shipped classifier's layers
    (same parameter names and shapes). ``image_size`` (``(H, W)`` or one int for square images) must be
    at least 8 on each side.
    """

    def __init__(
        self,
        classes: int = NUM_CLASSES,
        in_channels: int = IMAGE_SHAPE[0],
        image_size: tuple[int, int] | int = (28, 28),
    ) -> None:
        super().__init__()
        height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        if min(height, width) < 8:
            raise ValueError(
                f"image_size must be at least 8x8 (two 2x2 max-pools need room), got {height}x{width}; "
                "upsample smaller images first"
            )
        if classes < 1 or in_channels < 1:
            raise ValueError(f"classes and in_channels must be positive, got {classes} and {in_channels}")
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(0.3),
            nn.Linear(64 * (height // 4) * (width // 4), 128),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(128, classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def gaussian_blur(x: Tensor, sigma: float) -> Tensor:
    """Separable Gaussian blur of ``[B, C, H, W]`` (kernel radius ``ceil(3 sigma)``, replicate padding)."""
    radius = max(1, int(np.ceil(3 * sigma)))
    t = torch.arange(-radius, radius + 1, dtype=x.dtype, device=x.device)
    kernel = torch.exp(-(t**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    channels = x.shape[1]
    padded = F.pad(x, (radius, radius, radius, radius), mode="replicate")
    out = F.conv2d(padded, kernel.view(1, 1, 1, -1).expand(channels, 1, 1, -1), groups=channels)
    return F.conv2d(out, kernel.view(1, 1, -1, 1).expand(channels, 1, -1, 1), groups=channels)


def low_resolution(x: Tensor, factor: int) -> Tensor:
    """Average-pool by ``factor`` and upsample back (bilinear): a low-resolution copy."""
    small = F.avg_pool2d(x, factor)
    return F.interpolate(small, size=x.shape[-2:], mode="bilinear", align_corners=False).clamp(0, 1)


def _augment(x: Tensor, g: torch.Generator) -> Tensor:
    """Shifts and flips for all; half the batch also gets one generic degradation (any ``[N, C, H, W]``)."""
    n = x.shape[0]
    shifts = (int(torch.randint(-2, 3, (1,), generator=g)), int(torch.randint(-2, 3, (1,), generator=g)))
    x = torch.roll(x, shifts=shifts, dims=(2, 3))
    x = torch.where((torch.rand(n, generator=g) < 0.5).view(-1, 1, 1, 1), x.flip(3), x)
    kind = torch.randint(0, 12, (n,), generator=g).view(-1, 1, 1, 1)  # 6..11: unchanged
    u = torch.rand(n, 1, 1, 1, generator=g)
    scale = 0.2 + 0.8 * u
    shift = (1 - scale) * torch.rand(n, 1, 1, 1, generator=g)
    variants = (
        (x + (0.05 + 0.4 * u) * torch.randn(x.shape, generator=g)).clamp(0, 1),
        gaussian_blur(x, 1.5),
        scale * x + shift,
        (x > 0.05 + 0.4 * u).to(x.dtype),
        low_resolution(x, 2),
    )
    out = x
    for i, variant in enumerate(variants, start=1):
        out = torch.where(kind == i, variant, out)
    return out


def _outliers(n: int, g: torch.Generator, shape: tuple[int, ...] = IMAGE_SHAPE) -> Tensor:
    """``n`` images of nothing, ``[n, *shape]``: constants, uniform noise, Gaussian noise, smooth random fields.

    Constants and the Gaussian noise's level are drawn per channel (solid colours for RGB); for one
    channel the draws are those of the shipped recipe.
    """
    channels = shape[0]
    kind = torch.randint(0, 4, (n, 1, 1, 1), generator=g)
    constant = torch.rand(n, channels, 1, 1, generator=g).expand(n, *shape)
    uniform = torch.rand(n, *shape, generator=g)
    level = torch.rand(n, channels, 1, 1, generator=g)
    gaussian = (level + 0.3 * torch.randn(n, *shape, generator=g)).clamp(0, 1)
    smooth = gaussian_blur(torch.rand(n, *shape, generator=g), 2.0)
    low, high = smooth.amin(dim=(2, 3), keepdim=True), smooth.amax(dim=(2, 3), keepdim=True)
    smooth = (smooth - low) / (high - low + 1e-6)
    out = torch.where(kind == 0, constant, uniform)
    out = torch.where(kind == 2, gaussian, out)
    return torch.where(kind == 3, smooth, out)


def load_public_split() -> tuple[Tensor, Tensor]:
    """The built-in sample's test split as ([1000, 1, 28, 28] pixels in [0, 1], [1000] labels)."""
    with np.load(_SAMPLE_FILE) as npz:
        images, labels = npz["test_images"], npz["test_labels"]
    x = torch.from_numpy(np.asarray(images, dtype=np.float32) / 255.0)
    if x.ndim == 3:
        x = x[:, None]
    return x, torch.from_numpy(np.asarray(labels, dtype=np.int64))


def train_public_classifier(
    images: Tensor, labels: Tensor, epochs: int = _EPOCHS, seed: int = _TRAIN_SEED, classes: int = NUM_CLASSES
) -> PublicClassifier:
    """Train :class:`PublicClassifier` on public ``images`` (pixels) with the recipe above (seeded).

    ``images``: ``[N, C, H, W]`` pixels in [0, 1], any channel count and size (at least 8x8): the
    network, the augmentation and the outlier images take their shape from it. ``labels``: ``[N]`` in
    ``[0, classes)``. For 1x28x28 images and 10 classes this is the shipped recipe, draw for draw.
    Deterministic for a given torch build and thread count (up to float rounding across builds).
    The global RNG is left as it was.
    """
    if images.ndim != 4:
        raise ValueError(f"images must be [N, C, H, W] pixels in [0, 1], got shape {tuple(images.shape)}")
    shape = tuple(images.shape[1:])
    g = torch.Generator().manual_seed(seed)
    # callers score under no_grad/inference mode (reconstruction_report): training needs autograd on
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
        torch.manual_seed(seed)
        net = PublicClassifier(classes, shape[0], (shape[1], shape[2]))
        steps = epochs * ((len(images) + _BATCH - 1) // _BATCH)
        opt = torch.optim.Adam(net.parameters(), lr=2e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
        net.train()
        for _ in range(epochs):
            order = torch.randperm(len(images), generator=g)
            for start in range(0, len(images), _BATCH):
                idx = order[start : start + _BATCH]
                loss = F.cross_entropy(net(_augment(images[idx], g)), labels[idx])
                outlier_logits = net(_outliers(_OUTLIER_BATCH, g, shape))
                loss = loss - _OUTLIER_WEIGHT * outlier_logits.log_softmax(dim=1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    net.eval().requires_grad_(False)
    return net


class ClassifierFileError(ValueError):
    """The semantic classifier's weights file is missing, unreadable or not the expected file."""


def shipped_classifier_file() -> Any:
    """The packaged weights file (an ``importlib.resources`` traversable; a plain path in a source tree)."""
    return resources.files(CLASSIFIER_PACKAGE).joinpath(CLASSIFIER_FILE)


def serialize_classifier(net: nn.Module) -> bytes:
    """``net``'s ``state_dict`` as ``torch.save`` bytes (independent of any file name, so reproducible)."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, buffer)
    return buffer.getvalue()


def classifier_from_bytes(data: bytes, where: str, sha256: str | None = None) -> PublicClassifier:
    """A :class:`PublicClassifier` from ``torch.save``'d state_dict bytes (eval mode, no grad).

    ``sha256``: when given, the bytes' sha256 must equal it. Every failure is a
    :class:`ClassifierFileError` naming ``where``.
    """
    if sha256 is not None:
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise ClassifierFileError(
                f"semantic classifier weights {where} have sha256 {digest}, expected {sha256} (a corrupt or "
                "different file; reinstall lightning_gp, or see lightning_gp.metrics.semantic's docstring to "
                "reproduce the file)"
            )
    if not zipfile.is_zipfile(io.BytesIO(data)):  # torch.save writes a zip archive
        raise ClassifierFileError(f"semantic classifier weights {where} are not a torch.save file (not a zip archive)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as err:
        raise ClassifierFileError(f"semantic classifier weights {where} are not a readable state_dict: {err}") from err
    if not isinstance(state, dict):
        raise ClassifierFileError(
            f"semantic classifier weights {where} hold a {type(state).__name__}, expected a state_dict"
        )
    net = PublicClassifier()
    try:
        net.load_state_dict(state)
    except RuntimeError as err:
        raise ClassifierFileError(f"semantic classifier weights {where} do not fit PublicClassifier: {err}") from err
    return net.eval().requires_grad_(False)


def load_classifier(path: str | Path, sha256: str | None = None) -> PublicClassifier:
    """A :class:`PublicClassifier` from a weights file (e.g. one written by :func:`write_public_classifier`).

    ``sha256``: when given, the file's sha256 must equal it (:class:`ClassifierFileError` otherwise).
    A line calibrated for the shipped weights does not carry over to other weights.
    """
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ClassifierFileError(f"semantic classifier weights {path} cannot be read: {err}") from err
    return classifier_from_bytes(data, str(path), sha256)


@functools.lru_cache(maxsize=1)
def _shipped_classifier() -> PublicClassifier:
    source = shipped_classifier_file()
    where = f"{source} (package {CLASSIFIER_PACKAGE})"
    try:
        data = source.read_bytes()
    except OSError as err:
        raise ClassifierFileError(
            f"the shipped semantic classifier weights {where} cannot be read: {err}; the package data is "
            "missing (reinstall lightning_gp)"
        ) from err
    return classifier_from_bytes(data, where, CLASSIFIER_SHA256)


def public_classifier() -> PublicClassifier:
    """The shipped classifier: the packaged weights (sha256-checked), loaded once per process.

    Never trains (see the module docstring for where the weights come from). The returned network
    is shared: do not modify it.
    """
    return _shipped_classifier()


def write_public_classifier(path: str | Path, threads: int = 1) -> str:
    """Train the classifier with the shipped recipe on ``threads`` threads, write it to ``path``; its sha256.

    ``train_public_classifier(*load_public_split())``, saved with :func:`serialize_classifier`:
    how the shipped file was made (one thread; the torch thread count is restored afterwards).
    Compare the result with :data:`CLASSIFIER_SHA256`.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        net = train_public_classifier(*load_public_split())
    finally:
        torch.set_num_threads(previous)
    data = serialize_classifier(net)
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def trivial_guesses(mean_image: Tensor | None = None, seed: int = 1234, shape: tuple[int, ...] = IMAGE_SHAPE) -> Tensor:
    """Gradient-free guesses ``[5, *shape]``: zeros, grey 0.5, the mean image, uniform and Gaussian noise.

    ``shape``: ``(C, H, W)`` (default the shipped ``(1, 28, 28)``). ``mean_image``: the dataset-mean
    image of that shape in [0, 1]; optional only for the shipped shape (default: a constant image of
    Fashion-MNIST's mean pixel), required for any other. The noise images are drawn from ``seed``.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3:
        raise ValueError(f"shape must be (C, H, W), got {shape}")
    g = torch.Generator().manual_seed(seed)
    if mean_image is None:
        if shape != IMAGE_SHAPE:
            raise ValueError(
                f"mean_image is required for shape {shape} (the constant Fashion-MNIST mean is only the "
                f"default for {IMAGE_SHAPE}): pass the public images' mean, e.g. images.mean(dim=0)"
            )
        mean_image = torch.full(IMAGE_SHAPE, FASHION_MNIST_MEAN)
    mean_image = mean_image.detach().float().cpu()
    if mean_image.numel() != int(np.prod(shape)):
        raise ValueError(f"mean_image must have shape {shape}, got {tuple(mean_image.shape)}")
    mean_image = mean_image.reshape(shape)
    check_pixel_range(mean_image, "mean_image")
    return torch.stack(
        [
            torch.zeros(shape),
            torch.full(shape, 0.5),
            mean_image,
            torch.rand(shape, generator=g),
            (0.5 + 0.25 * torch.randn(shape, generator=g)).clamp(0, 1),
        ]
    )


@torch.no_grad()
def class_probabilities(images: Tensor, classifier: nn.Module | None = None) -> Tensor:
    """Softmax of ``classifier`` (default :func:`public_classifier`) on ``[B, 1, 28, 28]`` pixels in [0, 1]."""
    if images.ndim != 4 or tuple(images.shape[1:]) != IMAGE_SHAPE:
        raise ValueError(
            f"the semantic test's classifier takes [B, 1, 28, 28] images (Fashion-MNIST-like), got "
            f"{tuple(images.shape)}; other data needs its own classifier and calibrated line"
        )
    check_pixel_range(images, "images")
    return softmax_of(public_classifier() if classifier is None else classifier, images)


@torch.no_grad()
def softmax_of(classifier: nn.Module, images: Tensor) -> Tensor:
    """``classifier``'s softmax on ``images`` (on the CPU, float32, no gradient); no shape or range check."""
    return classifier(images.detach().float().cpu()).softmax(dim=1)


def lift_matrix(probabilities: Tensor, baseline_probabilities: Tensor, labels: Tensor) -> Tensor:
    """The semantic score ``[len(labels), B]`` from softmaxes ``[B, K]`` of the images and ``[k, K]`` of the
    baselines: entry ``[i, j]`` = ``p(labels[i] | image j) - max over baselines of p(labels[i] | baseline)``."""
    base = baseline_probabilities.amax(dim=0)
    return probabilities.t()[labels] - base[labels, None]


def semantic_scores(
    reconstructions: Tensor,
    labels: Tensor,
    *,
    classifier: nn.Module | None = None,
    baselines: Tensor | None = None,
) -> Tensor:
    """Per image: ``p(label | reconstruction) - max over baselines of p(label | baseline)``, ``[B]``.

    Args:
        reconstructions: ``[B, 1, 28, 28]`` pixels in [0, 1] (already matched to the originals).
        labels: ``[B]`` the originals' true classes.
        classifier: a public-data classifier on pixels (default :func:`public_classifier`).
        baselines: ``[K, 1, 28, 28]`` gradient-free guesses (default :func:`trivial_guesses`).

    Compare with :data:`SEMANTIC_LINE` via :func:`recognisable`.
    """
    labels = torch.as_tensor(labels).long().cpu().reshape(-1)
    if len(labels) != len(reconstructions):
        raise ValueError(f"{len(reconstructions)} reconstructions but {len(labels)} labels")
    return semantic_score_matrix(reconstructions, labels, classifier=classifier, baselines=baselines).diagonal()


def semantic_score_matrix(
    reconstructions: Tensor,
    labels: Tensor,
    *,
    classifier: nn.Module | None = None,
    baselines: Tensor | None = None,
) -> Tensor:
    """:func:`semantic_scores` of every reconstruction for every original's label: ``[len(labels),
    len(reconstructions)]``, entry ``[i, j]`` = ``p(labels[i] | reconstructions[j]) - max over baselines of
    p(labels[i] | baseline)`` (the leak rule judges an original by any reconstruction of it, not only by
    the one a matching assigned to it)."""
    labels = torch.as_tensor(labels).long().cpu().reshape(-1)
    probs = class_probabilities(reconstructions, classifier)
    if labels.numel() and (labels.min() < 0 or labels.max() >= probs.shape[1]):
        raise ValueError(f"labels must lie in [0, {probs.shape[1]}), got {labels.tolist()}")
    base = class_probabilities(trivial_guesses() if baselines is None else baselines, classifier)
    return lift_matrix(probs, base, labels)


def recognisable(scores: Tensor, line: float = SEMANTIC_LINE) -> Tensor:
    """``scores > line`` (bool, per image): the reconstruction shows the original's class."""
    return torch.as_tensor(scores) > line
