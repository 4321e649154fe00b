"""The L2 clip of a whole update, every layer together (McMahan et al. 2018, DP-FedAvg, Alg. 1 ``ClipFn``),
and DP-SGD's per-example clip, sum and noise (:func:`dp_sgd_gradient`, Abadi et al. 2016, Alg. 1).

One implementation serves the client-side mechanism (:class:`~lightning_gp.defenses.LocalGaussianMechanism`),
the server side of DP-FedAvg (:class:`~lightning_gp.federated.ClientLevelDP`) and the adaptive attacks
that model either (:func:`~lightning_gp.attacks.adaptive.update_clip`): it is differentiable, so an
attacker's dummy gradient can be clipped exactly as the client clipped its own.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_gp.defenses.validation import layer_norms, whole_norm
from lightning_gp.validation import check_nonnegative, check_positive


def squared_update_norm(update: Mapping[str, Tensor]) -> Tensor:
    """``||update||^2`` over every layer together, accumulated in float64 (differentiable)."""
    if not update:
        raise ValueError("update must hold at least one layer")
    return sum(u.double().pow(2).sum() for u in update.values())  # type: ignore[return-value]


def update_norm(update: Mapping[str, Tensor]) -> float:
    """The L2 norm of a whole update, every layer together: each layer's norm in one fused pass
    (:func:`~lightning_gp.defenses.validation.layer_norms`), combined in float64. Not differentiable (see
    :func:`squared_update_norm`); on a small model the fused pass is most of a defense's saving."""
    if not update:
        raise ValueError("update must hold at least one layer")
    return whole_norm(layer_norms(update))


def clip_update(update: Mapping[str, Tensor], max_update_norm: float) -> dict[str, Tensor]:
    """``update * min(1, C / ||update||)``: the whole update (all layers) scaled onto the L2 ball of
    radius ``C = max_update_norm`` (McMahan et al. 2018, Alg. 1, ``ClipFn``); an update inside it is
    returned unchanged (the same tensors). Differentiable in ``update`` (the norm included)."""
    check_positive(max_update_norm, "max_update_norm")
    norm = squared_update_norm(update).sqrt()
    if bool(norm <= max_update_norm):
        return dict(update)
    factor = max_update_norm / norm
    return {name: u * factor.to(u.dtype) for name, u in update.items()}


def clipped_example_sum(per_example: Mapping[str, Tensor], max_grad_norm: float) -> dict[str, Tensor]:
    """``sum_i g_i * min(1, C / (||g_i|| + 1e-6))``: DP-SGD's per-example clip (each example's gradient,
    every layer together, as Opacus's ``DPOptimizer`` scales it) and sum. No input checks (see
    :func:`dp_sgd_gradient`): differentiable, and a non-finite example stays non-finite, for an attack
    that models DP-SGD on its dummy batch.

    Args:
        per_example: ``{name: [B, *param.shape]}``, the gradient of each example's own loss.
    """
    batch = int(next(iter(per_example.values())).shape[0])
    squares = torch.stack([g.reshape(batch, -1).double().pow(2).sum(1) for g in per_example.values()]).sum(0)
    # 1e-24 under the root keeps the backward pass finite for an all-zero example (d sqrt(x) / dx at 0)
    norms = squares.add(1e-24).sqrt()
    factor = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return {name: (g * factor.to(g.dtype).view(-1, *([1] * (g.ndim - 1)))).sum(0) for name, g in per_example.items()}


def dp_sgd_gradient(
    per_example: Mapping[str, Tensor],
    max_grad_norm: float,
    noise_multiplier: float,
    *,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """One DP-SGD step's gradient from a batch's per-example gradients (Abadi et al. 2016, Alg. 1;
    as Opacus's ``DPOptimizer`` computes it): the clipped sum (:func:`clipped_example_sum`, bound
    ``C = max_grad_norm``), Gaussian noise of std ``noise_multiplier * C`` per coordinate, divided by
    the batch size.

    Args:
        per_example: ``{name: [B, *param.shape]}``, the gradient of each example's own loss.
    """
    check_positive(max_grad_norm, "max_grad_norm")
    check_nonnegative(noise_multiplier, "noise_multiplier")
    if not per_example:
        raise ValueError("per_example must hold at least one layer")
    sizes = {int(g.shape[0]) for g in per_example.values()}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"per_example must hold one non-empty batch of examples per layer, got sizes {sorted(sizes)}")
    batch = sizes.pop()
    finite = torch.stack([torch.isfinite(g.reshape(batch, -1)).all(1) for g in per_example.values()]).all(0)
    if not bool(finite.all()):
        raise ValueError(
            f"per_example holds non-finite gradients (examples {torch.nonzero(~finite).flatten().tolist()})"
        )
    shared = {}
    for name, summed in clipped_example_sum(per_example, max_grad_norm).items():
        if noise_multiplier > 0:
            noise = torch.randn(summed.shape, generator=generator, dtype=summed.dtype, device=summed.device)
            summed = summed + noise * (noise_multiplier * max_grad_norm)
        shared[name] = summed / batch
    return shared
