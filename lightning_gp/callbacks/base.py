"""Lightning adapters for the shared-gradient pipeline: defense callbacks and observers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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
    defense's per-client state is saved in checkpoints and restored on resume, and so is what the
    callback itself keeps across steps (:meth:`adapter_state`: a cached sensitivity, a reused
    statistic). The checkpoint is saved under :meth:`config`, the defense's configuration and the
    callback's own :meth:`adapter_config`: resuming with other settings is an error naming them.

    Example::

        trainer = Trainer(callbacks=[MagnitudePruning(rate=0.8)])
    """

    def __init__(self, defense: Defense) -> None:
        if not isinstance(defense, Defense):
            raise TypeError(f"defense must be a lightning_gp.defenses.Defense, got {type(defense).__name__}")
        self.defense = defense
        # adapter_state came from the checkpoint this fit resumes: on_fit_start keeps it
        self._adapter_restored = False

    # ---------------------------------------------------------------- settings and state of the callback
    def adapter_config(self) -> dict[str, Any]:
        """The callback's own settings that change what it shares, beyond the defense's
        :meth:`~lightning_gp.defenses.Defense.config` (how a sensitivity is estimated, how often it
        is refreshed, which layer is defended). Part of :attr:`state_key`, so a resume with other
        settings is refused. Settings that only trade memory (``chunk_size``) and callables
        (``loss_fn``) are not part of it. Default: none."""
        return {}

    def config(self) -> dict[str, Any]:
        """The settings a checkpoint is saved under: the defense's configuration and the callback's
        :meth:`adapter_config`."""
        defense, adapter = self.defense.config(), self.adapter_config()
        clash = sorted(defense.keys() & adapter.keys())
        if clash:
            raise TypeError(f"{type(self).__name__}.adapter_config repeats the defense's settings {clash}")
        return {**defense, **adapter}

    def adapter_state(self) -> dict[str, Any]:
        """What the callback keeps across steps that changes later shared gradients (a cached
        sensitivity, a statistic reused for several steps), saved in checkpoints next to the
        defense's per-client state. Default: nothing."""
        return {}

    def load_adapter_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`adapter_state`. Called when a fit resumes from a Lightning checkpoint only
        (the steps it records are the trainer's global steps); a Flower client's rounds, each a
        fresh fit from step 0, start without it."""
        if state:
            raise ValueError(
                f"{type(self).__name__} keeps no state across steps, but the checkpoint holds {sorted(state)}"
            )

    def reset_adapter_state(self) -> None:
        """Forget :meth:`adapter_state` (at the start of a fit that does not resume a checkpoint)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if not self._adapter_restored:
            self.reset_adapter_state()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # after the restore on every strategy (some restore callbacks after on_fit_start)
        self._adapter_restored = False

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._adapter_restored = False  # a fit that failed before on_train_start

    @property
    def layerwise(self) -> bool:
        return self.defense.layerwise

    @property
    def prepares_rounds(self) -> bool:
        """The wrapped defense (or this callback) overrides ``begin_round``, e.g. ADGP's round mask."""
        return (
            type(self.defense).begin_round is not Defense.begin_round
            or type(self).begin_round is not GradientDefense.begin_round
        )

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
        return self._generate_state_key(**self.config())

    def state_dict(self) -> dict[str, Any]:
        return {
            "defense": self.defense.state_dict(),
            "callback": type(self).__qualname__,
            "config": self.config(),
            "adapter": self.adapter_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the adapter state is restored by on_load_checkpoint (a resumed fit), not here: a Flower
        # client loads this state into every round's fresh fit, whose steps start again at 0
        self.defense.load_state_dict(state_dict["defense"])

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning silently skips saved callback state whose key matches no callback; for a
        # defense that would drop every client's state, so a mismatch is an error.
        saved = {
            key: state
            for key, state in checkpoint.get("callbacks", {}).items()
            if isinstance(state, dict)
            and isinstance(state.get("defense"), dict)
            and "client_states" in state["defense"]
        }
        if saved and self.state_key not in saved:
            found = ", ".join(_saved_description(state) for state in saved.values())
            differing = self._differing_settings(saved.values())
            raise ValueError(
                f"the checkpoint holds defense state for {found}, but none for {self!r}"
                + (f" (settings that differ: {differing})" if differing else "")
                + "; resume with the defense callbacks (and settings) the run was started with"
            )
        state = saved.get(self.state_key)
        if state is not None and state.get("adapter"):
            self.load_adapter_state(state["adapter"])
            self._adapter_restored = True

    def _differing_settings(self, states: Iterable[Mapping[str, Any]]) -> str:
        """The settings of the closest saved state of this callback's kind that differ from this
        callback's, as ``"name: <saved> in the checkpoint, <current> now"``; empty when there is none."""
        mine = self.config()
        closest: list[str] | None = None
        for state in states:
            if (
                state.get("callback") != type(self).__qualname__
                or state["defense"].get("defense") != type(self.defense).__qualname__
                or not isinstance(state.get("config"), Mapping)
            ):
                continue
            theirs = state["config"]
            differ = [
                f"{name}: {_setting(theirs, name)} in the checkpoint, {_setting(mine, name)} now"
                for name in [*mine, *(n for n in theirs if n not in mine)]
                if name not in mine or name not in theirs or theirs[name] != mine[name]
            ]
            if differ and (closest is None or len(differ) < len(closest)):
                closest = differ
        return "; ".join(closest or [])

    def __repr__(self) -> str:
        return f"{type(self.defense).__name__}({_format_settings(self.config())})"


def _format_settings(config: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


def _setting(config: Mapping[str, Any], name: str) -> str:
    return repr(config[name]) if name in config else "not set"


def _saved_description(state: Mapping[str, Any]) -> str:
    """``Defense(settings)`` of one saved defense callback state (checkpoints written before the
    callback's own settings were saved record the defense's only)."""
    config = state.get("config", state["defense"].get("config", {}))
    return f"{state['defense'].get('defense', '?')}({_format_settings(config)})"


class SharedGradientObserver(SharedGradientCallback, ObserverStage):
    """A callback that sees every shared gradient after all defenses (taps, meters): implement
    :meth:`observe` (and optionally :meth:`observe_aggregate`)."""
