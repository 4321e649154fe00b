"""The adaptive attacks on the secure aggregate: each defense's knowledge lifted to the mean of the
round's clients (``DefenseKnowledge.over_clients``), so the secure-aggregation view has an attacker who
knows the defense, and where the knowledge does not carry over the view names that gap."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightning_gp.attacks import DefenseKnowledge
from lightning_gp.attacks.resolution import composed_knowledge, defense_knowledge
from lightning_gp.audit import AttackBudget, audit_setting, published_attacks
from lightning_gp.audit.rounds import aggregate_record, tap_defended_round
from lightning_gp.audit.setting_audit import _server_view
from lightning_gp.data import FashionMNISTSampleDataModule, PhotoCropsDataModule
from lightning_gp.defenses import AlignedDualGradientPruning, GaussianNoise, RandomPruning
from lightning_gp.frontier import frontier_families
from lightning_gp.models import LeNetZhu


@pytest.fixture(scope="module")
def datamodule():
    dm = FashionMNISTSampleDataModule()
    dm.setup("fit")
    return dm


@pytest.mark.parametrize(
    ("family", "params"),
    [
        ("TopKPruning", {"rate": 0.8}),
        ("DPSGD", {"noise_multiplier": 0.0}),
        ("LocalGaussianMechanism", {"noise_multiplier": 0.0}),
    ],
)
def test_the_lifted_knowledge_reproduces_the_secure_aggregate_at_the_true_batch(datamodule, family, params):
    """At the clients' own images and labels, the lifted knowledge's dummy gradient is the round's mean of
    the defended updates to float precision: each client's own Top-k mask, per-example clip or update
    clip, then the mean (noise off, so the comparison is exact)."""
    setting = frontier_families()[family].build(params, 0, 1)
    # the weights are seeded, not left to whatever the worker ran before: under some draws of
    # U[-0.5, 0.5] one client's two images are classified confidently, its gradient is near zero and
    # the mean's support then matches the other client's alone (the Top-k check below would not hold)
    L.seed_everything(0, verbose=False)
    model = LeNetZhu()
    records, sent, _ = tap_defended_round(setting, model, datamodule, indices=[[0, 1], [2, 3]], num_clients=2)
    combined = aggregate_record(records)
    view = _server_view(combined, sent, datamodule)
    knowledge = composed_knowledge(setting.defenses(model, datamodule)).over_clients(2)
    guess = knowledge.dummy_gradient(view, combined.inputs, combined.targets)
    for name, shared in combined.gradients.items():
        torch.testing.assert_close(guess[name], shared, atol=1e-6, rtol=1e-5, msg=f"{family}: {name}")
    alone = composed_knowledge(setting.defenses(model, datamodule))
    if family == "TopKPruning":  # one client's support match does not model the mean: the lift is needed
        unlifted = alone.dummy_gradient(view, combined.inputs, combined.targets)
        kept = combined.gradients["fc.weight"] != 0
        assert not torch.allclose(unlifted["fc.weight"][kept], combined.gradients["fc.weight"][kept], atol=1e-4)


@pytest.mark.parametrize(("family", "params"), [("TopKPruning", {"rate": 0.8}), ("DPSGD", {"noise_multiplier": 0.0})])
def test_the_lift_is_exact_on_rgb_images_too(family, params):
    """The same exactness on 3 x 32 x 32 images of 11 classes (photo crops): the masks, clips and the
    mean work per channel-stacked layer, not on a grey 28 x 28 layout."""
    data = PhotoCropsDataModule(per_class_train=4, per_class_test=4, batch_size=500)
    data.setup("fit")
    setting = frontier_families()[family].build(params, 0, 1)
    model = LeNetZhu(num_classes=11, in_channels=3, image_size=32)
    L.seed_everything(0, verbose=False)
    records, sent, _ = tap_defended_round(setting, model, data, indices=[[0, 1], [2, 3], [4, 5]], num_clients=3)
    combined = aggregate_record(records)
    view = _server_view(combined, sent, data)
    assert view.input_shape == (3, 32, 32) and view.batch_size == 6
    knowledge = composed_knowledge(setting.defenses(model, data)).over_clients(3)
    guess = knowledge.dummy_gradient(view, combined.inputs, combined.targets)
    for name, shared in combined.gradients.items():
        torch.testing.assert_close(guess[name], shared, atol=1e-6, rtol=1e-5, msg=f"{family}: {name}")


def test_over_clients_refuses_what_the_mean_hides_and_scales_the_noise():
    """A mask that is not a function of the client's gradient (random, aligned to another client's) cannot
    be recomputed on a dummy: refused, naming why; the noise of a mean of K clients is sigma / sqrt(K)."""
    for defense in (RandomPruning(rate=0.5, seed=0), AlignedDualGradientPruning()):
        with pytest.raises(ValueError, match="which client sent which entry"):
            defense_knowledge(defense).over_clients(2)
    noise = defense_knowledge(GaussianNoise(scale=0.1, seed=0)).over_clients(4)
    assert math.isclose(noise.noise_level(None), 0.05)  # a fixed std reads nothing off the view
    with pytest.raises(ValueError, match="clients"):
        DefenseKnowledge().over_clients(0)
    with pytest.raises(ValueError, match="already"):
        noise.over_clients(2)
    with pytest.raises(ValueError, match="view_transform"):
        DefenseKnowledge(defense="X", support=False, view_transform=lambda view: lambda g: g).over_clients(2)


# 10 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_the_aggregate_view_runs_the_lifted_adaptive_attacks_and_names_the_gap_where_none_carries_over(datamodule):
    """Top-k's aggregate is attacked by its adaptive attacks knowing each client's mask (their cells in
    the view, no "no adaptive attack" gap); random pruning's is not modelled, a gap that keeps the
    aggregate's verdicts from private."""
    budget = AttackBudget(ig_iterations=20, lbfgs_iterations=4, rtf_bins=8)
    topk = frontier_families()["TopKPruning"].build({"rate": 0.8}, 0, 1)
    random = frontier_families()["RandomPruning"].build({"rate": 0.5}, 0, 1)
    audits = {}
    for setting in (topk, random):
        L.seed_everything(0, verbose=False)
        audits[setting.name] = audit_setting(
            setting, LeNetZhu(), datamodule, indices=[[0], [1]], published=published_attacks(budget, ["iDLG"]),
            budget=budget, aggregate=True, log=lambda line: None,
        )  # fmt: skip
    lifted = audits[topk.name]
    names = {c.attack for c in lifted.aggregate_cells}
    assert {"adaptive:DefenseAwareInversion", "adaptive:DefenseAwareIDLG"} <= names
    assert not any("no adaptive attack models" in r for r in lifted.aggregate.verdict_reasons)
    unmodelled = audits[random.name]
    assert not any(c.kind == "adaptive" for c in unmodelled.aggregate_cells)
    assert unmodelled.aggregate.verdict != "private"
    assert any("which client sent which entry" in r for r in unmodelled.aggregate.verdict_reasons)


def test_a_noise_read_off_the_view_is_one_client_s_batch_over_sqrt_clients(datamodule):
    """DP-SGD's noise std ``sigma C / B`` reads the batch off the view: on an aggregate of K clients of B
    images (a view of K B) it is one client's ``sigma C / B`` over sqrt(K), not ``sigma C / (K B)``."""
    setting = frontier_families()["DPSGD"].build({"noise_multiplier": 0.3}, 0, 1)
    model = LeNetZhu()
    L.seed_everything(0, verbose=False)
    records, sent, _ = tap_defended_round(setting, model, datamodule, indices=[[0, 1], [2, 3]], num_clients=2)
    one = composed_knowledge(setting.defenses(model, datamodule))
    client_view = _server_view(records[0], sent, datamodule)
    aggregate_view = _server_view(aggregate_record(records), sent, datamodule)
    lifted = one.over_clients(2).noise_level(aggregate_view)
    assert math.isclose(lifted, one.noise_level(client_view) / math.sqrt(2), rel_tol=1e-9)
    assert aggregate_view.batch_size == 4  # the view itself is untouched
