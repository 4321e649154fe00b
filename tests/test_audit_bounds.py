"""The audit's formal bound: which settings have one, the kappa it is taken at, and the report line."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import norm

from lightning_gp.audit import (
    AttackBudget,
    audit_setting,
    defense_catalog,
    defense_mechanism,
    prior_only_kappa,
    published_attacks,
    setting_bound,
)
from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.verdict import LeakRule
from lightning_gp.callbacks import DPSGD, GaussianNoise, TopKPruning
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.models import LeNetZhu

TINY = AttackBudget(ig_iterations=5, lbfgs_iterations=2, rtf_bins=8)


@pytest.fixture(scope="module")
def datamodule() -> FashionMNISTSampleDataModule:
    data = FashionMNISTSampleDataModule(seed=0)
    data.setup("fit")
    return data


def test_the_catalogue_dp_sgd_is_one_gaussian_step_at_its_noise():
    bound = setting_bound(defense_catalog(["DPSGD"])[0].build(0, 1), LeNetZhu())
    assert bound.mechanism is not None
    assert (bound.mechanism.noise_multiplier, bound.mechanism.steps, bound.mechanism.sample_rate) == (1.0, 1, 1.0)
    assert bound.at(0.1).eta == pytest.approx(norm.cdf(norm.ppf(0.1) + 1.0), abs=1e-3)


def test_a_trained_dp_sgd_is_bounded_by_the_steps_and_rate_it_accounted():
    dp = DPSGD(noise_multiplier=2.0, max_grad_norm=0.5)
    # the accounting a checkpoint restores: 30 steps at q = 0.1
    dp.load_state_dict(
        {"dp_sgd": {"accountant": {"history": [(2.0, 0.1, 30)]}, "noise_multiplier": 2.0, "delta": 1e-5}}
    )
    mechanism = defense_mechanism(dp)
    assert (mechanism.steps, mechanism.sample_rate, mechanism.noise_std, mechanism.sensitivity) == (30, 0.1, 1.0, 0.5)


def test_clipped_gaussian_noise_is_a_gaussian_mechanism_of_the_box_diameter():
    model = LeNetZhu()
    d = sum(p.numel() for p in model.parameters())
    bound = setting_bound(DefenseSetting("GaussianNoise(clip)", [GaussianNoise(scale=0.5, clip=1e-3)]), model)
    assert bound.mechanism is not None and bound.mechanism.neighbouring == "replace_one"
    assert bound.mechanism.sensitivity == pytest.approx(2 * 1e-3 * math.sqrt(d))
    assert bound.at(0.1).eta == pytest.approx(norm.cdf(norm.ppf(0.1) + 2e-3 * math.sqrt(d) / 0.5), abs=1e-3)


@pytest.mark.parametrize(
    "setting",
    [
        DefenseSetting("undefended"),
        DefenseSetting("TopK", [TopKPruning(rate=0.8)]),
        DefenseSetting("GaussianNoise", [GaussianNoise(scale=0.1)]),  # no clip: unbounded sensitivity
        DefenseSetting("DP + pruning", [DPSGD(noise_multiplier=1.0), TopKPruning(rate=0.5)], runner="trainer"),
        DefenseSetting("PRECODE", architecture=lambda model: model),
    ],
    ids=lambda s: s.name,
)
def test_settings_without_a_formal_mechanism_say_so_never_a_number(setting):
    bound = setting_bound(setting, LeNetZhu()).at(0.1)
    assert bound.mechanism is None and bound.eta is None and bound.reason
    assert bound.describe().startswith("no formal bound")


def test_asking_a_mechanism_of_a_defense_without_one_names_the_argument():
    with pytest.raises(ValueError, match="defense: TopKPruning has no formal mechanism"):
        defense_mechanism(TopKPruning(rate=0.8))
    with pytest.raises(ValueError, match="num_parameters"):
        defense_mechanism(GaussianNoise(scale=0.1, clip=1.0))


def test_kappa_counts_the_best_prior_only_guess_from_above():
    generator = torch.Generator().manual_seed(0)
    reference = torch.rand(20, 1, 16, 16, generator=generator)
    # originals that are public images: a fixed guess of one of them matches it exactly
    kappa_copies = prior_only_kappa(reference[:4].repeat(4, 1, 1, 1), reference)
    assert kappa_copies > 4 / 16  # one guess meets 4 of the 16 originals; the upper limit lies above
    noise = torch.rand(16, 1, 16, 16, generator=generator)
    kappa_noise = prior_only_kappa(noise, reference, rule=LeakRule(thresholds={"psnr": 20.0}))
    assert 0.0 < kappa_noise <= 1 - 0.025 ** (1 / 16) + 1e-9  # no guess succeeds: the 95% upper limit of 0/16
    # the semantic test: a typical image of the commonest class counts for all of that class
    labels = torch.tensor([3] * 12 + [1] * 4)
    assert prior_only_kappa(noise, reference, labels=labels) > 12 / 16


def test_the_audit_reports_eta_beside_the_measured_leaks(datamodule):
    torch.manual_seed(0)
    audit = audit_setting(
        defense_catalog(["DPSGD"])[0].build(0, 1),
        LeNetZhu(),
        datamodule,
        indices=[[0], [1]],
        published=published_attacks(TINY, ["IG"]),
        budget=TINY,
        adaptive=False,
        log=lambda line: None,
    )
    assert audit.bound is not None and audit.bound.kappa is not None and audit.bound.eta is not None
    assert audit.bound.kappa <= audit.bound.eta <= 1.0
    assert any(line.startswith("ReRo bound") for line in audit.summary_lines())
