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

from lightning_gp.callbacks.base import GradientDefense
from lightning_gp.callbacks.interfaces import ClientSetup
from lightning_gp.defenses import optimal
from lightning_gp.defenses.base import Gradients
from lightning_gp.defenses.sensitivity import gradient_sensitivity
from lightning_gp.functional import LossFn
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_positive_int


class SensitivityGradientDefense(GradientDefense):
    """Adapts a :class:`~lightning_gp.defenses.SensitivityDefense`: estimates ``s`` with
    ``num_probes`` jvp probes on the client's batch, then defends.

    Args:
        defense: the data-dependent defense.
        num_probes: Gaussian input probes per estimate (the paper's ``k = 10``).
        chunk_size: probes evaluated at once (``None``: all); lower it to bound memory.
        loss_fn: ``loss_fn(logits, targets)``, averaged over the batch; default: the LightningModule's
            ``loss_fn`` attribute. One of the two is required (the loss is never guessed). Batches
            must be ``(inputs, targets, ...)`` with floating-point inputs.
    """

    reads_client_data = True  # the sensitivity comes from the client's raw batch
    defense: optimal.SensitivityDefense

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
        self._batches_given = False

    # ---------------------------------------------------------------- Lightning hooks
    def bind(self, setup: ClientSetup) -> None:
        super().bind(setup)
        self._batches_given = setup.passes_client_batches

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        module_loss = getattr(pl_module, "loss_fn", None)
        self._module_loss = module_loss if callable(module_loss) else None
        if self.loss_fn is None and self._module_loss is None:
            raise ValueError(
                f"{type(self).__name__} needs the client's loss to estimate the sensitivity d(grad)/d(input), and "
                f"{type(pl_module).__name__} has no callable `loss_fn` attribute: pass loss_fn=... (loss(logits, "
                "targets), averaged over the batch, the loss the module trains with) or give the module a `loss_fn`"
            )
        self._pending, self._pending_step, self._micro_batches = None, None, 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._batches_given:
            return  # the runner hands each client's batch to defend()
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
        if self._batches_given:
            if meta.get("algorithm", "fedsgd") != "fedsgd":
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
        loss_fn = self.loss_fn or self._module_loss
        if loss_fn is None:
            raise RuntimeError(f"{type(self).__name__} has no loss: it estimates during a fit (or pass loss_fn=...)")
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
