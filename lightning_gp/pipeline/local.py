"""The local runner: one process is one client, and the pipeline defends ``.grad`` in place."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.optim import Optimizer

from lightning_gp.defenses.base import share_in_process
from lightning_gp.pipeline.pipeline import ClientStepRunner, SharedGradientPipeline
from lightning_gp.pipeline.stages import ClientSetup, StageCall


def stepped_parameters(module: nn.Module, optimizer: Optimizer) -> dict[str, nn.Parameter]:
    """The trainable parameters of ``module`` that ``optimizer`` steps, by name (what a client shares)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {n: p for n, p in module.named_parameters() if p.requires_grad and id(p) in stepped}


def single_optimizer(trainer: pl.Trainer) -> Optimizer:
    if len(trainer.optimizers) != 1:
        raise ValueError(
            f"gradient defenses support exactly one optimizer, this module configures {len(trainer.optimizers)}"
        )
    return trainer.optimizers[0]


def parameter_setup(trainer: pl.Trainer, module: nn.Module) -> ClientSetup:
    """One client per process (rank); it shares the gradient of the parameters its optimizer steps."""
    params = stepped_parameters(module, single_optimizer(trainer))
    if not params:
        raise ValueError("the optimizer steps none of the module's trainable parameters: no gradient to share")
    return ClientSetup(trainer.world_size, module, {n: p.shape for n, p in params.items()})


@torch.no_grad()
def defend_parameter_gradients(
    pipeline: SharedGradientPipeline,
    module: nn.Module,
    optimizer: Optimizer,
    *,
    client_id: int,
    round: int,
    path: str,
) -> None:
    """Run the pipeline on the ``.grad`` of ``module``'s parameters that ``optimizer`` steps.

    A trainable parameter without a gradient this step is shared as zeros (as DDP does), and
    keeps ``grad=None`` unless a defense (error feedback) sends something for it.
    """
    params = stepped_parameters(module, optimizer)
    gradients = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}
    meta = {"path": path}
    pipeline.begin_round(round, [client_id], {client_id: gradients}, share_in_process, model=module, meta=meta)
    # defended in place: .grad holds the shared gradient, with no model-sized temporaries
    shared = pipeline.process(gradients, StageCall(client_id, round, module, meta=meta), out=gradients)
    pipeline.finish_round(shared, round=round, clients=1)  # one client: it downloads what it sent
    for name, p in params.items():
        if p.grad is None and shared[name].any():
            p.grad = shared[name]  # the zeros made above, now holding what error feedback sent


class LocalClientStep(ClientStepRunner):
    """One process is one client: defend ``.grad`` once per optimizer step (after gradient
    accumulation, before gradient clipping and the step)."""

    execution_path = "local"

    def client_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ClientSetup:
        return parameter_setup(trainer, pl_module)

    def before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        defend_parameter_gradients(
            self.fit_pipeline(),
            pl_module,
            optimizer,
            client_id=trainer.global_rank,
            round=trainer.global_step,
            path="local",
        )
