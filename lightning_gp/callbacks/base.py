"""Lightning adapters for the shared-gradient pipeline: defense callbacks and observers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_gp.callbacks.interfaces import ClientSetup, ClientStepRunner, DefenseStage, ObserverStage
from lightning_gp.callbacks.pipeline import SharedGradientPipeline
from lightning_gp.callbacks.runners import resolve_runner
from lightning_gp.defenses.base import Defense, Gradients, Share


class SharedGradientCallback(Callback):
    """Base of the callbacks on the path of the shared gradient (defenses and observers).

    The first such callback of a trainer sets the pipeline up at fit start: it resolves who runs
    the client step (:func:`~lightning_gp.callbacks.runners.resolve_runner`), declares the run's
    clients and shared layers to every stage, and lets the runner hook into training (the DDP
    runner registers its communication hook; the local runner rewrites ``.grad`` from
    ``on_before_optimizer_step``). The callbacks themselves know no runner.
    """

    runner: ClientStepRunner | None = None  # the fit's runner, on the driving callback only

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            resolve_runner(trainer, pl_module)  # fail early on unsupported strategies

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pipeline = SharedGradientPipeline.from_trainer(trainer)
        if pipeline.members[0] is not self:
            self.runner = None
            return
        runner = resolve_runner(trainer, pl_module)
        pipeline.bind(runner.client_setup(trainer, pl_module), runner)
        runner.attach(trainer, pl_module, pipeline)
        self.runner = runner

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self.runner is not None:
            self.runner.before_optimizer_step(
                trainer, pl_module, optimizer, SharedGradientPipeline.from_trainer(trainer)
            )


class GradientDefense(SharedGradientCallback, DefenseStage):
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

    @property
    def layerwise(self) -> bool:
        return self.defense.layerwise

    def bind(self, setup: ClientSetup) -> None:
        self.defense.set_num_clients(setup.num_clients)
        self.defense.check_layer_shapes(setup.shapes)

    def begin_round(
        self, round: int, clients: Sequence[int], local_gradients: Mapping[int, Gradients], share: Share
    ) -> None:
        self.defense.begin_round(round, clients, local_gradients, share)

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
        if type(self).defend is not GradientDefense.defend:
            # a subclass hands the defense more than the gradient (a sensitivity, the weights):
            # its own defend, then a copy
            return super().defend_into(
                gradients, out, client_id=client_id, round=round, model=model, batch=batch, meta=meta
            )
        return self.defense(gradients, client_id, out=out)

    def defend_layers(
        self, gradients: Mapping[str, Tensor], *, client_id: int, round: int, model: nn.Module, meta: Mapping[str, Any]
    ) -> dict[str, Tensor]:
        return self.defense.defend_layers(gradients, client_id)

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


class SharedGradientObserver(SharedGradientCallback, ObserverStage):
    """A callback that sees every shared gradient after all defenses (taps, meters): implement
    :meth:`observe` (and optionally :meth:`observe_aggregate`)."""
