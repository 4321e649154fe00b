"""Robbing the Fed: an active attack through a malicious imprint block.

Fowl, Geiping, Czaja, Goldblum, Goldstein, "Robbing the Fed: Directly Obtaining Private Data in
Federated Learning with Modified Models", ICLR 2022. The malicious server puts an *imprint
module* in front of the model it sends (Sec. 3). The module is a linear layer with ``K`` units
whose rows all compute the same scalar *measurement* of the input, ``m(x) = <w, x>`` (the
paper's example: average pixel brightness). Each unit has its own bias ``-c_i``, so after
the ReLU unit ``i`` is active exactly when ``m(x) > c_i``. The thresholds ``c_0 < ... < c_{K-1}``
cut the measurement's distribution into ``K`` bins of equal probability mass.

Why the gradient gives the data back: write ``z_{t,i} = <w, x_t> - c_i`` for image ``t`` and
``delta_{t,i} = dL/dz_{t,i}``. For a linear layer,

    dL/dW_i = sum_t delta_{t,i} x_t,        dL/db_i = sum_t delta_{t,i}.

The second linear layer (``K -> D``) has identical columns, so every active unit passes the
same backward signal: ``delta_{t,i} = 1[m(x_t) > c_i] g_t`` with one ``g_t`` per image. The sums
are therefore *cumulative* over bins, and the difference of two neighbouring rows keeps only
the images whose measurement falls between their thresholds (Sec. 3):

    dL/dW_i - dL/dW_{i+1} = sum_{t: c_i < m(x_t) <= c_{i+1}} g_t x_t
    dL/db_i - dL/db_{i+1} = sum_{t: c_i < m(x_t) <= c_{i+1}} g_t

Their ratio is exactly ``x_t`` when a single image landed in the bin (and a ``g``-weighted mix
when several did). The last bin (``m > c_{K-1}``) is the last row alone.

How many images come back: with ``K`` bins of equal mass and ``B`` images drawn independently,
an image is alone in its bin with probability ``(1 - 1/K)^(B-1)`` (our derivation of the
paper's argument that recovery needs one image per bin). At ``B = 16`` that is 0.39 for
``K = B``, 0.79 for ``K = 4B`` and 0.89 for ``K = 8B``; the default ``num_bins=128`` is ``8B``
for the batch of 16 this package's experiments use. Unknown measurement distributions cost
extra collisions, which is why the server should estimate the bins from public data.

This module is an original implementation; the public reference implementation (the
``ImprintBlock`` of the ``breaching`` library and its ``ImprintAttacker``) was read for the
method, not copied.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from scipy.stats import norm
from torch import Tensor, nn

from lightning_gp.attacks.base import AttackNotApplicable, GradientAttack, Reconstruction
from lightning_gp.attacks.registry import register_attack
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.view import ServerView
from lightning_gp.normalization import input_bounds, per_channel

Measurement = Literal["mean", "gaussian"]
Connection = Literal["residual", "linear"]

SECRETS_KEY = "imprint"
"""Key of the attack's entry in :attr:`ServerView.server_secrets`."""

_NEEDS_MODIFIED_MODEL = (
    "Robbing the Fed needs the server-modified model: call RobbingTheFed.modify_model(model, ...), "
    "have the client train the returned model, and build the ServerView from that model's gradient "
    "with the returned server_secrets"
)


# --------------------------------------------------------------------------- measurement and bins
def measurement_direction(kind: Measurement, dim: int, *, seed: int = 0) -> Tensor:
    """The measurement vector ``w`` every row of the imprint layer holds (Sec. 3).

    ``"mean"``: ``w = 1 / D``, the average brightness of the (normalised) input, the paper's
    running example. ``"gaussian"``: a seeded random direction of unit norm, so that for
    independent unit-variance pixels ``<w, x>`` is standard normal (the alternative linear
    measurement the reference implementation offers).
    """
    if dim < 1:
        raise ValueError(f"the input must have at least one entry, got dimension {dim}")
    if kind == "mean":
        return torch.full((dim,), 1.0 / dim, dtype=torch.float64)
    if kind == "gaussian":
        direction = torch.randn(dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        return direction / direction.norm()
    raise ValueError(f"measurement must be 'mean' or 'gaussian', got {kind!r}")


def pixel_bounds(input_shape: Sequence[int], mean: Sequence[float], std: Sequence[float]) -> tuple[Tensor, Tensor]:
    """Smallest and largest valid normalised value of every input entry (pixels in [0, 1]), flattened."""
    channels = int(input_shape[0])
    low, high = input_bounds(
        per_channel(mean, channels, "mean"),
        per_channel(std, channels, "std", positive=True),
        sample_ndim=len(input_shape),
        dtype=torch.float64,
    )
    return low.expand(*input_shape).flatten(), high.expand(*input_shape).flatten()


def measurement_range(direction: Tensor, low: Tensor, high: Tensor) -> tuple[float, float]:
    """Exact range of ``<w, x>`` over the box ``low <= x <= high`` (each entry at its best end)."""
    low, high = low.to(direction), high.to(direction)
    smallest = torch.where(direction > 0, direction * low, direction * high).sum()
    largest = torch.where(direction > 0, direction * high, direction * low).sum()
    return float(smallest), float(largest)


def equal_mass_thresholds(
    num_bins: int,
    lowest: float,
    highest: float = math.inf,
    *,
    measurements: Tensor | None = None,
    stats: tuple[float, float] = (0.0, 1.0),
    fit: Literal["empirical", "normal"] = "empirical",
) -> tuple[float, ...]:
    """Thresholds ``c_0 < ... < c_{K-1}`` cutting the measurement's distribution into equal-mass bins.

    ``c_i`` is the ``i / K`` quantile for ``i >= 1`` (Sec. 3: bins from the measurement's CDF).
    ``c_0`` would be the 0-quantile (``-inf``); it is set just below ``lowest``, the smallest
    measurement any valid input can have, so every image activates unit 0 and none is lost.
    The quantiles come from ``measurements`` of public data when given (``fit="empirical"``:
    their sample quantiles; ``fit="normal"``: a normal fitted to their mean/std), else from a
    normal with ``stats = (mean, std)`` (``scipy.stats.norm.ppf`` of evenly spaced levels).
    A normal is truncated to ``[lowest, highest]``, the range valid inputs can reach, so that
    no bin is wasted on measurements no image can have.
    """
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
    levels = np.arange(1, num_bins) / num_bins
    if measurements is not None:
        values = measurements.detach().double().cpu().numpy().ravel()
        if values.size < 2:
            raise ValueError("public data must hold at least two inputs to estimate the bins")
        if fit == "empirical":
            inner = np.quantile(values, levels)
        elif fit == "normal":
            inner = _truncated_normal_quantiles(levels, values.mean(), values.std(ddof=1), lowest, highest)
        else:
            raise ValueError(f"fit must be 'empirical' or 'normal', got {fit!r}")
    else:
        loc, scale = (float(s) for s in stats)
        if not (math.isfinite(loc) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"measurement stats must be a finite mean and a positive std, got {stats!r}")
        inner = _truncated_normal_quantiles(levels, loc, scale, lowest, highest)
    # Margin below the exact minimum: an all-black image must still switch unit 0 on.
    margin = 1e-3 * max(1.0, abs(lowest))
    thresholds = (lowest - margin, *(float(c) for c in inner))
    return check_thresholds(thresholds)


def _truncated_normal_quantiles(
    levels: np.ndarray, loc: float, scale: float, lowest: float, highest: float
) -> np.ndarray:
    """Quantiles of ``N(loc, scale^2)`` conditioned on ``[lowest, highest]``."""
    if not scale > 0:
        raise ValueError(f"the measurement's std must be positive, got {scale}")
    below, above = norm.cdf([lowest, highest], loc=loc, scale=scale)
    if above - below < 1e-12:
        raise ValueError(f"N({loc}, {scale}^2) puts no mass on the valid measurement range [{lowest}, {highest}]")
    return norm.ppf(below + (above - below) * levels, loc=loc, scale=scale)


def check_thresholds(bins: Sequence[float]) -> tuple[float, ...]:
    """Validate thresholds: finite and strictly increasing (else two units would share a bin)."""
    values = tuple(float(b) for b in bins)
    if len(values) < 1 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"bins must be a non-empty sequence of finite thresholds, got {bins!r}")
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise ValueError(
            "bins must be strictly increasing; with public data this means too many bins for its "
            "number of distinct measurements (use fewer bins or more data)"
        )
    return values


# ----------------------------------------------------------------------------------- the block
class ImprintBlock(nn.Module):
    """The server's malicious first block (Fowl et al. 2022, Sec. 3, "imprint module").

    ``x -> flatten -> linear0 (D -> K) -> ReLU -> linear1 (K -> D) [+ x] -> reshape``.

    * ``linear0``: every row is the measurement ``w`` (:func:`measurement_direction`), bias
      ``-c_i``, so unit ``i`` fires when ``m(x) = <w, x> > c_i``.
    * thresholds: ``bins`` if given; else equal-mass quantiles of the measurement estimated from
      ``public_data`` (normalised inputs the server holds), else of a normal with
      ``measurement_stats`` (default ``(0, 1)``: the normalised data has mean 0, and std 1 is
      what ``<w, x>`` has for fully correlated pixels ("mean") or independent ones ("gaussian");
      real images sit in between, so public data gives tighter bins).
    * ``linear1``: ``gain`` times the pseudo-inverse of ``linear0``'s weight. That weight is
      ``1 w^T`` (rank one), whose pseudo-inverse is ``w 1^T / (K ||w||^2)``: a scaled transpose
      with *identical columns*, which the attack needs (every active unit then sends the same
      backward signal, see the module docstring). Its bias makes the block's added term vanish
      at the median measurement.
    * ``connection="residual"`` (default) adds the input back, ``y = x + linear1(...)``: the
      original model sees the image plus a brightness shift along ``w`` that depends only on
      ``m(x)``, so it keeps working. ``"linear"`` is the paper's plain stack ``y = linear1(...)``:
      a rank-one bottleneck (only ``m(x)`` survives), its bias chosen so that ``y`` is the
      projection of ``x`` onto ``w`` at the median. Either connection keeps recovery exact.

    Args:
        input_shape: ``(C, H, W)`` of one input; ``D = prod(input_shape)``.
        num_bins: ``K``; may be omitted when ``bins`` is given.
        bins: explicit thresholds ``c_0 < ... < c_{K-1}`` (bin ``i`` is ``(c_i, c_{i+1}]``,
            the last one is open above).
        measurement: ``"mean"`` or ``"gaussian"``.
        public_data: ``[N, *input_shape]`` normalised inputs to estimate the bins from.
        fit: how to turn ``public_data`` into bins (``"empirical"`` quantiles or ``"normal"``).
        measurement_stats: ``(mean, std)`` of the measurement for the normal assumption.
        mean, std: per-channel normalisation of the inputs (gives the valid pixel box).
        connection: ``"residual"`` or ``"linear"``.
        gain: scale of the second layer (the added term for ``"residual"``).
        seed: seeds the ``"gaussian"`` measurement direction.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_bins: int | None = None,
        *,
        bins: Sequence[float] | None = None,
        measurement: Measurement = "mean",
        public_data: Tensor | None = None,
        fit: Literal["empirical", "normal"] = "empirical",
        measurement_stats: tuple[float, float] = (0.0, 1.0),
        mean: Sequence[float] = (0.0,),
        std: Sequence[float] = (1.0,),
        connection: Connection = "residual",
        gain: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.input_shape = tuple(int(s) for s in input_shape)
        if len(self.input_shape) < 1 or any(s < 1 for s in self.input_shape):
            raise ValueError(f"input_shape must be positive sizes like (C, H, W), got {input_shape!r}")
        if connection not in ("residual", "linear"):
            raise ValueError(f"connection must be 'residual' or 'linear', got {connection!r}")
        if not (isinstance(gain, (int, float)) and math.isfinite(gain) and gain != 0):
            raise ValueError(f"gain must be a finite non-zero number, got {gain!r}")
        dim = math.prod(self.input_shape)
        self.measurement = measurement
        self.connection = connection
        direction = measurement_direction(measurement, dim, seed=seed)
        self.bins = self._thresholds(direction, num_bins, bins, public_data, fit, measurement_stats, mean, std)
        self.num_bins = len(self.bins)
        self.linear0 = nn.Linear(dim, self.num_bins)
        self.relu = nn.ReLU()
        self.linear1 = nn.Linear(self.num_bins, dim)
        self._init_weights(direction, float(gain))

    def _thresholds(
        self,
        direction: Tensor,
        num_bins: int | None,
        bins: Sequence[float] | None,
        public_data: Tensor | None,
        fit: Literal["empirical", "normal"],
        stats: tuple[float, float],
        mean: Sequence[float],
        std: Sequence[float],
    ) -> tuple[float, ...]:
        if bins is not None:
            thresholds = check_thresholds(bins)
            if num_bins is not None and num_bins != len(thresholds):
                raise ValueError(f"num_bins={num_bins} disagrees with the {len(thresholds)} bins given")
            return thresholds
        if num_bins is None:
            raise ValueError("give num_bins (or explicit bins)")
        lowest, highest = measurement_range(direction, *pixel_bounds(self.input_shape, mean, std))
        measurements = None
        if public_data is not None:
            if tuple(public_data.shape[1:]) != self.input_shape:
                raise ValueError(
                    f"public_data must have shape [N, *{self.input_shape}], got {tuple(public_data.shape)}"
                )
            measurements = public_data.detach().double().flatten(1).cpu() @ direction
        return equal_mass_thresholds(num_bins, lowest, highest, measurements=measurements, stats=stats, fit=fit)

    @torch.no_grad()
    def _init_weights(self, direction: Tensor, gain: float) -> None:
        dtype = self.linear0.weight.dtype
        thresholds = torch.tensor(self.bins, dtype=torch.float64)
        # Rows all equal w; biases -c_i: unit i computes relu(m(x) - c_i).
        self.linear0.weight.copy_(direction.expand(self.num_bins, -1).to(dtype))
        self.linear0.bias.copy_((-thresholds).to(dtype))
        # pinv(1 w^T) = w 1^T / (K ||w||^2): every column is the same vector `column`.
        back = direction / direction.dot(direction)  # <w, back> = 1: maps a measurement back to input space
        column = gain * back / self.num_bins
        self.linear1.weight.copy_(column[:, None].expand(-1, self.num_bins).to(dtype))
        # Added term at measurement m: column * sum_i relu(m - c_i) = gain * back * mean_i relu(m - c_i).
        reference = float(thresholds[self.num_bins // 2])  # ~ the median of equal-mass bins
        level = (reference - thresholds).clamp_min(0).mean()
        if self.connection == "residual":
            offset = -gain * level * back  # no shift at the median measurement
        else:
            offset = (reference - gain * level) * back  # y = projection of x onto w at the median
        self.linear1.bias.copy_(offset.to(dtype))

    def measure(self, inputs: Tensor) -> Tensor:
        """The measurement ``m(x)`` of each input (what decides its bin)."""
        return inputs.flatten(1) @ self.linear0.weight[0]

    def forward(self, inputs: Tensor) -> Tensor:
        flat = inputs.flatten(1)
        out = self.linear1(self.relu(self.linear0(flat)))
        if self.connection == "residual":
            out = out + flat
        return out.unflatten(1, self.input_shape)

    def extra_repr(self) -> str:
        return (
            f"input_shape={self.input_shape}, num_bins={self.num_bins}, "
            f"measurement={self.measurement!r}, connection={self.connection!r}"
        )


class ImprintedModel(nn.Sequential):
    """``model(imprint(x))``: what the malicious server sends.

    Parameters are named ``imprint.linear0.weight``, ``imprint.linear0.bias``,
    ``imprint.linear1.*`` and ``model.<the original names>``. A model that brings its own training
    loss (``model.loss_fn``, e.g. PRECODE's) keeps it: changing the model does not change how the
    client trains.
    """

    def __init__(self, imprint: ImprintBlock, model: nn.Module) -> None:
        super().__init__(OrderedDict(imprint=imprint, model=model))

    @property
    def loss_fn(self) -> Any:
        # a property, not an attribute: an nn.Module assigned here would join the Sequential's layers
        return getattr(self.model, "loss_fn", None)


# ---------------------------------------------------------------------------------- the attack
def bin_gradients(weight_grad: Tensor, bias_grad: Tensor) -> tuple[Tensor, Tensor]:
    """Per-bin sums ``sum g_t x_t`` and ``sum g_t`` from the cumulative rows (Sec. 3).

    Row ``i`` of the imprint layer's gradient sums over every image with ``m > c_i``; the
    difference of rows ``i`` and ``i + 1`` keeps the images of bin ``i`` only. The last bin
    has no upper neighbour: its row is already the bin's sum.
    """
    next_weight = torch.cat([weight_grad[1:], torch.zeros_like(weight_grad[:1])])
    next_bias = torch.cat([bias_grad[1:], torch.zeros_like(bias_grad[:1])])
    return weight_grad - next_weight, bias_grad - next_bias


def select_bins(bias_diff: Tensor, count: int, rel_threshold: float) -> Tensor:
    """Indices (ascending) of at most ``count`` bins holding data.

    A bin holds data when ``|sum g_t|`` exceeds ``rel_threshold`` times the largest one; empty
    bins differ from zero only by rounding. With more candidates than ``count`` (possible only
    with a perturbed gradient, since clean data fills at most ``B`` bins), the largest
    ``|sum g_t|`` win: they are the ones a perturbation is least likely to have made up.
    """
    magnitude = bias_diff.abs()
    peak = float(magnitude.max()) if magnitude.numel() else 0.0
    if peak == 0.0:
        return torch.zeros(0, dtype=torch.long, device=bias_diff.device)
    candidates = torch.nonzero(magnitude > rel_threshold * peak).flatten()
    if candidates.numel() > count:
        keep = torch.topk(magnitude[candidates], count).indices
        candidates = candidates[keep]
    return candidates.sort().values


@register_attack(  # the published attack (active: it sends a modified model)
    "RtF", order=5, build=lambda budget, seed, model: RobbingTheFed(num_bins=budget.rtf_bins, seed=seed)
)
class RobbingTheFed(GradientAttack):
    """Robbing the Fed (Fowl et al., ICLR 2022): recover inputs verbatim through an imprint block.

    Use: ``modified, secrets = attack.modify_model(model, input_shape, mean, std)``; the client
    trains ``modified``; ``attack.reconstruct(ServerView(model=modified, ...,
    server_secrets=secrets))`` returns the images of every bin that held data, in the model's
    normalised space, ordered by measurement (brightness), clamped to the valid pixel range.

    The reconstruction always has ``view.batch_size`` images: when fewer bins held data (images
    that collided in a bin come back as one mixture), the rest are zeros, i.e. the data mean in
    normalised space (``meta["num_filled"]`` counts them). Labels are not recovered (``None``).

    Args:
        num_bins: imprint units ``K`` (default 128 = 8 x a batch of 16; see the module
            docstring for the expected fraction recovered).
        measurement: ``"mean"`` (average brightness, the paper's) or ``"gaussian"``.
        connection: ``"residual"`` or ``"linear"``, see :class:`ImprintBlock`.
        gain: scale of the block's second layer.
        fit: how public data becomes bins (``"empirical"`` quantiles or a ``"normal"`` fit).
        rel_threshold: a bin holds data when its bias-gradient difference exceeds this fraction
            of the largest one.
        seed: seeds the ``"gaussian"`` measurement direction.
    """

    # the SoK's class G: it sends a modified model, its bins set from public data
    requires = requirements("basic_knowledge", "training_details", "surrogate_data", "active_manipulation")

    def __init__(
        self,
        num_bins: int = 128,
        measurement: Measurement = "mean",
        *,
        connection: Connection = "residual",
        gain: float = 1.0,
        fit: Literal["empirical", "normal"] = "empirical",
        rel_threshold: float = 1e-4,
        seed: int = 0,
        device: str | torch.device | None = None,
        progress_every: int = 0,
    ) -> None:
        super().__init__(seed=seed, device=device, progress_every=progress_every)
        if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
            raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
        if measurement not in ("mean", "gaussian"):
            raise ValueError(f"measurement must be 'mean' or 'gaussian', got {measurement!r}")
        if connection not in ("residual", "linear"):
            raise ValueError(f"connection must be 'residual' or 'linear', got {connection!r}")
        if not (isinstance(rel_threshold, (int, float)) and 0 <= rel_threshold < 1):
            raise ValueError(f"rel_threshold must be in [0, 1), got {rel_threshold!r}")
        self.num_bins = num_bins
        self.measurement = measurement
        self.connection = connection
        self.gain = gain
        self.fit = fit
        self.rel_threshold = float(rel_threshold)

    def modify_model(
        self,
        model: nn.Module,
        input_shape: Sequence[int],
        mean: Sequence[float] = (0.0,),
        std: Sequence[float] = (1.0,),
        *,
        public_data: Tensor | None = None,
        bins: Sequence[float] | None = None,
        measurement_stats: tuple[float, float] = (0.0, 1.0),
    ) -> tuple[ImprintedModel, dict[str, Any]]:
        """The malicious server's move: a copy of ``model`` behind an :class:`ImprintBlock`.

        Returns the model to send and the ``server_secrets`` to put in the :class:`ServerView`:
        ``{"imprint": {...}}`` with ``"weight"`` and ``"bias"`` (parameter names of the imprint
        layer), ``"bins"``, ``"input_shape"``, ``"measurement"`` and ``"structure": "cumulative"``.
        ``model`` itself is not changed (the block wraps a deep copy). Bins: ``bins`` if given,
        else estimated from ``public_data`` (normalised inputs the server holds), else a normal
        with ``measurement_stats``.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        imprint = self.imprint_block(
            input_shape, mean, std, public_data=public_data, bins=bins, measurement_stats=measurement_stats
        )
        template = next(model.parameters(), None)
        if template is not None:
            imprint = imprint.to(device=template.device, dtype=template.dtype)
        modified = ImprintedModel(imprint, copy.deepcopy(model))
        secrets = {
            SECRETS_KEY: {
                "weight": "imprint.linear0.weight",
                "bias": "imprint.linear0.bias",
                "bins": imprint.bins,
                "input_shape": imprint.input_shape,
                "measurement": imprint.measurement,
                "structure": "cumulative",
            }
        }
        return modified, secrets

    def imprint_block(
        self,
        input_shape: Sequence[int],
        mean: Sequence[float] = (0.0,),
        std: Sequence[float] = (1.0,),
        *,
        public_data: Tensor | None = None,
        bins: Sequence[float] | None = None,
        measurement_stats: tuple[float, float] = (0.0, 1.0),
    ) -> ImprintBlock:
        """The attack's :class:`ImprintBlock` for inputs of ``input_shape`` (its bins: ``bins`` if given,
        else from ``public_data``, else a normal with ``measurement_stats``)."""
        return ImprintBlock(
            input_shape,
            None if bins is not None else self.num_bins,
            bins=bins,
            measurement=self.measurement,
            public_data=public_data,
            fit=self.fit,
            measurement_stats=measurement_stats,
            mean=mean,
            std=std,
            connection=self.connection,
            gain=self.gain,
            seed=self.seed,
        )

    def reconstruct(self, view: ServerView) -> Reconstruction:
        """Read the inputs off the imprint layer's gradient (Sec. 3), no optimisation."""
        view, _ = self._prepare(view)
        weight_grad, bias_grad = _imprint_gradients(view)
        dtype = weight_grad.dtype
        # Rows are cumulative sums: subtract in float64 so the difference adds no rounding of its own.
        weight_diff, bias_diff = bin_gradients(weight_grad.double(), bias_grad.double())
        chosen = select_bins(bias_diff, view.batch_size, self.rel_threshold)
        images = (weight_diff[chosen] / bias_diff[chosen, None]).to(dtype)
        images = images.reshape(-1, *view.input_shape)
        low, high = view.data_bounds()
        images = torch.max(torch.min(images, high.to(dtype)), low.to(dtype))
        filled = view.batch_size - images.shape[0]
        if filled:
            images = torch.cat([images, images.new_zeros(filled, *view.input_shape)])
        magnitude = bias_diff.abs()
        active = int(((magnitude > self.rel_threshold * magnitude.max()) & (magnitude > 0)).sum())
        return Reconstruction(
            images=images.detach(),
            labels=None,
            attack="RobbingTheFed",
            meta={
                "bins": chosen.tolist(),
                "bias_differences": bias_diff[chosen].tolist(),
                "num_active_bins": active,
                "num_recovered": int(chosen.numel()),
                "num_filled": filled,
            },
        )


def _imprint_gradients(view: ServerView) -> tuple[Tensor, Tensor]:
    """The imprint layer's weight and bias gradients, checked against the server's secrets."""
    secrets = view.server_secrets.get(SECRETS_KEY)
    if not isinstance(secrets, Mapping) or not {"weight", "bias"} <= set(secrets):
        raise AttackNotApplicable(
            f"{_NEEDS_MODIFIED_MODEL} (server_secrets has no {SECRETS_KEY!r} entry naming the imprint layer)"
        )
    missing = [secrets[k] for k in ("weight", "bias") if secrets[k] not in view.gradients]
    if missing:
        raise AttackNotApplicable(f"{_NEEDS_MODIFIED_MODEL} (the shared gradient lacks {missing})")
    weight_grad = view.gradients[secrets["weight"]].detach()
    bias_grad = view.gradients[secrets["bias"]].detach()
    dim = math.prod(view.input_shape)
    if weight_grad.ndim != 2 or weight_grad.shape[1] != dim or bias_grad.shape != weight_grad.shape[:1]:
        raise AttackNotApplicable(
            f"{_NEEDS_MODIFIED_MODEL} (imprint gradients {tuple(weight_grad.shape)} / {tuple(bias_grad.shape)} "
            f"do not fit inputs of {dim} entries)"
        )
    return weight_grad, bias_grad
