"""The stages on the path of a shared gradient, and what a stage call carries.

The runner interface (:class:`~lightning_gp.pipeline.ClientStepRunner`) lives beside the pipeline
it holds (:mod:`lightning_gp.pipeline.pipeline`).

client batch -> **ClientStepRunner** computes the client's gradient -> **DefenseStage**s rewrite it
-> shared gradient -> **ObserverStage**s see it (taps, meters) -> aggregation -> optimizer step

* :class:`~lightning_gp.pipeline.ClientStepRunner` owns the client step: it produces each client's gradient and hands it
  to the fit's :class:`~lightning_gp.pipeline.SharedGradientPipeline`, which it holds from fit
  start (``ClientStepRunner.start``). Built in: one process is one
  client (``"local"``), one DDP rank is one client (``"ddp"``, a communication hook). A
  LightningModule (``FederatedSimulation``: many clients per process) or a callback (``DPSGD``:
  the optimizer's step hook, after Opacus noises) takes the role by implementing it.
* :class:`DefenseStage` rewrites what a client shares (``GradientDefense`` wraps a pure
  :class:`~lightning_gp.defenses.Defense`).
* :class:`ObserverStage` sees every shared gradient after all defenses.

A round: the runner calls ``pipeline.begin_round`` with every local client's gradient, then
``pipeline.process`` once per local client (with a :class:`StageCall`: the client, the round, the
model, the batch and the meta every stage of that call sees), then ``pipeline.finish_round``. A defense
stage that prepares its rounds (:attr:`DefenseStage.prepares_rounds`, e.g. ADGP choosing the
round's mask) is prepared from the gradients **as the stages before it defend them**, never from
the raw ones: in ``[GaussianNoise(...), AlignedDualGradientPruning()]`` the mask comes from the
noised gradients, so the positions sent reveal nothing the noise hides. The stages before the
last preparing stage therefore defend every local client's gradient in ``begin_round``, once;
``process`` goes on from that output (no stage runs, nor draws its noise, twice).

The pipeline knows these interfaces only, never the concrete classes, so new methods (a Refiner
module, PriPrune's pruned FedAvg) plug in by implementing one of them. See docs/architecture.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from lightning_gp.defenses.base import Gradients, Share
from lightning_gp.named_tensors import write_into


@dataclass(frozen=True)
class StageCall:
    """One client's gradient on its way through the pipeline: who shares it, when, and what a
    stage may read to defend or observe it. Built by the runner, passed unchanged to every stage.

    Attributes:
        client_id: the client whose gradient this is.
        round: the round index (the optimizer step).
        model: the model whose gradient it is (the client model, or the LightningModule itself).
        batch: the client's batch, when the runner passes it (:attr:`~lightning_gp.pipeline.ClientStepRunner.passes_client_batches`);
            ``None`` otherwise, and for a part of the layers (:meth:`DefenseStage.defend_layers`).
        meta: what the runner records with the shared gradient (``"path"``, ``"algorithm"``, ...),
            plus ``"defenses"``, the pipeline's description of its defenses.
    """

    client_id: int
    round: int
    model: nn.Module
    batch: Any = None
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientSetup:
    """What every stage is told before the first round: the clients and the shared layers.

    Attributes:
        num_clients: client ids run from 0 to ``num_clients - 1``.
        model: the model whose gradient the clients share (the simulated client model, or the
            LightningModule itself).
        shapes: the name and shape of every layer a client shares, in order.
        passes_client_batches: the runner hands each client's batch to the stages (see
            :attr:`~lightning_gp.pipeline.ClientStepRunner.passes_client_batches`); the pipeline fills it in.
        cohort_size: the clients whose uploads one round's aggregate sums (the simulation's
            ``cohort_size``, DDP's world size); ``None`` where the runner does not aggregate (one
            process training alone, e.g. a Flower client), so no stage can check it.
    """

    num_clients: int
    model: nn.Module
    shapes: dict[str, torch.Size]
    passes_client_batches: bool = False
    cohort_size: int | None = None


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
    def defend(self, gradients: Mapping[str, Tensor], call: StageCall) -> dict[str, Tensor]:
        """One client's gradient through this stage."""

    def defend_into(
        self, gradients: Mapping[str, Tensor], out: Mapping[str, Tensor], call: StageCall
    ) -> dict[str, Tensor]:
        """:meth:`defend` with the result written into ``out`` (tensors like the gradients, possibly
        the gradients themselves) and returned. Default: :meth:`defend`, then a copy; a stage that
        can write ``out`` directly saves the fresh memory (see ``Defense.__call__``)."""
        return write_into(out, self.defend(gradients, call))

    def defend_layers(self, gradients: Mapping[str, Tensor], call: StageCall) -> dict[str, Tensor]:
        """Some of one client's layers through a :attr:`layerwise` stage, called part after part in
        layer order within a step (``call.batch`` is ``None``; default: :meth:`defend` on the part)."""
        return self.defend(gradients, call)


class ObserverStage(ABC):
    """Sees every shared gradient after all defenses (taps, meters, audits)."""

    def bind(self, setup: ClientSetup) -> None:
        """Declare the run's clients and shared layers (e.g. a tap checks its client id)."""
        return

    @abstractmethod
    def observe(self, gradients: Mapping[str, Tensor], call: StageCall) -> None:
        """See one client's shared gradient."""

    def observe_aggregate(self, update: Mapping[str, Tensor], *, round: int, clients: int) -> None:
        """See the aggregated update the clients download after a round (default: nothing)."""
        return
