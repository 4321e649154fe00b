"""Score one reconstruction against the client's batch: per-image metrics, means, thresholds.

Thresholds (Refiner, Sec. 5 "Privacy protection" and App. N): below PSNR 15, below SSIM 0.5,
above LPIPS 0.05 and above a noise ratio of 0.4 (Refiner's evaluation network, see
:mod:`lightning_gp.metrics.noise_ratio`) a human no longer sees the private image. A defense is
"private" on a metric when the batch mean crosses that threshold in the private direction. The
noise ratio is "n/a" (with the reason in ``ReconstructionReport.unavailable``) for images with a
channel count no shipped evaluation network takes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_gp.attacks.base import Reconstruction
from lightning_gp.attacks.view import ServerView
from lightning_gp.metrics.matching import MATCH_METRICS, match_reconstructions, pairwise_scores
from lightning_gp.metrics.nmi import nmi_pairwise
from lightning_gp.metrics.recognition import RecognitionTests
from lightning_gp.normalization import denormalize, per_channel

PRIVACY_THRESHOLDS: dict[str, float] = {"psnr": 15.0, "ssim": 0.5, "lpips": 0.05, "noise_ratio": 0.4}
# True: a higher value means more private (less similar to the original; for the noise ratio: noisier).
HIGHER_IS_PRIVATE: dict[str, bool] = {
    "mse": True,
    "psnr": False,
    "ssim": False,
    "lpips": True,
    "nmi": False,
    "noise_ratio": True,
    "semantic": False,
    "identification": True,  # a p-value: small means the output picks out its original
}
METRICS = ("mse", "psnr", "ssim", "lpips", "nmi", "noise_ratio", "semantic", "identification")
#: The image similarities every pair is scored by (LPIPS, which needs its network, is asked for apart).
SIMILARITIES = ("mse", "psnr", "ssim", "nmi")
#: Why the identification score is missing when no calibrated tests were given.
NO_IDENTIFICATION_TEST = (
    "no identification test was given (tests=None); an audit calibrates one on the data's public split "
    "(lightning_gp.audit.recognition_tests)"
)


@dataclass
class ImageScores:
    """Scores of one original and the reconstruction matched to it."""

    index: int  # position in the client's batch
    matched_index: int  # position in the attack's output
    mse: float
    psnr: float
    ssim: float
    lpips: float | None
    nmi: float
    true_label: int | None = None
    predicted_label: int | None = None  # the matched reconstruction's label, if the attack gave labels
    noise_ratio: float | None = None  # the evaluation network's score of the reconstruction (None: not computed)
    # the public classifier's lift of the true class over trivial guesses (lightning_gp.metrics.semantic)
    semantic: float | None = None
    # the identification p-value: does the output pick this original out of public images of its class
    # (lightning_gp.metrics.identification)
    identification: float | None = None
    # False: the attack gave this original no finite reconstruction (scores are NaN: not reconstructed)
    reconstructed: bool = True


@dataclass
class ReconstructionReport:
    """How much of a client's batch an attack recovered (after matching, see ``permutation``).

    Attributes:
        rows: one :class:`ImageScores` per original image.
        means: batch mean of each metric (``None`` for LPIPS when it was skipped). A mean PSNR
            is ``inf`` when any reconstruction is an exact copy (PSNR of identical images).
        label_accuracy: fraction of the true labels recovered as a multiset,
            ``|multiset(predicted) ∩ multiset(true)| / B``. Label recovery from a gradient says
            which labels are in the batch, not which image has which, so this is order-free;
            ``None`` when the attack returned no labels or no true labels were given.
        matched_label_accuracy: fraction of originals whose matched reconstruction carries the
            right label (meaningful for attacks that optimise one label per image, e.g. DLG).
        private: per thresholded metric, whether the mean crosses the threshold in the private
            direction (``None`` when the metric was not computed).
        unavailable: metric -> why it could not be computed (e.g. no evaluation network for the
            images' channel count); such a metric shows as "n/a".
        permutation: ``reconstruction.images[permutation]`` aligns with the originals.
        not_reconstructed: the originals (``rows`` indices) the attack gave no finite reconstruction:
            a non-finite image scores NaN for that original only ("not reconstructed": it cannot
            help the attacker, and the other images keep their scores); the means leave them out.
        original_pixels, reconstructed_pixels: the aligned images in [0, 1] (for figures; not
            part of ``to_dict``).
        prior_only: per original, the bar each controlled metric must beat: the best score the same
            attack reached on that original with guesses that carry no information about the batch
            (the audit's prior-only control for attacks with a data prior,
            :mod:`lightning_gp.audit.prior_control`); ``None``: no control was run.
        prior_only_false_alarm: the control's stated family-wise false-alarm level over this report's
            images and metrics (the chance that an attack that learned nothing from the gradient
            gets a leak credited); ``None`` without a control.
        candidates: per original, every reconstruction of the attack scored against it, metric ->
            ``[R]`` values over the attack's ``R`` outputs (NaN for one that is not finite; a metric
            not computed is absent). The leak rule judges an original by **any** of them
            (:class:`~lightning_gp.audit.verdict.LeakRule`): the one-to-one matching behind ``rows``
            minimises a total and can hand an exact copy to another original, which must never hide
            the leak. ``None``: only the matched row is known.
    """

    attack: str
    match_metric: str
    rows: list[ImageScores]
    means: dict[str, float | None]
    label_accuracy: float | None
    matched_label_accuracy: float | None
    thresholds: dict[str, float]
    private: dict[str, bool | None]
    permutation: list[int]
    original_pixels: Tensor | None = field(default=None, repr=False, compare=False)
    reconstructed_pixels: Tensor | None = field(default=None, repr=False, compare=False)
    unavailable: dict[str, str] = field(default_factory=dict)
    prior_only: list[dict[str, float]] | None = field(default=None, compare=False)
    prior_only_false_alarm: float | None = field(default=None, compare=False)
    candidates: list[dict[str, Tensor]] | None = field(default=None, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def not_reconstructed(self) -> list[int]:
        return [row.index for row in self.rows if not row.reconstructed]

    @property
    def private_on_all(self) -> bool | None:
        """Whether every computed thresholded metric is on the private side (None if none computed)."""
        flags = [flag for flag in self.private.values() if flag is not None]
        return all(flags) if flags else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (``inf``/``nan`` written as the strings "inf", "-inf", "nan"); no images."""
        data = {
            "attack": self.attack,
            "match_metric": self.match_metric,
            "batch_size": self.batch_size,
            "means": dict(self.means),
            "label_accuracy": self.label_accuracy,
            "matched_label_accuracy": self.matched_label_accuracy,
            "thresholds": dict(self.thresholds),
            "private": dict(self.private),
            "private_on_all": self.private_on_all,
            "unavailable": dict(self.unavailable),
            "not_reconstructed": self.not_reconstructed,
            "permutation": list(self.permutation),
            "rows": [asdict(row) for row in self.rows],
        }
        return _json_safe(data)

    def to_markdown(self) -> str:
        """A summary table (means, thresholds, verdicts) and a per-image table."""
        lines = [
            f"### Reconstruction report{f' ({self.attack})' if self.attack else ''}",
            "",
            f"Batch of {self.batch_size}, matched by {self.match_metric}.",
            "",
            "| metric | mean | threshold | private |",
            "| --- | --- | --- | --- |",
        ]
        for name in METRICS:
            threshold = self.thresholds.get(name)
            side = "-" if threshold is None else ("> " if HIGHER_IS_PRIVATE[name] else "< ") + f"{threshold:g}"
            flag = self.private.get(name)
            verdict = "-" if flag is None else ("yes" if flag else "no")
            mean = _fmt(self.means.get(name))
            if name in self.unavailable:
                mean = verdict = "n/a"
            lines.append(f"| {name} | {mean} | {side} | {verdict} |")
        for name, reason in self.unavailable.items():
            lines += ["", f"{name} n/a: {reason}"]
        if self.not_reconstructed:
            lines += ["", f"Not reconstructed (non-finite output, scored NaN): images {self.not_reconstructed}."]
        lines.append("")
        lines.append(
            f"Label accuracy (multiset): {_fmt(self.label_accuracy)}; per matched image: {_fmt(self.matched_label_accuracy)}"
        )
        header = (
            "| # | matched | mse | psnr | ssim | lpips | nmi | noise ratio | semantic | identification p | label "
            "| predicted |"
        )
        lines += ["", header, "| --- " * 12 + "|"]
        for r in self.rows:
            ratio, semantic, identification = (
                "n/a" if name in self.unavailable else _fmt(getattr(r, name))
                for name in ("noise_ratio", "semantic", "identification")
            )
            lines.append(
                f"| {r.index} | {r.matched_index} | {_fmt(r.mse)} | {_fmt(r.psnr)} | {_fmt(r.ssim)} | "
                f"{_fmt(r.lpips)} | {_fmt(r.nmi)} | {ratio} | {semantic} | {identification} | {_fmt(r.true_label)} | "
                f"{_fmt(r.predicted_label)} |"
            )
        return "\n".join(lines) + "\n"


def batch_mean(values: Sequence[float | None]) -> float | None:
    """The mean of one metric over a batch's images: ``None`` when the metric was not computed (any
    ``None``) or no image was reconstructed; NaN entries (images not reconstructed) are left out."""
    if any(v is None for v in values):
        return None
    finite = [float(v) for v in values if v is not None and not math.isnan(v)]
    return float(torch.tensor(finite, dtype=torch.float64).mean()) if finite else None


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _denormalizer(view_or_mean_std: ServerView | tuple[Sequence[float], Sequence[float]], channels: int):
    """A function mapping normalised ``[B, C, H, W]`` images to [0, 1] pixels (clamped)."""
    if isinstance(view_or_mean_std, ServerView):
        return view_or_mean_std.denormalize
    try:
        mean, std = view_or_mean_std
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"view_or_mean_std must be a ServerView or a (mean, std) pair of per-channel sequences, got {view_or_mean_std!r}"
        ) from err
    try:
        mean = per_channel(mean, channels, "view_or_mean_std: mean")
        std = per_channel(std, channels, "view_or_mean_std: std", positive=True)
    except TypeError as err:
        raise TypeError(
            f"view_or_mean_std must be a ServerView or a (mean, std) pair of per-channel sequences, got {view_or_mean_std!r}"
        ) from err
    return functools.partial(denormalize, mean=mean, std=std)


def _multiset_accuracy(predicted: Sequence[int], true: Sequence[int]) -> float:
    overlap = Counter(predicted) & Counter(true)
    return sum(overlap.values()) / len(true)


def _check_thresholds(thresholds: Mapping[str, float]) -> dict[str, float]:
    unknown = [name for name in thresholds if name not in HIGHER_IS_PRIVATE]
    if unknown:
        raise ValueError(f"thresholds: unknown metric(s) {unknown}; this report computes {list(HIGHER_IS_PRIVATE)}")
    return {name: float(value) for name, value in thresholds.items()}


def privacy_flags(means: Mapping[str, float | None], thresholds: Mapping[str, float]) -> dict[str, bool | None]:
    """Per thresholded metric: is the mean on the private side (PSNR/SSIM/NMI below, LPIPS/MSE above)?"""
    flags: dict[str, bool | None] = {}
    for name, threshold in _check_thresholds(thresholds).items():
        value = means.get(name)
        if value is None or math.isnan(value):
            flags[name] = None
        else:
            flags[name] = value > threshold if HIGHER_IS_PRIVATE[name] else value < threshold
    return flags


def reconstruction_report(
    reconstruction: Reconstruction,
    originals: Tensor,
    view_or_mean_std: ServerView | tuple[Sequence[float], Sequence[float]],
    true_labels: Tensor | None = None,
    lpips: bool = True,
    thresholds: Mapping[str, float] = PRIVACY_THRESHOLDS,
    match_metric: str = "mse",
    lpips_fn: torch.nn.Module | None = None,
    noise_ratio: bool = True,
    evaluator: torch.nn.Module | None = None,
    semantic: bool = True,
    tests: RecognitionTests | None = None,
) -> ReconstructionReport:
    """Score an attack's reconstruction against the client's (normalised) batch.

    Both batches are denormalised to [0, 1] pixels (``ServerView.denormalize`` or the given
    ``(mean, std)``), the reconstructions are matched to the originals
    (:func:`~lightning_gp.metrics.matching.match_reconstructions` on ``match_metric``), and every
    reconstruction is scored against every original (:func:`pair_scores`: MSE, PSNR, SSIM,
    LPIPS-AlexNet unless ``lpips=False``, PriPrune's NMI, Refiner's noise ratio unless
    ``noise_ratio=False``, "n/a" with the reason in ``unavailable`` when no evaluation network takes its
    channel count, and the semantic test): the matched pairs give the rows and means, all of them the
    ``candidates`` the leak rule judges each original by.

    Args:
        reconstruction: the attack's output (``images`` normalised, in the attack's order).
        originals: the client's batch ``[B, C, H, W]``, normalised like the model's inputs.
        view_or_mean_std: the round's :class:`ServerView`, or ``(mean, std)`` per channel.
        true_labels: ``[B]`` labels of ``originals`` (for label accuracy), or ``None``.
        lpips: compute LPIPS (needs the pretrained weights, see ``metrics.lpips``).
        thresholds: metric -> threshold for the privacy verdicts (default Refiner's).
        match_metric: similarity used to align the batches ("mse", "psnr", "ssim", "lpips").
        lpips_fn: an LPIPS module to reuse (default: :class:`~lightning_gp.metrics.lpips.LPIPS`).
        noise_ratio: score each reconstruction with the evaluation network.
        evaluator: the evaluation network to use (default: the shipped one for the channel count).
        semantic: score each matched reconstruction with the public classifier's semantic test
            (:func:`~lightning_gp.metrics.semantic.semantic_scores`: how much more it names the
            original's class than trivial guesses do); "n/a" with the reason without ``true_labels``
            or for images the classifier was not built for.
        tests: the recognisable-image tests calibrated on the data's public split
            (:class:`~lightning_gp.metrics.RecognitionTests`): their semantic test replaces
            the shipped Fashion-MNIST one, and their identification test gives each pair's
            identification p-value. ``None``: the shipped semantic test where the images fit it, and no
            identification score (:data:`NO_IDENTIFICATION_TEST`).
    """
    return reconstruction_reports(
        [reconstruction],
        originals,
        view_or_mean_std,
        true_labels=true_labels,
        lpips=lpips,
        thresholds=thresholds,
        match_metric=match_metric,
        lpips_fn=lpips_fn,
        noise_ratio=noise_ratio,
        evaluator=evaluator,
        semantic=semantic,
        tests=tests,
    )[0]


def reconstruction_reports(
    reconstructions: Sequence[Reconstruction],
    originals: Tensor,
    view_or_mean_std: ServerView | tuple[Sequence[float], Sequence[float]],
    true_labels: Tensor | None = None,
    lpips: bool = True,
    thresholds: Mapping[str, float] = PRIVACY_THRESHOLDS,
    match_metric: str = "mse",
    lpips_fn: torch.nn.Module | None = None,
    noise_ratio: bool = True,
    evaluator: torch.nn.Module | None = None,
    semantic: bool = True,
    tests: RecognitionTests | None = None,
) -> list[ReconstructionReport]:
    """:func:`reconstruction_report` of each of several reconstructions of the same ``originals`` (e.g.
    an attack's outputs on many public batches, the prior-only control), scored in one pass over all
    their outputs; each report is the one :func:`reconstruction_report` gives (arguments as there)."""
    if isinstance(reconstructions, Reconstruction) or not reconstructions:
        raise ValueError("reconstructions must be a non-empty sequence of Reconstruction")
    for reconstruction in reconstructions:
        _check_report_inputs(reconstruction, originals, match_metric, lpips)
    thresholds = _check_thresholds(thresholds)
    batch = originals.shape[0]
    if true_labels is not None and tuple(true_labels.shape) != (batch,):
        raise ValueError(f"true_labels must have shape ({batch},), got {tuple(true_labels.shape)}")
    denormalize = _denormalizer(view_or_mean_std, originals.shape[1])
    with torch.no_grad():
        parts = [_pixels_and_failures(r.images, originals, denormalize) for r in reconstructions]
        orig_px = parts[0][0]
        if lpips and lpips_fn is None:
            from lightning_gp.metrics.lpips import LPIPS

            lpips_fn = LPIPS()
        every_pair, unavailable = pair_scores(
            torch.cat([p[1] for p in parts]),
            orig_px,
            torch.cat([p[2] for p in parts]),
            lpips_fn if lpips else None,
            noise_ratio,
            evaluator,
            semantic,
            true_labels,
            tests,
        )
        reports, start = [], 0
        for reconstruction, (_, rec_px, failed) in zip(reconstructions, parts):
            pairs = {name: values[:, start : start + rec_px.shape[0]] for name, values in every_pair.items()}
            start += rec_px.shape[0]
            perm = match_reconstructions(
                rec_px, orig_px, match_metric, lpips_fn if lpips else None, unusable=failed
            ).cpu()
            scored = _Scored(orig_px, rec_px, failed, perm, pairs, dict(unavailable))
            reports.append(_assembled_report(reconstruction, scored, true_labels, thresholds, match_metric))
    return reports


@dataclass
class _Scored:
    """One reconstruction's pixels, failures, matching and scores of every output on every original."""

    orig_px: Tensor
    rec_px: Tensor
    failed: Tensor
    perm: Tensor
    pairs: dict[str, Tensor]
    unavailable: dict[str, str]


def _assembled_report(
    reconstruction: Reconstruction,
    scored: _Scored,
    true_labels: Tensor | None,
    thresholds: dict[str, float],
    match_metric: str,
) -> ReconstructionReport:
    """The report of ``reconstruction`` from its scores: the matched rows, their means and the candidates."""
    batch, perm = scored.orig_px.shape[0], scored.perm
    scores = {name: values[torch.arange(batch), perm] for name, values in scored.pairs.items()}
    true, predicted = _true_and_matched_labels(reconstruction, true_labels, perm)
    rows = _image_rows(scores, perm, true, predicted, scored.failed[perm], batch)
    means = {name: batch_mean([getattr(row, name) for row in rows]) for name in METRICS}
    label_accuracy, matched_accuracy = _label_accuracies(true, predicted)
    return ReconstructionReport(
        attack=reconstruction.attack,
        match_metric=match_metric,
        rows=rows,
        means=means,
        label_accuracy=label_accuracy,
        matched_label_accuracy=matched_accuracy,
        thresholds=thresholds,
        private=privacy_flags(means, thresholds),
        permutation=[int(v) for v in perm.tolist()],
        original_pixels=scored.orig_px,
        reconstructed_pixels=scored.rec_px[perm],
        unavailable=scored.unavailable,
        candidates=[{name: values[i].clone() for name, values in scored.pairs.items()} for i in range(batch)],
    )


def _check_report_inputs(reconstruction: Reconstruction, originals: Tensor, match_metric: str, lpips: bool) -> None:
    """The reconstruction and originals are ``[B, C, H, W]`` batches of one image shape, and the
    matching metric is known (LPIPS only when LPIPS is computed)."""
    if not isinstance(reconstruction, Reconstruction):
        raise TypeError(f"reconstruction must be a Reconstruction, got {type(reconstruction).__name__}")
    if not isinstance(originals, Tensor) or originals.ndim != 4:
        raise ValueError(f"originals must be a [B, C, H, W] tensor, got {getattr(originals, 'shape', type(originals))}")
    images = reconstruction.images
    if images.ndim != 4 or images.shape[1:] != originals.shape[1:]:
        raise ValueError(
            f"reconstruction.images {tuple(images.shape)} and originals {tuple(originals.shape)} must be "
            "[B, C, H, W] batches of one image shape"
        )
    if match_metric not in MATCH_METRICS:
        raise ValueError(f"match_metric must be one of {MATCH_METRICS}, got {match_metric!r}")
    if match_metric == "lpips" and not lpips:
        raise ValueError("match_metric='lpips' needs lpips=True")


def _pixels_and_failures(
    images: Tensor, originals: Tensor, denormalize: Callable[[Tensor], Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """The originals' and the reconstructions' [0, 1] pixels on the CPU, and which reconstructions failed.

    A reconstruction with any non-finite entry is "not reconstructed": a blank placeholder, matched
    last, its original's scores NaN (denormalize would clamp inf into the pixel range).
    """
    orig_px = denormalize(originals.detach().float().cpu()).cpu()
    failed = ~torch.isfinite(images.detach().float().cpu()).flatten(1).all(dim=1)
    rec_px = denormalize(torch.nan_to_num(images.detach().float().cpu(), nan=0.0, posinf=0.0, neginf=0.0)).cpu()
    rec_px[failed] = 0.0
    return orig_px, rec_px, failed


def pair_scores(
    rec_px: Tensor,
    orig_px: Tensor,
    failed: Tensor,
    lpips_fn: torch.nn.Module | None,
    noise_ratio: bool,
    evaluator: torch.nn.Module | None,
    semantic: bool,
    true_labels: Tensor | None,
    tests: RecognitionTests | None = None,
    similarities: Collection[str] = SIMILARITIES,
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Every reconstruction scored against every original: the scoring of :func:`reconstruction_report`
    (and of anything that must judge as the audit judges, e.g. the fixed guesses of ReRo's kappa).

    ``rec_px`` ``[B_rec, C, H, W]`` and ``orig_px`` ``[B_orig, C, H, W]`` are pixels in [0, 1];
    ``failed`` ``[B_rec]`` marks reconstructions that are not finite. Returns metric -> ``[B_orig,
    B_rec]`` float64 (NaN in the columns of ``failed``): MSE, PSNR, SSIM, NMI, LPIPS with
    ``lpips_fn``, the noise ratio (the reconstruction's own score, the same in every row) with
    ``noise_ratio``, the semantic test for each original's label in ``true_labels`` with
    ``semantic`` (``tests``' semantic test, else the shipped one), the identification p-value with
    ``tests``; and why an asked-for score is not available. ``similarities`` names which of
    :data:`SIMILARITIES` to compute (a caller that judges by a rule reading fewer of them skips the rest:
    on hundreds of originals against hundreds of guesses they are most of the cost)."""
    unknown = set(similarities) - set(SIMILARITIES)
    if unknown:
        raise ValueError(f"similarities must be among {SIMILARITIES}, got {sorted(unknown)}")
    pairs: dict[str, Tensor] = {
        m: pairwise_scores(rec_px, orig_px, m) for m in ("mse", "psnr", "ssim") if m in similarities
    }
    if "nmi" in similarities:
        pairs["nmi"] = nmi_pairwise(rec_px, orig_px)
    if lpips_fn is not None:
        pairs["lpips"] = pairwise_scores(rec_px, orig_px, "lpips", lpips_fn)
    unavailable: dict[str, str] = {}
    if noise_ratio:
        ratio = _noise_ratio_or_reason(rec_px, evaluator)
        if isinstance(ratio, str):
            unavailable["noise_ratio"] = ratio
        else:
            pairs["noise_ratio"] = ratio.detach().cpu()[None, :].expand(orig_px.shape[0], -1)
    if tests is not None:
        if not semantic:  # not asked for: its classifier is not run
            tests = tests.without("semantic", "not asked for (semantic=False)")
        tested, missing = tests.score_matrices(rec_px, orig_px, true_labels)
        if not semantic:
            missing.pop("semantic", None)
        pairs.update(tested)
        unavailable.update(missing)
    else:
        unavailable["identification"] = NO_IDENTIFICATION_TEST
        if semantic:
            lift = _semantic_or_reason(rec_px, true_labels)
            if isinstance(lift, str):
                unavailable["semantic"] = lift
            else:
                pairs["semantic"] = lift
    return {m: v.double().masked_fill(failed[None, :], math.nan) for m, v in pairs.items()}, unavailable


def _true_and_matched_labels(
    reconstruction: Reconstruction, true_labels: Tensor | None, perm: Tensor
) -> tuple[list[int] | None, list[int] | None]:
    """The true labels, and the attack's labels in the matched order (``None`` where not given)."""
    images = reconstruction.images
    true = None if true_labels is None else [int(v) for v in true_labels.detach().cpu().tolist()]
    predicted_all = (
        None
        if reconstruction.labels is None
        else [int(v) for v in reconstruction.labels.detach().cpu().flatten().tolist()]
    )
    if predicted_all is not None and len(predicted_all) != images.shape[0]:
        raise ValueError(f"reconstruction.labels has {len(predicted_all)} entries for {images.shape[0]} images")
    predicted = None if predicted_all is None else [predicted_all[j] for j in perm.tolist()]
    return true, predicted


def _label_accuracies(true: Sequence[int] | None, predicted: Sequence[int] | None) -> tuple[float | None, float | None]:
    """The attack's label accuracy as multisets (order-free), and per matched image; ``None`` without both labels."""
    if true is None or predicted is None:
        return None, None
    return _multiset_accuracy(predicted, true), sum(p == t for p, t in zip(predicted, true)) / len(true)


def _image_rows(
    scores: Mapping[str, Tensor],
    perm: Tensor,
    true: Sequence[int] | None,
    predicted: Sequence[int] | None,
    not_reconstructed: Tensor,
    batch: int,
) -> list[ImageScores]:
    """One :class:`ImageScores` per original (``None`` for a score that was not computed)."""
    return [
        ImageScores(
            index=i,
            matched_index=int(perm[i]),
            mse=float(scores["mse"][i]),
            psnr=float(scores["psnr"][i]),
            ssim=float(scores["ssim"][i]),
            lpips=float(scores["lpips"][i]) if "lpips" in scores else None,
            nmi=float(scores["nmi"][i]),
            true_label=None if true is None else true[i],
            predicted_label=None if predicted is None else predicted[i],
            noise_ratio=float(scores["noise_ratio"][i]) if "noise_ratio" in scores else None,
            semantic=float(scores["semantic"][i]) if "semantic" in scores else None,
            identification=float(scores["identification"][i]) if "identification" in scores else None,
            reconstructed=not bool(not_reconstructed[i]),
        )
        for i in range(batch)
    ]


def _semantic_or_reason(pixels: Tensor, true_labels: Tensor | None) -> Tensor | str:
    """The semantic test's scores ``[B_orig, B_rec]`` of every reconstruction for every original's label,
    or why it cannot run."""
    from lightning_gp.metrics.semantic import IMAGE_SHAPE, NUM_CLASSES, semantic_score_matrix

    if true_labels is None:
        return "needs the originals' true labels"
    if tuple(pixels.shape[1:]) != IMAGE_SHAPE:
        return (
            f"the public classifier is built and calibrated for {'x'.join(map(str, IMAGE_SHAPE))} images, these are "
            f"{'x'.join(map(str, pixels.shape[1:]))}"
        )
    labels = true_labels.detach().cpu().long()
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= NUM_CLASSES):
        return f"the public classifier knows {NUM_CLASSES} classes, the labels reach {int(labels.max())}"
    return semantic_score_matrix(pixels, labels)


def _noise_ratio_or_reason(pixels: Tensor, evaluator: torch.nn.Module | None) -> Tensor | str:
    """The noise ratio ``[B]`` of ``pixels``, or why no evaluation network can score them."""
    from lightning_gp.metrics.noise_ratio import noise_ratio
    from lightning_gp.refiner.evaluator import EvaluatorUnavailableError

    try:
        return noise_ratio(pixels, evaluator=evaluator)
    except EvaluatorUnavailableError as err:
        return str(err)


def concatenate_reports(reports: Sequence[ReconstructionReport]) -> ReconstructionReport:
    """One attack's reports on several clients' batches as one report over all their images.

    Rows are renumbered in order (client after client), means are recomputed over every image, the
    label accuracies are averaged weighted by batch size, and the pixels are concatenated, so a
    worst case over attacks (:func:`~lightning_gp.audit.verdict.worst_case_report`) can judge
    several clients together.
    """
    reports = list(reports)
    if not reports:
        raise ValueError("reports is empty: give at least one client's report")
    names = {r.attack for r in reports}
    if len(names) > 1:
        raise ValueError(f"concatenate one attack's reports at a time, got attacks {sorted(names)}")
    first = reports[0]
    rows: list[ImageScores] = []
    for report in reports:
        offset = len(rows)
        rows += [dataclasses.replace(row, index=offset + row.index) for row in report.rows]
    means = {name: batch_mean([getattr(row, name) for row in rows]) for name in METRICS}

    def weighted(attribute: str) -> float | None:
        values = [(getattr(r, attribute), r.batch_size) for r in reports]
        if any(v is None for v, _ in values):
            return None
        return sum(v * n for v, n in values) / sum(n for _, n in values)

    def pixels(attribute: str) -> Tensor | None:
        parts = [getattr(r, attribute) for r in reports]
        return None if any(p is None for p in parts) else torch.cat(parts)

    # a metric one client could not compute stays None on that client's rows only (a gap the verdict
    # names); it is blanked for the whole report only where no client computed it
    unavailable = {
        metric: reason
        for metric, reason in first.unavailable.items()
        if all(metric in report.unavailable for report in reports)
    }
    false_alarms = [r.prior_only_false_alarm for r in reports]
    return ReconstructionReport(
        attack=first.attack,
        match_metric=first.match_metric,
        rows=rows,
        means=means,
        label_accuracy=weighted("label_accuracy"),
        matched_label_accuracy=weighted("matched_label_accuracy"),
        thresholds=dict(first.thresholds),
        private=privacy_flags(means, first.thresholds),
        permutation=[row.matched_index for row in rows],
        original_pixels=pixels("original_pixels"),
        reconstructed_pixels=pixels("reconstructed_pixels"),
        unavailable=unavailable,
        prior_only=None
        if any(r.prior_only is None for r in reports)
        else [c for r in reports for c in r.prior_only or []],
        # family-wise over the clients: the union bound of each client's level
        prior_only_false_alarm=None
        if any(a is None for a in false_alarms)
        else min(1.0, sum(a for a in false_alarms if a is not None)),
        candidates=None
        if any(r.candidates is None for r in reports)
        else [c for r in reports for c in r.candidates or []],
    )
