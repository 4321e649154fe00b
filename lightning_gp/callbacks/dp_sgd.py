"""Formal differential privacy: DP-SGD (Abadi et al., 2016) through Opacus, as a Lightning callback.

Importing this module imports :mod:`lightning_gp.dp_sgd`, which registers its Conv2d norm sampler with
Opacus (``register_norm_sampler(nn.Conv2d)``, process-wide) for Opacus' ghost clipping.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from opacus import GradSampleModule
from opacus.accountants import IAccountant, create_accountant
from opacus.accountants.utils import get_noise_multiplier
from opacus.data_loader import DPDataLoader
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import DataLoader

from lightning_gp.attacks.adaptive import dp_sgd_knowledge
from lightning_gp.attacks.noise_aware import noise_aware_attacks
from lightning_gp.attacks.registry import register_defense_knowledge
from lightning_gp.dp_sgd import BookKeeping, trainable_layers
from lightning_gp.pipeline.local import defend_parameter_gradients, parameter_setup
from lightning_gp.pipeline.pipeline import ClientStepRunner
from lightning_gp.pipeline.stages import ClientSetup
from lightning_gp.validation import check_bool, check_choice, check_nonnegative, check_number, check_positive

ACCOUNTANTS = ("prv", "rdp", "gdp")
#: How per-example gradients are clipped: ``"auto"`` picks ``"book_keeping"`` where the model allows it.
GRAD_SAMPLE_MODES = ("auto", "hooks", "ghost", "book_keeping")
_STATE = "dp_sgd"  # marks this callback's entry among a checkpoint's callback states
_PARAM_ATTRS = ("grad_sample", "summed_grad", "_forward_counter", "_current_grad_sample", "_norm_sample")
_MODULE_ATTRS = ("activations", "max_batch_len")


class DPSGD(Callback, ClientStepRunner):
    """Train with DP-SGD: clip each example's gradient, add Gaussian noise, account the privacy spent.

    This is the package's *formal* differential-privacy path (Abadi et al., "Deep Learning with
    Differential Privacy", CCS 2016), built on Opacus (Yousefpour et al., 2021) through its public
    API: ``GradSampleModule`` computes per-example gradients, ``DPOptimizer`` clips them to
    ``max_grad_norm``, sums them, adds ``N(0, (noise_multiplier * max_grad_norm)^2)`` noise and
    divides by the expected batch size, and an Opacus accountant turns the steps taken into an
    ``(epsilon, delta)`` guarantee, logged as ``dp_epsilon`` at the end of every training epoch.
    The optimal-noise and pruning defenses of this package report no epsilon: they are judged by
    the attacks they resist, not by a DP guarantee.

    The clipped and noised gradient is the gradient the client shares: defense callbacks given to
    the same ``Trainer`` (e.g. :class:`~lightning_gp.callbacks.DualGradientPruning`) run on it,
    wherever they stand in the callback list (DP first, then the defenses in their order),
    and observers (:class:`~lightning_gp.callbacks.GradientTap`,
    :class:`~lightning_gp.callbacks.CommunicationMeter`) record it, from the optimizer's step hook
    right after Opacus noises it. Anything done after the noise is post-processing and keeps the
    guarantee.

    Poisson sampling (each example joins a batch independently with probability ``q``), which the
    accountants assume, replaces the sampler of the training loader: the callback wraps the
    ``train_dataloader`` of the datamodule (or of the LightningModule) with
    ``DPDataLoader.from_data_loader`` for the duration of the fit, with ``q = 1 / len(loader)``
    (the expected batch size stays the loader's batch size). A loader passed directly to
    ``Trainer.fit(train_dataloaders=...)`` cannot be wrapped: pass a datamodule or wrap it
    yourself. ``poisson_sampling=False`` keeps the loader as it is (shuffled fixed-size batches);
    the reported epsilon then assumes a sampling the run did not do and is only indicative.

    How the per-example gradients are clipped (``grad_sample_mode``); every mode forms the same
    clipped sum (to float precision), adds the same noise and accounts the same way:

    - ``"hooks"``: Opacus' ``GradSampleModule`` instantiates every example's gradient in backward
      hooks and ``DPOptimizer`` clips and sums them (about 2.5x a plain step).
    - ``"ghost"``: Opacus' ghost clipping (``GradSampleModuleFastGradientClipping`` and
      ``DPOptimizerFastGradientClipping``): per-example norms without instantiation, then a second
      backward pass with each example's output gradient scaled by its clip factor. Conv2d layers use
      :func:`lightning_gp.dp_sgd.conv2d_norm_sample`. It rescales the gradient of the module's output,
      so ``training_step`` must compute its loss from one call of the LightningModule (``self(x)``).
    - ``"book_keeping"``: :class:`lightning_gp.dp_sgd.BookKeeping` (Bu et al., ICML 2023): one backward
      pass to the layers' outputs, the per-example norms from them and the clipped sum formed
      directly; ``DPOptimizerFastGradientClipping`` adds the noise. It replaces the LightningModule's
      ``backward`` for the fit, and handles ``nn.Linear``, ``nn.Conv2d`` and the layers Opacus has
      grad samplers for (GroupNorm, LayerNorm, Embedding, ...).
    - ``"auto"`` (default): ``"book_keeping"`` when every layer with trainable parameters is one it
      handles, no parameter is shared between layers and the module does not override ``backward``;
      ``"hooks"`` otherwise. :attr:`grad_sample_mode_used` says which mode ran.

    Supported: one process (a single-device strategy), automatic optimization with one optimizer,
    no gradient accumulation, no gradient scaler, a model Opacus can compute per-example
    gradients for (no BatchNorm) and one forward pass per training step. The accountant's history
    is saved in checkpoints, so epsilon continues across a resume; one callback instance also
    keeps accounting across repeated ``fit`` calls.

    Args:
        noise_multiplier: noise std relative to ``max_grad_norm`` (``sigma``); give this or
            ``target_epsilon``. ``0`` clips without noise (epsilon is infinite).
        target_epsilon: pick ``sigma`` so that the whole run (``max_epochs``/``max_steps``) spends
            this epsilon at ``delta`` (``opacus.accountants.utils.get_noise_multiplier``).
        max_grad_norm: per-example L2 clipping bound ``C``.
        delta: the ``delta`` of the guarantee; ``None`` uses ``1 / n**1.1`` for ``n`` training
            examples (below ``1 / n``, as the guarantee requires).
        accountant: ``"prv"`` (default, tightest), ``"rdp"`` or ``"gdp"`` (experimental in Opacus).
        poisson_sampling: wrap the training loader for Poisson sampling (see above).
        secure_mode: Opacus's noise hardened against floating-point attacks, and a Poisson
            sampler seeded from the OS's entropy instead of the loader's generator. It does not
            make PyTorch's generator cryptographically secure.
        stop_at_epsilon: a privacy budget: ``Trainer.fit`` ends cleanly (``trainer.should_stop``;
            the epoch ends, so ``ModelCheckpoint`` still writes its checkpoint) as soon as the *next*
            step would spend more than this epsilon at ``delta``, by the same accountant. The steps
            the budget allows are counted once at fit start (:attr:`steps_within_budget`), so the
            stop costs no accounting per step. ``None``: no budget.
        grad_sample_mode: ``"auto"``, ``"hooks"``, ``"ghost"`` or ``"book_keeping"`` (see above); it
            changes the cost of a step, not its privacy, so it is not part of :attr:`state_key` (a run
            may resume in another mode).

    Example::

        Trainer(max_epochs=10, callbacks=[DPSGD(target_epsilon=3.0, max_grad_norm=1.0), GradientTap()])
    """

    def __init__(
        self,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        max_grad_norm: float = 1.0,
        delta: float | None = None,
        accountant: str = "prv",
        poisson_sampling: bool = True,
        secure_mode: bool = False,
        stop_at_epsilon: float | None = None,
        grad_sample_mode: str = "auto",
    ) -> None:
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError(
                f"give exactly one of noise_multiplier and target_epsilon, got noise_multiplier={noise_multiplier!r} "
                f"and target_epsilon={target_epsilon!r}"
            )
        if noise_multiplier is not None:
            check_nonnegative(noise_multiplier, "noise_multiplier")
        if target_epsilon is not None:
            check_positive(target_epsilon, "target_epsilon")
        check_positive(max_grad_norm, "max_grad_norm")
        if delta is not None:
            check_number(delta, "delta", low=0.0, high=1.0, low_open=True, high_open=True)
        check_choice(accountant, "accountant", ACCOUNTANTS)
        check_bool(poisson_sampling, "poisson_sampling")
        check_bool(secure_mode, "secure_mode")
        if stop_at_epsilon is not None:
            check_positive(stop_at_epsilon, "stop_at_epsilon")
        check_choice(grad_sample_mode, "grad_sample_mode", GRAD_SAMPLE_MODES)
        self.noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.target_epsilon = None if target_epsilon is None else float(target_epsilon)
        self.max_grad_norm = float(max_grad_norm)
        self.delta = None if delta is None else float(delta)
        self.accountant = accountant
        self.poisson_sampling = poisson_sampling
        self.secure_mode = secure_mode
        self.stop_at_epsilon = None if stop_at_epsilon is None else float(stop_at_epsilon)
        self.steps_within_budget: int | None = None  # with stop_at_epsilon: the steps the budget allows
        self.grad_sample_mode = grad_sample_mode
        self.grad_sample_mode_used: str | None = None  # the mode the last fit ran in ("auto" resolved)

        self.privacy_accountant: IAccountant | None = None  # the Opacus accountant, once training starts
        self.noise_multiplier_used: float | None = None
        self.sample_rate: float | None = None
        self.expected_batch_size: int | None = None
        self.target_delta: float | None = None  # the delta in use (``delta`` or its default)
        self._pending_state: dict[str, Any] | None = None
        self._wrapped_loader: tuple[Any, bool, Any] | None = None
        self._grad_sample_module: GradSampleModule | GradSampleModuleFastGradientClipping | None = None
        self._new_module_attrs: list[tuple[nn.Module, str]] = []
        self._original_optimizer: torch.optim.Optimizer | None = None
        self._dp_optimizer: DPOptimizer | None = None
        self._module: pl.LightningModule | None = None  # the module the DP machinery is attached to
        self._book_keeping: BookKeeping | None = None
        self._backward_override: tuple[bool, Any] | None = None  # (had its own backward, that backward)
        self._output_hook: Any = None  # ghost: the handle of the hook that keeps the module's output
        self._outputs: list[Any] = []

    # ------------------------------------------------------------------ configuration

    def describe_defenses(self) -> list[dict[str, Any]]:
        """DP-SGD clips and noises before the defense stages: recorded first in ``meta["defenses"]``
        (with the mode that ran, ``grad_sample_mode_used``)."""
        config = {**self.config(), "grad_sample_mode": self.grad_sample_mode}
        return [
            {"name": type(self).__name__, "config": {**config, "grad_sample_mode_used": self.grad_sample_mode_used}}
        ]

    def config(self) -> dict[str, Any]:
        """The privacy settings (what :attr:`state_key` and ``repr`` are made of; ``grad_sample_mode``,
        which changes only the cost, is in :meth:`describe_defenses`)."""
        return {
            "noise_multiplier": self.noise_multiplier,
            "target_epsilon": self.target_epsilon,
            "max_grad_norm": self.max_grad_norm,
            "delta": self.delta,
            "accountant": self.accountant,
            "poisson_sampling": self.poisson_sampling,
            "stop_at_epsilon": self.stop_at_epsilon,
        }

    @property
    def state_key(self) -> str:
        return self._generate_state_key(**self.config())

    def __repr__(self) -> str:
        settings = dict(self.config())
        if self.grad_sample_mode != "auto":
            settings["grad_sample_mode"] = self.grad_sample_mode
        return f"DPSGD({', '.join(f'{k}={v!r}' for k, v in settings.items())})"

    # ------------------------------------------------------------------ the client step
    # DPSGD runs the client step: Opacus writes the clipped, noised gradient into .grad inside the
    # optimizer's step, after Lightning's on_before_optimizer_step, so the pipeline runs from the
    # DPOptimizer's step hook instead (see on_train_start).
    execution_path = "dp_sgd"
    formal_privacy = True

    def client_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ClientSetup:
        return parameter_setup(trainer, pl_module)

    # ------------------------------------------------------------------ privacy spent

    @property
    def steps(self) -> int:
        """Noised optimizer steps accounted so far (including those of a resumed checkpoint)."""
        history = self._history()
        return sum(int(n) for _, _, n in history)

    def get_epsilon(self, delta: float | None = None) -> float:
        """The epsilon spent so far at ``delta`` (default: :attr:`target_delta`)."""
        delta = self.target_delta if delta is None else delta
        history = self._history()
        if not history:
            return 0.0
        if delta is None:
            raise RuntimeError("delta is not known before training starts; pass delta=")
        if any(sigma == 0 for sigma, _, _ in history):
            return math.inf  # no noise, no privacy (Opacus's PRV accountant overflows here)
        accountant = self.privacy_accountant if self.privacy_accountant is not None else self._restored_accountant()
        return float(accountant.get_epsilon(delta=delta))

    @property
    def epsilon(self) -> float:
        """The epsilon spent so far at :attr:`target_delta`."""
        return self.get_epsilon()

    @property
    def privacy_history(self) -> list[tuple[float, float, int]]:
        """The accountant's history: ``(noise_multiplier, sample_rate, steps)`` per stretch of training."""
        return [(float(s), float(q), int(n)) for s, q, n in self._history()]

    def _history(self) -> list:
        if self.privacy_accountant is not None:
            return list(self.privacy_accountant.history)
        if self._pending_state is not None:
            return list(self._pending_state["accountant"]["history"])
        return []

    def _restored_accountant(self) -> IAccountant:
        if self._pending_state is None:
            raise RuntimeError("no accountant state to restore")
        accountant = create_accountant(mechanism=self.accountant)
        accountant.load_state_dict(self._pending_state["accountant"])
        return accountant

    # ------------------------------------------------------------------ Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if isinstance(pl_module, ClientStepRunner):
            raise ValueError(
                f"DPSGD trains one model on one process's data; it does not support a {type(pl_module).__name__}, "
                "which runs its own clients (e.g. a FederatedSimulation). Use it with a plain LightningModule "
                "(e.g. lightning_gp.models.ImageClassifier) on a single device"
            )
        if not isinstance(trainer.strategy, SingleDeviceStrategy):
            raise ValueError(
                f"DPSGD supports a single-device strategy (one process, e.g. Trainer(devices=1)); "
                f"{type(trainer.strategy).__name__} is not supported"
            )
        if not pl_module.automatic_optimization:
            raise ValueError(
                "DPSGD supports automatic optimization only (the optimizer step must be Lightning's); "
                "set automatic_optimization = True"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"DPSGD does not support gradient accumulation (accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}): Poisson sampling draws one batch per step. Use "
                "accumulate_grad_batches=1 and set the expected batch size with the loader's batch_size"
            )
        if self.stop_at_epsilon is not None and (trainer.fit_loop.min_steps or trainer.fit_loop.min_epochs):
            raise ValueError(
                f"DPSGD(stop_at_epsilon={self.stop_at_epsilon:g}) stops the fit at the budget, but min_steps/min_epochs "
                "would keep it training past it; remove Trainer(min_steps=..., min_epochs=...)"
            )
        if trainer.gradient_clip_val:
            raise ValueError(
                f"DPSGD clips each example's gradient to max_grad_norm itself; remove gradient_clip_val="
                f"{trainer.gradient_clip_val!r} (Lightning would clip the batch gradient before Opacus replaces it)"
            )
        if trainer.scaler is not None:
            raise ValueError(
                "DPSGD does not support a gradient scaler (precision='16-mixed'): the scaled per-example "
                "gradients would be clipped. Use precision 32, 64 or 'bf16-mixed'"
            )
        _check_module(pl_module)
        self.grad_sample_mode_used = self._resolve_mode(pl_module)
        if self.poisson_sampling and self._wrapped_loader is None:
            datamodule = getattr(trainer, "datamodule", None)
            owner = datamodule if is_overridden("train_dataloader", datamodule) else None
            if owner is None and is_overridden("train_dataloader", pl_module):
                owner = pl_module
            if owner is not None:
                self._wrap_train_dataloader(owner)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"DPSGD supports exactly one optimizer, this module configures {len(trainer.optimizers)}")
        loader = trainer.train_dataloader
        if self.poisson_sampling and not isinstance(loader, DPDataLoader):
            raise ValueError(
                "DPSGD(poisson_sampling=True) needs the training batches Poisson-sampled, but the train loader is "
                f"a {type(loader).__name__}: a loader given to Trainer.fit(train_dataloaders=...) cannot be "
                "wrapped. Pass the data as a LightningDataModule (or define the LightningModule's "
                "train_dataloader), wrap the loader with opacus.data_loader.DPDataLoader.from_data_loader(loader), "
                "or use DPSGD(poisson_sampling=False)"
            )
        if not isinstance(loader, DataLoader) or not hasattr(loader.dataset, "__len__"):
            raise ValueError(f"DPSGD needs one DataLoader over a dataset of known size, got {type(loader).__name__}")
        n = len(loader.dataset)
        self.sample_rate = float(loader.sample_rate) if isinstance(loader, DPDataLoader) else 1.0 / len(loader)
        self.expected_batch_size = max(1, round(n * self.sample_rate))
        self.target_delta = self.delta if self.delta is not None else 1.0 / n**1.1

        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.privacy_accountant = create_accountant(mechanism=self.accountant)
            self.privacy_accountant.load_state_dict(state["accountant"])
            self.noise_multiplier_used = state["noise_multiplier"]
        elif self.privacy_accountant is None:
            self.privacy_accountant = create_accountant(mechanism=self.accountant)
            self.noise_multiplier_used = self.noise_multiplier
        if self.noise_multiplier_used is None:
            self.noise_multiplier_used = self._calibrate_noise(trainer)

        original = trainer.optimizers[0]
        optimizer = self._attach(pl_module, original)
        account = self.privacy_accountant.get_optimizer_hook_fn(sample_rate=self.sample_rate)

        def step_hook(dp_optimizer: DPOptimizer) -> None:
            # Runs inside DPOptimizer.pre_step, after clip, noise and scaling wrote p.grad. The
            # pipeline is the fit's (given at fit start), empty when the trainer has no stages.
            account(dp_optimizer)
            pipeline = self.fit_pipeline()
            if len(pipeline):
                defend_parameter_gradients(
                    pipeline,
                    pl_module,
                    dp_optimizer,
                    client_id=trainer.global_rank,
                    round=trainer.global_step,
                    path=self.execution_path,
                )

        optimizer.attach_step_hook(step_hook)
        self._original_optimizer, self._dp_optimizer = original, optimizer
        trainer.optimizers = [optimizer]  # LR schedulers keep stepping `original`: same param_groups
        if self.stop_at_epsilon is not None:
            self.steps_within_budget = self._steps_within_budget(self.stop_at_epsilon)
            self._stop_if_over_budget(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # forget what a step that never reached backward (training_step returned None) left behind
        if self._book_keeping is not None:
            self._book_keeping.reset()
        self._outputs = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.stop_at_epsilon is not None:
            self._stop_if_over_budget(trainer)

    def _stop_if_over_budget(self, trainer: pl.Trainer) -> None:
        """End the fit when one more step would pass ``stop_at_epsilon`` (the epoch ends: checkpoints are written)."""
        assert self.steps_within_budget is not None and self.stop_at_epsilon is not None
        if self.steps + 1 > self.steps_within_budget and not trainer.should_stop:
            trainer.should_stop = True
            rank_zero_info(
                f"DPSGD: stopping after {self.steps} step(s), epsilon {self.epsilon:.4g} at delta {self.target_delta:.3g}: "
                f"one more step would spend more than stop_at_epsilon={self.stop_at_epsilon:g}"
            )

    def _steps_within_budget(self, budget: float) -> int:
        """The most steps (those taken included) whose epsilon at :attr:`target_delta` stays within
        ``budget``, at this fit's noise multiplier and sample rate (a doubling then bisection search on
        the accountant's history; epsilon grows with the steps)."""
        assert self.noise_multiplier_used is not None and self.sample_rate is not None
        if self.noise_multiplier_used == 0:
            return self.steps  # no noise: no step fits any budget
        history = self._history()

        def epsilon_after(total: int) -> float:
            extra = total - self.steps
            if total == 0:
                return 0.0
            accountant = create_accountant(mechanism=self.accountant)
            accountant.history = [*history, *([(self.noise_multiplier_used, self.sample_rate, extra)] if extra else [])]
            return float(accountant.get_epsilon(delta=self.target_delta))

        low = self.steps
        if epsilon_after(low) > budget:
            return low  # already over: no further step
        high = max(1, 2 * low)
        while epsilon_after(high) <= budget:
            low, high = high, 2 * high
            if high > 10**9:
                return high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if epsilon_after(middle) <= budget else (low, middle)
        return low

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.privacy_accountant is not None:
            pl_module.log(
                "dp_epsilon", self.epsilon, prog_bar=True
            )  # on the bar and ProgressPrinter, not only in the logs

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._clean_up(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._clean_up(trainer)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        if self.privacy_accountant is None:
            return {_STATE: self._pending_state} if self._pending_state is not None else {}
        return {
            _STATE: {
                "accountant": self.privacy_accountant.state_dict(),
                "noise_multiplier": self.noise_multiplier_used,
                "sample_rate": self.sample_rate,
                "delta": self.target_delta,
            }
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _STATE in state_dict:
            self._pending_state = state_dict[_STATE]
            self.privacy_accountant = None
            self.noise_multiplier_used = state_dict[_STATE]["noise_multiplier"]
            self.target_delta = state_dict[_STATE]["delta"]

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning silently drops saved callback state whose key matches no callback; for DP-SGD
        # that would forget the privacy already spent, so refuse to resume with other settings.
        saved = [
            key for key, state in checkpoint.get("callbacks", {}).items() if isinstance(state, dict) and _STATE in state
        ]
        if saved and self.state_key not in saved:
            raise ValueError(
                f"the checkpoint holds DP-SGD accounting saved by {', '.join(saved)}, but none for {self!r}; resume "
                "with the DPSGD settings the run was started with, or epsilon would leave those steps out"
            )
        if not saved and checkpoint.get("global_step", 0) > 0:
            raise ValueError(
                f"the checkpoint was trained for {checkpoint['global_step']} steps without DPSGD; resuming it with "
                "DPSGD would leave those steps out of epsilon. To fine-tune its weights privately, load them "
                "(LightningModule.load_from_checkpoint) and start a new fit without ckpt_path"
            )

    # ------------------------------------------------------------------ helpers

    def _calibrate_noise(self, trainer: pl.Trainer) -> float:
        steps = trainer.estimated_stepping_batches
        if not math.isfinite(steps) or steps < 1:
            raise ValueError(
                "DPSGD(target_epsilon=...) calibrates the noise for the whole run, but neither max_epochs nor "
                "max_steps bounds this one; set Trainer(max_epochs=...) or Trainer(max_steps=...), or give "
                "noise_multiplier instead"
            )
        return float(
            get_noise_multiplier(
                target_epsilon=self.target_epsilon,
                target_delta=self.target_delta,
                sample_rate=self.sample_rate,
                steps=int(steps),
                accountant=self.accountant,
            )
        )

    def _wrap_train_dataloader(self, owner: Any) -> None:
        had_own = "train_dataloader" in vars(owner)
        previous = vars(owner).get("train_dataloader")
        original = owner.train_dataloader
        secure = self.secure_mode

        def train_dataloader() -> DPDataLoader:
            loader = original()
            if isinstance(loader, DPDataLoader):
                return loader
            if not isinstance(loader, DataLoader):
                raise ValueError(
                    f"DPSGD's Poisson sampling needs train_dataloader() to return one DataLoader, got "
                    f"{type(loader).__name__}; return a DataLoader or use DPSGD(poisson_sampling=False)"
                )
            generator = torch.Generator().manual_seed(secrets.randbits(63)) if secure else None
            return DPDataLoader.from_data_loader(loader, generator=generator)

        owner.train_dataloader = train_dataloader
        self._wrapped_loader = (owner, had_own, previous)

    def _resolve_mode(self, pl_module: pl.LightningModule) -> str:
        """The mode this fit runs in: ``grad_sample_mode``, with ``"auto"`` resolved (book-keeping where the
        model allows it, else Opacus' hooks); a mode the model does not allow is refused here, before training."""
        refusal = _book_keeping_refusal(pl_module)
        if self.grad_sample_mode == "auto":
            return "hooks" if refusal else "book_keeping"
        if self.grad_sample_mode == "book_keeping" and refusal:
            raise ValueError(f"DPSGD(grad_sample_mode='book_keeping'): {refusal}")
        if self.grad_sample_mode == "ghost" and is_overridden("backward", pl_module, parent=pl.LightningModule):
            raise ValueError(
                f"DPSGD(grad_sample_mode='ghost') runs its own two backward passes, but {type(pl_module).__name__} "
                "overrides backward; use grad_sample_mode='hooks'"
            )
        return self.grad_sample_mode

    def _attach(self, pl_module: pl.LightningModule, original: torch.optim.Optimizer) -> DPOptimizer:
        """Attach the per-example clipping of :attr:`grad_sample_mode_used` to the module and wrap the
        optimizer: ``DPOptimizer`` (hooks: it clips) or ``DPOptimizerFastGradientClipping`` (ghost,
        book-keeping: ``.grad`` already holds the clipped sum; it adds the noise and divides by the
        expected batch size)."""
        mode = self.grad_sample_mode_used or self._resolve_mode(pl_module)
        self.grad_sample_mode_used, self._module = mode, pl_module
        before = {(id(m), attr) for m in pl_module.modules() for attr in _MODULE_ATTRS if attr in vars(m)}
        if mode == "hooks":
            self._grad_sample_module = GradSampleModule(pl_module, loss_reduction="mean")
        elif mode == "ghost":
            self._grad_sample_module = GradSampleModuleFastGradientClipping(
                pl_module, loss_reduction="mean", max_grad_norm=self.max_grad_norm, use_ghost_clipping=True
            )
            self._output_hook = pl_module.register_forward_hook(self._keep_output)
            self._override_backward(pl_module, self._ghost_backward)
        else:
            self._book_keeping = BookKeeping(pl_module, max_grad_norm=self.max_grad_norm, loss_reduction="mean")
            self._override_backward(pl_module, self._book_keeping_backward)
        # Opacus's hooks store activations on the submodules; remember which attributes are its own.
        self._new_module_attrs = [
            (m, attr) for m in pl_module.modules() for attr in _MODULE_ATTRS if (id(m), attr) not in before
        ]
        wrapper = DPOptimizer if mode == "hooks" else DPOptimizerFastGradientClipping
        return wrapper(
            original,
            noise_multiplier=self.noise_multiplier_used,
            max_grad_norm=self.max_grad_norm,
            expected_batch_size=self.expected_batch_size,
            loss_reduction="mean",
            secure_mode=self.secure_mode,
        )

    def _override_backward(self, pl_module: pl.LightningModule, backward: Any) -> None:
        """Replace the module's ``backward`` hook (Lightning calls ``model.backward(loss)``) for the fit."""
        self._backward_override = ("backward" in vars(pl_module), vars(pl_module).get("backward"))
        pl_module.backward = backward  # type: ignore[method-assign]

    def _book_keeping_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """One backward pass: the clipped sum of the per-example gradients lands in ``.grad``."""
        _no_backward_arguments(args, kwargs)
        assert self._book_keeping is not None
        self._book_keeping.backward(loss)

    def _keep_output(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self._outputs.append(output)

    def _ghost_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Opacus' ghost clipping in two backward passes (as ``DPTensorFastGradientClipping.backward``), with
        the per-example loss weights applied to the gradient of the module's output: the first pass gives
        Opacus' hooks the per-example norms, the second backpropagates ``n c_i dL/d out_i`` (``n`` examples,
        ``loss_reduction="mean"``), whose parameter gradient is ``sum_i c_i grad l_i``."""
        _no_backward_arguments(args, kwargs)
        outputs, self._outputs = self._outputs, []
        tensors = [t for t in _tensors(outputs) if t.requires_grad]
        if len(outputs) != 1 or not tensors:
            raise ValueError(
                "DPSGD(grad_sample_mode='ghost') rescales each example's share of the gradient of the "
                f"LightningModule's output, so training_step must compute the loss from one call of the module "
                f"(self(x)); this step called it {len(outputs)} time(s). Use grad_sample_mode='book_keeping' or 'hooks'"
            )
        gsm, optimizer = self._grad_sample_module, self._dp_optimizer
        assert isinstance(gsm, GradSampleModuleFastGradientClipping) and optimizer is not None
        grads = torch.autograd.grad(loss, tensors, retain_graph=True, allow_unused=True, materialize_grads=True)
        torch.autograd.backward(tensors, grads, retain_graph=True)  # Opacus' hooks: the per-example norms
        optimizer.zero_grad()
        coefficients = gsm.get_clipping_coef() * tensors[0].shape[0]
        gsm.disable_hooks()
        try:
            weighted = [g * coefficients.to(g.dtype).reshape(-1, *([1] * (g.dim() - 1))) for g in grads]
            torch.autograd.backward(tensors, weighted)
        finally:
            gsm.enable_hooks()

    def _clean_up(self, trainer: pl.Trainer) -> None:
        if self._wrapped_loader is not None:
            owner, had_own, previous = self._wrapped_loader
            if had_own:
                owner.train_dataloader = previous
            else:
                del owner.train_dataloader
            self._wrapped_loader = None
        if self._dp_optimizer is not None:
            if (
                trainer.optimizers
                and trainer.optimizers[0] is self._dp_optimizer
                and self._original_optimizer is not None
            ):
                trainer.optimizers = [self._original_optimizer]
            self._dp_optimizer = self._original_optimizer = None
        if self._grad_sample_module is not None:
            self._grad_sample_module.to_standard_module()  # removes Opacus' hooks
            self._grad_sample_module = None
        if self._book_keeping is not None:
            self._book_keeping.detach()
            self._book_keeping = None
        if self._output_hook is not None:
            self._output_hook.remove()
            self._output_hook, self._outputs = None, []
        if self._module is not None:
            self._restore_module(self._module)
            self._module = None

    def _restore_module(self, module: pl.LightningModule) -> None:
        """Its own ``backward`` back, and no attribute left by Opacus on the module or its parameters."""
        if self._backward_override is not None:
            had_own, previous = self._backward_override
            if had_own:
                module.backward = previous  # type: ignore[method-assign]
            elif "backward" in vars(module):
                del module.backward
            self._backward_override = None
        for p in module.parameters():
            for attr in _PARAM_ATTRS:
                if hasattr(p, attr):
                    delattr(p, attr)
        for m, attr in self._new_module_attrs:
            if attr in vars(m):
                delattr(m, attr)
        self._new_module_attrs = []


def _book_keeping_refusal(pl_module: pl.LightningModule) -> str | None:
    """Why book-keeping cannot clip this module's gradients (``None``: it can)."""
    if is_overridden("backward", pl_module, parent=pl.LightningModule):
        return f"it runs its own backward pass, but {type(pl_module).__name__} overrides backward; use grad_sample_mode='hooks'"
    try:
        trainable_layers(pl_module)
    except ValueError as err:
        return str(err)
    return None


def _no_backward_arguments(args: tuple, kwargs: dict) -> None:
    if args or kwargs:
        raise ValueError(
            "DPSGD(grad_sample_mode='ghost' or 'book_keeping') runs the backward pass itself and takes no "
            f"backward arguments, got {args!r} {kwargs!r}; use grad_sample_mode='hooks'"
        )


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) output: a tensor, or a tuple, list or dict of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _check_module(pl_module: pl.LightningModule) -> None:
    """Fail before training if Opacus cannot compute per-example gradients for the model."""
    modes = {m: m.training for m in pl_module.modules()}
    pl_module.train()  # Lightning trains in train mode; don't report the mode the module is in now
    try:
        # ModuleValidator knows the unsupported layer types (BatchNorm, ...); GradSampleModule also
        # rejects any other trainable layer with buffers.
        errors = ModuleValidator.validate(pl_module, strict=False) or GradSampleModule.validate(pl_module, strict=False)
    finally:
        for m, training in modes.items():
            m.training = training
    if not errors:
        return
    offenders = [
        f"{name or type(pl_module).__name__} ({type(m).__name__})"
        for name, m in pl_module.named_modules()
        if any(p.requires_grad for p in m.parameters(recurse=False))
        and (type(m) in ModuleValidator.VALIDATORS or any(True for _ in m.buffers(recurse=False)))
    ]
    reasons = sorted({str(e).split(". ")[0].strip() for e in errors})
    raise ValueError(
        "DPSGD cannot compute per-example gradients for this model"
        + (f": {', '.join(offenders)}" if offenders else "")
        + f" ({'; '.join(reasons)}). Replace BatchNorm with GroupNorm (e.g. ResNet18(norm='group')) or run "
        "opacus.validators.ModuleValidator.fix(model) on the model before training"
    )


# The server's adaptive attack on a DP-SGD client (declared here, beside the class it models).
register_defense_knowledge(DPSGD, dp_sgd_knowledge, attacks=noise_aware_attacks)
