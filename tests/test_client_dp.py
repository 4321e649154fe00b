"""Client-level DP (DP-FedAvg) in the federated simulation: the clip, the noise, the accounting, the budget."""

import math

import lightning as L
import pytest
import torch
from helpers import RandomImages, quiet_trainer, small_cnn
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_gp.callbacks import GradientTap
from lightning_gp.defenses import dp_sgd_gradient
from lightning_gp.defenses.clipping import clipped_example_sum
from lightning_gp.federated import ClientLevelDP, FederatedSimulation, clip_update, update_norm

NUM_CLIENTS, PER_ROUND = 6, 3


def simulation(client_dp: ClientLevelDP, **kwargs) -> FederatedSimulation:
    options = dict(
        datamodule=RandomImages(),
        num_clients=NUM_CLIENTS,
        clients_per_round=PER_ROUND,
        local_batch_size=4,
        server_optimizer="sgd",
        server_lr=1.0,
        seed=3,
        client_dp=client_dp,
    )
    options.update(kwargs)
    return FederatedSimulation(small_cnn(), **options)


def every_client_tap() -> list[GradientTap]:
    return [GradientTap(clients=c, rounds=None) for c in range(NUM_CLIENTS)]


class EpsilonPerRound(Callback):
    """Records ``dp_epsilon`` as logged after every round."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(trainer.callback_metrics["dp_epsilon"]))


def test_clip_update_scales_the_whole_update_onto_the_ball_and_keeps_shorter_ones():
    g = torch.Generator().manual_seed(0)
    long = {"a": torch.randn(30, generator=g) * 5, "b": torch.randn(4, 3, generator=g) * 5}
    clipped = clip_update(long, 1.5)
    assert update_norm(long) > 1.5
    assert update_norm(clipped) == pytest.approx(1.5, rel=1e-6)  # float32 precision
    factor = clipped["a"][0] / long["a"][0]
    for name in long:  # one factor for every layer: the direction is kept
        torch.testing.assert_close(clipped[name], long[name] * factor)
    short = {n: t * (1.0 / update_norm(long)) for n, t in long.items()}  # norm 1 < 1.5
    assert all(clip_update(short, 1.5)[n] is short[n] for n in short)


def test_dp_sgd_gradient_clips_each_example_onto_the_ball_before_the_mean():
    """Without noise: each example's whole gradient is clipped on its own (Opacus's factor
    ``C / (||g|| + 1e-6)``), then averaged; an example inside the ball counts unchanged."""
    g = torch.Generator().manual_seed(0)
    per_example = {"a": torch.randn(3, 30, generator=g), "b": torch.randn(3, 4, 2, generator=g)}
    per_example = {
        n: t * torch.tensor([10.0, 10.0, 0.01]).view(-1, *[1] * (t.ndim - 1)) for n, t in per_example.items()
    }
    shared = dp_sgd_gradient(per_example, 1.0, 0.0)
    expected = {n: torch.zeros_like(t[0]) for n, t in per_example.items()}
    for i in range(3):
        example = {n: t[i] for n, t in per_example.items()}
        norm = update_norm(example)
        factor = min(1.0, 1.0 / (norm + 1e-6))
        for n in expected:
            expected[n] += example[n] * factor / 3
    for n in shared:
        torch.testing.assert_close(shared[n], expected[n])
    with pytest.raises(ValueError, match="noise_multiplier"):
        dp_sgd_gradient(per_example, 1.0, -1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        dp_sgd_gradient(per_example, 0.0, 1.0)
    with pytest.raises(ValueError, match="per_example"):
        dp_sgd_gradient({"a": per_example["a"], "b": per_example["b"][:2]}, 1.0, 1.0)
    zero = {n: torch.zeros(2, *t.shape[1:], requires_grad=True) for n, t in per_example.items()}
    sum(t.sum() for t in clipped_example_sum(zero, 1.0).values()).backward()
    assert all(torch.isfinite(t.grad).all() for t in zero.values())  # an attack's all-zero dummy example
    broken = {**per_example, "a": per_example["a"].clone()}
    broken["a"][1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite gradients \(examples \[1\]\)"):
        dp_sgd_gradient(broken, 1.0, 1.0)


def test_every_shared_update_is_clipped_to_max_update_norm():
    L.seed_everything(0)
    bound = 1e-3  # far below any client's gradient norm here: every update is clipped to exactly C
    taps = every_client_tap()
    quiet_trainer(max_steps=2, callbacks=taps).fit(simulation(ClientLevelDP(0.0, bound, seed=0)))
    records = [r for tap in taps for r in tap.records]
    assert len(records) == 2 * PER_ROUND
    for record in records:
        assert update_norm(record.gradients) == pytest.approx(bound, rel=1e-5)


def test_the_server_noise_on_the_sum_has_std_noise_multiplier_times_clip():
    """``W (w0 - w1) - sum(clipped)`` is the noise on the sum (SGD at lr 1): its squared norm over
    ``(z C)^2`` is chi-square with ``d`` degrees of freedom, within 6 standard deviations ``sqrt(2 d)``."""
    L.seed_everything(0)
    z, bound = 2.0, 0.5
    taps = every_client_tap()
    sim = simulation(ClientLevelDP(z, bound, seed=1))
    start = {n: p.detach().clone() for n, p in sim.module.named_parameters()}
    quiet_trainer(max_steps=1, callbacks=taps).fit(sim)
    records = [r for tap in taps for r in tap.records]
    assert len(records) == PER_ROUND
    squares, d = 0.0, 0
    for name, p in sim.module.named_parameters():
        released = (start[name] - p.detach()).double() * PER_ROUND
        noise = released - torch.stack([r.gradients[name] for r in records]).double().sum(0)
        squares += float(noise.pow(2).sum())
        d += p.numel()
    statistic = squares / (z * bound) ** 2
    assert abs(statistic - d) < 6 * math.sqrt(2 * d)


@pytest.mark.parametrize("amplification", ["none", "poisson"])
def test_epsilon_logged_each_round_is_dp_accountings_for_the_same_rate_noise_and_rounds(amplification):
    from dp_accounting.pld import privacy_loss_distribution

    L.seed_everything(0)
    dp = ClientLevelDP(1.5, 1.0, delta=1e-5, amplification=amplification, seed=0)
    record = EpsilonPerRound()
    quiet_trainer(max_steps=2, callbacks=[record]).fit(simulation(dp))
    q = 1.0 if amplification == "none" else PER_ROUND / NUM_CLIENTS
    expected = [
        privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=1.5, sensitivity=1.0, sampling_prob=q, value_discretization_interval=1e-4
        )
        .self_compose(rounds)
        .get_epsilon_for_delta(1e-5)
        for rounds in (1, 2)
    ]
    assert record.values == pytest.approx(expected, rel=1e-6)
    assert record.values[1] > record.values[0] > 0


def test_the_simulation_stops_cleanly_before_the_round_that_would_pass_the_budget(tmp_path):
    L.seed_everything(0)
    probe = ClientLevelDP(2.0, 1.0, delta=1e-5, seed=0)
    budget = (probe.epsilon(2, 1.0) + probe.epsilon(3, 1.0)) / 2  # two rounds fit, three do not
    sim = simulation(ClientLevelDP(2.0, 1.0, delta=1e-5, stop_at_epsilon=budget, seed=0))
    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    trainer = quiet_trainer(max_steps=10, callbacks=[checkpoint], enable_checkpointing=True)
    trainer.fit(sim)
    assert trainer.global_step == 2
    assert sim.dp_epsilon() <= budget < sim.dp_epsilon(3)
    assert checkpoint.best_model_path and list(tmp_path.glob("*.ckpt"))


def test_a_budget_smaller_than_one_round_trains_no_round():
    L.seed_everything(0)
    probe = ClientLevelDP(1.0, 1.0, seed=0)
    sim = simulation(ClientLevelDP(1.0, 1.0, stop_at_epsilon=probe.epsilon(1, 1.0) / 2, seed=0))
    trainer = quiet_trainer(max_steps=5)
    trainer.fit(sim)
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"noise_multiplier": -0.5}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "max_update_norm": 0.0}, "max_update_norm"),
        ({"noise_multiplier": 1.0, "delta": 0.0}, "delta"),
        ({"noise_multiplier": 1.0, "delta": 1.0}, "delta"),
        ({"noise_multiplier": 1.0, "stop_at_epsilon": -1.0}, "stop_at_epsilon"),
        ({"noise_multiplier": 1.0, "amplification": "shuffle"}, "amplification"),
    ],
)
def test_bad_client_dp_settings_are_refused_naming_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        ClientLevelDP(**kwargs)


def test_client_dp_refuses_weighting_by_data_size():
    with pytest.raises(ValueError, match="weighting"):
        simulation(ClientLevelDP(1.0), weighting="num_samples")


def test_training_a_setting_under_client_dp_needs_the_simulation_runner():
    """``train_setting(client_dp=...)`` (the PMM of DP-FedAvg) refuses a plain-Trainer setting by name
    instead of training it without the client-level noise."""
    from lightning_gp.audit import DefenseSetting, train_setting
    from lightning_gp.data import FashionMNISTSampleDataModule

    setting = DefenseSetting("plain", runner="trainer")
    with pytest.raises(ValueError, match="client_dp needs the simulation runner; plain"):
        train_setting(setting, small_cnn(), FashionMNISTSampleDataModule(), rounds=1, client_dp=ClientLevelDP(1.0))
