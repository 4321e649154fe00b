"""Record the gradient a client shares (after every defense) for attacks and audits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_gp.callbacks.base import SharedGradientObserver
from lightning_gp.functional import batchnorm_mode
from lightning_gp.pipeline.stages import ClientSetup, StageCall
from lightning_gp.records import TappedGradient
from lightning_gp.validation import check_bool, check_int, check_int_list


class GradientTap(SharedGradientObserver):
    """Keep the shared (post-defense) gradients of chosen clients in chosen rounds.

    Args:
        clients: the client id(s) to record (the global rank under DDP, 0 on a single device).
        rounds: the round (optimizer step) indices to record; ``None`` records every round.
        dirpath: each record is also written to ``dirpath/round{r}_client{c}.pt``. ``None``: to
            ``<the run's log directory>/taps`` when the Trainer has a logger (a run from a config
            keeps its records after it exits), else kept in memory only (:attr:`records`).
        record_data: keep the client's batch with the record, for scoring reconstructions.
    """

    def __init__(
        self,
        clients: int | Sequence[int] = 0,
        rounds: int | Sequence[int] | None = 0,
        dirpath: str | None = None,
        record_data: bool = True,
    ) -> None:
        self.clients = check_int_list(clients, "clients")
        if isinstance(rounds, int):
            rounds = [rounds]
        self.rounds = None if rounds is None else sorted({check_int(r, "rounds", low=0) for r in rounds})
        self.dirpath = dirpath
        self.record_data = check_bool(record_data, "record_data")
        self.records: list[TappedGradient] = []
        self.batches = StepBatches()
        #: where this fit writes its records (``dirpath``, the log directory's ``taps``, or None)
        self.record_dir: Path | None = None if dirpath is None else Path(dirpath)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if self.dirpath is not None:
            self.record_dir = Path(self.dirpath)
        elif trainer.loggers and trainer.log_dir is not None:
            self.record_dir = Path(trainer.log_dir) / "taps"
        else:
            self.record_dir = None

    def wants(self, client_id: int, round: int) -> bool:
        return client_id in self.clients and (self.rounds is None or round in self.rounds)

    def bind(self, setup: ClientSetup) -> None:
        outside = [c for c in self.clients if c >= setup.num_clients]
        if outside:
            raise ValueError(
                f"GradientTap(clients={self.clients}): client(s) {outside} would never be recorded: this run has "
                f"{setup.num_clients} client(s), ids 0..{setup.num_clients - 1} (under DDP the client id is the rank)"
            )
        self.batches.given = setup.passes_client_batches

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        self.batches.keep(step, batch, wanted=self.record_data and self.wants(trainer.global_rank, step))

    def observe(self, gradients: Mapping[str, Tensor], call: StageCall) -> None:
        client_id, round, model, batch, meta = call.client_id, call.round, call.model, call.batch, call.meta
        if not self.wants(client_id, round):
            return
        batch = self.batches.take(round, batch)
        record = tapped_record(
            gradients,
            client_id=client_id,
            round=round,
            model=model,
            batch=batch if self.record_data else None,
            meta=meta,
        )
        self.records.append(record)
        if self.record_dir is not None:
            record.save(self.record_dir / f"round{round}_client{client_id}.pt")

    def latest(self) -> TappedGradient:
        if not self.records:
            raise LookupError(
                f"GradientTap recorded nothing: clients {self.clients} shared no gradient in rounds {self.rounds}"
            )
        return self.records[-1]


class StepBatches:
    """The client's batches of the optimizer step in progress, for observers that need them.

    When the runner does not hand the batch to the stages (local, DDP), the hook that sees the
    gradient does not see the batch: observers keep it from ``on_train_batch_start`` (several
    micro-batches with gradient accumulation) and take it back when the gradient arrives.
    """

    def __init__(self) -> None:
        self.given = False  # the runner passes each client's batch to the stages itself
        self._steps: dict[int, list[Any]] = {}

    def keep(self, step: int, batch: Any, *, wanted: bool) -> None:
        for old in [s for s in self._steps if s < step]:
            del self._steps[old]
        if wanted and not self.given:
            self._steps.setdefault(step, []).append(batch_to_cpu(batch))

    def take(self, step: int, batch: Any) -> Any:
        """``batch`` if the runner gave one, else the kept batches of ``step`` as one (or ``None``)."""
        if batch is None and step in self._steps:
            return concat_batches(self._steps.pop(step))
        return batch


def tapped_record(
    gradients: Mapping[str, Tensor],
    *,
    client_id: int,
    round: int,
    model: nn.Module,
    batch: Any,
    meta: Mapping[str, Any],
) -> TappedGradient:
    """A :class:`TappedGradient` of one shared gradient: CPU copies of the gradient, the model's
    tensors (its weights that round) and ``batch`` (``None``: not recorded), detached from training.
    ``meta["batchnorm"]`` says the mode of the model's BatchNorm layers in the pass, unless ``meta`` does."""
    mode = batchnorm_mode(model)
    return TappedGradient(
        round=round,
        client_id=client_id,
        gradients={n: g.detach().to("cpu", copy=True) for n, g in gradients.items()},
        # tensors only: a module's extra state (e.g. Refiner's warm-start cache) is client-private
        model_state={
            n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items() if isinstance(t, Tensor)
        },
        model_class=f"{type(model).__module__}.{type(model).__qualname__}",
        batch=None if batch is None else batch_to_cpu(batch),
        meta={**({"batchnorm": mode} if mode is not None else {}), **meta},
    )


def batch_to_cpu(batch: Any) -> Any:
    """A detached CPU copy of a batch (tensors in tuples, lists and mappings; anything else as is)."""
    if isinstance(batch, Tensor):
        return batch.detach().to("cpu", copy=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(batch_to_cpu(b) for b in batch)
    if isinstance(batch, Mapping):
        return {k: batch_to_cpu(v) for k, v in batch.items()}
    return batch


def concat_batches(batches: list[Any]) -> Any:
    """The micro-batches of one optimizer step as one batch (tuples/lists of tensors concatenated)."""
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    if isinstance(first, (tuple, list)) and all(isinstance(t, Tensor) for t in first):
        return type(first)(torch.cat([b[i] for b in batches]) for i in range(len(first)))
    return batches
