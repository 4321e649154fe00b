"""The path a client's gradient takes to the server: defenses in order, then observers.

client gradient -> defense 1 -> ... -> defense n -> **shared gradient** -> observers (taps, meters)

One pipeline serves the three places a defense can run (DESIGN.md, "Where a defense runs"):
``"local"`` (one process is one client: the callbacks rewrite ``.grad`` once per optimizer step),
``"ddp"`` (one rank is one client: a communication hook defends before the all-reduce) and
``"simulation"`` (a :class:`~lightning_gp.federated.FederatedSimulation` runs many clients in one
process and calls :meth:`SharedGradientPipeline.process` for each).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import Tensor, nn

from lightning_gp.defenses.base import Gradients, Share

if TYPE_CHECKING:
    from lightning_gp.callbacks.base import GradientDefense, SharedGradientCallback, SharedGradientObserver

ExecutionPath = Literal["local", "ddp", "simulation"]


def client_module(pl_module: pl.LightningModule) -> nn.Module:
    """The model whose gradient a client shares: the simulated client model, or the module itself."""
    return pl_module.client_module if getattr(pl_module, "defends_per_client", False) else pl_module


def execution_path(trainer: pl.Trainer, pl_module: pl.LightningModule) -> ExecutionPath:
    if getattr(pl_module, "defends_per_client", False):
        return "simulation"
    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy):
        return "ddp"
    if isinstance(strategy, SingleDeviceStrategy):
        return "local"
    raise ValueError(
        f"gradient defenses run under a single-device strategy, DDP, or a FederatedSimulation; "
        f"{type(strategy).__name__} is not supported (sharded strategies split the gradient before a "
        "client could defend it)"
    )


class SharedGradientPipeline:
    """The defense and observer callbacks of a trainer, in the order the user gave them."""

    def __init__(self, defenses: list[GradientDefense], observers: list[SharedGradientObserver]) -> None:
        self.defenses = defenses
        self.observers = observers

    @classmethod
    def from_trainer(cls, trainer: pl.Trainer) -> SharedGradientPipeline:
        from lightning_gp.callbacks.base import GradientDefense, SharedGradientObserver

        callbacks = trainer.callbacks
        return cls(
            [cb for cb in callbacks if isinstance(cb, GradientDefense)],
            [cb for cb in callbacks if isinstance(cb, SharedGradientObserver)],
        )

    @property
    def driver(self) -> SharedGradientCallback | None:
        """The callback that runs the pipeline for the local and DDP paths (the first one)."""
        members = [*self.defenses, *self.observers]
        return members[0] if members else None

    def __len__(self) -> int:
        return len(self.defenses) + len(self.observers)

    def bind(self, num_clients: int, model: nn.Module) -> None:
        """Declare the run's clients and check restored defense state against the model."""
        shapes = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
        for callback in self.defenses:
            callback.defense.set_num_clients(num_clients)
            callback.defense.check_layer_shapes(shapes)

    def begin_round(
        self, round: int, clients: list[int], local_gradients: Mapping[int, Gradients], share: Share
    ) -> None:
        """Let every defense prepare the round (e.g. ADGP's shared mask) before clients are defended."""
        for callback in self.defenses:
            callback.defense.begin_round(round, clients, local_gradients, share)

    def finish_round(self, update: Mapping[str, Tensor], *, round: int, clients: int) -> None:
        """Show the aggregated update (what every client downloads) to the observers."""
        for observer in self.observers:
            observer.observe_aggregate(update, round=round, clients=clients)

    def process(
        self,
        gradients: Mapping[str, Tensor],
        *,
        client_id: int,
        round: int,
        model: nn.Module,
        batch: Any = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Gradients:
        """Defend one client's gradient and show the shared result to every observer."""
        shared = dict(gradients)
        for callback in self.defenses:
            shared = callback.defend(
                shared, client_id=client_id, round=round, model=model, batch=batch, meta=meta or {}
            )
        for observer in self.observers:
            observer.observe(shared, client_id=client_id, round=round, model=model, batch=batch, meta=meta or {})
        return shared
