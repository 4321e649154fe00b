"""Gradient checks shared by every defense (errors name the argument).

Number and choice checks are :mod:`lightning_gp.validation`'s; they are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_gp.validation import check_choice, check_nonnegative, check_positive_int, check_rate

__all__ = [
    "NONFINITE_POLICIES",
    "NonFiniteGradientError",
    "check_choice",
    "check_client_id",
    "check_gradients",
    "check_nonnegative",
    "check_positive_int",
    "check_rate",
    "layer_norms",
    "nonfinite_layers",
    "whole_norm",
]

NONFINITE_POLICIES = ("error", "zero")


class NonFiniteGradientError(ValueError):
    """A gradient holds NaN or inf and the defense's ``nonfinite`` policy is ``"error"``."""


def check_client_id(client_id: int, num_clients: int | None) -> int:
    """A client id is a non-negative int, below ``num_clients`` once the run declared that number."""
    if isinstance(client_id, Tensor) and client_id.numel() == 1:
        client_id = int(client_id.item())
    if isinstance(client_id, bool) or not isinstance(client_id, int):
        raise TypeError(f"client_id must be an int, got {type(client_id).__name__} {client_id!r}")
    if client_id < 0:
        raise ValueError(f"client_id must be >= 0, got {client_id}")
    if num_clients is not None and client_id >= num_clients:
        raise KeyError(f"unknown client_id {client_id}: this run has {num_clients} clients (ids 0..{num_clients - 1})")
    return client_id


def check_gradients(gradients: Mapping[str, Tensor]) -> None:
    """Named per-layer gradients: a non-empty mapping of str to dense floating tensors."""
    if not isinstance(gradients, Mapping):
        raise TypeError(f"gradients must be a mapping of parameter name to tensor, got {type(gradients).__name__}")
    if len(gradients) == 0:
        raise ValueError("gradients is empty: the defense needs at least one named layer gradient")
    for name, grad in gradients.items():
        if not isinstance(name, str):
            raise TypeError(f"gradients keys must be parameter names (str), got {name!r}")
        if not isinstance(grad, Tensor):
            raise TypeError(f"gradients[{name!r}] must be a torch.Tensor, got {type(grad).__name__}")
        if grad.layout != torch.strided:
            raise ValueError(f"gradients[{name!r}] is a {grad.layout} tensor; only dense gradients are supported")
        if not grad.is_floating_point():
            raise TypeError(f"gradients[{name!r}] must be a floating-point tensor, got dtype {grad.dtype}")
        if grad.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"gradients[{name!r}] requires grad (it is part of an autograd graph, e.g. from "
                "torch.autograd.grad(..., create_graph=True)): a defense rewrites the gradient a client shares, "
                "pass it detached (g.detach())"
            )


def nonfinite_layers(gradients: Mapping[str, Tensor], norms: Tensor | None = None) -> list[str]:
    """Names of the layers holding NaN or inf (one device sync for the whole model).

    ``norms``: the layers' stacked L2 norms (:func:`layer_norms`) where the caller has them already.
    """
    names = list(gradients)
    # A finite norm means every entry is finite (NaN and inf propagate through it); one fused pass
    # over the layers, and only layers whose norm is not finite (or overflowed) get the exact check.
    sums_finite = (layer_norms(gradients) if norms is None else norms).isfinite().tolist()
    suspects = [n for n, ok in zip(names, sums_finite) if not ok]
    return [n for n in suspects if not bool(gradients[n].isfinite().all())]


def layer_norms(gradients: Mapping[str, Tensor]) -> Tensor:
    """The L2 norm of every layer, in one fused pass (``torch._foreach_norm``, in each layer's dtype, in
    float32 where a layer is 16-bit: a float16 norm overflows past 65504), stacked on the first layer's
    device."""
    values = list(gradients.values())
    low_precision = any(v.dtype.itemsize < 4 for v in values)
    with torch.no_grad():
        norms = torch._foreach_norm(values, 2, dtype=torch.float32) if low_precision else torch._foreach_norm(values)
    try:
        return torch.stack(norms)
    except RuntimeError:  # layers on several devices
        device = norms[0].device
        return torch.stack([s.to(device) for s in norms])


def whole_norm(norms: Tensor) -> float:
    """The L2 norm of a whole update from its :func:`layer_norms`, combined in float64."""
    return float(norms.double().norm())
