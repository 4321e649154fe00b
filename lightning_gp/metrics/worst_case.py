"""Worst-case privacy verdicts: per image, the best reconstruction any attack achieved.

A defense is judged by the strongest attacker, not by the mean of one attack: a batch mean PSNR
of 12 dB hides the two images that came back at 45 dB. :func:`worst_case_report` takes several
attacks' :class:`~lightning_gp.metrics.report.ReconstructionReport` of one client batch (each
already matched to the originals) and keeps, per image and per metric, the attacker's best value
(max PSNR/SSIM/NMI, min MSE/LPIPS/noise ratio) with the attack that produced it.

The leak rule is explicit (``leak_thresholds``): an image **leaks** when ANY attack puts ANY
listed metric on the leaking side of its threshold (default: PSNR > 20 dB or SSIM > 0.5, the
issue's rule; "leaking side" is above for PSNR/SSIM/NMI, below for MSE/LPIPS/noise ratio). The
defense is **private** only if the per-image worst case averaged over the batch is on the
private side of every privacy threshold (:data:`~lightning_gp.metrics.report.PRIVACY_THRESHOLDS`)
AND at most ``max_leak_fraction`` of the images leak (default 0: one leaked image is a leak).

Trivial baselines are scored the same way: a blank guess (all-zero and mid-grey 0.5 pixels, the
better of the two by mean PSNR is reported as "blank") and the dataset mean image (the mean of
given reference images, or a constant image of the per-channel pixel mean). A worst-case PSNR
below a baseline's is flagged ``below_trivial_baseline``: the attacks did worse than a guess that
needs no gradient, so "private" says little about the defense.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_gp.attacks.base import Reconstruction
from lightning_gp.attacks.view import ServerView
from lightning_gp.metrics.image_quality import check_pixel_range, mse, psnr, ssim
from lightning_gp.metrics.report import (
    HIGHER_IS_PRIVATE,
    METRICS,
    PRIVACY_THRESHOLDS,
    ReconstructionReport,
    _fmt,
    _json_safe,
    privacy_flags,
    reconstruction_report,
)

#: The issue's leak rule: an image leaks if any attack gets PSNR > 20 dB or SSIM > 0.5.
LEAK_THRESHOLDS: dict[str, float] = {"psnr": 20.0, "ssim": 0.5}
#: Metrics the baselines are scored on (LPIPS and the noise ratio need networks; a baseline is a
#: fixed guess, so the pixel metrics say what it is worth).
BASELINE_METRICS = ("mse", "psnr", "ssim")


def leaks_on(metric: str, value: float, threshold: float) -> bool:
    """Whether ``value`` of ``metric`` is on the leaking side of ``threshold`` (strictly)."""
    return value < threshold if HIGHER_IS_PRIVATE[metric] else value > threshold


def _better_for_attacker(metric: str, a: float, b: float) -> bool:
    """Whether ``a`` is a better (less private) value of ``metric`` than ``b``."""
    return a < b if HIGHER_IS_PRIVATE[metric] else a > b


@dataclass
class WorstImage:
    """The attacker's best on one original image, over every attack.

    Attributes:
        index: position in the client's batch.
        values: metric -> the best value any attack reached on this image (``None``: no attack
            computed the metric).
        attacks: metric -> the attack that reached it.
        leaks: whether any attack crossed a leak threshold on this image.
        leaked_by: the attacks that did.
        below_trivial_baseline: the best PSNR is below the best baseline's PSNR on this image.
    """

    index: int
    values: dict[str, float | None]
    attacks: dict[str, str | None]
    leaks: bool
    leaked_by: list[str]
    below_trivial_baseline: bool | None = None


@dataclass
class BaselineScores:
    """A fixed guess scored against every original (no gradient needed to make it).

    Attributes:
        name: "blank" or "dataset mean".
        kind: what the guess is ("zeros", "grey 0.5", "reference mean", "channel mean").
        per_image: metric -> ``[B]`` values; ``means``: metric -> batch mean.
    """

    name: str
    kind: str
    per_image: dict[str, list[float]]
    means: dict[str, float]


@dataclass
class WorstCaseReport:
    """Several attacks on one batch, judged by the attacker's best per image.

    Attributes:
        attacks: the attacks' names, in the order given (made unique with ``#k`` suffixes).
        rows: one :class:`WorstImage` per original.
        means: batch mean of each metric's per-image worst case (``None`` where no attack
            computed it; PSNR is ``inf`` when some image came back exactly).
        attack_means: attack -> its own batch means (what one attack alone would report).
        private: privacy threshold flags of ``means`` (see ``privacy_flags``).
        leak_fraction: fraction of images that leak; ``leaked``: how many.
        verdict: "private" or "leaks".
        baselines: the trivial guesses' scores ("blank", "dataset mean" when known).
        below_trivial_baseline: the worst-case mean PSNR is below a baseline's mean PSNR.
        best_psnr_pixels: per image, the reconstruction (pixels) of the attack with the best
            PSNR (for figures; not in ``to_dict``); ``original_pixels``: the originals.
    """

    attacks: list[str]
    rows: list[WorstImage]
    means: dict[str, float | None]
    attack_means: dict[str, dict[str, float | None]]
    thresholds: dict[str, float]
    leak_thresholds: dict[str, float]
    max_leak_fraction: float
    private: dict[str, bool | None]
    leak_fraction: float
    leaked: int
    verdict: str
    baselines: list[BaselineScores]
    below_trivial_baseline: bool | None
    original_pixels: Tensor | None = field(default=None, repr=False, compare=False)
    best_psnr_pixels: Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def is_private(self) -> bool:
        return self.verdict == "private"

    def baseline(self, name: str) -> BaselineScores:
        """The baseline called ``name`` ("blank" or "dataset mean")."""
        for baseline in self.baselines:
            if baseline.name == name:
                return baseline
        raise KeyError(f"no baseline {name!r}; this report has {[b.name for b in self.baselines]}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (``inf``/``nan`` as strings); no images."""
        data = {
            "attacks": list(self.attacks),
            "batch_size": self.batch_size,
            "means": dict(self.means),
            "attack_means": {k: dict(v) for k, v in self.attack_means.items()},
            "thresholds": dict(self.thresholds),
            "leak_thresholds": dict(self.leak_thresholds),
            "max_leak_fraction": self.max_leak_fraction,
            "private": dict(self.private),
            "leak_fraction": self.leak_fraction,
            "leaked": self.leaked,
            "verdict": self.verdict,
            "below_trivial_baseline": self.below_trivial_baseline,
            "baselines": [
                {"name": b.name, "kind": b.kind, "means": dict(b.means), "per_image": dict(b.per_image)}
                for b in self.baselines
            ],
            "rows": [
                {
                    "index": r.index,
                    "values": dict(r.values),
                    "attacks": dict(r.attacks),
                    "leaks": r.leaks,
                    "leaked_by": list(r.leaked_by),
                    "below_trivial_baseline": r.below_trivial_baseline,
                }
                for r in self.rows
            ],
        }
        return _json_safe(data)

    def to_markdown(self) -> str:
        """Per-attack means, the worst case, the baselines, the leak fraction and the verdict."""
        rule = " or ".join(
            f"{name} {'<' if HIGHER_IS_PRIVATE[name] else '>'} {value:g}"
            for name, value in self.leak_thresholds.items()
        )
        lines = [
            "### Worst case over attacks",
            "",
            f"Batch of {self.batch_size}; attacks: {', '.join(self.attacks)}.",
            "",
            "| | " + " | ".join(METRICS) + " |",
            "| --- " * (len(METRICS) + 1) + "|",
        ]
        for attack, means in self.attack_means.items():
            lines.append(f"| {attack} | " + " | ".join(_fmt(means.get(m)) for m in METRICS) + " |")
        lines.append("| **worst case** | " + " | ".join(_fmt(self.means.get(m)) for m in METRICS) + " |")
        for b in self.baselines:
            lines.append(
                f"| baseline: {b.name} ({b.kind}) | "
                + " | ".join(_fmt(b.means.get(m)) if m in b.means else "-" for m in METRICS)
                + " |"
            )
        lines += [
            "",
            (
                f"Leak rule: an image leaks if any attack gets {rule}. "
                f"Leaked: {self.leaked}/{self.batch_size} ({self.leak_fraction:.0%})."
            ),
            f"Verdict: **{self.verdict}** (worst-case means vs thresholds, at most {self.max_leak_fraction:.0%} leaked).",
        ]
        if self.below_trivial_baseline:
            lines.append(
                "The worst-case PSNR is below a trivial baseline: no attack beat a guess without the gradient."
            )
        lines += ["", "| # | best psnr (attack) | best ssim (attack) | leaks | leaked by |", "| --- " * 5 + "|"]
        for r in self.rows:
            lines.append(
                f"| {r.index} | {_fmt(r.values.get('psnr'))} ({r.attacks.get('psnr') or '-'}) | "
                f"{_fmt(r.values.get('ssim'))} ({r.attacks.get('ssim') or '-'}) | {'yes' if r.leaks else 'no'} | "
                f"{', '.join(r.leaked_by) or '-'} |"
            )
        return "\n".join(lines) + "\n"


def _unique_names(names: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        name = name or "attack"
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def check_metric_thresholds(thresholds: Mapping[str, float], name: str) -> dict[str, float]:
    """``thresholds`` as metric -> float, every metric one the reports compute (errors name ``name``)."""
    if not isinstance(thresholds, Mapping):
        raise TypeError(f"{name} must be a mapping metric -> threshold, got {type(thresholds).__name__}")
    unknown = [m for m in thresholds if m not in HIGHER_IS_PRIVATE]
    if unknown:
        raise ValueError(f"{name}: unknown metric(s) {unknown}; known metrics are {list(HIGHER_IS_PRIVATE)}")
    out = {}
    for metric, value in thresholds.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"{name}[{metric!r}] must be a number, got {value!r}")
        out[metric] = float(value)
    return out


def _constant_like(originals: Tensor, values: Sequence[float]) -> Tensor:
    channel = torch.as_tensor(list(values), dtype=originals.dtype).view(1, -1, 1, 1)
    return channel.expand_as(originals).clone()


def _score_guess(guess: Tensor, originals: Tensor) -> dict[str, list[float]]:
    guess = guess.expand_as(originals) if guess.shape[0] == 1 else guess
    scores = {"mse": mse(guess, originals), "psnr": psnr(guess, originals)}
    if min(originals.shape[-2:]) >= 11:  # SSIM needs its 11x11 window
        scores["ssim"] = ssim(guess, originals)
    return {name: [float(v) for v in values] for name, values in scores.items()}


def _baseline(name: str, kind: str, guess: Tensor, originals: Tensor) -> BaselineScores:
    per_image = _score_guess(guess, originals)
    means = {m: float(torch.tensor(v, dtype=torch.float64).mean()) for m, v in per_image.items()}
    return BaselineScores(name, kind, per_image, means)


def trivial_baselines(
    originals: Tensor,
    *,
    reference_images: Tensor | None = None,
    dataset_mean: Sequence[float] | None = None,
) -> list[BaselineScores]:
    """Score the guesses that need no gradient against ``originals`` (pixels in [0, 1]).

    Returns "blank" (the better, by mean PSNR, of an all-zero and a mid-grey 0.5 image) and,
    when known, "dataset mean": the mean of ``reference_images`` (``[N, C, H, W]`` pixels in
    [0, 1], e.g. public or test images), else a constant image of ``dataset_mean`` (the
    per-channel pixel mean, in [0, 1]; the un-normalised ``mean`` of a datamodule).
    """
    if not isinstance(originals, Tensor) or originals.ndim != 4:
        raise ValueError(f"originals must be a [B, C, H, W] tensor, got {getattr(originals, 'shape', type(originals))}")
    check_pixel_range(originals, "originals")
    originals = originals.detach().float().cpu()
    channels = originals.shape[1]
    zeros = _baseline("blank", "zeros", torch.zeros_like(originals), originals)
    grey = _baseline("blank", "grey 0.5", torch.full_like(originals, 0.5), originals)
    baselines = [zeros if zeros.means["psnr"] >= grey.means["psnr"] else grey]
    if reference_images is not None:
        if not isinstance(reference_images, Tensor) or reference_images.ndim != 4:
            raise ValueError(
                "reference_images must be a [N, C, H, W] tensor of pixel images, got "
                f"{getattr(reference_images, 'shape', type(reference_images))}"
            )
        if reference_images.shape[0] == 0 or reference_images.shape[1:] != originals.shape[1:]:
            raise ValueError(
                f"reference_images {tuple(reference_images.shape)} must hold at least one image of the originals' "
                f"shape {tuple(originals.shape[1:])}"
            )
        check_pixel_range(reference_images, "reference_images")
        mean_image = reference_images.detach().float().cpu().mean(dim=0, keepdim=True)
        baselines.append(_baseline("dataset mean", "reference mean", mean_image.clamp(0, 1), originals))
    elif dataset_mean is not None:
        values = [dataset_mean] if isinstance(dataset_mean, (int, float)) else list(dataset_mean)
        if len(values) == 1:
            values = values * channels
        if len(values) != channels:
            raise ValueError(f"dataset_mean needs 1 or {channels} per-channel values, got {len(values)}")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"dataset_mean must hold pixel means in [0, 1], got {list(dataset_mean)}")
        baselines.append(_baseline("dataset mean", "channel mean", _constant_like(originals, values), originals))
    return baselines


def worst_case_report(
    reports: Sequence[ReconstructionReport],
    *,
    thresholds: Mapping[str, float] = PRIVACY_THRESHOLDS,
    leak_thresholds: Mapping[str, float] = LEAK_THRESHOLDS,
    max_leak_fraction: float = 0.0,
    reference_images: Tensor | None = None,
    dataset_mean: Sequence[float] | None = None,
) -> WorstCaseReport:
    """Judge a defense by the attacker's best per image over several attacks on one batch.

    Args:
        reports: one :class:`ReconstructionReport` per attack, all on the same originals (each
            is already matched to them; see :func:`worst_case_of_reconstructions` to match here).
        thresholds: privacy thresholds for the worst-case means (default Refiner's).
        leak_thresholds: the leak rule: metric -> threshold; an image leaks if any attack puts
            any of these metrics on the leaking side (default PSNR > 20 dB or SSIM > 0.5).
        max_leak_fraction: the largest fraction of leaked images a "private" verdict allows.
        reference_images, dataset_mean: for the "dataset mean" baseline (see
            :func:`trivial_baselines`); without either only the blank baseline is scored.
    """
    if isinstance(reports, ReconstructionReport) or not isinstance(reports, Sequence):
        raise TypeError(f"reports must be a sequence of ReconstructionReport, got {type(reports).__name__}")
    reports = list(reports)
    if not reports:
        raise ValueError("reports is empty: give at least one attack's ReconstructionReport")
    for i, report in enumerate(reports):
        if not isinstance(report, ReconstructionReport):
            raise TypeError(f"reports[{i}] must be a ReconstructionReport, got {type(report).__name__}")
    thresholds = check_metric_thresholds(thresholds, "thresholds")
    leak_thresholds = check_metric_thresholds(leak_thresholds, "leak_thresholds")
    if not leak_thresholds:
        raise ValueError("leak_thresholds is empty: the leak rule needs at least one metric")
    if isinstance(max_leak_fraction, bool) or not 0.0 <= float(max_leak_fraction) <= 1.0:
        raise ValueError(f"max_leak_fraction must be in [0, 1], got {max_leak_fraction!r}")

    batch = reports[0].batch_size
    originals = reports[0].original_pixels
    for i, report in enumerate(reports[1:], start=1):
        if report.batch_size != batch:
            raise ValueError(
                f"reports[{i}] scores {report.batch_size} images but reports[0] scores {batch}: the worst case "
                "compares attacks on one batch"
            )
        other = report.original_pixels
        if (
            originals is not None
            and other is not None
            and (other.shape != originals.shape or not torch.allclose(other, originals, atol=1e-5))
        ):
            raise ValueError(
                f"reports[{i}] was scored against other originals than reports[0] (shapes "
                f"{tuple(other.shape)} and {tuple(originals.shape)}): the worst case compares attacks on one batch"
            )
    names = _unique_names([r.attack for r in reports])

    rows: list[WorstImage] = []
    best_psnr_source: list[int] = []
    for i in range(batch):
        values: dict[str, float | None] = {}
        sources: dict[str, str | None] = {}
        for metric in METRICS:
            best: float | None = None
            source: str | None = None
            for name, report in zip(names, reports):
                value = getattr(report.rows[i], metric)
                if value is None or metric in report.unavailable or math.isnan(value):
                    continue
                if best is None or _better_for_attacker(metric, value, best):
                    best, source = float(value), name
            values[metric], sources[metric] = best, source
        leaked_by = [
            name
            for name, report in zip(names, reports)
            if any(
                (value := getattr(report.rows[i], metric)) is not None
                and not math.isnan(value)
                and leaks_on(metric, value, threshold)
                for metric, threshold in leak_thresholds.items()
            )
        ]
        rows.append(WorstImage(i, values, sources, bool(leaked_by), leaked_by))
        best_psnr_source.append(names.index(sources["psnr"]) if sources["psnr"] is not None else 0)

    means: dict[str, float | None] = {}
    for metric in METRICS:
        column = [r.values[metric] for r in rows]
        means[metric] = (
            None if any(v is None for v in column) else float(torch.tensor(column, dtype=torch.float64).mean())
        )
    leaked = sum(r.leaks for r in rows)
    leak_fraction = leaked / batch
    private = privacy_flags(means, thresholds)
    flags = [flag for flag in private.values() if flag is not None]
    verdict = "private" if all(flags) and leak_fraction <= float(max_leak_fraction) else "leaks"

    baselines: list[BaselineScores] = []
    below: bool | None = None
    best_pixels: Tensor | None = None
    if originals is not None:
        baselines = trivial_baselines(originals, reference_images=reference_images, dataset_mean=dataset_mean)
        best_baseline = [max(b.per_image["psnr"][i] for b in baselines) for i in range(batch)]
        for row, floor in zip(rows, best_baseline):
            if row.values["psnr"] is not None:
                row.below_trivial_baseline = row.values["psnr"] < floor
        if means["psnr"] is not None:
            below = means["psnr"] < max(b.means["psnr"] for b in baselines)
        if all(r.reconstructed_pixels is not None for r in reports):
            best_pixels = torch.stack(
                [
                    reports[source].reconstructed_pixels[i]  # type: ignore[index]
                    for i, source in enumerate(best_psnr_source)
                ]
            )
    return WorstCaseReport(
        attacks=names,
        rows=rows,
        means=means,
        attack_means={name: dict(report.means) for name, report in zip(names, reports)},
        thresholds=thresholds,
        leak_thresholds=leak_thresholds,
        max_leak_fraction=float(max_leak_fraction),
        private=private,
        leak_fraction=leak_fraction,
        leaked=leaked,
        verdict=verdict,
        baselines=baselines,
        below_trivial_baseline=below,
        original_pixels=originals,
        best_psnr_pixels=best_pixels,
    )


def worst_case_of_reconstructions(
    reconstructions: Sequence[Reconstruction],
    originals: Tensor,
    view_or_mean_std: ServerView | tuple[Sequence[float], Sequence[float]],
    *,
    true_labels: Tensor | None = None,
    lpips: bool = True,
    noise_ratio: bool = True,
    lpips_fn: torch.nn.Module | None = None,
    match_metric: str = "mse",
    **worst_case_kwargs: Any,
) -> tuple[list[ReconstructionReport], WorstCaseReport]:
    """Match and score each attack's reconstruction (:func:`reconstruction_report`), then take the worst case.

    ``originals`` are the client's normalised inputs; ``worst_case_kwargs`` go to
    :func:`worst_case_report`. Returns the per-attack reports and the worst case.
    """
    if isinstance(reconstructions, Reconstruction) or not isinstance(reconstructions, Sequence):
        raise TypeError(f"reconstructions must be a sequence of Reconstruction, got {type(reconstructions).__name__}")
    if not reconstructions:
        raise ValueError("reconstructions is empty: give at least one attack's Reconstruction")
    if lpips and lpips_fn is None:
        from lightning_gp.metrics.lpips import LPIPS

        lpips_fn = LPIPS()
    reports = [
        reconstruction_report(
            rec,
            originals,
            view_or_mean_std,
            true_labels=true_labels,
            lpips=lpips,
            lpips_fn=lpips_fn,
            noise_ratio=noise_ratio,
            match_metric=match_metric,
        )
        for rec in reconstructions
    ]
    return reports, worst_case_report(reports, **worst_case_kwargs)
