"""The callback base of defenses that read the client's raw batch (the optimal defenses, Soteria).

Such a defense needs a statistic of the batch behind the gradient (the sensitivity, Soteria's
feature scores). Where it comes from depends on the runner (docs/architecture.md, "Flow 1"):

* single device and DDP: at ``on_train_batch_start``, from the module and the batch about to be
  trained on (the weights the backward pass will use); with gradient accumulation the
  micro-batches' statistics are combined (:meth:`DataDependentGradientDefense.combine`,
  :meth:`~DataDependentGradientDefense.accumulated`). Under DDP the defense itself then runs in the
  communication hook, with no autograd work inside it.
* :class:`~lightning_gp.federated.FederatedSimulation`: per client, from the server model and that
  client's batch (FedSGD only: a FedAvg update is not the gradient of one batch).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
from torch import Tensor, nn

from lightning_gp.callbacks.base import GradientDefense
from lightning_gp.pipeline.stages import ClientSetup, StageCall
from lightning_gp.validation import check_positive_int


class DataDependentGradientDefense(GradientDefense):
    """A :class:`GradientDefense` whose defense needs a statistic of the client's batch.

    Subclasses implement :meth:`batch_statistic` (the statistic of one batch) and
    :meth:`statistic_inputs` (the defense's arguments made of it); :meth:`combine` and
    :meth:`accumulated` say how micro-batches add up.

    ``refresh_every=N`` computes a client's statistic at every ``N``-th optimizer step (round) and
    reuses its last one in between (``1``: every step): stale by design, up to ``N - 1`` steps old
    and from an earlier batch. Per client (the rank on the local and DDP paths, the client id in
    the simulation, where it is refreshed at the client's first round at least ``N`` rounds after
    the last one). The statistics kept for reuse are checkpointed, so a resumed run reuses them as
    the uninterrupted run would (under DDP the checkpoint holds rank 0's: the other ranks refresh
    theirs at the first step after the resume). ``refresh_every`` is part of :attr:`state_key`.
    """

    reads_client_data = True  # the statistic comes from the client's raw batch
    #: what the statistic is called in error messages
    statistic_name: ClassVar[str] = "statistic"

    def adapt(self, *, refresh_every: int = 1) -> None:
        self.refresh_every = check_positive_int(refresh_every, "refresh_every")
        self._pending: Any = None
        self._pending_step: int | None = None
        self._micro_batches = 0
        self._batches_given = False
        # client -> (step it was computed at, statistic), only with refresh_every > 1
        self._latest: dict[int, tuple[int, Any]] = {}

    # ---------------------------------------------------------------- subclass API
    @abstractmethod
    def batch_statistic(
        self, module: nn.Module, inputs: Tensor, targets: Tensor, *, seed_words: tuple[int, ...]
    ) -> Any:
        """The statistic of one batch under ``module``'s current weights (random draws seeded by
        the defense's seed and ``seed_words``)."""

    @abstractmethod
    def statistic_inputs(self, gradients: Mapping[str, Tensor], statistic: Any) -> dict[str, Any]:
        """The defense's arguments besides the gradient (its ``prepare`` keywords) from the statistic
        of the client's batch."""

    def combine(self, total: Any, new: Any) -> Any:
        """Two micro-batches' statistics together (default: sum per layer)."""
        return {n: total[n] + new[n] for n in new}

    def accumulated(self, total: Any, micro_batches: int) -> Any:
        """The statistic of the optimizer step from the combined micro-batches (default: as is)."""
        return total

    # ---------------------------------------------------------------- Lightning hooks
    def bind(self, setup: ClientSetup) -> None:
        super().bind(setup)
        self._batches_given = setup.passes_client_batches

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._pending, self._pending_step, self._micro_batches = None, None, 0

    # ---------------------------------------------------------------- settings and checkpointed state
    def adapter_config(self) -> dict[str, Any]:
        return {**super().adapter_config(), "refresh_every": self.refresh_every}

    def adapter_state(self) -> dict[str, Any]:
        # a step's micro-batch statistics in progress are not saved: Lightning does not save the
        # gradient accumulated so far either
        return {"latest": {client: (step, statistic) for client, (step, statistic) in self._latest.items()}}

    def load_adapter_state(self, state: Mapping[str, Any]) -> None:
        latest = state.get("latest")
        if set(state) != {"latest"} or not isinstance(latest, Mapping):
            raise ValueError(f"{type(self).__name__}: not a saved {self.statistic_name} state: keys {sorted(state)}")
        self._latest = {int(client): (int(step), _cloned(statistic)) for client, (step, statistic) in latest.items()}

    def reset_adapter_state(self) -> None:
        self._latest = {}

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._batches_given:
            return  # the runner hands each client's batch to defend()
        step = trainer.global_step
        if self._reusable(trainer.global_rank, step) is not None:
            return  # refresh_every: this step reuses the rank's last statistic
        if self._pending_step != step:
            self._pending, self._pending_step, self._micro_batches = None, step, 0
        inputs, targets = inputs_and_targets(batch)
        new = self.batch_statistic(
            pl_module, inputs, targets, seed_words=(step, trainer.global_rank, self._micro_batches)
        )
        self._pending = new if self._pending is None else self.combine(self._pending, new)
        self._micro_batches += 1

    # ---------------------------------------------------------------- pipeline
    def defense_inputs(self, gradients: Mapping[str, Tensor], call: StageCall) -> dict[str, Any]:
        return {**super().defense_inputs(gradients, call), **self.statistic_inputs(gradients, self.statistic(call))}

    def statistic(self, call: StageCall) -> Any:
        """The statistic the client's gradient is defended with: the one of its batch (computed now
        when the runner passes the batch, else from the micro-batches seen in
        ``on_train_batch_start``), or its last one while ``refresh_every`` allows reusing it."""
        reusable = self._reusable(call.client_id, call.round)
        if reusable is not None and self._pending is None:
            return reusable
        if self._batches_given:
            if call.meta.get("algorithm", "fedsgd") != "fedsgd":
                raise ValueError(
                    f"{type(self).__name__} defends the gradient of one batch; FedAvg shares a multi-step model "
                    f"update, whose {self.statistic_name} this defense does not have. Use algorithm='fedsgd'"
                )
            inputs, targets = inputs_and_targets(call.batch)
            statistic = self.batch_statistic(call.model, inputs, targets, seed_words=(call.round, call.client_id, 0))
        else:
            if self._pending is None:
                raise RuntimeError(
                    f"{type(self).__name__} saw no training batch for this optimizer step, so it has no "
                    f"{self.statistic_name} to defend with (manual optimization is not supported)"
                )
            statistic = self.accumulated(self._pending, self._micro_batches)
            self._pending, self._pending_step, self._micro_batches = None, None, 0
        if self.refresh_every > 1:
            self._latest[call.client_id] = (call.round, statistic)
        return statistic

    def _reusable(self, client: int, step: int) -> Any:
        """The client's last statistic while ``refresh_every`` allows reusing it at ``step``, else None."""
        latest = self._latest.get(client)
        if latest is None or not 0 <= step - latest[0] < self.refresh_every:
            return None
        return latest[1]


def _cloned(value: Any) -> Any:
    """A copy of a statistic's tensors (dicts, tuples and lists of them; other values as they are)."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, Mapping):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_cloned(v) for v in value)
    return value


def inputs_and_targets(batch: Any) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)`` of an ``(inputs, targets, ...)`` batch; a clear error for anything else."""
    if (
        isinstance(batch, (tuple, list))
        and len(batch) >= 2
        and isinstance(batch[0], Tensor)
        and isinstance(batch[1], Tensor)
    ):
        return batch[0], batch[1]
    raise TypeError(
        "the data-dependent defenses read (inputs, targets, ...) batches; got "
        f"{type(batch).__name__}. Return such tuples from the dataloader, or pass the batch through a collate_fn"
    )


def sensitivity_of_layers(sensitivity: Mapping[str, Tensor], gradients: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The sensitivity of the shared layers, or a clear error when the model names other layers."""
    missing = [n for n in gradients if n not in sensitivity]
    if missing:
        raise ValueError(f"no sensitivity for the shared layers {missing[:5]}: the model and the gradient disagree")
    return {n: sensitivity[n] for n in gradients}
