"""The prior-only control: what an attack with a data prior scores when the gradient says nothing.

A learned inverter (Wu et al., UAI 2023) returns plausible images from any gradient: it was fitted
to public images of the task. Matched one-to-one to a client's batch of 8, its outputs beat a
blank or dataset-mean image on about half of the originals even when the upload is pure noise
(``benchmarks/results/local_dp_batch8_prior_only.md``: 9 of 16 images "leaked" at noise std 100
per coordinate). Those wins measure the prior and the matching, not the gradient.

The control scores the attack against itself: its reconstructions of ``K`` public batches that
the inverter held out from fitting, defended exactly as the client defends (fresh randomness),
are matched to the attacked originals and scored exactly as its reconstruction of the attacked
batch is. Two tests follow, per metric, that the leak rule reads through one number per image
(:attr:`~lightning_gp.metrics.report.ReconstructionReport.prior_only`, see
:class:`~lightning_gp.audit.verdict.LeakRule`):

1. **Does the gradient inform this attack on this batch?** The attack's batch mean of the metric
   must beat the batch mean of every one of the ``K`` guesses. Without information the ``K + 1``
   batch means are exchangeable, so this passes by chance with probability ``1/(K+1)``; with
   :data:`PRIOR_ONLY_BATCHES` = 255 and the five similarity metrics, at most 2% per client batch
   (the refined variant refines only 31 guesses, its refinement being costly: 1/32 per metric).
   A mean over the batch has a small spread, so real information passes it easily.
2. **Does this image beat the attack's typical uninformed guess on it?** Its score must beat the
   median of the ``K`` guesses' scores on that original. A criterion of the rule counts only then
   (on a metric that failed test 1 nothing is credited).

A per-image test alone (beat all ``K`` guesses on that image) would need the same ``1/(K+1)``
level per image and would miss images an informed attack recovers only somewhat better than its
luckiest guess: a loss of power that errs in the defense's favour. The two tests above keep the
chance of crediting an uninformed attack at about 2% per client batch; such a false leak errs
against the defense, never for it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_gp.attacks import Reconstruction, ServerView
from lightning_gp.audit.engine import AttackResult
from lightning_gp.metrics import ReconstructionReport, reconstruction_report
from lightning_gp.metrics.report import HIGHER_IS_PRIVATE

#: Public batches each attacked batch's control is scored over (see the module's statistics).
PRIOR_ONLY_BATCHES = 255
#: The metrics a criterion of the leak rule reads (the noise ratio is the guess's own, not a similarity).
CONTROLLED_METRICS = ("psnr", "ssim", "mse", "lpips", "semantic")


@runtime_checkable
class HasDataPrior(Protocol):
    """An attack that can show what it returns without information about the batch."""

    def prior_only_guesses(self, view: ServerView, count: int) -> Tensor: ...


def prior_only_control(
    report: ReconstructionReport, guesses: Tensor, originals: Tensor, view: ServerView, true_labels: Tensor | None
) -> list[dict[str, float]]:
    """Per original of ``report`` (the attack's scores on ``originals``), the bar each controlled
    metric must beat: the median score of ``guesses`` ``[K, B, C, H, W]`` (each batch matched to
    ``originals`` and scored like a reconstruction) on that original when the attack's batch mean
    beats every guess's batch mean, else a bar nothing beats (``inf``, or ``-inf`` for a metric
    where lower leaks more)."""
    if guesses.ndim != originals.ndim + 1 or guesses.shape[1:] != originals.shape:
        raise ValueError(
            f"guesses must be [K, *originals.shape] = [K, {', '.join(map(str, originals.shape))}], "
            f"got {tuple(guesses.shape)}"
        )
    shape = (guesses.shape[0], originals.shape[0])
    scores = {metric: torch.full(shape, math.nan, dtype=torch.float64) for metric in CONTROLLED_METRICS}
    for k, guess in enumerate(guesses):
        scored = reconstruction_report(
            Reconstruction(images=guess.to(originals.device), labels=None),
            originals,
            view,
            true_labels=true_labels,
            lpips=False,
            noise_ratio=False,
        )
        for metric in CONTROLLED_METRICS:
            if metric not in scored.unavailable:
                scores[metric][k] = _column(scored, metric)
    control: list[dict[str, float]] = [{} for _ in report.rows]
    for metric, null in scores.items():
        if metric in report.unavailable or null.isnan().all():
            continue
        attack = _column(report, metric)
        sign = -1.0 if HIGHER_IS_PRIVATE[metric] else 1.0  # sign * score: higher leaks more
        # a guess batch with no finite score competes with nothing (a NaN mean must not block the test)
        null_means = null.nanmean(dim=1)
        null_means = null_means[~null_means.isnan()]
        informed = bool((sign * attack.nanmean() > sign * null_means).all())
        median = null.nanmedian(dim=0).values
        for i in range(len(report.rows)):
            control[i][metric] = float(median[i]) if informed else sign * math.inf
    return control


def _column(report: ReconstructionReport, metric: str) -> Tensor:
    """``[B]`` the report's ``metric`` per original (NaN where not scored)."""
    values = [getattr(row, metric) for row in report.rows]
    return torch.as_tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)


def with_prior_only_control(
    attacks: Sequence[object], results: Sequence[AttackResult], count: int = PRIOR_ONLY_BATCHES
) -> tuple[list[AttackResult], list[str]]:
    """``results`` (one per client, ``attacks`` their attacks) with each report's prior-only control
    filled in when the attack has a data prior (:class:`HasDataPrior`); unchanged otherwise. A
    client the attack did not reconstruct gets an empty control (its NaN scores leak nothing).

    Also returns the errors: a client whose control raised keeps no control (``prior_only=None``: the
    rule credits its reconstruction as if the attack had no prior, the direction that never favours
    the defense), and the error, which makes the cell's status "error", so no verdict reads "private"."""
    if not attacks or not isinstance(attacks[0], HasDataPrior):
        return list(results), []
    out, errors = [], []
    for position, (attack, result) in enumerate(zip(attacks, results)):
        record, report = result.record, result.report
        if not any(row.reconstructed for row in report.rows) or record.inputs is None:
            control: list[dict[str, float]] | None = [{} for _ in report.rows]
        else:
            assert isinstance(attack, HasDataPrior)
            try:
                guesses = attack.prior_only_guesses(result.view, count)
                control = prior_only_control(report, guesses, record.inputs, result.view, record.targets)
            except Exception as err:  # any failure: no control for this client, and the cell says why
                errors.append(f"client {position}: the prior-only control failed: {type(err).__name__}: {err}")
                control = None
        out.append(dataclasses.replace(result, report=dataclasses.replace(report, prior_only=control)))
    return out, errors


__all__ = ["CONTROLLED_METRICS", "PRIOR_ONLY_BATCHES", "HasDataPrior", "prior_only_control", "with_prior_only_control"]
