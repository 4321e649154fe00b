"""Pieces shared by optimization attacks: the gradient of a guess, distances, image priors."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap


def parameter_gradients(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inputs: Tensor,
    targets: Tensor,
    *,
    create_graph: bool = True,
) -> dict[str, Tensor]:
    """Gradient of ``loss_fn(model(inputs), targets)`` w.r.t. the trainable parameters.

    ``targets`` may be class indices or per-class probabilities (soft labels, as DLG optimizes).
    The model's buffers are cloned, so evaluating a guess in training mode never changes the
    model's BatchNorm running statistics. With ``create_graph`` the result is differentiable
    w.r.t. ``inputs`` (and soft ``targets``), which is what gradient matching optimizes.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    outputs = functional_call(model, {**params, **buffers}, (inputs,))
    loss = loss_fn(outputs, targets)
    grads = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph)
    return dict(zip(params, grads))


def functional_parameter_gradients(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inputs: Tensor,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    targets: Tensor,
) -> dict[str, Tensor]:
    """:func:`parameter_gradients` at the weights ``params`` and ``buffers``, through
    :func:`torch.func.grad`, so that it maps (:func:`torch.func.vmap`) over problems or examples;
    differentiable for autograd outside the map."""

    def training_loss(weights: Mapping[str, Tensor], own_buffers: Mapping[str, Tensor]) -> Tensor:
        return loss_fn(functional_call(model, {**weights, **own_buffers}, (inputs,)), targets)

    # fresh buffer copies, passed in (grad refuses in-place updates of captured tensors)
    return grad(training_loss)(dict(params), {n: b.clone() for n, b in buffers.items()})


def vmapped_example_gradients(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inputs: Tensor,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    targets: Tensor,
) -> dict[str, Tensor]:
    """``{name: [B, *param.shape]}``: each example of ``inputs`` alone through
    :func:`functional_parameter_gradients`, in one vmapped pass."""
    return vmap(lambda x, y: functional_parameter_gradients(model, loss_fn, x[None], params, buffers, y[None]))(
        inputs, targets
    )


def per_example_gradients(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inputs: Tensor,
    targets: Tensor,
    *,
    vectorize: bool = True,
) -> dict[str, Tensor]:
    """``{name: [B, *param.shape]}``: each example's own :func:`parameter_gradients` (differentiable
    w.r.t. ``inputs``), as DP-SGD clips them. One vmapped pass over the examples
    (:func:`vmapped_example_gradients`); one example at a time without ``vectorize``, or where the model
    does not map (a forward pass that reads a value out of a tensor, or BatchNorm updating its running
    statistics in place). A batch of one is its own gradient (the map's overhead would cost more than
    it saves).
    """
    if vectorize and inputs.shape[0] > 1:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        try:
            return vmapped_example_gradients(model, loss_fn, inputs, params, dict(model.named_buffers()), targets)
        except RuntimeError:  # not mappable: the loop below gives the same values (or the real error)
            pass
    examples = [parameter_gradients(model, loss_fn, x[None], y[None]) for x, y in zip(inputs, targets)]
    return {n: torch.stack([g[n] for g in examples]) for n in examples[0]}


def squared_l2_distance(
    guess: Mapping[str, Tensor], shared: Mapping[str, Tensor], names: Sequence[str] | None = None
) -> Tensor:
    """``sum_layers ||guess - shared||^2`` (DLG, Zhu et al. 2019, Eq. 4)."""
    names = list(shared) if names is None else names
    return _total([((guess[n] - shared[n]) ** 2).sum() for n in names])


def cosine_distance(
    guess: Mapping[str, Tensor], shared: Mapping[str, Tensor], names: Sequence[str] | None = None
) -> Tensor:
    """``1 - <guess, shared> / (||guess|| ||shared||)`` over all layers together
    (Inverting Gradients, Geiping et al. 2020, Eq. 4)."""
    names = list(shared) if names is None else names
    dot = _total([(guess[n] * shared[n]).sum() for n in names])
    guess_norm = _total([guess[n].pow(2).sum() for n in names]).sqrt()
    shared_norm = _total([shared[n].pow(2).sum() for n in names]).sqrt()
    return 1 - dot / (guess_norm * shared_norm).clamp_min(1e-12)


def total_variation(images: Tensor, *, reduction: str = "mean", smoothing: float = 0.0) -> Tensor:
    """Anisotropic total variation: the absolute differences of horizontally and vertically
    neighbouring pixels (the TV prior of Inverting Gradients).

    ``reduction="mean"`` (Inverting Gradients' weight convention): the mean horizontal plus the mean
    vertical difference; ``"sum"``: their sum over every pair, i.e. ``-log p(x)`` up to the scale of a
    Laplace prior on each difference (Balunovic et al., ICLR 2022, Sec. 5). ``smoothing = delta > 0``
    replaces ``|d|`` by ``sqrt(d^2 + delta^2) - delta`` (pseudo-Huber: within ``delta`` of ``|d|``,
    differentiable at 0, for L-BFGS).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not smoothing >= 0:
        raise ValueError(f"smoothing must be >= 0, got {smoothing!r}")
    dx = _absolute(images[..., :, 1:] - images[..., :, :-1], smoothing)
    dy = _absolute(images[..., 1:, :] - images[..., :-1, :], smoothing)
    return dx.mean() + dy.mean() if reduction == "mean" else dx.sum() + dy.sum()


def _absolute(values: Tensor, smoothing: float | Tensor) -> Tensor:
    """``|values|``, or its pseudo-Huber smoothing ``sqrt(values^2 + delta^2) - delta`` for ``delta > 0``."""
    if isinstance(smoothing, Tensor) or smoothing > 0:
        return torch.sqrt(values * values + smoothing * smoothing) - smoothing
    return values.abs()


def gaussian_nll(
    guess: Mapping[str, Tensor],
    shared: Mapping[str, Tensor],
    std: Mapping[str, float | Tensor],
    names: Sequence[str] | None = None,
) -> Tensor:
    """``sum_i (shared_i - guess_i)^2 / (2 std_i^2)``: the negative log-likelihood of the shared
    gradient under Gaussian noise ``N(0, std_i^2)`` around ``guess`` (up to a constant; Balunovic et
    al., ICLR 2022, Sec. 4). ``std[name]`` is a number or a tensor of the layer's shape."""
    names = list(shared) if names is None else names
    return _total([((guess[n] - shared[n]) / std[n]).pow(2).sum() / 2 for n in names])


def laplace_nll(
    guess: Mapping[str, Tensor],
    shared: Mapping[str, Tensor],
    scale: Mapping[str, float | Tensor],
    names: Sequence[str] | None = None,
    *,
    smoothing: float = 0.0,
) -> Tensor:
    """``sum_i |shared_i - guess_i| / b_i``: the negative log-likelihood under Laplace noise of scale
    ``b_i`` (density ``exp(-|z| / b) / 2b``), up to a constant. ``smoothing = s > 0`` replaces
    ``|r|`` by its pseudo-Huber ``sqrt(r^2 + (s b)^2) - s b`` (within ``s b`` of ``|r|``, smooth for L-BFGS)."""
    if not smoothing >= 0:
        raise ValueError(f"smoothing must be >= 0, got {smoothing!r}")
    names = list(shared) if names is None else names
    return _total(
        [
            (_absolute(guess[n] - shared[n], smoothing * scale[n] if smoothing > 0 else 0.0) / scale[n]).sum()
            for n in names
        ]
    )


def _total(terms: list[Tensor]) -> Tensor:
    """The sum of per-layer terms, added left to right (as ``sum`` would, without its int start)."""
    if not terms:
        raise ValueError("no layers to compare: names is empty")
    return functools.reduce(operator.add, terms)
