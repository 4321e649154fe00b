"""The reconstruction advantage over the prior: identified images against the best prior-only guess's,
with its interval; a planted copy fails the bar, a class-level semantic leak does not count, and a gap
in the audit never reads as "holds"."""

import dataclasses

import pytest
import torch

from lightning_gp.attacks import Reconstruction
from lightning_gp.audit.advantage import (
    MAX_ADVANTAGE,
    MIN_PRIOR_IMAGES,
    difference_interval,
    identified_images,
    identifying_criteria,
    identifying_rule,
    reconstruction_advantage,
)
from lightning_gp.audit.bounds import prior_only_successes
from lightning_gp.audit.rounds import public_examples
from lightning_gp.audit.verdict import LeakRule, worst_case_report
from lightning_gp.metrics import reconstruction_report
from lightning_gp.normalization import denormalize


@pytest.fixture(scope="module")
def batch(crops):
    pairs = [crops.train_dataset[i * 7] for i in range(8)]
    return torch.stack([x for x, _ in pairs]), torch.as_tensor([int(y) for _, y in pairs])


def _worst(crops, tests, originals, labels, reconstructions: dict[str, torch.Tensor]):
    """The worst case over attacks that returned ``reconstructions`` (normalised inputs), under the
    identifying rule (the crops have no semantic test here)."""
    reports = [
        reconstruction_report(
            Reconstruction(images, None, attack=name),
            originals,
            (crops.mean, crops.std),
            labels,
            tests=tests,
            lpips=False,
        )
        for name, images in reconstructions.items()
    ]
    rule = identifying_rule(LeakRule().calibrated(tests))
    public = denormalize(public_examples(crops)[0], crops.mean, crops.std)
    return worst_case_report(
        reports, leak_thresholds=rule.thresholds, noise_ratio_line=rule.noise_ratio_line, reference_images=public
    )


def _flat(originals: torch.Tensor) -> torch.Tensor:
    """Normalised images at the data's mean: pixel 0 after normalisation, carrying nothing."""
    return torch.zeros_like(originals)


def test_newcombe_interval_reproduces_the_published_example() -> None:
    # Newcombe (1998), Table II, example (a): 56/70 - 48/80, method 10: 0.0524 .. 0.3339
    low, high = difference_interval(56, 70, 48, 80)
    assert low == pytest.approx(0.0524, abs=5e-4) and high == pytest.approx(0.3339, abs=5e-4)
    # example (h): 0/10 - 0/20, method 10: -0.1611 .. 0.2775
    low, high = difference_interval(0, 10, 0, 20)
    assert low == pytest.approx(-0.1611, abs=5e-4) and high == pytest.approx(0.2775, abs=5e-4)


def test_a_planted_copy_is_identified_and_fails_the_bar(crops, crop_tests, batch) -> None:
    originals, labels = batch
    planted = _flat(originals)
    planted[3] = originals[3]
    worst = _worst(crops, crop_tests, originals, labels, {"flat": _flat(originals), "planted": planted})
    assert identified_images(worst) == {3: ["planted"]}
    advantage = reconstruction_advantage(worst, 0, MIN_PRIOR_IMAGES)
    assert advantage.successes == 1 and advantage.by_attack == {"flat": 0, "planted": 1}
    assert advantage.advantage == pytest.approx(1 / 8) and advantage.status == "fails"
    assert advantage.worst_attack == "planted" and "planted (1)" in advantage.describe()


def test_nothing_identified_holds_only_on_a_complete_audit(crops, crop_tests, batch) -> None:
    originals, labels = batch
    worst = _worst(crops, crop_tests, originals, labels, {"flat": _flat(originals)})
    assert worst.verdict == "private" and worst.gaps == []
    advantage = reconstruction_advantage(worst, 4, MIN_PRIOR_IMAGES)
    assert advantage.advantage == pytest.approx(-4 / MIN_PRIOR_IMAGES) and advantage.status == "holds"
    low, high = advantage.interval
    assert low < advantage.advantage < high and high > MAX_ADVANTAGE  # 8 images cannot show 0.05
    gap = dataclasses.replace(worst, gaps=["DLG errored on client 0"])
    assert reconstruction_advantage(gap, 0, MIN_PRIOR_IMAGES).status == "inconclusive"
    # a report stored before gaps were kept: "private" implies none, "leaks" says nothing about them
    assert reconstruction_advantage(dataclasses.replace(worst, gaps=None), 0, 256).status == "holds"
    unknown = dataclasses.replace(worst, gaps=None, verdict="leaks")
    assert "not recorded" in reconstruction_advantage(unknown, 0, 256).describe()


def test_a_found_identification_fails_however_incomplete_the_audit(crops, crop_tests, batch) -> None:
    originals, labels = batch
    planted = _flat(originals)
    planted[:2] = originals[:2]
    diverged = torch.full_like(originals, float("nan"))
    worst = _worst(crops, crop_tests, originals, labels, {"planted": planted, "diverged": diverged})
    # the verdict names the leak; the gap the diverged attack left is still recorded
    assert worst.verdict == "leaks" and any("diverged" in gap for gap in worst.gaps), worst.gaps
    assert reconstruction_advantage(worst, 0, 256).status == "fails"


def test_a_class_level_semantic_leak_is_not_an_identification(crops, crop_tests, batch) -> None:
    originals, labels = batch
    worst = _worst(crops, crop_tests, originals, labels, {"flat": _flat(originals)})
    rows = list(worst.rows)
    rows[0] = dataclasses.replace(rows[0], leaks=True, criteria={"flat": ["semantic > 0.7"]})
    rows[1] = dataclasses.replace(rows[1], leaks=True, criteria={"flat": ["semantic > 0.7", "ssim > 0.5"]})
    semantic = dataclasses.replace(worst, rows=rows, verdict="leaks", leaked=2)
    assert identified_images(semantic) == {1: ["flat"]}
    assert identifying_criteria(["semantic > 0.7", "noise_ratio < 0.4 and closer"]) == ["noise_ratio < 0.4 and closer"]


def test_identifying_rule_drops_the_class_level_line_and_refuses_a_rule_with_nothing_else() -> None:
    rule = identifying_rule(LeakRule())
    assert "semantic" not in rule.thresholds and "identification" in rule.thresholds
    with pytest.raises(ValueError, match="rule"):
        identifying_rule(LeakRule(thresholds={"semantic": 0.7}))


def test_the_prior_path_finds_a_planted_guess_and_gates_smooth_guesses_that_identify_no_one(
    crops, crop_tests, batch
) -> None:
    """A public "guess" that is a copy of an original identifies it: the prior path counts it. Blurred
    public images cross SSIM 0.5 on flat crops without identifying anyone: judged ungated (kappa's
    count, from above) they succeed, scored by the identification test they do not."""
    originals, labels = batch
    pixels = denormalize(originals, crops.mean, crops.std)
    public = denormalize(public_examples(crops)[0], crops.mean, crops.std)
    rule = identifying_rule(LeakRule().calibrated(crop_tests))
    kwargs = {"labels": labels, "rule": rule}
    planted = torch.cat([pixels[5:6], public[:40]])
    assert prior_only_successes(pixels, planted, identification=True, **kwargs) >= 1
    blurred = torch.nn.functional.avg_pool2d(public[:40], 9, stride=1, padding=4, count_include_pad=False)
    ungated = prior_only_successes(pixels, blurred, **kwargs)
    assert ungated >= 2 and prior_only_successes(pixels, blurred, identification=True, **kwargs) < ungated


def test_bad_counts_are_refused_naming_the_argument(crops, crop_tests, batch) -> None:
    originals, labels = batch
    worst = _worst(crops, crop_tests, originals, labels, {"flat": _flat(originals)})
    with pytest.raises(ValueError, match="prior_images"):
        reconstruction_advantage(worst, 0, 16)
    with pytest.raises(ValueError, match="prior_successes"):
        reconstruction_advantage(worst, 300, 256)
    with pytest.raises(TypeError, match="worst"):
        reconstruction_advantage(None, 0, 256)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trials"):
        difference_interval(1, 0, 0, 10)
