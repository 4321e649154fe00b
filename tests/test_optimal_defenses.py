"""Optimal defenses: the sensitivity estimate, optimal noise/pruning/clipped DP-SGD, noise baselines."""

import lightning as L
import pytest
import torch
from helpers import RandomImages, quiet_trainer
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


# ----------------------------------------------------------------------------- sensitivity
def test_exact_sensitivity_of_a_linear_score_is_one_over_the_batch_size():
    # L = mean_b w.x_b, so g = mean_b x_b and d g_i / d x_{b,i} = 1/B: s_i = B * (1/B)^2 = 1/B
    model = nn.Linear(3, 1, bias=False)
    x, y = torch.randn(4, 3), torch.zeros(4)
    exact = gradient_sensitivity(model, lambda out, _: out.mean(), x, y, exact=True)
    torch.testing.assert_close(exact["weight"], torch.full((1, 3), 0.25))
    probed = gradient_sensitivity(
        model, lambda out, _: out.mean(), x, y, num_probes=4000, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(probed["weight"], torch.full((1, 3), 0.25), rtol=0.1, atol=0)


def test_ten_probes_have_median_relative_error_under_half_and_more_probes_do_better():
    model, (x, y) = tiny_net(), tiny_batch()
    exact = gradient_sensitivity(model, CE, x, y, exact=True)
    medians = []
    for k in (10, 100, 1000):
        estimate = gradient_sensitivity(
            model, CE, x, y, num_probes=k, chunk_size=100, generator=torch.Generator().manual_seed(k)
        )
        medians.append(relative_errors(estimate, exact).median().item())
    assert medians[0] <= 0.5
    assert medians[0] > medians[1] > medians[2]


def test_chunking_the_probes_does_not_change_the_estimate():
    model, (x, y) = tiny_net(), tiny_batch()
    whole = gradient_sensitivity(model, CE, x, y, num_probes=6, generator=torch.Generator().manual_seed(3))
    chunked = gradient_sensitivity(
        model, CE, x, y, num_probes=6, chunk_size=4, generator=torch.Generator().manual_seed(3)
    )
    for n in whole:
        torch.testing.assert_close(whole[n], chunked[n])


def test_batchnorm_running_statistics_are_untouched_by_the_estimate():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Tanh(), nn.Flatten(), nn.Linear(4, 3)).train()
    before = {n: b.clone() for n, b in model.named_buffers()}
    s = gradient_sensitivity(model, CE, torch.randn(4, 1, 3, 4), torch.tensor([0, 1, 2, 0]), num_probes=3)
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
    assert all((v >= 0).all() for v in s.values())


def test_integer_inputs_are_rejected_with_what_to_use_instead():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 2))
    with pytest.raises(TypeError, match="embedding"):
        gradient_sensitivity(model, CE, torch.randint(0, 10, (3, 2)), torch.tensor([0, 1, 0]))


@pytest.mark.parametrize("kwargs", [{"num_probes": 0}, {"num_probes": 2.5}, {"chunk_size": 0}])
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


def test_sampled_noise_has_the_optimal_variance_and_the_gaussian_total_power():
    g, s = known_case()
    g = {n: v.double() for n, v in g.items()}
    s = {n: v.double() for n, v in s.items()}
    optimal, isotropic = OptimalGradientNoise(0.5, seed=0), GaussianNoise(0.5, seed=0)
    draws = 4000
    noise = {n: torch.stack([optimal(g, 0, sensitivity=s)[n] - g[n] for _ in range(draws)]) for n in g}
    iso = torch.stack([torch.cat([(isotropic(g, 0)[n] - g[n]).flatten() for n in g]) for _ in range(draws)])
    expected = optimal_noise_variance(g, s, scale=0.5)
    for n in g:
        torch.testing.assert_close(noise[n].var(0), expected[n], rtol=0.08, atol=1e-12)
    power = sum(noise[n].pow(2).flatten(1).sum(1) for n in g).mean()
    assert power.item() == pytest.approx(iso.pow(2).sum(1).mean().item(), rel=0.05)
    assert power.item() == pytest.approx(6 * 0.25, rel=0.05)


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
def test_laplace_noise_has_std_sqrt2_times_scale_and_quantization_hits_the_levels():
    g = {"w": torch.zeros(20000, dtype=torch.float64)}
    assert LaplaceNoise(0.3, seed=0)(g)["w"].std().item() == pytest.approx(0.3 * 2**0.5, rel=0.03)
    assert GaussianNoise(0.3, seed=0)(g)["w"].std().item() == pytest.approx(0.3, rel=0.03)
    q = GradientQuantization(3)({"w": torch.tensor([3.0, -1.4, 0.2, 0.0])})["w"]  # levels k * 3/3
    assert q.tolist() == [3.0, -1.0, 0.0, 0.0]
    assert GradientQuantization(1)({"w": torch.tensor([0.5, -2.0, 0.0])})["w"].tolist() == [2.0, -2.0, 0.0]
    stochastic = GradientQuantization(2, stochastic_rounding=True, seed=0)
    mean = torch.stack([stochastic({"w": torch.tensor([0.25, 1.0])}, 0)["w"] for _ in range(4000)]).mean(0)
    assert mean[0].item() == pytest.approx(0.25, abs=0.03)  # unbiased


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
        (lambda: callbacks.OptimalGradientNoise(0.1, num_probes=0), "num_probes"),
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
    pruning = callbacks.OptimalGradientPruning(rate=0.5, num_probes=5, seed=7, loss_fn=CE)
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
    quiet_trainer(max_steps=2, callbacks=[callbacks.OptimalGradientNoise(scale=0.01, num_probes=3, seed=0), tap]).fit(
        sim
    )
    record = tap.latest()
    assert all(torch.isfinite(v).all() for v in record.gradients.values())
    fedavg = FederatedSimulation(
        tiny_cnn(), datamodule=RandomImages(), algorithm="fedavg", num_clients=4, clients_per_round=2
    )
    with pytest.raises(ValueError, match="fedsgd"):
        quiet_trainer(max_steps=1, callbacks=[callbacks.OptimalGradientNoise(scale=0.01, num_probes=2)]).fit(fedavg)


def tiny_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.LeakyReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 4))


def test_accumulated_micro_batches_add_their_sensitivities():
    L.seed_everything(0)
    model = Classifier()
    x, y = tiny_batch()
    noise = callbacks.OptimalGradientNoise(scale=0.0, num_probes=4, seed=3, loss_fn=CE)  # zero noise: bookkeeping only
    quiet_trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[noise]).fit(
        model, DataLoader(TensorDataset(x, y), batch_size=2)
    )
    assert noise._micro_batches == 0 and noise._pending is None  # consumed by the one optimizer step


def test_combining_a_data_dependent_defense_with_dpsgd_is_refused():
    trainer = quiet_trainer(
        max_steps=1, callbacks=[callbacks.DPSGD(noise_multiplier=1.0), callbacks.OptimalGradientNoise(0.01)]
    )
    x, y = tiny_batch()
    with pytest.raises(ValueError, match="void the reported epsilon"):
        trainer.fit(Classifier(), DataLoader(TensorDataset(x, y), batch_size=4))
