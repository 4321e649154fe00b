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
original ``i`` only where, on each of the criterion's metrics, it beats the **best** score any of
the ``K`` uninformed batches reached on ``i`` with any of its outputs (the bar,
:attr:`~lightning_gp.metrics.report.ReconstructionReport.prior_only`, read by
:class:`~lightning_gp.audit.verdict.LeakRule`). Without information the attack's outputs and the
``K`` guess batches are exchangeable, so one (image, metric) test passes by chance with probability
at most ``1 / (K + 1)``. One informed image in a batch of otherwise uninformed outputs is tested on
its own, so it is credited (a batch mean, the earlier test, hid it).

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
from lightning_gp.metrics import ReconstructionReport, reconstruction_report
from lightning_gp.metrics.report import HIGHER_IS_PRIVATE

#: Public batches each attacked batch's control is scored over: one (image, metric) test passes by
#: chance with probability at most 1/256.
PRIOR_ONLY_BATCHES = 255
#: The metrics a criterion of the leak rule reads (the noise ratio is the guess's own, not a similarity).
CONTROLLED_METRICS = ("psnr", "ssim", "mse", "nmi", "lpips", "semantic")


@runtime_checkable
class HasDataPrior(Protocol):
    """An attack that can show what it returns without information about the batch."""

    def prior_only_guesses(self, view: ServerView, count: int) -> Tensor: ...


@dataclass(frozen=True)
class PriorOnlyControl:
    """One client batch's control: per original, metric -> the bar to beat; and the stated level.

    Attributes:
        bars: per original, metric -> the best score of any uninformed guess on it (NaN: no guess
            could be scored, which hides nothing).
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
    scored = [
        reconstruction_report(
            Reconstruction(images=guess.to(originals.device), labels=None),
            originals,
            view,
            true_labels=true_labels,
            lpips=False,
            noise_ratio=rule.noise_ratio_line is not None,
        )
        for guess in guesses
    ]
    metrics = [m for m in CONTROLLED_METRICS if m not in report.unavailable]
    # best[m]: [K, B] each guess batch's best score (sign-flipped: higher leaks more) on each original
    best = {m: torch.stack([_best_per_original(s, m) for s in scored]) for m in metrics}
    bars = _bars(best, exclude=None, batch=len(report.rows))
    floors = guess_floors(scored[0].original_pixels, _baselines(scored[0], reference))
    credited = sum(
        _credited(rule, s, _bars(best, exclude=k, batch=len(report.rows)), floors) for k, s in enumerate(scored)
    )
    return PriorOnlyControl(bars, (credited + 1) / (len(scored) + 1), len(scored))


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


def _bars(best: dict[str, Tensor], exclude: int | None, batch: int) -> list[dict[str, float]]:
    """Per original, metric -> the best score over the guess batches (all but ``exclude``), unsigned."""
    bars: list[dict[str, float]] = [{} for _ in range(batch)]
    for metric, table in best.items():
        if exclude is not None:
            table = torch.cat([table[:exclude], table[exclude + 1 :]])
        if table.shape[0] == 0:
            continue
        top = table.nan_to_num(nan=-math.inf).max(dim=0).values
        for i in range(batch):
            value = float(top[i])
            bars[i][metric] = math.nan if value == -math.inf else _sign(metric) * value
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
