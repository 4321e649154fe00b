"""The three roles on the path of a shared gradient, as explicit interfaces.

client batch -> **ClientStepRunner** computes the client's gradient -> **DefenseStage**s rewrite it
-> shared gradient -> **ObserverStage**s see it (taps, meters) -> aggregation -> optimizer step

* :class:`ClientStepRunner` owns the client step: it produces each client's gradient and hands it
  to the pipeline (:class:`Pipeline`, implemented by
  :class:`~lightning_gp.callbacks.SharedGradientPipeline`). Built in: one process is one
  client (``"local"``), one DDP rank is one client (``"ddp"``, a communication hook). A
  LightningModule (``FederatedSimulation``: many clients per process) or a callback (``DPSGD``:
  the optimizer's step hook, after Opacus noises) takes the role by implementing it.
* :class:`DefenseStage` rewrites what a client shares (``GradientDefense`` wraps a pure
  :class:`~lightning_gp.defenses.Defense`).
* :class:`ObserverStage` sees every shared gradient after all defenses.

A round: the runner calls :meth:`Pipeline.begin_round` with every local client's gradient, then
:meth:`Pipeline.process` once per local client, then :meth:`Pipeline.finish_round`. A defense
stage that prepares its rounds (:attr:`DefenseStage.prepares_rounds`, e.g. ADGP choosing the
round's mask) is prepared from the gradients **as the stages before it defend them**, never from
the raw ones: in ``[GaussianNoise(...), AlignedDualGradientPruning()]`` the mask comes from the
noised gradients, so the positions sent reveal nothing the noise hides. The stages before the
last preparing stage therefore defend every local client's gradient in ``begin_round``, once;
``process`` goes on from that output (no stage runs, nor draws its noise, twice).

The pipeline knows these interfaces only, never the concrete classes, so new methods (a Refiner
module, PriPrune's pruned FedAvg) plug in by implementing one of them. Nothing here imports
another module of :mod:`lightning_gp.callbacks`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from lightning_gp.defenses.base import Gradients, Share
from lightning_gp.named_tensors import write_into

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer


@dataclass(frozen=True)
class ClientSetup:
    """What every stage is told before the first round: the clients and the shared layers.

    Attributes:
        num_clients: client ids run from 0 to ``num_clients - 1``.
        model: the model whose gradient the clients share (the simulated client model, or the
            LightningModule itself).
        shapes: the name and shape of every layer a client shares, in order.
        passes_client_batches: the runner hands each client's batch to the stages (see
            :attr:`ClientStepRunner.passes_client_batches`); the pipeline fills it in.
    """

    num_clients: int
    model: nn.Module
    shapes: dict[str, torch.Size]
    passes_client_batches: bool = False


class Pipeline(Protocol):
    """What a runner drives (:class:`~lightning_gp.callbacks.SharedGradientPipeline` implements it)."""

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
    ) -> None: ...

    def process(
        self,
        gradients: Mapping[str, Tensor],
        *,
        client_id: int,
        round: int,
        model: nn.Module,
        batch: Any = None,
        meta: Mapping[str, Any] | None = None,
        out: Mapping[str, Tensor] | None = None,
    ) -> Gradients: ...

    def finish_round(self, update: Mapping[str, Tensor], *, round: int, clients: int) -> None: ...

    @property
    def layerwise(self) -> bool: ...

    def defend(
        self,
        gradients: Mapping[str, Tensor],
        *,
        client_id: int,
        round: int,
        model: nn.Module,
        batch: Any = None,
        meta: Mapping[str, Any] | None = None,
        part: bool = False,
    ) -> Gradients: ...

    def observe(
        self,
        shared: Mapping[str, Tensor],
        *,
        client_id: int,
        round: int,
        model: nn.Module,
        batch: Any = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None: ...


class ClientStepRunner(ABC):
    """Owns the client step: computes each client's gradient and sends it through the pipeline.

    Implementations call :meth:`SharedGradientPipeline.begin_round` with the raw gradient of every
    client this process holds (and the model, the clients' batches and the meta ``process`` will
    get: a stage before a round-preparing one defends them there), then
    :meth:`SharedGradientPipeline.process` once per client with the same gradients, then
    :meth:`SharedGradientPipeline.finish_round` with the aggregate the clients download.
    """

    #: recorded as ``meta["path"]`` of every shared gradient
    execution_path: ClassVar[str]
    #: ``process`` receives each client's batch; otherwise stages that need the batch read it
    #: in ``on_train_batch_start`` (the hook that sees the gradient does not see the batch)
    passes_client_batches: ClassVar[bool] = False
    #: the shared gradient carries a formal privacy guarantee (DP-SGD) that a stage reading the
    #: raw client data would void, so such stages are refused
    formal_privacy: ClassVar[bool] = False

    @abstractmethod
    def client_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ClientSetup:
        """The run's clients and shared layers (called once the model and optimizers exist)."""

    def attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, pipeline: Pipeline) -> None:
        """Hook into the training loop at fit start (default: nothing; e.g. DDP registers its hook)."""
        return

    def before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer, pipeline: Pipeline
    ) -> None:
        """Called from ``on_before_optimizer_step`` (default: nothing; the local runner defends ``.grad`` here)."""
        return


class DefenseStage(ABC):
    """Rewrites the gradient one client shares; stages compose in the order given to the Trainer."""

    #: reads the client's raw batch or model to decide what to share (data-dependent); refused
    #: after a runner with a formal privacy guarantee
    reads_client_data: ClassVar[bool] = False

    @property
    def layerwise(self) -> bool:
        """The stage defends each layer from that layer alone (and per-layer state), and needs no
        :meth:`begin_round`: a runner may then call :meth:`defend_layers` part after part (the DDP
        hook, bucket by bucket, overlapping the all-reduce with the backward pass). Default: False."""
        return False

    @property
    def prepares_rounds(self) -> bool:
        """The stage prepares each round in :meth:`begin_round` (e.g. a mask shared by the round's
        clients). The pipeline calls :meth:`begin_round` of such stages only, and such a stage is
        never defended part by part. Default: whether the subclass overrides :meth:`begin_round`."""
        return type(self).begin_round is not DefenseStage.begin_round

    def bind(self, setup: ClientSetup) -> None:
        """Declare the run's clients and shared layers (checks restored state against them)."""
        return

    def begin_round(
        self, round: int, clients: Sequence[int], local_gradients: Mapping[int, Gradients], share: Share
    ) -> None:
        """Prepare a round before any of its clients is defended (default: nothing).

        ``local_gradients`` holds, for every client this process holds, its gradient **as defended by
        the stages before this one** (the raw gradient for the first stage): exactly what this
        stage's :meth:`defend` then receives for that client in this round. ``clients`` lists every
        client of the round, in every process; ``share`` as in
        :meth:`lightning_gp.defenses.Defense.begin_round`.
        """
        return

    @abstractmethod
    def defend(
        self,
        gradients: Mapping[str, Tensor],
        *,
        client_id: int,
        round: int,
        model: nn.Module,
        batch: Any,
        meta: Mapping[str, Any],
    ) -> dict[str, Tensor]:
        """One client's gradient through this stage."""

    def defend_into(
        self,
        gradients: Mapping[str, Tensor],
        out: Mapping[str, Tensor],
        *,
        client_id: int,
        round: int,
        model: nn.Module,
        batch: Any,
        meta: Mapping[str, Any],
    ) -> dict[str, Tensor]:
        """:meth:`defend` with the result written into ``out`` (tensors like the gradients, possibly
        the gradients themselves) and returned. Default: :meth:`defend`, then a copy; a stage that
        can write ``out`` directly saves the fresh memory (see ``Defense.__call__``)."""
        shared = self.defend(gradients, client_id=client_id, round=round, model=model, batch=batch, meta=meta)
        return write_into(out, shared)

    def defend_layers(
        self, gradients: Mapping[str, Tensor], *, client_id: int, round: int, model: nn.Module, meta: Mapping[str, Any]
    ) -> dict[str, Tensor]:
        """Some of one client's layers through a :attr:`layerwise` stage, called part after part in
        layer order within a step (default: :meth:`defend` on the part, without a batch)."""
        return self.defend(gradients, client_id=client_id, round=round, model=model, batch=None, meta=meta)


class ObserverStage(ABC):
    """Sees every shared gradient after all defenses (taps, meters, audits)."""

    def bind(self, setup: ClientSetup) -> None:
        """Declare the run's clients and shared layers (e.g. a tap checks its client id)."""
        return

    @abstractmethod
    def observe(
        self,
        gradients: Mapping[str, Tensor],
        *,
        client_id: int,
        round: int,
        model: nn.Module,
        batch: Any,
        meta: Mapping[str, Any],
    ) -> None:
        """See one client's shared gradient."""

    def observe_aggregate(self, update: Mapping[str, Tensor], *, round: int, clients: int) -> None:
        """See the aggregated update the clients download after a round (default: nothing)."""
        return
