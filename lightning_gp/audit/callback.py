"""``PrivacyAudit``: attack what clients really share during a user's own training, and log the scores.

client batch -> defenses -> **shared gradient** -> PrivacyAudit (copy) -> ServerView -> attacks -> reports -> logger

The callback is an observer on the shared-gradient pipeline (like
:class:`~lightning_gp.callbacks.GradientTap`): at the chosen steps (rounds) it keeps a copy of the
chosen clients' shared gradient (after every defense), the weights it was computed at and the
client's batch. After the optimizer step (``on_train_batch_end``, outside the training
computation) it builds the server's view the way the audit does
(:func:`~lightning_gp.audit.attack_record`: a deep copy of the model given the round's weights),
runs each attack, scores it (:func:`~lightning_gp.metrics.reconstruction_report`) and takes the
worst case over the attacks (:func:`~lightning_gp.audit.worst_case_report`). Metrics go to
every logger of the trainer (``log_metrics`` at the audited step), a figure per audited gradient
(:func:`~lightning_gp.audit.figure.save_audit_figure`: the verdict, the leak rule, each image's worst
case) and the run's one-screen ``summary.md`` (:mod:`~lightning_gp.audit.summary`: is this run's
setting private, and why) to ``<log_dir>/privacy_audit/`` (the figures also to TensorBoard's
``add_image`` when a ``TensorBoardLogger`` is attached).

The run is not changed: the attacks work on copies of the model, gradient and batch, and the
torch (CPU and CUDA), numpy and Python ``random`` generator states are saved before the audit and
restored after it, so the weights after training are bit-identical to a run without the callback.

What is attacked is what the runner shares: a gradient on the local and DDP paths and in FedSGD;
in a FedAvg simulation (``local_steps > 1``) the shared update of several local steps, which the
default attacks treat as one gradient (``ServerView.meta`` says which algorithm produced it).

Paths: the local path (one process is one client, id 0) and
:class:`~lightning_gp.federated.FederatedSimulation` (client ids of the simulation; a client not
sampled in an audited round shares nothing then, which is reported at the end of the fit). Under
DDP each rank is one client and audits its own shared gradient when its rank is in ``clients``;
Lightning's loggers write on rank 0 only, so other ranks' scores stay in ``results`` of that
rank's callback.

Threat models: the callback audits the **passive** server (it attacks what the run really
shares, with the published attacks given and the adaptive attack of the run's defenses). An active
server sends a modified model, which an observer of the user's own run cannot do: the logged
active verdict is "inconclusive" with that reason; :func:`~lightning_gp.audit.audit_setting` (the
matrix, the demo) and ``lightning-gp attack`` with an active attack audit it.

Import it as ``lightning_gp.audit.PrivacyAudit``.
"""

from __future__ import annotations

import functools
import math
import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn

from lightning_gp.attacks import (
    IDLG,
    AttackNotApplicable,
    GradientAttack,
    InvertingGradients,
    Reconstruction,
    adaptive_attacks_of,
    has_adaptive_attack,
    label_estimates_differ,
)
from lightning_gp.attacks.monitor import HEARTBEAT_SECONDS, AttackInterrupted, monitored
from lightning_gp.attacks.view import checked_public_data
from lightning_gp.audit.bounds import FormalBound, defense_mechanism, lpips_for_rule, prior_only_kappa
from lightning_gp.audit.engine import AttackResult, attack_record
from lightning_gp.audit.figure import save_audit_figure
from lightning_gp.audit.recognition import check_served_normalization, recognition_tests, uses_shipped_semantic_test
from lightning_gp.audit.rounds import NoPublicSplitError, public_examples
from lightning_gp.audit.summary import Candidate, combined_verdict, summary_markdown
from lightning_gp.audit.verdict import (
    LEAK_THRESHOLDS,
    NOISE_RATIO_LINE,
    VERDICT_THRESHOLDS,
    LeakRule,
    WorstCaseReport,
    check_verdict_thresholds,
    worst_case_report,
)
from lightning_gp.callbacks import DPSGD
from lightning_gp.callbacks.base import SharedGradientObserver
from lightning_gp.callbacks.tap import StepBatches, tapped_record
from lightning_gp.metrics import ReconstructionReport, reconstruction_report
from lightning_gp.metrics.recognition import RecognitionTests
from lightning_gp.pipeline.stages import ClientSetup, DefenseStage, StageCall
from lightning_gp.records import TappedGradient
from lightning_gp.validation import check_bool, check_int, check_int_list, check_number

#: Metrics logged per attack and for the worst case (LPIPS and the noise ratio when computed).
LOGGED_METRICS = ("psnr", "ssim", "lpips", "noise_ratio")


#: The adaptive attacks' default budget in an audit (small: audits run during training).
DEFAULT_ADAPTIVE_BUDGET = {"iterations": 200, "lbfgs_iterations": 30}


def default_attacks(batch_size: int) -> list[GradientAttack]:
    """The audit's default attackers, on a small budget: iDLG for one image, else Inverting Gradients."""
    if batch_size == 1:
        return [IDLG(iterations=30)]
    return [InvertingGradients(iterations=200)]


#: Why the callback's active verdict is always "inconclusive".
ACTIVE_NOT_AUDITED = (
    "PrivacyAudit observes the run's real rounds, where the server sent the real model; a malicious server's "
    "modified model is audited by audit_setting (the matrix, the demo) or lightning-gp attack with an active attack"
)


@dataclass
class AuditResult:
    """One audited shared gradient: each attack's result and the passive server's worst case.

    Attributes:
        attacks: the results of the attacks that ran (n/a and failed attacks are in ``skipped``).
        worst: the worst case over them (the passive threat model; ``worst.verdict_reasons`` says why
            a verdict is "inconclusive").
        skipped: attack -> why it has no result ("n/a: ..." or "error: ...").
        active_verdict: always "inconclusive"; ``active_reason`` says why (:data:`ACTIVE_NOT_AUDITED`).
        labels_granted: why the attackers were given the true labels although ``labels_known=False``
            (a batch with more images than classes), else None.
    """

    round: int
    client_id: int
    attacks: list[AttackResult]
    worst: WorstCaseReport
    metrics: dict[str, float]
    image_path: Path | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    active_verdict: str = "inconclusive"
    active_reason: str = ACTIVE_NOT_AUDITED
    labels_granted: str | None = None


def _logged_accuracy(trainer: pl.Trainer) -> float | None:
    """The run's last logged validation accuracy (``val_acc``), if any."""
    value = trainer.callback_metrics.get("val_acc")
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


class _RandomState:
    """The global generators' states (torch CPU and CUDA, numpy, Python ``random``), restorable."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = (
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self.numpy = np.random.get_state()
        self.python = random.getstate()

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


class PrivacyAudit(SharedGradientObserver):
    """Attack the chosen clients' shared gradients at chosen steps of a run and log how much leaks.

    Args:
        rounds: the rounds (optimizer steps; rounds of a ``FederatedSimulation``) to audit.
        clients: the client ids to audit (0 on the local path; the rank under DDP).
        attacks: the attackers (``GradientAttack`` instances), all run on every audited gradient;
            ``None``: :func:`default_attacks` for the batch size (iDLG for one image, else
            Inverting Gradients, small budgets).
        num_classes, mean, std: what the server knows (classes; the inputs' per-channel
            normalisation); ``None`` takes them from the datamodule (``trainer.datamodule``, or
            the simulation's ``source_datamodule``).
        labels_known: the threat model grants the server the client's labels. Without it, a batch of
            more images than classes (labels repeat; recovery from the gradient assumes distinct
            labels) is audited with the true labels granted, said in ``AuditResult.labels_granted``.
        public_data: labelled images the server holds, never a client's: ``(inputs, labels)``, inputs
            normalised like the training batches (e.g. :func:`~lightning_gp.audit.rounds.public_examples`
            of the datamodule: its test split). Batch label recovery measures the model's per-class
            softmax on them (:func:`~lightning_gp.attacks.label_counts`); without them it uses random
            inputs, which on a trained model gets labels wrong and so errs in the defense's favour.
        loss_fn: the loss the client trains with, which the attacker matches with; ``None``: the
            LightningModule's (or its wrapped model's) ``loss_fn`` attribute, else cross-entropy with
            a warning at fit start (a guessed loss is a wrong attack: pass it when you train with another).
        lpips: score LPIPS (needs the pretrained weights, see :mod:`lightning_gp.metrics.lpips`).
        noise_ratio: score Refiner's noise ratio (n/a for channel counts without a shipped network).
            It is part of the leak rule (its paired clean-image test): off or n/a, no verdict reads
            "private" ("inconclusive", naming it) unless the rule is stated without it,
            ``noise_ratio_line=None``.
        thresholds, leak_thresholds, noise_ratio_line, max_leak_fraction: the verdict's mean
            thresholds and leak rule (see :func:`~lightning_gp.audit.worst_case_report` and
            :class:`~lightning_gp.audit.LeakRule`).
        tests: the recognisable-image tests of the data (semantic and identification,
            :func:`~lightning_gp.audit.recognition.recognition_tests`); ``None``: calibrated at fit start
            on ``public_data``, else on the datamodule's test split (the shipped semantic test for
            Fashion-MNIST, one fitted on the public images otherwise). Without public images both are
            missing and no verdict reads "private".
        adaptive: also run the adaptive attack of the run's defenses, all of them together in the
            order the client applies them (:func:`~lightning_gp.attacks.adaptive_attacks_of` of a
            defending module such as ``RefinerModule``, then each defense callback and DP-SGD), so the
            worst case covers the attacker who knows the defense; ``adaptive_budget`` is its budget
            (``iterations``, ``lbfgs_iterations``, ``restarts``). With ``adaptive=False`` a defended
            run's verdict is "inconclusive" at best.
        save_images: write a figure per audited gradient, ``step{s}_client{c}.png``
            (:func:`~lightning_gp.audit.figure.save_audit_figure`: the verdict and the leak rule in the
            title, up to 16 originals over their worst-case reconstruction, framed red where they leak).
        save_summary: write the run's one-screen ``summary.md`` (updated after every audited gradient;
            ``summary_rank{r}.md`` per rank under DDP): the run's verdict over every audited gradient,
            why, and a row per audited gradient (:func:`~lightning_gp.audit.summary.summary_markdown`).
            ``None``: as ``save_images``.
        dirpath: where the figures and the summary go (default ``<logger.log_dir>/privacy_audit``, or
            the trainer's ``default_root_dir`` without a logger).
        prefix: the logged metrics' name prefix.
        progress_seconds: while an attack runs, print a line (the attack, its iteration and objective)
            at least this often; ``None``: silent. An audit stops at the attack's next iteration once
            the Trainer received SIGTERM (Lightning's ``SIGTERMException`` ends the fit); Ctrl-C
            (SIGINT) interrupts it at once.

    Logged per audited gradient (at the audited step), for each attack ``A`` and for ``passive``
    (the worst case over them): ``{prefix}/client{c}/{A}/{psnr,ssim,lpips,noise_ratio,leak_fraction}``,
    plus for each threat model ``T`` in ``passive``, ``active``: ``{prefix}/client{c}/{T}/private``
    (1 private, else 0) and ``{prefix}/client{c}/{T}/inconclusive`` (1 when the audit is incomplete), and
    ``{prefix}/client{c}/baseline_blank/psnr`` (and ``baseline_dataset_mean/psnr``: a constant image
    of the known per-channel mean). ``results`` keeps every :class:`AuditResult`.
    """

    def __init__(
        self,
        rounds: int | Sequence[int] = 0,
        clients: int | Sequence[int] = 0,
        attacks: Sequence[GradientAttack] | None = None,
        *,
        num_classes: int | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        labels_known: bool = False,
        public_data: tuple[Tensor, Tensor] | None = None,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        lpips: bool = True,
        noise_ratio: bool = True,
        thresholds: Mapping[str, float] = VERDICT_THRESHOLDS,
        leak_thresholds: Mapping[str, float] = LEAK_THRESHOLDS,
        noise_ratio_line: float | None = NOISE_RATIO_LINE,
        max_leak_fraction: float = 0.0,
        tests: RecognitionTests | None = None,
        adaptive: bool = True,
        adaptive_budget: Mapping[str, int] | None = None,
        save_images: bool = True,
        save_summary: bool | None = None,
        dirpath: str | Path | None = None,
        prefix: str = "privacy_audit",
        progress_seconds: float | None = HEARTBEAT_SECONDS,
    ) -> None:
        self.rounds = check_int_list(rounds, "rounds")
        if progress_seconds is not None:
            check_number(progress_seconds, "progress_seconds", low=0.0, low_open=True)
        self.progress_seconds = progress_seconds
        self.clients = check_int_list(clients, "clients")
        if attacks is not None:
            attacks = list(attacks)
            if not attacks:
                raise ValueError("attacks must hold at least one GradientAttack (or be None for the defaults)")
            for i, attack in enumerate(attacks):
                if not isinstance(attack, GradientAttack):
                    raise TypeError(f"attacks[{i}] must be a GradientAttack instance, got {type(attack).__name__}")
        self.attacks = attacks
        self.num_classes = None if num_classes is None else check_int(num_classes, "num_classes", low=2)
        self.mean = None if mean is None else tuple(float(v) for v in mean)
        self.std = None if std is None else tuple(float(v) for v in std)
        self.labels_known = check_bool(labels_known, "labels_known")
        self.public_data = checked_public_data(public_data, num_classes=self.num_classes)
        self._warned_labels = False
        self.lpips = check_bool(lpips, "lpips")
        self.noise_ratio = check_bool(noise_ratio, "noise_ratio")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (loss(logits, targets)), got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self._loss_fn: Callable[[Tensor, Tensor], Tensor] | None = loss_fn
        self.thresholds = check_verdict_thresholds(thresholds)
        rule = LeakRule(leak_thresholds, noise_ratio_line)
        self.rule = rule if tests is None else rule.calibrated(tests)
        self.leak_thresholds = dict(self.rule.thresholds)
        self.max_leak_fraction = float(check_number(max_leak_fraction, "max_leak_fraction", low=0.0, high=1.0))
        self.adaptive = check_bool(adaptive, "adaptive")
        self.adaptive_budget = dict(DEFAULT_ADAPTIVE_BUDGET if adaptive_budget is None else adaptive_budget)
        unknown = sorted(set(self.adaptive_budget) - {"iterations", "lbfgs_iterations", "restarts"})
        if unknown:
            raise ValueError(f"adaptive_budget takes iterations, lbfgs_iterations and restarts, got {unknown}")
        for key, value in self.adaptive_budget.items():
            check_int(value, f"adaptive_budget[{key!r}]", low=1)
        self._adaptive_attacks: list[GradientAttack] = []
        self._defended = False
        self._defenses: list[Any] = []
        self.save_images = check_bool(save_images, "save_images")
        self.save_summary = self.save_images if save_summary is None else check_bool(save_summary, "save_summary")
        self.summary_path: Path | None = None
        self._setting = "no defense"
        self.dirpath = None if dirpath is None else Path(dirpath)
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
        self.prefix = prefix
        self.results: list[AuditResult] = []
        self._pending: list[tuple[TappedGradient, nn.Module]] = []
        self.batches = StepBatches()
        self._lpips_fn: nn.Module | None = None
        self._server: tuple[int, tuple[float, ...], tuple[float, ...]] | None = None

    # ------------------------------------------------------------------ pipeline
    def wants(self, client_id: int, round: int) -> bool:
        return client_id in self.clients and round in self.rounds

    def bind(self, setup: ClientSetup) -> None:
        never = [c for c in self.clients if c >= setup.num_clients]
        if never:
            raise ValueError(
                f"PrivacyAudit(clients={self.clients}): client(s) {never} never share a gradient: this run has "
                f"{setup.num_clients} client(s), ids 0..{setup.num_clients - 1} (on the local path the one client is 0; "
                "under DDP the client id is the rank)"
            )
        self.batches.given = setup.passes_client_batches

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        max_steps = trainer.max_steps
        if max_steps is not None and max_steps >= 0:
            outside = [s for s in self.rounds if s >= max_steps]
            if outside:
                raise ValueError(
                    f"PrivacyAudit(rounds={self.rounds}): round(s) {outside} are outside this run, which stops after "
                    f"max_steps={max_steps} (steps 0..{max_steps - 1})"
                )
        else:
            self._check_estimated_steps(trainer)
        past = [s for s in self.rounds if s < trainer.global_step]
        if past:
            warnings.warn(
                f"PrivacyAudit: step(s) {past} were run before this fit started (resumed at step "
                f"{trainer.global_step}); they will not be audited",
                stacklevel=2,
            )
        self._server = self._server_knowledge(trainer, pl_module)
        self._loss_fn = self._client_loss(pl_module)
        defenses = self._run_defenses(trainer, pl_module)
        self._defended = bool(defenses)
        self._setting = " + ".join(type(d).__name__ for d in defenses) or "no defense"
        self._defenses = defenses
        self._adaptive_attacks = self._declared_adaptive_attacks(defenses) if self.adaptive else []
        if self.lpips and self._lpips_fn is None:  # fail at fit start, not mid-run, without LPIPS weights
            state = _RandomState()  # building a network draws initial weights from the global generator
            try:
                from lightning_gp.metrics.lpips import LPIPS

                self._lpips_fn = LPIPS()
            finally:
                state.restore()
        if self.rule.tests is None:
            self.rule = self.rule.calibrated(self._recognition_tests(trainer, pl_module))
            self.leak_thresholds = dict(self.rule.thresholds)

    def _recognition_tests(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> RecognitionTests:
        """The recognisable-image tests calibrated on ``public_data``, else on the datamodule's public
        (test) split; without either, both tests are missing and said why (no verdict reads "private")."""
        assert self._server is not None
        datamodule = getattr(trainer, "datamodule", None) or getattr(pl_module, "source_datamodule", None)
        why = (
            "PrivacyAudit has no public images to calibrate it on: pass public_data=(inputs, labels), tests=..., "
            "or use a datamodule with a test split"
        )
        state = _RandomState()  # fitting a semantic test draws from the global generator
        try:
            public = (
                self.public_data if self.public_data is not None or datamodule is None else public_examples(datamodule)
            )
            if public is not None:
                _, mean, std = self._server  # the normalisation the server knows, as the attacks use it
                return recognition_tests(
                    public,
                    mean,
                    std,
                    shipped_semantic=datamodule is not None and uses_shipped_semantic_test(datamodule),
                    lpips_fn=self._lpips_fn,
                    name="public_data" if self.public_data is not None else "mean, std (of the datamodule)",
                )
        except NoPublicSplitError as err:
            why = f"{err}; pass PrivacyAudit(public_data=(inputs, labels)) or tests=..."
        finally:
            state.restore()
        return RecognitionTests(None, None, {"semantic": why, "identification": why}, source="none")

    def _client_loss(self, pl_module: pl.LightningModule) -> Callable[[Tensor, Tensor], Tensor] | None:
        """The loss the client trains with: given, else the module's (or its wrapped model's) ``loss_fn``;
        ``None`` (cross-entropy, warned) when neither is known."""
        if self.loss_fn is not None:
            return self.loss_fn
        for owner in (pl_module, getattr(pl_module, "module", None), getattr(pl_module, "model", None)):
            found = getattr(owner, "loss_fn", None)
            if callable(found):
                return found
        warnings.warn(
            f"PrivacyAudit: {type(pl_module).__name__} has no loss_fn attribute, so the attacker matches with "
            "cross-entropy; if the client trains with another loss, pass PrivacyAudit(loss_fn=...)",
            stacklevel=2,
        )
        return None

    def _run_defenses(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Any]:
        """The run's defenses in the order the client applies them: a defending module (or the module a
        ``FederatedSimulation`` wraps), then every defense callback and DP-SGD."""
        candidates: list[Any] = [pl_module, getattr(pl_module, "module", None)]
        candidates += [cb for cb in trainer.callbacks if cb is not self]  # type: ignore[attr-defined]
        return [c for c in candidates if c is not None and (isinstance(c, DefenseStage) or has_adaptive_attack(c))]

    def _declared_adaptive_attacks(self, defenses: Sequence[Any]) -> list[GradientAttack]:
        """The adaptive attack of ``defenses``, modelled together (an unmodelled one makes it a marked
        fallback, with a warning)."""
        if not defenses:
            return []
        state = _RandomState()  # building attacks must not move the run's random streams
        try:
            return adaptive_attacks_of(list(defenses), **self.adaptive_budget)
        finally:
            state.restore()

    def _check_estimated_steps(self, trainer: pl.Trainer) -> None:
        """Without ``max_steps``, warn about steps past Lightning's estimate of the run's length."""
        try:
            estimate = trainer.estimated_stepping_batches
        except Exception:  # no sized dataloader: the length is unknown, nothing to check
            return
        if isinstance(estimate, (int, float)) and math.isfinite(estimate):
            outside = [s for s in self.rounds if s >= estimate]
            if outside:
                warnings.warn(
                    f"PrivacyAudit(rounds={self.rounds}): round(s) {outside} are past the estimated end of this run "
                    f"({int(estimate)} optimizer steps); they will not be audited unless the run goes on longer",
                    stacklevel=2,
                )

    def _server_knowledge(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[int, tuple[float, ...], tuple[float, ...]]:
        sources = [getattr(trainer, "datamodule", None), getattr(pl_module, "source_datamodule", None)]

        def find(value: Any, attribute: str) -> Any:
            if value is not None:
                return value
            for source in sources:
                found = getattr(source, attribute, None)
                if found is not None:
                    return found
            raise ValueError(
                f"PrivacyAudit needs {attribute} (what the server knows of the data): pass {attribute}=... or use a "
                f"datamodule with a {attribute!r} attribute"
            )

        if self.mean is None or self.std is None:  # read off the datamodule: its images must be standardised by them
            for source in sources:
                if source is not None:
                    check_served_normalization(source, "the datamodule")
        num_classes = check_int(find(self.num_classes, "num_classes"), "num_classes", low=2)
        mean = tuple(float(v) for v in find(self.mean, "mean"))
        std = tuple(float(v) for v in find(self.std, "std"))
        return num_classes, mean, std

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        self.batches.keep(step, batch, wanted=self.wants(trainer.global_rank, step))

    def observe(self, gradients: Mapping[str, Tensor], call: StageCall) -> None:
        client_id, round, model, batch, meta = call.client_id, call.round, call.model, call.batch, call.meta
        if not self.wants(client_id, round):
            return
        batch = self.batches.take(round, batch)
        record = tapped_record(gradients, client_id=client_id, round=round, model=model, batch=batch, meta=meta)
        if record.inputs is None or record.targets is None:
            raise ValueError(
                f"PrivacyAudit has no client batch for client {client_id} at step {round} (path "
                f"{meta.get('path', '?')!r}): scoring a reconstruction needs the client's (inputs, targets), as a "
                "GradientTap with record_data=True keeps them; this runner handed none and none was seen in "
                "on_train_batch_start"
            )
        self._pending.append((record, model))

    # ------------------------------------------------------------------ the audit, after the step
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._run_pending(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run_pending(trainer)
        audited = {(r.round, r.client_id) for r in self.results}
        missing = [
            (s, c) for s in self.rounds for c in self.clients if (s, c) not in audited and s < trainer.global_step
        ]
        if missing:
            warnings.warn(
                "PrivacyAudit: no shared gradient was seen for (step, client) "
                f"{missing} (a simulated client not sampled in that round, or a step skipped); nothing was audited "
                "there",
                stacklevel=2,
            )

    def _run_pending(self, trainer: pl.Trainer) -> None:
        pending, self._pending = self._pending, []

        def stop() -> bool:  # Lightning's SIGTERM handler sets the flag; the attack checks it each iteration
            return bool(getattr(trainer, "received_sigterm", False))

        for record, model in pending:
            state = _RandomState()
            try:
                with (
                    monitored(heartbeat=self.progress_seconds, stop=stop),
                    torch.enable_grad(),
                    torch.inference_mode(False),
                ):
                    result = self.audit(record, model)
            except AttackInterrupted as stopped:
                raise SIGTERMException(
                    f"PrivacyAudit: SIGTERM received; the audit of step {record.round}, client {record.client_id} "
                    f"was stopped ({stopped})"
                ) from stopped
            finally:
                state.restore()
            self.results.append(result)
            self._log(trainer, result)

    def audit(self, record: TappedGradient, model: nn.Module) -> AuditResult:
        """Attack one recorded shared gradient with every attack and take the worst case (no logging)."""
        if self._server is None:
            raise RuntimeError("PrivacyAudit.audit runs inside a fit (the server's knowledge is read at fit start)")
        num_classes, mean, _ = self._server
        assert record.inputs is not None
        attacks = self.attacks if self.attacks is not None else default_attacks(int(record.inputs.shape[0]))
        attacks = [*attacks, *self._adaptive_attacks]
        if self.lpips and self._lpips_fn is None:
            from lightning_gp.metrics.lpips import LPIPS

            self._lpips_fn = LPIPS()
        skipped: dict[str, str] = {}
        gaps: list[str] = []
        labels_granted = self._labels_granted(int(record.inputs.shape[0]), num_classes, record.round)
        if self._defended and not self.adaptive:
            gaps.append("the adaptive attacks were not run (adaptive=False)")
        results = self._attack_all(record, model, attacks, labels_granted, skipped, gaps)
        reports = [r.report for r in results]
        if not reports:  # nothing was reconstructed: an inconclusive verdict, never a crash of the user's run
            reports = [self._nothing_reconstructed(record, skipped, gaps)]
        worst = worst_case_report(
            reports,
            thresholds=self.thresholds,
            leak_thresholds=self.rule.thresholds,
            noise_ratio_line=self.rule.noise_ratio_line,
            identification_gate=self.rule.identification_gate,
            max_leak_fraction=self.max_leak_fraction,
            # the normalisation mean is the data's per-channel pixel mean: the "dataset mean" guess
            dataset_mean=mean if all(0.0 <= v <= 1.0 for v in mean) else None,
            incomplete=gaps,
            threat_model="passive",
        )
        metrics = self._metrics(record.client_id, worst)
        bound = self._formal_bound(model, reports, record)
        if bound.eta is not None and bound.kappa is not None:
            metrics[f"{self.prefix}/client{record.client_id}/rero_eta"] = bound.eta
            metrics[f"{self.prefix}/client{record.client_id}/rero_kappa"] = bound.kappa
        return AuditResult(
            record.round, record.client_id, results, worst, metrics, skipped=skipped, labels_granted=labels_granted
        )

    def _attack_all(
        self,
        record: TappedGradient,
        model: nn.Module,
        attacks: Sequence[GradientAttack],
        labels_granted: str | None,
        skipped: dict[str, str],
        gaps: list[str],
    ) -> list[AttackResult]:
        """Run every attack on ``record``: the results of those that ran; why each other one did not
        goes to ``skipped``, and what the verdict must name to ``gaps``."""
        assert self._server is not None
        num_classes, mean, std = self._server
        adaptive = {id(a) for a in self._adaptive_attacks}
        results: list[AttackResult] = []
        labels_known = self.labels_known or labels_granted is not None
        labels_disagree: bool | None = None  # one gradient, one answer: checked once, where an attack first needs it
        for attack in attacks:
            name = type(attack).__name__
            run = functools.partial(
                attack_record,
                record,
                model,
                attack,
                num_classes=num_classes,
                mean=mean,
                std=std,
                labels_known=labels_known,
                lpips=self.lpips,
                noise_ratio=self.noise_ratio,
                lpips_fn=self._lpips_fn,
                loss_fn=self._loss_fn,
                tests=self.rule.tests,
            )
            try:
                result = run(public_data=self.public_data)
            except AttackNotApplicable as err:
                skipped[name] = f"n/a: {err}"
                if id(attack) in adaptive:
                    gaps.append(f"the adaptive attack {name} could not apply: {err}")
                continue
            except Exception as err:  # the run goes on; the verdict says the audit is incomplete
                skipped[name] = f"error: {type(err).__name__}: {err}"
                gaps.append(f"{name} failed: {type(err).__name__}: {err}")
                warnings.warn(
                    f"PrivacyAudit: {name} failed at step {record.round}, client {record.client_id}: "
                    f"{type(err).__name__}: {err}",
                    stacklevel=3,  # the caller of audit
                )
                continue
            if result.reconstruction.meta.get("fallback"):
                gaps.append(
                    f"{name} fell back to the published attack ({result.reconstruction.meta.get('fallback_reason')})"
                )
            results.append(result)
            if labels_known or result.reconstruction.labels is None:
                continue
            if labels_disagree is None:
                labels_disagree = label_estimates_differ(result.view)
            if labels_disagree:  # two label estimates, two attacks: the worst case takes both (as audit_setting does)
                try:
                    results.append(run(public_data=self.public_data, label_softmax="dummy"))
                except Exception as err:
                    gaps.append(f"{name} on the dummy-input labels failed: {type(err).__name__}: {err}")
        return results

    def _nothing_reconstructed(
        self, record: TappedGradient, skipped: dict[str, str], gaps: list[str]
    ) -> ReconstructionReport:
        """The report of a round no attack could run on (every image "not reconstructed"), said in a
        warning and in ``gaps``."""
        assert self._server is not None and record.inputs is not None
        _, mean, std = self._server
        warnings.warn(
            f"PrivacyAudit: no attack could run at step {record.round}, client {record.client_id}: {skipped}",
            stacklevel=3,  # the caller of audit
        )
        gaps.append(f"no attack could run ({'; '.join(f'{n}: {why}' for n, why in skipped.items())})")
        nothing = Reconstruction(torch.full_like(record.inputs, math.nan), None, attack="no attack ran")
        return reconstruction_report(
            nothing,
            record.inputs,
            (mean, std),
            true_labels=record.targets,
            lpips=False,
            noise_ratio=False,
            tests=self.rule.tests,
        )

    def _formal_bound(
        self, model: nn.Module, reports: Sequence[ReconstructionReport], record: TappedGradient
    ) -> FormalBound:
        """The run's ReRo bound so far at the kappa of the leak rule on this batch
        (:func:`~lightning_gp.audit.bounds.prior_only_kappa`: the blank, dataset-mean and class-share
        guesses, judged as the verdict judges); "no formal bound" otherwise. Its one formal mechanism
        composes every release up to the audited step ``s``: DPSGD's steps as its accountant counted
        them, else the ``s + 1`` releases of steps ``0 .. s``, each charged in full (``q = 1``)."""
        if len(self._defenses) != 1:
            reason = "undefended" if not self._defenses else "a composition of defenses is not analysed"
            return FormalBound(None, reason)
        defense = self._defenses[0]
        size = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # DPSGD's accountant counts every step it took, the audited one among them: nothing to add
        accounted = isinstance(defense, DPSGD) and bool(defense.privacy_history)
        try:
            bound = FormalBound(defense_mechanism(defense, size, releases=1 if accounted else record.round + 1))
        except ValueError as err:
            return FormalBound(None, str(err).removeprefix("defense: "))
        originals = next((r.original_pixels for r in reports if r.original_pixels is not None), None)
        if originals is None or self._server is None:
            return bound
        mean = self._server[1]
        kappa = prior_only_kappa(
            originals,
            None,
            labels=record.targets,
            rule=self.rule,
            lpips_fn=lpips_for_rule(self.rule, self._lpips_fn),
            # the worst case's "dataset mean" guess (audit): the normalisation mean, where it is a pixel mean
            dataset_mean=mean if all(0.0 <= v <= 1.0 for v in mean) else None,
        )
        return bound.at(kappa)

    def _labels_granted(self, batch_size: int, num_classes: int, step: int) -> str | None:
        """Why the attackers are given the client's true labels although ``labels_known=False``, or None.

        When the batch holds more images than there are classes its labels repeat, and what the
        gradient gives is an estimate of each class's count (:func:`~lightning_gp.attacks.label_counts`),
        which can be off by one; the audit then grants the true labels (a stronger attacker, so the
        verdict can only err against the defense). So it does for any batch of several images past
        step 0 without ``public_data``: on a trained model the counts from random inputs get labels
        wrong (``benchmarks/results/label_counts_trained.md``)."""
        if self.labels_known or batch_size == 1:
            return None
        if batch_size > num_classes:
            reason = (
                f"the attackers were given the true labels: a batch of {batch_size} images of {num_classes} "
                "classes repeats labels, whose counts the gradient gives only as an estimate (a stronger attacker)"
            )
        elif step > 0 and self.public_data is None:
            reason = (
                f"the attackers were given the true labels: at step {step} (a trained model) the label counts of "
                f"a batch of {batch_size} need labelled public images (PrivacyAudit(public_data=...)), without "
                "which they can be wrong (a stronger attacker)"
            )
        else:
            return None
        if not self._warned_labels:
            self._warned_labels = True
            warnings.warn(f"PrivacyAudit: {reason}", stacklevel=3)
        return reason

    def _metrics(self, client_id: int, worst: WorstCaseReport) -> dict[str, float]:
        base = f"{self.prefix}/client{client_id}"
        metrics: dict[str, float] = {}
        for name, means in [*worst.attack_means.items(), ("passive", worst.means)]:
            for metric in LOGGED_METRICS:
                value = means.get(metric)
                if value is not None:
                    metrics[f"{base}/{name}/{metric}"] = float(value)
        for name in worst.attacks:
            metrics[f"{base}/{name}/leak_fraction"] = worst.attack_leak_fraction(name)
        metrics[f"{base}/passive/leak_fraction"] = worst.leak_fraction
        metrics[f"{base}/passive/private"] = 1.0 if worst.is_private else 0.0
        metrics[f"{base}/passive/inconclusive"] = 1.0 if worst.is_inconclusive else 0.0
        metrics[f"{base}/active/private"] = 0.0
        metrics[f"{base}/active/inconclusive"] = 1.0  # see ACTIVE_NOT_AUDITED
        for baseline in worst.baselines:
            metrics[f"{base}/baseline_{baseline.name.replace(' ', '_')}/psnr"] = baseline.means["psnr"]
        return metrics

    def _folder(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return self.dirpath
        log_dir = next((lg.log_dir for lg in trainer.loggers if getattr(lg, "log_dir", None)), None)
        return Path(log_dir or trainer.default_root_dir) / "privacy_audit"

    def _log(self, trainer: pl.Trainer, result: AuditResult) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(result.metrics, step=result.round)
        if self.save_summary:
            name = "summary.md" if trainer.world_size == 1 else f"summary_rank{trainer.global_rank}.md"
            self.summary_path = self._folder(trainer) / name
            self.summary_path.parent.mkdir(parents=True, exist_ok=True)
            self.summary_path.write_text(self.summary(accuracy=_logged_accuracy(trainer)))
        if not self.save_images:
            return
        folder = self._folder(trainer)
        result.image_path = self._save_figure(result, folder / f"step{result.round}_client{result.client_id}.png")
        if result.image_path is None:
            return
        from lightning.pytorch.loggers import TensorBoardLogger

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                from matplotlib.image import imread

                image = imread(str(result.image_path))[..., :3]
                logger.experiment.add_image(
                    f"{self.prefix}/client{result.client_id}", image, global_step=result.round, dataformats="HWC"
                )

    def _save_figure(self, result: AuditResult, path: Path) -> Path | None:
        context = f"step {result.round}, client {result.client_id}, passive server"
        try:
            return save_audit_figure(result.worst, path, context=context)
        except ValueError as err:  # e.g. no pixels (nothing reconstructed), a channel count a figure cannot show
            warnings.warn(f"PrivacyAudit: no figure for step {result.round}: {err}", stacklevel=2)
            return None

    def summary(self, accuracy: float | None = None) -> str:
        """The run's one-screen Markdown summary (what ``summary.md`` holds): is this run's setting private
        at every audited gradient (:func:`~lightning_gp.audit.summary.choose` over the one setting), why,
        and one row per audited gradient. ``accuracy``: the run's accuracy, when known (the callback
        writes the last logged ``val_acc``)."""
        points = [
            Candidate(
                f"step {r.round}, client {r.client_id}",
                r.worst.verdict,
                r.worst.leak_fraction,
                r.worst.means["psnr"],
                reason=r.worst.verdict_reasons[0] if r.worst.verdict_reasons else "",
            )
            for r in self.results
        ]
        # the run's headline numbers: its worst audited gradient (most images leaked, then the highest PSNR)
        worst = max(points, key=lambda p: (p.leak_fraction or 0.0, p.worst_psnr or -math.inf), default=None)
        run = Candidate(
            self._setting,
            combined_verdict(p.verdict for p in points),
            None if worst is None else worst.leak_fraction,
            None if worst is None else worst.worst_psnr,
            accuracy=accuracy,
            reason="" if worst is None or not worst.reason else f"{worst.name}: {worst.reason}",
        )
        context = [
            (
                f"Audited: {len(points)} shared gradient(s) of this run (after every defense), the passive server; "
                "each verdict is the worst case over the attacks "
                f"({', '.join(self.results[-1].worst.attacks) if self.results else 'none run yet'}). The active server "
                "is not audited by an observer of the run (audit_setting, benchmarks/matrix.py audit it)."
                + (" Figures: step{s}_client{c}.png beside this file." if self.save_images else "")
            ),
            (
                "The run is private only if every audited gradient is. To choose among settings, audit each the same "
                "way (benchmarks/matrix.py writes matrix_summary.md): the same rule picks."
            ),
        ]
        return summary_markdown(
            "PrivacyAudit: is this run's setting private?",
            [run],
            rule=self.rule.describe(),
            context=context,
            table=points,
            accuracy_name="val_acc",
            what="setting",
            table_label="audited gradient",
        )
