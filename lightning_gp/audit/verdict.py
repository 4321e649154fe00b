"""The verdict: per image, the best reconstruction any attack achieved, judged by one leak rule.

A defense is judged by the strongest attacker, not by the mean of one attack: a batch mean PSNR
of 12 dB hides the two images that came back at 45 dB. :func:`worst_case_report` takes several
attacks' :class:`~lightning_gp.metrics.report.ReconstructionReport` of one client batch (each
already matched to the originals) and keeps, per image and per metric, the attacker's best value
(max PSNR/SSIM/NMI, min MSE/LPIPS/noise ratio) with the attack that produced it.

**The leak rule** (:class:`LeakRule`, the only place it is written): one attack's reconstruction of
one image leaks when

- it **identifies** its original: its identification p-value (does the output pick its original out of
  public images of its class and of all classes, :mod:`lightning_gp.metrics.identification`) is below
  :data:`~lightning_gp.metrics.identification.IDENTIFICATION_LINE`, or
- its semantic score is above the semantic test's line: a classifier trained on public data names the
  original's class on it clearly more than on any blank, mean or noise guess (the shipped
  Fashion-MNIST test, line :data:`~lightning_gp.metrics.semantic.SEMANTIC_LINE`, or one fitted on the
  audited data's public split, :mod:`lightning_gp.metrics.semantic_test`; the tests come with the
  rule, :attr:`LeakRule.tests`, :mod:`lightning_gp.audit.recognition`), or
- a fixed similarity line is crossed (:data:`LEAK_THRESHOLDS`: PSNR > 20 dB, SSIM > 0.5) by an output
  that also passes the identification gate (:data:`IDENTIFICATION_GATE`: a fixed line that an
  uninformed smooth guess crosses on smooth data measures the data), or
- Refiner's noise ratio is below 0.4 (a clean-looking image) **and** the reconstruction is closer to
  the original than every trivial guess on both PSNR and SSIM (behind the same gate). The noise ratio
  alone is not a similarity: a blank or dataset-mean image is clean too (noise ratio 0.0003 and
  0.10), so it only counts on an image that a blank or mean guess cannot be.

Where no identification p-value was computed the fixed lines count ungated, and the verdict names the
missing test.

**Per original, any reconstruction.** An original leaks to an attack when **any** of the attack's
outputs meets the rule on it (:meth:`LeakRule.image_criteria`), not only the output a one-to-one
matching assigned to it: the matching minimises a total over the batch and hands an exact copy of one
original to another whenever a failed output sits closer to the first. The matched rows still give
the reported scores and means.

An attack with a data prior (the learned inverter) returns plausible images from any gradient, and
such guesses beat a blank or mean image by chance. For such an attack every criterion also needs its
metrics to pass the attack's **prior-only control**, image by image: the reconstruction must beat,
on each of the criterion's metrics, the best score that any of the attack's reconstructions of
public batches (which carry no information about the attacked one) reached on that original, or,
where the attack's batch mean beats every such batch's, the median one
(:mod:`lightning_gp.audit.prior_control`, which also states the control's false-alarm level).

**The verdict** (:func:`judge`): ``"leaks"`` when more than ``max_leak_fraction`` of the images leak
(default: one image is a leak) or a worst-case mean is on the leaking side of
:data:`VERDICT_THRESHOLDS` (Refiner's mean PSNR 15 dB, SSIM 0.5, LPIPS 0.05), beats every trivial
guess's mean on that metric and some image's best output passes the identification gate (a mean line
that a blank or mean image crosses as far measures the data: on smooth images a blank guess alone
scores 12-16 dB; such a line is reported in ``mean_lines_at_guess``, one crossed where no output passes
the gate in ``mean_lines_unidentified``, and neither counts; without the originals' pixels no guess is scored and
every crossed line counts); else
``"inconclusive"`` when the audit is incomplete (an attack errored, an adaptive attack fell back or
could not apply, an attack produced non-finite images, the semantic test could not run;
``verdict_reasons`` says which); else ``"private"``. A leak found is a leak however
incomplete the rest is; "private" needs a complete audit.

Trivial baselines are scored the same way: a blank guess (all-zero and mid-grey 0.5 pixels, the
better of the two by mean PSNR is reported as "blank") and the dataset mean image (the mean of
given reference images, or a constant image of the per-channel pixel mean). A worst-case PSNR
below a baseline's is flagged ``below_trivial_baseline``: the attacks did worse than a guess that
needs no gradient.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_gp.attacks.base import Reconstruction
from lightning_gp.attacks.view import ServerView
from lightning_gp.metrics.identification import IDENTIFICATION_LINE
from lightning_gp.metrics.image_quality import check_pixel_range, mse, psnr, ssim
from lightning_gp.metrics.recognition import RecognitionTests
from lightning_gp.metrics.report import (
    HIGHER_IS_PRIVATE,
    METRICS,
    PRIVACY_THRESHOLDS,
    ReconstructionReport,
    _fmt,
    _json_safe,
    batch_mean,
    privacy_flags,
    reconstruction_report,
)
from lightning_gp.metrics.semantic import SEMANTIC_LINE

#: An image leaks when an attack gets PSNR > 20 dB, SSIM > 0.5 (each on an output that also picks
#: its original out of its class's public images, :data:`IDENTIFICATION_GATE`), a public classifier
#: names the original's class on it clearly more than on any trivial guess (semantic score above the
#: test's line; :data:`~lightning_gp.metrics.semantic.SEMANTIC_LINE` is the shipped test's), or the
#: output identifies its original (identification p-value at most
#: :data:`~lightning_gp.metrics.identification.IDENTIFICATION_LINE`).
LEAK_THRESHOLDS: dict[str, float] = {
    "psnr": 20.0,
    "ssim": 0.5,
    "semantic": SEMANTIC_LINE,
    "identification": IDENTIFICATION_LINE,
}
#: The fixed similarity lines (and the paired noise-ratio test) count on an output only where its
#: identification p-value is at most this: the output must also be closer to its original than
#: (about) every public image of the original's class is. A fixed line that an uninformed smooth
#: guess crosses on smooth data (an SSIM of 0.5 on flat photo crops) measures the data, not the leak.
IDENTIFICATION_GATE = 0.05
#: The lines the gate applies to: similarities fixed in advance, the same on every data set.
GATED_METRICS = ("psnr", "ssim", "lpips", "mse", "nmi")
#: Refiner's mean thresholds (Sec. 5) that enter the verdict: a worst-case mean on the leaking side
#: is a leak. The noise ratio is not one of them (a blank guess fails it); see :class:`LeakRule`.
VERDICT_THRESHOLDS: dict[str, float] = {m: t for m, t in PRIVACY_THRESHOLDS.items() if m != "noise_ratio"}
#: Refiner's noise-ratio line: below it an image looks clean (App. N).
NOISE_RATIO_LINE = 0.4
#: Raised whenever a change of the leak rule or its baselines can change a stored verdict (stored
#: results, e.g. a frontier's, are keyed by it). 2: the prior-only control for attacks with a data prior;
#: 3: the refined learned inverter's control made of its own refinements only; 4: an original leaks when any
#: output of an attack meets the rule on it (not only the matched one), the prior-only control also credits
#: an image that beats the best uninformed score on it, a rule metric that was not computed is a gap, and
#: the bound's kappa is measured under the full rule (earlier rounds composed); 5: the identification test
#: joins the rule, fixed similarity lines count only on an output that passes the identification gate,
#: and the semantic test is calibrated on the audited data's public split (shipped for Fashion-MNIST).
LEAK_RULE_REVISION = 5
#: The newest revision that could turn a stored "leaks" into another verdict. Later revisions only add
#: leaks, gaps and composed rounds to the bound: a result stored under one of them that leaked to every
#: server keeps its verdict (the frontier reruns the others and drops the stale bound of the kept ones).
LEAK_RULE_MONOTONE_SINCE = 5

Verdict = Literal["private", "leaks", "inconclusive"]


def leaks_on(metric: str, value: float, threshold: float) -> bool:
    """Whether ``value`` of ``metric`` is on the leaking side of ``threshold`` (strictly)."""
    return value < threshold if HIGHER_IS_PRIVATE[metric] else value > threshold


@dataclass(frozen=True)
class LeakRule:
    """When one attack's reconstruction of one image leaks (see the module docstring).

    Attributes:
        thresholds: metric -> line; the image leaks when any computed metric is on the leaking side
            (above for PSNR/SSIM/NMI, below for MSE/LPIPS). The noise ratio is refused here: alone it
            calls a blank guess a leak.
        noise_ratio_line: the image also leaks when its noise ratio is below this line and it is
            closer to the original than every trivial guess on PSNR and SSIM; ``None`` turns the
            paired test off.
        identification_gate: a line of :data:`GATED_METRICS` (and the paired noise-ratio test) counts
            on an output only where its identification p-value is at most this; where no
            identification p-value was computed the lines count ungated (the verdict then names the
            missing test and is never "private"). ``None`` turns the gate off.
        tests: the recognisable-image tests the reports are scored with, calibrated on the audited
            data's public split (:class:`~lightning_gp.metrics.RecognitionTests`; an audit
            sets them with :meth:`calibrated`); ``None``: the shipped Fashion-MNIST semantic test and
            no identification test (every verdict then names the missing test).
    """

    thresholds: Mapping[str, float] = field(default_factory=lambda: dict(LEAK_THRESHOLDS))
    noise_ratio_line: float | None = NOISE_RATIO_LINE
    identification_gate: float | None = IDENTIFICATION_GATE
    tests: RecognitionTests | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        thresholds = check_metric_thresholds(self.thresholds, "leak_thresholds")
        if not thresholds:
            raise ValueError("leak_thresholds is empty: the leak rule needs at least one metric")
        if "noise_ratio" in thresholds:
            raise ValueError(
                "leak_thresholds: the noise ratio alone calls a blank or mean guess a leak; it enters the rule only "
                "paired with a similarity test a blank image fails (noise_ratio_line)"
            )
        object.__setattr__(self, "thresholds", thresholds)
        if self.noise_ratio_line is not None:
            line = self.noise_ratio_line
            if isinstance(line, bool) or not isinstance(line, (int, float)) or not 0.0 < float(line) <= 1.0:
                raise ValueError(f"noise_ratio_line must be in (0, 1] or None, got {line!r}")
            object.__setattr__(self, "noise_ratio_line", float(line))
        gate = self.identification_gate
        if gate is not None:
            if isinstance(gate, bool) or not isinstance(gate, (int, float)) or not 0.0 < float(gate) <= 1.0:
                raise ValueError(f"identification_gate must be in (0, 1] or None, got {gate!r}")
            object.__setattr__(self, "identification_gate", float(gate))
        if self.tests is not None and not isinstance(self.tests, RecognitionTests):
            raise TypeError(f"tests must be RecognitionTests or None, got {type(self.tests).__name__}")

    def calibrated(self, tests: RecognitionTests) -> LeakRule:
        """This rule scored with ``tests``: a semantic line at the shipped default
        (:data:`~lightning_gp.metrics.semantic.SEMANTIC_LINE`) becomes the semantic test's own line (a
        fitted test sets its line on its data); a line set to another value is the caller's choice and
        is kept, and a rule without the semantic line keeps none."""
        if not isinstance(tests, RecognitionTests):
            raise TypeError(f"tests must be RecognitionTests, got {type(tests).__name__}")
        thresholds = dict(self.thresholds)
        if thresholds.get("semantic") == SEMANTIC_LINE and tests.semantic is not None:
            thresholds["semantic"] = tests.semantic.line
        return dataclasses.replace(self, thresholds=thresholds, tests=tests)

    def criteria(
        self,
        values: Mapping[str, float | None],
        floor: Mapping[str, float] | None = None,
        control: Mapping[str, float] | None = None,
    ) -> list[str]:
        """The criteria one reconstruction meets (empty: it does not leak).

        ``values`` are its scores (metric -> value; ``None``/NaN: not computed or not reconstructed);
        ``floor`` the best trivial guess's PSNR and SSIM on the same original (``None``: unknown, the
        paired noise-ratio test is skipped); ``control`` the bars of the attack's prior-only control on
        that original, metric -> value (:mod:`lightning_gp.audit.prior_control`; ``inf`` where the
        attack was not informed): with it, a criterion counts only where the reconstruction also
        beats the bar of each of the criterion's metrics."""
        control = control or {}

        def beats_control(metric: str, value: float) -> bool:
            bar = control.get(metric)
            return bar is None or math.isnan(bar) or _better_for_attacker(metric, value, bar)

        met = []
        gated = not self.passes_gate(values)
        for metric, line in self.thresholds.items():
            value = values.get(metric)
            if value is None or math.isnan(value) or not leaks_on(metric, value, line):
                continue
            if beats_control(metric, value) and not (gated and metric in GATED_METRICS):
                met.append(f"{metric} {'<' if HIGHER_IS_PRIVATE[metric] else '>'} {line:g}")
        ratio = values.get("noise_ratio")
        if gated or self.noise_ratio_line is None:
            return met
        if floor is not None and ratio is not None and not math.isnan(ratio):
            closer = all(
                (v := values.get(m)) is not None and not math.isnan(v) and v > floor[m] and beats_control(m, v)
                for m in ("psnr", "ssim")
            )
            if ratio < self.noise_ratio_line and closer:
                met.append(f"noise_ratio < {self.noise_ratio_line:g} and closer than every trivial guess")
        return met

    def passes_gate(self, values: Mapping[str, float | None]) -> bool:
        """Whether the fixed lines may count on an output with these scores (:attr:`identification_gate`):
        its identification p-value is at most the gate, or none was computed, or the gate is off."""
        p = values.get("identification")
        if self.identification_gate is None or p is None or math.isnan(p):
            return True
        return p <= self.identification_gate

    def describe(self) -> str:
        """The rule in words, e.g. for report headers."""
        parts = threshold_phrases(self.thresholds)
        if self.noise_ratio_line is not None:
            parts.append(f"noise ratio < {self.noise_ratio_line:g} on an image closer than every trivial guess")
        text = or_list(parts)
        gated = [METRIC_NAMES.get(m, m) for m in GATED_METRICS if m in self.thresholds]
        gated += ["noise-ratio"] if self.noise_ratio_line is not None else []
        if self.identification_gate is not None and gated:
            text += (
                f"; the {', '.join(gated)} tests count only on an output whose identification p-value is at most "
                f"{self.identification_gate:g}"
            )
        return text

    def image_criteria(
        self, report: ReconstructionReport, i: int, floor: Mapping[str, float] | None = None
    ) -> list[str]:
        """The criteria by which original ``i`` of ``report`` (one attack) leaks: those of its matched
        reconstruction, else those of the first other reconstruction of the attack that meets one
        (:attr:`~lightning_gp.metrics.report.ReconstructionReport.candidates`; the matching minimises a
        total over the batch and can hand a copy of this original to another one). Empty: no
        reconstruction of the attack leaks it."""
        control = prior_control(report, i)
        matched = self.criteria(row_values(report.rows[i], report), floor, control)
        if matched or report.candidates is None:
            return matched
        for j, values in enumerate(candidate_values(report, i)):
            if j != report.rows[i].matched_index and (met := self.criteria(values, floor, control)):
                return [f"{c} (by output {j}, matched to another original)" for c in met]
        return []

    def leaked(self, report: ReconstructionReport, baselines: Sequence[BaselineScores] = ()) -> list[bool]:
        """Per image of ``report`` (one attack alone), whether any of its reconstructions leaks it
        (:meth:`image_criteria`). ``baselines``: more trivial guesses' scores on the same originals
        (e.g. the dataset mean; blank guesses are always in)."""
        floors = guess_floors(report.original_pixels, baselines)
        return [
            bool(self.image_criteria(report, i, None if floors is None else floors[i])) for i in range(len(report.rows))
        ]

    def leak_fraction(self, report: ReconstructionReport, baselines: Sequence[BaselineScores] = ()) -> float:
        """The fraction of ``report``'s images that leak (one attack alone)."""
        leaked = self.leaked(report, baselines)
        return sum(leaked) / len(leaked)


METRIC_NAMES = {
    "psnr": "PSNR",
    "ssim": "SSIM",
    "lpips": "LPIPS",
    "mse": "MSE",
    "nmi": "NMI",
    "semantic": "semantic score",
    "identification": "identification p-value",
}


def threshold_phrases(thresholds: Mapping[str, float]) -> list[str]:
    """Each line of ``thresholds`` as its leaking side in words, e.g. ``"PSNR > 20 dB"``, ``"LPIPS < 0.05"``."""
    return [
        f"{METRIC_NAMES.get(m, m)} {'<' if HIGHER_IS_PRIVATE[m] else '>'} {t:g}" + (" dB" if m == "psnr" else "")
        for m, t in thresholds.items()
    ]


def or_list(parts: Sequence[str]) -> str:
    """``["a", "b", "c"]`` -> ``"a, b or c"``."""
    return ", ".join(parts[:-1]) + (" or " if len(parts) > 1 else "") + (parts[-1] if parts else "")


def prior_control(report: ReconstructionReport, i: int) -> dict[str, float] | None:
    """Image ``i``'s prior-only control in ``report`` (``None`` when the attack ran none)."""
    return None if report.prior_only is None else report.prior_only[i]


def row_values(row: Any, report: ReconstructionReport) -> dict[str, float | None]:
    """One image's scores in ``report`` (``None`` for a metric the report could not compute)."""
    return {m: None if m in report.unavailable else getattr(row, m) for m in METRICS}


def candidate_values(report: ReconstructionReport, i: int) -> list[dict[str, float | None]]:
    """Every reconstruction of ``report``'s attack scored against original ``i`` (one dict per output,
    in the attack's order; ``None`` for a metric not computed); the matched row alone when the report
    kept no candidates."""
    if report.candidates is None:
        return [row_values(report.rows[i], report)]
    scores = report.candidates[i]
    count = len(next(iter(scores.values()))) if scores else 0
    return [
        {m: None if m in report.unavailable or m not in scores else float(scores[m][j]) for m in METRICS}
        for j in range(count)
    ]


def guess_floors(originals: Tensor | None, baselines: Sequence[BaselineScores] = ()) -> list[dict[str, float]] | None:
    """Per original, the best PSNR and SSIM any trivial guess reaches on it: all-zero and mid-grey
    images always, plus ``baselines`` (e.g. the dataset mean). SSIM is ``inf`` where the images are
    too small for it (then nothing is closer); ``None`` without the originals' pixels."""
    if originals is None:
        return None
    originals = originals.detach().float().cpu()
    guesses = [
        _score_guess(torch.zeros_like(originals), originals),
        _score_guess(torch.full_like(originals, 0.5), originals),
    ]
    guesses += [b.per_image for b in baselines]
    floors = []
    for i in range(originals.shape[0]):
        with_ssim = [g["ssim"][i] for g in guesses if "ssim" in g]
        floors.append({"psnr": max(g["psnr"][i] for g in guesses), "ssim": max(with_ssim) if with_ssim else math.inf})
    return floors


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
        criteria: attack -> the criteria of the rule its reconstruction met on this image (why it leaks).
    """

    index: int
    values: dict[str, float | None]
    attacks: dict[str, str | None]
    leaks: bool
    leaked_by: list[str]
    below_trivial_baseline: bool | None = None
    criteria: dict[str, list[str]] = field(default_factory=dict)


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
        verdict: "private", "leaks" or "inconclusive" (see :func:`judge`).
        verdict_reasons: why the verdict is what it is: the leaks, or what made the audit incomplete.
        gaps: what made the audit incomplete, recorded whatever the verdict (:func:`audit_gaps`; a
            "leaks" verdict does not name them in its reasons); ``None`` on a report stored before it was kept.
        rule: the leak rule in words; ``noise_ratio_line``: its paired noise-ratio line (``None``: off).
        threat_model: "passive" or "active" when the report judges one threat model (``None``: not said).
        control_false_alarm: the stated family-wise level of the prior-only controls in the worst case:
            the union bound, over every controlled attack (each label estimate one) and client, of the
            chance that an attack that learned nothing is credited with a leak
            (:mod:`lightning_gp.audit.prior_control`); ``None`` when no attack ran a control.
        baselines: the trivial guesses' scores ("blank", "dataset mean" when known).
        below_trivial_baseline: the worst-case mean PSNR is below a baseline's mean PSNR.
        mean_lines_at_guess: the verdict's mean lines that the worst-case mean crosses no further than
            a trivial guess's mean does (:func:`mean_lines_at_guess`): reported, not counted as a leak.
        mean_lines_unidentified: the crossed mean lines where no image's best output passes the
            identification gate (:func:`mean_lines_unidentified`): reported, not counted as a leak.
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
    verdict: Verdict
    baselines: list[BaselineScores]
    below_trivial_baseline: bool | None
    verdict_reasons: list[str] = field(default_factory=list)
    rule: str = ""
    noise_ratio_line: float | None = NOISE_RATIO_LINE
    threat_model: str | None = None
    control_false_alarm: float | None = None
    mean_lines_at_guess: list[str] = field(default_factory=list)
    mean_lines_unidentified: list[str] = field(default_factory=list)
    original_pixels: Tensor | None = field(default=None, repr=False, compare=False)
    gaps: list[str] | None = None
    best_psnr_pixels: Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def is_private(self) -> bool:
        return self.verdict == "private"

    @property
    def is_inconclusive(self) -> bool:
        return self.verdict == "inconclusive"

    def headline(self) -> str:
        """The verdict in one line that names what crossed which line: how many images leak, or, where
        the verdict rests on a worst-case mean alone (no image met the per-image rule), which mean
        crossed which of the verdict's mean lines (a "leaks: 0 of 4 images leak" read as a contradiction)."""
        crossed = [
            m
            for m, flag in self.private.items()
            if flag is False
            and self.means.get(m) is not None
            and m not in self.mean_lines_at_guess
            and m not in self.mean_lines_unidentified
        ]
        if self.verdict == "leaks" and self.leaked == 0 and crossed:
            parts = [
                f"{METRIC_NAMES.get(m, m)} {self.means[m]:.3g}{' dB' if m == 'psnr' else ''} crossed its line "
                f"({threshold_phrases({m: self.thresholds[m]})[0]})"
                for m in crossed
            ]
            return (
                f"LEAKS by the worst-case mean over {self.batch_size} images: {'; '.join(parts)}; no single image "
                "met the per-image rule"
            )
        return f"{self.verdict.upper()}: {self.leaked} of {self.batch_size} images leak"

    def attack_leak_fraction(self, attack: str) -> float:
        """The fraction of images that ``attack`` alone leaks (by the report's leak rule)."""
        if attack not in self.attacks:
            raise KeyError(f"no attack {attack!r}; this report has {self.attacks}")
        return sum(attack in row.leaked_by for row in self.rows) / self.batch_size

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
            "mean_lines_at_guess": list(self.mean_lines_at_guess),
            "mean_lines_unidentified": list(self.mean_lines_unidentified),
            "leak_fraction": self.leak_fraction,
            "leaked": self.leaked,
            "verdict": self.verdict,
            "verdict_reasons": list(self.verdict_reasons),
            "gaps": None if self.gaps is None else list(self.gaps),
            "rule": self.rule,
            "noise_ratio_line": self.noise_ratio_line,
            "threat_model": self.threat_model,
            "control_false_alarm": self.control_false_alarm,
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
                    "criteria": {a: list(c) for a, c in r.criteria.items()},
                    "below_trivial_baseline": r.below_trivial_baseline,
                }
                for r in self.rows
            ],
        }
        return _json_safe(data)

    def to_markdown(self) -> str:
        """Per-attack means, the worst case, the baselines, the leak fraction and the verdict."""
        title = "Worst case over attacks" + (f" ({self.threat_model} server)" if self.threat_model else "")
        lines = [
            f"### {title}",
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
                f"Leak rule: an image leaks if any attack gets {self.rule}. "
                f"Leaked: {self.leaked}/{self.batch_size} ({self.leak_fraction:.0%})."
            ),
            f"Verdict: **{self.verdict}**" + (f": {'; '.join(self.verdict_reasons)}." if self.verdict_reasons else "."),
        ]
        if self.control_false_alarm is not None:
            lines.append(
                "Prior-only control: an attack that learned nothing from the gradient is credited with a leak "
                f"here with probability at most about {self.control_false_alarm:.3g} (family-wise over images, "
                "metrics, label estimates and clients)."
            )
        if self.below_trivial_baseline:
            lines.append(
                "The worst-case PSNR is below a trivial baseline: no attack beat a guess without the gradient."
            )
        if self.mean_lines_at_guess:
            lines.append(
                f"The worst-case mean {', '.join(self.mean_lines_at_guess)} crosses its verdict line, but a trivial "
                "guess's mean does so as far: on these images the line measures the data, so it is not counted."
            )
        if self.mean_lines_unidentified:
            lines.append(
                f"The worst-case mean {', '.join(self.mean_lines_unidentified)} crosses its verdict line, but no "
                "image's best output passes the identification gate: the line is crossed by what the data gives "
                "any guess, so it is not counted."
            )
        lines += ["", "| # | best psnr (attack) | best ssim (attack) | leaks | leaked by |", "| --- " * 5 + "|"]
        for r in self.rows:
            lines.append(
                f"| {r.index} | {_fmt(r.values.get('psnr'))} ({r.attacks.get('psnr') or '-'}) | "
                f"{_fmt(r.values.get('ssim'))} ({r.attacks.get('ssim') or '-'}) | {'yes' if r.leaks else 'no'} | "
                f"{_criteria_text(r) or '-'} |"
            )
        return "\n".join(lines) + "\n"


def _criteria_text(image: WorstImage) -> str:
    """``"IDLG (psnr > 20); LearnedInversion (ssim > 0.5)"``: each attack that leaks the image and why."""
    return "; ".join(f"{attack} ({', '.join(met)})" for attack, met in image.criteria.items())


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
    thresholds: Mapping[str, float] = VERDICT_THRESHOLDS,
    leak_thresholds: Mapping[str, float] = LEAK_THRESHOLDS,
    noise_ratio_line: float | None = NOISE_RATIO_LINE,
    identification_gate: float | None = IDENTIFICATION_GATE,
    max_leak_fraction: float = 0.0,
    reference_images: Tensor | None = None,
    dataset_mean: Sequence[float] | None = None,
    incomplete: Sequence[str] = (),
    threat_model: str | None = None,
) -> WorstCaseReport:
    """Judge a defense by the attacker's best per image over several attacks on one batch.

    Args:
        reports: one :class:`ReconstructionReport` per attack, all on the same originals (each
            is already matched to them; see :func:`worst_case_of_reconstructions` to match here).
        thresholds: the verdict's mean lines (:data:`VERDICT_THRESHOLDS`), each counted where it beats every guess.
        leak_thresholds, noise_ratio_line, identification_gate: the per-image leak rule (:class:`LeakRule`).
        max_leak_fraction: the largest fraction of leaked images a "private" verdict allows.
        reference_images, dataset_mean: for the "dataset mean" baseline (see
            :func:`trivial_baselines`); without either only the blank baseline is scored.
        incomplete: what the caller knows is missing from the audit (an attack that errored, an
            adaptive attack that fell back): the verdict cannot be "private" then.
        threat_model: the label of the threat model judged ("passive", "active"), for reports.
    """
    reports = _checked_reports(reports)
    thresholds = check_verdict_thresholds(thresholds)
    rule = LeakRule(leak_thresholds, noise_ratio_line, identification_gate)
    _check_leak_fraction_and_incomplete(max_leak_fraction, incomplete)

    batch = reports[0].batch_size
    originals = _common_originals(reports)
    names = _unique_names([r.attack for r in reports])
    baselines, floors = _guesses_and_floors(originals, reference_images, dataset_mean)

    rows = [_worst_image(i, names, reports, rule, None if floors is None else floors[i]) for i in range(batch)]
    best_psnr_source = [names.index(r.attacks["psnr"]) if r.attacks["psnr"] is not None else 0 for r in rows]

    means = {metric: batch_mean([r.values[metric] for r in rows]) for metric in METRICS}
    leaked = sum(r.leaks for r in rows)
    private = privacy_flags(means, thresholds)
    at_guess, unidentified = (
        mean_lines_at_guess(private, means, baselines),
        mean_lines_unidentified(private, rows, rule),
    )
    counted = {m: flag for m, flag in private.items() if m not in at_guess + unidentified}
    verdict, reasons = judge(
        rows, reports, names, counted, rule, max_leak_fraction=float(max_leak_fraction), incomplete=incomplete
    )
    gaps = reasons if verdict == "inconclusive" else audit_gaps(rows, reports, names, rule, incomplete)

    below = None if floors is None else _mark_below_baselines(rows, floors, means, baselines)
    best_pixels = None if floors is None else _best_psnr_pixels(reports, best_psnr_source)
    return WorstCaseReport(
        attacks=names,
        rows=rows,
        means=means,
        attack_means={name: dict(report.means) for name, report in zip(names, reports)},
        thresholds=thresholds,
        leak_thresholds=dict(rule.thresholds),
        max_leak_fraction=float(max_leak_fraction),
        private=private,
        leak_fraction=leaked / batch,
        leaked=leaked,
        verdict=verdict,
        baselines=baselines,
        below_trivial_baseline=below,
        verdict_reasons=reasons,
        gaps=gaps,
        rule=rule.describe(),
        noise_ratio_line=rule.noise_ratio_line,
        threat_model=threat_model,
        control_false_alarm=_control_false_alarm(reports),
        mean_lines_at_guess=at_guess,
        mean_lines_unidentified=unidentified,
        original_pixels=originals,
        best_psnr_pixels=best_pixels,
    )


def _guesses_and_floors(
    originals: Tensor | None, reference_images: Tensor | None, dataset_mean: Sequence[float] | None
) -> tuple[list[BaselineScores], list[dict[str, float]] | None]:
    """The trivial guesses scored on ``originals`` and the per-original floors they set (none without pixels)."""
    if originals is None:
        return [], None
    baselines = trivial_baselines(originals, reference_images=reference_images, dataset_mean=dataset_mean)
    return baselines, guess_floors(originals, baselines)


def mean_lines_unidentified(
    private: Mapping[str, bool | None], rows: Sequence[WorstImage], rule: LeakRule
) -> list[str]:
    """The crossed mean lines (``private[m] is False``) of a batch where the identification test ran on
    every image and no image's best output passes the rule's identification gate: the fixed mean lines
    are gated as the per-image ones are (:class:`LeakRule`). Empty without the gate or the test."""
    if rule.identification_gate is None:
        return []
    values = [r.values.get("identification") for r in rows]
    if any(v is None for v in values):
        return []
    if any(v is not None and not math.isnan(v) and v <= rule.identification_gate for v in values):
        return []
    return [m for m, flag in private.items() if flag is False and m in GATED_METRICS]


def mean_lines_at_guess(
    private: Mapping[str, bool | None], means: Mapping[str, float | None], baselines: Sequence[BaselineScores]
) -> list[str]:
    """The crossed mean lines (``private[m] is False``) on which some trivial guess's batch mean is at
    least as good for the attacker as the worst-case mean: the attacks did no better there than an
    image that needs no gradient, so the line measures the data, not the defense. No baselines (no
    originals' pixels to score a guess on): none, every crossed line counts."""
    at_guess = []
    for metric, flag in private.items():
        value = means.get(metric)
        if flag is not False or value is None:
            continue
        for baseline in baselines:
            guess = baseline.means.get(metric)
            if guess is None or math.isnan(guess):
                continue
            if (guess <= value) if HIGHER_IS_PRIVATE[metric] else (guess >= value):
                at_guess.append(metric)
                break
    return at_guess


def _control_false_alarm(reports: Sequence[ReconstructionReport]) -> float | None:
    """The union bound of the reports' prior-only control levels (``None`` when none ran a control)."""
    levels = [r.prior_only_false_alarm for r in reports if r.prior_only_false_alarm is not None]
    return min(1.0, sum(levels)) if levels else None


def _checked_reports(reports: Sequence[ReconstructionReport]) -> list[ReconstructionReport]:
    """``reports`` as a non-empty list of :class:`ReconstructionReport` (else the caller's error)."""
    if isinstance(reports, ReconstructionReport) or not isinstance(reports, Sequence):
        raise TypeError(f"reports must be a sequence of ReconstructionReport, got {type(reports).__name__}")
    reports = list(reports)
    if not reports:
        raise ValueError("reports is empty: give at least one attack's ReconstructionReport")
    for i, report in enumerate(reports):
        if not isinstance(report, ReconstructionReport):
            raise TypeError(f"reports[{i}] must be a ReconstructionReport, got {type(report).__name__}")
    return reports


def _check_leak_fraction_and_incomplete(max_leak_fraction: float, incomplete: Sequence[str]) -> None:
    """``max_leak_fraction`` in [0, 1] and ``incomplete`` a sequence of strings (not one string)."""
    if isinstance(max_leak_fraction, bool) or not 0.0 <= float(max_leak_fraction) <= 1.0:
        raise ValueError(f"max_leak_fraction must be in [0, 1], got {max_leak_fraction!r}")
    if isinstance(incomplete, str) or not all(isinstance(r, str) for r in incomplete):
        raise TypeError(f"incomplete must be a sequence of reasons (strings), got {incomplete!r}")


def _attackers_best(
    metric: str, scored: Sequence[tuple[str, Mapping[str, float | None]]]
) -> tuple[float | None, str | None]:
    """The attacker's best value of ``metric`` over the attacks' rows (NaN and missing skipped, first wins
    ties) and the attack that reached it; ``(None, None)`` when no attack scored it."""
    best: float | None = None
    source: str | None = None
    for name, row in scored:
        value = row[metric]
        if value is None or math.isnan(value):
            continue
        if best is None or _better_for_attacker(metric, value, best):
            best, source = float(value), name
    return best, source


def _worst_image(
    i: int,
    names: Sequence[str],
    reports: Sequence[ReconstructionReport],
    rule: LeakRule,
    floor: Mapping[str, float] | None,
) -> WorstImage:
    """Image ``i``'s worst case: every metric at the attacker's best, and the attacks whose row leaks."""
    scored = [(name, row_values(report.rows[i], report)) for name, report in zip(names, reports)]
    values: dict[str, float | None] = {}
    sources: dict[str, str | None] = {}
    for metric in METRICS:
        values[metric], sources[metric] = _attackers_best(metric, scored)
    met = {name: rule.image_criteria(report, i, floor) for name, report in zip(names, reports)}
    criteria = {name: found for name, found in met.items() if found}
    return WorstImage(i, values, sources, bool(criteria), list(criteria), criteria=criteria)


def _mark_below_baselines(
    rows: Sequence[WorstImage],
    floors: Sequence[Mapping[str, float]],
    means: Mapping[str, float | None],
    baselines: Sequence[BaselineScores],
) -> bool | None:
    """Mark each image whose worst-case PSNR is under its trivial guess's; whether the mean PSNR is
    under the best baseline's (``None`` without a mean PSNR)."""
    for image, floor in zip(rows, floors):
        if image.values["psnr"] is not None:
            image.below_trivial_baseline = image.values["psnr"] < floor["psnr"]
    if means["psnr"] is None:
        return None
    return means["psnr"] < max(b.means["psnr"] for b in baselines)


def _best_psnr_pixels(reports: Sequence[ReconstructionReport], best_psnr_source: Sequence[int]) -> Tensor | None:
    """Every image's reconstruction from the attack with its best PSNR (``None`` unless all reports keep pixels)."""
    if not all(r.reconstructed_pixels is not None for r in reports):
        return None
    return torch.stack(
        [
            reports[source].reconstructed_pixels[i]  # type: ignore[index]
            for i, source in enumerate(best_psnr_source)
        ]
    )


def check_verdict_thresholds(thresholds: Mapping[str, float]) -> dict[str, float]:
    """The verdict's mean thresholds, checked: known metrics, numbers, and no noise ratio (it calls a
    blank guess a leak; it stays a reported score, see :class:`LeakRule` for its paired test)."""
    checked = check_metric_thresholds(thresholds, "thresholds")
    if "noise_ratio" in checked:
        raise ValueError(
            "thresholds: the mean noise ratio calls a blank guess a leak, so it does not enter the verdict; it stays a "
            "reported score (see LeakRule for the paired per-image test)"
        )
    return checked


def _common_originals(reports: Sequence[ReconstructionReport]) -> Tensor | None:
    """The originals' pixels, checked to be the same batch in every report."""
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
    return originals


def judge(
    rows: Sequence[WorstImage],
    reports: Sequence[ReconstructionReport],
    names: Sequence[str],
    private: Mapping[str, bool | None],
    rule: LeakRule,
    *,
    max_leak_fraction: float = 0.0,
    incomplete: Sequence[str] = (),
) -> tuple[Verdict, list[str]]:
    """The verdict and its reasons: "leaks" on evidence of a leak, else "inconclusive" when anything
    is missing, else "private" (the order never lets a gap in the audit read as privacy)."""
    leaked = [r.index for r in rows if r.leaks]
    leaks: list[str] = []
    if leaked and len(leaked) / len(rows) > max_leak_fraction:
        leaks.append(f"{len(leaked)} of {len(rows)} images leak (images {leaked})")
    crossed = [metric for metric, flag in private.items() if flag is False]
    if crossed:
        leaks.append(f"worst-case mean {', '.join(crossed)} on the leaking side of the verdict thresholds")
    if leaks:
        return "leaks", leaks
    gaps = audit_gaps(rows, reports, names, rule, incomplete)
    return ("inconclusive", gaps) if gaps else ("private", [])


def audit_gaps(
    rows: Sequence[WorstImage],
    reports: Sequence[ReconstructionReport],
    names: Sequence[str],
    rule: LeakRule,
    incomplete: Sequence[str] = (),
) -> list[str]:
    """What the audit behind a worst case did not cover (``incomplete``, non-finite reconstructions, a
    rule metric or the paired noise-ratio test not computed): empty for a complete audit. The reasons
    of an "inconclusive" verdict; a "leaks" verdict holds whatever they are, but a question other than
    "does it leak" (e.g. :mod:`~lightning_gp.audit.advantage`) still needs them.
    """
    gaps = list(incomplete)
    for name, report in zip(names, reports):
        if report.not_reconstructed:
            gaps.append(f"{name} produced non-finite reconstructions of images {report.not_reconstructed}")
    for metric in ("psnr", "ssim"):
        missing = [r.index for r in rows if r.values[metric] is None]
        if missing and metric in rule.thresholds:
            gaps.append(f"no attack has a {metric} score for images {missing}")
    for metric in rule.thresholds:
        if metric not in ("psnr", "ssim") and any(r.values[metric] is None for r in rows):
            reason = next((rep.unavailable[metric] for rep in reports if metric in rep.unavailable), "not computed")
            what = " (the recognisable-image test)" if metric == "semantic" else ""
            gaps.append(f"{metric}{what} did not run: {reason}")
    if rule.noise_ratio_line is not None:
        # the paired clean-image test is part of the rule: switched off or not computable, it is a gap,
        # never a criterion silently dropped (LeakRule(noise_ratio_line=None) states a rule without it)
        missing = [r.index for r in rows if r.values["noise_ratio"] is None]
        if missing:
            why = next(
                (rep.unavailable["noise_ratio"] for rep in reports if "noise_ratio" in rep.unavailable),
                "not computed (scored with noise_ratio=False?)",
            )
            gaps.append(
                f"the noise ratio (the leak rule's paired clean-image test) did not run for images {missing}: {why}"
            )
        if any(rep.original_pixels is None for rep in reports):
            gaps.append(
                "the noise-ratio test needs the originals' pixels to place the trivial guesses; a report has none"
            )
    return gaps


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
    tests: RecognitionTests | None = None,
    **worst_case_kwargs: Any,
) -> tuple[list[ReconstructionReport], WorstCaseReport]:
    """Match and score each attack's reconstruction (:func:`reconstruction_report`), then take the worst case.

    ``originals`` are the client's normalised inputs; ``tests`` the recognisable-image tests of the
    data (:func:`~lightning_gp.audit.recognition.recognition_tests`; without them the identification
    test is a gap and the verdict is never "private"; with a fitted semantic test pass its line in
    ``leak_thresholds``, e.g. ``LeakRule().calibrated(tests).thresholds``); ``worst_case_kwargs`` go to
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
            tests=tests,
        )
        for rec in reconstructions
    ]
    return reports, worst_case_report(reports, **worst_case_kwargs)
