"""Outpost (Wang, Hugh and Li, INFOCOM 2023, "More than Enough is Too Much: Adaptive Defenses
against Gradient Leakage in Production Federated Learning").

At a client's ``t``-th local step (``t = 1, 2, ...``) the gradient is perturbed with probability
``1 / (1 + beta t)`` (iteration-based decay); a perturbed gradient is

1. pruned per layer: the ``rho`` percent of each layer's entries with the smallest ``|g|`` are zeroed;
2. noised: ``N(0, (lambda risk_l)^2)`` is added to the ``phi`` percent of the model's entries with
   the largest empirical Fisher information ``g^2``, where ``risk_l = min(Var(W_l), 1)`` is the
   privacy-leakage risk of layer ``l`` from the spread of its current weights.

An unperturbed step shares the raw gradient. The official code (Plato,
``examples/gradient_leakage_attacks/defense/Outpost/perturb.py`` and ``dlg_trainer.py``) was read
for the details; where this implementation differs:

* ``t`` counts the client's defended steps over the whole run (kept in the client's state, so it
  survives a checkpoint). Plato's ``iteration = epoch * (batch + 1)`` restarts every round;
  under FedSGD (one step a round) that would pin the probability at ``1 / (1 + beta)``, while the
  paper's point is that the risk decays as training goes on. ``t`` starts at 1 as there;
* the Fisher ranking is per entry (``g^2``) over the whole model, as the official threshold is
  model-wide; the official code averages ``g^2`` over each layer's first axis (so a mask is shared
  by a layer's output channels), which is not the empirical Fisher of an entry;
* percentiles become exact counts (:func:`~lightning_gp.defenses.selection.count_for_rate`, ties
  broken by position) instead of ``np.percentile``'s interpolated threshold;
* the noise is really added: the official ``noise`` rebinds a loop variable and returns its input
  unchanged, and re-seeds torch's global generator with the same seed on every call;
* ``Var`` is torch's unbiased variance; a one-entry layer has risk 0.

Under FedAvg the client's multi-step update is defended once per round (``t`` then counts rounds);
Outpost's per-local-step perturbation inside local training is not what this gradient pipeline sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_gp.defenses.base import Defense, DefenseCall, Gradients
from lightning_gp.defenses.noise import standard_normal_like
from lightning_gp.defenses.selection import count_for_rate, largest_entries_mask, largest_magnitude_mask, magnitudes
from lightning_gp.named_tensors import unflatten_named
from lightning_gp.validation import check_nonnegative, check_number

#: the key of a client's step counter in its state (no parameter name contains '#')
STEP_KEY = "#step"


def perturbation_probability(beta: float, step: int) -> float:
    """``1 / (1 + beta t)``: the chance that Outpost perturbs local step ``t``."""
    return 1.0 / (1.0 + beta * step)


def layer_risk(weight: Tensor) -> float:
    """``min(Var(W_l), 1)``: Outpost's privacy-leakage risk of a layer (0 for a single weight)."""
    if weight.numel() < 2:
        return 0.0
    return min(float(weight.detach().double().var()), 1.0)


def prune_below_percentile(gradient: Tensor, rho: float) -> Tensor:
    """``gradient`` with its ``rho`` percent smallest-magnitude entries zeroed (exact count, ties by position)."""
    pruned = count_for_rate(rho / 100, gradient.numel())
    keep = largest_magnitude_mask(gradient, gradient.numel() - pruned)
    return torch.where(keep, gradient, torch.zeros_like(gradient))


def fisher_noise_mask(gradients: Mapping[str, Tensor], phi: float) -> dict[str, Tensor]:
    """Boolean masks of the ``phi`` percent of the model's entries with the largest empirical
    Fisher information ``g^2`` (model-wide, ties by position)."""
    scores = torch.cat([magnitudes(g) for g in gradients.values()])
    mask = largest_entries_mask(scores, count_for_rate(phi / 100, scores.numel()))
    return unflatten_named(mask, gradients, dtype=torch.bool)


def outpost_noise_std(weights: Mapping[str, Tensor], noise_multiplier: float) -> dict[str, float]:
    """The noise std of every layer: ``lambda min(Var(W_l), 1)``."""
    return {n: noise_multiplier * layer_risk(w) for n, w in weights.items()}


class Outpost(Defense):
    """Outpost (Wang et al. 2023): decaying-probability pruning plus risk-scaled noise on high-Fisher entries.

    Call it as ``defense(gradients, client_id, weights=w)`` with the layers' current weights,
    named like the gradients (the callback :class:`~lightning_gp.callbacks.Outpost` passes the
    model's). Each client's step counter lives in its state (``client_state(c)["#step"]``).

    Args:
        beta: decay of the perturbation probability ``1 / (1 + beta t)``, ``>= 0`` (0: every step).
        phi: percent of the model's entries (largest ``g^2``) that get noise, in [0, 100].
        rho: percent of each layer's entries (smallest ``|g|``) pruned, in [0, 100].
        noise_multiplier: the paper's ``lambda >= 0``: the std on layer ``l`` is ``lambda min(Var(W_l), 1)``.
    """

    reads_weights = True

    def __init__(
        self,
        beta: float = 0.1,
        phi: float = 40.0,
        rho: float = 80.0,
        noise_multiplier: float = 0.8,
        *,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        self.beta = check_nonnegative(beta, "beta")
        self.phi = check_number(phi, "phi", low=0.0, high=100.0)
        self.rho = check_number(rho, "rho", low=0.0, high=100.0)
        self.noise_multiplier = check_nonnegative(noise_multiplier, "noise_multiplier")
        #: whether the last call perturbed (for inspection; the server sees it from the zeros)
        self.last_perturbed: bool | None = None

    def config(self) -> dict[str, Any]:
        return {"beta": self.beta, "phi": self.phi, "rho": self.rho, "noise_multiplier": self.noise_multiplier}

    def init_client_state(self, gradients: Gradients) -> Gradients:
        device = next(iter(gradients.values())).device
        return {STEP_KEY: torch.zeros((), dtype=torch.int64, device=device)}

    def prepare(  # type: ignore[override]
        self, gradients: Mapping[str, Tensor], *, weights: Mapping[str, Tensor] | None = None
    ) -> dict[str, float]:
        """The noise std of every layer (``noise_multiplier min(Var(W_l), 1)``) from the current ``weights``."""
        if weights is None:
            raise TypeError(
                "Outpost scales its noise by the spread of the current weights: pass weights={name: parameter} "
                "named like the gradients (the Outpost callback passes the model's)"
            )
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must map layer names to tensors, got {type(weights).__name__}")
        missing = [n for n in gradients if n not in weights]
        if missing:
            raise ValueError(f"weights has no tensor for the layers {missing[:5]}: name them like the gradients")
        wrong = [
            f"{n}: {tuple(weights[n].shape)} vs gradient {tuple(g.shape)}"
            for n, g in gradients.items()
            if not isinstance(weights[n], Tensor) or weights[n].shape != g.shape
        ]
        if wrong:
            raise ValueError(f"weights must be tensors shaped like the gradients: {wrong[:5]}")
        return outpost_noise_std({n: weights[n] for n in gradients}, self.noise_multiplier)

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        counter = state[STEP_KEY]
        step = int(counter) + 1
        draw = torch.rand((), generator=call.generator, device=call.generator.device, dtype=torch.float64)
        perturb = float(draw) < perturbation_probability(self.beta, step)
        shared = dict(gradients)
        if perturb:
            noised = fisher_noise_mask(gradients, self.phi)
            for name, g in gradients.items():
                noise = call.statistic[name] * standard_normal_like(g, call.generator)
                shared[name] = prune_below_percentile(g, self.rho) + torch.where(noised[name], noise, 0.0)
        self.last_perturbed = perturb
        counter.fill_(step)  # nothing can fail any more
        return shared, state
