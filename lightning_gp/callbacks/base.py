"""Lightning adapters for the shared-gradient pipeline: defense callbacks and observers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_gp.callbacks.ddp import register_defended_allreduce
from lightning_gp.callbacks.pipeline import SharedGradientPipeline, client_module, execution_path
from lightning_gp.defenses.base import Defense, share_in_process


class SharedGradientCallback(Callback):
    """Base of the callbacks that act on the gradient a client shares.

    The first such callback of a trainer drives the pipeline: on a single device it rewrites
    ``.grad`` once per optimizer step (after gradient accumulation, before clipping and the
    step); under DDP it registers a communication hook that defends each rank's gradient before
    the all-reduce. Inside a :class:`~lightning_gp.federated.FederatedSimulation` the simulation
    drives the pipeline per client and these hooks stand aside.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            execution_path(trainer, pl_module)  # fail early on unsupported strategies

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pipeline = SharedGradientPipeline.from_trainer(trainer)
        if pipeline.driver is not self:
            return
        path = execution_path(trainer, pl_module)
        if path == "simulation":
            pipeline.bind(pl_module.num_clients, client_module(pl_module))
            return
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"gradient defenses support exactly one optimizer, this module configures {len(trainer.optimizers)}"
            )
        pipeline.bind(trainer.world_size, pl_module)
        if path == "ddp":
            self.comm_hook = register_defended_allreduce(trainer, pl_module)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        from lightning_gp.callbacks.dp_sgd import DPSGD  # local: dp_sgd imports this module

        if any(isinstance(cb, DPSGD) for cb in trainer.callbacks):
            return  # Opacus replaces .grad after this hook; DPSGD's step hook runs the pipeline instead
        pipeline = SharedGradientPipeline.from_trainer(trainer)
        if pipeline.driver is self and execution_path(trainer, pl_module) == "local":
            defend_parameter_gradients(
                pipeline, pl_module, optimizer, client_id=trainer.global_rank, round=trainer.global_step
            )


class GradientDefense(SharedGradientCallback):
    """A Lightning callback that applies a :class:`~lightning_gp.defenses.Defense` to what a client shares.

    Several defense callbacks compose in the order they are given to the ``Trainer``. The
    defense's per-client state is saved in checkpoints and restored on resume.

    Example::

        trainer = Trainer(callbacks=[MagnitudePruning(rate=0.8)])
    """

    def __init__(self, defense: Defense) -> None:
        if not isinstance(defense, Defense):
            raise TypeError(f"defense must be a lightning_gp.defenses.Defense, got {type(defense).__name__}")
        self.defense = defense

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
        """One client's gradient through this defense (the pipeline calls this; data-dependent
        defenses also use the model and the client's batch)."""
        return self.defense(gradients, client_id)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(**self.defense.config())

    def state_dict(self) -> dict[str, Any]:
        return {"defense": self.defense.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.defense.load_state_dict(state_dict["defense"])

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning silently skips saved callback state whose key matches no callback; for a
        # defense that would drop every client's state, so a mismatch is an error.
        saved = {
            key: state["defense"]
            for key, state in checkpoint.get("callbacks", {}).items()
            if isinstance(state, dict)
            and isinstance(state.get("defense"), dict)
            and "client_states" in state["defense"]
        }
        if saved and self.state_key not in saved:
            found = ", ".join(
                f"{s['defense']}({', '.join(f'{k}={v!r}' for k, v in s['config'].items())})" for s in saved.values()
            )
            raise ValueError(
                f"the checkpoint holds defense state for {found}, but none for {self!r}; resume with the "
                "defense callbacks (and settings) the run was started with"
            )

    def __repr__(self) -> str:
        return repr(self.defense)


class SharedGradientObserver(SharedGradientCallback):
    """A callback that sees every shared gradient after all defenses (taps, meters)."""

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
        raise NotImplementedError

    def observe_aggregate(self, update: Mapping[str, Tensor], *, round: int, clients: int) -> None:
        """See the aggregated update the clients download after a round (default: nothing)."""


@torch.no_grad()
def defend_parameter_gradients(
    pipeline: SharedGradientPipeline, module: nn.Module, optimizer: Optimizer, *, client_id: int, round: int
) -> None:
    """Run the pipeline on the ``.grad`` of ``module``'s parameters that ``optimizer`` steps.

    A trainable parameter without a gradient this step is shared as zeros (as DDP does), and
    keeps ``grad=None`` unless a defense (error feedback) sends something for it.
    """
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    params = {n: p for n, p in module.named_parameters() if p.requires_grad and id(p) in stepped}
    gradients = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}
    pipeline.begin_round(round, [client_id], {client_id: gradients}, share_in_process)
    shared = pipeline.process(gradients, client_id=client_id, round=round, model=module, meta={"path": "local"})
    pipeline.finish_round(shared, round=round, clients=1)  # one client: it downloads what it sent
    for name, p in params.items():
        if p.grad is not None:
            p.grad.copy_(shared[name])
        elif shared[name].any():
            p.grad = shared[name].clone()
