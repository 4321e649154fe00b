"""Refiner's noise-ratio metric (Sec. 3.3, App. N): values, input checks, report and audit columns, Metric class."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_gp.attacks.base import Reconstruction
from lightning_gp.audit import AttackResult, mean_scores
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.metrics import (
    HIGHER_IS_PRIVATE,
    PRIVACY_THRESHOLDS,
    ReconstructionNoiseRatio,
    noise_ratio,
    reconstruction_report,
)
from lightning_gp.refiner.evaluator import EvaluationNetwork, EvaluatorUnavailableError, load_evaluator
from lightning_gp.refiner.training import mix_with_noise

MEAN, STD = (0.2860,), (0.3530,)


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    """64 Fashion-MNIST training images of the built-in sample as pixels in [0, 1] (unseen by D)."""
    datamodule = FashionMNISTSampleDataModule(normalize=False)
    datamodule.setup("fit")
    return torch.stack([datamodule.train_dataset[i * 40][0] for i in range(64)])


def uniform_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


# --- values --------------------------------------------------------------------------------------


def test_clean_images_score_low_and_pure_noise_high(pixels):
    clean = noise_ratio(pixels)
    assert clean.shape == (64,) and float(clean.mean()) < 0.1 and float(clean.max()) < PRIVACY_THRESHOLDS["noise_ratio"]
    noise = noise_ratio(uniform_noise((32, 1, 28, 28), 0))
    assert float(noise.mean()) > 0.85 and float(noise.min()) > PRIVACY_THRESHOLDS["noise_ratio"]
    rgb_noise = noise_ratio(uniform_noise((32, 3, 32, 32), 1))
    assert float(rgb_noise.mean()) > 0.85


def test_mean_score_rises_with_the_noise_ratio(pixels):
    ratios = [round(0.1 * i, 1) for i in range(11)]
    mixes, _ = mix_with_noise(pixels, ratios, torch.Generator().manual_seed(2))
    means = [float(chunk.mean()) for chunk in noise_ratio(mixes).chunk(len(ratios))]
    assert all(b > a for a, b in itertools.pairwise(means)), means
    assert max(abs(m - r) for m, r in zip(means, ratios)) < 0.1, means


def test_data_range_scales_8_bit_pixels_held_as_floats(pixels):
    torch.testing.assert_close(noise_ratio(pixels * 255, data_range=255), noise_ratio(pixels), atol=1e-5, rtol=0)


def test_an_explicit_evaluator_is_used():
    network = load_evaluator(1)
    x = uniform_noise((4, 1, 16, 16), 3)
    torch.testing.assert_close(noise_ratio(x, evaluator=network), network(x))
    with pytest.raises(ValueError, match=r"1 channel.*takes 3"):
        noise_ratio(x, evaluator=EvaluationNetwork(in_channels=3, width=0.125))
    with pytest.raises(TypeError, match="evaluator"):
        noise_ratio(x, evaluator="network")


def test_noise_ratio_is_differentiable_in_the_images():
    x = uniform_noise((2, 1, 28, 28), 4).requires_grad_(True)
    noise_ratio(x).sum().backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0


# --- input checks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "images, kwargs, error, match",
    [
        ((uniform_noise((2, 1, 28, 28), 5) - 0.2860) / 0.3530, {}, ValueError, "denormalise"),
        (uniform_noise((2, 1, 28, 28), 5) * 255, {}, ValueError, "data_range=255"),
        (torch.full((2, 1, 28, 28), float("nan")), {}, ValueError, "NaN"),
        (torch.zeros(2, 1, 28, 28, dtype=torch.uint8), {}, TypeError, "floating"),
        (torch.zeros(1, 28, 28), {}, ValueError, r"\[N, C, H, W\]"),
        (torch.zeros(2, 1, 28, 28), {"data_range": 0}, ValueError, "data_range"),
        ("pixels", {}, TypeError, "torch.Tensor"),
    ],
)
def test_bad_images_are_refused_naming_the_argument(images, kwargs, error, match):
    with pytest.raises(error, match=match):
        noise_ratio(images, **kwargs)


def test_no_network_for_two_channel_images():
    with pytest.raises(EvaluatorUnavailableError, match="2-channel"):
        noise_ratio(uniform_noise((2, 2, 16, 16), 6))


# --- report and audit ----------------------------------------------------------------------------


def _normalise(x: torch.Tensor, mean=MEAN, std=STD) -> torch.Tensor:
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return (x - m) / s


def test_report_scores_the_noise_ratio_against_refiners_threshold(pixels):
    originals = _normalise(pixels[:8])
    assert PRIVACY_THRESHOLDS["noise_ratio"] == 0.4 and HIGHER_IS_PRIVATE["noise_ratio"] is True
    exact = reconstruction_report(
        Reconstruction(images=originals.clone(), labels=None), originals, (MEAN, STD), lpips=False
    )
    assert exact.thresholds["noise_ratio"] == 0.4
    assert exact.means["noise_ratio"] < 0.1 and exact.private["noise_ratio"] is False
    assert all(row.noise_ratio is not None and row.noise_ratio < 0.4 for row in exact.rows)
    torch.testing.assert_close(
        torch.tensor([row.noise_ratio for row in exact.rows]), noise_ratio(exact.reconstructed_pixels)
    )
    markdown = exact.to_markdown()
    assert "| noise_ratio |" in markdown and "> 0.4 | no |" in markdown and "noise ratio" in markdown

    noise = Reconstruction(images=_normalise(uniform_noise((8, 1, 28, 28), 7)), labels=None)
    private = reconstruction_report(noise, originals, (MEAN, STD), lpips=False)
    assert private.means["noise_ratio"] > 0.85 and private.private["noise_ratio"] is True
    assert private.to_dict()["private"]["noise_ratio"] is True and "noise_ratio" not in private.to_dict()["unavailable"]

    skipped = reconstruction_report(noise, originals, (MEAN, STD), lpips=False, noise_ratio=False)
    assert skipped.means["noise_ratio"] is None and skipped.private["noise_ratio"] is None
    assert "noise_ratio" not in skipped.unavailable


def test_report_says_n_a_with_the_reason_for_two_channel_images():
    g = torch.Generator().manual_seed(8)
    mean, std = (0.5, 0.5), (0.5, 0.5)
    originals = torch.rand(3, 2, 12, 12, generator=g) * 2 - 1
    recon = Reconstruction(images=originals + 0.1 * torch.randn(3, 2, 12, 12, generator=g), labels=None)
    report = reconstruction_report(recon, originals, (mean, std), lpips=False)
    assert report.means["noise_ratio"] is None and report.private["noise_ratio"] is None
    assert "2-channel" in report.unavailable["noise_ratio"]
    assert all(row.noise_ratio is None for row in report.rows)
    markdown = report.to_markdown()
    assert "| noise_ratio | n/a | > 0.4 | n/a |" in markdown
    assert "noise_ratio n/a: no shipped evaluation network for 2-channel images" in markdown
    assert report.to_dict()["unavailable"]["noise_ratio"] == report.unavailable["noise_ratio"]
    assert math.isfinite(report.means["psnr"])  # the other metrics are still there

    result = AttackResult(record=None, view=None, reconstruction=recon, report=report, seconds=0.0)
    assert mean_scores([result])["noise_ratio"] is None


def test_audit_means_average_the_noise_ratio_per_image(pixels):
    results = []
    for start, stop in ((0, 2), (2, 5)):
        originals = _normalise(pixels[start:stop])
        recon = Reconstruction(images=_normalise(uniform_noise((stop - start, 1, 28, 28), start)), labels=None)
        report = reconstruction_report(recon, originals, (MEAN, STD), lpips=False)
        results.append(AttackResult(record=None, view=None, reconstruction=recon, report=report, seconds=0.0))
    rows = [row.noise_ratio for r in results for row in r.report.rows]
    assert mean_scores(results)["noise_ratio"] == pytest.approx(sum(rows) / len(rows), rel=1e-6)


# --- torchmetrics class --------------------------------------------------------------------------


def test_metric_class_accumulates_the_functional_values(pixels):
    mixes, _ = mix_with_noise(pixels[:12], (0.3,), torch.Generator().manual_seed(9))
    metric = ReconstructionNoiseRatio(match=False)
    every = ReconstructionNoiseRatio(match=False, reduction="none")
    worst = ReconstructionNoiseRatio(reduction="worst")
    for start, stop in ((0, 5), (5, 12)):
        for m in (metric, every, worst):
            m.update(mixes[start:stop], pixels[start:stop])
    expected = noise_ratio(mixes)
    torch.testing.assert_close(every.compute(), expected)
    torch.testing.assert_close(metric.compute(), expected.mean())
    torch.testing.assert_close(worst.compute(), expected.min())  # the least private: the least noisy
    assert ReconstructionNoiseRatio.higher_is_better is False
    assert "_evaluators" not in dict(metric.named_children()) and not list(metric.parameters())


def test_metric_class_with_a_checkpoint_file_and_bad_inputs(tmp_path, pixels):
    from lightning_gp.refiner.evaluator import shipped_checkpoint

    path = tmp_path / "d.pt"
    with shipped_checkpoint(1).open("rb") as handle:
        path.write_bytes(handle.read())
    metric = ReconstructionNoiseRatio(checkpoint=path, match=False)
    metric.update(pixels[:4], pixels[:4])
    torch.testing.assert_close(metric.compute(), noise_ratio(pixels[:4]).mean())
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        ReconstructionNoiseRatio(checkpoint=tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="reconstructions"):
        ReconstructionNoiseRatio().update(pixels[:2] * 2 - 1, pixels[:2])
    with pytest.raises(EvaluatorUnavailableError, match="2-channel"):
        ReconstructionNoiseRatio(match=False).update(uniform_noise((2, 2, 8, 8), 1), uniform_noise((2, 2, 8, 8), 2))
