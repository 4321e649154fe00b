"""Book-keeping DP-SGD: every example's gradient norm and the clipped gradient sum from one backward pass.

Bu, Wang, Zha and Karypis, "Differentially Private Optimization on Large Model at Small Cost",
ICML 2023 (book-keeping, BK). Forward hooks keep each trainable layer's input ``a`` and the autograd
edge of its output; one backward pass computes only the output gradients ``g`` (no parameter
gradients). Then, per layer, each example's squared gradient norm is read off ``a`` and ``g`` (their
Algorithm 1: the ghost norm or the instantiated per-example gradient, whichever is cheaper,
:mod:`lightning_gp.dp_sgd.conv_norm`), the norms summed over layers give each example's norm
``||G_i||``, and the clipped sum is formed directly from the clip-scaled output gradient (their eq. 4):
``sum_i c_i g_i^T a_i = (c * g)^T a`` for ``nn.Linear``, the weight gradient of a convolution fed
``c * g`` for ``nn.Conv2d``. Any other layer Opacus has a per-example gradient sampler for
(``GroupNorm``, ``LayerNorm``, ``Embedding``, ...) has its per-example gradients instantiated by that
sampler and summed with the weights ``c_i``.

The clip factors are Opacus' (``DPOptimizer.clip_and_accumulate``):
``c_i = min(1, max_grad_norm / (||G_i|| + 1e-6))``. With ``loss_reduction="mean"`` the loss is taken to
be the mean over the ``n`` examples of the batch, so the per-example gradient is ``n`` times the
example's share of the batch gradient, as Opacus' ``GradSampleModule`` rescales it. The result,
written into ``p.grad``, is ``sum_i c_i grad l_i``: what ``DPOptimizer`` forms before its noise and its
division by the expected batch size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from opacus.grad_sample import GradSampleModule
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn.grad import conv2d_weight
from torch.utils.hooks import RemovableHandle

from lightning_gp.dp_sgd.conv_norm import (
    NORM_METHODS,
    NormMethod,
    conv2d_norms_and_grads,
    ghost_is_cheaper,
    padded_input,
    patch_gram_norms,
    squared_norms,
    weighted_sum,
)

LOSS_REDUCTIONS = ("mean", "sum")
CLIP_EPSILON = 1e-6  # Opacus' DPOptimizer: max_grad_norm / (norm + 1e-6)
_FAST = (nn.Linear, nn.Conv2d)


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def is_supported(module: nn.Module) -> bool:
    """Whether book-keeping handles the layer: ``nn.Linear``, ``nn.Conv2d`` or a type Opacus has a
    per-example gradient sampler for (exact types, as Opacus looks them up)."""
    return type(module) in _FAST or type(module) in GradSampleModule.GRAD_SAMPLERS


def unsupported_layers(module: nn.Module) -> list[str]:
    """``"name (Type)"`` of every module owning trainable parameters that book-keeping cannot handle."""
    return [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in module.named_modules()
        if _trainable(m) and not is_supported(m)
    ]


def trainable_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules owning trainable parameters, in ``named_modules`` order; a ``ValueError`` names any
    layer book-keeping cannot handle and any parameter two layers share."""
    bad = unsupported_layers(module)
    if bad:
        raise ValueError(
            f"book-keeping DP-SGD computes per-example gradients of nn.Linear, nn.Conv2d and the layers Opacus "
            f"has grad samplers for; these layers own trainable parameters it cannot handle: {', '.join(bad)}. "
            "Use grad_sample_mode='hooks' (Opacus, functorch for other layers) or freeze them"
        )
    layers = [(name, m) for name, m in module.named_modules() if _trainable(m)]
    owner: dict[int, str] = {}
    for name, m in layers:
        for p in _trainable(m):
            if id(p) in owner:
                raise ValueError(
                    f"book-keeping DP-SGD does not support a parameter shared by two layers ({owner[id(p)]} and "
                    f"{name}); use grad_sample_mode='hooks'"
                )
            owner[id(p)] = name
    return layers


@dataclass
class _Call:
    """One forward call of a layer: its inputs (detached) and the autograd edge of its output."""

    inputs: list[torch.Tensor]
    edge: GradientEdge
    shape: torch.Size
    dtype: torch.dtype


@dataclass
class _LayerStep:
    """A layer's part of one step: its calls, their output gradients (batch first) and, where they
    were instantiated, its per-example gradients."""

    module: nn.Module
    calls: list[_Call]
    grads: list[torch.Tensor]
    per_example: dict[torch.Tensor, torch.Tensor] | None = None
    scale: float = 1.0  # the true per-example gradients are ``per_example`` times this


def _linear_norms_and_grads(
    layer: nn.Linear, a: torch.Tensor, g: torch.Tensor, method: NormMethod
) -> tuple[dict[torch.Tensor, torch.Tensor], dict[torch.Tensor, torch.Tensor]]:
    """Per-example squared norms for ``nn.Linear`` and the per-example gradients formed on the way:
    ``||g_i||^2 ||a_i||^2`` for one position per example; for a sequence ``(n, T, d)`` the ghost norm
    or the instantiated ``g_i^T a_i``, the cheaper (mixed)."""
    n = a.shape[0]
    norms: dict[torch.Tensor, torch.Tensor] = {}
    grads: dict[torch.Tensor, torch.Tensor] = {}
    a = a.to(g.dtype)
    if a.dim() == 2:
        g2 = g.square().sum(dim=1)
        if layer.weight.requires_grad:
            norms[layer.weight] = g2 * a.square().sum(dim=1)
        if layer.bias is not None and layer.bias.requires_grad:
            norms[layer.bias] = g2
        return norms, grads
    a3, g3 = a.reshape(n, -1, a.shape[-1]), g.reshape(n, -1, g.shape[-1])
    if layer.weight.requires_grad:
        positions, d, p = a3.shape[1], a3.shape[2], g3.shape[2]
        if method == "ghost" or (method == "mixed" and ghost_is_cheaper(positions, d, p)):
            norms[layer.weight] = patch_gram_norms(a3.transpose(1, 2), g3.transpose(1, 2))
        else:
            grads[layer.weight] = torch.bmm(g3.transpose(1, 2), a3)  # (n, p, d)
            norms[layer.weight] = grads[layer.weight].square().sum(dim=(1, 2))
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = g3.sum(dim=1)
        norms[layer.bias] = grads[layer.bias].square().sum(dim=1)
    return norms, grads


def _linear_clipped_sum(layer: nn.Linear, a: torch.Tensor, weighted: torch.Tensor) -> dict[torch.Tensor, torch.Tensor]:
    """``sum_i c_i g_i^T a_i = (c * g)^T a`` (one matmul) and the bias' ``sum_i c_i sum_t g_i(t)``."""
    g2 = weighted.reshape(-1, weighted.shape[-1])
    out = {}
    if layer.weight.requires_grad:
        out[layer.weight] = g2.t() @ a.reshape(-1, a.shape[-1]).to(g2.dtype)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = g2.sum(dim=0)
    return out


def _conv2d_clipped_sum(layer: nn.Conv2d, x: torch.Tensor, weighted: torch.Tensor) -> dict[torch.Tensor, torch.Tensor]:
    """The convolution's weight gradient for the output gradient ``c * g`` (``sum_i c_i grad_W l_i``)."""
    out = {}
    if layer.weight.requires_grad:
        if x.shape[0] == 0:
            out[layer.weight] = torch.zeros_like(layer.weight)
        else:
            x, padding = padded_input(layer, x.to(weighted.dtype))
            out[layer.weight] = conv2d_weight(
                x, layer.weight.shape, weighted, layer.stride, padding, layer.dilation, layer.groups
            )
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = weighted.sum(dim=(0, 2, 3))
    return out


class BookKeeping:
    """Book-keeping clipping (Bu et al., ICML 2023) attached to ``module``: call :meth:`backward` on the
    loss instead of ``loss.backward()`` and every trainable parameter's ``.grad`` receives the clipped
    sum ``sum_i c_i grad l_i`` (added to what ``.grad`` holds, as autograd accumulates).

    Args:
        module: the model; every module owning trainable parameters must be supported
            (:func:`is_supported`), else a ``ValueError`` names it.
        max_grad_norm: the clipping bound ``C``.
        loss_reduction: ``"mean"`` (the loss is the batch mean: per-example gradients are ``n`` times
            each example's share) or ``"sum"``, as Opacus' ``loss_reduction``.
        norm_method: ``"mixed"`` (the cheaper of ghost norm and instantiation, per layer), ``"ghost"``
            or ``"instantiate"`` for every Linear/Conv2d layer.

    :meth:`detach` removes every hook and stored tensor. The norms of the last step are kept in
    :attr:`per_sample_norms` (not private: for tests and debugging only).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        max_grad_norm: float,
        loss_reduction: str = "mean",
        norm_method: NormMethod = "mixed",
    ) -> None:
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        if norm_method not in NORM_METHODS:
            raise ValueError(f"norm_method must be one of {NORM_METHODS}, got {norm_method!r}")
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
        self.max_grad_norm = float(max_grad_norm)
        self.loss_reduction = loss_reduction
        self.norm_method: NormMethod = norm_method
        self.layers = [m for _, m in trainable_layers(module)]
        self.per_sample_norms: torch.Tensor | None = None
        self._calls: dict[nn.Module, list[_Call]] = {}
        self._handles: list[RemovableHandle] = [m.register_forward_hook(self._capture) for m in self.layers]

    # ------------------------------------------------------------------ hooks

    def _capture(self, module: nn.Module, inputs: tuple, output: object) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if not isinstance(output, torch.Tensor) or output.grad_fn is None:
            return  # nothing to differentiate (e.g. every parameter frozen since the hook was added)
        kept = [t.detach() if isinstance(t, torch.Tensor) else t for t in inputs]
        call = _Call(kept, get_gradient_edge(output), output.shape, output.dtype)
        self._calls.setdefault(module, []).append(call)

    def reset(self) -> None:
        """Forget the forward calls recorded since the last :meth:`backward` (e.g. of a skipped step)."""
        self._calls = {}

    def detach(self) -> None:
        """Remove the hooks and everything recorded."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._calls = {}
        self.per_sample_norms = None

    # ------------------------------------------------------------------ the step

    def backward(self, loss: torch.Tensor) -> None:
        """One backward pass to the recorded layer outputs, then the clipped gradient sum into ``.grad``."""
        steps = self._output_gradients(loss)
        n = self._batch_size(steps)
        if n == 0:  # an empty Poisson batch: nothing to clip, the step adds noise only
            self.per_sample_norms = torch.zeros(0, device=loss.device)
            self._zero_missing_grads()
            return
        scale = float(n) if self.loss_reduction == "mean" else 1.0
        parts = [s for step in steps for s in self._squared_norms(step, scale).values()]
        dtype = functools.reduce(torch.promote_types, [s.dtype for s in parts], torch.float32)
        norms = sum((s.to(dtype) for s in parts), torch.zeros(n, device=loss.device, dtype=dtype)).clamp(min=0).sqrt()
        self.per_sample_norms = norms
        coefficients = (self.max_grad_norm / (norms + CLIP_EPSILON)).clamp(max=1.0)
        for step in steps:
            for p, g in self._clipped_sum(step, coefficients, scale).items():
                p.grad = g.to(p.dtype) if p.grad is None else p.grad + g.to(p.dtype)
        self._zero_missing_grads()

    def _zero_missing_grads(self) -> None:
        """Layers the loss did not use get a zero clipped sum (the optimizer still adds noise to it)."""
        for layer in self.layers:
            for p in _trainable(layer):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

    def _output_gradients(self, loss: torch.Tensor) -> list[_LayerStep]:
        calls, self._calls = self._calls, {}
        if not calls:
            raise RuntimeError(
                "book-keeping: no trainable layer ran forward (in training mode, with grad enabled) since the last "
                "backward; compute the loss from the model the hooks are attached to"
            )
        flat = [(m, c) for m, cs in calls.items() for c in cs]
        grads = torch.autograd.grad(loss, [c.edge for _, c in flat], allow_unused=True)
        steps: dict[nn.Module, _LayerStep] = {}
        for (m, call), g in zip(flat, grads):
            g = torch.zeros(call.shape, dtype=call.dtype, device=loss.device) if g is None else g
            steps.setdefault(m, _LayerStep(m, [], [])).calls.append(call)
            steps[m].grads.append(g)
        return list(steps.values())

    @staticmethod
    def _batch_size(steps: list[_LayerStep]) -> int:
        sizes = {g.shape[0] if g.dim() else 0 for step in steps for g in step.grads}
        if len(sizes) != 1:
            raise ValueError(
                f"book-keeping needs batch-first layer outputs of one batch size, got sizes {sorted(sizes)}"
            )
        return sizes.pop()

    def _squared_norms(self, step: _LayerStep, scale: float) -> dict[torch.Tensor, torch.Tensor]:
        """Per-example squared norms of the layer's parameters (of the true per-example gradients: the
        recorded output gradients times ``scale``); keeps what it instantiated in ``step.per_example``."""
        module, calls, grads = step.module, step.calls, step.grads
        if len(calls) == 1 and type(module) in _FAST:
            if type(module) is nn.Conv2d:
                assert isinstance(module, nn.Conv2d)
                norms, per_example = conv2d_norms_and_grads(module, calls[0].inputs[0], grads[0], self.norm_method)
            else:
                assert isinstance(module, nn.Linear)
                norms, per_example = _linear_norms_and_grads(module, calls[0].inputs[0], grads[0], self.norm_method)
            step.per_example, step.scale = per_example, scale  # the true gradients are these times scale
            return {p: s * scale**2 for p, s in norms.items()}
        step.per_example = _instantiate(module, calls, grads, scale)
        return {p: squared_norms(g) for p, g in step.per_example.items()}

    @staticmethod
    def _clipped_sum(step: _LayerStep, coefficients: torch.Tensor, scale: float) -> dict[torch.Tensor, torch.Tensor]:
        """``sum_i c_i grad_i`` for each of the layer's parameters: from the per-example gradients where
        they were instantiated, else from the clip-weighted output gradient (Bu et al. 2023, eq. 4)."""
        per_example = step.per_example or {}
        weights = coefficients * step.scale
        out = {p: weighted_sum(weights, g) for p, g in per_example.items()}
        module = step.module
        if all(p in out for p in _trainable(module)):
            return out
        x, g = step.calls[0].inputs[0], step.grads[0]
        weighted = g * (coefficients * scale).to(g.dtype).reshape(-1, *([1] * (g.dim() - 1)))
        if type(module) is nn.Conv2d:
            assert isinstance(module, nn.Conv2d)
            rest = _conv2d_clipped_sum(module, x, weighted)
        else:
            assert isinstance(module, nn.Linear)
            rest = _linear_clipped_sum(module, x, weighted)
        return {**rest, **out}


def _instantiate(
    module: nn.Module, calls: list[_Call], grads: list[torch.Tensor], scale: float
) -> dict[torch.Tensor, torch.Tensor]:
    """Per-example gradients by Opacus' grad sampler for the layer type, summed over the layer's calls."""
    sampler = GradSampleModule.GRAD_SAMPLERS[type(module)]
    total: dict[torch.Tensor, torch.Tensor] = {}
    for call, g in zip(calls, grads):
        for p, gs in sampler(module, call.inputs, g * scale).items():
            if p.requires_grad:
                total[p] = gs if p not in total else total[p] + gs
    return total
