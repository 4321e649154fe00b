"""Pieces shared by optimization attacks: the gradient of a guess, distances, image priors."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call


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


def total_variation(images: Tensor) -> Tensor:
    """Mean absolute difference of neighbouring pixels (the TV prior of Inverting Gradients)."""
    dx = (images[..., :, 1:] - images[..., :, :-1]).abs().mean()
    dy = (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
    return dx + dy


def _total(terms: list[Tensor]) -> Tensor:
    """The sum of per-layer terms, added left to right (as ``sum`` would, without its int start)."""
    if not terms:
        raise ValueError("no layers to compare: names is empty")
    return functools.reduce(operator.add, terms)
