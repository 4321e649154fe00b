"""Every attack against one defense setting, judged by the worst case per threat model: the engine of the
matrix and the demo.

For one :class:`~lightning_gp.audit.catalog.DefenseSetting` :func:`audit_setting` taps a round of chosen
client images (:func:`~lightning_gp.audit.rounds.tap_defended_round`), runs every published attack
and the setting's adaptive attack(s) on each client's shared gradient, scores each attack over all
the clients' images, and judges the setting by the per-image worst case over the attacks
(:func:`~lightning_gp.audit.verdict.worst_case_report`), once per threat model:

- **passive** (honest-but-curious server): it sees what the clients send and knows the defense; the
  published passive attacks and the adaptive attacks;
- **active** (malicious server): it may also send a modified model (Robbing the Fed, the
  ATS-aware Robbing, any attack with ``modify_model``); the worst case over passive and active.
- **aggregate** (``audit_setting(aggregate=True)``): an honest-but-curious server behind secure
  aggregation sees only the round's combined update (:func:`~lightning_gp.audit.rounds.aggregate_record`:
  the mean of the clients' defended updates, or DP-FedAvg's clipped, noised mean with ``client_dp``),
  attacked as one batch of every client's images, each image scored. The passive published attacks
  run on it, and the setting's adaptive attacks with their knowledge lifted to the mean
  (:meth:`~lightning_gp.attacks.DefenseKnowledge.over_clients`: each client's chunk of the dummy batch
  through its own clip or Top-k mask, the noise std over ``sqrt(clients)``; the labels granted in
  client order). Where a defense's knowledge does not carry over (a random or aligned mask, a
  transform read off one client's gradient, DP-FedAvg's clipped noised mean) the gap is stated and the
  verdict is never "private".

Cells: ``ok``; ``n/a`` when the attack's own precondition check raised
:class:`~lightning_gp.attacks.AttackNotApplicable` (R-GAP on a model with biases, GradInversion's
BatchNorm prior without BatchNorm), with the reason; ``fallback`` when an adaptive attack ran the
published one because it does not model the defense; ``error`` for any other exception, printed
whole. Fallback cells are real attacks: they enter the worst case. A clients' images that an
attack failed on score "not reconstructed" and the others keep their scores. A verdict is never
"private" with an error cell, a fallback, an adaptive attack that could not apply or an attack the
budget asked for that did not run (the learned inverter on a setting the server cannot replay, or
below ``AttackBudget.learned_min_batch``): it is "inconclusive", with the reasons.
"""

from __future__ import annotations

import copy
import hashlib
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import lightning as L
import torch
from torch import Tensor, nn

from lightning_gp.attacks import (
    AttackNotApplicable,
    DefenseKnowledge,
    GenerativeGradientLeakage,
    GeneratorConfig,
    GradientAttack,
    InverterConfig,
    PublishedAttack,
    Reconstruction,
    ServerView,
    attacks_by_name,
    label_estimates_differ,
)
from lightning_gp.attacks.learned import REFINED_DECOYS, LearnedInversion, RefinedLearnedInversion
from lightning_gp.attacks.resolution import composed_knowledge
from lightning_gp.attacks.threat_models import SoKThreatModel, attack_requirements, threat_class_of
from lightning_gp.attacks.threat_models import threat_model as sok_threat_model
from lightning_gp.audit.bounds import KAPPA_IMAGES, FormalBound, lpips_for_rule, prior_only_kappa, setting_bound
from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.engine import AttackResult, Scoring, attack_record, attack_records_side_by_side, attacker_loss
from lightning_gp.audit.learned import (
    REFINE_ITERATIONS,
    learned_inversion_attacks,
    setting_simulator,
    simulation_refusal,
)
from lightning_gp.audit.prior_control import with_prior_only_control
from lightning_gp.audit.recognition import datamodule_recognition_tests
from lightning_gp.audit.rounds import (
    active_replay_blocker,
    aggregate_record,
    public_batch,
    public_examples,
    tap_defended_round,
    training_examples,
)
from lightning_gp.audit.verdict import BaselineScores, LeakRule, WorstCaseReport, trivial_baselines, worst_case_report
from lightning_gp.defenses import DistributedGaussianMechanism
from lightning_gp.defenses.base import Gradients
from lightning_gp.federated import ClientLevelDP, weighted_mean
from lightning_gp.metrics import ReconstructionReport, concatenate_reports, reconstruction_report
from lightning_gp.metrics.recognition import RecognitionTests
from lightning_gp.normalization import denormalize
from lightning_gp.records import TappedGradient
from lightning_gp.validation import check_bool, check_positive_int

AttackKind = Literal["published", "adaptive"]
CellStatus = Literal["ok", "n/a", "fallback", "error"]
ThreatModel = Literal["passive", "active"]
#: Appended to an attack's name where it ran again with the batch's labels counted from dummy inputs.
DUMMY_LABELS_SUFFIX = " (dummy-input labels)"
THREAT_MODELS: tuple[ThreatModel, ...] = ("passive", "active")
#: The gap both threat models name where ``AttackBudget(learned_inversion=True)`` asked for the learned
#: inverter and it did not run (``{}``: why).
LEARNED_NOT_RUN = "the learned inverter was asked for (learned_inversion=True) but not run: {}"


@dataclass(frozen=True)
class AttackBudget:
    """Iterations of every attack (the matrix's ``--quick`` and full budgets are two of these).

    Attributes:
        ig_iterations: Adam steps of Inverting Gradients, GradInversion and the adaptive Adam attacks
            (and of the refined learned inverter's refinement, at most 200).
        lbfgs_iterations: the cap on outer L-BFGS steps of DLG, iDLG and the adaptive L-BFGS
            attack; a run stops earlier when it matches the gradient to tolerance or stops
            improving. 300: at client batch 8, 100 steps left 2 of 8 undefended images over 20 dB
            where 300 left 6 (``benchmarks/results/matrix_batch8.md``).
        adaptive_restarts: restarts of the adaptive Adam attack (the adaptive L-BFGS keeps >= 4).
        rtf_bins: bins of Robbing the Fed's imprint block.
        learned_inversion: also run the learned inverter and its refined variant
            (:func:`~lightning_gp.audit.learned.learned_inversion_attacks`) on every setting the
            server can replay, the undefended one included, and with ``audit_setting(aggregate=True)``
            on the secure aggregate too (trained on the mean of as many simulated clients); off by
            default (it trains a network per setting, minutes on a CPU). Where it was asked for and
            does not run (the server cannot replay the setting,
            :func:`~lightning_gp.audit.learned.simulation_refusal`; a client, or the aggregate, below
            ``learned_min_batch``; ``audit_setting(adaptive=False)``; DP-FedAvg's aggregate), the
            verdicts name that gap (:data:`LEARNED_NOT_RUN`) and are never "private".
        learned_max_epochs: cap on the learned inverter's epochs (it stops earlier on convergence).
        learned_min_batch: with ``learned_inversion``, run the learned inverter only on clients of at
            least this many images. Raising it above 1 saves minutes per setting (at batch 1 the
            inverter trains on nine times the pairs of batch 8), and a setting audited on smaller
            clients then reads "inconclusive" at best (the inverter not run is a gap): gradient
            matching beat the inverter at batch 1 on the catalogue
            (``benchmarks/results/learned_inversion.md``), yet after 50 rounds the inverter alone
            leaked 7 of 16 batch-1 images of the Gaussian mechanism at z = 0.03 (docs/results/defense-that-holds.md, "Less
            noise, fewer clients"). At batch 8 it is the strongest passive attack on Top-k and DGP
            (``benchmarks/results/matrix_batch8_pruning.md``).
        lbfgs_restarts: restarts of DLG and iDLG, the one with the lowest gradient distance kept (at
            batch 8 the start decides as much as the budget: the lowest distance of 3 starts was also
            the best PSNR there).
        stop_when_all_leak: attack no client further once every image it holds leaks to some
            passive attack already run, and run no further attack once that holds for every client:
            no attack can change either verdict or either leak fraction then (a leaked image stays
            leaked; the active worst case contains the passive one), only raise the worst-case mean
            PSNR, which is then a lower bound. The setting's adaptive attacks then run before the
            published ones (on a pruned gradient the published iDLG never converges and runs its
            whole budget, after the attack that knows the pruning has leaked every image).
            :attr:`SettingAudit.skipped` lists the attacks not run, :attr:`SettingAudit.partial`
            those run on fewer clients. Off by default; the frontier turns it on.
        refined_decoys: with ``learned_inversion``, the public batches the refined inverter attacks end
            to end for its prior-only control (:mod:`~lightning_gp.audit.prior_control`): its batch
            mean must beat every one, a test at the ``1 / (K + 1)`` level per metric and client batch.
            31 (1 in 32) keeps the refinement's cost; 255 is the unrefined inverter's 1 in 256, at
            8 times the control's cost. More guesses mean fewer chance leaks and less power: a weak
            label signal that 31 credits, 255 may not (docs/results/defense-that-holds.md).
        generative_prior: also run the generative image prior (GGL, Li et al. CVPR 2022;
            :class:`~lightning_gp.attacks.GenerativeGradientLeakage`) built with the setting's defense
            knowledge, on every setting, the undefended one included: a DCGAN trained on up to 10,000
            public (test-split) images (about 1.5 min on a CPU thread, cached for the process), then
            the latent search through the defense. Off by default. Where it was asked for and cannot
            run (a defense with no composable knowledge: Refiner, ATS, PRECODE, PriPrune;
            ``adaptive=False``) both verdicts name that gap (:data:`GENERATIVE_NOT_RUN`) and are never
            "private".
        generative_max_steps: with ``generative_prior``, the cap on its GAN's training steps (it
            stops earlier on a plateau of its held-out MMD).
    """

    ig_iterations: int = 1000
    lbfgs_iterations: int = 300
    adaptive_restarts: int = 1
    rtf_bins: int = 64
    learned_inversion: bool = False
    learned_max_epochs: int = 60
    lbfgs_restarts: int = 1
    stop_when_all_leak: bool = False
    learned_min_batch: int = 1
    refined_decoys: int = REFINED_DECOYS
    generative_prior: bool = False
    generative_max_steps: int = 3000

    def __post_init__(self) -> None:
        names = ("ig_iterations", "lbfgs_iterations", "adaptive_restarts", "rtf_bins", "learned_max_epochs")
        for name in (*names, "lbfgs_restarts", "learned_min_batch", "refined_decoys", "generative_max_steps"):
            check_positive_int(getattr(self, name), name)
        check_bool(self.learned_inversion, "learned_inversion")
        check_bool(self.generative_prior, "generative_prior")
        check_bool(self.stop_when_all_leak, "stop_when_all_leak")


@dataclass(frozen=True)
class AttackSpec:
    """A column of the matrix: ``build(seed, model)`` gives a fresh attack for one client."""

    name: str
    kind: AttackKind
    build: Callable[[int, nn.Module], GradientAttack]


def published_attacks(budget: AttackBudget, names: Sequence[str] | None = None) -> list[AttackSpec]:
    """The published attacks of the matrix (all, in their order, or the ``names`` given, in that
    order): the registry of :mod:`lightning_gp.attacks.registry`, where each attack registers its
    name and how ``budget`` builds it beside its definition. An unknown name is an error listing them."""
    return [_published_spec(p, budget) for p in attacks_by_name(names)]


def _published_spec(published: PublishedAttack, budget: AttackBudget) -> AttackSpec:
    return AttackSpec(published.name, "published", lambda seed, model: published.build(budget, seed, model))


@dataclass
class Cell:
    """One attack against one setting, over all attacked images.

    Attributes:
        status: ``"ok"``; ``"n/a"`` (the attack does not apply: ``note`` says why); ``"fallback"``
            (an adaptive attack ran the published one: it does not model this defense); ``"error"``
            (``note`` holds the whole message; the images it failed on score "not reconstructed").
        threat: ``"active"`` for an attack that sends a modified model, else ``"passive"``.
        means: mean PSNR/SSIM/LPIPS/... over the images (``{}`` when nothing was scored).
        leak_fraction: fraction of the images this attack alone leaks (:class:`~lightning_gp.audit.LeakRule`).
        trained_means, trained_leak_fraction: the same, scored against the images the client trained
            on, for a defense that transforms them (ATS-T; ``means`` is against the raw image, ATS-R).
        sok_class: the weakest threat model of the SoK (Carletti et al., USENIX Security 2025) under which
            the attack runs, ``"A"`` .. ``"H"`` (:func:`~lightning_gp.attacks.threat_models.threat_class_of`).
        seconds, cpu_seconds: the cell's wall time and its process's CPU time (every thread's); the CPU
            time does not count a worker that waits for a core or a paused machine.
    """

    defense: str
    attack: str
    kind: AttackKind
    status: CellStatus
    note: str = ""
    means: dict[str, float | None] = field(default_factory=dict)
    leak_fraction: float | None = None
    seconds: float = 0.0
    trained_means: dict[str, float | None] = field(default_factory=dict)
    trained_leak_fraction: float | None = None
    threat: ThreatModel = "passive"
    sok_class: str = ""
    cpu_seconds: float = 0.0

    def summary(self) -> str:
        """One line for progress output: the scores, or the status and why (whole)."""
        if not self.means or self.means.get("psnr") is None:
            return f"{self.attack:32s} {self.status}: {self.note} ({self.seconds:.0f} s)"
        marked = f" ({self.status}: {self.note})" if self.status in ("fallback", "error") else ""
        trained = (
            f"; vs the transformed images PSNR {self.trained_means['psnr']:.1f} dB, SSIM "
            f"{self.trained_means['ssim']:.3f}"
            if self.trained_means and self.trained_means.get("psnr") is not None
            else ""
        )
        return (
            f"{self.attack:32s} PSNR {self.means['psnr']:.1f} dB, SSIM {self.means['ssim']:.3f}, "
            f"{self.leak_fraction:.0%} of images leak{trained}{marked} ({self.seconds:.0f} s)"
        )

    def gap(self) -> str | None:
        """Why this cell leaves the audit incomplete (``None``: it does not)."""
        if self.status == "error":
            return f"{self.attack} failed: {self.note}"
        if self.status == "fallback":
            return f"{self.attack} fell back to the published attack ({self.note})"
        if self.status == "n/a" and self.kind == "adaptive":
            return f"the adaptive attack {self.attack} could not apply: {self.note}"
        return None


@dataclass
class SettingAudit:
    """Every attack against one setting, and the worst case over them per threat model.

    Attributes:
        passive: the worst case over the passive attacks (published and adaptive);
        active: over every attack, the malicious server's modified models included. Either is
            ``None`` when no attack of it produced a report.
        bound: the setting's formal ReRo bound ``eta`` at the kappa of the leak rule on the audited
            images (:mod:`~lightning_gp.audit.bounds`), composed over the audited client's releases in
            rounds ``0 .. round``, or "no formal bound" with the reason.
        aggregate: the worst case of the secure-aggregation view (``audit_setting(aggregate=True)``)
            for the honest-but-curious server, over the passive ``aggregate_cells``; ``None`` when not
            audited. ``aggregate_active``: for the malicious server behind secure aggregation, over every
            aggregate cell, the attacks that send each client its own model (LOKI) included. ``aggregate_bound``: its ReRo bound
            (DP-FedAvg's rounds ``0 .. round`` with ``client_dp``; else the setting's own on the sum of the
            round's uploads: a Gaussian mechanism per client is charged the sum's noise, ``sqrt(K)`` times
            one upload's, any other bound holds for the aggregate by post-processing).
        skipped: the attacks not run because every image had leaked to an earlier passive attack
            (``AttackBudget(stop_when_all_leak=True)``); the worst-case PSNR is then a lower bound.
            ``partial``: attack -> how many clients it skipped (their images had leaked).
        sok_class: the SoK threat model the audit was restricted to (``None``: every attack);
            ``forbidden``: the attacks it did not run because they need more than that model grants
            (a restriction asked for, not a gap). Under a threat model without active manipulation
            (``A`` .. ``E``) ``active`` is ``None``: the malicious server is outside it.
    """

    setting: str
    cells: list[Cell]
    passive: WorstCaseReport | None
    active: WorstCaseReport | None
    results: dict[str, list[AttackResult]] = field(default_factory=dict, repr=False)
    bound: FormalBound | None = None
    aggregate: WorstCaseReport | None = None
    aggregate_cells: list[Cell] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    partial: dict[str, int] = field(default_factory=dict)
    aggregate_bound: FormalBound | None = None
    sok_class: str | None = None
    forbidden: list[str] = field(default_factory=list)
    aggregate_active: WorstCaseReport | None = None

    @property
    def worst(self) -> WorstCaseReport | None:
        """The worst case over every attack (the active threat model)."""
        return self.active

    def verdict(self, threat: ThreatModel | Literal["aggregate", "aggregate_active"]) -> str:
        reports = {"passive": self.passive, "active": self.active, "aggregate": self.aggregate}
        report = {**reports, "aggregate_active": self.aggregate_active}[threat]
        return "inconclusive" if report is None else report.verdict

    def summary_lines(self) -> list[str]:
        """Progress output: one line per attack, then the worst case and the verdict per threat model."""
        lines = [cell.summary() for cell in self.cells]
        for threat, report in (("passive", self.passive), ("active", self.active)):
            if report is None:
                lines.append(f"{threat} server: inconclusive (no attack produced a report)")
                continue
            psnr = report.means["psnr"]
            line = (
                f"{threat} server: worst-case PSNR {'-' if psnr is None else f'{psnr:.1f}'} dB, "
                f"{report.leak_fraction:.0%} of images leak -> {report.verdict}"
            )
            if report.verdict != "private" and report.verdict_reasons:
                line += f" ({'; '.join(report.verdict_reasons)})"
            lines.append(line)
        if self.bound is not None:
            lines.append(self.bound.describe())
        if self.aggregate is not None:
            lines += [cell.summary() for cell in self.aggregate_cells]
            lines.append(
                f"aggregate (secure aggregation): {self.aggregate.leak_fraction:.0%} of {self.aggregate.batch_size} images "
                f"leak -> {self.aggregate.verdict}"
                + (f" ({'; '.join(self.aggregate.verdict_reasons)})" if self.aggregate.verdict_reasons else "")
            )
            if self.aggregate_active is not None:
                active = self.aggregate_active
                lines.append(
                    f"aggregate, malicious server: {active.leak_fraction:.0%} of {active.batch_size} images leak -> "
                    f"{active.verdict}" + (f" ({'; '.join(active.verdict_reasons)})" if active.verdict_reasons else "")
                )
            if self.aggregate_bound is not None:
                lines.append(f"aggregate {self.aggregate_bound.describe()}")
        if self.forbidden:
            lines.append(f"not run under SoK threat model {self.sok_class}: {'; '.join(self.forbidden)}")
        return lines

    def cell(self, attack: str) -> Cell:
        for cell in self.cells:
            if cell.attack == attack:
                return cell
        raise KeyError(
            f"no attack {attack!r} in the audit of {self.setting}; attacks: {[c.attack for c in self.cells]}"
        )


def _not_reconstructed(record: TappedGradient, name: str) -> Reconstruction:
    """What an attack that failed on one client rebuilt: nothing (non-finite images, scored
    "not reconstructed" image by image)."""
    assert record.inputs is not None
    return Reconstruction(torch.full_like(record.inputs, float("nan")), None, attack=name)


def _run_attack(
    name: str,
    kind: AttackKind,
    attacks: Sequence[GradientAttack],
    records: Sequence[TappedGradient],
    model: nn.Module,
    setting: DefenseSetting,
    datamodule: Any,
    secrets: dict[str, Any],
    lpips_fn: nn.Module | None,
    log: Callable[[str], None],
    rule: LeakRule,
    reference: Tensor,
    skip: frozenset[int] = frozenset(),
    *,
    public_data: tuple[Tensor, Tensor] | None,
    labels_known: bool = False,
    label_softmax: str = "auto",
) -> tuple[Cell, list[AttackResult]]:
    """One attack on every client but those in ``skip`` (positions whose images already leaked; they
    score "not reconstructed" in this cell and leave the worst case to the attacks that leaked them).
    ``public_data`` is what the server holds (:func:`~lightning_gp.audit.rounds.public_examples`);
    ``labels_known``: the attack is granted the labels (always under FedAvg's local training);
    ``label_softmax``: where it recovers a batch's labels from (:attr:`ServerView.label_softmax
    <lightning_gp.attacks.view.ServerView>`)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    outcomes, errors, not_applicable = _attack_clients(
        name, attacks, records, model, setting, datamodule, secrets, lpips_fn, log, skip, public_data, rule.tests,
        labels_known=labels_known, label_softmax=label_softmax,
    )  # fmt: skip
    if len(not_applicable) == len(outcomes) - len(skip):  # n/a for every client: it does not apply here
        note = not_applicable[0].split(": n/a: ", 1)[1]
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        return Cell(setting.name, name, kind, "n/a", note, seconds=seconds, cpu_seconds=cpu_seconds), []
    # n/a for some clients only: the others' reconstructions stand, the cell is incomplete
    errors += not_applicable
    # the failed clients' placeholders carry the attack's own name, so its reports concatenate
    attack_name = next((r.report.attack for r in outcomes if isinstance(r, AttackResult)), type(attacks[0]).__name__)
    results = [
        r if isinstance(r, AttackResult) else _failed_result(r, model, attack_name, datamodule, lpips_fn, rule.tests)
        for r in outcomes
    ]
    results, control_errors = with_prior_only_control(attacks, results, rule=rule, reference=reference)
    errors += control_errors
    fallbacks = sorted(
        {
            str(r.reconstruction.meta.get("fallback_reason", ""))
            for r in results
            if r.reconstruction.meta.get("fallback")
        }
    )
    status: CellStatus = "error" if errors else "fallback" if fallbacks else "ok"
    merged = concatenate_reports([r.report for r in results])
    guesses = _guesses(merged, reference)
    skipped = [f"run on {len(records) - len(skip)} of {len(records)} clients (the others' images had leaked)"]
    cell = Cell(
        setting.name,
        name,
        kind,
        status,
        "; ".join(errors or fallbacks or (skipped if skip else [])),
        merged.means,
        rule.leak_fraction(merged, guesses),
        time.perf_counter() - start,
        cpu_seconds=time.process_time() - cpu_start,
    )
    if setting.trained_inputs is not None:
        trained = concatenate_reports(
            [_score_against_trained_inputs(r, setting, datamodule, lpips_fn, rule.tests) for r in results]
        )
        cell.trained_means = trained.means
        cell.trained_leak_fraction = rule.leak_fraction(trained, _guesses(trained, reference))
    return cell, results


def _attack_clients(
    name: str,
    attacks: Sequence[GradientAttack],
    records: Sequence[TappedGradient],
    model: nn.Module,
    setting: DefenseSetting,
    datamodule: Any,
    secrets: dict[str, Any],
    lpips_fn: nn.Module | None,
    log: Callable[[str], None],
    skip: frozenset[int],
    public_data: tuple[Tensor, Tensor] | None,
    tests: RecognitionTests | None,
    *,
    labels_known: bool = False,
    label_softmax: str = "auto",
) -> tuple[list[AttackResult | TappedGradient], list[str], list[str]]:
    """Each client's attack result (its record where the attack failed, did not apply or was skipped),
    the errors and the n/a notes. The clients' problems share one optimisation where the attack allows it
    (:func:`~lightning_gp.audit.engine.attack_records_side_by_side`), else each is attacked on its own."""
    outcomes: list[AttackResult | TappedGradient] = []
    errors: list[str] = []
    not_applicable: list[str] = []
    scoring = Scoring(lpips=lpips_fn is not None, lpips_fn=lpips_fn, tests=tests)
    view_options: dict[str, Any] = dict(
        num_classes=datamodule.num_classes, mean=datamodule.mean, std=datamodule.std, server_secrets=secrets,
        public_data=public_data, label_softmax=label_softmax,
        # label counts from a multi-step FedAvg update are not modelled well enough to trust:
        # the attacker is granted the labels (a stronger attacker, never a weaker one)
        labels_known=labels_known or setting.local_training,
    )  # fmt: skip
    attacked = [p for p in range(len(records)) if p not in skip]
    together = attack_records_side_by_side(
        [records[p] for p in attacked], model, [attacks[p] for p in attacked], scoring=scoring, **view_options
    )
    if together is not None:
        found = dict(zip(attacked, together, strict=True))
        return [found.get(p, record) for p, record in enumerate(records)], errors, not_applicable
    for position, (attack, record) in enumerate(zip(attacks, records)):
        if position in skip:
            outcomes.append(record)
            continue
        try:
            outcomes.append(
                attack_record(
                    record, model, attack, lpips_fn=lpips_fn, lpips=lpips_fn is not None, tests=tests, **view_options
                )
            )
        except AttackNotApplicable as err:  # the attack's own check that it cannot apply (model, loss, batch)
            not_applicable.append(f"client {record.client_id}: n/a: {err}")
            outcomes.append(record)
        except Exception as err:  # loud, and marked: never a silently missing column
            log(f"   {name} FAILED on {setting.name}, client {record.client_id}: {type(err).__name__}: {err}")
            log(traceback.format_exc())
            errors.append(f"client {record.client_id}: {type(err).__name__}: {err}")
            outcomes.append(record)
    return outcomes, errors, not_applicable


def reference_pixels(datamodule: Any, size: int = 1000, images: Tensor | None = None) -> Tensor:
    """Public images the server holds (the test split, :func:`~lightning_gp.audit.rounds.public_batch`;
    ``images`` where the caller loaded them already) as pixels in [0, 1]: their mean image is the
    "dataset mean" guess."""
    images = public_batch(datamodule, size) if images is None else images
    return denormalize(images.detach().float().cpu(), datamodule.mean, datamodule.std)


def _guesses(report: ReconstructionReport, reference: Tensor) -> list[BaselineScores]:
    """The trivial guesses on ``report``'s originals, the public mean image included."""
    if report.original_pixels is None:
        return []
    return trivial_baselines(report.original_pixels, reference_images=reference)


def _server_view(
    record: TappedGradient, model: nn.Module, datamodule: Any, public_data: tuple[Tensor, Tensor] | None = None
) -> ServerView:
    """The server's view of ``record`` on a copy of ``model`` (given the record's weights), matched
    with the loss the client trains with, as :func:`~lightning_gp.audit.engine.attack_record` builds it."""
    return ServerView.from_tap(
        record,
        copy.deepcopy(model),
        num_classes=datamodule.num_classes,
        mean=tuple(datamodule.mean),
        std=tuple(datamodule.std),
        loss_fn=attacker_loss(model),
        public_data=public_data,
    )


def _failed_result(
    record: TappedGradient,
    model: nn.Module,
    name: str,
    datamodule: Any,
    lpips_fn: nn.Module | None,
    tests: RecognitionTests | None,
) -> AttackResult:
    """The result of an attack that raised on ``record``: every image "not reconstructed"."""
    assert record.inputs is not None
    view = _server_view(record, model, datamodule)
    reconstruction = _not_reconstructed(record, name)
    report = reconstruction_report(
        reconstruction,
        record.inputs,
        view,
        true_labels=record.targets,
        lpips=lpips_fn is not None,
        lpips_fn=lpips_fn,
        tests=tests,
    )
    return AttackResult(record, view, reconstruction, report, 0.0)


def _score_against_trained_inputs(
    result: AttackResult,
    setting: DefenseSetting,
    datamodule: Any,
    lpips_fn: nn.Module | None,
    tests: RecognitionTests | None,
) -> ReconstructionReport:
    """One client's reconstruction scored against the images it trained on (ATS-T). An attack that
    estimates both keeps its estimate of the trained images in ``meta["transformed"]``."""
    assert setting.trained_inputs is not None
    trained = setting.trained_inputs(result.record, datamodule)
    reconstruction = result.reconstruction
    if "transformed" in reconstruction.meta:
        reconstruction = Reconstruction(reconstruction.meta["transformed"], reconstruction.labels)
    return reconstruction_report(
        reconstruction,
        trained,
        result.view,
        true_labels=result.record.targets,
        lpips=lpips_fn is not None,
        lpips_fn=lpips_fn,
        tests=tests,
    )


def _threat(attack: GradientAttack) -> ThreatModel:
    return "active" if callable(getattr(attack, "modify_model", None)) else "passive"


def _forbidden(sok_class: SoKThreatModel | None, name: str, attack: GradientAttack | type) -> str | None:
    """Why ``sok_class`` forbids ``attack`` (``None``: it allows it, or no threat model restricts the audit)."""
    if sok_class is None or sok_class.allows(attack_requirements(attack)):
        return None
    return f"{name} needs SoK threat model {threat_class_of(attack).describe()}, beyond {sok_class.describe()}"


def audit_setting(
    setting: DefenseSetting,
    model: nn.Module,
    datamodule: L.LightningDataModule,
    *,
    indices: Sequence[Sequence[int]],
    published: Sequence[AttackSpec],
    budget: AttackBudget = AttackBudget(),
    adaptive: bool = True,
    num_clients: int = 10,
    seed: int = 0,
    lpips_fn: nn.Module | None = None,
    rule: LeakRule | None = None,
    log: Callable[[str], None] = print,
    aggregate: bool = False,
    client_dp: ClientLevelDP | None = None,
    round: int = 0,
    algorithm: Literal["fedsgd", "fedavg"] | None = None,
    local_epochs: int | None = None,
    local_batch_size: int | None = None,
    batchnorm: Literal["train", "eval"] | None = None,
    sok_class: str | None = None,
) -> SettingAudit:
    """Attack the clients of ``setting`` (client ``c`` holds the training images ``indices[c]``,
    the model at ``model``'s weights) with every ``published`` attack and, with ``adaptive``, the
    setting's adaptive attacks (one attacker modelling every defense of it); judge by the worst case
    per threat model. ``lpips_fn=None`` skips LPIPS: the per-image leak rule does not use it (its
    recognisable-image line is the semantic score, which runs without LPIPS; a semantic score that
    cannot run makes the verdict "inconclusive"), only the verdict's mean-LPIPS line goes unchecked.
    ``rule`` is the leak rule (default :class:`~lightning_gp.audit.LeakRule`).

    ``aggregate=True`` adds the secure-aggregation view (module docstring): the published passive
    attacks on the round's mean of the clients' defended updates, every image of every client scored;
    with ``client_dp`` that mean is DP-FedAvg's (each update clipped, the sum noised, divided by the
    number of clients) and its bound is DP-FedAvg's over rounds ``0 .. round`` (that of a deployment
    running DP-FedAvg in every round: the simulation's earlier rounds train without it).


    ``round = r > 0`` attacks round ``r`` after ``r`` rounds of training under the setting, with
    the defenses' state as it is then (:func:`~lightning_gp.audit.rounds.tap_defended_round`);
    audit ``rounds=[0, r]`` with one call per round. At a trained round an active attack is the
    server turning malicious then: it sends its modified model built on the round's weights (round 0
    of a simulation from those weights), where no client defense carries state across rounds
    (:func:`~lightning_gp.audit.rounds.active_replay_blocker`); otherwise it is not run and the
    active verdict names that gap and is never "private". The learned inverter
    (``budget.learned_inversion``) is trained on the server's simulation of round ``r`` at the
    round's weights (:func:`~lightning_gp.audit.learned.learned_inversion_attacks`); where it does not
    run, both verdicts name that gap (:data:`LEARNED_NOT_RUN`).

    ``algorithm``, ``local_epochs``, ``local_batch_size`` and ``batchnorm`` (the mode of the model's
    BatchNorm layers in the clients' passes, which the attackers model) replace the setting's
    (:meth:`~lightning_gp.audit.catalog.DefenseSetting.with_client_training`; the setting's name says
    which): with ``algorithm="fedavg"`` and
    local epochs or batches, client ``c`` trains ``local_epochs`` epochs over its ``indices[c]`` in
    batches of ``local_batch_size`` and shares ``w_global - w_local``; every attack sees that update,
    :class:`~lightning_gp.attacks.FedAvgInversion` (Dimitrov et al., TMLR 2022) simulates the local
    training, and the others treat it as one gradient (the baseline). Under such local training the
    attackers are granted the clients' labels: label counts read from a multi-step update are not yet
    modelled well enough to trust, and a weaker label estimate would err for the defense.

    ``sok_class`` (``"A"`` .. ``"H"``) restricts the audit to one threat model of the SoK of gradient
    inversion (Carletti et al., USENIX Security 2025; :mod:`lightning_gp.attacks.threat_models`): an attack
    needing more than it grants is not run (:attr:`SettingAudit.forbidden`; a restriction, not a gap),
    and under a threat model without active manipulation (``A`` .. ``E``) there is no active verdict.
    ``None`` (the default) runs every attack; each cell still names its class (:attr:`Cell.sok_class`)."""
    restricted = None if sok_class is None else sok_threat_model(sok_class)
    setting = setting.with_client_training(algorithm, local_epochs, local_batch_size, batchnorm)
    rule = rule if rule is not None else LeakRule()
    campaign = _open_campaign(setting, model, datamodule, indices, num_clients, seed, round, lpips_fn, rule, log)
    campaign.stop_when_all_leak = budget.stop_when_all_leak
    campaign.sok_class = restricted
    per_client = _run_gradient_attacks(campaign, published, budget, adaptive=adaptive)
    if budget.learned_inversion:
        _run_learned(campaign, budget, per_client[0] if per_client else [], adaptive=adaptive)
    if budget.generative_prior:
        _run_generative(campaign, budget, adaptive=adaptive)
    return _judged_audit(
        campaign, published, aggregate or client_dp is not None, client_dp, learned=budget.learned_inversion,
        budget=budget, adaptive=adaptive,
    )  # fmt: skip


def _run_gradient_attacks(
    campaign: _Campaign, published: Sequence[AttackSpec], budget: AttackBudget, *, adaptive: bool
) -> list[list[GradientAttack]]:
    """The published attacks and, with ``adaptive``, the setting's adaptive ones (their per-client objects
    returned): the adaptive first under ``stop_when_all_leak``, where once they leak every image the
    published attacks are spared (the order changes no verdict and no leak fraction: a leaked image
    stays leaked)."""
    setting, seed = campaign.setting, campaign.seed
    per_client: list[list[GradientAttack]] = []
    run_adaptive = adaptive and not setting.undefended
    if run_adaptive and budget.stop_when_all_leak:
        per_client = _run_adaptive(campaign, budget)
    for spec in published:
        clients = range(len(campaign.indices))
        campaign.run(spec.name, spec.kind, [spec.build(seed + c, campaign.passive_model) for c in clients])
    if run_adaptive and not budget.stop_when_all_leak:
        per_client = _run_adaptive(campaign, budget)
    elif not adaptive and not setting.undefended:
        campaign.gaps.append("the adaptive attacks were not run (adaptive=False)")
    return per_client


def _open_campaign(
    setting: DefenseSetting,
    model: nn.Module,
    datamodule: Any,
    indices: Sequence[Sequence[int]],
    num_clients: int,
    seed: int,
    round: int,
    lpips_fn: nn.Module | None,
    rule: LeakRule,
    log: Callable[[str], None],
) -> _Campaign:
    """The public reference images, the leak rule calibrated on them (unless ``rule`` has its tests) and
    the passive round tapped: a campaign with no attack run yet."""
    public = public_examples(datamodule)
    reference = reference_pixels(datamodule, images=public[0])
    if rule.tests is None:
        rule = rule.calibrated(datamodule_recognition_tests(datamodule, public, lpips_fn=lpips_fn, log=log))
    passive_records, sent_model, _ = tap_defended_round(
        setting, model, datamodule, indices=indices, num_clients=num_clients, seed=seed, round=round
    )
    return _Campaign(
        setting,
        model,
        datamodule,
        indices,
        num_clients,
        seed,
        round,
        lpips_fn,
        rule,
        log,
        reference,
        public,
        passive_records,
        sent_model,
    )


def _judged_audit(
    campaign: _Campaign,
    published: Sequence[AttackSpec],
    aggregate: bool,
    client_dp: ClientLevelDP | None,
    *,
    learned: bool = False,
    budget: AttackBudget | None = None,
    adaptive: bool = True,
) -> SettingAudit:
    """The audit of the attacks run: the worst case per threat model, the formal bound and, with
    ``aggregate``, the secure-aggregation view (``learned``: the budget asked for the learned
    inverter, which does not attack the aggregate: a gap there; ``budget``: the adaptive attacks' on
    the aggregate, which ``adaptive=False`` leaves out)."""
    setting, cells, results = campaign.setting, campaign.cells, campaign.results
    rule, reference = campaign.rule, campaign.reference
    judged = {
        threat: _judge(threat, cells, results, rule, campaign.threat_gaps(threat), reference)
        for threat in THREAT_MODELS
    }
    bound = _formal_bound(campaign, results)
    restricted = campaign.sok_class
    audit = SettingAudit(
        setting.name,
        cells,
        judged["passive"],
        None if restricted is not None and not restricted.active else judged["active"],
        results,
        bound,
        skipped=campaign.skipped,
        partial=campaign.partial,
        sok_class=None if restricted is None else restricted.id,
        forbidden=campaign.forbidden,
    )
    if aggregate:
        _audit_aggregate(
            audit, campaign, published, client_dp, learned=learned, budget=budget or AttackBudget(), adaptive=adaptive
        )
    return audit


@dataclass
class _Campaign:
    """The attacks of one :func:`audit_setting` call: the round they share and the cells, results and
    gaps they fill, attack by attack."""

    setting: DefenseSetting
    model: nn.Module
    datamodule: Any
    indices: Sequence[Sequence[int]]
    num_clients: int
    seed: int
    round: int
    lpips_fn: nn.Module | None
    rule: LeakRule
    log: Callable[[str], None]
    reference: Tensor
    public: tuple[Tensor, Tensor]  # labelled public images the server holds (label recovery on them)
    passive_records: list[TappedGradient]
    passive_model: nn.Module
    cells: list[Cell] = field(default_factory=list)
    results: dict[str, list[AttackResult]] = field(default_factory=dict)
    gaps: list[str] = field(default_factory=list)
    active_gaps: list[str] = field(default_factory=list)  # what only the active threat model misses
    stop_when_all_leak: bool = False
    skipped: list[str] = field(default_factory=list)
    partial: dict[str, int] = field(default_factory=dict)
    sok_class: SoKThreatModel | None = None
    forbidden: list[str] = field(default_factory=list)
    _labels_disagree: bool | None = None
    _kappas: dict[bytes, float] = field(default_factory=dict)

    def kappa(self, pixels: Tensor, labels: Tensor) -> float:
        """:func:`~lightning_gp.audit.bounds.prior_only_kappa` of the campaign's rule on ``pixels`` with their
        ``labels``, against its reference; measured once per sample (the formal bound and the aggregate
        view's bound are often read on the same images)."""
        digest = hashlib.sha256()
        for t in (pixels, labels):
            t = t.detach().cpu().contiguous()
            digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.numpy().tobytes())
        key = digest.digest()
        if key not in self._kappas:
            lpips_fn = lpips_for_rule(self.rule, self.lpips_fn)
            self._kappas[key] = prior_only_kappa(
                pixels, self.reference, labels=labels, rule=self.rule, lpips_fn=lpips_fn
            )
        return self._kappas[key]

    def forbids(self, name: str, attack: GradientAttack | type) -> bool:
        """Whether the audit's threat model forbids ``attack`` (then noted in ``forbidden`` and logged)."""
        reason = _forbidden(self.sok_class, name, attack)
        if reason is None:
            return False
        self.forbidden.append(reason)
        self.log(f"   {name} on {self.setting.name}: not run: {reason}")
        return True

    def leaked_clients(self) -> frozenset[int]:
        """The positions of the clients every image of which leaks to some passive attack run so far."""
        worst = _judge("passive", self.cells, self.results, self.rule, [], self.reference)
        if worst is None:
            return frozenset()
        leaks, start, out = [row.leaks for row in worst.rows], 0, set()
        for position, images in enumerate(self.indices):
            if all(leaks[start : start + len(images)]):
                out.add(position)
            start += len(images)
        return frozenset(out)

    def _weights_at_round(self) -> nn.Module:
        """The server's model at the audited round: at initialisation for round 0, else with the
        round's trained weights (what every passive record of the round carries)."""
        if not self.round:
            return self.model
        trained = copy.deepcopy(self.model)
        trained.load_state_dict(self.passive_records[0].model_state)
        return trained

    def threat_gaps(self, threat: ThreatModel) -> list[str]:
        """What the verdict of ``threat`` must name as not covered."""
        return self.gaps + (self.active_gaps if threat == "active" else [])

    def run(self, name: str, kind: AttackKind, attacks: list[GradientAttack]) -> None:
        """Run one attack (one object per client) on every client and keep its cell and results; an
        active attack on the round its own model is sent in (at a trained round: built on the round's
        weights, where :func:`~lightning_gp.audit.rounds.active_replay_blocker` allows it)."""
        setting, round = self.setting, self.round
        if self.forbids(name, attacks[0]):
            return
        leaked = self.leaked_clients() if self.stop_when_all_leak else frozenset()
        if len(leaked) == len(self.indices):
            if not self.skipped:
                self.log(f"   every attacked image of {setting.name} leaks: the remaining attacks are not run")
            self.skipped.append(name)
            return
        if leaked:
            self.partial[name] = len(leaked)
        threat = _threat(attacks[0])
        if callable(getattr(attacks[0], "client_models", None)):  # its model differs per client: the aggregate's
            note = "it sends each client its own model and attacks their secure aggregate (aggregate=True)"
            cell = Cell(setting.name, name, kind, "n/a", note, threat=threat, sok_class=threat_class_of(attacks[0]).id)
            self.cells.append(cell)
            return
        blocker = active_replay_blocker(setting, self.passive_records[0]) if threat == "active" and round else None
        if blocker is not None:
            self.log(f"   {name} on {setting.name}: not run at round {round} ({blocker})")
            self.active_gaps.append(f"the active attack {name} was not run at round {round}: {blocker}")
            return
        if threat == "active":  # the server sends its own model this round, built on the weights it holds
            try:
                records, active_model, secrets = tap_defended_round(
                    setting,
                    self._weights_at_round(),
                    self.datamodule,
                    indices=self.indices,
                    num_clients=self.num_clients,
                    attack=attacks[0],
                    seed=self.seed,
                )
            except AttackNotApplicable as err:  # the attack cannot build its model, or the clients refuse it
                self.log(f"   {name} on {setting.name}: n/a ({err})")
                sok = threat_class_of(attacks[0]).id
                self.cells.append(Cell(setting.name, name, kind, "n/a", str(err), threat=threat, sok_class=sok))
                return
            attacks = [attacks[0]] * len(self.indices)  # one malicious model, its secrets shared by every client
        else:
            records, active_model, secrets = self.passive_records, self.passive_model, {}
        self.log(f"   {name} on {setting.name} ...")
        out = self._keep(name, kind, attacks, records, active_model, secrets, leaked, threat)
        if threat == "passive" and any(r.reconstruction.labels is not None for r in out) and self.labels_disagree():
            # the two label estimates differ: each is an attack of its own and the worst case takes both
            # (the public estimate is better on average, not on every batch: it can lose a leak)
            leaked = self.leaked_clients() if self.stop_when_all_leak else frozenset()
            if len(leaked) < len(self.indices):
                dummy = f"{name}{DUMMY_LABELS_SUFFIX}"
                if leaked:
                    self.partial[dummy] = len(leaked)
                self.log(f"   {dummy} on {setting.name} ...")
                self._keep(dummy, kind, attacks, records, active_model, secrets, leaked, threat, "dummy")

    def _keep(
        self,
        name: str,
        kind: AttackKind,
        attacks: list[GradientAttack],
        records: list[TappedGradient],
        model: nn.Module,
        secrets: dict[str, Any],
        leaked: frozenset[int],
        threat: ThreatModel,
        label_softmax: str = "auto",
    ) -> list[AttackResult]:
        """Run one attack as :func:`_run_attack` does and keep its cell and results (``label_softmax``
        ``"dummy"``: the server recovers a batch's labels from dummy inputs, not its public images,
        which the view still holds for an attack's prior)."""
        cell, out = _run_attack(
            name,
            kind,
            attacks,
            records,
            model,
            self.setting,
            self.datamodule,
            secrets,
            self.lpips_fn,
            self.log,
            self.rule,
            self.reference,
            leaked,
            public_data=self.public,
            label_softmax=label_softmax,
        )
        cell.threat = threat
        cell.sok_class = threat_class_of(attacks[0]).id
        self.cells.append(cell)
        if out:
            self.results[name] = out
        return out

    def labels_disagree(self) -> bool:
        """Whether, on some client of several images, the batch's label counts from the public images
        (:func:`~lightning_gp.attacks.label_counts`, ``softmax_from="public"``) differ from those of
        dummy inputs (``"dummy"``, Geng et al.'s estimate). Computed once per audit; never where the
        attackers are granted the labels (FedAvg's local training)."""
        if self.setting.local_training:
            return False
        if self._labels_disagree is None:
            self._labels_disagree = any(_label_estimates_differ(record, self) for record in self.passive_records)
        return self._labels_disagree


def _label_estimates_differ(record: TappedGradient, campaign: _Campaign) -> bool:
    """:func:`~lightning_gp.attacks.label_estimates_differ` on the server's view of ``record``."""
    view = _server_view(record, campaign.passive_model, campaign.datamodule, campaign.public)
    try:
        return label_estimates_differ(view)
    except AttackNotApplicable:  # no classification layer: no attack recovers labels from it either
        return False


def _run_adaptive(campaign: _Campaign, budget: AttackBudget) -> list[list[GradientAttack]]:
    """Run the setting's adaptive attacks, built once per client; those per-client attacks."""
    setting = campaign.setting
    per_client = [
        setting.adaptive_attacks(
            campaign.model,
            campaign.datamodule,
            iterations=budget.ig_iterations,
            lbfgs_iterations=budget.lbfgs_iterations,
            restarts=budget.adaptive_restarts,
            seed=campaign.seed + c,
        )
        for c in range(len(campaign.indices))
    ]
    if not per_client[0]:
        campaign.gaps.append(f"{setting.name} declares no adaptive attack")
    for k in range(len(per_client[0])):
        campaign.run(f"adaptive:{type(per_client[0][k]).__name__}", "adaptive", [a[k] for a in per_client])
    return per_client


def _run_learned(
    campaign: _Campaign, budget: AttackBudget, adaptive_attacks: list[GradientAttack], *, adaptive: bool
) -> None:
    """Run the learned inverter and its refined variant (one object for every client), trained on the
    audited round's behaviour, and log what training each cost; where they cannot run, name the gap
    (:data:`LEARNED_NOT_RUN`) that keeps both verdicts from "private"."""
    setting = campaign.setting
    forbidden = [
        campaign.forbids(f"adaptive:{kind.__name__}", kind) for kind in (LearnedInversion, RefinedLearnedInversion)
    ]
    if any(forbidden):  # both noted; outside the audit's threat model: not trained, and no gap
        return
    why = _learned_not_run(campaign, budget, adaptive)
    attacks = (
        []
        if why is not None
        else _learned_attacks(
            setting,
            campaign.datamodule,
            budget,
            adaptive_attacks,
            campaign.seed,
            campaign.log,
            round=campaign.round,
            num_clients=max(campaign.num_clients, len(campaign.indices)),
        )
    )
    if not attacks:
        why = why or "no learned attack was built"
        campaign.log(f"   LearnedInversion not run on {setting.name}: {why}")
        campaign.gaps.append(LEARNED_NOT_RUN.format(why))
        return
    for attack in attacks:
        campaign.run(f"adaptive:{type(attack).__name__}", "adaptive", [attack] * len(campaign.indices))
    for name in ("adaptive:LearnedInversion", "adaptive:RefinedLearnedInversion"):
        if name in campaign.results:
            cost = campaign.results[name][0].reconstruction.meta.get("training", {})
            campaign.log(f"   {name} on {setting.name}: inverter {_training_summary(cost)}")


def _audit_aggregate(
    audit: SettingAudit,
    campaign: _Campaign,
    published: Sequence[AttackSpec],
    client_dp: ClientLevelDP | None,
    *,
    learned: bool = False,
    budget: AttackBudget,
    adaptive: bool = True,
) -> None:
    """Fill ``audit``'s secure-aggregation views: the passive published attacks and the setting's adaptive
    ones (:func:`_run_aggregate_adaptive`) on the round's combined
    update (:attr:`SettingAudit.aggregate`), and, for the active server, also each published attack
    that sends every client its own model (``client_models``, e.g. :class:`~lightning_gp.attacks.LOKI`)
    on the combination of the updates of the models it sent (:attr:`SettingAudit.aggregate_active`).
    ``learned``: the learned inverter was asked for: it attacks the aggregate too, trained on the mean of
    simulated clients (:func:`~lightning_gp.audit.learned.aggregate_simulator`); where it cannot, a named
    gap. The bound (DP-FedAvg's with ``client_dp``, else the setting's) composes rounds ``0 .. round``: every
    client of the audit's simulation takes part in every round (``q = 1``)."""
    setting, records, model, round = campaign.setting, campaign.passive_records, campaign.passive_model, campaign.round
    combine = None
    cohort = honest_cohort(setting)
    if client_dp is not None:
        round_idx, count = records[0].round, len(records)
        combine = lambda grads: client_dp.noised_mean([client_dp.clip(g) for g in grads], count, round_idx)  # noqa: E731
    elif cohort is not None:
        combine = with_absent_shares(cohort, len(records), campaign.seed)
    combined = aggregate_record(records, combine)
    results: dict[str, list[AttackResult]] = {}
    active_gaps: list[str] = []
    for spec in published:
        attack = spec.build(campaign.seed, model)
        isolating = callable(getattr(attack, "client_models", None))
        if _threat(attack) != "passive" and not isolating:
            continue  # one model sent to every client: its attack is on each client, not on the aggregate
        if (reason := _forbidden(campaign.sok_class, f"{spec.name} on the aggregate", attack)) is not None:
            audit.forbidden.append(reason)
            continue
        target, target_model, secrets = combined, model, cast(dict[str, Any], {})
        if isolating:
            blocker = active_replay_blocker(setting, records[0]) if round else None
            if blocker is not None:
                active_gaps.append(
                    f"the active attack {spec.name} was not run on the aggregate at round {round}: {blocker}"
                )
                continue
            try:
                target, target_model, secrets = _isolated_aggregate(campaign, attack, combine)
            except AttackNotApplicable as err:  # the clients refuse the models it sends (model_checks)
                campaign.log(f"   {spec.name} on the aggregate of {setting.name}: n/a ({err})")
                sok = threat_class_of(attack).id
                audit.aggregate_cells.append(
                    Cell(setting.name, spec.name, spec.kind, "n/a", str(err), threat="active", sok_class=sok)
                )
                continue
        campaign.log(f"   {spec.name} on the aggregate of {setting.name} ...")
        cell, out = _run_attack(
            spec.name, spec.kind, [attack], [target], target_model, setting, campaign.datamodule, secrets,
            campaign.lpips_fn, campaign.log, campaign.rule, campaign.reference, public_data=campaign.public,
        )  # fmt: skip
        cell.sok_class, cell.threat = threat_class_of(attack).id, "active" if isolating else "passive"
        audit.aggregate_cells.append(cell)
        if out:
            results[spec.name] = out
    gaps = _run_aggregate_adaptive(
        audit, campaign, combined, results, budget, client_dp, cohort, adaptive=adaptive, learned=learned
    )
    passive = {c.attack for c in audit.aggregate_cells if c.threat == "passive"}
    passive_results = {k: v for k, v in results.items() if k in passive}
    audit.aggregate = _judge_aggregate(audit, campaign, passive_results, gaps, threats=("passive",))
    if campaign.sok_class is None or campaign.sok_class.active:
        everything = ("passive", "active")
        audit.aggregate_active = _judge_aggregate(audit, campaign, results, [*gaps, *active_gaps], threats=everything)
    bound = (
        FormalBound(client_dp.mechanism(round + 1, 1.0))
        if client_dp is not None
        else setting_bound(setting, model, round=round, aggregate_of=_summed_uploads(cohort, len(records)))
    )
    audit.aggregate_bound = _aggregate_bound_at_kappa(bound, results, combined, campaign)


def honest_cohort(setting: DefenseSetting) -> DistributedGaussianMechanism | None:
    """The distributed Gaussian mechanism that is ``setting``'s one defense, else ``None``. Its secure sum
    also carries the noise shares of the cohort's clients the audit does not attack: the aggregate view
    takes them as honest (they add their shares and keep them secret; their data may be known to the
    server, which then subtracts their updates), the threat model of distributed DP (Kairouz et al.,
    ICML 2021). A server colluding with them sees less noise: the per-client views bound that case."""
    defenses = [setting.declared] if setting.declared is not None else list(setting.callbacks)
    if len(defenses) != 1:
        return None
    inner = getattr(defenses[0], "defense", defenses[0])
    return inner if isinstance(inner, DistributedGaussianMechanism) else None


def _summed_uploads(cohort: DistributedGaussianMechanism | None, present: int) -> int:
    """The uploads whose noise the aggregate of ``present`` clients carries: the whole cohort's for a
    distributed mechanism, else ``present``."""
    return present if cohort is None else max(present, cohort.cohort_size)


def with_absent_shares(
    cohort: DistributedGaussianMechanism, present: int, seed: int
) -> Callable[[list[Gradients]], Gradients]:
    """The secure aggregate of ``present`` clients of ``cohort`` as the server sees it in a round of the
    whole cohort with the others' updates subtracted: the mean of the present clients' uploads plus
    the other clients' noise shares over ``present`` (:meth:`DistributedGaussianMechanism.absent_noise_std`;
    drawn with ``seed``: the same for every call)."""
    std = cohort.absent_noise_std(present) / present

    def combine(updates: list[Gradients]) -> Gradients:
        mean = weighted_mean(updates)
        generator = torch.Generator().manual_seed(seed)
        return {
            n: v + torch.randn(v.shape, generator=generator, dtype=v.dtype).to(v.device) * std for n, v in mean.items()
        }

    return combine


def _run_aggregate_adaptive(
    audit: SettingAudit,
    campaign: _Campaign,
    combined: TappedGradient,
    results: dict[str, list[AttackResult]],
    budget: AttackBudget,
    client_dp: ClientLevelDP | None,
    cohort: DistributedGaussianMechanism | None,
    *,
    adaptive: bool = True,
    learned: bool = False,
) -> list[str]:
    """The setting's adaptive attacks on the secure aggregate: each one's defense knowledge lifted to the
    mean of the round's clients (:meth:`~lightning_gp.attacks.DefenseKnowledge.over_clients`), the
    attacker granted the labels in client order (which client holds which label is what each client's
    clip and pruning act on: a guessed assignment would err for the defense); with ``learned``, the
    learned inverter and its refined variant trained on the aggregate of as many simulated clients
    (matching with the lifted attacks); ``cohort``: the distributed mechanism whose other clients'
    noise shares the aggregate carries (:func:`honest_cohort`). Their cells join
    ``audit.aggregate_cells``, their results ``results``. Returns the gaps that keep the aggregate's verdicts from "private": an adaptive attack
    that does not carry over, a learned inverter asked for and not run."""
    setting = campaign.setting
    why_not_learned = _aggregate_learned_not_run(campaign, budget, client_dp, adaptive)
    gaps = [LEARNED_NOT_RUN.format(why_not_learned or "no learned attack was built")] if learned else []
    if client_dp is not None:
        return [*gaps, "no adaptive attack models DP-FedAvg's clipped, noised mean of the updates"]
    if not adaptive:
        return (
            gaps
            if setting.undefended
            else [*gaps, "the adaptive attacks were not run on the aggregate (adaptive=False)"]
        )
    clients = len(campaign.passive_records)
    shares = _summed_uploads(cohort, clients)
    lifted, unmodelled = ([], []) if setting.undefended else _lifted_adaptive_attacks(campaign, budget, shares)
    learned_attacks: list[GradientAttack] = []
    if learned and why_not_learned is None:
        learned_attacks = _learned_attacks(
            setting, campaign.datamodule, budget, lifted, campaign.seed, campaign.log, round=campaign.round,
            aggregate_of=clients, absent_noise_std=0.0 if cohort is None else cohort.absent_noise_std(clients),
        )  # fmt: skip
        gaps = [] if learned_attacks else gaps
    for attack in [*lifted, *learned_attacks]:
        name = f"adaptive:{type(attack).__name__}"
        if (reason := _forbidden(campaign.sok_class, f"{name} on the aggregate", attack)) is not None:
            audit.forbidden.append(reason)
            continue
        campaign.log(f"   {name} on the aggregate of {setting.name} ...")
        cell, out = _run_attack(
            name, "adaptive", [attack], [combined], campaign.passive_model, setting, campaign.datamodule, {},
            campaign.lpips_fn, campaign.log, campaign.rule, campaign.reference, public_data=campaign.public,
            labels_known=True,
        )  # fmt: skip
        cell.sok_class, cell.threat = threat_class_of(attack).id, "passive"
        audit.aggregate_cells.append(cell)
        if out:
            results[name] = out
    if not setting.undefended and (unmodelled or not lifted):
        why = "; ".join(unmodelled) or f"{setting.name} declares no adaptive attack"
        gaps.append(f"no adaptive attack models the aggregate of {setting.name}: {why}")
    return gaps


def _aggregate_learned_not_run(
    campaign: _Campaign, budget: AttackBudget, client_dp: ClientLevelDP | None, adaptive: bool
) -> str | None:
    """Why the learned inverter cannot attack the secure aggregate of ``campaign`` (``None``: it can)."""
    if client_dp is not None:
        return "the server cannot simulate DP-FedAvg's clipped, noised mean"
    if not adaptive:
        return "adaptive=False (the learned inverter is an adaptive attack)"
    images = len(campaign.passive_records) * min(map(len, campaign.indices))
    if images < budget.learned_min_batch:
        return f"the aggregate holds {images} image(s), below learned_min_batch={budget.learned_min_batch}"
    return simulation_refusal(campaign.setting)


def _lifted_adaptive_attacks(
    campaign: _Campaign, budget: AttackBudget, noise_shares: int
) -> tuple[list[GradientAttack], list[str]]:
    """The setting's adaptive attacks with their defense knowledge lifted to the mean of the round's
    clients (whose sum carries ``noise_shares`` noises), and why each one that does not carry over does not."""
    clients = len(campaign.passive_records)
    attacks = campaign.setting.adaptive_attacks(
        campaign.model,
        campaign.datamodule,
        iterations=budget.ig_iterations,
        lbfgs_iterations=budget.lbfgs_iterations,
        restarts=budget.adaptive_restarts,
        seed=campaign.seed,
    )
    lifted, unmodelled = [], []
    for attack in attacks:
        knowledge = getattr(attack, "knowledge", None)
        if not isinstance(knowledge, DefenseKnowledge) or knowledge.fallback_reason is not None:
            unmodelled.append(f"{type(attack).__name__} is not built on a defense knowledge that carries over")
            continue
        try:
            cast(Any, attack).knowledge = knowledge.over_clients(clients, noise_shares=noise_shares)
        except ValueError as err:
            unmodelled.append(f"{type(attack).__name__}: {err}")
            continue
        lifted.append(attack)
    return lifted, unmodelled


def _judge_aggregate(
    audit: SettingAudit,
    campaign: _Campaign,
    results: dict[str, list[AttackResult]],
    gaps: list[str],
    *,
    threats: tuple[str, ...],
) -> WorstCaseReport | None:
    """The worst case over the aggregate view's ``results``, the gaps of its cells of ``threats`` and
    ``gaps`` included."""
    reports = [concatenate_reports([r.report for r in out]) for out in results.values()]
    cells = [c for c in audit.aggregate_cells if c.threat in threats]
    incomplete = [*gaps, *(g for c in cells if (g := c.gap()) is not None)]
    if not reports:
        return None
    rule = campaign.rule
    return worst_case_report(
        reports,
        leak_thresholds=rule.thresholds,
        noise_ratio_line=rule.noise_ratio_line,
        identification_gate=rule.identification_gate,
        reference_images=campaign.reference,
        incomplete=incomplete,
        threat_model="aggregate",
    )


class _ClientModel:
    """Client ``client``'s model of an attack that sends every client its own (``client_models``), as
    :func:`~lightning_gp.audit.rounds.tap_defended_round` asks an active attack for it."""

    def __init__(self, attack: Any, client: int, clients: int) -> None:
        self.attack, self.client, self.clients = attack, client, clients

    def modify_model(self, model: nn.Module, input_shape: Any, mean: Any, std: Any, **kwargs: Any) -> Any:
        return self.attack.client_models(model, self.clients, input_shape, mean, std, **kwargs)[self.client]


def _isolated_aggregate(
    campaign: _Campaign, attack: Any, combine: Callable[[list[Gradients]], Gradients] | None
) -> tuple[TappedGradient, nn.Module, dict[str, Any]]:
    """The secure aggregate of a round in which ``attack`` sent each audited client its own model: each
    client tapped with its model (its defenses as in any round), the updates combined as the honest
    round's are; the aggregate, one client's model (one architecture for all) and the secrets."""
    clients = len(campaign.indices)
    records: list[TappedGradient] = []
    sent: nn.Module | None = None
    secrets: dict[str, Any] = {}
    for client, images in enumerate(campaign.indices):
        tapped, sent_model, secrets = tap_defended_round(
            campaign.setting,
            campaign._weights_at_round(),
            campaign.datamodule,
            indices=[images],
            num_clients=campaign.num_clients,
            attack=cast(GradientAttack, _ClientModel(attack, client, clients)),
            seed=campaign.seed + client,
        )
        records += tapped
        sent = sent if sent is not None else sent_model
    assert sent is not None
    return aggregate_record(records, combine), sent, secrets


def _aggregate_bound_at_kappa(
    bound: FormalBound, results: dict[str, list[AttackResult]], combined: TappedGradient, campaign: _Campaign
) -> FormalBound:
    """The aggregate view's ``bound`` at the kappa of the campaign's rule on every image of the aggregate
    and more training images (:func:`_kappa_sample`)."""
    scored = next(iter(results.values()), None)
    originals = None if not scored else concatenate_reports([r.report for r in scored]).original_pixels
    if bound.mechanism is None or originals is None or combined.targets is None:
        return bound
    pixels, labels = _kappa_sample(campaign.datamodule, originals, combined.targets, campaign.seed)
    return bound.at(campaign.kappa(pixels, labels))


def _formal_bound(campaign: _Campaign, results: dict[str, list[AttackResult]]) -> FormalBound:
    """The setting's ReRo bound over rounds ``0 .. campaign.round`` at the kappa of the campaign's rule on
    the audited images and more training images (:func:`_kappa_sample`; none without a mechanism)."""
    bound = setting_bound(campaign.setting, campaign.model, round=campaign.round)
    scored = next(iter(results.values()), None)
    if bound.mechanism is None or not scored:
        return bound
    originals = concatenate_reports([r.report for r in scored]).original_pixels
    if originals is None:
        return bound
    # the labels of the images scored (an attack spared on clients whose images had leaked scored fewer)
    labels = torch.cat([r.record.targets.reshape(-1) for r in scored if r.record.targets is not None])
    pixels, labels = _kappa_sample(campaign.datamodule, originals, labels, campaign.seed)
    return bound.at(campaign.kappa(pixels, labels))


def _kappa_sample(datamodule: Any, originals: Tensor, labels: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """The images kappa is measured on: the audited ``originals`` (pixels) with their ``labels``, then
    training images drawn with ``seed`` up to :data:`~lightning_gp.audit.bounds.KAPPA_IMAGES` (every one
    where the training set is smaller; the bound's kappa is then the less certain)."""
    if labels.is_floating_point() or labels.numel() != originals.shape[0]:
        return originals, labels  # soft labels: the audited images alone, as before
    labels = labels.reshape(-1).long().cpu()
    wanted = KAPPA_IMAGES - originals.shape[0]
    if wanted <= 0:
        return originals, labels
    try:
        extra, extra_labels = training_examples(datamodule, wanted + originals.shape[0], seed)
    except ValueError:  # labels that are not one class each: the audited images alone
        return originals, labels
    extra_pixels = denormalize(extra, datamodule.mean, datamodule.std).clamp(0, 1)
    # a drawn image equal to an audited one would be counted twice
    gaps = (extra_pixels.flatten(1)[:, None, :] - originals.cpu().flatten(1)[None]).abs().amax(-1)
    keep = ~(gaps < 1e-4).any(-1)
    extra_pixels, extra_labels = extra_pixels[keep][:wanted], extra_labels[keep][:wanted]
    return torch.cat([originals.cpu(), extra_pixels]), torch.cat([labels, extra_labels])


def _learned_attacks(
    setting: DefenseSetting,
    datamodule: Any,
    budget: AttackBudget,
    adaptive: list[GradientAttack],
    seed: int,
    log: Callable[[str], None],
    *,
    round: int = 0,
    num_clients: int = 10,
    aggregate_of: int | None = None,
    absent_noise_std: float = 0.0,
) -> list[GradientAttack]:
    """The learned inverter and its refined variant of ``setting`` (one object each for every
    client: the inverter is trained once, with the audit's seed), trained on the clients' behaviour
    at round ``round`` in rounds of ``num_clients`` clients (``aggregate_of=K``: on the secure
    aggregate of ``K`` clients); none, with the reason logged, where the server cannot replay the setting."""
    refusal = simulation_refusal(setting)
    if refusal is not None:
        log(f"   LearnedInversion not run on {setting.name}: {refusal}")
        return []
    config = InverterConfig(max_epochs=budget.learned_max_epochs)
    # the refinement is Adam gradient matching: never more steps than the budget's Adam attacks get
    refine = min(REFINE_ITERATIONS, budget.ig_iterations)
    return learned_inversion_attacks(
        setting,
        datamodule,
        adaptive=adaptive,
        num_clients=num_clients,
        config=config,
        refine_iterations=refine,
        refined_decoys=budget.refined_decoys,
        seed=seed,
        round=round,
        aggregate_of=aggregate_of,
        absent_noise_std=absent_noise_std,
    )


#: The gap a verdict names where the generative prior was asked for and did not run.
GENERATIVE_NOT_RUN = "the generative prior was asked for (generative_prior=True) but not run: {}"
#: Public (test-split) images the generative prior's GAN trains on (at most; fewer where the split is smaller).
GENERATIVE_PUBLIC_SIZE = 10_000


def _run_generative(campaign: _Campaign, budget: AttackBudget, *, adaptive: bool) -> None:
    """The generative prior (GGL) with the setting's defense knowledge, one object for every client (its
    generator trained once on the public split, its decoys shared); where it cannot run, the gap that
    keeps both verdicts from "private" (:data:`GENERATIVE_NOT_RUN`)."""
    name, setting = "adaptive:GenerativeGradientLeakage", campaign.setting
    if campaign.forbids(name, GenerativeGradientLeakage):
        return
    knowledge, why = None, None if adaptive else "adaptive=False (the defense-aware generative prior is adaptive)"
    if why is None and not setting.undefended:
        try:
            knowledge = composed_knowledge(setting.defenses(campaign.model, campaign.datamodule))
        except ValueError as err:
            why = str(err)
    if why is not None:
        campaign.log(f"   GenerativeGradientLeakage not run on {setting.name}: {why}")
        campaign.gaps.append(GENERATIVE_NOT_RUN.format(why))
        return
    clients = max(campaign.num_clients, len(campaign.indices))
    simulate = None
    if simulation_refusal(setting) is None:
        simulate = setting_simulator(setting, num_clients=clients, round=campaign.round)
    size = min(GENERATIVE_PUBLIC_SIZE, len(cast(Any, campaign.datamodule).test_dataset))
    attack = GenerativeGradientLeakage(
        knowledge=knowledge,
        public_data=public_examples(campaign.datamodule, size),
        generator_config=GeneratorConfig(max_steps=budget.generative_max_steps),
        iterations=budget.ig_iterations,
        simulate=simulate,
        defense_key=f"{setting.name}|{[repr(cb) for cb in setting.callbacks]}|round={campaign.round}|clients={clients}",
        prior_seed=campaign.seed,
        seed=campaign.seed,
    )
    campaign.run(name, "adaptive", [attack] * len(campaign.indices))


def _learned_not_run(campaign: _Campaign, budget: AttackBudget, adaptive: bool) -> str | None:
    """Why the learned inverter the budget asks for cannot run in ``campaign`` (``None``: it can)."""
    if not adaptive:
        return "adaptive=False (the learned inverter is an adaptive attack)"
    smallest = min(map(len, campaign.indices))
    if smallest < budget.learned_min_batch:
        return (
            f"a client holds {smallest} image(s), below learned_min_batch={budget.learned_min_batch} "
            "(lower it to run the inverter on these clients)"
        )
    return simulation_refusal(campaign.setting)


def _training_summary(cost: dict[str, Any]) -> str:
    if not cost:
        return "cost not recorded"
    return (
        f"trained in {cost['seconds']:.0f} s ({cost['cpu_seconds']:.0f} CPU s; {cost['simulation_seconds']:.0f} s "
        "simulating the defense), "
        f"{cost['samples']} training pairs, {cost['epochs']} epochs, validation MSE {cost['validation_mse']:.4f}, "
        f"{cost['stopped']}"
    )


def _judge(
    threat: ThreatModel,
    cells: Sequence[Cell],
    results: dict[str, list[AttackResult]],
    rule: LeakRule,
    gaps: Sequence[str],
    reference: Tensor,
) -> WorstCaseReport | None:
    """The worst case of one threat model: the passive cells, or every cell for the active server."""
    chosen = [c for c in cells if threat == "active" or c.threat == "passive"]
    reports = [concatenate_reports([r.report for r in results[c.attack]]) for c in chosen if c.attack in results]
    if not reports:
        return None
    incomplete = [*gaps, *(g for c in chosen if (g := c.gap()) is not None)]
    if threat == "active" and not any(c.threat == "active" for c in chosen):
        incomplete.append("no active attack was run")
    return worst_case_report(
        reports,
        leak_thresholds=rule.thresholds,
        noise_ratio_line=rule.noise_ratio_line,
        identification_gate=rule.identification_gate,
        reference_images=reference,
        incomplete=incomplete,
        threat_model=threat,
    )
