"""Callbacks for the data-dependent optimal defenses: they estimate the sensitivity, then defend.

Where the sensitivity is estimated (each client's batch, on every path) is the job of
:class:`~lightning_gp.callbacks.data_dependent.DataDependentGradientDefense`. With gradient
accumulation the micro-batches' sensitivities add up (``g = mean_b g_b``, so ``s = sum_b s_b / A^2``).

Cost (ConvNet, batch 16, one CPU thread): the sensitivity dominates a defended step; ``method``,
``probes``, ``subset`` and ``refresh_every`` trade it against the estimate's error (see
:func:`~lightning_gp.defenses.gradient_sensitivity` for the estimators' variances).
``refresh_every=N`` reuses a client's last estimate for its next ``N - 1`` steps: the sensitivity
is then computed from older weights and another batch, stale by design.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn

from lightning_gp.callbacks.data_dependent import DataDependentGradientDefense, sensitivity_of_layers
from lightning_gp.defenses import optimal
from lightning_gp.defenses.base import Gradients
from lightning_gp.defenses.sensitivity import SENSITIVITY_METHODS, batch_mixing, gradient_sensitivity
from lightning_gp.functional import LossFn
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_choice, check_positive_int


class SensitivityGradientDefense(DataDependentGradientDefense):
    """Adapts a :class:`~lightning_gp.defenses.SensitivityDefense`: estimates ``s`` with
    ``probes`` jvp probes on the client's batch, then defends.

    Args:
        defense: the data-dependent defense.
        probes: Gaussian input probes per estimate (the paper's ``k = 10``).
        chunk_size: probes evaluated at once (``None``: all); lower it to bound memory.
        loss_fn: ``loss_fn(logits, targets)``, averaged over the batch; default: the LightningModule's
            ``loss_fn`` attribute. One of the two is required (the loss is never guessed). Batches
            must be ``(inputs, targets, ...)`` with floating-point inputs.
        method: ``"batch"`` (the paper's estimator, ``probes`` probes over the whole batch) or
            ``"per_example"`` (``probes`` probes per example; lower variance per probe, needs a
            mean-reduced loss and no BatchNorm in training mode, refused at fit start otherwise).
        subset: ``"per_example"`` only: probe this many examples of each batch, rescaled (unbiased,
            noisier); must not exceed the batch size (checked on every batch).
        refresh_every: estimate every ``N``-th optimizer step (round) of a client and reuse that
            client's last estimate in between (``1``: every step); stale by design, see
            :class:`~lightning_gp.callbacks.DataDependentGradientDefense`. Gradient accumulation:
            a refreshed step combines its micro-batches.

    ``probes``, ``method``, ``subset`` and ``refresh_every`` are part of :attr:`state_key`
    (a resume with other values is refused); ``chunk_size`` (memory) and ``loss_fn`` are not.
    """

    defense: optimal.SensitivityDefense
    statistic_name = "sensitivity"

    def adapt(
        self,
        *,
        probes: int = 10,
        chunk_size: int | None = None,
        loss_fn: LossFn | None = None,
        method: str = "batch",
        subset: int | None = None,
        refresh_every: int = 1,
    ) -> None:
        if not isinstance(self.defense, optimal.SensitivityDefense):
            raise TypeError(f"defense must be a SensitivityDefense, got {type(self.defense).__name__}")
        super().adapt(refresh_every=refresh_every)
        check_positive_int(probes, "probes")
        if chunk_size is not None:
            check_positive_int(chunk_size, "chunk_size")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        check_choice(method, "method", SENSITIVITY_METHODS)
        if subset is not None:
            check_positive_int(subset, "subset")
            if method != "per_example":
                raise ValueError(
                    f"subset={subset} needs method='per_example' (the batch estimator probes every example)"
                )
        self.probes = probes
        self.chunk_size = chunk_size
        self.loss_fn = loss_fn
        self.method = method
        self.subset = subset
        self._module_loss: LossFn | None = None

    def adapter_config(self) -> dict[str, Any]:
        return {
            **super().adapter_config(),
            "probes": self.probes,
            "method": self.method,
            "subset": self.subset,
        }

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
        if self.method == "per_example" and batch_mixing(pl_module):
            raise ValueError(
                f"{type(self).__name__}(method='per_example') decomposes the loss over examples, but "
                f"{type(pl_module).__name__} has BatchNorm in training mode (each example normalised with the batch's "
                "statistics), which makes that estimate biased: use method='batch'"
            )

    # ---------------------------------------------------------------- the statistic
    def batch_statistic(
        self, module: nn.Module, inputs: Tensor, targets: Tensor, *, seed_words: tuple[int, ...]
    ) -> Any:
        return self.estimate(module, inputs, targets, seed_words=seed_words)

    def accumulated(self, total: Any, micro_batches: int) -> Any:
        # g = mean_b g_b over A micro-batches, so s = sum_b s_b / A^2
        return {n: s / micro_batches**2 for n, s in total.items()} if micro_batches > 1 else total

    def statistic_inputs(self, gradients: Mapping[str, Tensor], statistic: Any) -> dict[str, Any]:
        return {"sensitivity": sensitivity_of_layers(statistic, gradients)}

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
            probes=self.probes,
            chunk_size=self.chunk_size,
            generator=generator,
            method=self.method,
            subset=self.subset,
        )


class OptimalGradientNoise(SensitivityGradientDefense, defense=optimal.OptimalGradientNoise):
    """Fisher-trace-optimal diagonal Gaussian noise: variance ∝ ``sqrt(s_i) / max(|g_i|, c)``,
    total power equal to ``GaussianNoise(scale)``'s, none on zero-gradient coordinates, at most
    ``max_variance`` on one (default ``100 scale^2``). Data-dependent: no formal DP guarantee and
    no epsilon. See :class:`lightning_gp.defenses.OptimalGradientNoise`.
    """


class OptimalGradientPruning(SensitivityGradientDefense, defense=optimal.OptimalGradientPruning):
    """Prune the ``rate`` fraction of coordinates with the largest ``sqrt(s_i) / |g_i|``, across the
    model (``scope="global"``) or per layer. Data-dependent: no formal DP guarantee.
    See :class:`lightning_gp.defenses.OptimalGradientPruning`.
    """


class OptimalDPSGD(SensitivityGradientDefense, defense=optimal.OptimalDPSGD):
    """Clipped optimal noise (Eq. 9-13): clip every coordinate to ``[-clip, clip]``; clipped
    coordinates get no noise, the rest optimal noise. Despite the name, no formal DP guarantee
    and no epsilon (the noise depends on the data); formal DP is :class:`DPSGD`.
    See :class:`lightning_gp.defenses.OptimalDPSGD`.
    """
