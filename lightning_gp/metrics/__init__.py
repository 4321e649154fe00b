"""Reconstruction metrics: MSE, PSNR, SSIM, LPIPS-AlexNet, PriPrune's NMI, Refiner's noise ratio; matching; reports.

All metrics take pixel images in [0, 1] (``[B, C, H, W]``; PSNR and SSIM: [0, data_range]) and
return one value per image (``[B]``); normalised or 8-bit images, NaN and inf are refused.
``reconstruction_report`` denormalises an attack's output, matches it to the client's batch and
checks Refiner's privacy thresholds (PSNR < 15, SSIM < 0.5, LPIPS > 0.05, noise ratio > 0.4 are
"private"), reported per attack; the verdict over several attacks (worst case, leak rule, threat
models) is the audit's: :mod:`lightning_gp.audit.verdict`. ``noise_ratio`` scores a reconstruction alone with Refiner's evaluation network
(shipped for 1- and 3-channel images; higher is noisier, more private). ``fit_semantic_test`` trains and
calibrates the semantic leak test (does a public-data classifier name the original's class?) on any
dataset's public split; ``shipped_semantic_test`` is the shipped Fashion-MNIST one.
``IdentificationTest`` asks whether a reconstruction picks its original out of public images of the
same data (by SSIM or LPIPS), with a p-value per pair.

``ReconstructionPSNR``, ``ReconstructionSSIM``, ``ReconstructionLPIPS``, ``ReconstructionNMI`` and
``ReconstructionNoiseRatio`` are torchmetrics ``Metric`` classes over the same functions: they match each update's
reconstructions to the originals, keep the per-image values (synced across processes) and
compute their mean, the least private value (``reduction="worst"``) or all of them::

    psnr_metric = ReconstructionPSNR()              # in a LightningModule's __init__
    psnr_metric.update(reconstructions, originals)  # each step: pixel images in [0, 1]
    self.log("reconstruction_psnr", psnr_metric)    # compute() and reset() at epoch end
"""

from lightning_gp.metrics.classes import (
    ReconstructionLPIPS,
    ReconstructionNMI,
    ReconstructionNoiseRatio,
    ReconstructionPSNR,
    ReconstructionSSIM,
)
from lightning_gp.metrics.figures import save_comparison_grid, save_flagged_grid, save_reconstruction_grid
from lightning_gp.metrics.identification import IdentificationCalibrationError, IdentificationTest
from lightning_gp.metrics.image_quality import mse, psnr, ssim
from lightning_gp.metrics.lpips import (
    LPIPS,
    LPIPSNetwork,
    LPIPSWeights,
    LPIPSWeightsNotFoundError,
    load_lpips_weights,
    lpips_distance,
    lpips_network,
    lpips_with_network,
)
from lightning_gp.metrics.matching import MATCH_METRICS, match_reconstructions, pairwise_scores
from lightning_gp.metrics.nmi import nmi
from lightning_gp.metrics.noise_ratio import noise_ratio
from lightning_gp.metrics.recognition import RecognitionTests
from lightning_gp.metrics.report import (
    HIGHER_IS_PRIVATE,
    PRIVACY_THRESHOLDS,
    ImageScores,
    ReconstructionReport,
    concatenate_reports,
    privacy_flags,
    reconstruction_report,
    reconstruction_reports,
)
from lightning_gp.metrics.semantic_test import (
    SemanticCalibrationError,
    SemanticTest,
    fit_semantic_test,
    shipped_semantic_test,
)

__all__ = [
    "HIGHER_IS_PRIVATE",
    "LPIPS",
    "MATCH_METRICS",
    "PRIVACY_THRESHOLDS",
    "IdentificationCalibrationError",
    "IdentificationTest",
    "ImageScores",
    "LPIPSNetwork",
    "LPIPSWeights",
    "LPIPSWeightsNotFoundError",
    "RecognitionTests",
    "ReconstructionLPIPS",
    "ReconstructionNMI",
    "ReconstructionNoiseRatio",
    "ReconstructionPSNR",
    "ReconstructionReport",
    "ReconstructionSSIM",
    "SemanticCalibrationError",
    "SemanticTest",
    "concatenate_reports",
    "fit_semantic_test",
    "load_lpips_weights",
    "lpips_distance",
    "lpips_network",
    "lpips_with_network",
    "match_reconstructions",
    "mse",
    "nmi",
    "noise_ratio",
    "pairwise_scores",
    "privacy_flags",
    "psnr",
    "reconstruction_report",
    "reconstruction_reports",
    "save_comparison_grid",
    "save_flagged_grid",
    "save_reconstruction_grid",
    "shipped_semantic_test",
    "ssim",
]
