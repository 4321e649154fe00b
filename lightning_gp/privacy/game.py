"""The prior-aware discrete reconstruction game against DP-SGD, the empirical check of the ReRo bound.

Hayes, Mahloujifar, Balle, "Bounding Training Data Reconstruction in DP-SGD" (NeurIPS 2023, Sec. 4 and
Alg. 2): the adversary knows ``n`` candidate records, one of which (uniformly at random) is the
target the client trains on; every other record is known to it and subtracted, so each DP-SGD step
releases the target's clipped gradient, present with probability ``q`` (Poisson sampling), plus
``N(0, (sigma C)^2 I)``. The adversary sees every released gradient and every model in between (it
sends them) and picks the candidate of highest likelihood: at step ``t`` candidate ``i`` explains the
release ``o_t`` with density ``q N(o_t; g_i(theta_t), s^2) + (1 - q) N(o_t; 0, s^2)``. With a uniform
prior this is the Bayes-optimal guess among the candidates, so its success rate is the game's best:
it must stay below the bound ``eta`` at ``kappa = 1 / n``
(:func:`~lightning_gp.privacy.rero.reconstruction_bound`); above it, beyond the binomial confidence
interval, one of the two is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from lightning_gp.privacy.rero import GaussianMechanism
from lightning_gp.validation import check_int, check_nonnegative, check_number, check_positive, check_positive_int


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact two-sided binomial confidence interval of a success rate (Clopper, Pearson,
    Biometrika 1934): the Beta quantiles at ``(1 - confidence) / 2`` and ``(1 + confidence) / 2``."""
    from scipy.stats import beta

    check_positive_int(trials, "trials")
    check_int(successes, "successes", low=0, high=trials)
    check_number(confidence, "confidence", low=0.0, high=1.0, low_open=True, high_open=True)
    tail = (1.0 - confidence) / 2
    low = 0.0 if successes == 0 else float(beta.ppf(tail, successes, trials - successes + 1))
    high = 1.0 if successes == trials else float(beta.ppf(1 - tail, successes + 1, trials - successes))
    return low, high


@dataclass(frozen=True)
class GameResult:
    """The outcome of :func:`reconstruction_game`: ``successes`` correct picks out of ``trials``, each
    among ``candidates`` equally likely records, against ``mechanism``."""

    mechanism: GaussianMechanism
    candidates: int
    trials: int
    successes: int
    clipped_fraction: float  # of the candidate gradients met, the share longer than C (clipped to C)

    @property
    def kappa(self) -> float:
        """The prior-only success rate: ``1 / n``."""
        return 1.0 / self.candidates

    @property
    def success_rate(self) -> float:
        return self.successes / self.trials

    def interval(self, confidence: float = 0.95) -> tuple[float, float]:
        """The Clopper-Pearson interval of the success rate."""
        return clopper_pearson(self.successes, self.trials, confidence)

    @property
    def bound(self) -> float:
        """The ReRo bound ``eta`` at ``kappa = 1 / n``."""
        return self.mechanism.eta(self.kappa)


def reconstruction_game(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inputs: Tensor,
    targets: Tensor,
    *,
    noise_multiplier: float,
    max_grad_norm: float = 1.0,
    steps: int = 1,
    sample_rate: float = 1.0,
    lr: float = 0.0,
    trials: int = 1000,
    trials_per_batch: int = 256,
    seed: int = 0,
) -> GameResult:
    """Play ``trials`` rounds of the prior-aware game (module docstring) with the candidates
    ``inputs[i], targets[i]`` on ``model`` (its weights at the start of every trial; left unchanged).

    Each trial draws the target, runs ``steps`` DP-SGD steps on it alone (per-example clipping to
    ``max_grad_norm``, noise ``noise_multiplier * max_grad_norm``, Poisson participation at
    ``sample_rate``, the model moved by ``lr`` times the released gradient, as DP-SGD's server would)
    and lets the adversary pick by likelihood. Trials run ``trials_per_batch`` at a time, each with its
    own model (``torch.func``: one gradient per trial and candidate).
    """
    if not isinstance(inputs, Tensor) or not isinstance(targets, Tensor) or inputs.shape[0] != targets.shape[0]:
        raise ValueError("inputs and targets must be tensors with one row per candidate")
    n = int(inputs.shape[0])
    if n < 2:
        raise ValueError(f"inputs must hold at least 2 candidates, got {n}")
    mechanism = GaussianMechanism(
        noise_std=check_positive(noise_multiplier, "noise_multiplier") * check_positive(max_grad_norm, "max_grad_norm"),
        clip_norm=max_grad_norm,
        steps=steps,
        sample_rate=sample_rate,
        description=f"DP-SGD on the target alone, {steps} step(s) at q={sample_rate:g}",
    )
    check_nonnegative(lr, "lr")
    check_positive_int(trials, "trials")
    check_positive_int(trials_per_batch, "trials_per_batch")
    generator = torch.Generator().manual_seed(int(seed))
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return loss_fn(functional_call(model, {**p, **buffers}, (x.unsqueeze(0),)), y.unsqueeze(0))

    per_candidate = vmap(grad(loss), in_dims=(None, 0, 0))  # one gradient per candidate
    per_trial = vmap(per_candidate, in_dims=(0, None, None))  # ... for each trial's model
    successes, clipped, met = 0, 0, 0
    noise_std = mechanism.noise_std
    for start in range(0, trials, trials_per_batch):
        size = min(trials_per_batch, trials - start)
        chosen = torch.randint(n, (size,), generator=generator)
        weights = {k: v.unsqueeze(0).repeat(size, *[1] * v.ndim) for k, v in params.items()}
        scores = torch.zeros(size, n, dtype=torch.float64)
        for _ in range(steps):
            grads = per_trial(weights, inputs, targets)
            flat = torch.cat([g.reshape(size, n, -1) for g in grads.values()], dim=2).double()
            norms = flat.norm(dim=2, keepdim=True)
            clipped += int((norms > max_grad_norm).sum())
            met += norms.numel()
            flat = flat * (max_grad_norm / norms.clamp_min(max_grad_norm))
            present = (torch.rand(size, generator=generator) < sample_rate).double().unsqueeze(1)
            noise = torch.randn(size, flat.shape[2], generator=generator, dtype=torch.float64) * noise_std
            released = present * flat[torch.arange(size), chosen] + noise
            scores += _log_likelihoods(released, flat, noise_std, sample_rate)
            if lr > 0:
                update = released.to(inputs.dtype)
                offset = 0
                for k, w in weights.items():
                    width = w[0].numel()
                    weights[k] = w - lr * update[:, offset : offset + width].reshape(w.shape)
                    offset += width
        successes += int((scores.argmax(dim=1) == chosen).sum())
    return GameResult(mechanism, n, trials, successes, clipped / max(met, 1))


def _log_likelihoods(released: Tensor, gradients: Tensor, noise_std: float, sample_rate: float) -> Tensor:
    """``[trials, n]``: the log density of each trial's release under each candidate, up to a constant
    shared by the candidates (Hayes et al. 2023, Alg. 2)."""
    distance = (released.unsqueeze(1) - gradients).pow(2).sum(dim=2)
    with_target = math.log(sample_rate) - distance / (2 * noise_std**2)
    if sample_rate == 1:
        return with_target
    without = math.log1p(-sample_rate) - released.pow(2).sum(dim=1, keepdim=True) / (2 * noise_std**2)
    return torch.logaddexp(with_target, without.expand_as(with_target))
