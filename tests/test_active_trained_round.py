"""An active server at a trained round: it turns malicious at round r and sends its modified model built
on the round-r weights. The audit replays that as round 0 from those weights where no client defense
carries state across rounds, and names why it cannot where one does."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_gp.audit import AttackBudget, audit_setting, defense_catalog, published_attacks
from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.rounds import active_replay_blocker, tap_fedsgd_round
from lightning_gp.callbacks import GaussianNoise
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")
BUDGET = AttackBudget(ig_iterations=2, lbfgs_iterations=2, rtf_bins=16)


def audit_at_round_two(setting: DefenseSetting):
    L.seed_everything(0, verbose=False)
    return audit_setting(
        setting,
        LeNetZhu(),
        FashionMNISTSampleDataModule(batch_size=500),
        indices=[[0, 1], [2, 3]],
        published=published_attacks(BUDGET, ["iDLG", "RtF"]),
        budget=BUDGET,
        adaptive=False,
        num_clients=4,
        log=lambda line: None,
        round=2,
    )


def initial_weights() -> dict[str, torch.Tensor]:
    """The weights :func:`audit_at_round_two` starts from (the same seed, the same draw)."""
    L.seed_everything(0, verbose=False)
    return LeNetZhu().state_dict()


def test_robbing_the_fed_runs_at_a_trained_round_on_the_model_built_on_that_round_s_weights():
    audit = audit_at_round_two(DefenseSetting("noise", [GaussianNoise(scale=1e-6, seed=0)]))
    cells = {c.attack: c for c in audit.cells}
    assert cells["RtF"].status == "ok" and cells["RtF"].threat == "active"
    passive = audit.results["iDLG"][0].record.model_state
    active = audit.results["RtF"][0].record.model_state
    initial = initial_weights()
    for name, weight in passive.items():  # the imprinted model wraps the round-2 weights, not the initial ones
        assert torch.equal(active[f"model.{name}"], weight)
    assert any(not torch.equal(passive[n], initial[n]) for n in initial)  # the premise: two rounds moved them
    assert audit.active is not None and not any("not run at round" in r for r in audit.active.verdict_reasons)
    # the imprint block separates the images of a batch even after training: a noise this small hides none
    assert cells["RtF"].leak_fraction == 1.0 and audit.active.verdict == "leaks"


def test_dp_sgd_is_audited_at_a_trained_round_on_the_weights_its_own_training_reached():
    """DP-SGD (the plain-Trainer runner, through Opacus) at round 2: both servers attack the round-2
    weights that two DP-SGD steps reached (not the initial ones, not undefended training's), and the
    malicious server's round is replayed (DP-SGD keeps nothing across steps but its accounting)."""
    setting = defense_catalog(["DPSGD"])[0].build(0, 1)
    audit = audit_at_round_two(setting)
    cells = {c.attack: c for c in audit.cells}
    assert cells["iDLG"].status == "ok" and cells["RtF"].status == "ok"
    passive = audit.results["iDLG"][0].record.model_state
    active = audit.results["RtF"][0].record.model_state
    initial = initial_weights()
    assert any(not torch.equal(passive[n], initial[n]) for n in initial)
    for name, weight in passive.items():
        assert torch.equal(active[f"model.{name}"], weight)
    L.seed_everything(0, verbose=False)
    undefended = audit_at_round_two(DefenseSetting("undefended", runner="trainer"))
    other = undefended.results["iDLG"][0].record.model_state
    assert any(not torch.equal(passive[n], other[n]) for n in initial)  # trained through DP-SGD's clip and noise
    assert audit.active is not None and not any("not run at round" in r for r in audit.active.verdict_reasons)


def test_a_defense_with_per_client_state_is_not_replayed_and_the_active_verdict_says_why():
    setting = defense_catalog(["DualGradientPruning"])[0].build(0, 1)
    audit = audit_at_round_two(setting)
    assert "RtF" not in {c.attack for c in audit.cells}
    assert audit.active is not None and audit.active.verdict != "private"
    assert any(
        "the active attack RtF was not run at round 2: DualGradientPruning keeps per-client state across rounds" in r
        for r in audit.active.verdict_reasons
    )


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("undefended", None),
        ("GaussianNoise", None),
        ("LocalGaussianMechanism", None),
        ("GradientQuantization", None),
        ("DualGradientPruning", "keeps per-client state across rounds"),
        ("Outpost", "keeps per-client state across rounds"),
        ("AlignedDualGradientPruning", "coordinates the clients of each round"),
        ("OptimalGradientNoise", "keeps state across rounds"),
        ("PRECODE", "wraps or changes the model the clients train"),
        ("DPSGD", None),
    ],
)
def test_which_settings_a_trained_active_round_replays(name, reason):
    data = FashionMNISTSampleDataModule(batch_size=500)
    L.seed_everything(0, verbose=False)
    records, _, _ = tap_fedsgd_round(LeNetZhu(), data, indices=[[0]], num_clients=2)
    blocker = active_replay_blocker(defense_catalog([name])[0].build(0, 1), records[0])
    assert blocker == reason if reason is None else reason in blocker
