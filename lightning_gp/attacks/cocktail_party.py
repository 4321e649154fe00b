"""The Cocktail Party attack: unmix a (securely aggregated) first-layer gradient with ICA.

Kariyappa, Guo, Maeng, Xiong, Suh, Qureshi, Lee, "Cocktail Party Attack: Breaking Aggregation-Based
Privacy in Federated Learning Using Independent Component Analysis", ICML 2023 (CPA).

Why a gradient is a cocktail party (the paper's key insight): a fully connected first layer
``z = W x + b`` on the flattened input, over a batch of ``B`` images (or the mean of many clients'
batches, which is what a server behind secure aggregation sees), has the gradient

    dL/dW = sum_i delta_i x_i^T,        dL/db = sum_i delta_i,        delta_i = dL/dz_i,

so row ``h`` of ``dL/dW`` is ``G_h = sum_i delta_{i,h} x_i``: every one of the ``H`` hidden units
records a different linear mixture of the same ``B`` images (the "speakers"), with the unknown
mixing matrix ``A = [delta_{i,h}]``. With ``H >= B`` (the rank the unmixing needs) the rows span the
images, and blind source separation recovers them.

What CPA does (the paper's optimisation for the unmixing matrix ``V^``), as implemented here:

1. Centre each row over its pixels and whiten: with the SVD ``G_c = U S V^T`` of the centred rows,
   ``K = sqrt(D) S_B^-1 U_B^T`` (top ``B`` components) maps them to ``Z = K G_c``, ``B`` signals of
   unit variance and no correlation (``D``: pixels per image).
2. Find the unmixing matrix ``V`` (``B x B``, rows ``v_i`` kept at unit norm; it starts at the
   identity, the principal components) by Adam on the paper's objective

       min_V  E_i[ -lambda_NE J(v_i Z) + lambda_TV R_TV(u_i) ]
              + lambda_MI E_{i != j}[ exp(T (|cos(v_i, v_j)| - 1)) ]  (+ lambda_range R_range(x_i))

   * ``J(y) = (E[G(y)] - E[G(nu)])^2``, ``G = log cosh``, ``nu ~ N(0, 1)``: the negentropy
     approximation of FastICA (Hyvarinen 1999), large for non-Gaussian components;
   * ``R_TV``: the total variation (mean absolute difference of neighbouring pixels) of the
     un-centred component ``u_i = v_i K G`` as an image: the image prior;
   * the mutual-independence penalty on the cosine similarity of the unmixing vectors, which keeps
     two components from converging to the same image. The paper writes ``lambda exp(T |cos|)``;
     ``exp(T (|cos| - 1))`` is the same term with ``lambda`` scaled by ``e^-T``, so that
     ``lambda_MI`` is the penalty of two identical components whatever the temperature ``T``.
   It stops when no entry of the (row-normalised) ``V`` moved more than ``tol`` in a step, or, when
   the objective's best value fell by less than a fraction ``plateau_rtol`` over ``plateau_steps``
   steps, after dividing the step size by 10 three times (or at ``iterations``).
3. Sign and scale. The paper maps each component to the valid range. Here the bias gradient fixes
   both exactly (our addition): the component ``v_i K`` is a combination ``c`` of the rows, and if it
   isolates image ``j``, ``c^T dL/dW = a_j x_j`` and ``c^T dL/db = a_j`` with the same ``a_j``, so
   ``x_j = c^T dL/dW / c^T dL/db`` in the model's normalised input space, sign included. Without a
   bias (or where ``c^T dL/db`` vanishes), the component is scaled into the valid pixel range, the
   smallest scale that puts every pixel inside it, and its sign is the one that makes it
   positively skewed (a bright object on a darker background): a heuristic, reported in ``meta``.

Our additions, each reported in ``meta`` and switchable:

* ``range_weight``: a prior that the exactly scaled image ``x_i = c^T dL/dW / c^T dL/db`` lies in the
  valid pixel range (its mean violation, in units of the range). A mixture of images with weights of
  both signs leaves the range where the images differ, so the prior pushes towards single images;
  0 gives the paper's objective. It needs the bias gradient.
* ``peel``: an exact first stage for a ReLU after the first layer. A unit that exactly one image of
  the batch switches on has a pure row, ``G_h / (dL/db)_h = x_j``. A candidate ``x`` from a row is
  accepted only when it passes a rank test that holds for a true image alone: the rows of the units
  ``x`` leaves off (``W x + b < 0``, computable since the server sent ``W`` and ``b``) hold no
  trace of ``x`` (``delta_{j,h} = 0`` there), so they span only the other ``B - 1`` images; their
  ``B``-th singular value, relative to the ``(B-1)``-th, must be below ``peel_tol``. The null vector
  ``d`` of those rows gives the image's coefficient in every row, ``delta_{j,h} = G_h d / x_j d``, and
  the image is deflated out exactly (``G <- G - delta_j x_j^T``, ``dL/db <- dL/db - delta_j``),
  which can make further rows pure. ICA then unmixes what is left. Without exact zeros (a sigmoid or
  leaky ReLU) no candidate passes and nothing is peeled. Noise in the gradient raises the ratio to
  about its relative size: below ``peel_tol`` peeling still works, to that accuracy; at 1% (measured
  on 12 images) nothing is peeled. A FedAvg update of several local steps, whose units switch as the
  weights move, should fail the test too (not tested).

This module is an original implementation; the authors' public code was read for the method, not
copied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_gp.attacks.base import AttackNotApplicable, GradientAttack, Reconstruction
from lightning_gp.attacks.registry import register_attack
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.view import ServerView
from lightning_gp.validation import (
    check_bool,
    check_choice,
    check_int,
    check_nonnegative,
    check_number,
    check_positive_int,
)

#: ``E[log cosh(nu)]`` for ``nu ~ N(0, 1)`` (200-point Gauss-Hermite quadrature): the Gaussian
#: reference of the negentropy approximation ``J``.
GAUSSIAN_LOGCOSH = 0.3745672074914377
#: Singular values below this fraction of the largest count as zero when the numerical rank of the
#: gradient is taken: float32 gradients carry a relative rounding error of about 1e-7 (unit
#: roundoff 6e-8 times a few accumulations; measured: 1e-8 of the largest beyond the rank), while an
#: aggregate of 128 Fashion-MNIST images through 256 units keeps its smallest true singular value near
#: 1e-3 of the largest (64 images: 5e-3).
RANK_RTOL = 1e-5
#: A candidate image from a pure row may leave the valid range by this fraction of it (rounding only:
#: a pure row is an image exactly).
PEEL_RANGE_RTOL = 1e-3
_NEEDS = "Cocktail Party unmixes the weight gradient of a first nn.Linear on the flattened input"


# ------------------------------------------------------------------------------- the first layer
@dataclass(frozen=True)
class FirstLayer:
    """The model's first trainable layer: the module's name, the ``nn.Linear`` and its parameter names."""

    name: str
    module: nn.Linear
    weight: str
    bias: str | None


def first_linear_layer(model: nn.Module, input_shape: tuple[int, ...]) -> FirstLayer:
    """The first module with parameters that a forward pass of one input runs, which must be a
    trainable ``nn.Linear`` whose input is the flattened image; else :class:`AttackNotApplicable`
    naming what it is instead."""
    owners = [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    calls: list[tuple[str, nn.Module, Tensor]] = []

    def first_call(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not calls and args:
                calls.append((name, module, args[0]))

        return hook

    handles = [module.register_forward_pre_hook(first_call(name)) for name, module in owners]
    parameter = next(model.parameters(), None)
    if parameter is None:
        raise AttackNotApplicable(f"{_NEEDS}; the model has no parameters")
    probe = torch.linspace(-1.0, 1.0, math.prod(input_shape), dtype=parameter.dtype, device=parameter.device)
    probe = probe.reshape(1, *input_shape)
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            model(probe)
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
    if not calls:
        raise AttackNotApplicable(f"{_NEEDS}; no module with parameters ran in a forward pass")
    name, module, seen = calls[0]
    label = f"{name or '<model>'} ({type(module).__name__})"
    if not isinstance(module, nn.Linear):
        raise AttackNotApplicable(f"{_NEEDS}; the model's first layer is {label}, not an nn.Linear")
    if not module.weight.requires_grad:
        raise AttackNotApplicable(f"{_NEEDS}; the first layer {label} is frozen, its weight has no gradient")
    if not isinstance(seen, Tensor) or seen.shape != (1, probe[0].numel()) or not torch.equal(seen, probe.flatten(1)):
        raise AttackNotApplicable(f"{_NEEDS}; the input of the first layer {label} is not the flattened image")
    prefix = f"{name}." if name else ""
    bias = f"{prefix}bias" if module.bias is not None and module.bias.requires_grad else None
    return FirstLayer(name, module, f"{prefix}weight", bias)


# ---------------------------------------------------------------------------------- the mixture
@dataclass
class Mixture:
    """The first layer's gradient as a mixing problem, in float64: ``rows`` ``[H, D]`` (``dL/dW``),
    ``bias`` ``[H]`` (``dL/db``, or ``None``), ``sources``: how many images it still mixes, and the
    valid range ``low``, ``high`` ``[D]`` of a normalised input."""

    rows: Tensor
    bias: Tensor | None
    sources: int
    low: Tensor
    high: Tensor

    def scaled(self, combos: Tensor) -> tuple[Tensor, Tensor]:
        """The images the row combinations ``combos`` ``[n, H]`` isolate, each divided by its bias
        combination (exact sign and scale), and which of them could be scaled so (``[n]`` bool)."""
        mixed = combos @ self.rows
        if self.bias is None:
            return mixed, torch.zeros(len(combos), dtype=torch.bool, device=mixed.device)
        weights = combos @ self.bias
        floor = 1e-9 * combos.norm(dim=1) * self.bias.norm()
        usable = weights.abs() > floor
        safe = torch.where(usable, weights, torch.ones_like(weights))
        return mixed / safe[:, None], usable

    def range_violation(self, images: Tensor) -> Tensor:
        """Per image, the mean distance of its pixels outside the valid range, in units of the range."""
        outside = (self.low - images).clamp(min=0) + (images - self.high).clamp(min=0)
        return (outside / (self.high - self.low)).mean(dim=1)


def numerical_rank(matrix: Tensor) -> int:
    """Singular values above :data:`RANK_RTOL` of the largest."""
    values = torch.linalg.svdvals(matrix)
    return 0 if not values.numel() or values[0] == 0 else int((values > RANK_RTOL * values[0]).sum())


def range_fit(components: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """Each component ``[n, D]`` divided by the smallest positive scale that puts every pixel in
    ``[low, high]`` (``low < 0 < high``), with the sign that makes it positively skewed (the fallback
    without a bias gradient: a heuristic for images with a darker background)."""
    centred = components - components.mean(dim=1, keepdim=True)
    skew = (centred**3).mean(dim=1)
    signed = components * torch.where(skew < 0, -1.0, 1.0).to(components)[:, None]
    # v / s <= high needs s >= v / high where v > 0; v / s >= low needs s >= v / low where v < 0
    needed = torch.maximum((signed / high).clamp(min=0), (signed / low).clamp(min=0)).amax(dim=1)
    return signed / torch.where(needed > 0, needed, torch.ones_like(needed))[:, None]


# ------------------------------------------------------------------------- exact peeling (ReLU)
@dataclass
class Peeled:
    """What :func:`peel_pure_rows` took out: the images and, per image, its rank-test ratio."""

    images: list[Tensor] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)


def _pure_row(mixture: Mixture, weight: Tensor, bias: Tensor, tol: float) -> tuple[Tensor, Tensor, float] | None:
    """An image of a pure row that passes the rank test (``[D]``), the null vector ``d`` of its inactive
    rows (``[D]``, in the rows' span: ``delta_{j,h} = G_h d / x_j d``) and its ratio; ``None`` when no
    candidate passes. Candidates, cheapest tests first: a row with a bias gradient, whose image lies in
    the valid range (up to :data:`PEEL_RANGE_RTOL`) and switches its own unit on."""
    rows, gains, n = mixture.rows, mixture.bias, mixture.sources
    assert gains is not None
    _, values, vh = torch.linalg.svd(rows, full_matrices=False)
    basis = vh[:n]
    coords = rows @ basis.T
    norms = coords.norm(dim=1)
    live = norms > RANK_RTOL * norms.max()
    candidates = torch.nonzero(live & (gains.abs() > RANK_RTOL * gains.abs().max())).flatten()
    images = rows[candidates] / gains[candidates, None]
    violation = mixture.range_violation(images)
    keep = violation <= PEEL_RANGE_RTOL
    candidates, images, violation = candidates[keep], images[keep], violation[keep]
    pre = images @ weight.T + bias
    own = pre[torch.arange(len(candidates)), candidates] > 0  # a pure row's image switches its unit on
    for k in torch.argsort(violation).tolist():
        if not bool(own[k]):
            continue
        off = torch.nonzero(live & (pre[k] < 0)).flatten()
        if n == 1:
            ratio = float(values[1] / values[0]) if values.numel() > 1 else 0.0
            return (images[k], torch.ones(1, dtype=rows.dtype, device=rows.device), ratio) if ratio < tol else None
        if off.numel() < n + 2:  # too few rows to test a rank of n - 1
            continue
        _, s, v = torch.linalg.svd(coords[off], full_matrices=True)
        ratio = float(s[n - 1] / s[n - 2])
        if ratio < tol:
            return images[k], basis.T @ v[-1], ratio
    return None


def peel_pure_rows(mixture: Mixture, weight: Tensor, bias: Tensor, tol: float) -> tuple[Mixture, Peeled]:
    """Take out, exactly, every image a pure row reveals, and each time deflate the mixture by it
    (module docstring, ``peel``). Returns the mixture of the images left and what was peeled."""
    peeled = Peeled()
    while mixture.sources > 0 and mixture.bias is not None:
        found = _pure_row(mixture, weight, bias, tol)
        if found is None:
            break
        image, null, ratio = found
        if mixture.sources == 1:
            coefficient = mixture.bias.clone()
        else:
            coefficient = (mixture.rows @ null) / (image @ null)
        mixture = Mixture(
            mixture.rows - coefficient[:, None] * image[None],
            mixture.bias - coefficient,
            mixture.sources - 1,
            mixture.low,
            mixture.high,
        )
        peeled.images.append(image)
        peeled.ratios.append(ratio)
    return mixture, peeled


# ------------------------------------------------------------------------------ the ICA objective
@dataclass
class Whitened:
    """Step 1: ``signals = K G_c`` (``[n, D]``, unit variance), ``means = K mu`` (``[n, 1]``: the
    centring undone), ``K`` ``[n, H]``."""

    signals: Tensor
    means: Tensor
    whitening: Tensor


def whiten(rows: Tensor, components: int) -> Whitened:
    """Centre each row over its pixels and whiten to the top ``components`` principal components."""
    mean = rows.mean(dim=1, keepdim=True)
    u, s, _ = torch.linalg.svd(rows - mean, full_matrices=False)
    whitening = (u[:, :components] / s[:components]).T * math.sqrt(rows.shape[1])
    return Whitened(whitening @ (rows - mean), whitening @ mean, whitening)


def total_variation_of(images: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Per image, the mean absolute difference of horizontally and vertically neighbouring pixels
    (``[n, D]`` reshaped to ``[n, *shape]``; 0 for inputs that are not ``(C, H, W)``)."""
    if len(shape) != 3:
        return images.new_zeros(images.shape[0])
    grid = images.reshape(-1, *shape)
    across = (grid[..., :, 1:] - grid[..., :, :-1]).abs().flatten(1).mean(dim=1)
    down = (grid[..., 1:, :] - grid[..., :-1, :]).abs().flatten(1).mean(dim=1)
    return across + down


class UnmixingObjective:
    """The CPA objective of the module docstring for the unmixing matrix ``V``: ``terms(V)`` gives the
    total and each term (before weighting)."""

    def __init__(self, attack: CocktailParty, mixture: Mixture, white: Whitened, shape: tuple[int, ...]) -> None:
        self.attack, self.mixture, self.white, self.shape = attack, mixture, white, shape
        self.use_range = attack.range_weight > 0 and mixture.bias is not None
        n = white.signals.shape[0]
        self.off_diagonal = 1.0 - torch.eye(n, dtype=white.signals.dtype, device=white.signals.device)

    def terms(self, unmixing: Tensor) -> tuple[Tensor, dict[str, float]]:
        a = self.attack
        v = unmixing / unmixing.norm(dim=1, keepdim=True)
        components = v @ self.white.signals
        negentropy = ((torch.log(torch.cosh(components)).mean(dim=1) - GAUSSIAN_LOGCOSH) ** 2).mean()
        tv = total_variation_of(components + v @ self.white.means, self.shape).mean()
        n = v.shape[0]
        similarity = (v @ v.T).abs()
        mi = (torch.exp(a.temperature * (similarity - 1.0)) * self.off_diagonal).sum() / max(n * (n - 1), 1)
        total = -a.ne_weight * negentropy + a.tv_weight * tv + a.mi_weight * mi
        violation = torch.zeros((), dtype=total.dtype, device=total.device)
        if self.use_range:
            images, _ = self.mixture.scaled(v @ self.white.whitening)
            violation = self.mixture.range_violation(images).mean()
            total = total + a.range_weight * violation
        values = {"negentropy": negentropy, "total_variation": tv, "independence": mi, "range": violation}
        return total, {k: float(t.detach()) for k, t in values.items()}


# ---------------------------------------------------------------------------------- the attack
@register_attack("CocktailParty", order=7, build=lambda budget, seed, model: CocktailParty(seed=seed))
class CocktailParty(GradientAttack):
    """The Cocktail Party attack (Kariyappa et al., ICML 2023), passive, as the module describes it.

    Works on one client's gradient and on an aggregate (a sum or mean of many clients' gradients, or
    a FedAvg update: the first layer's update is a mixture of the same images either way). Returns
    ``view.batch_size`` images in the model's normalised input space, clamped to the valid range
    (peeled images first, then the ICA components; when the gradient's numerical rank is below the
    batch size, the missing ones are zeros, the data mean); labels are not recovered (``None``).
    ``meta``: the layer, its hidden units, the gradient's numerical rank, how many images were peeled
    (and each one's rank-test ratio), the ICA's components and iterations, whether and why it stopped
    (``"tolerance"``, ``"plateau"``, ``"iterations"``), the final terms of its objective, and per
    image found how it was scaled (``"peeled"``, ``"bias"`` or ``"range"``).

    Args:
        iterations: the cap on Adam steps of the unmixing; ``lr``: Adam's initial step size.
        ne_weight, tv_weight, mi_weight, temperature: ``lambda_NE``, ``lambda_TV``, ``lambda_MI``
            and ``T`` of the objective (module docstring).
        range_weight: ``lambda_range`` of the valid-range prior (ours; 0: the paper's objective).
        tol: convergence: no entry of the row-normalised unmixing matrix moved more than this.
        plateau_steps, plateau_rtol: the step size is divided by 10 when the best objective fell by
            less than a fraction ``plateau_rtol`` over ``plateau_steps`` steps, and the run stops
            after three such divisions (``plateau_steps=0``: never).
        peel: take out the images of pure rows exactly first (ours, module docstring).
        peel_tol: the rank test's bound on the ratio of singular values.
        init: the unmixing matrix's start: ``"identity"`` (the paper's; the principal components)
            or ``"random"`` (a random orthogonal matrix drawn from ``seed``).
    """

    # the SoK's class B (its attack table lists Cocktail Party there): the update, the model sent (its
    # first layer's weights, for ``peel``) and the data's shape and range; passive (no ``modify_model``)
    requires = requirements("basic_knowledge")

    def __init__(
        self,
        iterations: int = 3000,
        lr: float = 0.01,
        ne_weight: float = 1.0,
        tv_weight: float = 1.0,
        mi_weight: float = 10.0,
        temperature: float = 20.0,
        range_weight: float = 10.0,
        tol: float = 1e-7,
        plateau_steps: int = 100,
        plateau_rtol: float = 1e-3,
        peel: bool = True,
        peel_tol: float = 1e-4,
        init: Literal["identity", "random"] = "identity",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.iterations = check_positive_int(iterations, "iterations")
        self.lr = check_number(lr, "lr", low=0.0, low_open=True)
        self.ne_weight = check_nonnegative(ne_weight, "ne_weight")
        self.tv_weight = check_nonnegative(tv_weight, "tv_weight")
        self.mi_weight = check_nonnegative(mi_weight, "mi_weight")
        self.temperature = check_nonnegative(temperature, "temperature")
        self.range_weight = check_nonnegative(range_weight, "range_weight")
        self.tol = check_nonnegative(tol, "tol")
        self.plateau_steps = check_int(plateau_steps, "plateau_steps", low=0)
        self.plateau_rtol = check_number(plateau_rtol, "plateau_rtol", low=0.0, high=1.0)
        self.peel = check_bool(peel, "peel")
        self.peel_tol = check_number(peel_tol, "peel_tol", low=0.0, high=1.0, low_open=True, high_open=True)
        self.init = check_choice(init, "init", ("identity", "random"))

    def reconstruct(self, view: ServerView) -> Reconstruction:
        """Unmix the first layer's gradient into ``view.batch_size`` images (module docstring)."""
        view, generator = self._prepare(view)
        layer = first_linear_layer(view.model, view.input_shape)
        mixture, rank = self._mixture(view, layer)
        meta: dict[str, Any] = {"layer": layer.name, "hidden_units": layer.module.out_features, "rank": rank}
        peeled = Peeled()
        if self.peel and mixture.bias is not None and layer.module.bias is not None:
            weight, bias = (p.detach().to(torch.float64) for p in (layer.module.weight, layer.module.bias))
            mixture, peeled = peel_pure_rows(mixture, weight, bias, self.peel_tol)
        meta.update(peeled=len(peeled.images), peel_ratios=peeled.ratios)
        images, trace, ica_meta = self._unmix(mixture, view.input_shape, generator)
        meta.update(ica_meta, scale=["peeled"] * len(peeled.images) + ica_meta["scale"])
        found = torch.cat([torch.stack(peeled.images), images]) if peeled.images else images
        missing = view.batch_size - found.shape[0]
        if missing > 0:
            found = torch.cat([found, found.new_zeros(missing, found.shape[1])])
        meta["num_missing"] = max(missing, 0)
        low, high = view.data_bounds()
        dtype = view.gradients[layer.weight].dtype
        out = found.reshape(-1, *view.input_shape).to(dtype)
        out = torch.max(torch.min(out, high.to(dtype)), low.to(dtype))
        return Reconstruction(images=out.detach(), labels=None, loss_trace=trace, attack="CocktailParty", meta=meta)

    def _mixture(self, view: ServerView, layer: FirstLayer) -> tuple[Mixture, int]:
        """The layer's gradient as a :class:`Mixture` of the batch, checked for the rank it needs."""
        hidden, batch = layer.module.out_features, view.batch_size
        if hidden < batch:
            raise AttackNotApplicable(
                f"the first layer {layer.name or '<model>'} has {hidden} hidden units for a batch of {batch} images: "
                f"its weight gradient has rank at most {hidden} < {batch}, and unmixing {batch} images needs rank "
                f"{batch} (Cocktail Party needs at least as many hidden units as images)"
            )
        rows = view.gradients[layer.weight].detach().to(torch.float64)
        bias = None if layer.bias is None else view.gradients[layer.bias].detach().to(torch.float64)
        if bias is not None and not bool(bias.abs().max() > RANK_RTOL * rows.abs().max()):
            bias = None  # e.g. a normalisation layer right after the first: dL/db vanishes, no scale in it
        low, high = view.data_bounds()
        shape = view.input_shape
        low = low[0].to(torch.float64).expand(*shape).flatten()
        high = high[0].to(torch.float64).expand(*shape).flatten()
        rank = numerical_rank(rows - rows.mean(dim=1, keepdim=True))
        return Mixture(rows, bias, min(batch, rank), low, high), rank

    def _unmix(
        self, mixture: Mixture, shape: tuple[int, ...], generator: torch.Generator
    ) -> tuple[Tensor, list[float], dict[str, Any]]:
        """Steps 1-3 of the module docstring on what is left of the mixture: the images ``[n, D]``,
        the objective per iteration, and the ICA's ``meta``."""
        n = min(mixture.sources, numerical_rank(mixture.rows - mixture.rows.mean(dim=1, keepdim=True)))
        empty: dict[str, Any] = {"ica_components": n, "iterations": 0, "converged": True, "stop": "nothing to unmix"}
        if n == 0:
            return mixture.rows.new_zeros(0, mixture.rows.shape[1]), [], {**empty, "scale": []}
        white = whiten(mixture.rows, n)
        objective = UnmixingObjective(self, mixture, white, shape)
        unmixing, trace, ica_meta = self._optimise(objective, n, generator)
        combos = unmixing @ white.whitening
        images, usable = mixture.scaled(combos)
        if not bool(usable.all()):
            fallback = range_fit(combos[~usable] @ mixture.rows, mixture.low, mixture.high)
            images[~usable] = fallback
        scale = ["bias" if bool(u) else "range" for u in usable]
        return images, trace, {**empty, **ica_meta, "scale": scale}

    def _optimise(
        self, objective: UnmixingObjective, n: int, generator: torch.Generator
    ) -> tuple[Tensor, list[float], dict[str, Any]]:
        """Adam on the unmixing matrix until it stops moving (``tol``), the objective plateaus three
        times, or ``iterations``; returns the row-normalised matrix, the trace and the run's ``meta``."""
        dtype, device = objective.white.signals.dtype, objective.white.signals.device
        if self.init == "identity":
            start = torch.eye(n, dtype=dtype, device=device)
        else:
            draw = torch.randn(n, n, generator=generator, device=generator.device, dtype=dtype).to(device)
            start = torch.linalg.qr(draw)[0]
        unmixing = start.clone().requires_grad_(True)
        optimiser = torch.optim.Adam([unmixing], lr=self.lr)
        trace: list[float] = []
        best: list[float] = []
        decays, stop = 0, "iterations"
        terms: dict[str, float] = {}
        for iteration in range(self.iterations):
            before = (unmixing / unmixing.norm(dim=1, keepdim=True)).detach()
            loss, terms = objective.terms(unmixing)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            trace.append(float(loss.detach()))
            best.append(min(best[-1], trace[-1]) if best else trace[-1])
            self._report(iteration, self.iterations, trace[-1])
            with torch.no_grad():
                moved = float((unmixing / unmixing.norm(dim=1, keepdim=True) - before).abs().max())
            if moved <= self.tol:
                stop = "tolerance"
                break
            if self.plateau_steps and len(best) > self.plateau_steps:
                reference = best[-self.plateau_steps - 1]
                if reference - best[-1] < self.plateau_rtol * abs(reference):
                    decays += 1
                    if decays > 3:
                        stop = "plateau"
                        break
                    for group in optimiser.param_groups:
                        group["lr"] /= 10
                    best = best[-1:]
        final = (unmixing / unmixing.norm(dim=1, keepdim=True)).detach()
        meta = {"iterations": len(trace), "converged": stop != "iterations", "stop": stop, "objective_terms": terms}
        return final, trace, meta
