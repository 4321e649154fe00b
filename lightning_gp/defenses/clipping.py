"""The L2 clip of a whole update, every layer together (McMahan et al. 2018, DP-FedAvg, Alg. 1 ``ClipFn``).

One implementation serves the client-side mechanism (:class:`~lightning_gp.defenses.LocalGaussianMechanism`),
the server side of DP-FedAvg (:class:`~lightning_gp.federated.ClientLevelDP`) and the adaptive attacks
that model either (:func:`~lightning_gp.attacks.adaptive.update_clip`): it is differentiable, so an
attacker's dummy gradient can be clipped exactly as the client clipped its own.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from lightning_gp.defenses.validation import layer_norms, whole_norm
from lightning_gp.validation import check_positive


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
