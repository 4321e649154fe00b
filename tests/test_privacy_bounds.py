"""ReRo bounds of (subsampled) Gaussian mechanisms, and the prior-aware game that must stay below them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm
from torch import nn

from lightning_gp.privacy import GaussianMechanism, clopper_pearson, reconstruction_bound, reconstruction_game


@pytest.mark.parametrize(("sigma", "steps", "kappa"), [(0.5, 1, 0.1), (1.0, 1, 0.1), (2.0, 4, 0.01), (4.0, 16, 0.5)])
def test_full_batch_bound_is_the_gaussian_closed_form(sigma, steps, kappa):
    # q = 1: T Gaussian steps are mu-GDP with mu = sqrt(T) / sigma, eta = Phi(Phi^-1(kappa) + mu)
    closed = norm.cdf(norm.ppf(kappa) + math.sqrt(steps) / sigma)
    assert reconstruction_bound(sigma, steps=steps, kappa=kappa) == pytest.approx(closed, abs=1e-3)


def test_a_noise_too_small_for_a_pld_gets_the_unsubsampled_bound_which_is_never_lower():
    # sigma 1e-6 under subsampling: a PLD grid would need petabytes; the q = 1 bound stands in
    assert reconstruction_bound(1e-6, steps=100, sample_rate=0.01, kappa=0.1) == 1.0
    tiny = reconstruction_bound(0.04, sample_rate=0.01, kappa=0.001)
    assert tiny == pytest.approx(norm.cdf(norm.ppf(0.001) + 1 / 0.04), abs=1e-9)
    # above the threshold the PLD's subsampled bound is used, and is below the fallback's (0.2: a PLD
    # just above the threshold, at 0.06, costs about 20 s of CPU for the same check)
    assert reconstruction_bound(0.2, sample_rate=0.01, kappa=0.001) < reconstruction_bound(0.2, kappa=0.001)


def test_replace_one_doubles_the_sensitivity():
    closed = norm.cdf(norm.ppf(0.1) + 2.0 / 1.0)
    assert reconstruction_bound(1.0, kappa=0.1, neighbouring="replace_one") == pytest.approx(closed, abs=1e-3)
    mechanism = GaussianMechanism(noise_std=3.0, clip_norm=1.5, neighbouring="replace_one")
    assert mechanism.sensitivity == 3.0 and mechanism.noise_multiplier == 2.0


def test_one_subsampled_step_is_the_mixture_of_the_gaussian_and_the_prior():
    # T = 1, rate q: the target is in the release with probability q, else the guess is the prior's
    q, sigma, kappa = 0.1, 1.0, 0.1
    expected = q * norm.cdf(norm.ppf(kappa) + 1 / sigma) + (1 - q) * kappa
    assert reconstruction_bound(sigma, sample_rate=q, kappa=kappa) == pytest.approx(expected, abs=1e-3)


def _monte_carlo_bound(sigma: float, q: float, steps: int, kappa: float, samples: int, seed: int) -> float:
    """Power at level kappa of the likelihood-ratio test of "target absent" (N(0, sigma^2)^T) against
    "target present with probability q" ((1 - q) N(0, sigma^2) + q N(1, sigma^2))^T (Neyman-Pearson)."""
    rng = np.random.default_rng(seed)

    def llr(x: np.ndarray) -> np.ndarray:
        return np.log1p(q * np.expm1((2 * x - 1) / (2 * sigma**2))).sum(axis=1)

    absent = rng.normal(0.0, sigma, (samples, steps))
    present = absent + (rng.random((samples, steps)) < q)
    threshold = np.quantile(llr(rng.normal(0.0, sigma, (samples, steps))), 1 - kappa)
    return float((llr(present) > threshold).mean())


def test_subsampled_composed_bound_matches_a_monte_carlo_estimate():
    sigma, q, steps, kappa, samples = 1.0, 0.2, 20, 0.1, 200_000
    estimate = _monte_carlo_bound(sigma, q, steps, kappa, samples, seed=0)
    library = reconstruction_bound(sigma, steps=steps, sample_rate=q, kappa=kappa)
    # the estimate's standard error is below sqrt(1/4 / samples) ~ 1.1e-3 (plus the threshold's, of the
    # same order): 6e-3 is more than 3 of each; the library's PLD is pessimistic, never far below
    assert library == pytest.approx(estimate, abs=6e-3)
    assert library >= estimate - 6e-3


def test_bound_grows_with_steps_rate_and_kappa_and_falls_with_noise():
    base = reconstruction_bound(1.0, steps=4, sample_rate=0.5, kappa=0.1)
    assert reconstruction_bound(1.0, steps=6, sample_rate=0.5, kappa=0.1) > base
    assert reconstruction_bound(1.0, steps=4, sample_rate=0.9, kappa=0.1) > base
    assert reconstruction_bound(1.0, steps=4, sample_rate=0.5, kappa=0.2) > base
    assert reconstruction_bound(2.0, steps=4, sample_rate=0.5, kappa=0.1) < base
    assert 0.1 <= base <= 1.0 and reconstruction_bound(0.0, kappa=0.1) == 1.0


def test_epsilon_of_one_gaussian_step_matches_the_analytic_gaussian_mechanism():
    # Balle & Wang 2018, Thm. 8: delta(eps) = Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s) at sensitivity 1
    sigma, delta = 1.0, 1e-5
    epsilon = GaussianMechanism(noise_std=sigma, clip_norm=1.0).epsilon(delta)
    reached = norm.cdf(1 / (2 * sigma) - epsilon * sigma) - math.exp(epsilon) * norm.cdf(
        -1 / (2 * sigma) - epsilon * sigma
    )
    assert reached == pytest.approx(delta, rel=0.05)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"noise_multiplier": -1.0, "kappa": 0.1}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "kappa": 1.5}, "kappa"),
        ({"noise_multiplier": 1.0, "kappa": 0.1, "sample_rate": 0.0}, "sample_rate"),
        ({"noise_multiplier": 1.0, "kappa": 0.1, "steps": 0}, "steps"),
        ({"noise_multiplier": 1.0, "kappa": 0.1, "neighbouring": "swap"}, "neighbouring"),
    ],
)
def test_bad_bound_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        reconstruction_bound(**kwargs)


@pytest.mark.parametrize("delta", [0.0, 1.0, -0.1])
def test_epsilon_refuses_delta_outside_the_open_unit_interval(delta):
    with pytest.raises(ValueError, match="delta"):
        GaussianMechanism(noise_std=1.0, clip_norm=1.0).epsilon(delta)


def test_clopper_pearson_covers_the_rate_and_is_exact_at_the_edges():
    low, high = clopper_pearson(30, 100)
    assert low < 0.3 < high
    assert clopper_pearson(0, 50)[0] == 0.0 and clopper_pearson(50, 50)[1] == 1.0
    # one-sided exactness at 0 successes: (1 - high)^n = (1 - confidence) / 2
    assert (1 - clopper_pearson(0, 50)[1]) ** 50 == pytest.approx(0.025, rel=1e-6)


def _candidates(n: int, seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return model, torch.randn(n, 1, 8, 8, generator=generator), torch.randint(10, (n,), generator=generator)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 4.0])
def test_the_prior_aware_game_stays_below_the_bound(sigma):
    model, x, y = _candidates(10, seed=0)
    result = reconstruction_game(
        model, nn.functional.cross_entropy, x, y, noise_multiplier=sigma, steps=2, sample_rate=0.5, lr=0.5, trials=400
    )
    # a correct game and bound fail this one-sided 99.95% check with probability below 5e-4
    assert result.interval(confidence=0.999)[0] <= result.bound
    # and the attacker is no straw man: above the prior-only guess wherever the noise lets it
    if sigma <= 1.0:
        assert result.interval(confidence=0.999)[0] > result.kappa


def test_the_game_catches_a_bound_that_is_too_small():
    # the same game at sigma 0.5 wins far more often than a sigma-4 bound allows: the check can fail
    model, x, y = _candidates(10, seed=1)
    result = reconstruction_game(model, nn.functional.cross_entropy, x, y, noise_multiplier=0.5, trials=400, seed=1)
    assert result.interval(confidence=0.999)[0] > reconstruction_bound(4.0, kappa=result.kappa)


def test_the_game_leaves_the_model_unchanged_and_is_seeded():
    model, x, y = _candidates(4, seed=2)
    before = [p.clone() for p in model.parameters()]
    runs = [
        reconstruction_game(model, nn.functional.cross_entropy, x, y, noise_multiplier=1.0, lr=1.0, steps=2, trials=50)
        for _ in range(2)
    ]
    assert runs[0].successes == runs[1].successes
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
