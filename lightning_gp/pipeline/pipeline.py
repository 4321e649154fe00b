"""The one owner of what leaves a client: defenses in order, then observers.

client gradient -> defense 1 -> ... -> defense n -> **shared gradient** -> observers (taps, meters)

A :class:`~lightning_gp.pipeline.stages.ClientStepRunner` produces each client's gradient and
sends it through the fit's :class:`SharedGradientPipeline`, which it holds from fit start
(docs/architecture.md, "A gradient from .grad to the wire"):

* ``"local"`` (:class:`~lightning_gp.pipeline.local.LocalClientStep`): one process is one client;
  the pipeline rewrites ``.grad`` once per optimizer step;
* ``"ddp"`` (:class:`~lightning_gp.pipeline.ddp.DDPClientStep`): one rank is one client; a
  communication hook defends before the all-reduce;
* a LightningModule or callback that implements the runner interface itself, e.g.
  :class:`~lightning_gp.federated.FederatedSimulation` (many clients per process) or
  :class:`~lightning_gp.callbacks.DPSGD` (the optimizer's step hook, after Opacus noises).

:func:`~lightning_gp.pipeline.runners.resolve_runner` picks the runner of a fit.

Composed defenses and round preparation: a stage that prepares its rounds
(:attr:`~lightning_gp.pipeline.stages.DefenseStage.prepares_rounds`, e.g. ADGP's round mask)
is prepared from every local client's gradient as defended by the stages before it, and that same
output is what its ``defend`` then receives. :meth:`SharedGradientPipeline.begin_round` therefore
runs the stages before the last preparing stage on every local client (each once) and keeps the
result; :meth:`SharedGradientPipeline.process` takes it up there. With no preparing stage after
the first, ``begin_round`` defends nothing and the stages run client by client as they always did.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_gp.defenses.base import Gradients, Share
from lightning_gp.named_tensors import write_into
from lightning_gp.pipeline.stages import ClientSetup, DefenseStage, ObserverStage, StageCall


def trainer_callbacks(trainer: pl.Trainer) -> list[Callback]:
    """The trainer's callbacks (Lightning assigns the attribute in a connector; it is not declared)."""
    return trainer.callbacks  # type: ignore[attr-defined]


def _stage_name(stage: DefenseStage) -> str:
    """The class name of the defense a stage applies (of the stage itself when it wraps none)."""
    return type(getattr(stage, "defense", stage)).__name__


class RoundNotPrepared(RuntimeError):
    """Another process of the round failed defending its clients before a stage could prepare the
    round (that process raises its own error); this process did not fail itself."""


@dataclasses.dataclass(frozen=True)
class _PreparedClient:
    """One client's gradient as defended in :meth:`SharedGradientPipeline.begin_round`."""

    round: int
    raw: Mapping[str, Tensor]  # what the runner handed begin_round (process must hand the same)
    defended: Gradients  # after the stages before the last round-preparing one
    next_stage: int  # the index of the stage that defends it next (the last preparing one)


class SharedGradientPipeline:
    """The defense and observer stages of a trainer, in the order the user gave them.

    A runner drives a round as :meth:`begin_round`, :meth:`process` per local client, then
    :meth:`finish_round`. Every stage that :attr:`~DefenseStage.prepares_rounds` is prepared from
    the gradients as defended by the stages before it (for every local client), and its ``defend``
    then receives exactly those gradients: the earlier stages run once per client and round, in
    ``begin_round`` when a later stage must be prepared from their output.
    """

    def __init__(self, defenses: list[DefenseStage], observers: list[ObserverStage]) -> None:
        self.defenses = defenses
        self.observers = observers
        self._prepared: dict[int, _PreparedClient] = {}
        #: what the runner itself does to the gradient before the stages (DP-SGD's clip and noise)
        self._runner_defenses: list[dict[str, Any]] = []

    @classmethod
    def from_trainer(cls, trainer: pl.Trainer) -> SharedGradientPipeline:
        callbacks = trainer_callbacks(trainer)
        return cls(
            [cb for cb in callbacks if isinstance(cb, DefenseStage)],
            [cb for cb in callbacks if isinstance(cb, ObserverStage)],
        )

    @property
    def members(self) -> list[DefenseStage | ObserverStage]:
        members: list[DefenseStage | ObserverStage] = [*self.defenses, *self.observers]
        return members

    def __len__(self) -> int:
        return len(self.defenses) + len(self.observers)

    def bind(self, setup: ClientSetup, runner: ClientStepRunner) -> None:
        """Declare the run's clients and shared layers to every stage, and refuse a stage the
        runner cannot take (data-dependent defenses after formal DP)."""
        if runner.formal_privacy:
            for stage in self.defenses:
                if stage.reads_client_data:
                    raise ValueError(
                        f"{type(stage).__name__} reads the client's raw batch to shape its noise or pruning, so running "
                        f"it after {type(runner).__name__} is not post-processing of the DP output and would void the "
                        f"reported epsilon. Use {type(runner).__name__} alone, or with data-independent defenses "
                        "(pruning, GaussianNoise) after it"
                    )
        self._runner_defenses = runner.describe_defenses()
        setup = dataclasses.replace(setup, passes_client_batches=runner.passes_client_batches)
        for member in self.members:
            member.bind(setup)

    def describe_defenses(self) -> list[dict[str, Any]]:
        """What the server is assumed to know of the defenses (recorded as ``meta["defenses"]``, read by
        the adaptive attacks): the runner's own (DP-SGD), then each stage's defense class name and
        configuration, in the order they apply."""
        described = [dict(d) for d in self._runner_defenses]
        for stage in self.defenses:
            inner: Any = getattr(stage, "defense", stage)
            config = inner.config() if callable(getattr(inner, "config", None)) else {}
            described.append({"name": type(inner).__name__, "config": dict(config)})
        return described

    def begin_round(
        self,
        round: int,
        clients: Sequence[int],
        local_gradients: Mapping[int, Gradients],
        share: Share,
        *,
        model: nn.Module | None = None,
        batches: Mapping[int, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        """Let every defense that :attr:`~DefenseStage.prepares_rounds` prepare the round (e.g. ADGP's
        shared mask) before clients are defended, each from the gradients as the stages before it
        defend them.

        Args:
            round: the round index (the optimizer step).
            clients: every client of the round, in every process.
            local_gradients: the raw gradient of every client this process holds, by client id;
                :meth:`process` must then be given these same gradients (the same tensors).
            share: ``share(source_client, tensors)`` (see ``Defense.begin_round``).
            model, batches, meta: what :meth:`process` gets for each client (``batches`` by
                client id; ``None`` when the runner passes no batch). A stage before a preparing
                stage defends the local clients here with them, so ``model`` is needed then.
            agree: where the round's clients live in several processes, a collective: every
                process says whether it failed and learns whether any did (DDP: an all-reduce).
                The stages before a preparing stage may fail in one process (a NaN gradient) while
                the others would wait for it inside the preparing stage's ``share``; so before each
                preparing stage the processes agree, the failed one raises its error and the others
                :class:`RoundNotPrepared`. ``None`` (one process): a failure is raised at once.
        """
        self._prepared = {}
        preparing = [index for index, stage in enumerate(self.defenses) if stage.prepares_rounds]
        if not preparing:
            return
        outside = sorted(set(local_gradients) - set(clients))
        if outside:
            raise ValueError(f"local_gradients holds clients {outside} that are not among the round's clients")
        last = preparing[-1]
        if last > 0:  # the stages before `last` defend every local client now
            if model is None:
                raise ValueError(
                    f"begin_round needs model=: {_stage_name(self.defenses[last])} prepares its round from the "
                    f"gradients defended by the {last} stage(s) before it, which defend them here"
                )
            missing = [] if batches is None else sorted(set(local_gradients) - set(batches))
            if missing:
                raise ValueError(f"batches has no batch for clients {missing} of local_gradients")
        stage_meta = self._meta(meta) if last > 0 else {}
        current = dict(local_gradients)
        for index, stage in enumerate(self.defenses[: last + 1]):
            if stage.prepares_rounds:
                if index > 0 and agree is not None and agree(False):
                    raise RoundNotPrepared(
                        f"another process failed defending its clients before {_stage_name(stage)} could "
                        f"prepare round {round}"
                    )
                stage.begin_round(round, clients, current, share)
            if index < last:
                assert model is not None  # checked above
                try:
                    current = {
                        client: stage.defend(
                            gradients,
                            StageCall(client, round, model, None if batches is None else batches[client], stage_meta),
                        )
                        for client, gradients in current.items()
                    }
                except Exception:
                    if agree is not None:
                        agree(True)  # the processes about to prepare the next stage learn of it
                    raise
        if last > 0:
            self._prepared = {
                client: _PreparedClient(round, local_gradients[client], dict(current[client]), last)
                for client in local_gradients
            }

    @property
    def layerwise(self) -> bool:
        """Every defense is layerwise (and prepares no round), so a client's gradient may be
        defended part by part."""
        return all(stage.layerwise and not stage.prepares_rounds for stage in self.defenses)

    def process(
        self, gradients: Mapping[str, Tensor], call: StageCall, *, out: Mapping[str, Tensor] | None = None
    ) -> Gradients:
        """Defend one client's gradient and show the shared result to every observer (``out``: see
        :meth:`defend`)."""
        shared = self.defend(gradients, call, out=out)
        self.observe(shared, call)
        return shared

    def defend(
        self,
        gradients: Mapping[str, Tensor],
        call: StageCall,
        *,
        part: bool = False,
        out: Mapping[str, Tensor] | None = None,
    ) -> Gradients:
        """The defenses of :meth:`process` alone. With ``part``, ``gradients`` holds some of the
        client's layers (a DDP bucket) and every defense must be :attr:`layerwise`; the observers
        then see the assembled gradient through :meth:`observe` once the last part is defended.

        With ``out`` (tensors like the gradients; the gradients themselves to defend in place) the
        last defense writes the shared gradient into them (:meth:`DefenseStage.defend_into`) and
        they are returned: the local runner defends ``.grad`` so, with no fresh model-sized memory.

        When :meth:`begin_round` already ran the first stages on this client (a later stage
        prepares its rounds), the defense goes on from their output: ``gradients`` must be the
        ones given to :meth:`begin_round`.
        """
        if part and not self.layerwise:
            raise RuntimeError("a gradient can be defended part by part only when every defense is layerwise")
        if part and out is not None:
            raise ValueError("out is not supported with part=True (a DDP bucket is copied into its buffer)")
        shared, first = self._resume_prepared(gradients, call, part=part)
        call = self.described(call)
        if part:
            call = dataclasses.replace(call, batch=None)
        for index in range(first, len(self.defenses)):
            defense = self.defenses[index]
            if part:
                shared = defense.defend_layers(shared, call)
            elif out is not None and index == len(self.defenses) - 1:
                shared = defense.defend_into(shared, out, call)
            else:
                shared = defense.defend(shared, call)
        return shared if out is None else write_into(out, shared)

    def _resume_prepared(
        self, gradients: Mapping[str, Tensor], call: StageCall, *, part: bool
    ) -> tuple[Gradients, int]:
        """The client's gradient and the index of the stage that defends it next: where
        :meth:`begin_round` left it, else the gradient as given and the first stage."""
        prepared = None if part else self._prepared.pop(call.client_id, None)
        if prepared is None:
            return dict(gradients), 0
        if prepared.round != call.round:
            raise RuntimeError(
                f"client {call.client_id} is defended for round {call.round}, but begin_round prepared round "
                f"{prepared.round}; call begin_round for every round before its clients are defended"
            )
        if gradients.keys() != prepared.raw.keys() or any(gradients[n] is not t for n, t in prepared.raw.items()):
            raise ValueError(
                f"gradients: client {call.client_id}'s gradients are not the ones given to begin_round for round "
                f"{call.round}, where the stages before the round-preparing "
                f"{_stage_name(self.defenses[prepared.next_stage])} already defended them"
            )
        return dict(prepared.defended), prepared.next_stage

    def observe(self, shared: Mapping[str, Tensor], call: StageCall) -> None:
        """Show one client's whole shared gradient to every observer (the observers of :meth:`process`)."""
        call = self.described(call)
        for observer in self.observers:
            observer.observe(shared, call)

    def described(self, call: StageCall) -> StageCall:
        """``call`` with ``meta["defenses"]`` set to :meth:`describe_defenses` (what the adaptive
        attacks read of the defenses)."""
        return dataclasses.replace(call, meta=self._meta(call.meta))

    def _meta(self, meta: Mapping[str, Any] | None) -> dict[str, Any]:
        return {**(meta or {}), "defenses": self.describe_defenses()}

    def finish_round(self, update: Mapping[str, Tensor], *, round: int, clients: int) -> None:
        """Show the aggregated update (what every client downloads) to the observers."""
        self._prepared = {}  # a client begin_round defended but nobody processed is dropped with its round
        for observer in self.observers:
            observer.observe_aggregate(update, round=round, clients=clients)


class ClientStepRunner(ABC):
    """Owns the client step: computes each client's gradient and sends it through the fit's pipeline.

    At fit start :meth:`start` hands the runner the fit's
    :class:`~lightning_gp.pipeline.SharedGradientPipeline` (the one object holding the trainer's
    defense and observer stages); the runner keeps it as :attr:`pipeline` for the fit. Each round
    it calls ``pipeline.begin_round`` with the raw gradient of every client this process holds
    (and the model, the clients' batches and the meta ``process`` will get: a stage before a
    round-preparing one defends them there), then ``pipeline.process`` once per client with the
    same gradients, then ``pipeline.finish_round`` with the aggregate the clients download.
    """

    #: recorded as ``meta["path"]`` of every shared gradient
    execution_path: ClassVar[str]
    #: ``process`` receives each client's batch; otherwise stages that need the batch read it
    #: in ``on_train_batch_start`` (the hook that sees the gradient does not see the batch)
    passes_client_batches: ClassVar[bool] = False
    #: the shared gradient carries a formal privacy guarantee (DP-SGD) that a stage reading the
    #: raw client data would void, so such stages are refused
    formal_privacy: ClassVar[bool] = False
    #: the fit's pipeline, from :meth:`start` (``None`` before the fit starts)
    pipeline: SharedGradientPipeline | None = None

    @abstractmethod
    def client_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ClientSetup:
        """The run's clients and shared layers (called once the model and optimizers exist)."""

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, pipeline: SharedGradientPipeline) -> None:
        """Take the fit's pipeline: declare the clients and shared layers to its stages, keep it as
        :attr:`pipeline`, and :meth:`attach` to the training loop."""
        pipeline.bind(self.client_setup(trainer, pl_module), self)
        self.pipeline = pipeline
        self.attach(trainer, pl_module)

    def attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Hook into the training loop at fit start (default: nothing; e.g. DDP registers its hook)."""
        return

    def before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        """Called from ``on_before_optimizer_step`` (default: nothing; the local runner defends ``.grad`` here)."""
        return

    def describe_defenses(self) -> list[dict[str, Any]]:
        """What this runner does to a client's gradient before the stages see it, described like the
        stages' defenses (``{"name", "config"}``; recorded first in ``meta["defenses"]``). Default: none."""
        return []

    def finish(self) -> None:
        """Let go of the fit's pipeline (at teardown): the next fit gets its own."""
        self.pipeline = None

    def fit_pipeline(self) -> SharedGradientPipeline:
        """:attr:`pipeline`; an empty pipeline when the trainer has no stages (nothing started one)."""
        return SharedGradientPipeline([], []) if self.pipeline is None else self.pipeline
