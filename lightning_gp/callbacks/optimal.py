"""Callbacks for the data-dependent optimal defenses: they estimate the sensitivity, then defend.

Where the sensitivity comes from depends on the path (DESIGN.md, "Where a defense runs"):

* single device and DDP: at ``on_train_batch_start``, from the module and the batch about to be
  trained on (the weights the backward pass will use). With gradient accumulation the
  micro-batches' sensitivities add up (``g = mean_b g_b``, so ``s = sum_b s_b / A^2``). Under
  DDP the defense itself then runs in the communication hook, with no autograd work inside it.
* :class:`~lightning_gp.federated.FederatedSimulation`: per client, from the server model and
  that client's batch (FedSGD only: a FedAvg update is not the gradient of one batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_gp.callbacks.base import GradientDefense
from lightning_gp.callbacks.pipeline import execution_path
from lightning_gp.defenses import optimal
from lightning_gp.defenses.base import Gradients
from lightning_gp.defenses.sensitivity import gradient_sensitivity
from lightning_gp.defenses.validation import check_positive_int
from lightning_gp.functional import LossFn
from lightning_gp.seeding import seeded_generator


class SensitivityGradientDefense(GradientDefense):
    """Adapts a :class:`~lightning_gp.defenses.SensitivityDefense`: estimates ``s`` with
    ``num_probes`` jvp probes on the client's batch, then defends.

    Args:
        defense: the data-dependent defense.
        num_probes: Gaussian input probes per estimate (the paper's ``k = 10``).
        chunk_size: probes evaluated at once (``None``: all); lower it to bound memory.
        loss_fn: ``loss_fn(logits, targets)``; default: the module's ``loss_fn`` attribute, else
            cross-entropy. Batches must be ``(inputs, targets, ...)`` with floating-point inputs.
    """

    def __init__(
        self,
        defense: optimal.SensitivityDefense,
        *,
        num_probes: int = 10,
        chunk_size: int | None = None,
        loss_fn: LossFn | None = None,
    ) -> None:
        if not isinstance(defense, optimal.SensitivityDefense):
            raise TypeError(f"defense must be a SensitivityDefense, got {type(defense).__name__}")
        super().__init__(defense)
        check_positive_int(num_probes, "num_probes")
        if chunk_size is not None:
            check_positive_int(chunk_size, "chunk_size")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.num_probes = num_probes
        self.chunk_size = chunk_size
        self.loss_fn = loss_fn
        self._module_loss: LossFn | None = None
        self._pending: Gradients | None = None
        self._pending_step: int | None = None
        self._micro_batches = 0

    # ---------------------------------------------------------------- Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        from lightning_gp.callbacks.dp_sgd import DPSGD  # local: dp_sgd imports the callback base

        if stage == "fit" and any(isinstance(cb, DPSGD) for cb in trainer.callbacks):
            raise ValueError(
                f"{type(self).__name__} reads the client's raw batch to shape its noise or pruning, so running it "
                "after DPSGD is not post-processing of the DP output and would void the reported epsilon. Use "
                "DPSGD alone, or with data-independent defenses (pruning, GaussianNoise) after it"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        module_loss = getattr(pl_module, "loss_fn", None)
        self._module_loss = module_loss if callable(module_loss) else None
        self._pending, self._pending_step, self._micro_batches = None, None, 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if execution_path(trainer, pl_module) == "simulation":
            return  # the simulation hands each client's batch to defend()
        step = trainer.global_step
        if self._pending_step != step:
            self._pending, self._pending_step, self._micro_batches = None, step, 0
        inputs, targets = _inputs_and_targets(batch)
        s = self.estimate(pl_module, inputs, targets, seed_words=(step, trainer.global_rank, self._micro_batches))
        self._pending = s if self._pending is None else {n: self._pending[n] + s[n] for n in s}
        self._micro_batches += 1

    # ---------------------------------------------------------------- pipeline
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
        if meta.get("path") == "simulation":
            if meta.get("algorithm") != "fedsgd":
                raise ValueError(
                    f"{type(self).__name__} defends the gradient of one batch; FedAvg shares a multi-step model "
                    "update, whose sensitivity this estimate does not give. Use algorithm='fedsgd'"
                )
            inputs, targets = _inputs_and_targets(batch)
            sensitivity = self.estimate(model, inputs, targets, seed_words=(round, client_id, 0))
        else:
            if self._pending is None:
                raise RuntimeError(
                    f"{type(self).__name__} saw no training batch for this optimizer step, so it has no sensitivity "
                    "to defend with (manual optimization is not supported)"
                )
            accumulated = self._micro_batches
            sensitivity = (
                {n: s / accumulated**2 for n, s in self._pending.items()} if accumulated > 1 else self._pending
            )
            self._pending, self._pending_step, self._micro_batches = None, None, 0
        missing = [n for n in gradients if n not in sensitivity]
        if missing:
            raise ValueError(f"no sensitivity for the shared layers {missing[:5]}: the model and the gradient disagree")
        return self.defense(gradients, client_id, sensitivity={n: sensitivity[n] for n in gradients})

    def estimate(self, module: nn.Module, inputs: Tensor, targets: Tensor, *, seed_words: tuple[int, ...]) -> Gradients:
        """``s`` for one batch; the probes are seeded by the defense's seed and ``seed_words``."""
        generator = seeded_generator(self.defense.seed, *seed_words, device=inputs.device)
        loss_fn = self.loss_fn or self._module_loss or F.cross_entropy
        return gradient_sensitivity(
            module,
            loss_fn,
            inputs,
            targets,
            num_probes=self.num_probes,
            chunk_size=self.chunk_size,
            generator=generator,
        )


def _inputs_and_targets(batch: Any) -> tuple[Tensor, Tensor]:
    if (
        isinstance(batch, (tuple, list))
        and len(batch) >= 2
        and isinstance(batch[0], Tensor)
        and isinstance(batch[1], Tensor)
    ):
        return batch[0], batch[1]
    raise TypeError(
        "the optimal defenses estimate the sensitivity from (inputs, targets, ...) batches; got "
        f"{type(batch).__name__}. Return such tuples from the dataloader, or pass the batch through a collate_fn"
    )


class OptimalGradientNoise(SensitivityGradientDefense):
    """Fisher-trace-optimal diagonal Gaussian noise: variance ∝ ``sqrt(s_i) / max(|g_i|, c)``,
    total power equal to ``GaussianNoise(scale)``'s, none on zero-gradient coordinates, at most
    ``max_variance`` on one (default ``100 scale^2``). Data-dependent: no formal DP guarantee and
    no epsilon. See :class:`lightning_gp.defenses.OptimalGradientNoise`.
    """

    def __init__(
        self,
        scale: float = 0.01,
        num_probes: int = 10,
        c: float = 1e-6,
        max_variance: float | None = None,
        chunk_size: int | None = None,
        loss_fn: LossFn | None = None,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        defense = optimal.OptimalGradientNoise(scale, c=c, max_variance=max_variance, seed=seed, nonfinite=nonfinite)
        super().__init__(defense, num_probes=num_probes, chunk_size=chunk_size, loss_fn=loss_fn)


class OptimalGradientPruning(SensitivityGradientDefense):
    """Prune the ``rate`` fraction of coordinates with the largest ``sqrt(s_i) / |g_i|``, across the
    model (``scope="global"``) or per layer. Data-dependent: no formal DP guarantee.
    See :class:`lightning_gp.defenses.OptimalGradientPruning`.
    """

    def __init__(
        self,
        rate: float = 0.8,
        num_probes: int = 10,
        scope: str = "global",
        chunk_size: int | None = None,
        loss_fn: LossFn | None = None,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        defense = optimal.OptimalGradientPruning(rate, scope=scope, seed=seed, nonfinite=nonfinite)
        super().__init__(defense, num_probes=num_probes, chunk_size=chunk_size, loss_fn=loss_fn)


class OptimalDPSGD(SensitivityGradientDefense):
    """Clipped optimal noise (Eq. 9-13): clip every coordinate to ``[-clip, clip]``; clipped
    coordinates get no noise, the rest optimal noise. Despite the name, no formal DP guarantee
    and no epsilon (the noise depends on the data); formal DP is :class:`DPSGD`.
    See :class:`lightning_gp.defenses.OptimalDPSGD`.
    """

    def __init__(
        self,
        clip: float = 1.0,
        scale: float = 0.01,
        num_probes: int = 10,
        c: float = 1e-6,
        max_variance: float | None = None,
        chunk_size: int | None = None,
        loss_fn: LossFn | None = None,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        defense = optimal.OptimalDPSGD(clip, scale, c=c, max_variance=max_variance, seed=seed, nonfinite=nonfinite)
        super().__init__(defense, num_probes=num_probes, chunk_size=chunk_size, loss_fn=loss_fn)
