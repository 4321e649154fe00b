"""How strongly each gradient coordinate depends on the client's data (the optimal defenses' s_i).

For one client batch ``x`` and the gradient ``g(x) = dL/dtheta``, the sensitivity of coordinate
``i`` is ``s_i = ||d g_i / d x||^2``. The full Jacobian ``dg/dx`` is ``d x n`` (thousands of
times the model for an image batch), so the estimate follows Lemma 1 and Algorithm 1 (steps 2-3)
of "Optimal Defenses Against Gradient Reconstruction Attacks": for Gaussian probes
``v_j ~ N(0, I)``, ``E[(J v)_i^2] = ||J_i||^2``, so ``s_i ~= mean_j (J v_j)_i^2``. Each ``J v_j``
is one forward-over-reverse product, ``torch.func.jvp`` of ``x -> torch.func.grad(L)(theta)``,
and the probes are batched with ``vmap`` in chunks to bound memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.func import grad, jacfwd, jvp, vmap
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_gp.functional import LossFn, frozen_state, functional_loss, trainable_parameters
from lightning_gp.validation import check_positive_int

__all__ = ["gradient_sensitivity"]


def gradient_sensitivity(
    module: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    *,
    num_probes: int = 10,
    chunk_size: int | None = None,
    generator: torch.Generator | None = None,
    exact: bool = False,
) -> dict[str, Tensor]:
    """Estimate ``s_i = ||d g_i / d x||^2`` for every trainable parameter coordinate of ``module``.

    Args:
        module: the model, in the mode (train/eval) the gradient was computed in. BatchNorm uses
            the batch statistics in training mode, but its running statistics are left untouched.
        loss_fn: ``loss_fn(module(inputs), targets)``, the loss whose gradient is shared.
        inputs: the client's batch; must be floating point (the loss is differentiated w.r.t. it).
        targets: the labels (held fixed).
        num_probes: Gaussian probes ``k`` (the paper uses 10); the relative error falls like ``1/sqrt(k)``.
        chunk_size: probes evaluated at once under ``vmap`` (``None``: all); lower it to save memory.
        generator: draws the probes (on the inputs' device).
        exact: compute the full Jacobian with ``jacfwd`` instead (tiny models only; for tests).

    Returns:
        ``{name: s}`` with ``s`` the shape of the parameter, non-negative.
    """
    if not isinstance(inputs, Tensor) or not isinstance(targets, Tensor):
        raise TypeError("inputs and targets must be tensors")
    if not inputs.is_floating_point():
        raise TypeError(
            f"the sensitivity differentiates the loss w.r.t. the input, but the inputs are {inputs.dtype}: models "
            "fed integer inputs (token ids into an embedding) have no such derivative. Use a defense that needs "
            "no sensitivity (GaussianNoise, MagnitudePruning, DualGradientPruning) for such models"
        )
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs and targets disagree on the batch size: {inputs.shape[0]} vs {targets.shape[0]}")
    check_positive_int(num_probes, "num_probes")
    if chunk_size is not None:
        check_positive_int(chunk_size, "chunk_size")

    params = {n: p.detach() for n, p in trainable_parameters(module).items()}
    if not params:
        raise ValueError("the module has no trainable parameters")
    inputs, targets = inputs.detach(), targets.detach()
    with _batch_statistics_without_updates(module):
        loss = functional_loss(module, loss_fn, frozen_state(module))

        def gradient_of(x: Tensor) -> dict[str, Tensor]:
            return grad(loss)(params, x, targets)

        if exact:
            jacobian = jacfwd(gradient_of, randomness="same")(inputs)
            return {n: jacobian[n].pow(2).flatten(params[n].dim()).sum(-1) for n in params}

        def directional(v: Tensor) -> dict[str, Tensor]:
            return jvp(gradient_of, (inputs,), (v,))[1]

        chunk = num_probes if chunk_size is None else min(chunk_size, num_probes)
        total = {n: torch.zeros_like(p) for n, p in params.items()}
        for start in range(0, num_probes, chunk):
            count = min(chunk, num_probes - start)
            probes = torch.randn((count, *inputs.shape), generator=generator, device=inputs.device, dtype=inputs.dtype)
            products = vmap(directional, randomness="same")(probes)
            for n in total:
                total[n] += products[n].pow(2).sum(0)
    return {n: s / num_probes for n, s in total.items()}


@contextlib.contextmanager
def _batch_statistics_without_updates(module: nn.Module) -> Iterator[None]:
    """BatchNorm in training mode normalizes with batch statistics; keep it from updating its running ones.

    ``vmap`` cannot update a shared buffer per probe, and a sensitivity estimate must not change
    the model, so tracking is switched off (the batch statistics are what the gradient used).
    """
    saved = []
    for m in module.modules():
        if isinstance(m, _BatchNorm) and m.training and m.track_running_stats:
            saved.append((m, m.running_mean, m.running_var, m.num_batches_tracked))
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None
    try:
        yield
    finally:
        for m, mean, var, tracked in saved:
            m.track_running_stats = True
            m.running_mean, m.running_var, m.num_batches_tracked = mean, var, tracked
