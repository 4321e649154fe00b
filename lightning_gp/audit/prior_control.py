"""The prior-only control: what an attack with a data prior scores when the gradient says nothing.

A learned inverter (Wu et al., UAI 2023) returns plausible images from any gradient: it was fitted
to public images of the task. Its outputs beat a blank or dataset-mean image on about half of the
originals even when the upload is pure noise (``benchmarks/results/local_dp_batch8_prior_only.md``:
9 of 16 images "leaked" at noise std 100 per coordinate). Those wins measure the prior, not the
gradient; Hayes et al. (NeurIPS 2023) make the same point for reconstruction success in general:
it has to be measured against what the prior alone achieves.

The control scores the attack against itself: its reconstructions of ``K`` public batches that the
inverter held out from fitting, defended exactly as the client defends (fresh randomness), are
scored against the attacked originals exactly as its reconstruction of the attacked batch is
(every output against every original, as the leak rule reads them).

**The test, per image and metric.** A criterion of the leak rule counts for a reconstruction of
original ``i`` only where, on each of the criterion's metrics, it beats that original's bar
(:attr:`~lightning_gp.metrics.report.ReconstructionReport.prior_only`, read by
:class:`~lightning_gp.audit.verdict.LeakRule`). The bar is the **best** score any of the ``K``
uninformed batches reached on ``i`` with any of its outputs: without information the attack's
outputs and the ``K`` guess batches are exchangeable, so one (image, metric) test passes by chance
with probability at most ``1 / (K + 1)``. One informed image in a batch of otherwise uninformed
outputs is tested on its own, so it is credited.

Where the attack is informed on the whole batch (its batch mean of the metric, matched one-to-one,
beats the batch mean of every guess batch: by chance ``1 / (K + 1)`` per metric) the bar is lower:
the median guess's score on ``i``, so images the attack recovers only somewhat better than its
luckiest guess still count (the batch-mean route, leak rule revision 3). The median never exceeds
the best, so the two routes together credit everything either one credits, and a leak found under
revision 3 stays a leak.

**The false-alarm level, stated.** Over a batch the tests are many (images x metrics), and over an
audit more (x label estimates x clients); their union bound ``tests / (K + 1)`` is loose because a
test also needs the absolute leak line. The control therefore measures the level it runs at: each
guess batch in turn plays the attack against the bars of the other ``K - 1``, judged by the full
rule (lines, trivial-guess floors, noise-ratio pairing); with ``c`` of them credited with any leak,
``(c + 1) / (K + 1)`` estimates from above the chance that an uninformed attack is credited on this
client batch (:attr:`~lightning_gp.metrics.report.ReconstructionReport.prior_only_false_alarm`).
Clients and label estimates add up (union bound) in the worst case's
:attr:`~lightning_gp.audit.verdict.WorstCaseReport.control_false_alarm`. A false leak errs against the
defense, never for it; the level says how often.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_gp.attacks import Reconstruction, ServerView
from lightning_gp.audit.engine import AttackResult
from lightning_gp.audit.verdict import LeakRule, candidate_values, guess_floors, trivial_baselines
from lightning_gp.metrics import ReconstructionReport, reconstruction_reports
from lightning_gp.metrics.report import HIGHER_IS_PRIVATE

#: Public batches each attacked batch's control is scored over: one (image, metric) test passes by
#: chance with probability at most 1/256.
PRIOR_ONLY_BATCHES = 255
#: The metrics a criterion of the leak rule reads (the noise ratio is the guess's own, not a similarity).
CONTROLLED_METRICS = ("psnr", "ssim", "mse", "nmi", "lpips", "semantic")
#: Why the identification test needs no prior-only control (and the guesses are not scored by it): its
#: null is already that the output knows nothing of the original beyond its class, which an output made
#: from a data prior and an uninformative gradient satisfies; without its p-values the fixed lines judge
#: the guess batches ungated, which can only raise the control's stated false-alarm level.
UNCONTROLLED_IDENTIFICATION = (
    "the identification test's null already holds for outputs of a data prior; it needs no prior-only control"
)


@runtime_checkable
class HasDataPrior(Protocol):
    """An attack that can show what it returns without information about the batch."""

    def prior_only_guesses(self, view: ServerView, count: int) -> Tensor: ...


@dataclass(frozen=True)
class PriorOnlyControl:
    """One client batch's control: per original, metric -> the bar to beat; and the stated level.

    Attributes:
        bars: per original, metric -> the bar a reconstruction of it must beat (module docstring; NaN:
            no guess could be scored, which hides nothing).
        false_alarm: ``(c + 1) / (K + 1)``, ``c`` the guess batches credited with a leak against the
            others' bars (module docstring).
        guesses: ``K``, the guess batches scored.
    """

    bars: list[dict[str, float]]
    false_alarm: float
    guesses: int


def prior_only_control(
    report: ReconstructionReport,
    guesses: Tensor,
    originals: Tensor,
    view: ServerView,
    true_labels: Tensor | None,
    *,
    rule: LeakRule | None = None,
    reference: Tensor | None = None,
) -> PriorOnlyControl:
    """The control of ``report`` (the attack's scores on ``originals``) from ``guesses``
    ``[K, B', C, H, W]`` (the attack's outputs on ``K`` public batches; normalised like ``originals``).

    ``rule`` (default :class:`LeakRule`) and ``reference`` (public pixel images, for the dataset-mean
    floor) judge each guess batch against the others for the stated false-alarm level."""
    if guesses.ndim != originals.ndim + 1 or guesses.shape[2:] != originals.shape[1:] or guesses.shape[0] < 1:
        raise ValueError(
            f"guesses must be [K, B, *originals.shape[1:]] = [K, B, {', '.join(map(str, originals.shape[1:]))}] "
            f"with K >= 1, got {tuple(guesses.shape)}"
        )
    rule = rule if rule is not None else LeakRule()
    scored = reconstruction_reports(
        [Reconstruction(images=guess.to(originals.device), labels=None) for guess in guesses],
        originals,
        view,
        true_labels=true_labels,
        lpips=False,
        noise_ratio=rule.noise_ratio_line is not None,
        tests=None if rule.tests is None else rule.tests.without("identification", UNCONTROLLED_IDENTIFICATION),
    )
    metrics = [m for m in CONTROLLED_METRICS if m not in report.unavailable]
    # per metric, sign-flipped (higher leaks more), [K, B]: each guess batch's matched score and its best
    # score over its outputs on each original
    null = {
        m: _Null(
            torch.stack([_signed_rows(s, m) for s in scored]), torch.stack([_best_per_original(s, m) for s in scored])
        )
        for m in metrics
    }
    attack_means = {m: float(_signed_rows(report, m).nanmean()) for m in metrics}
    bars = _bars(null, attack_means, exclude=None, batch=len(report.rows))
    floors = guess_floors(scored[0].original_pixels, _baselines(scored[0], reference))
    credited = 0
    for k, guess in enumerate(scored):  # each guess batch plays the attack against the others
        means = {m: float(null[m].matched[k].nanmean()) for m in metrics}
        credited += _credited(rule, guess, _bars(null, means, exclude=k, batch=len(report.rows)), floors)
    return PriorOnlyControl(bars, (credited + 1) / (len(scored) + 1), len(scored))


@dataclass(frozen=True)
class _Null:
    """One metric's scores of the uninformed guess batches, sign-flipped, ``[K, B]``: matched one-to-one,
    and the best of each batch's outputs on each original."""

    matched: Tensor
    best: Tensor


def _sign(metric: str) -> float:
    """``sign * score`` is higher where the score leaks more."""
    return -1.0 if HIGHER_IS_PRIVATE[metric] else 1.0


def _best_per_original(report: ReconstructionReport, metric: str) -> Tensor:
    """``[B]`` the best (sign-flipped) score of any of ``report``'s outputs on each original (NaN where
    none was scored)."""
    if report.candidates is None or metric in report.unavailable:
        return torch.full((len(report.rows),), math.nan, dtype=torch.float64)
    rows = []
    for scores in report.candidates:
        values = scores.get(metric)
        if values is None:
            rows.append(math.nan)
            continue
        signed = _sign(metric) * values.double()
        finite = signed[~signed.isnan()]
        rows.append(float(finite.max()) if finite.numel() else math.nan)
    return torch.as_tensor(rows, dtype=torch.float64)


def _signed_rows(report: ReconstructionReport, metric: str) -> Tensor:
    """``[B]`` the report's matched ``metric`` per original, sign-flipped (NaN where not scored)."""
    values = [getattr(row, metric) for row in report.rows]
    return _sign(metric) * torch.as_tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)


def _bars(
    null: dict[str, _Null], attack_means: dict[str, float], exclude: int | None, batch: int
) -> list[dict[str, float]]:
    """Per original, metric -> its bar (unsigned), from the guess batches but ``exclude``: the median
    guess's matched score on the original where the attack's batch mean beats every guess batch's mean
    (the batch-mean route, leak rule revision 3), else the best score any guess output reached on it
    (the per-image route). The median never exceeds the best, so the two routes together credit
    everything either credits."""
    bars: list[dict[str, float]] = [{} for _ in range(batch)]
    for metric, scores in null.items():
        keep = [k for k in range(scores.best.shape[0]) if k != exclude]
        if not keep or scores.best[keep].isnan().all():
            continue
        matched, best = scores.matched[keep], scores.best[keep]
        null_means = matched.nanmean(dim=1)
        null_means = null_means[~null_means.isnan()]  # a guess batch with no finite score competes with nothing
        informed = bool((attack_means[metric] > null_means).all())
        top = matched.nanmedian(dim=0).values if informed else best.nan_to_num(nan=-math.inf).max(dim=0).values
        for i in range(batch):
            value = float(top[i])
            bars[i][metric] = math.nan if math.isnan(value) or value == -math.inf else _sign(metric) * value
    return bars


def _baselines(report: ReconstructionReport, reference: Tensor | None) -> list:
    if report.original_pixels is None or reference is None:
        return []
    return trivial_baselines(report.original_pixels, reference_images=reference)


def _credited(rule: LeakRule, report: ReconstructionReport, bars: list[dict[str, float]], floors: list | None) -> bool:
    """Whether the rule credits some output of ``report`` (a guess batch) with a leak of some original
    against ``bars`` (the other guess batches')."""
    for i in range(len(report.rows)):
        floor = None if floors is None else floors[i]
        if any(rule.criteria(values, floor, bars[i]) for values in candidate_values(report, i)):
            return True
    return False


def with_prior_only_control(
    attacks: Sequence[object],
    results: Sequence[AttackResult],
    count: int = PRIOR_ONLY_BATCHES,
    *,
    rule: LeakRule | None = None,
    reference: Tensor | None = None,
) -> tuple[list[AttackResult], list[str]]:
    """``results`` (one per client, ``attacks`` their attacks) with each report's prior-only control
    filled in when the attack has a data prior (:class:`HasDataPrior`); unchanged otherwise. A
    client the attack did not reconstruct gets an empty control (its NaN scores leak nothing).
    ``rule`` and ``reference`` state the control's false-alarm level (:func:`prior_only_control`).

    Also returns the errors: a client whose control raised keeps no control (``prior_only=None``: the
    rule credits its reconstruction as if the attack had no prior, the direction that never favours
    the defense), and the error, which makes the cell's status "error", so no verdict reads "private"."""
    if not attacks or not isinstance(attacks[0], HasDataPrior):
        return list(results), []
    out, errors = [], []
    for position, (attack, result) in enumerate(zip(attacks, results)):
        record, report = result.record, result.report
        bars: list[dict[str, float]] | None
        level: float | None = 0.0
        if not any(row.reconstructed for row in report.rows) or record.inputs is None:
            bars = [{} for _ in report.rows]
        else:
            assert isinstance(attack, HasDataPrior)
            try:
                guesses = attack.prior_only_guesses(result.view, count)
                control = prior_only_control(
                    report, guesses, record.inputs, result.view, record.targets, rule=rule, reference=reference
                )
                bars, level = control.bars, control.false_alarm
            except Exception as err:  # any failure: no control for this client, and the cell says why
                errors.append(f"client {position}: the prior-only control failed: {type(err).__name__}: {err}")
                bars, level = None, None
        replaced = dataclasses.replace(report, prior_only=bars, prior_only_false_alarm=level)
        out.append(dataclasses.replace(result, report=replaced))
    return out, errors


__all__ = [
    "CONTROLLED_METRICS",
    "PRIOR_ONLY_BATCHES",
    "HasDataPrior",
    "PriorOnlyControl",
    "prior_only_control",
    "with_prior_only_control",
]
