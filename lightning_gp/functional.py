"""A module's loss as a function of its parameters (``torch.func.functional_call``).

Shared by the per-client gradients of the federated simulation and the input-sensitivity
estimate of the optimal defenses; torch only.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm

LossFn = Callable[[Tensor, Tensor], Tensor]


def updates_running_stats(module: nn.Module) -> bool:
    """True when a forward pass in training mode would update BatchNorm running statistics."""
    return any(isinstance(m, _BatchNorm) and m.track_running_stats and m.training for m in module.modules())


def set_batchnorm_mode(module: nn.Module, mode: str) -> nn.Module:
    """Put every BatchNorm layer of ``module`` in ``mode`` (``"train"``: batch statistics; ``"eval"``: the
    running statistics), the rest of the module as it is; returns ``module``."""
    if mode not in ("train", "eval"):
        raise ValueError(f"batchnorm mode must be 'train' or 'eval', got {mode!r}")
    for m in module.modules():
        if isinstance(m, _BatchNorm):
            m.train(mode == "train")
    return module


def batchnorm_mode(module: nn.Module) -> str | None:
    """The mode ``module``'s BatchNorm layers are in: ``"train"`` if any is in training mode, else
    ``"eval"``; ``None`` without BatchNorm."""
    norms = [m for m in module.modules() if isinstance(m, _BatchNorm)]
    if not norms:
        return None
    return "train" if any(m.training for m in norms) else "eval"


def trainable_parameters(module: nn.Module) -> dict[str, Tensor]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def frozen_state(module: nn.Module) -> dict[str, Tensor]:
    """The frozen parameters (detached) and the buffers: what ``functional_call`` holds fixed."""
    frozen = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
    frozen.update(dict(module.named_buffers()))
    return frozen


def functional_loss(module: nn.Module, loss_fn: LossFn, frozen: dict[str, Tensor]) -> Callable[..., Tensor]:
    """``loss(params, x, y)``: ``loss_fn(module(x), y)`` with ``params`` in place of the trainable weights."""

    def loss(params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return loss_fn(functional_call(module, {**frozen, **params}, (x,)), y)

    return loss
