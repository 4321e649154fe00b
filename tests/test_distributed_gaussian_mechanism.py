"""The distributed Gaussian mechanism: each client of a cohort of ``K`` adds its share ``(z C)^2 / K`` of
one central noise to its clipped update, so the secure sum of the cohort carries DP-FedAvg's central
noise ``z C``; its bound is the sum's on the aggregate view and one weak upload's on the per-client view."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_gp import callbacks
from lightning_gp import defenses as D
from lightning_gp.attacks import DefenseKnowledge
from lightning_gp.attacks.resolution import composed_knowledge
from lightning_gp.audit import AttackBudget, DefenseSetting, audit_setting, defense_mechanism, published_attacks
from lightning_gp.audit.quiet import internal_trainer, quiet_lightning
from lightning_gp.audit.rounds import tap_fedsgd_round
from lightning_gp.audit.setting_audit import honest_cohort, with_absent_shares
from lightning_gp.audit.training import simulated_cohort
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.defenses.base import DefenseCall
from lightning_gp.federated import FederatedSimulation, train_many_clients
from lightning_gp.models import LeNetZhu
from lightning_gp.pipeline.stages import ClientSetup

pytestmark = pytest.mark.usefixtures("one_thread")


def _upload(defense: D.DistributedGaussianMechanism, gradients: dict, client: int) -> dict:
    call = DefenseCall(client_id=client, generator=torch.Generator().manual_seed(client))
    shared, _ = defense.transform(gradients, {}, call)
    return shared


def test_the_secure_sum_of_a_cohort_carries_the_central_noise() -> None:
    """A cohort of K = 64 clients with zero updates: each upload's entries have std z C / 8, their sum
    z C. With 64 x 4096 draws the sample std of the sum's 4096 entries is within 5% of z C (its relative
    standard error is 1 / sqrt(2 x 4096) = 1.1%: a 4.5-sigma margin)."""
    z, C, K = 2.0, 0.5, 64
    defense = D.DistributedGaussianMechanism(noise_multiplier=z, max_update_norm=C, cohort_size=K, seed=0)
    assert defense.noise_std == pytest.approx(z * C / math.sqrt(K))
    zeros = {"w": torch.zeros(4096)}
    uploads = [_upload(defense, zeros, c)["w"] for c in range(K)]
    assert float(uploads[0].std()) == pytest.approx(z * C / math.sqrt(K), rel=0.05)
    total = torch.stack(uploads).sum(0)
    assert float(total.std()) == pytest.approx(z * C, rel=0.05)


def test_the_update_is_clipped_as_a_whole_before_the_share_of_noise() -> None:
    defense = D.DistributedGaussianMechanism(noise_multiplier=0.0, max_update_norm=1.0, cohort_size=10, seed=0)
    gradients = {"a": torch.full((3,), 4.0), "b": torch.full((4,), 3.0)}  # norm sqrt(48 + 36)
    shared = _upload(defense, gradients, 0)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in shared.values()))
    assert norm == pytest.approx(1.0, rel=1e-6)


def test_its_bound_is_one_weak_upload_per_client_and_the_central_mechanism_on_the_cohort_s_sum() -> None:
    z, C, K = 1.0, 1.0, 1000
    callback = callbacks.DistributedGaussianMechanism(noise_multiplier=z, max_update_norm=C, cohort_size=K, seed=0)
    upload = defense_mechanism(callback)
    assert upload.noise_std == pytest.approx(z * C / math.sqrt(K)) and upload.sensitivity == pytest.approx(2 * C)
    summed = defense_mechanism(callback, aggregate_of=K)
    assert summed.noise_std == pytest.approx(z * C) and summed.sensitivity == pytest.approx(2 * C)
    central = defense_mechanism(callbacks.LocalGaussianMechanism(noise_multiplier=z, max_update_norm=C))
    kappa = 0.1
    assert summed.eta(kappa) == pytest.approx(central.eta(kappa))  # the sum is the central mechanism
    assert upload.eta(kappa) > 0.999 > summed.eta(kappa)  # one upload alone protects nothing
    assert "secure sum of 1000 clients" in summed.description
    # a sum of fewer clients than the cohort (dropouts) carries less noise: a weaker bound, never a stronger one
    assert defense_mechanism(callback, aggregate_of=K // 4).eta(kappa) > summed.eta(kappa)
    with pytest.raises(ValueError, match="aggregate_of"):
        defense_mechanism(callback, aggregate_of=0)


def test_client_sampling_is_accounted_as_the_rate_of_the_rounds_a_client_takes_part_in() -> None:
    callback = callbacks.DistributedGaussianMechanism(noise_multiplier=2.0, max_update_norm=1.0, cohort_size=1000)
    sampled = defense_mechanism(callback, releases=100, aggregate_of=1000, participation=1000 / 60000)
    assert sampled.sample_rate == pytest.approx(1 / 60) and sampled.steps == 100
    assert sampled.noise_std == pytest.approx(2.0) and "probability q = 0.01667" in sampled.description
    every_round = defense_mechanism(callback, releases=100, aggregate_of=1000)
    assert sampled.eta(0.1) < every_round.eta(0.1)  # amplification by sampling
    with pytest.raises(ValueError, match="participation"):
        defense_mechanism(callback, participation=0.0)
    # DP-SGD's one step per round on the client's batch: each example is in it exactly when its client is
    dp_sgd = defense_mechanism(callbacks.DPSGD(noise_multiplier=1.0), releases=100, participation=0.5)
    assert (dp_sgd.sample_rate, dp_sgd.steps, dp_sgd.neighbouring) == (0.5, 100, "add_remove")
    with pytest.raises(ValueError, match="participation"):
        defense_mechanism(callbacks.TopKPruning(rate=0.5), participation=0.5)


def test_bad_arguments_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="cohort_size"):
        D.DistributedGaussianMechanism(cohort_size=0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        D.DistributedGaussianMechanism(noise_multiplier=-1.0)
    with pytest.raises(ValueError, match="max_update_norm"):
        D.DistributedGaussianMechanism(max_update_norm=0.0)


def test_the_attacker_knows_the_upload_s_share_and_the_lift_divides_it_over_the_aggregate() -> None:
    """The adaptive attacks are LocalGaussianMechanism's (the clip and the noise std), with the upload's
    std ``z C / sqrt(K)``; lifted to an aggregate of ``K'`` clients' mean, that std over ``sqrt(K')``."""
    z, C, K = 1.0, 1.0, 100
    defense = D.DistributedGaussianMechanism(noise_multiplier=z, max_update_norm=C, cohort_size=K, seed=0)
    knowledge = composed_knowledge([defense])
    assert isinstance(knowledge, DefenseKnowledge) and knowledge.noise_std == pytest.approx(z * C / math.sqrt(K))
    view = SimpleNamespace(batch_size=4)  # a number std reads nothing off the view
    assert knowledge.over_clients(4).noise_level(view) == pytest.approx(z * C / math.sqrt(K) / 2)  # type: ignore[arg-type]


def test_the_audit_s_aggregate_view_carries_the_honest_cohort_s_noise_and_its_bound(monkeypatch) -> None:
    """Two audited clients of a cohort of 4: the aggregate view is their mean plus the other two clients'
    noise shares (honest: kept secret), so its noise is the central z C over the 2 summed, and its bound
    is the sum of the whole cohort's (noise z C); the per-client view's, one upload's z C / 2. Both bounds
    are read at one kappa, measured once: the aggregate holds the clients' images."""
    import lightning_gp.audit.setting_audit as setting_audit

    measured = []
    kappa = setting_audit.prior_only_kappa
    monkeypatch.setattr(setting_audit, "prior_only_kappa", lambda *a, **k: measured.append(1) or kappa(*a, **k))
    data = FashionMNISTSampleDataModule(batch_size=500)
    budget = AttackBudget(ig_iterations=3, lbfgs_iterations=2)
    setting = DefenseSetting(
        "distributed", [callbacks.DistributedGaussianMechanism(noise_multiplier=2.0, cohort_size=4, seed=0)]
    )
    L.seed_everything(0, verbose=False)
    audit = audit_setting(
        setting, LeNetZhu(), data, indices=[[0], [1]], published=published_attacks(budget, ["IG"]), budget=budget,
        adaptive=False, aggregate=True, log=lambda line: None,
    )  # fmt: skip
    assert audit.bound is not None and audit.bound.mechanism is not None
    assert audit.bound.mechanism.noise_std == pytest.approx(2.0 / 2)
    assert audit.aggregate_bound is not None and audit.aggregate_bound.mechanism is not None
    assert audit.aggregate_bound.mechanism.noise_std == pytest.approx(2.0)
    assert audit.aggregate_bound.eta < audit.bound.eta  # type: ignore[operator]
    assert audit.aggregate_bound.kappa == audit.bound.kappa and len(measured) == 1


def test_the_absent_shares_make_the_mean_s_noise_the_central_one_and_the_knowledge_knows_it() -> None:
    """On the mean of 4 present clients of a cohort of 100 (upload noise 0.1), the others' shares add
    std 0.1 sqrt(96) / 4: with the present clients' own, the central z C / 4 = 0.25, which the lifted
    knowledge models; the draw is the same on every call (one round's noise)."""
    cohort = D.DistributedGaussianMechanism(noise_multiplier=1.0, cohort_size=100)
    combine = with_absent_shares(cohort, 4, seed=0)
    zeros = [{"w": torch.zeros(40_000)} for _ in range(4)]
    added = combine(zeros)["w"]
    assert added.std().item() == pytest.approx(0.1 * math.sqrt(96) / 4, rel=0.02)
    assert torch.equal(added, combine(zeros)["w"])
    lifted = DefenseKnowledge(noise_std=cohort.noise_std, support=False).over_clients(4, noise_shares=100)
    total = math.hypot(0.1 * math.sqrt(96) / 4, 0.1 * math.sqrt(4) / 4)
    assert lifted.noise_level(None) == pytest.approx(total) == pytest.approx(0.25)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="noise_shares"):
        DefenseKnowledge(noise_std=0.1, support=False).over_clients(4, noise_shares=3)
    assert honest_cohort(DefenseSetting("d", [callbacks.DistributedGaussianMechanism(cohort_size=10)])) is not None
    assert honest_cohort(DefenseSetting("l", [callbacks.LocalGaussianMechanism()])) is None


def _simulation(clients_per_round: int, **kwargs) -> FederatedSimulation:
    return FederatedSimulation(
        LeNetZhu(), datamodule=FashionMNISTSampleDataModule(batch_size=64), num_clients=8,
        clients_per_round=clients_per_round, local_batch_size=1, **kwargs,
    )  # fmt: skip


def _fit(simulation: FederatedSimulation, cohort_size: int) -> None:
    defense = callbacks.DistributedGaussianMechanism(noise_multiplier=1.0, cohort_size=cohort_size, seed=0)
    with quiet_lightning():
        internal_trainer(max_steps=1, callbacks=[defense]).fit(simulation)


def test_rounds_that_sum_fewer_uploads_than_the_cohort_are_refused_before_they_train() -> None:
    """Four uploads of a cohort of 8 sum to noise z C / sqrt(2): half the variance the guarantee states."""
    with pytest.raises(ValueError, match=r"cohort_size=8.*aggregate 4 uploads.*0\.7071"):
        _fit(_simulation(4), cohort_size=8)
    with pytest.raises(ValueError, match=r"cohort_size=8.*aggregate 4 uploads"):
        train_many_clients(
            LeNetZhu(), FashionMNISTSampleDataModule(batch_size=64), rounds=1, clients_per_round=4,
            defense=D.DistributedGaussianMechanism(noise_multiplier=1.0, cohort_size=8, seed=0),
        )  # fmt: skip
    setup = ClientSetup(8, LeNetZhu(), {"w": torch.Size([3])}, cohort_size=4)  # DDP: four ranks
    with pytest.raises(ValueError, match="cohort_size=8"):
        callbacks.DistributedGaussianMechanism(noise_multiplier=1.0, cohort_size=8).bind(setup)


def test_a_full_cohort_or_a_simulation_that_stands_for_one_trains() -> None:
    _fit(_simulation(8), cohort_size=8)
    _fit(_simulation(4, cohort_size=8), cohort_size=8)  # four clients of a round of eight, as the audit taps
    _fit(_simulation(8), cohort_size=4)  # more uploads only add noise
    callbacks.DistributedGaussianMechanism(cohort_size=1000).bind(ClientSetup(1, LeNetZhu(), {}))  # no aggregate
    # the audit taps two clients of a cohort of 1,000: each upload carries its share, z C / sqrt(1000)
    defense = callbacks.DistributedGaussianMechanism(noise_multiplier=1.0, max_update_norm=1e-6, cohort_size=1000)
    records, _, _ = tap_fedsgd_round(LeNetZhu(), FashionMNISTSampleDataModule(), defenses=[defense], num_clients=2)
    noise = torch.cat([g.flatten() for g in records[0].gradients.values()])
    # 53,704 draws: 0.3% sampling error; the clipped gradient (norm 1e-6 over 53,704 entries) adds under 1%
    assert float(noise.std()) == pytest.approx(1e-6 / math.sqrt(1000), rel=0.05)
    assert (
        simulated_cohort([callbacks.DistributedGaussianMechanism(cohort_size=1000), callbacks.GaussianNoise()], 16)
        == 1000
    )
    assert simulated_cohort([callbacks.GaussianNoise()], 16) == 16
    with pytest.raises(ValueError, match="cohort_size"):
        _simulation(8, cohort_size=4)
