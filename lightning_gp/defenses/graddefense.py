"""GradDefense (Wang et al., INFOCOM 2022, "Protect Privacy from Gradient Leakage Attack in Federated Learning").

Four steps, each a small function here (the official code is github.com/wangjunxiao/GradDefense,
also in Plato's ``examples/gradient_leakage_attacks/defense/GradDefense``):

1. **Sensitivity** (:func:`root_set_sensitivity`, the official ``compute_sens``): on a small root
   set of public data ``(x, y)``, for every layer ``l`` the mean over the root examples of the
   Frobenius norm of ``d(sum_i g_{l,i}) / d x_b``, where ``g_l`` is the layer's gradient of the
   mean loss (one double-backward pass per layer).
2. **Slicing** (:func:`equal_sensitivity_slices`): the model's gradient, flattened in layer order,
   is cut into ``slices`` contiguous slices of equal sensitivity, each layer's sensitivity spread
   evenly over its coordinates.
3. **Perturbation** (:func:`perturb_slices`): ``perturbed_slices`` slices drawn uniformly at random
   (the official reservoir sample) get ``N(0, scale^2)`` on every coordinate; with ``max_slice_norm``,
   each drawn slice is first scaled to L2 norm at most ``max_slice_norm``.
4. **Compensation** (:func:`compensate`, the official ``denoise``): the flattened gradient is
   reshaped into a ``v x w`` matrix with ``v / w`` close to ``Q`` (``v`` the smallest divisor of the
   size ``>= sqrt(Q n)``); the eigenvectors of its column covariance whose eigenvalues fall inside
   the Marchenko-Pastur bulk of the noise, ``[(1 - 1/sqrt(Q'))^2 s^2, (1 + 1/sqrt(Q'))^2 s^2]``
   with ``Q' = v / w`` and ``s^2 = (perturbed_slices / slices) scale^2``, are projected out.

Where this differs from the official code, and why:

* slices are cut at coordinate granularity on the model-wide cumulative sensitivity (coordinate
  ``i`` is in slice ``floor(S C_i / T)``, ``C_i`` the cumulative sensitivity before ``i``, ``T``
  the total). The official greedy packs blocks of ``gcd(layer sizes)`` coordinates, restarts its
  running sum in every slice, lets adjacent slices share their boundary coordinate, leaves a slice
  empty when one block reaches the average exactly, and can run out of blocks before the last
  slice; the aim, slices of equal sensitivity, is the same. With no sensitivity at all (``T = 0``)
  the slices are of equal size. Note that the official measure gives the last layer of a
  softmax cross-entropy classifier zero sensitivity: its gradient sums to zero over the classes
  for every input, so the all-ones product vanishes;
* clipping scales each drawn slice of the (batch) gradient; the official code clips each
  example's slice (per-example gradients, with the bound equal to the noise std ``sigma``), which the shared
  batch gradient does not expose. For one example the two agree;
* compensation runs on the client's own perturbed gradient, before it is shared. The paper runs it
  on the server's aggregate, a step this framework has no hook for. It is deterministic
  post-processing of the noised gradient: a server that knows the defense could compute it itself,
  but the published attacks see a less noisy gradient than the paper's experiments (``q=None``
  shares the uncompensated gradient the paper attacked). When the size ``n`` has no divisor pair
  with ``w >= 2`` (``n`` prime, or tiny) compensation is skipped with a warning.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.defenses.base import Defense, DefenseCall, Gradients
from lightning_gp.defenses.noise import standard_normal_like
from lightning_gp.defenses.sensitivity import _batch_statistics_without_updates
from lightning_gp.defenses.validation import check_gradients
from lightning_gp.functional import LossFn
from lightning_gp.named_tensors import flatten_named, unflatten_named
from lightning_gp.validation import check_int, check_nonnegative, check_number, check_positive_int

#: Plato's GradDefense settings (README and configs): 10 slices, 5 noised, noise std (the paper's sigma) 0.01, Q = 6
DEFAULT_SLICES, DEFAULT_PERTURBED_SLICES, DEFAULT_SCALE, DEFAULT_Q = 10, 5, 0.01, 6.0


# ---------------------------------------------------------------------------------- 1. sensitivity
def root_set_sensitivity(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    names: list[str] | None = None,
) -> dict[str, Tensor]:
    """GradDefense's per-layer sensitivity on the root set ``(inputs, targets)`` (step 1 above).

    ``s_l = mean_b || d(sum_i g_{l,i}) / d x_b ||_F`` with ``g_l = dL/dtheta_l`` of the mean loss
    ``L = loss_fn(model(x), y)``: the official ``compute_sens`` (the vector-Jacobian product of
    an all-ones vector with the layer's input-gradient Jacobian). One double-backward pass per
    layer. BatchNorm running statistics are left untouched. Returns 0-d float tensors, keyed by
    ``names`` (default: every trainable parameter); a layer the loss does not depend on gets 0.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if names is None:
        names = list(params)
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"no trainable parameter named {missing[:5]} in {type(model).__name__}")
    if not inputs.is_floating_point():
        raise TypeError(f"the root set's inputs must be floating point, got {inputs.dtype}")
    if inputs.shape[0] == 0 or targets.shape[0] != inputs.shape[0]:
        raise ValueError(
            f"the root set needs at least one example and one target per input, got inputs "
            f"{tuple(inputs.shape)} and targets {tuple(targets.shape)}"
        )
    x = inputs.detach().clone().requires_grad_(True)
    with torch.enable_grad(), _batch_statistics_without_updates(model):
        loss = loss_fn(model(x), targets)
        grads = torch.autograd.grad(loss, [params[n] for n in names], create_graph=True, allow_unused=True)
        sensitivity = {}
        for name, g in zip(names, grads):
            if g is None or not g.requires_grad:
                sensitivity[name] = torch.zeros((), device=x.device)
                continue
            (vjp,) = torch.autograd.grad(g, x, grad_outputs=torch.ones_like(g), retain_graph=True, allow_unused=True)
            if vjp is None:
                sensitivity[name] = torch.zeros((), device=x.device)
                continue
            sensitivity[name] = vjp.detach().flatten(1).norm(dim=1).mean()
    return sensitivity


# ---------------------------------------------------------------------------------- 2. slicing
def equal_sensitivity_slices(
    sizes: Mapping[str, int], sensitivity: Mapping[str, float | Tensor], slices: int
) -> list[int]:
    """Boundaries ``b_0 = 0 <= b_1 <= ... <= b_S = n`` of ``slices`` contiguous slices of equal
    sensitivity over the flattened gradient (layers in the order of ``sizes``): slice ``k`` holds
    the flat coordinates ``b_k .. b_{k+1} - 1`` (step 2 of the module docstring).

    Coordinate ``i`` lies in slice ``floor(S C_i / T)``, where every coordinate of layer ``l``
    carries ``s_l / n_l`` and ``C_i`` is the cumulative sensitivity of the coordinates before ``i``
    (a coordinate belongs to the slice it starts in, so evenly spread sensitivity gives slices of
    equal size). Exact rational arithmetic: the boundaries do not depend on float rounding. A slice
    is empty when one coordinate carries more than ``T / S``. With ``T = 0`` every coordinate counts
    the same.
    """
    slices = check_positive_int(slices, "slices")
    names = list(sizes)
    if not names:
        raise ValueError("sizes is empty: no layer to slice")
    missing = [n for n in names if n not in sensitivity]
    if missing:
        raise ValueError(f"no sensitivity for the layers {missing[:5]}")
    counts = [check_int(int(sizes[n]), f"sizes[{n!r}]", low=0) for n in names]
    values = [_sensitivity_value(sensitivity[n], n) if c > 0 else Fraction(0) for n, c in zip(names, counts)]
    if sum(values) == 0:
        values = [Fraction(c) for c in counts]  # no sensitivity anywhere: equal-size slices
    total = sum(values)
    boundaries = [0]
    for m in range(1, slices):
        target = total * m / slices
        # the coordinates that start (C_i minus their own share) below the target lie before boundary m
        before, cumulative = 0, Fraction(0)
        for count, value in zip(counts, values):
            if cumulative >= target:
                break
            inside = count if value == 0 else min(count, math.ceil((target - cumulative) * count / value))
            before += inside
            if inside < count:
                break
            cumulative += value
        boundaries.append(before)
    boundaries.append(sum(counts))
    return boundaries


def _sensitivity_value(value: float | Tensor, name: str) -> Fraction:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"sensitivity[{name!r}] must be one number per layer, got shape {tuple(value.shape)}")
        value = float(value.item())
    number = check_nonnegative(value, f"sensitivity[{name!r}]")
    return Fraction(number)


# ---------------------------------------------------------------------------------- 3. perturbation
def perturb_slices(
    gradients: Mapping[str, Tensor],
    boundaries: list[int],
    chosen: list[int],
    scale: float,
    generator: torch.Generator,
    *,
    max_slice_norm: float | None = None,
) -> Gradients:
    """Add ``N(0, scale^2)`` to every coordinate of the ``chosen`` slices (step 3), each first
    scaled to L2 norm at most ``max_slice_norm`` when given. Other coordinates are returned unchanged."""
    flat = flatten_named(gradients).clone()
    mask = torch.zeros_like(flat, dtype=torch.bool)
    for k in chosen:
        start, stop = boundaries[k], boundaries[k + 1]
        mask[start:stop] = True
        if max_slice_norm is not None and stop > start:
            norm = float(flat[start:stop].double().norm())
            if norm > max_slice_norm:
                flat[start:stop] *= max_slice_norm / norm
    noise = standard_normal_like(flat, generator)
    flat = torch.where(mask, flat + scale * noise, flat)
    return {n: t.clone() for n, t in unflatten_named(flat, gradients).items()}


def choose_slices(slices: int, perturbed_slices: int, generator: torch.Generator) -> list[int]:
    """``perturbed_slices`` distinct slice indices drawn uniformly (the official reservoir sample), sorted."""
    order = torch.randperm(slices, generator=generator, device=generator.device)
    return sorted(int(k) for k in order[:perturbed_slices].tolist())


# ---------------------------------------------------------------------------------- 4. compensation
@functools.lru_cache(maxsize=64)
def compensation_shape(size: int, q: float) -> tuple[int, int]:
    """``(v, w)``: ``v`` the smallest divisor of ``size`` with ``v >= sqrt(q size)``, ``w = size / v``."""
    size = check_positive_int(size, "size")
    goal = math.sqrt(q * size)
    best = size
    for i in range(1, math.isqrt(size) + 1):
        if size % i == 0:
            for d in (i, size // i):
                if goal <= d < best:
                    best = d
    return best, size // best


def compensate(gradients: Mapping[str, Tensor], noise_std: float, q: float = DEFAULT_Q) -> Gradients:
    """GradDefense's compensation (step 4; the official ``denoise``): project out of the ``v x w``
    gradient matrix the covariance eigenvectors inside the Marchenko-Pastur bulk of noise of std
    ``noise_std`` (a ``ValueError`` when the shape has ``w < 2``: nothing to project)."""
    noise_std = check_nonnegative(noise_std, "noise_std")
    q = check_number(q, "q", low=1.0)
    flat = flatten_named(gradients, dtype=torch.float64)
    v, w = compensation_shape(flat.numel(), q)
    if w < 2:
        raise ValueError(
            f"cannot compensate {flat.numel()} entries: no divisor pair v x w with v >= sqrt({q:g} n) has w >= 2"
        )
    matrix = flat.view(v, w)
    covariance = torch.cov(matrix.T)  # columns are the variables, like np.cov(rowvar=False)
    values, vectors = torch.linalg.eigh(covariance)
    ratio = v / w
    low = (1 - 1 / math.sqrt(ratio)) ** 2 * noise_std**2
    high = (1 + 1 / math.sqrt(ratio)) ** 2 * noise_std**2
    kept = vectors[:, (values <= low) | (values >= high)]
    projected = (matrix @ kept) @ kept.T
    return {n: t.clone() for n, t in unflatten_named(projected.reshape(-1), gradients).items()}


# ---------------------------------------------------------------------------------- the defense
class GradDefense(Defense):
    """GradDefense (Wang et al. 2022): noise on random slices of equal sensitivity, then compensation.

    Call it as ``defense(gradients, client_id, sensitivity=s)`` with the per-layer sensitivity of
    :func:`root_set_sensitivity` (one number per layer; the callback
    :class:`~lightning_gp.callbacks.GradDefense` computes it on a public root set). Each call draws
    its own ``perturbed_slices`` slices from the client's generator.

    Args:
        slices: number of slices of equal sensitivity (the paper's 10), ``>= 1``.
        perturbed_slices: slices that get noise, in ``[0, slices]`` (the paper's 5).
        scale: std of the Gaussian noise on a perturbed coordinate (the paper's sigma), ``>= 0`` (Plato's 0.01).
        max_slice_norm: L2 bound of each perturbed slice before the noise, ``> 0``; ``None``: no clipping.
        q: the compensation matrix's aspect ratio ``Q >= 1`` (the paper's 6); ``None``: share the
            perturbed gradient uncompensated (what the paper's attack experiments saw).
    """

    def __init__(
        self,
        slices: int = DEFAULT_SLICES,
        perturbed_slices: int = DEFAULT_PERTURBED_SLICES,
        scale: float = DEFAULT_SCALE,
        *,
        max_slice_norm: float | None = None,
        q: float | None = DEFAULT_Q,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        self.slices = check_positive_int(slices, "slices")
        self.perturbed_slices = check_int(perturbed_slices, "perturbed_slices", low=0, high=self.slices)
        self.scale = check_nonnegative(scale, "scale")
        self.max_slice_norm = (
            None if max_slice_norm is None else check_nonnegative(max_slice_norm, "max_slice_norm", strict=True)
        )
        self.q = None if q is None else check_number(q, "q", low=1.0)
        self._warned_uncompensated = False

    def config(self) -> dict[str, Any]:
        return {
            "slices": self.slices,
            "perturbed_slices": self.perturbed_slices,
            "scale": self.scale,
            "max_slice_norm": self.max_slice_norm,
            "q": self.q,
        }

    @property
    def compensation_noise_std(self) -> float:
        """The per-coordinate noise std compensation assumes: ``scale sqrt(perturbed_slices / slices)``."""
        return self.scale * math.sqrt(self.perturbed_slices / self.slices)

    def slice_boundaries(self, gradients: Mapping[str, Tensor], sensitivity: Mapping[str, float | Tensor]) -> list[int]:
        """The slices of ``gradients`` under ``sensitivity`` (:func:`equal_sensitivity_slices`)."""
        return equal_sensitivity_slices({n: g.numel() for n, g in gradients.items()}, sensitivity, self.slices)

    def prepare(  # type: ignore[override]
        self, gradients: Mapping[str, Tensor], *, sensitivity: Mapping[str, float | Tensor] | None = None
    ) -> Mapping[str, float | Tensor]:
        if sensitivity is None:
            raise TypeError(
                "GradDefense slices the gradient by sensitivity: pass sensitivity=root_set_sensitivity(model, loss_fn, "
                "root_inputs, root_targets) (the GradDefense callback computes it on its root set)"
            )
        if not isinstance(sensitivity, Mapping):
            raise TypeError(f"sensitivity must map layer names to numbers, got {type(sensitivity).__name__}")
        check_gradients(gradients)
        self.slice_boundaries(gradients, sensitivity)  # validates before any state is touched
        return sensitivity

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        boundaries = self.slice_boundaries(gradients, call.statistic)
        chosen = choose_slices(self.slices, self.perturbed_slices, call.generator)
        shared = perturb_slices(
            gradients, boundaries, chosen, self.scale, call.generator, max_slice_norm=self.max_slice_norm
        )
        if self.q is not None:
            size = sum(g.numel() for g in gradients.values())
            if compensation_shape(size, self.q)[1] >= 2:
                shared = compensate(shared, self.compensation_noise_std, self.q)
            elif not self._warned_uncompensated:
                self._warned_uncompensated = True
                warnings.warn(
                    f"GradDefense shares the gradient uncompensated: its {size} entries have no divisor pair v x w "
                    f"with v >= sqrt({self.q:g} n) and w >= 2",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return {n: shared[n].to(g.dtype) for n, g in gradients.items()}, state
