"""How strongly each gradient coordinate depends on the client's data (the optimal defenses' s_i).

For one client batch ``x`` and the gradient ``g(x) = dL/dtheta``, the sensitivity of coordinate
``i`` is ``s_i = ||d g_i / d x||^2``. The full Jacobian ``dg/dx`` is ``d x n`` (thousands of
times the model for an image batch), so the estimate follows Lemma 1 and Algorithm 1 (steps 2-3)
of "Optimal Defenses Against Gradient Reconstruction Attacks": for Gaussian probes
``v_j ~ N(0, I)``, ``E[(J v)_i^2] = ||J_i||^2``, so ``s_i ~= mean_j (J v_j)_i^2``.

Two estimators (``method``):

* ``"batch"`` (the paper's): each ``J v_j`` is one forward-over-reverse product over the whole
  batch, ``torch.func.jvp`` of ``x -> torch.func.grad(L)(theta)``, probes batched with ``vmap``.
  Per coordinate the estimate is exactly ``s_i chi2_k / k`` (relative variance ``2 / k``).
* ``"per_example"``: when ``L = mean_b l(x_b)`` and the model treats examples independently,
  ``g = mean_b g_b(x_b)`` and ``d g / d x_b = (1/B) d g_b / d x_b``, so
  ``s_i = (1/B^2) sum_b s_{b,i}`` with ``s_{b,i} = ||d g_{b,i} / d x_b||^2``. Each example gets its
  own ``k`` probes (``J_b v`` by reverse-over-forward: the gradient in ``theta`` of the loss's
  directional input derivative, vmapped over examples); the cross-example terms that make the
  batch estimate noisy vanish: ``Var = (2 / (k B^4)) sum_b s_{b,i}^2``, at most the batch
  estimator's ``2 s_i^2 / k`` and down to ``1/B`` of it when the examples contribute equally.
  With ``subset=m`` only ``m`` examples drawn uniformly without replacement are probed and the sum
  is scaled by ``B / m``, still unbiased, with variance
  ``(1 - m/B) sigma_i^2 / (m B^2) + (2 / (k m B^3)) sum_b s_{b,i}^2``, where ``sigma_i^2`` is the
  (``B - 1``)-normalised variance of ``s_{b,i}`` over the batch's examples (the first term is the
  sampling of examples, the second the probes).

Cost (ConvNet, batch 16, one CPU thread, in undefended steps): a batch probe costs about one step;
a per-example probe about two (per-example weight-gradient tangents: batched outer products and
grouped convolutions), so ``"per_example"`` pays off at few probes: ``k = 2`` per example has a
lower error than 10 batch probes at about half the time; with many probes ``"batch"`` is cheaper.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacfwd, jvp, vmap
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_gp.functional import LossFn, frozen_state, functional_loss, trainable_parameters
from lightning_gp.validation import check_choice, check_positive_int

__all__ = ["SENSITIVITY_METHODS", "gradient_sensitivity"]

SENSITIVITY_METHODS = ("batch", "per_example")


def gradient_sensitivity(
    module: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    *,
    probes: int = 10,
    chunk_size: int | None = None,
    generator: torch.Generator | None = None,
    exact: bool = False,
    method: str = "batch",
    subset: int | None = None,
) -> dict[str, Tensor]:
    """Estimate ``s_i = ||d g_i / d x||^2`` for every trainable parameter coordinate of ``module``.

    Args:
        module: the model, in the mode (train/eval) the gradient was computed in. BatchNorm uses
            the batch statistics in training mode, but its running statistics are left untouched.
        loss_fn: ``loss_fn(module(inputs), targets)``, the loss whose gradient is shared.
        inputs: the client's batch; must be floating point (the loss is differentiated w.r.t. it).
        targets: the labels (held fixed).
        probes: Gaussian probes ``k`` (the paper uses 10): for ``"batch"`` over the whole batch,
            for ``"per_example"`` per probed example. The relative error falls like ``1/sqrt(k)``.
        chunk_size: probes evaluated at once under ``vmap`` (``None``: all); lower it to save memory.
            With ``exact=True``: Jacobian columns at once.
        generator: draws the probes (and the subset) on the inputs' device.
        exact: compute the full Jacobian with ``jacfwd`` instead (tiny models only, for tests and
            error measurements; ``"per_example"`` takes one example's Jacobian at a time, which
            makes it feasible for small CNNs).
        method: ``"batch"`` (the paper's estimator) or ``"per_example"`` (see the module docstring).
            ``"per_example"`` needs ``loss_fn`` to average per-example losses (checked on the probed
            examples' logits) and a model that treats examples independently: BatchNorm in
            training mode mixes the batch and is refused; so must be any other batch-mixing layer
            (not detectable: the estimate would be silently wrong).
        subset: ``"per_example"`` only: probe this many examples (``1 <= subset <= batch size``),
            drawn without replacement, and rescale; unbiased, at a variance given in the module docstring.

    Returns:
        ``{name: s}`` with ``s`` the shape of the parameter, non-negative.
    """
    _check_tensors(inputs, targets)
    _check_options(module, probes, chunk_size, method, subset, inputs.shape[0])
    params = {n: p.detach() for n, p in trainable_parameters(module).items()}
    if not params:
        raise ValueError("the module has no trainable parameters")
    inputs, targets = inputs.detach(), targets.detach()
    with _batch_statistics_without_updates(module):
        if method == "per_example":
            return _per_example(module, loss_fn, params, inputs, targets, probes, chunk_size, generator, exact, subset)
        gradient_of = _batch_gradient(module, loss_fn, params, targets)
        if exact:
            return _batch_exact(gradient_of, params, inputs)
        total = _batch_probe_sums(gradient_of, params, inputs, probes, chunk_size, generator)
    return {n: s / probes for n, s in total.items()}


def _check_tensors(inputs: Tensor, targets: Tensor) -> None:
    """``inputs`` and ``targets`` are tensors of one batch, the inputs floating point."""
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


def _check_options(
    module: nn.Module, probes: int, chunk_size: int | None, method: str, subset: int | None, batch_size: int
) -> None:
    """The estimator's options are valid, and ``method='per_example'`` is sound for ``module``."""
    check_positive_int(probes, "probes")
    if chunk_size is not None:
        check_positive_int(chunk_size, "chunk_size")
    check_choice(method, "method", SENSITIVITY_METHODS)
    if subset is not None:
        if method != "per_example":
            raise ValueError(f"subset={subset!r} needs method='per_example' (the batch estimator probes all examples)")
        check_positive_int(subset, "subset")
        if subset > batch_size:
            raise ValueError(f"subset must be at most the batch size {batch_size}, got {subset}")
    if method == "per_example" and batch_mixing(module):
        raise ValueError(
            "method='per_example' splits the loss into per-example terms, but the module has BatchNorm in training "
            "mode, which normalises each example with the whole batch's statistics: the decomposition (and the "
            "estimate) would be wrong. Use method='batch', or put the BatchNorm layers in eval mode"
        )


def _batch_gradient(
    module: nn.Module, loss_fn: LossFn, params: dict[str, Tensor], targets: Tensor
) -> Callable[[Tensor], dict[str, Tensor]]:
    """``x -> dL/dtheta`` of the whole batch at ``params``, the targets held fixed."""
    loss = functional_loss(module, loss_fn, frozen_state(module))

    def gradient_of(x: Tensor) -> dict[str, Tensor]:
        return grad(loss)(params, x, targets)

    return gradient_of


def _batch_exact(
    gradient_of: Callable[[Tensor], dict[str, Tensor]], params: dict[str, Tensor], inputs: Tensor
) -> dict[str, Tensor]:
    """``||d g_i / d x||^2`` from the full Jacobian (``jacfwd``): tiny models only."""
    jacobian = jacfwd(gradient_of, randomness="same")(inputs)
    return {n: jacobian[n].pow(2).flatten(params[n].dim()).sum(-1) for n in params}


def _batch_probe_sums(
    gradient_of: Callable[[Tensor], dict[str, Tensor]],
    params: dict[str, Tensor],
    inputs: Tensor,
    probes: int,
    chunk_size: int | None,
    generator: torch.Generator | None,
) -> dict[str, Tensor]:
    """``sum_j (J v_j)_i^2`` over ``probes`` Gaussian probes of the whole batch, drawn chunk by chunk."""

    def directional(v: Tensor) -> dict[str, Tensor]:
        return jvp(gradient_of, (inputs,), (v,))[1]

    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for count in _chunks(probes, chunk_size):
        directions = torch.randn((count, *inputs.shape), generator=generator, device=inputs.device, dtype=inputs.dtype)
        products = vmap(directional, randomness="same")(directions)
        for n in total:
            total[n] += products[n].pow(2).sum(0)
    return total


def batch_mixing(module: nn.Module) -> bool:
    """True when a forward pass of ``module`` mixes the examples of a batch (BatchNorm in training mode)."""
    return any(isinstance(m, _BatchNorm) and m.training for m in module.modules())


def _chunks(total: int, chunk_size: int | None) -> list[int]:
    chunk = total if chunk_size is None else min(chunk_size, total)
    return [min(chunk, total - start) for start in range(0, total, chunk)]


_ExampleLoss = Callable[[dict[str, Tensor], Tensor, Tensor], tuple[Tensor, Tensor]]


def _per_example(
    module: nn.Module,
    loss_fn: LossFn,
    params: dict[str, Tensor],
    inputs: Tensor,
    targets: Tensor,
    probes: int,
    chunk_size: int | None,
    generator: torch.Generator | None,
    exact: bool,
    subset: int | None,
) -> dict[str, Tensor]:
    """``(1/B^2) sum_b ||d g_{b,i} / d x_b||^2``, probed (or exact) one example at a time."""
    batch_size = inputs.shape[0]
    if subset is not None and subset < batch_size:
        chosen = torch.randperm(batch_size, generator=generator, device=inputs.device)[:subset]
        inputs, targets = inputs[chosen], targets[chosen]
    probed = inputs.shape[0]
    example_loss = _example_loss(module, loss_fn)
    if exact:
        total = _per_example_jacobian_sums(example_loss, params, inputs, targets, chunk_size)
        # (B / m) (1 / B^2) sum over the m examples taken (all of them without a subset)
        return {n: s / (probed * batch_size) for n, s in total.items()}
    total = _per_example_probe_sums(example_loss, loss_fn, params, inputs, targets, probes, chunk_size, generator)
    # (B / m) (1 / B^2) sum over the m probed examples, each the mean over its k probes
    return {n: s / (probes * probed * batch_size) for n, s in total.items()}


def _example_loss(module: nn.Module, loss_fn: LossFn) -> _ExampleLoss:
    """``(params, x_b, y_b) -> (l_b, logits_b)``: one example's loss (and logits) as a batch of one."""
    frozen = frozen_state(module)

    def example_loss(p: dict[str, Tensor], x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        logits = functional_call(module, {**frozen, **p}, (x.unsqueeze(0),))
        return loss_fn(logits, y.unsqueeze(0)), logits.squeeze(0)

    return example_loss


def _per_example_jacobian_sums(
    example_loss: _ExampleLoss, params: dict[str, Tensor], inputs: Tensor, targets: Tensor, chunk_size: int | None
) -> dict[str, Tensor]:
    """``sum_b ||d g_{b,i} / d x_b||^2`` exactly: each example's Jacobian, ``chunk_size`` columns at once."""
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for x, y in zip(inputs, targets):

        def gradient_of(z: Tensor, y: Tensor = y) -> dict[str, Tensor]:
            return grad(example_loss, has_aux=True)(params, z, y)[0]

        columns = torch.eye(x.numel(), device=x.device, dtype=x.dtype).view(-1, *x.shape)
        for start in range(0, len(columns), chunk_size or len(columns)):
            basis = columns[start : start + (chunk_size or len(columns))]
            products = vmap(lambda v, x=x, f=gradient_of: jvp(f, (x,), (v,))[1], randomness="same")(basis)
            for n in total:
                total[n] += products[n].pow(2).sum(0)
    return total


def _per_example_probe_sums(
    example_loss: _ExampleLoss,
    loss_fn: LossFn,
    params: dict[str, Tensor],
    inputs: Tensor,
    targets: Tensor,
    probes: int,
    chunk_size: int | None,
    generator: torch.Generator | None,
) -> dict[str, Tensor]:
    """``sum_b sum_j (J_b v_{b,j})_i^2`` over ``probes`` Gaussian probes per example (checks the loss is a mean)."""

    def directional(p: dict[str, Tensor], x: Tensor, y: Tensor, v: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        # <d l_b / d x_b, v>: its gradient in theta is (d g_b / d x_b) v (reverse-over-forward)
        loss, tangent, logits = jvp(lambda z: example_loss(p, z, y), (x,), (v,), has_aux=True)  # type: ignore[misc]
        return tangent, (loss, logits)

    def example_terms(x: Tensor, y: Tensor, directions: Tensor) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        products, (loss, logits) = vmap(lambda v: grad(directional, has_aux=True)(params, x, y, v), randomness="same")(
            directions
        )
        return {n: t.pow(2).sum(0) for n, t in products.items()}, loss[0], logits[0]

    per_example: Callable[..., tuple[dict[str, Tensor], Tensor, Tensor]] = vmap(
        example_terms, in_dims=(0, 0, 1), randomness="different"
    )
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    losses = logits = inputs
    # drawn at once (k x m inputs: small) so that chunking does not change the draws
    directions = torch.randn((probes, *inputs.shape), generator=generator, device=inputs.device, dtype=inputs.dtype)
    start = 0
    for count in _chunks(probes, chunk_size):
        terms, losses, logits = per_example(inputs, targets, directions[start : start + count])
        start += count
        for n in total:
            total[n] += terms[n].sum(0)
    _check_mean_reduction(loss_fn, logits, targets, losses)
    return total


def _check_mean_reduction(loss_fn: LossFn, logits: Tensor, targets: Tensor, losses: Tensor) -> None:
    """The per-example decomposition assumes ``loss_fn(batch) == mean of loss_fn(example)``."""
    with torch.no_grad():
        whole = loss_fn(logits, targets)
    mean = losses.mean()
    if whole.numel() != 1 or not torch.allclose(whole.detach().reshape(()), mean, rtol=1e-4, atol=1e-6):
        raise ValueError(
            "method='per_example' needs loss_fn to be the mean of per-example losses (e.g. cross_entropy with "
            f"reduction='mean'); on the probed examples it gives {whole.detach().flatten()[:1].tolist()} against a "
            f"per-example mean of {float(mean):.6g}. Use method='batch' for other losses"
        )


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
