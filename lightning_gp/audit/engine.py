"""The attack-and-score engine: attack one tapped gradient from the server's view and score it.

record (what a client shared) -> :class:`~lightning_gp.attacks.ServerView` -> attack -> report

:func:`attack_record` is the one place an attack meets a tapped gradient: the catalogue's
:func:`~lightning_gp.audit.setting_audit.audit_setting`, :class:`~lightning_gp.audit.PrivacyAudit`
and ``lightning-gp attack`` all go through it, so the attacker always matches with the loss the
client trained with and every reconstruction is scored the same way.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_gp.attacks import GradientAttack, Reconstruction, ServerView
from lightning_gp.metrics import ReconstructionReport, reconstruction_report
from lightning_gp.metrics.recognition import RecognitionTests
from lightning_gp.metrics.report import METRICS, batch_mean
from lightning_gp.records import TappedGradient


@dataclass
class AttackResult:
    """One client's round: what it shared, what the attack rebuilt, and the scores."""

    record: TappedGradient
    view: ServerView
    reconstruction: Reconstruction
    report: ReconstructionReport
    seconds: float

    def pixels(self) -> tuple[Tensor, Tensor]:
        """The client's images and the aligned reconstructions, as pixels in [0, 1] (for figures)."""
        original, reconstructed = self.report.original_pixels, self.report.reconstructed_pixels
        if original is None or reconstructed is None:
            raise ValueError("the reconstruction report holds no pixel images")
        return original, reconstructed


def attack_record(
    record: TappedGradient,
    model: nn.Module,
    attack: GradientAttack,
    *,
    num_classes: int,
    mean: Sequence[float],
    std: Sequence[float],
    server_secrets: dict[str, Any] | None = None,
    labels_known: bool = False,
    lpips: bool = True,
    noise_ratio: bool = True,
    lpips_fn: nn.Module | None = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    public_data: tuple[Tensor, Tensor] | None = None,
    tests: RecognitionTests | None = None,
    label_softmax: str = "auto",
) -> AttackResult:
    """Attack one tapped gradient from the server's view and score it against the client's batch.

    ``model`` is deep-copied and given the record's weights, so the caller's model (e.g. one
    still training, see :class:`~lightning_gp.audit.PrivacyAudit`) is never touched. The attacker
    matches with the loss the client trains with (:func:`attacker_loss`): ``loss_fn`` when given,
    else ``model.loss_fn`` when the model has one (e.g. PRECODE's CE + beta KL; the server designed
    the training), else cross-entropy.
    ``lpips``/``noise_ratio``/``lpips_fn`` go to :func:`~lightning_gp.metrics.reconstruction_report`.
    ``public_data``: labelled images the server holds (:attr:`ServerView.public_data
    <lightning_gp.attacks.view.ServerView>`, e.g. :func:`~lightning_gp.audit.rounds.public_examples`);
    batch label recovery needs them on a trained model (``label_softmax``: where it reads the softmax,
    :attr:`ServerView.label_softmax <lightning_gp.attacks.view.ServerView>`). ``tests``: the recognisable-image tests the
    report is scored with (:func:`~lightning_gp.audit.recognition.recognition_tests`).
    """
    view = record_view(
        record, model, num_classes=num_classes, mean=mean, std=std, server_secrets=server_secrets,
        labels_known=labels_known, loss_fn=loss_fn, public_data=public_data, label_softmax=label_softmax,
    )  # fmt: skip
    start = time.perf_counter()
    reconstruction = attack.reconstruct(view)
    seconds = time.perf_counter() - start
    scores = Scoring(lpips=lpips, noise_ratio=noise_ratio, lpips_fn=lpips_fn, tests=tests)
    return scores.result(record, view, reconstruction, seconds)


def attack_records_side_by_side(
    records: Sequence[TappedGradient],
    model: nn.Module,
    attacks: Sequence[GradientAttack],
    *,
    scoring: Scoring,
    **view_options: Any,
) -> list[AttackResult] | None:
    """:func:`attack_record` of ``attacks[i]`` on ``records[i]`` for every ``i``, the attacks' problems
    in one shared optimisation (:meth:`~lightning_gp.attacks.GradientAttack.reconstruct_side_by_side`;
    each result's ``seconds`` is its share of the whole); ``None`` for fewer than two records (one has
    nothing to share: it runs as it always did), where they cannot share one, or where trying fails in any
    way (an attack that does not apply to some client, an error): the caller then attacks each record on
    its own, which gives every client its own result or error. ``view_options``: :func:`record_view`'s
    keywords."""
    if len(records) < 2 or len(records) != len(attacks):
        return None
    try:
        views = [record_view(record, model, **view_options) for record in records]
        start = time.perf_counter()
        reconstructions = attacks[0].reconstruct_side_by_side(attacks, views)
        if reconstructions is None:
            return None
        seconds = (time.perf_counter() - start) / len(records)
        return [scoring.result(r, v, rec, seconds) for r, v, rec in zip(records, views, reconstructions, strict=True)]
    except Exception:  # the one-by-one path names the client and the error
        return None


def record_view(
    record: TappedGradient,
    model: nn.Module,
    *,
    num_classes: int,
    mean: Sequence[float],
    std: Sequence[float],
    server_secrets: dict[str, Any] | None = None,
    labels_known: bool = False,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    public_data: tuple[Tensor, Tensor] | None = None,
    label_softmax: str = "auto",
) -> ServerView:
    """The server's view of ``record`` (:func:`attack_record`'s), on a deep copy of ``model``; refuses
    a record that holds no client batch to score against."""
    if record.inputs is None:
        raise ValueError("the record holds no client batch to score against (tapped with record_data=False)")
    return ServerView.from_tap(
        record,
        copy.deepcopy(model),
        num_classes=num_classes,
        mean=tuple(mean),
        std=tuple(std),
        labels_known=labels_known,
        server_secrets=server_secrets,
        loss_fn=attacker_loss(model, loss_fn),
        public_data=public_data,
        label_softmax=label_softmax,
    )


@dataclass(frozen=True)
class Scoring:
    """How a reconstruction is scored (:func:`~lightning_gp.metrics.reconstruction_report`'s options)."""

    lpips: bool = True
    noise_ratio: bool = True
    lpips_fn: nn.Module | None = None
    tests: RecognitionTests | None = None

    def result(
        self, record: TappedGradient, view: ServerView, reconstruction: Reconstruction, seconds: float
    ) -> AttackResult:
        """``reconstruction`` of ``record``'s batch, scored against it."""
        assert record.inputs is not None  # record_view refuses a record without its batch
        report = reconstruction_report(
            reconstruction,
            record.inputs,
            view,
            true_labels=record.targets,
            lpips=self.lpips,
            lpips_fn=self.lpips_fn,
            noise_ratio=self.noise_ratio,
            tests=self.tests,
        )
        return AttackResult(record, view, reconstruction, report, seconds)


def attacker_loss(
    model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None
) -> Callable[[Tensor, Tensor], Tensor]:
    """The loss the attacker matches with: the client's ``loss_fn`` when known, else the model's own
    ``loss_fn`` (any callable ``loss(logits, targets)``, a module or a plain function), else
    cross-entropy (what the package's runners train a model without one with)."""
    if loss_fn is not None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (loss(logits, targets)), got {type(loss_fn).__name__}")
        return loss_fn
    own = getattr(model, "loss_fn", None)
    if own is not None:
        if not callable(own):
            raise TypeError(f"model.loss_fn must be callable (loss(logits, targets)), got {type(own).__name__}")
        return own
    return nn.CrossEntropyLoss()


def mean_scores(results: Sequence[AttackResult]) -> dict[str, float | None]:
    """Per-image scores averaged over several clients' reports (PSNR of exact copies is inf).

    A metric some report lacks (LPIPS skipped, a noise ratio "n/a") is ``None``; images an attack
    did not reconstruct (NaN) are left out (:func:`~lightning_gp.metrics.report.batch_mean`).
    """
    rows = [row for result in results for row in result.report.rows]
    means: dict[str, float | None] = {m: batch_mean([getattr(row, m) for row in rows]) for m in METRICS}
    accuracies = [r.report.label_accuracy for r in results if r.report.label_accuracy is not None]
    means["label_accuracy"] = sum(accuracies) / len(accuracies) if accuracies else None
    return means
