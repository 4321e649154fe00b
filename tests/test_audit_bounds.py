"""The audit's formal bound: which settings have one, the kappa it is taken at, and the report line."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import norm

from lightning_gp.attacks.base import Reconstruction
from lightning_gp.audit import (
    AttackBudget,
    audit_setting,
    defense_catalog,
    defense_mechanism,
    prior_only_kappa,
    published_attacks,
    setting_bound,
)
from lightning_gp.audit.bounds import KAPPA_IMAGES, prior_only_guesses, prior_only_leaks, prior_only_successes
from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.recognition import datamodule_recognition_tests
from lightning_gp.audit.rounds import public_examples
from lightning_gp.audit.setting_audit import _kappa_sample
from lightning_gp.audit.verdict import LeakRule, worst_case_report
from lightning_gp.callbacks import DPSGD, GaussianNoise, TopKPruning
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.federated import ClientLevelDP
from lightning_gp.metrics import reconstruction_report
from lightning_gp.metrics.lpips import LPIPS
from lightning_gp.models import LeNetZhu
from lightning_gp.normalization import denormalize
from lightning_gp.privacy import clopper_pearson

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
    pixel_rule = LeakRule(thresholds={"psnr": 20.0, "ssim": 0.5})
    # originals that are public images: a fixed guess of one of them matches it exactly
    kappa_copies = prior_only_kappa(reference[:4].repeat(4, 1, 1, 1), reference, rule=pixel_rule)
    assert kappa_copies > 4 / 16  # one guess meets 4 of the 16 originals; the upper limit lies above
    noise = torch.rand(16, 1, 16, 16, generator=generator)
    kappa_noise = prior_only_kappa(noise, reference, rule=LeakRule(thresholds={"psnr": 20.0}))
    assert 0.0 < kappa_noise <= 1 - 0.025 ** (1 / 16) + 1e-9  # no guess succeeds: the 95% upper limit of 0/16
    # the semantic test: a typical image of the commonest class counts for all of that class
    labels = torch.tensor([3] * 12 + [1] * 4)
    assert prior_only_kappa(noise, reference, labels=labels) > 12 / 16


@pytest.fixture(scope="module")
def sample_images(datamodule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8 training images of the built-in sample (the matrix's seed-0 draw) as pixels, their labels,
    and the first 16 public (test-split) images as pixels."""
    order = torch.randperm(len(datamodule.train_dataset), generator=torch.Generator().manual_seed(0))[:8]
    pairs = [datamodule.train_dataset[int(i)] for i in order]
    originals = denormalize(torch.stack([x for x, _ in pairs]), datamodule.mean, datamodule.std)
    labels = torch.tensor([int(y) for _, y in pairs])
    reference = denormalize(public_examples(datamodule, 16)[0], datamodule.mean, datamodule.std)
    return originals, labels, reference


def verdict_leaks(guess, originals, labels, reference, rule, lpips_fn=None) -> list[bool]:
    """Per original, whether the verdict itself (a report of the guess repeated for every original,
    judged by ``worst_case_report`` against the reference's trivial guesses) calls it leaked."""
    repeated = Reconstruction(guess.expand_as(originals).clone(), None)
    report = reconstruction_report(
        repeated, originals, ((0.0,), (1.0,)), true_labels=labels, lpips=lpips_fn is not None, lpips_fn=lpips_fn
    )
    worst = worst_case_report(
        [report],
        leak_thresholds=rule.thresholds,
        noise_ratio_line=rule.noise_ratio_line,
        reference_images=reference,
    )
    return [row.leaks for row in worst.rows]


@pytest.mark.parametrize(
    "rule",
    [LeakRule(), LeakRule(thresholds={"lpips": 0.12, "nmi": 0.75, "mse": 0.02})],
    ids=["default rule", "LPIPS, NMI and MSE lines"],
)
def test_every_fixed_guess_leaks_exactly_what_the_verdict_says_and_kappa_counts_the_best(sample_images, rule):
    # brute force: each guess of kappa through the verdict path itself, original by original
    originals, labels, reference = sample_images
    lpips_fn = LPIPS() if "lpips" in rule.thresholds else None
    leaks = prior_only_leaks(originals, reference, labels=labels, rule=rule, lpips_fn=lpips_fn)
    guesses = prior_only_guesses(originals, reference)
    assert leaks.shape == (8, len(guesses)) == (8, 2 + 1 + 16)
    verdict = [verdict_leaks(g, originals, labels, reference, rule, lpips_fn) for g in guesses]
    assert [leaks[:, j].tolist() for j in range(len(guesses))] == verdict
    best = max(sum(v) for v in verdict)
    successes = prior_only_successes(originals, reference, labels=labels, rule=rule, lpips_fn=lpips_fn)
    assert best <= successes and 0 < best < 8  # a mix: the check has leaks and misses to agree on
    kappa = prior_only_kappa(originals, reference, labels=labels, rule=rule, lpips_fn=lpips_fn)
    assert kappa == clopper_pearson(successes, 8)[1]


@pytest.mark.parametrize("line", [{"nmi": 0.3}, {"mse": 0.05}], ids=["NMI line alone", "MSE line alone"])
def test_a_rule_that_reads_one_similarity_judges_the_fixed_guesses_by_it(sample_images, line):
    # the guesses are scored only by the similarities the rule reads: the one it reads must still be scored
    originals, labels, reference = sample_images
    rule = LeakRule(thresholds=line, noise_ratio_line=None)
    leaks = prior_only_leaks(originals, reference, labels=labels, rule=rule)
    guesses = prior_only_guesses(originals, reference)
    assert [leaks[:, j].tolist() for j in range(len(guesses))] == [
        verdict_leaks(g, originals, labels, reference, rule) for g in guesses
    ]
    assert 0 < int(leaks.sum()) < leaks.numel()  # a mix: the line fires on some pairs and not on others


def test_a_guess_that_leaks_only_through_the_noise_ratio_pairing_counts(sample_images):
    # a line no public image reaches: only "noise ratio < 0.4 and closer than every trivial guess" can fire
    originals, labels, reference = sample_images
    rule = LeakRule(thresholds={"psnr": 1000.0})
    leaks = prior_only_leaks(originals, reference, labels=labels, rule=rule)
    best = int(leaks.sum(0).argmax())
    assert leaks[:, best].sum() >= 1
    guess = prior_only_guesses(originals, reference)[best]
    assert verdict_leaks(guess, originals, labels, reference, rule) == leaks[:, best].tolist()
    # the PSNR/SSIM/MSE-only count saw no success here: kappa stayed at the upper limit of 0 of 8
    assert prior_only_kappa(originals, reference, labels=labels, rule=rule) > clopper_pearson(0, 8)[1] + 0.1
    # under the default rule, public image 0 leaks 4 of the 8 (one of them through the pairing alone)
    assert prior_only_kappa(originals, reference, labels=labels) == pytest.approx(clopper_pearson(4, 8)[1])


def test_kappa_names_the_argument_a_rule_line_needs(sample_images):
    originals, labels, reference = sample_images
    with pytest.raises(ValueError, match="lpips_fn"):
        prior_only_kappa(originals, reference, labels=labels, rule=LeakRule(thresholds={"lpips": 0.1}))
    with pytest.raises(ValueError, match="labels"):
        prior_only_kappa(originals, reference)


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
    # kappa is measured on the 2 audited images and more training images, not on the 2 alone
    originals = audit.passive.original_pixels
    labels = torch.as_tensor([int(datamodule.train_dataset[i][1]) for i in (0, 1)])
    pixels, kappa_labels = _kappa_sample(datamodule, originals, labels, 0)
    assert pixels.shape[0] == min(KAPPA_IMAGES, len(datamodule.train_dataset)) == kappa_labels.shape[0]
    assert torch.equal(pixels[:2], originals) and torch.equal(kappa_labels[:2], labels)
    assert torch.unique(pixels.flatten(1), dim=0).shape[0] == pixels.shape[0]  # no image counted twice
    rule = LeakRule().calibrated(datamodule_recognition_tests(datamodule, log=lambda line: None))
    reference = denormalize(public_examples(datamodule)[0], datamodule.mean, datamodule.std)
    assert audit.bound.kappa == prior_only_kappa(pixels, reference, labels=kappa_labels, rule=rule)
    assert audit.bound.kappa < clopper_pearson(0, 2)[1]


def test_a_bound_at_round_r_composes_the_r_plus_1_releases_of_the_client():
    (entry,) = defense_catalog(["LocalGaussianMechanism"])
    setting = entry.build(0, 1)  # z = 0.5, C = 1: replace-one, mu = 2 / z per release
    first, later = setting_bound(setting, LeNetZhu()), setting_bound(setting, LeNetZhu(), round=5)
    assert first.mechanism is not None and later.mechanism is not None
    assert (later.mechanism.steps, later.mechanism.sample_rate) == (6, 1.0) and first.mechanism.steps == 1
    kappa = 0.01
    eta_first, eta_later = first.at(kappa).eta, later.at(kappa).eta
    assert eta_first is not None and eta_later is not None and eta_later > eta_first
    assert eta_later == pytest.approx(norm.cdf(norm.ppf(kappa) + math.sqrt(6) * 2 / 0.5), abs=1e-3)
    assert "6 rounds composed" in later.describe() and "one round" in first.describe()

    dp = setting_bound(defense_catalog(["DPSGD"])[0].build(0, 1), LeNetZhu(), round=3)
    assert dp.mechanism is not None and (dp.mechanism.steps, dp.mechanism.sample_rate) == (4, 1.0)
    assert "4 steps composed" in dp.describe()
    model = LeNetZhu()
    noise = setting_bound(DefenseSetting("GaussianNoise(clip)", [GaussianNoise(scale=0.5, clip=1e-3)]), model, round=2)
    assert noise.mechanism is not None and noise.mechanism.steps == 3 and "3 rounds composed" in noise.describe()


def test_a_dp_sgd_that_accounted_its_own_steps_is_not_composed_with_more_rounds_at_another_rate():
    dp = DPSGD(noise_multiplier=2.0, max_grad_norm=0.5)
    dp.load_state_dict(
        {"dp_sgd": {"accountant": {"history": [(2.0, 0.1, 30)]}, "noise_multiplier": 2.0, "delta": 1e-5}}
    )
    assert setting_bound(DefenseSetting("DP", [dp], runner="trainer"), LeNetZhu()).mechanism is not None
    later = setting_bound(DefenseSetting("DP", [dp], runner="trainer"), LeNetZhu(), round=2)
    assert later.mechanism is None and "privacy_history" in later.reason
    with pytest.raises(ValueError, match="releases"):
        defense_mechanism(dp, releases=0)


def test_the_audit_at_round_r_and_its_aggregate_view_bound_every_round_the_client_took_part_in(datamodule):
    torch.manual_seed(0)
    client_dp = ClientLevelDP(1.0, 1.0, seed=0)
    audit = audit_setting(
        defense_catalog(["LocalGaussianMechanism"])[0].build(0, 1),
        LeNetZhu(),
        datamodule,
        indices=[[0], [1]],
        published=published_attacks(TINY, ["IG"]),
        budget=TINY,
        adaptive=False,
        client_dp=client_dp,
        round=2,
        log=lambda line: None,
    )
    assert audit.bound is not None and audit.bound.mechanism is not None and audit.bound.mechanism.steps == 3
    assert "3 rounds composed" in audit.bound.describe()
    bound = audit.aggregate_bound
    assert bound is not None and bound.mechanism == client_dp.mechanism(3, 1.0) and bound.kappa is not None
    assert bound.eta == pytest.approx(client_dp.mechanism(3, 1.0).eta(bound.kappa))
