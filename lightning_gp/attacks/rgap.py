"""R-GAP: a closed-form, layer-by-layer inversion of one image's gradient.

Zhu & Blaschko, "R-GAP: Recursive Gradient Attack on Privacy", ICLR 2021 (Sec. 3 and its
Algorithm 1, whose notation follows the paper's Eqs. 6-15). For a network that is a chain of
bias-free linear maps (convs, linear layers) with invertible activations, every layer gives two
sets of equations that are *linear* in the layer's input ``x_i``:

* the forward constraint ``W_i x_i = z_i``, where the pre-activation ``z_i`` is the inverse
  activation of the next layer's (already recovered) input;
* the gradient constraint ``dL/dW_i = g_i x_i^T`` for a linear layer, in its convolutional form
  ``dL/dW_i[o, r] = sum_l g_i[o, l] x_i[patch entry r at output position l]``, where the
  upstream gradient ``g_i = dL/dz_i`` follows from the layer above by backpropagation:
  ``g_i = sigma'(z_i) * (W_{i+1}^T g_{i+1})``.

Stacking both and solving by least squares gives ``x_i``, which is the previous layer's output;
the recursion runs from the classifier down to the image. It starts at the last layer:
``dL/dW_L = g_L x_L^T`` is rank one, so ``x_L`` is its row direction up to one scalar, which
the loss pins down (the paper has a single logit and a logistic loss; here it is the
cross-entropy of ``num_classes`` logits, see :func:`final_layer_input`). How many independent
equations a layer has against its unknowns is the paper's rank analysis; ``meta`` reports it.

Numerics (our choices, not the paper's): each layer's stacked system ``A x = b`` is solved
through its Gram matrix ``A^T A``, assembled directly from the patch geometry (never forming
``A``, which has ~77k rows for CNN6's top conv). A Cholesky factorisation with a LAPACK
condition estimate certifies full rank; otherwise a pivoted Cholesky factorisation gives the
numerical rank and the minimum-norm least-squares solution (what ``numpy.linalg.lstsq`` gives
in the reference implementation). Iterative refinement with residuals computed from ``A``
itself (corrected semi-normal equations) restores the accuracy squaring the condition number
costs. The gradient rows are rescaled so both blocks have the same Frobenius norm: this leaves
the solution of a consistent system unchanged and only balances an inconsistent one (a
defended gradient). Zero padding is never an unknown: padded entries are known zeros.

This module is an original implementation; the authors' reference implementation
(JunyiZhu-AI/R-GAP: ``main.py``, ``recursive_attack.py``, ``conv2circulant.py``,
``utils/utils.py``) was read for the method, not copied.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import scipy.linalg
import scipy.linalg.lapack
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gp.attacks.base import AttackNotApplicable, GradientAttack, Reconstruction
from lightning_gp.attacks.labels import recover_labels
from lightning_gp.attacks.registry import register_attack
from lightning_gp.attacks.view import ServerView

SUPPORTED = (
    "R-GAP handles a plain chain of bias-free nn.Conv2d / nn.Linear layers (zero padding, groups=1), "
    "each followed by an invertible activation (nn.LeakyReLU with a positive slope, nn.Identity, "
    "nn.Sigmoid, nn.Tanh) or none, optionally nn.Flatten, ending in an nn.Linear classifier "
    "(bias allowed there) trained with nn.CrossEntropyLoss, for a batch of one image"
)
_ACTIVATIONS = (nn.LeakyReLU, nn.Identity, nn.Sigmoid, nn.Tanh)
_DTYPE = torch.float64
_CLAMP = 1e-7  # keeps the inverse of a sigmoid/tanh finite on saturated outputs


# --------------------------------------------------------------------------------------------
# The layer chain
# --------------------------------------------------------------------------------------------


@dataclass
class ChainLayer:
    """One linear map of the chain and the activation after it.

    Attributes:
        name: the module's name in ``model.named_modules()`` (gradients are ``f"{name}.weight"``).
        module: the ``nn.Conv2d`` or ``nn.Linear``.
        activation: what follows it (``nn.Identity`` when nothing does).
        in_shape, out_shape: per-sample shapes of its input and output (set by tracing).
    """

    name: str
    module: nn.Conv2d | nn.Linear
    activation: nn.Module
    in_shape: tuple[int, ...] = ()
    out_shape: tuple[int, ...] = ()

    def parameter(self, kind: str) -> str:
        return f"{self.name}.{kind}" if self.name else kind


def _leaf_problem(name: str, module: nn.Module) -> str | None:
    """Why R-GAP cannot go through this leaf module (``None`` if it can)."""
    label = f"{name or '<model>'} ({type(module).__name__})"
    if isinstance(module, nn.Conv2d):
        if module.bias is not None:
            return f"{label} has a bias"
        if module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str):
            return f"{label} needs groups=1 and explicit zero padding"
        return None
    if isinstance(module, (nn.Linear, nn.Flatten, nn.Identity, nn.Sigmoid, nn.Tanh)):
        return None
    if isinstance(module, nn.LeakyReLU):
        return None if module.negative_slope > 0 else f"{label} has slope {module.negative_slope} (not invertible)"
    if isinstance(module, nn.ReLU):
        return f"{label} is not invertible (negative pre-activations are lost)"
    return f"{label} is not supported"


def _leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Leaf modules in registration order; a container holding parameters itself counts as a leaf."""
    found = []
    for name, module in model.named_modules():
        own_params = any(True for _ in module.parameters(recurse=False))
        if not any(True for _ in module.children()) or own_params:
            found.append((name, module))
    return found


def layer_chain(model: nn.Module, input_shape: tuple[int, ...], num_classes: int) -> list[ChainLayer]:
    """Flatten ``model`` into ``[Conv2d/Linear, activation]`` pairs in forward order and validate it.

    The order is the modules' registration order; :func:`_check_reproduces` then proves it is
    the forward order by running a probe through both. Raises ``ValueError`` listing every layer
    R-GAP cannot handle.
    """
    problems: list[str] = []
    chain: list[ChainLayer] = []
    for name, module in _leaves(model):
        problem = _leaf_problem(name, module)
        if problem is not None:
            problems.append(problem)
        elif isinstance(module, (nn.Conv2d, nn.Linear)):
            chain.append(ChainLayer(name, module, nn.Identity()))
        elif isinstance(module, _ACTIVATIONS) and not isinstance(module, nn.Identity):
            if not chain or not isinstance(chain[-1].activation, nn.Identity):
                problems.append(f"{name} ({type(module).__name__}) does not directly follow a conv/linear layer")
            else:
                chain[-1].activation = module
    if not chain:
        problems.append("the model has no conv/linear layer")
    else:
        head = chain[-1]
        if not isinstance(head.module, nn.Linear) or head.module.out_features != num_classes:
            problems.append(
                f"{head.name} ({type(head.module).__name__}) is last; R-GAP needs a final nn.Linear with {num_classes} outputs"
            )
        elif not isinstance(head.activation, nn.Identity):
            problems.append(
                f"{head.name} is followed by {type(head.activation).__name__}; the logits must be its raw output"
            )
        problems += [f"{layer.name} (Linear) has a bias" for layer in chain[:-1] if layer.module.bias is not None]
    if problems:
        raise AttackNotApplicable(
            f"R-GAP cannot attack {type(model).__name__}: " + "; ".join(problems) + f". {SUPPORTED}."
        )
    _trace_shapes(chain, input_shape)
    _check_reproduces(model, chain, input_shape)
    return chain


def _apply(layer: ChainLayer, x: Tensor) -> Tensor:
    """One link of the chain on a batch (flattening before a linear layer)."""
    if isinstance(layer.module, nn.Linear):
        x = x.flatten(1)
    return layer.activation(layer.module(x))


def _trace_shapes(chain: list[ChainLayer], input_shape: tuple[int, ...]) -> None:
    """Fill in each layer's per-sample input and output shapes."""
    param = next(chain[0].module.parameters())
    x = torch.zeros(1, *input_shape, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        for layer in chain:
            layer.in_shape = tuple(x.shape[1:]) if not isinstance(layer.module, nn.Linear) else (x[0].numel(),)
            try:
                x = _apply(layer, x)
            except RuntimeError as error:
                raise AttackNotApplicable(
                    f"R-GAP cannot run {layer.name} on input of shape {layer.in_shape}: {error}"
                ) from error
            layer.out_shape = tuple(x.shape[1:])


def _check_reproduces(model: nn.Module, chain: list[ChainLayer], input_shape: tuple[int, ...]) -> None:
    """The chain must compute exactly what the model computes (no skips, no functional extras)."""
    param = next(model.parameters())
    probe = torch.randn(2, *input_shape, generator=torch.Generator().manual_seed(0)).to(param)
    with torch.no_grad():
        expected = model(probe)
        got = probe
        for layer in chain:
            got = _apply(layer, got)
    scale = expected.abs().max().clamp_min(1e-6)
    if got.shape != expected.shape or (got - expected).abs().max() > 1e-4 * scale:
        raise AttackNotApplicable(
            f"{type(model).__name__}'s forward is not the plain chain of its layers in registration order "
            f"(residual connections or functional operations?). {SUPPORTED}."
        )


# --------------------------------------------------------------------------------------------
# Patch geometry: a conv (or linear) layer as x -> W U(x), with U(x) gathering patches
# --------------------------------------------------------------------------------------------


def patch_indices(layer: ChainLayer) -> Tensor:
    """``idx[r, l]``: which input entry fills patch row ``r`` at output position ``l``.

    ``n = prod(in_shape)`` is the sentinel of a zero-padding entry, so padding is never an
    unknown. A linear layer is the one-patch case ``idx = arange(n)[:, None]``.
    """
    n = math.prod(layer.in_shape)
    if isinstance(layer.module, nn.Linear):
        return torch.arange(n).unsqueeze(1)
    conv = layer.module
    # unfold an image of (index + 1): zero padding then reads 0, i.e. sentinel n after the shift
    numbered = (torch.arange(n, dtype=_DTYPE) + 1).view(1, *layer.in_shape)
    padding = cast(tuple[int, ...], conv.padding)  # numeric: string padding is refused when the chain is built
    cols = F.unfold(numbered, conv.kernel_size, dilation=conv.dilation, padding=padding, stride=conv.stride)[0]
    idx = cols.round().long() - 1
    return torch.where(idx < 0, torch.full_like(idx, n), idx)


def gather_patches(x: Tensor, idx: Tensor) -> Tensor:
    """``U(x)``: the patch matrix ``[R, L]`` of a flat input ``x`` (zeros at padding)."""
    return torch.cat([x, x.new_zeros(1)])[idx]


def scatter_patches(patches: Tensor, idx: Tensor, n: int) -> Tensor:
    """``U^T(Y)``: the adjoint of :func:`gather_patches` (sums each entry's patch copies)."""
    out = patches.new_zeros(n + 1)
    out.index_add_(0, idx.reshape(-1), patches.reshape(-1))
    return out[:n]


def scatter_gram(out: Tensor, block: Tensor, index_sets: Tensor, chunk: int = 1 << 22) -> None:
    """Add ``sum_j S_j^T block S_j`` to the flat ``(n+1)^2`` buffer ``out``; ``S_j`` selects ``index_sets[j]``.

    With ``block = W^T W`` and the patch at each output position (``index_sets = idx^T``) this is
    ``A_f^T A_f`` of the forward constraint; with ``block = g^T g`` and the positions of each
    patch row (``index_sets = idx``) it is ``A_g^T A_g`` of the gradient constraint. The padding
    sentinel ``n`` collects the products with padding entries, which the caller drops.
    """
    side = math.isqrt(out.numel())
    per = max(1, chunk // block.numel())
    for start in range(0, index_sets.shape[0], per):
        sets = index_sets[start : start + per]
        flat = sets[:, :, None] * side + sets[:, None, :]
        out.index_add_(0, flat.reshape(-1), block.expand(sets.shape[0], -1, -1).reshape(-1))


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------


def invert_activation(activation: nn.Module, out: Tensor) -> Tensor:
    """Pre-activation ``z`` from the activation's output ``sigma(z)``."""
    if isinstance(activation, nn.LeakyReLU):
        return torch.where(out >= 0, out, out / activation.negative_slope)
    if isinstance(activation, nn.Sigmoid):
        return torch.logit(out.clamp(_CLAMP, 1 - _CLAMP))
    if isinstance(activation, nn.Tanh):
        return torch.atanh(out.clamp(-1 + _CLAMP, 1 - _CLAMP))
    return out


def activation_derivative(activation: nn.Module, pre: Tensor, out: Tensor) -> Tensor:
    """``sigma'(z)`` elementwise, from the pre-activation and the output."""
    if isinstance(activation, nn.LeakyReLU):
        return torch.where(pre > 0, torch.ones_like(pre), torch.full_like(pre, activation.negative_slope))
    if isinstance(activation, nn.Sigmoid):
        out = out.clamp(_CLAMP, 1 - _CLAMP)
        return out * (1 - out)
    if isinstance(activation, nn.Tanh):
        return 1 - out.clamp(-1 + _CLAMP, 1 - _CLAMP) ** 2
    return torch.ones_like(pre)


# --------------------------------------------------------------------------------------------
# The last layer: rank-one gradient and a one-dimensional root find
# --------------------------------------------------------------------------------------------


def loss_target(loss_fn: Callable[[Tensor, Tensor], Tensor], label: int, num_classes: int) -> tuple[Tensor, float]:
    """``(t, s)`` with ``dL/dz = s (softmax(z) - t)`` for one image under ``loss_fn``."""
    if not isinstance(loss_fn, nn.CrossEntropyLoss):
        raise AttackNotApplicable(
            f"R-GAP's last-layer step needs nn.CrossEntropyLoss, the view has {type(loss_fn).__name__}"
        )
    if loss_fn.ignore_index == label:
        raise AttackNotApplicable(f"the label {label} is the loss's ignore_index: the gradient is zero")
    smoothing = float(loss_fn.label_smoothing)
    if smoothing > 0 and loss_fn.weight is not None:
        raise AttackNotApplicable("R-GAP does not model class weights together with label smoothing")
    target = torch.full((num_classes,), smoothing / num_classes, dtype=_DTYPE)
    target[label] += 1 - smoothing
    # class weights cancel in the mean over one image; a sum keeps the label's weight
    scale = 1.0
    if loss_fn.reduction == "sum" and loss_fn.weight is not None:
        scale = float(loss_fn.weight[label])
    elif loss_fn.reduction == "none":
        raise AttackNotApplicable("R-GAP needs a scalar loss (reduction 'mean' or 'sum')")
    return target, scale


def _logit_gradient(a: Tensor, v: Tensor, bias: Tensor, target: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``s (softmax(a v + b) - t)`` and its derivative in ``a`` (``a`` may be a batch ``[A, 1]``)."""
    p = torch.softmax(a * v + bias, dim=-1)
    dp = p * (v - (p * v).sum(-1, keepdim=True))  # d softmax(a v + b) / da
    return scale * (p - target), scale * dp


def solve_scale(v: Tensor, c: Tensor, bias: Tensor, target: Tensor, scale: float) -> tuple[float, float]:
    """The scalar ``a`` with ``x_L = a u``: a root of ``R(a) = a s (softmax(a W u + b) - t) - dL/dW u``.

    Why: ``dL/dW = g x_L^T`` with ``g = s (softmax(W x_L + b) - t)``; for ``x_L = a u`` (``u`` a
    unit vector) ``dL/dW u = a g``, which gives the ``K`` equations ``R(a) = 0`` in one unknown
    (the reference implementation's single-logit logistic loss has the one scalar equation
    ``<dL/dW, W> = z dL/dz = -z / (1 + e^z)`` in the logit ``z`` instead).
    Method: the ``K`` equations are solved in the least-squares sense. A grid over both signs
    and twelve decades of ``|a|`` brackets the root; the sign is the one that makes the non-label
    entries of ``dL/dW u / a`` positive softmax values, and the grid finds it without special
    cases. Gauss-Newton steps (with step halving) then polish ``a`` to machine precision.
    Returns ``a`` and the relative residual ``|R(a)| / |dL/dW u|``.
    """
    magnitudes = torch.logspace(-6, 6, 1201, dtype=_DTYPE)
    grid = torch.cat([-magnitudes.flip(0), magnitudes]).unsqueeze(1)
    g, _ = _logit_gradient(grid, v, bias, target, scale)
    a = grid[(grid * g - c).norm(dim=1).argmin()].squeeze()

    def residual(a: Tensor) -> Tensor:
        return a * _logit_gradient(a, v, bias, target, scale)[0] - c

    for _ in range(100):
        g, dg = _logit_gradient(a, v, bias, target, scale)
        r = a * g - c
        jac = g + a * dg
        step = -(jac @ r) / (jac @ jac).clamp_min(1e-300)
        for _ in range(60):  # step halving keeps each step a descent step
            if residual(a + step).norm() <= r.norm():
                break
            step = step / 2
        a = a + step
        if step.abs() <= 1e-15 * a.abs():
            break
    return float(a), float(residual(a).norm() / c.norm().clamp_min(1e-300))


def final_layer_input(
    layer: ChainLayer, weight_grad: Tensor, bias_grad: Tensor | None, target: Tensor, scale: float
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Input ``x_L`` of the classifier and the logits' gradient ``dL/dz``: the recursion's start.

    ``dL/dW = g x_L^T`` is rank one: ``x_L`` lies along its leading right singular vector ``u``.
    With a bias, ``dL/db = g`` is shared outright and ``x_L = dL/dW^T g / |g|^2``; otherwise the
    scale of ``x_L`` comes from :func:`solve_scale`.
    """
    weight = layer.module.weight.detach().to(_DTYPE).cpu()
    bias = torch.zeros(weight.shape[0], dtype=_DTYPE)
    if layer.module.bias is not None:
        bias = layer.module.bias.detach().to(_DTYPE).cpu()
    if bias_grad is not None and bool(bias_grad.ne(0).any()):
        g = bias_grad
        return (
            weight_grad.T @ g / (g @ g),
            g,
            {"method": "bias gradient", "rank_one_ratio": _rank_one_ratio(weight_grad)},
        )
    if not bool(weight_grad.ne(0).any()):
        # nothing shared: the best guess is x_L = 0, with the logits' gradient that implies
        g, _ = _logit_gradient(torch.zeros((), dtype=_DTYPE), torch.zeros_like(bias), bias, target, scale)
        return torch.zeros(weight.shape[1], dtype=_DTYPE), g, {"method": "zero gradient"}
    u = torch.linalg.svd(weight_grad, full_matrices=False).Vh[0]
    a, residual = solve_scale(weight @ u, weight_grad @ u, bias, target, scale)
    x = a * u
    g, _ = _logit_gradient(torch.tensor(1.0, dtype=_DTYPE), weight @ x, bias, target, scale)
    meta = {"method": "root find", "scale": a, "residual": residual, "rank_one_ratio": _rank_one_ratio(weight_grad)}
    return x, g, meta


def _rank_one_ratio(matrix: Tensor) -> float:
    """``sigma_2 / sigma_1``: 0 for an exact single-image gradient, larger once a defense perturbs it."""
    s = torch.linalg.svdvals(matrix)
    return float(s[1] / s[0]) if s.numel() > 1 and s[0] > 0 else 0.0


# --------------------------------------------------------------------------------------------
# One layer: stacked forward + gradient constraints, least squares
# --------------------------------------------------------------------------------------------


@dataclass
class LayerSystem:
    """The stacked system of one layer in patch form.

    Forward rows: ``weight @ U(x) = pre``; gradient rows: ``w * (g @ U(x)^T) = w * weight_grad``
    with ``w = |weight| / |g|`` (row equilibration). ``weight``: ``[O, R]``; ``pre``, ``g``:
    ``[O, L]``; ``weight_grad``: ``[O, R]``; ``idx``: ``[R, L]``.
    """

    weight: Tensor
    pre: Tensor
    g: Tensor
    weight_grad: Tensor
    idx: Tensor
    n: int

    @property
    def balance(self) -> float:
        g_norm = float(self.g.norm())
        return float(self.weight.norm()) / g_norm if g_norm > 0 else 0.0

    @property
    def equations(self) -> int:
        return self.pre.numel() + self.weight_grad.numel()

    def apply(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``A x`` as (forward rows, gradient rows), the latter without the balance factor."""
        patches = gather_patches(x, self.idx)
        return self.weight @ patches, self.g @ patches.T

    def adjoint(self, forward_rows: Tensor, gradient_rows: Tensor) -> Tensor:
        """``A^T [forward_rows; w gradient_rows]`` (the balance applied once more, as in ``A^T A``)."""
        patches = self.weight.T @ forward_rows + self.balance**2 * (gradient_rows.T @ self.g)
        return scatter_patches(patches, self.idx, self.n)

    def gram(self) -> Tensor:
        """``A^T A``, assembled from the patch geometry without forming ``A``."""
        side = self.n + 1
        gram = self.weight.new_zeros(side * side)
        scatter_gram(gram, self.weight.T @ self.weight, self.idx.T)
        scatter_gram(gram, self.balance**2 * (self.g.T @ self.g), self.idx)
        return gram.view(side, side)[: self.n, : self.n]

    def residuals(self, x: Tensor) -> dict[str, float]:
        """Relative residuals of both blocks at ``x``."""
        forward, gradient = self.apply(x)
        return {
            "forward": float((forward - self.pre).norm() / self.pre.norm().clamp_min(1e-300)),
            "gradient": float((gradient - self.weight_grad).norm() / self.weight_grad.norm().clamp_min(1e-300)),
        }


class GramSolver:
    """Least-squares solves with a layer's Gram matrix ``M = A^T A``, and its numerical rank.

    The fast path is a plain Cholesky factorisation (MKL through torch) with LAPACK's
    condition estimate ``dpocon``: if ``cond(M) < 1 / rcond^2`` the layer has full rank. Otherwise
    a pivoted Cholesky factorisation ``P^T M P = R^T R`` (LAPACK ``dpstrf``) stops at the first
    pivot below ``rcond^2 * max(diag M)``; the pivots taken are the rank, and solves return the
    minimum-norm solution. ``rcond`` thus thresholds the singular values of ``A`` relative to
    its largest column norm.
    """

    def __init__(self, gram: Tensor, rcond: float) -> None:
        self.n = gram.shape[0]
        self.condition = math.inf
        lower, info = torch.linalg.cholesky_ex(gram)
        if int(info) == 0:
            anorm = float(gram.abs().sum(0).max())
            reciprocal, _ = scipy.linalg.lapack.dpocon(lower.numpy(), anorm, uplo="L")
            self.condition = 1 / reciprocal if reciprocal > 0 else math.inf
        if self.condition * rcond**2 < 1:
            self.lower, self.rank = lower, self.n
        else:
            self.lower = None
            self._pivoted(gram.numpy(), rcond)

    def _pivoted(self, matrix: np.ndarray, rcond: float) -> None:
        tol = rcond**2 * float(np.max(np.diag(matrix)))
        factor, piv, rank, info = scipy.linalg.lapack.dpstrf(matrix, tol=tol, lower=0)
        if info < 0:
            raise RuntimeError(f"LAPACK dpstrf failed with info={info}")
        self.rank, self.piv = int(rank), piv - 1
        self.factor = np.triu(factor[: self.rank])  # rows past the rank hold an unfactored remainder
        if self.rank < self.n:
            self.q, self.t = np.linalg.qr(self.factor.T)

    def solve(self, rhs: Tensor) -> Tensor:
        """``M^+ rhs`` (exact inverse at full rank, minimum norm otherwise)."""
        if self.lower is not None:
            return torch.cholesky_solve(rhs.unsqueeze(1), self.lower).squeeze(1)
        if self.rank == 0:
            return torch.zeros_like(rhs)
        # With y = P^T x: R^T (R y) = P^T rhs gives w = R y from the leading rank x rank block;
        # the minimum-norm y with R y = w is Q T^{-T} w for the QR factorisation R^T = Q T.
        c = rhs.numpy()[self.piv]
        lead = self.factor[:, : self.rank]
        w = scipy.linalg.solve_triangular(lead, c[: self.rank], trans="T")
        if self.rank == self.n:
            y = scipy.linalg.solve_triangular(lead, w)
        else:
            y = self.q @ scipy.linalg.solve_triangular(self.t, w, trans="T")
        x = np.empty_like(y)
        x[self.piv] = y
        return torch.from_numpy(x)


def solve_layer(system: LayerSystem, rcond: float, refinements: int) -> tuple[Tensor, dict[str, Any]]:
    """Least-squares ``x`` of the stacked system via corrected semi-normal equations."""
    solver = GramSolver(system.gram(), rcond)
    x = torch.zeros(system.n, dtype=_DTYPE)
    for _ in range(1 + refinements):
        forward, gradient = system.apply(x)
        # A^T (b - A x) computed from A itself (not from A^T A), then a solve with A^T A
        x = x + solver.solve(system.adjoint(system.pre - forward, system.weight_grad - gradient))
    info = {
        "unknowns": system.n,
        "equations": system.equations,
        "rank": solver.rank,
        "deficiency": system.n - solver.rank,
        # LAPACK's estimate of cond(A) = sqrt(cond(A^T A)); None where the pivoted path ran
        "condition": math.sqrt(solver.condition) if math.isfinite(solver.condition) else None,
    }
    return x, info


# --------------------------------------------------------------------------------------------
# The attack
# --------------------------------------------------------------------------------------------


@register_attack("R-GAP", order=4, build=lambda budget, seed, model: RGAP(seed=seed))  # the published attack
class RGAP(GradientAttack):
    """R-GAP (Zhu & Blaschko, ICLR 2021): analytic recursive inversion of one image's gradient.

    Args:
        rcond: relative singular-value threshold below which a layer's stacked system is
            treated as rank-deficient (its minimum-norm solution is returned then).
        refinements: iterative-refinement steps per layer after the first solve.
        seed, device, progress_every: see :class:`GradientAttack` (the attack is deterministic).

    ``meta`` of the result: ``label`` (how the label was obtained), ``last_layer`` (method,
    scale, residual, ``rank_one_ratio``), and per conv/linear layer below the classifier,
    top-down, ``rank_deficiency`` (unknowns, equations, numerical rank, deficiency = unknowns -
    rank, LAPACK's estimate of the condition number) and ``residuals`` (relative forward and
    gradient residuals: ~1e-7 for an undefended float32 gradient, large once a defense makes the
    system inconsistent).
    """

    def __init__(self, *, rcond: float = 1e-6, refinements: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0 < rcond < 1:
            raise ValueError(f"rcond must be in (0, 1), got {rcond}")
        if refinements < 0:
            raise ValueError(f"refinements must be >= 0, got {refinements}")
        self.rcond = rcond
        self.refinements = refinements

    def reconstruct(self, view: ServerView) -> Reconstruction:
        if view.batch_size != 1:
            raise AttackNotApplicable(
                f"R-GAP inverts the gradient of one image, the view has batch_size {view.batch_size}"
            )
        view, _ = self._prepare(view)
        chain = layer_chain(view.model, view.input_shape, view.num_classes)
        grads = self._weight_gradients(view, chain)
        label, label_source = self._label(view)
        target, scale = loss_target(view.loss_fn, label, view.num_classes)

        head = chain[-1]
        bias_grad = self._gradient(view, head.parameter("bias")) if head.module.bias is not None else None
        x, g, last_meta = final_layer_input(head, grads[head.name], bias_grad, target, scale)
        # gradient w.r.t. the classifier's input = output of the layer below
        upstream = head.module.weight.detach().to(_DTYPE).cpu().T @ g

        ranks, residuals = [], []
        for index, layer in enumerate(reversed(chain[:-1])):
            x, upstream, info, residual = self._invert_layer(layer, x, upstream, grads[layer.name])
            ranks.append({"layer": layer.name, **info})
            residuals.append({"layer": layer.name, **residual})
            self._report(index, len(chain) - 1, residual["forward"] + residual["gradient"])

        image = x.reshape(1, *view.input_shape).to(device=view.device, dtype=next(view.model.parameters()).dtype)
        meta = {"label": label_source, "last_layer": last_meta, "rank_deficiency": ranks, "residuals": residuals}
        return Reconstruction(
            images=image,
            labels=torch.tensor([label], dtype=torch.int64, device=view.device),
            loss_trace=[],
            attack="RGAP",
            meta=meta,
        )

    def _invert_layer(
        self, layer: ChainLayer, out: Tensor, out_grad: Tensor, weight_grad: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Any], dict[str, float]]:
        """From this layer's output and that output's gradient to its input and the input's gradient."""
        pre = invert_activation(layer.activation, out)
        g = activation_derivative(layer.activation, pre, out) * out_grad  # dL/dz_i
        weight = layer.module.weight.detach().to(_DTYPE).cpu()
        channels = weight.shape[0]
        system = LayerSystem(
            weight=weight.reshape(channels, -1),
            pre=pre.reshape(channels, -1),
            g=g.reshape(channels, -1),
            weight_grad=weight_grad.reshape(channels, -1),
            idx=patch_indices(layer),
            n=math.prod(layer.in_shape),
        )
        x, info = solve_layer(system, self.rcond, self.refinements)
        # dL/dx_i = W_i^T dL/dz_i: the layer's backward pass (padding entries dropped)
        in_grad = scatter_patches(system.weight.T @ system.g, system.idx, system.n)
        return x, in_grad, info, system.residuals(x)

    @staticmethod
    def _gradient(view: ServerView, name: str) -> Tensor:
        """A shared gradient as float64 on the CPU; missing ones are an error (not a defense)."""
        if name not in view.gradients or view.gradients[name] is None:
            raise AttackNotApplicable(f"R-GAP needs the gradient of {name!r}, the shared gradient has none")
        return view.gradients[name].detach().to(device="cpu", dtype=_DTYPE)

    def _weight_gradients(self, view: ServerView, chain: list[ChainLayer]) -> dict[str, Tensor]:
        return {layer.name: self._gradient(view, layer.parameter("weight")) for layer in chain}

    @staticmethod
    def _label(view: ServerView) -> tuple[int, str]:
        if view.labels is not None:
            return int(view.labels[0]), "given"
        return int(recover_labels(view)[0]), "recovered"
