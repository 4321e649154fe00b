"""Refiner's client step in pure torch: optimise robust data, then project the upload.

Refiner (Fan et al., USENIX Security 2025, Sec. 3, App. J) replaces a client's batch
``x`` by robust data ``x*`` whose gradient keeps the model's utility but whose picture carries
no information about ``x``:

* Eq. 2: ``x* = argmin UM(x*, x) - beta * PM(x*)`` from the noise-blended start
  ``x0 = (1 - alpha) x + alpha v``, ``v ~ U[0, 1]``, ``I`` gradient steps, clamped to [0, 1].
* Eq. 3-4: ``UM = sum_i ||w_i (.) (grad_i(x*) - g_i)||^2`` with ``w_i = |g_i (.) theta_i| tau^i``,
  ``g`` the raw batch's gradient and ``i = 1..K`` the parametrised layers counted from the input
  (weight and bias share ``i``). Eq. 4 prints the weight inside the norm (``"printed"``, our
  default); the sentence under it reads a weighted sum of squares (``"sentence"``:
  ``sum_i sum_j w_ij Delta_ij^2``).
* ``PM(x*) = D(x*)``, the evaluation network's predicted noise ratio (higher = more private).
* App. J, Eq. 14: the upload is ``g*`` when ``||g* - g|| <= eps``, else
  ``g + eps (g* - g) / ||g* - g||`` (global L2 norm; per layer as an option). The paper's ``eps``
  is an absolute radius; ``eps_relative=True`` (ours) makes it ``eps ||g||`` (per layer
  ``eps ||g_l||``), so one setting means the same on every model, batch and round.

Everything happens in pixel space (``[0, 1]``); the model sees ``normalize(x*)``. Labels are
never changed: Refiner hides images, not labels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_gp.normalization import denormalize, normalize
from lightning_gp.validation import (
    check_bool,
    check_choice,
    check_nonnegative,
    check_positive,
    check_positive_int,
    check_rate,
)

LossFn = Callable[[Tensor, Tensor], Tensor]
UtilityReading = Literal["printed", "sentence"]
ProjectionNorm = Literal["global", "layer"]
StepRule = Literal["sgd", "adam"]


@dataclass(frozen=True)
class RefinerConfig:
    """The knobs of Refiner, with the paper's defaults (Sec. 5.1, App. J).

    Args:
        alpha: noise blend of the start ``x0 = (1 - alpha) x + alpha v`` (Sec. 3.4), in [0, 1].
        beta: weight of the privacy measure ``PM`` in Eq. 2 (>= 0).
        iterations: optimisation steps ``I`` on a cold start (>= 1).
        warm_iterations: steps when every image of the batch starts from its cached ``x*`` (Sec. 6.3).
        tau: layer-wise decay of the utility weights (Eq. 3), in [0, 1].
        step_size: the optimiser's learning rate on ``x*`` (the paper's only figure: 10 iterations at lr 1, Fig. 5).
        step_rule: ``"sgd"`` (plain gradient descent, the paper's) or ``"adam"``.
        eps: radius of the upload projection (App. J, Eq. 14; >= 0; ``inf`` turns it off).
        eps_relative: read ``eps`` as a fraction of the raw gradient's norm: the radius is
            ``eps ||g||`` (``projection="layer"``: ``eps ||g_l||`` per layer); ``eps`` must then be finite.
        projection: ``"global"`` L2 norm over all layers, or ``"layer"``: each layer on its own.
        utility: ``"printed"`` or ``"sentence"`` reading of Eq. 4 (see the module docstring).
    """

    alpha: float = 0.5
    beta: float = 1.0
    iterations: int = 10
    warm_iterations: int = 5
    tau: float = 0.95
    step_size: float = 1.0
    step_rule: StepRule = "sgd"
    eps: float = 0.1
    projection: ProjectionNorm = "global"
    utility: UtilityReading = "printed"
    eps_relative: bool = False

    def __post_init__(self) -> None:
        check_rate(self.alpha, "alpha")
        check_nonnegative(self.beta, "beta")
        check_positive_int(self.iterations, "iterations")
        check_positive_int(self.warm_iterations, "warm_iterations")
        check_rate(self.tau, "tau")
        check_positive(self.step_size, "step_size")
        check_choice(self.step_rule, "step_rule", ("sgd", "adam"))
        check_bool(self.eps_relative, "eps_relative")
        check_radius(self.eps, eps_relative=self.eps_relative)
        check_choice(self.projection, "projection", ("global", "layer"))
        check_choice(self.utility, "utility", ("printed", "sentence"))


@dataclass
class RefinedBatch:
    """What one client's Refiner step produced.

    Attributes:
        pixels: the robust data ``x*`` in [0, 1] (detached).
        inputs: ``normalize(x*)``, what the model was trained on.
        upload: the projected gradient the client shares (App. J).
        raw: the raw batch's gradient ``g``; ``robust``: the gradient of ``x*``, ``g*``.
        distance: ``||g* - g||`` (global L2, before projection).
        projected: whether the projection moved the upload (``||g* - g||`` beyond the radius; per layer: any layer).
        utility, privacy: ``UM`` and ``PM`` at every step (``len = iterations + 1``).
        iterations: the steps taken (``iterations`` cold, ``warm_iterations`` warm).
        loss: the loss of the raw batch (the model's training loss on real data).
    """

    pixels: Tensor
    inputs: Tensor
    upload: dict[str, Tensor]
    raw: dict[str, Tensor]
    robust: dict[str, Tensor]
    distance: float
    projected: bool
    loss: Tensor
    iterations: int
    utility: list[float] = field(default_factory=list)
    privacy: list[float] = field(default_factory=list)


def layer_index(names: Sequence[str]) -> dict[str, int]:
    """Eq. 3's ``i`` for each parameter: parametrised layers counted from 1 in registration order
    (the order modules are defined, input first for sequential models); a layer's weight and bias
    share their index."""
    order: dict[str, int] = {}
    index = {}
    for name in names:
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if owner not in order:
            order[owner] = len(order) + 1
        index[name] = order[owner]
    return index


def utility_weights(raw: Mapping[str, Tensor], params: Mapping[str, Tensor], tau: float) -> dict[str, Tensor]:
    """Eq. 3: ``w_i = |g_i (.) theta_i| tau^i`` (detached constants)."""
    index = layer_index(list(raw))
    return {n: (raw[n] * params[n].detach()).abs() * tau ** index[n] for n in raw}


def utility_measure(
    robust: Mapping[str, Tensor], raw: Mapping[str, Tensor], weights: Mapping[str, Tensor], reading: UtilityReading
) -> Tensor:
    """Eq. 4, summed over layers: ``||w (.) Delta||^2`` (printed) or ``sum w Delta^2`` (sentence)."""
    terms = []
    for name, g in raw.items():
        delta = robust[name] - g
        terms.append(((weights[name] * delta) ** 2).sum() if reading == "printed" else (weights[name] * delta**2).sum())
    return torch.stack(terms).sum()


def check_radius(eps: float, *, eps_relative: bool = False) -> float:
    """The projection radius: a number ``>= 0``; ``math.inf`` turns the projection off, except
    with ``eps_relative`` (a fraction of ``||g||``), where it must be finite."""
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool)) or math.isnan(eps) or eps < 0:
        raise ValueError(f"eps must be a number >= 0 (math.inf turns the projection off), got {eps!r}")
    if eps_relative and math.isinf(eps):
        raise ValueError(
            f"eps must be finite with eps_relative=True (a fraction of the raw gradient's norm), got {eps!r}; "
            "an absolute eps=math.inf turns the projection off"
        )
    return eps


def _norm(tensors: Sequence[Tensor]) -> float:
    """The L2 norm over all entries of ``tensors``, in float64."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t.detach().double())) ** 2 for t in tensors))


def project_upload(
    robust: Mapping[str, Tensor],
    raw: Mapping[str, Tensor],
    eps: float,
    *,
    per_layer: bool = False,
    eps_relative: bool = False,
) -> tuple[dict[str, Tensor], bool]:
    """App. J, Eq. 14: the closest point to ``g*`` within radius ``r`` of ``g``.

    ``r = eps``, or ``r = eps ||g||`` with ``eps_relative`` (ours: the paper's radius is absolute).
    Returns ``(upload, moved)``: ``g*`` itself when ``||g* - g|| <= r``, else
    ``g + r (g* - g) / ||g* - g||`` (at exactly distance ``r`` from ``g``). ``per_layer``
    applies the rule to each layer with its own norm (each layer then within ``r_l = eps``, or
    ``eps ||g_l||`` with ``eps_relative``).
    """
    check_bool(eps_relative, "eps_relative")
    check_radius(eps, eps_relative=eps_relative)
    if set(robust) != set(raw):
        raise ValueError(f"robust and raw gradients name different layers: {sorted(set(robust) ^ set(raw))}")
    delta = {n: robust[n].detach() - raw[n].detach() for n in raw}
    if per_layer:
        upload, moved = {}, False
        for n, d in delta.items():
            norm = _norm([d])
            radius = eps * _norm([raw[n]]) if eps_relative else eps
            if norm > radius:
                upload[n] = raw[n].detach() + d * (radius / norm)
                moved = True
            else:
                upload[n] = robust[n].detach().clone()
        return upload, moved
    norm = _norm(list(delta.values()))
    radius = eps * _norm(list(raw.values())) if eps_relative else eps
    if norm <= radius:
        return {n: robust[n].detach().clone() for n in raw}, False
    scale = radius / norm
    return {n: raw[n].detach() + d * scale for n, d in delta.items()}, True


def _check_inputs(inputs: Tensor) -> None:
    if not isinstance(inputs, Tensor):
        raise TypeError(f"inputs must be a tensor, got {type(inputs).__name__}")
    if not inputs.is_floating_point():
        raise TypeError(
            f"Refiner optimises the inputs themselves and needs continuous inputs (images); got a {inputs.dtype} "
            "batch (token ids, class indices?). For text, refine embeddings inside your model instead"
        )
    if inputs.ndim < 2:
        raise ValueError(f"inputs must be a batch [B, C, ...], got shape {tuple(inputs.shape)}")
    if not torch.isfinite(inputs).all():
        raise ValueError("inputs contain NaN or inf")


def blended_start(pixels: Tensor, alpha: float, generator: torch.Generator | None) -> Tensor:
    """Sec. 3.4: ``(1 - alpha) x + alpha v``, ``v ~ U[0, 1]`` (drawn on the CPU for reproducibility)."""
    v = torch.rand(pixels.shape, generator=generator, dtype=pixels.dtype).to(pixels.device)
    return (1 - alpha) * pixels + alpha * v


def parameter_gradients(
    model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, params: Mapping[str, Tensor], create_graph: bool
) -> tuple[dict[str, Tensor], Tensor]:
    """``(grad of loss_fn(model(inputs), targets) w.r.t. params, loss)``; unused parameters get zeros."""
    loss = loss_fn(model(inputs), targets)
    grads = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph, allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads)}, loss


def refine(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    *,
    evaluator: nn.Module,
    mean: Sequence[float],
    std: Sequence[float],
    config: RefinerConfig | None = None,
    start: Tensor | None = None,
    warm: bool = False,
    generator: torch.Generator | None = None,
    params: Mapping[str, Tensor] | None = None,
) -> RefinedBatch:
    """One client's Refiner step on a batch (Eq. 2-4, App. J).

    Args:
        model: the live model (its trainable parameters are what the client shares, unless
            ``params`` names them).
        loss_fn: ``loss_fn(outputs, targets)``, the mean training loss.
        inputs: the raw batch, normalised as the model expects (``(x - mean) / std``).
        evaluator: the evaluation network ``D`` (pixels in [0, 1] -> noise ratio ``[N]``).
        mean, std: the per-channel normalisation of ``inputs``.
        start: pixels to start from (warm start; ``None``: the noise blend of Sec. 3.4). Rows
            that are NaN get the noise blend (a batch mixing cached and new samples).
        warm: every row of ``start`` is a cached ``x*``: run ``warm_iterations`` steps.
        generator: the random stream of the noise blend.

    BatchNorm running statistics are restored after the optimisation, then updated once by the
    pass that computes ``g*`` (the robust batch is what the client trains on).
    """
    config = config or RefinerConfig()
    _check_inputs(inputs)
    if params is None:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("model has no trainable parameters: Refiner has no gradient to shape")
    pixels = denormalize(inputs, mean, std, sample_ndim=inputs.ndim - 1)  # clamped to [0, 1]
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}

    with torch.enable_grad():
        raw, raw_loss = parameter_gradients(model, loss_fn, inputs, targets, params, create_graph=False)
    raw = {n: g.detach() for n, g in raw.items()}
    weights = utility_weights(raw, params, config.tau)

    x = _starting_pixels(pixels, start, config.alpha, generator)
    steps = config.warm_iterations if warm else config.iterations
    optimizer = (
        torch.optim.Adam([x], lr=config.step_size)
        if config.step_rule == "adam"
        else torch.optim.SGD([x], lr=config.step_size)
    )
    if evaluator.training:
        raise ValueError("evaluator must be in eval mode (a frozen, trained evaluation network)")
    objective = _RefinerObjective(model, loss_fn, targets, params, raw, weights, evaluator, mean, std, config)
    utility, privacy = objective.optimise(x, optimizer, steps)
    _restore_buffers(model, buffers)
    robust_pixels = x.detach()
    robust_inputs = normalize(robust_pixels, mean, std, sample_ndim=x.ndim - 1)
    robust_grads, final_utility, final_privacy = objective.final(robust_pixels, robust_inputs)
    utility.append(final_utility)
    privacy.append(final_privacy)
    upload, moved = project_upload(
        robust_grads, raw, config.eps, per_layer=config.projection == "layer", eps_relative=config.eps_relative
    )
    return RefinedBatch(
        pixels=robust_pixels,
        inputs=robust_inputs,
        upload=upload,
        raw=raw,
        robust=robust_grads,
        distance=_gradient_distance(robust_grads, raw),
        projected=moved,
        loss=raw_loss.detach(),
        iterations=steps,
        utility=utility,
        privacy=privacy,
    )


def _starting_pixels(pixels: Tensor, start: Tensor | None, alpha: float, generator: torch.Generator | None) -> Tensor:
    """The optimisation's leaf ``x0`` in [0, 1]: the noise blend, with the non-NaN rows of ``start`` in its place."""
    x = blended_start(pixels, alpha, generator)
    if start is not None:
        if start.shape != pixels.shape:
            raise ValueError(f"start must have the batch's shape {tuple(pixels.shape)}, got {tuple(start.shape)}")
        fresh = torch.isnan(start.flatten(1)).any(1)
        x = torch.where(fresh.view(-1, *([1] * (x.ndim - 1))), x, start.to(x))
    return x.clamp(0, 1).detach().requires_grad_(True)


@dataclass(frozen=True, eq=False)
class _RefinerObjective:
    """Eq. 2 on one batch: the utility measure of ``x``'s gradient against the raw one, minus
    ``beta`` times the evaluator's noise ratio of ``x``."""

    model: nn.Module
    loss_fn: LossFn
    targets: Tensor
    params: Mapping[str, Tensor]
    raw: Mapping[str, Tensor]
    weights: Mapping[str, Tensor]
    evaluator: nn.Module
    mean: Sequence[float]
    std: Sequence[float]
    config: RefinerConfig

    def optimise(self, x: Tensor, optimizer: torch.optim.Optimizer, steps: int) -> tuple[list[float], list[float]]:
        """``steps`` optimiser steps on the pixels ``x`` (clamped to [0, 1] after each); the UM and PM
        before each step."""
        utility, privacy = [], []
        with torch.enable_grad():
            for _ in range(steps):
                robust, _ = parameter_gradients(
                    self.model,
                    self.loss_fn,
                    normalize(x, self.mean, self.std, sample_ndim=x.ndim - 1),
                    self.targets,
                    self.params,
                    create_graph=True,
                )
                um = utility_measure(robust, self.raw, self.weights, self.config.utility)
                pm = self.evaluator(x).mean()
                utility.append(float(um.detach()))
                privacy.append(float(pm.detach()))
                optimizer.zero_grad(set_to_none=True)
                (x.grad,) = torch.autograd.grad(um - self.config.beta * pm, [x])
                optimizer.step()
                with torch.no_grad():
                    x.clamp_(0, 1)
        return utility, privacy

    def final(self, pixels: Tensor, inputs: Tensor) -> tuple[dict[str, Tensor], float, float]:
        """The final ``x*``: one plain gradient pass gives ``g*`` (what is shared), then its UM and PM; no graph."""
        with torch.enable_grad():
            grads, _ = parameter_gradients(
                self.model, self.loss_fn, inputs, self.targets, self.params, create_graph=False
            )
        grads = {n: g.detach() for n, g in grads.items()}
        with torch.no_grad():
            utility = float(utility_measure(grads, self.raw, self.weights, self.config.utility))
            privacy = float(self.evaluator(pixels).mean())
        return grads, utility, privacy


def _gradient_distance(robust: Mapping[str, Tensor], raw: Mapping[str, Tensor]) -> float:
    """``||g* - g||``, the L2 norm over all layers (in float64)."""
    return _norm([robust[n] - raw[n] for n in raw])


@torch.no_grad()
def _restore_buffers(model: nn.Module, saved: Mapping[str, Tensor]) -> None:
    for name, buffer in model.named_buffers():
        buffer.copy_(saved[name])
