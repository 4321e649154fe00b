"""Fisher-trace-optimal gradient noise, pruning and clipped DP-SGD (locally optimal versions).

"Optimal Defenses Against Gradient Reconstruction Attacks" (Sec. 3.3-3.6, Alg. 1, App. B).
Each defense needs, besides the gradient ``g`` of the client's batch ``x``, the sensitivity
``s_i = ||d g_i / d x||^2`` of every coordinate (:func:`~lightning_gp.defenses.gradient_sensitivity`).
The readings taken where the paper contradicts itself:

* Noise variance ``Sigma_ii ∝ sqrt(s_i) / max(|g_i|, c)``: Eq. 8 and the Lagrangian of Theorem 2
  carry the square root; Algorithm 1's ``||.||^2`` without it is a typo.
* Pruning removes the coordinates with the LARGEST ``k'_i = sqrt(s_i) / |g_i|`` (Eq. 17; the
  proof in App. A.4 says so, Theorem 4's "smallest" is read as "keep the smallest").
* The total noise power is that of isotropic noise of the same ``scale`` (``scale^2`` per
  coordinate, summed over all coordinates), so the two are compared at equal noise energy;
  coordinates whose gradient is exactly zero get none, and no coordinate gets more than
  ``max_variance`` (App. B: the local estimate would otherwise put unbounded noise where
  ``|g_i| ~ 0``); the power a capped coordinate cannot take goes to the others.

These noises depend on the client's data, so they carry no formal differential-privacy
guarantee and nothing here reports an epsilon; formal DP is :class:`~lightning_gp.callbacks.DPSGD`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_gp.defenses.base import Defense, DefenseCall, Gradients
from lightning_gp.defenses.noise import standard_normal_like
from lightning_gp.defenses.selection import count_for_rate, largest_entries_mask
from lightning_gp.defenses.validation import check_gradients
from lightning_gp.named_tensors import flatten_named, unflatten_named
from lightning_gp.validation import check_choice, check_nonnegative, check_rate

DEFAULT_VARIANCE_CAP_RATIO = 100.0


class SensitivityDefense(Defense):
    """A defense whose transform needs the per-coordinate sensitivity ``s`` of the gradient.

    Call it as ``defense(gradients, client_id, sensitivity=s)``; :meth:`transform` reads it as
    ``call.statistic`` (on the gradients' device and dtype).
    """

    def prepare(  # type: ignore[override]
        self, gradients: Mapping[str, Tensor], *, sensitivity: Mapping[str, Tensor] | None = None
    ) -> Gradients:
        if sensitivity is None:
            raise TypeError(
                f"{type(self).__name__} is data-dependent: pass sensitivity=gradient_sensitivity(model, loss_fn, x, y) "
                "(the callbacks do this for you)"
            )
        check_gradients(gradients)
        check_sensitivity(sensitivity, gradients)
        return {n: sensitivity[n].to(device=g.device, dtype=g.dtype) for n, g in gradients.items()}


def check_sensitivity(sensitivity: Mapping[str, Tensor], gradients: Mapping[str, Tensor]) -> None:
    """The sensitivity names the gradient's layers with the same shapes, finite and non-negative."""
    if not isinstance(sensitivity, Mapping):
        raise TypeError(f"sensitivity must be a mapping of parameter name to tensor, got {type(sensitivity).__name__}")
    if set(sensitivity) != set(gradients):
        missing, extra = sorted(set(gradients) - set(sensitivity)), sorted(set(sensitivity) - set(gradients))
        raise ValueError(f"sensitivity and gradients name different layers (missing {missing}, unexpected {extra})")
    for name, g in gradients.items():
        s = sensitivity[name]
        if not isinstance(s, Tensor) or s.shape != g.shape:
            raise ValueError(f"sensitivity[{name!r}] must be a tensor of the gradient's shape {tuple(g.shape)}")
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
            raise ValueError(f"sensitivity[{name!r}] must be finite and non-negative")


def noise_weights(
    gradients: Gradients, sensitivity: Gradients, c: float, eligible: Gradients | None = None
) -> Gradients:
    """``sqrt(s_i) / max(|g_i|, c)`` where the gradient is nonzero (and ``eligible``), 0 elsewhere."""
    weights = {}
    for n, g in gradients.items():
        takes_noise = g != 0 if eligible is None else (g != 0) & eligible[n]
        weights[n] = torch.where(
            takes_noise, sensitivity[n].sqrt() / g.abs().clamp_min(c), torch.zeros((), dtype=g.dtype, device=g.device)
        )
    return weights


def water_fill(weights: Gradients, total: float, cap: float) -> Gradients:
    """Variances ``min(lambda w_i, cap)`` with ``lambda`` chosen so they sum to ``total``.

    Coordinates with ``w_i = 0`` get none. When the cap binds, the power capped coordinates
    cannot take is spread over the others (each pass caps more, so the loop ends).
    """
    flat = flatten_named(weights, dtype=torch.float64)
    if total == 0:
        variance = torch.zeros_like(flat)
    else:
        positive = flat > 0
        count = int(positive.sum())
        if count == 0:
            raise ValueError(
                "no coordinate can take the optimal noise: the sensitivity is zero wherever the gradient is nonzero "
                "(the gradient does not depend on the input), or every coordinate is clipped"
            )
        if cap * count <= total:
            warnings.warn(
                f"max_variance={cap:g} caps all {count} noisable coordinates: the noise power is "
                f"{cap * count:g}, below the {total:g} of isotropic noise at this scale",
                stacklevel=3,
            )
            variance = torch.where(positive, torch.full_like(flat, cap), torch.zeros_like(flat))
        else:
            # free (not capped): 0/1 in float64, so each pass is one comparison, and the free weight
            # one dot product (boolean indexing costs several times that on CPU; a sum of the free
            # weights, not the total minus the capped ones, which could cancel). The capped set
            # only grows (intersect with the last pass: a rounding-level drop of lambda must not
            # shrink it), and an unchanged count means an unchanged set.
            free = torch.ones_like(flat)
            capped_count, free_weight = 0, float(flat.sum())
            while True:
                lam = (total - cap * capped_count) / free_weight
                torch.minimum(free, torch.mul(flat, lam).le_(cap), out=free)
                count = flat.numel() - int(free.sum())
                if count == capped_count:
                    break
                capped_count, free_weight = count, float(flat.dot(free))
            variance = torch.where(free > 0, flat.mul_(lam), cap)
    return unflatten_named(variance, weights)


def optimal_noise_variance(
    gradients: Gradients,
    sensitivity: Gradients,
    *,
    scale: float,
    c: float = 1e-6,
    max_variance: float | None = None,
    clip: float | None = None,
) -> Gradients:
    """The per-coordinate variance of optimal noise (Eq. 8; with ``clip``, Eq. 13).

    Proportional to ``sqrt(s_i) / max(|g_i|, c)``, zero where ``g_i = 0`` (and, with ``clip``,
    where ``|g_i| >= clip``), capped at ``max_variance`` (default ``100 scale^2``), and summing to
    ``scale^2`` times the number of coordinates.
    """
    eligible = None if clip is None else {n: g.abs() < clip for n, g in gradients.items()}
    cap = DEFAULT_VARIANCE_CAP_RATIO * scale**2 if max_variance is None else max_variance
    numel = sum(g.numel() for g in gradients.values())
    return water_fill(noise_weights(gradients, sensitivity, c, eligible), scale**2 * numel, cap)


def _check_c(c: float) -> float:
    return check_nonnegative(c, "c", strict=True)


class OptimalGradientNoise(SensitivityDefense):
    """Diagonal Gaussian noise with ``Sigma_ii ∝ sqrt(s_i) / max(|g_i|, c)`` (Theorem 2, Eq. 8, Alg. 1).

    Args:
        scale: the isotropic noise scale whose total power (``scale^2`` per coordinate) this
            noise matches.
        c: floor on ``|g_i|`` in the weight (the paper's 1e-6).
        max_variance: cap on one coordinate's variance (App. B); default ``100 scale^2``.

    Data-dependent: no formal DP guarantee, no epsilon.
    """

    def __init__(
        self,
        scale: float = 0.01,
        *,
        c: float = 1e-6,
        max_variance: float | None = None,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        self.scale = check_nonnegative(scale, "scale")
        self.c = _check_c(c)
        self.max_variance = (
            None if max_variance is None else check_nonnegative(max_variance, "max_variance", strict=True)
        )

    def config(self) -> dict[str, Any]:
        return {"scale": self.scale, "c": self.c, "max_variance": self.max_variance}

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        variance = optimal_noise_variance(
            gradients, call.statistic, scale=self.scale, c=self.c, max_variance=self.max_variance
        )
        return {
            n: g + variance[n].sqrt() * standard_normal_like(g, call.generator) for n, g in gradients.items()
        }, state


class OptimalDPSGD(SensitivityDefense):
    """Clipped optimal noise (Eq. 9-13): clip each coordinate to ``[-clip, clip]``; clipped coordinates
    get no noise, the others optimal noise of total power ``scale^2`` per coordinate.

    Compare it with ``GaussianNoise(scale, clip=clip)`` (clipped isotropic noise). Despite the
    paper's name it has no formal DP guarantee: the noise depends on the data (no epsilon).
    """

    def __init__(
        self,
        clip: float = 1.0,
        scale: float = 0.01,
        *,
        c: float = 1e-6,
        max_variance: float | None = None,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        self.clip = check_nonnegative(clip, "clip", strict=True)
        self.scale = check_nonnegative(scale, "scale")
        self.c = _check_c(c)
        self.max_variance = (
            None if max_variance is None else check_nonnegative(max_variance, "max_variance", strict=True)
        )

    def config(self) -> dict[str, Any]:
        return {"clip": self.clip, "scale": self.scale, "c": self.c, "max_variance": self.max_variance}

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        variance = optimal_noise_variance(
            gradients, call.statistic, scale=self.scale, c=self.c, max_variance=self.max_variance, clip=self.clip
        )
        shared = {
            n: g.clamp(-self.clip, self.clip) + variance[n].sqrt() * standard_normal_like(g, call.generator)
            for n, g in gradients.items()
        }
        return shared, state


PRUNING_SCOPES = ("global", "layer")


def optimal_pruning_scores(gradients: Gradients, sensitivity: Gradients) -> Gradients:
    """``k'_i = sqrt(s_i) / |g_i|`` (Eq. 17): leakage per unit of utility; ``inf`` where ``g_i = 0``."""
    # 0 / 0 (no gradient, no sensitivity) is nan: such a coordinate is free to prune as well
    return {n: torch.nan_to_num(sensitivity[n].sqrt() / g.abs(), nan=float("inf")) for n, g in gradients.items()}


class OptimalGradientPruning(SensitivityDefense):
    """Zero the ``rate`` fraction of coordinates with the largest ``sqrt(s_i) / |g_i|`` (Theorem 4, Eq. 17).

    Zero-gradient coordinates rank first (pruning them costs nothing). ``scope="global"``
    ranks all coordinates together (the paper); ``"layer"`` prunes ``rate`` of every layer.
    Data-dependent: no formal DP guarantee.
    """

    def __init__(
        self, rate: float = 0.8, *, scope: str = "global", seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        self.rate = check_rate(rate, "rate")
        self.scope = check_choice(scope, "scope", PRUNING_SCOPES)

    def config(self) -> dict[str, Any]:
        return {"rate": self.rate, "scope": self.scope}

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        scores = optimal_pruning_scores(gradients, call.statistic)
        if self.scope == "layer":
            pruned = {
                n: largest_entries_mask(v.flatten(), count_for_rate(self.rate, v.numel())).view_as(v)
                for n, v in scores.items()
            }
        else:
            flat = flatten_named(scores)
            mask = largest_entries_mask(flat, count_for_rate(self.rate, flat.numel()))
            pruned = unflatten_named(mask, {n: torch.empty(v.shape, dtype=torch.bool) for n, v in scores.items()})
        return {n: g.masked_fill(pruned[n], 0) for n, g in gradients.items()}, state
