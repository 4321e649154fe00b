"""Lightning adapters for the shared-gradient pipeline: the one defense adapter and the observer base.

A pure :class:`~lightning_gp.defenses.Defense` becomes a callback by :class:`GradientDefense`
(``GradientDefense(MyDefense(...))``); the named callbacks (``MagnitudePruning``, ``Outpost``, ...)
are one-line subclasses declared with ``defense=``, whose keyword-only constructor is the
defense's own (plus the adapter's knobs, for the data-dependent ones): no copied defaults.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer

from lightning_gp.defenses.base import Defense, Gradients, Share
from lightning_gp.pipeline.pipeline import ClientStepRunner
from lightning_gp.pipeline.runners import resolve_runner, start_pipeline
from lightning_gp.pipeline.stages import ClientSetup, DefenseStage, ObserverStage, StageCall


class SharedGradientCallback(Callback):
    """Base of the callbacks on the path of the shared gradient (defenses and observers).

    The first such callback of a trainer starts the fit's pipeline at fit start
    (:func:`~lightning_gp.pipeline.start_pipeline`): it builds the one
    :class:`~lightning_gp.pipeline.SharedGradientPipeline` of the fit from the trainer's stages and
    hands it to the runner of the client step, which holds it and drives it (the DDP runner
    registers its communication hook; the local runner rewrites ``.grad`` from
    ``on_before_optimizer_step``, which this callback forwards). The stages themselves know no runner.
    """

    #: the runner of the fit this callback started (the last one, after the fit), else None
    runner: ClientStepRunner | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            resolve_runner(trainer, pl_module)  # fail early on unsupported strategies

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        first = next(cb for cb in trainer.callbacks if isinstance(cb, (DefenseStage, ObserverStage)))  # type: ignore[attr-defined]
        self.runner = start_pipeline(trainer, pl_module) if first is self else None

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self.runner is not None:
            self.runner.before_optimizer_step(trainer, pl_module, optimizer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        if self.runner is not None:
            self.runner.finish()  # the runner stays, for inspection after the fit; its pipeline goes


class GradientDefense(SharedGradientCallback, DefenseStage):
    """A Lightning callback that applies a :class:`~lightning_gp.defenses.Defense` to what a client shares.

    ``GradientDefense(defense)`` adapts any defense. A named callback is a subclass declared with the
    defense class it adapts, and takes the defense's arguments (keyword-only)::

        class MagnitudePruning(GradientDefense, defense=pruning.MagnitudePruning):
            ...  # a docstring: the paper and what the defense does

    Several defense callbacks compose in the order they are given to the ``Trainer``. The
    defense's per-client state is saved in checkpoints and restored on resume, and so is what the
    callback itself keeps across steps (:meth:`adapter_state`: a cached sensitivity, a reused
    statistic). The checkpoint is saved under :meth:`config`, the defense's configuration and the
    callback's own :meth:`adapter_config`: resuming with other settings is an error naming them.

    Example::

        trainer = Trainer(callbacks=[MagnitudePruning(rate=0.8)])
    """

    #: the defense class a named subclass adapts (set by ``defense=`` in its class statement)
    defense_class: ClassVar[type[Defense] | None] = None

    def __init_subclass__(cls, defense: type[Defense] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if defense is not None:
            cls.defense_class = defense
            cls.__init__ = _named_init(cls, defense)  # type: ignore[method-assign]

    def __init__(self, defense: Defense | None = None, /, **kwargs: Any) -> None:
        """``GradientDefense(defense, **knobs)`` adapts ``defense``; a named subclass takes the
        defense's arguments instead of the defense: ``MagnitudePruning(rate=0.8)``. ``knobs`` are
        the adapter's own settings (:meth:`adapt`), keyword-only."""
        cls = type(self)
        if cls.defense_class is not None:  # a named subclass: its __init__ takes keywords only
            names = _defense_parameters(cls.defense_class)
            defense = cls.defense_class(**{n: kwargs.pop(n) for n in names if n in kwargs})
        if not isinstance(defense, Defense):
            raise TypeError(f"defense must be a lightning_gp.defenses.Defense, got {type(defense).__name__}")
        unknown = sorted(set(kwargs) - set(_adapt_parameters(cls)))
        if unknown:
            known = [*(_defense_parameters(cls.defense_class) if cls.defense_class else []), *_adapt_parameters(cls)]
            takes = ", ".join(known) or "no settings besides the defense"
            raise TypeError(f"{cls.__name__} got unexpected arguments {unknown}; it takes {takes}")
        self.defense = defense
        # adapter_state came from the checkpoint this fit resumes: on_fit_start keeps it
        self._adapter_restored = False
        self.adapt(**kwargs)

    def adapt(self) -> None:
        """Take the adapter's own settings, keyword-only (a data-dependent adapter: how it estimates
        its statistic). Default: none."""
        return

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
        if setup.cohort_size is not None:
            self.defense.check_cohort(setup.cohort_size)

    def begin_round(
        self, round: int, clients: Sequence[int], local_gradients: Mapping[int, Gradients], share: Share
    ) -> None:
        self.defense.begin_round(round, clients, local_gradients, share)

    def defense_inputs(self, gradients: Mapping[str, Tensor], call: StageCall) -> dict[str, Any]:
        """What the defense takes besides the gradient (its :meth:`~lightning_gp.defenses.Defense.prepare`
        arguments) for this call: the model's current weights for a defense that
        :attr:`~lightning_gp.defenses.Defense.reads_weights`; the data-dependent adapters add the
        statistic of the client's batch. Default: nothing else."""
        if not self.defense.reads_weights:
            return {}
        params = dict(call.model.named_parameters())
        return {"weights": {n: params[n].detach() for n in gradients if n in params}}

    def defend(self, gradients: Mapping[str, Tensor], call: StageCall) -> dict[str, Tensor]:
        """One client's gradient through this defense (the pipeline calls this)."""
        return self.defense(dict(gradients), call.client_id, **self.defense_inputs(gradients, call))

    def defend_into(
        self, gradients: Mapping[str, Tensor], out: Mapping[str, Tensor], call: StageCall
    ) -> dict[str, Tensor]:
        return self.defense(gradients, call.client_id, out=out, **self.defense_inputs(gradients, call))

    def defend_layers(self, gradients: Mapping[str, Tensor], call: StageCall) -> dict[str, Tensor]:
        return self.defense.defend_layers(gradients, call.client_id)

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


def _defense_parameters(defense: type[Defense]) -> list[str]:
    return list(inspect.signature(defense.__init__).parameters)[1:]


def _adapt_parameters(cls: type[GradientDefense]) -> list[str]:
    return list(inspect.signature(cls.adapt).parameters)[1:]


def _named_init(cls: type[GradientDefense], defense: type[Defense]) -> Callable[..., None]:
    """The ``__init__`` of a named adapter, with the signature LightningCLI and ``help()`` read:
    the defense's arguments, then the adapter's (:meth:`GradientDefense.adapt`), all keyword-only."""
    parameters = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for function in (defense.__init__, cls.adapt)
        for p in list(inspect.signature(function, eval_str=True).parameters.values())[1:]
    ]
    clash = sorted(set(_defense_parameters(defense)) & set(_adapt_parameters(cls)))
    if clash:
        raise TypeError(f"{cls.__name__}: the adapter's settings {clash} repeat {defense.__name__}'s arguments")

    def __init__(self: GradientDefense, **kwargs: Any) -> None:
        GradientDefense.__init__(self, **kwargs)

    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *parameters]
    )
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__doc__ = (
        f"The arguments of :class:`{defense.__module__}.{defense.__name__}`, then the adapter's settings."
    )
    return __init__


class SharedGradientObserver(SharedGradientCallback, ObserverStage):
    """A callback that sees every shared gradient after all defenses (taps, meters): implement
    :meth:`observe` (and optionally :meth:`observe_aggregate`)."""
