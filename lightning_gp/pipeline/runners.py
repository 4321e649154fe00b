"""Who runs the client step of a fit: the module, a callback, or the runner of the strategy."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_gp.pipeline.ddp import DDPClientStep
from lightning_gp.pipeline.local import LocalClientStep
from lightning_gp.pipeline.pipeline import ClientStepRunner, SharedGradientPipeline, trainer_callbacks


def resolve_runner(trainer: pl.Trainer, pl_module: pl.LightningModule) -> ClientStepRunner:
    """Who runs the client step: the module or a callback that implements
    :class:`ClientStepRunner`, else the runner of the trainer's strategy."""
    runners: list[Any] = [pl_module] if isinstance(pl_module, ClientStepRunner) else []
    runners += [cb for cb in trainer_callbacks(trainer) if isinstance(cb, ClientStepRunner)]
    if len(runners) > 1:
        names = " and ".join(type(r).__name__ for r in runners)
        raise ValueError(
            f"{names} each run the client step themselves; use one of them (e.g. DPSGD trains a plain "
            "LightningModule, FederatedSimulation simulates its own clients)"
        )
    if runners:
        return runners[0]
    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy):
        return DDPClientStep()
    if isinstance(strategy, SingleDeviceStrategy):
        return LocalClientStep()
    raise ValueError(
        f"gradient defenses run under a single-device strategy, DDP, or a FederatedSimulation; "
        f"{type(strategy).__name__} is not supported (sharded strategies split the gradient before a "
        "client could defend it)"
    )


def start_pipeline(trainer: pl.Trainer, pl_module: pl.LightningModule) -> ClientStepRunner:
    """Build the fit's pipeline from the trainer's stages (in the order given) and hand it to the
    fit's runner (:meth:`ClientStepRunner.start`), which holds and drives it; returns the runner."""
    runner = resolve_runner(trainer, pl_module)
    runner.start(trainer, pl_module, SharedGradientPipeline.from_trainer(trainer))
    return runner
