"""Optimal defenses: the sensitivity estimate, optimal noise/pruning/clipped DP-SGD, noise baselines."""

import math

import lightning as L
import pytest
import torch
from helpers import RandomImages, quiet_trainer
from scipy.stats import binom, chi2, gamma
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp import callbacks
from lightning_gp.defenses import (
    GaussianNoise,
    GradientQuantization,
    LaplaceNoise,
    OptimalDPSGD,
    OptimalGradientNoise,
    OptimalGradientPruning,
    gradient_sensitivity,
    optimal_noise_variance,
)
from lightning_gp.defenses.optimal import water_fill
from lightning_gp.federated import FederatedSimulation

CE = nn.functional.cross_entropy


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.LeakyReLU(), nn.Linear(5, 3))


def tiny_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 1, 3, 4, generator=g), torch.tensor([0, 1, 2, 1])


def relative_errors(estimate: dict, exact: dict) -> torch.Tensor:
    return torch.cat([((estimate[n] - exact[n]).abs() / exact[n]).flatten() for n in exact if (exact[n] > 0).all()])


# Statistical checks of seeded draws: each fails a correct implementation with probability <= 1e-6 (two-sided,
# split evenly between the sides and over the `checks` a bound covers). The draws are seeded, so a run's outcome
# is fixed; the rate says how unlucky a seed would have to be.
FALSE_FAILURE = 1e-6


def chi2_band(dof: int, checks: int = 1) -> tuple[float, float]:
    """``(low, high)`` with ``P(chi2_dof / dof < low) = P(chi2_dof / dof > high) = FALSE_FAILURE / (2 checks)``:
    the band of a variance estimate from ``dof`` Gaussian degrees of freedom, relative to the true variance."""
    q = FALSE_FAILURE / (2 * checks)
    return chi2.ppf(q, dof) / dof, chi2.isf(q, dof) / dof


def power_band(variances: torch.Tensor, draws: int) -> tuple[float, float]:
    """Band for the mean over ``draws`` of ``sum_i Z_i^2`` with independent ``Z_i ~ N(0, variances_i)``.

    Laurent & Massart (2000), Lemma 1: for ``a >= 0`` and standard normal ``Z_j``, ``sum_j a_j (Z_j^2 - 1)``
    exceeds ``2 |a|_2 sqrt(x) + 2 |a|_inf x`` and falls below ``-2 |a|_2 sqrt(x)`` each with probability
    at most ``e^-x``; here ``a`` is every variance divided by ``draws``, once per draw.
    """
    v = variances.flatten().double()
    x = math.log(2 / FALSE_FAILURE)
    l2, linf, total = math.sqrt(float((v**2).sum()) / draws), float(v.max()) / draws, float(v.sum())
    return total - 2 * l2 * math.sqrt(x), total + 2 * l2 * math.sqrt(x) + 2 * linf * x


# ----------------------------------------------------------------------------- sensitivity
def test_exact_sensitivity_of_a_linear_score_is_one_over_the_batch_size():
    # L = mean_b w.x_b, so g = mean_b x_b and d g_i / d x_{b,i} = 1/B: s_i = B * (1/B)^2 = 1/B
    model = nn.Linear(3, 1, bias=False)
    x, y = torch.randn(4, 3), torch.zeros(4)
    exact = gradient_sensitivity(model, lambda out, _: out.mean(), x, y, exact=True)
    torch.testing.assert_close(exact["weight"], torch.full((1, 3), 0.25))
    probed = gradient_sensitivity(
        model, lambda out, _: out.mean(), x, y, probes=4000, generator=torch.Generator().manual_seed(0)
    )
    # Each coordinate's (J v)_i ~ N(0, 1/4): the estimate is 0.25 chi2_4000 / 4000 exactly (+-12% at 1e-6 over
    # the three); an unsquared, doubly normalised or wrongly scaled probe falls outside.
    low, high = chi2_band(4000, checks=3)
    assert bool(((probed["weight"] >= 0.25 * low) & (probed["weight"] <= 0.25 * high)).all()), probed["weight"]


def test_ten_probes_have_median_relative_error_under_half_and_more_probes_do_better():
    """A coordinate's estimate from k Gaussian probes is exactly s_i chi2_k / k ((J v)_i ~ N(0, s_i)), so its
    relative error |chi2_k / k - 1| (~ sqrt(2 / k)) has a known law: median 0.30 at k = 10, 0.03 at k = 1000.

    Medians: the coordinates of one estimate share its probes, so their errors are correlated in general.
    For a linear score over D input features they are not: coordinate i of g = mean_b x_b depends on feature i
    alone (disjoint rows of J), so one estimate gives D = 101 independent errors with exactly that law, and
    how many fall below a threshold is binomial. Each claim fails a correct estimator with the binomial
    probability computed below (all <= 1e-6):

    - 10 probes, median error <= 0.5 (P(error <= 0.5) = 0.76 per coordinate);
    - 10 probes, median error > 0.1 (P(error > 0.1) = 0.83): an estimator that ignores probes fails;
    - 1000 probes, median error <= 0.1 (P = 0.975).

    On the small network (correlated coordinates) every coordinate of a 1000-probe estimate, made in two
    chunks, lies in its chi2 band (union bound over the coordinates, valid under any correlation). A lost or
    doubled chunk (errors ~0.5 / ~1), dividing by k^2 or probes of variance 1.2 instead of 1 fail.
    """
    features, batch = 101, 4
    linear = nn.Linear(features, 1, bias=False)
    x, y = torch.randn(batch, features, generator=torch.Generator().manual_seed(2)), torch.zeros(batch)
    exact = gradient_sensitivity(linear, lambda out, _: out.mean(), x, y, exact=True)
    torch.testing.assert_close(exact["weight"], torch.full((1, features), 1 / batch))

    def errors(probes: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(probes)
        estimate = gradient_sensitivity(
            linear, lambda out, _: out.mean(), x, y, probes=probes, chunk_size=500, generator=generator
        )
        return relative_errors(estimate, exact)

    def within(k: int, t: float) -> float:
        """P(|chi2_k / k - 1| <= t): one coordinate's chance of an error of at most t."""
        return chi2.cdf(k * (1 + t), k) - chi2.cdf(k * (1 - t), k)

    def majority_missed(p: float) -> float:
        """P(at most half of the independent coordinates succeed), each with probability p."""
        return binom.cdf(features // 2, features, p)

    assert majority_missed(within(10, 0.5)) <= 1e-6 and majority_missed(1 - within(10, 0.1)) <= 1e-6
    assert majority_missed(within(1000, 0.1)) <= 1e-6
    ten, thousand = errors(10), errors(1000)
    print(f"median relative error: 10 probes {ten.median():.3f}, 1000 probes {thousand.median():.3f}")
    assert int((ten <= 0.5).sum()) > features // 2
    assert int((ten > 0.1).sum()) > features // 2
    assert int((thousand <= 0.1).sum()) > features // 2

    model, (x, y) = tiny_net(), tiny_batch()
    exact = gradient_sensitivity(model, CE, x, y, exact=True)
    estimate = gradient_sensitivity(
        model, CE, x, y, probes=1000, chunk_size=500, generator=torch.Generator().manual_seed(0)
    )
    ratios = torch.cat([(estimate[n] / exact[n]).flatten() for n in exact])
    low, high = chi2_band(1000, checks=ratios.numel())  # -23% / +28% for the 83 coordinates
    assert bool(((ratios >= low) & (ratios <= high)).all()), (float(ratios.min()), float(ratios.max()), low, high)


def test_chunking_the_probes_does_not_change_the_estimate():
    model, (x, y) = tiny_net(), tiny_batch()
    whole = gradient_sensitivity(model, CE, x, y, probes=6, generator=torch.Generator().manual_seed(3))
    chunked = gradient_sensitivity(model, CE, x, y, probes=6, chunk_size=4, generator=torch.Generator().manual_seed(3))
    for n in whole:
        torch.testing.assert_close(whole[n], chunked[n])


def test_batchnorm_running_statistics_are_untouched_by_the_estimate():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Tanh(), nn.Flatten(), nn.Linear(4, 3)).train()
    before = {n: b.clone() for n, b in model.named_buffers()}
    s = gradient_sensitivity(model, CE, torch.randn(4, 1, 3, 4), torch.tensor([0, 1, 2, 0]), probes=3)
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
    assert all((v >= 0).all() for v in s.values())


def test_integer_inputs_are_rejected_with_what_to_use_instead():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 2))
    with pytest.raises(TypeError, match="embedding"):
        gradient_sensitivity(model, CE, torch.randint(0, 10, (3, 2)), torch.tensor([0, 1, 0]))


@pytest.mark.parametrize("kwargs", [{"probes": 0}, {"probes": 2.5}, {"chunk_size": 0}])
def test_bad_probe_arguments_are_rejected(kwargs):
    model, (x, y) = tiny_net(), tiny_batch()
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        gradient_sensitivity(model, CE, x, y, **kwargs)


# ----------------------------------------------------------------------------- optimal noise
def known_case():
    g = {"a": torch.tensor([1.0, 0.0, 0.5, -2.0]), "b": torch.tensor([[0.1, 0.2]])}
    s = {"a": torch.tensor([4.0, 1.0, 1.0, 0.0]), "b": torch.tensor([[1.0, 4.0]])}
    return g, s


def test_noise_variance_is_proportional_to_sqrt_s_over_abs_g_with_isotropic_total_power():
    g, s = known_case()
    variance = optimal_noise_variance(g, s, scale=1.0)
    # weights sqrt(s)/|g|: a -> [2, (g=0) 0, 2, (s=0) 0], b -> [10, 10]; total power 6 * 1^2
    torch.testing.assert_close(variance["a"], torch.tensor([0.5, 0.0, 0.5, 0.0]))
    torch.testing.assert_close(variance["b"], torch.tensor([[2.5, 2.5]]))


def test_the_variance_cap_moves_power_to_the_other_coordinates():
    g, s = known_case()
    variance = optimal_noise_variance(g, s, scale=1.0, max_variance=2.0)
    torch.testing.assert_close(variance["b"], torch.tensor([[2.0, 2.0]]))
    torch.testing.assert_close(variance["a"], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    with pytest.warns(UserWarning, match="caps all"):
        optimal_noise_variance(g, s, scale=1.0, max_variance=1.0)


def sorted_water_fill(w: torch.Tensor, total: float, cap: float) -> torch.Tensor:
    """Closed form: the j largest weights capped, lambda_j = (total - j cap) / (sum of the others),
    for the first j at which the largest uncapped weight stays within the cap."""
    order = w.sort(descending=True).values
    rest = order.flip(0).cumsum(0).flip(0)  # rest[j]: sum of the weights ranked j and below
    for j in range(order.numel()):
        lam = (total - j * cap) / float(rest[j])
        if lam * float(order[j]) <= cap:
            return torch.where(lam * w > cap, torch.full_like(w, cap), lam * w)
    raise AssertionError("the cap binds everywhere")


@pytest.mark.parametrize("seed", range(6))
def test_water_filling_matches_the_sorted_closed_form(seed):
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed weights (as sqrt(s) / |g| is) with exact zeros: the cap binds for a few
    pareto = torch.rand(5000, generator=g, dtype=torch.float64).pow(-1 / 0.7)
    w = pareto * (torch.rand(5000, generator=g) > 0.1)
    total = 5000 * 1.0
    cap = float(torch.tensor([2.0, 5.0, 20.0, 100.0, 1e3, 1e9])[seed])
    variance = water_fill({"a": w[:3000].view(30, 100), "b": w[3000:]}, total, cap)
    flat = torch.cat([variance["a"].flatten(), variance["b"]])
    torch.testing.assert_close(flat, sorted_water_fill(w, total, cap), rtol=1e-12, atol=0)
    assert math.isclose(float(flat.sum()), total, rel_tol=1e-12)
    assert float(flat.max()) <= cap


def test_sampled_noise_has_the_optimal_variance_and_the_gaussian_total_power():
    g, s = known_case()
    g = {n: v.double() for n, v in g.items()}
    s = {n: v.double() for n, v in s.items()}
    optimal, isotropic = OptimalGradientNoise(0.5, seed=0), GaussianNoise(0.5, seed=0)
    draws = 4000
    noise = {n: torch.stack([optimal(g, 0, sensitivity=s)[n] - g[n] for _ in range(draws)]) for n in g}
    iso = torch.stack([torch.cat([(isotropic(g, 0)[n] - g[n]).flatten() for n in g]) for _ in range(draws)])
    expected = optimal_noise_variance(g, s, scale=0.5)
    # Sample variances of 4000 Gaussian draws: chi2 with 3999 dof (+-12% at 1e-6 over the 4 noised
    # coordinates); the coordinates meant to get no noise get exactly none. A sqrt(s)/|g| rule without the
    # square root, or one normalised to another total, puts some coordinate far outside.
    noised = sum(int((v > 0).sum()) for v in expected.values())
    low, high = chi2_band(draws - 1, checks=noised)
    for n in g:
        variance, target = noise[n].var(0), expected[n]
        assert bool((variance[target == 0] == 0).all()), n
        ratio = variance[target > 0] / target[target > 0]
        assert bool(((ratio >= low) & (ratio <= high)).all()), (n, ratio, low, high)
    # Total power: the optimal noise is scaled to the isotropic noise's 6 * 0.5^2, and both sampled means
    # stay in their 1e-6 bands around it (power_band: ~+-7% here).
    assert sum(float(v.sum()) for v in expected.values()) == pytest.approx(6 * 0.25, rel=1e-12)
    power = float(sum(noise[n].pow(2).flatten(1).sum(1) for n in g).mean())
    low, high = power_band(torch.cat([v.flatten() for v in expected.values()]), draws)
    assert low <= power <= high, (power, low, high)
    low, high = power_band(torch.full((6,), 0.25), draws)
    assert low <= float(iso.pow(2).sum(1).mean()) <= high


def test_zero_gradient_coordinates_get_no_noise():
    g, s = known_case()
    out = OptimalGradientNoise(1.0, seed=0)(g, 0, sensitivity=s)
    assert out["a"][1] == 0.0


def test_a_gradient_that_does_not_depend_on_the_input_is_an_error():
    g, _ = known_case()
    zeros = {n: torch.zeros_like(v) for n, v in g.items()}
    with pytest.raises(ValueError, match="does not depend on the input"):
        OptimalGradientNoise(1.0, seed=0)(g, 0, sensitivity=zeros)


# ----------------------------------------------------------------------------- clipped optimal DP-SGD
def test_clipped_coordinates_are_clipped_and_get_zero_noise():
    g, s = known_case()
    out = OptimalDPSGD(clip=0.6, scale=0.3, seed=1)(g, 0, sensitivity=s)
    assert out["a"][0] == 0.6 and out["a"][3] == -0.6  # |g| >= clip: exactly the bound, no noise
    assert out["a"][1] == 0.0
    assert out["a"][2] != 0.5 and (out["b"] != g["b"]).all()  # the others are noised
    variance = optimal_noise_variance(g, s, scale=0.3, clip=0.6)
    assert variance["a"][0] == 0 and variance["a"][3] == 0
    total = sum(v.sum() for v in variance.values())
    assert total.item() == pytest.approx(6 * 0.09)


# ----------------------------------------------------------------------------- optimal pruning
def test_optimal_pruning_removes_the_largest_sqrt_s_over_abs_g_coordinates():
    g = {"a": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.tensor([1.0, 1.0])}
    s = {"a": torch.tensor([1.0, 64.0, 9.0, 1.0]), "b": torch.tensor([100.0, 0.25])}
    # ratios: a -> [1, 4, 1, 0.25], b -> [10, 0.5]
    out = OptimalGradientPruning(0.5)(g, 0, sensitivity=s)  # 3 of 6, globally: b0, a1, then a0 or a2 (tie by position)
    assert out["b"].tolist() == [0.0, 1.0]
    assert out["a"].tolist() == [0.0, 0.0, 3.0, 4.0]
    per_layer = OptimalGradientPruning(0.5, scope="layer")(g, 0, sensitivity=s)
    assert per_layer["a"].tolist() == [0.0, 0.0, 3.0, 4.0] and per_layer["b"].tolist() == [0.0, 1.0]


def test_optimal_pruning_prunes_zero_gradients_first():
    g = {"a": torch.tensor([0.0, 1.0, 2.0])}
    s = {"a": torch.tensor([0.0, 1.0, 1.0])}
    out = OptimalGradientPruning(1 / 3)(g, 0, sensitivity=s)
    assert out["a"].tolist() == [0.0, 1.0, 2.0]


# ----------------------------------------------------------------------------- baselines
def test_laplace_noise_has_scale_b_gaussian_noise_std_scale_and_quantization_hits_the_levels():
    n = 20000
    g = {"w": torch.zeros(n, dtype=torch.float64)}
    # Laplace(b): |z| / b ~ Exp(1), so sum |z| / b ~ Gamma(n, 1) exactly (+-3.5% at 1e-6), and then std = sqrt(2) b.
    # Catches b taken as the std (-29%) and Gaussian noise of the right std (+13%).
    laplace = LaplaceNoise(0.3, seed=0)(g)["w"]
    q = FALSE_FAILURE / 2
    assert gamma.ppf(q, n) / n <= laplace.abs().mean().item() / 0.3 <= gamma.isf(q, n) / n
    # Gaussian: (n - 1) s^2 / scale^2 ~ chi2_{n-1} (std +-2.5% at 1e-6).
    low, high = chi2_band(n - 1)
    assert low <= (GaussianNoise(0.3, seed=0)(g)["w"].std().item() / 0.3) ** 2 <= high
    q = GradientQuantization(3)({"w": torch.tensor([3.0, -1.4, 0.2, 0.0])})["w"]  # levels k * 3/3
    assert q.tolist() == [3.0, -1.0, 0.0, 0.0]
    assert GradientQuantization(1)({"w": torch.tensor([0.5, -2.0, 0.0])})["w"].tolist() == [2.0, -2.0, 0.0]
    stochastic = GradientQuantization(2, stochastic_rounding=True, seed=0)
    draws = 4000
    mean = torch.stack([stochastic({"w": torch.tensor([0.25, 1.0])}, 0)["w"] for _ in range(draws)]).mean(0)
    # Unbiased: 0.25 rounds up to level 1 with probability 0.25, so the count of ups is Binomial(4000, 0.25)
    # (mean within +-0.034 at 1e-6); rounding to nearest (0) or up-biased rounding falls outside.
    ups = round(mean[0].item() * draws)
    assert binom.ppf(FALSE_FAILURE / 2, draws, 0.25) <= ups <= binom.isf(FALSE_FAILURE / 2, draws, 0.25)
    assert mean[1].item() == 1.0  # already on a level: never moved


def test_clipped_isotropic_noise_clips_before_adding_noise():
    out = GaussianNoise(0.0, clip=1.0)({"w": torch.tensor([3.0, -0.5, -7.0])})["w"]
    assert out.tolist() == [1.0, -0.5, -1.0]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: GaussianNoise(-0.1), "scale"),
        (lambda: LaplaceNoise(float("nan")), "scale"),
        (lambda: GaussianNoise(0.1, clip=0.0), "clip"),
        (lambda: GradientQuantization(0), "bits"),
        (lambda: OptimalGradientNoise(-1.0), "scale"),
        (lambda: OptimalGradientNoise(1.0, c=0.0), "c"),
        (lambda: OptimalDPSGD(clip=0.0), "clip"),
        (lambda: OptimalDPSGD(clip=-1.0), "clip"),
        (lambda: OptimalGradientPruning(1.5), "rate"),
        (lambda: OptimalGradientPruning(0.5, scope="model"), "scope"),
        (lambda: callbacks.OptimalGradientNoise(scale=0.1, probes=0), "probes"),
    ],
)
def test_bad_arguments_name_the_argument(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_the_sensitivity_must_be_given_and_match_the_gradient():
    g, s = known_case()
    with pytest.raises(TypeError, match="sensitivity="):
        OptimalGradientNoise(1.0)(g)
    with pytest.raises(ValueError, match="shape"):
        OptimalGradientNoise(1.0)(g, sensitivity={"a": torch.ones(3), "b": s["b"]})
    with pytest.raises(ValueError, match="non-negative"):
        OptimalGradientNoise(1.0)(g, sensitivity={"a": -s["a"], "b": s["b"]})


# ----------------------------------------------------------------------------- callbacks
class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return CE(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_local_path_prunes_with_the_sensitivity_of_the_batch_being_trained_on():
    L.seed_everything(0)
    model = Classifier()
    x, y = tiny_batch()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = CE(model(x), y)
    raw = dict(zip(start, torch.autograd.grad(loss, list(model.parameters()))))
    pruning = callbacks.OptimalGradientPruning(rate=0.5, probes=5, seed=7, loss_fn=CE)
    expected_s = pruning.estimate(model, x, y, seed_words=(0, 0, 0))
    expected = OptimalGradientPruning(0.5)(raw, 0, sensitivity=expected_s)
    tap = callbacks.GradientTap(rounds=[0])
    quiet_trainer(max_steps=1, callbacks=[pruning, tap]).fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    for n in raw:
        torch.testing.assert_close(tap.latest().gradients[n], expected[n])
    assert int(sum((v == 0).sum() for v in tap.latest().gradients.values())) >= 0.5 * sum(
        v.numel() for v in raw.values()
    )


def test_optimal_noise_trains_in_the_simulation_and_refuses_fedavg():
    L.seed_everything(0)
    sim = FederatedSimulation(
        tiny_cnn(), datamodule=RandomImages(), num_clients=4, clients_per_round=2, local_batch_size=4
    )
    tap = callbacks.GradientTap(rounds=[1])
    quiet_trainer(max_steps=2, callbacks=[callbacks.OptimalGradientNoise(scale=0.01, probes=3, seed=0), tap]).fit(sim)
    record = tap.latest()
    assert all(torch.isfinite(v).all() for v in record.gradients.values())
    fedavg = FederatedSimulation(
        tiny_cnn(), datamodule=RandomImages(), algorithm="fedavg", num_clients=4, clients_per_round=2
    )
    with pytest.raises(ValueError, match="fedsgd"):
        quiet_trainer(max_steps=1, callbacks=[callbacks.OptimalGradientNoise(scale=0.01, probes=2)]).fit(fedavg)


def tiny_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.LeakyReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 4))


def test_accumulated_micro_batches_add_their_sensitivities():
    L.seed_everything(0)
    model = Classifier()
    x, y = tiny_batch()
    noise = callbacks.OptimalGradientNoise(scale=0.0, probes=4, seed=3, loss_fn=CE)  # zero noise: bookkeeping only
    quiet_trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[noise]).fit(
        model, DataLoader(TensorDataset(x, y), batch_size=2)
    )
    assert noise._micro_batches == 0 and noise._pending is None  # consumed by the one optimizer step


def test_combining_a_data_dependent_defense_with_dpsgd_is_refused():
    trainer = quiet_trainer(
        max_steps=1, callbacks=[callbacks.DPSGD(noise_multiplier=1.0), callbacks.OptimalGradientNoise(scale=0.01)]
    )
    x, y = tiny_batch()
    with pytest.raises(ValueError, match="void the reported epsilon"):
        trainer.fit(Classifier(), DataLoader(TensorDataset(x, y), batch_size=4))
