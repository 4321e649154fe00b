"""The identification test (lightning_gp.metrics.identification): its level under an exchangeable null, its
power on copies of the original, and its errors."""

import math

import numpy as np
import pytest
import torch

from lightning_gp.data.builtin_sample import load_sample_arrays
from lightning_gp.metrics.identification import (
    IDENTIFICATION_LINE,
    IdentificationCalibrationError,
    IdentificationTest,
    tail_pvalues,
)
from lightning_gp.metrics.semantic import gaussian_blur


def binomial_upper(n: int, p: float, z: float = 3.1) -> float:
    """A one-sided ~99.9% upper limit of Binomial(n, p) (normal approximation plus one count)."""
    return n * p + z * math.sqrt(n * p * (1 - p)) + 1


@pytest.fixture(scope="module")
def sample() -> dict[str, torch.Tensor]:
    arrays = load_sample_arrays()
    return {
        "public": torch.from_numpy(arrays["test_images"].astype(np.float32) / 255),
        "public_labels": torch.from_numpy(arrays["test_labels"].astype(np.int64)),
        "train": torch.from_numpy(arrays["train_images"].astype(np.float32) / 255),
        "train_labels": torch.from_numpy(arrays["train_labels"].astype(np.int64)),
    }


@pytest.mark.parametrize("distribution", ["normal", "exponential"])
def test_tail_pvalues_hold_their_level_when_the_observed_value_is_one_more_draw(distribution):
    g = torch.Generator().manual_seed(3)
    rows, pool = 20000, 100
    draws = torch.randn(rows, pool + 1, generator=g)
    if distribution == "exponential":
        draws = -torch.log(torch.rand(rows, pool + 1, generator=g))
    p = tail_pvalues(draws[:, :pool], draws[:, pool:])
    # at 0.01 the rank p-value is exact (1 / 101 of the rows are first); below 1 / (N + 1) the Pareto tail is
    # an estimate, made heavier on purpose (SHAPE_MARGIN)
    for level in (0.01, 1e-3):
        assert int((p <= level).sum()) <= binomial_upper(rows, level)


def test_tail_pvalues_fall_far_below_the_rank_for_a_value_far_beyond_the_pool():
    g = torch.Generator().manual_seed(0)
    null = torch.randn(4, 200, generator=g)
    observed = torch.tensor([[0.0], [null[1].max().item() + 0.01], [8.0], [30.0]])
    p = tail_pvalues(null, observed)[:, 0]
    assert 0.3 < p[0] < 0.7  # the median of the pool
    assert p[1] <= 1 / 201 + 1e-12  # first by a hair: about the rank
    assert p[2] < 1e-3 and p[3] < 1e-6 and p[3] < p[2]  # far ahead: far smaller, and smaller the further


def test_tail_pvalues_refuse_mismatched_rows_and_too_few_exceedances():
    with pytest.raises(ValueError, match="share R"):
        tail_pvalues(torch.zeros(3, 50), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="exceedances"):
        tail_pvalues(torch.randn(2, 20), torch.zeros(2, 1), exceedances=20)


def test_an_other_image_of_the_class_does_not_identify_the_original(sample):
    test = IdentificationTest(sample["public"], sample["public_labels"])
    g = torch.Generator().manual_seed(0)
    picked = torch.randperm(len(sample["train"]), generator=g)[:48]
    originals, labels = sample["train"][picked], sample["train_labels"][picked]
    others = []
    for label in labels.tolist():  # a same-class training image that is none of the originals
        same = (sample["train_labels"] == label).nonzero().flatten()
        same = same[~torch.isin(same, picked)]
        others.append(sample["train"][same[torch.randint(len(same), (1,), generator=g)]][0])
    p = test.pvalues(torch.stack(others), originals, labels)
    assert p.shape == (48, 48) and bool(torch.isfinite(p).all())
    # 2304 uninformed pairs (the diagonal shares the class): each passes with probability about the line
    assert int((p <= IDENTIFICATION_LINE).sum()) <= binomial_upper(p.numel(), IDENTIFICATION_LINE)


def test_a_copy_of_the_original_identifies_it_and_a_blur_ranks_it_first(sample):
    test = IdentificationTest(sample["public"], sample["public_labels"])
    originals, labels = sample["train"][:16], sample["train_labels"][:16]
    copies = test.pvalues(originals, originals, labels)
    assert bool((copies.diagonal() <= IDENTIFICATION_LINE).all())
    blurred = test.pvalues(gaussian_blur(originals, 1.0).clamp(0, 1), originals, labels).diagonal()
    blank = test.pvalues(torch.full_like(originals, 0.5), originals, labels).diagonal()
    assert float(blurred.median()) < 1 / 101 < float(blank.median())


def test_the_feature_distance_joins_and_the_test_describes_itself(sample):
    from lightning_gp.metrics.lpips import LPIPS

    test = IdentificationTest(sample["public"], sample["public_labels"], lpips_fn=LPIPS(), max_pool=50)
    assert test.distances == ("ssim", "lpips")
    assert "by SSIM or LPIPS against 50-50 public images per class" in test.describe()
    originals, labels = sample["train"][:4], sample["train_labels"][:4]
    assert bool((test.pvalues(originals, originals, labels).diagonal() <= IDENTIFICATION_LINE).all())


def test_a_class_with_too_few_public_images_is_not_judged(sample):
    keep = (sample["public_labels"] != 3) | (torch.arange(1000) % 10 == 0)  # class 3 keeps ~10 images
    test = IdentificationTest(sample["public"][keep], sample["public_labels"][keep])
    labels = torch.tensor([3, 1])
    originals = sample["train"][:2]
    assert test.uncalibrated(labels) == [3]
    p = test.pvalues(originals, originals, labels)
    assert bool(torch.isnan(p[0]).all()) and bool(torch.isfinite(p[1]).all())


def test_bad_public_data_and_arguments_are_refused_naming_them(sample):
    public, labels = sample["public"], sample["public_labels"]
    with pytest.raises(ValueError, match="public_images must be a"):
        IdentificationTest(public[:, 0])
    with pytest.raises(ValueError, match="public_images must hold pixel values"):
        IdentificationTest(public * 255)
    with pytest.raises(ValueError, match="NaN"):
        IdentificationTest(torch.full((50, 1, 28, 28), math.nan))
    with pytest.raises(IdentificationCalibrationError, match="at least 40 public images of a class"):
        IdentificationTest(public[:100], labels[:100])
    with pytest.raises(ValueError, match="public_labels"):
        IdentificationTest(public, labels[:10])
    with pytest.raises(ValueError, match="min_pool"):
        IdentificationTest(public, labels, min_pool=5)
    test = IdentificationTest(public, labels)
    with pytest.raises(ValueError, match="labels"):
        test.pvalues(public[:2], public[:2])
    with pytest.raises(ValueError, match="one data set"):
        test.pvalues(torch.rand(2, 3, 28, 28), torch.rand(2, 3, 28, 28), labels[:2])
    with pytest.raises(ValueError, match="reconstructions must hold pixel values"):
        test.pvalues(public[:2] - 1, public[:2], labels[:2])
