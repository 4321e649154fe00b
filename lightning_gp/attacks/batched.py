"""Many gradient-matching problems in one vmapped optimisation (attack throughput, issue 15).

An attack on one client's shared gradient is a small problem: on LeNetZhu with one image most of
an iteration is per-call overhead (batch-1 convolutions, autograd bookkeeping, the optimiser
step). Several clients' problems, and the restarts of one problem, are independent, so they can
share one optimisation: stack the dummy images as ``[P, B, C, H, W]`` (one row per problem), map
the per-problem objective over the rows with :func:`torch.func.vmap` (the model's parameters go in
through :func:`torch.func.functional_call`; each problem has its own shared gradient, labels, box
and, if they differ, weights) and minimise the SUM of the per-problem objectives. The sum's
gradient with respect to row ``p`` is problem ``p``'s own gradient, and Adam, the gradient sign
and the box projection act elementwise, so every problem follows the trajectory it follows when
solved alone (up to the summation order inside batched kernels: ~1e-17 in float64).

This module builds the stacked problem (:func:`stack_problems`) and the mapped objective; the
optimiser loop is :func:`lightning_gp.attacks.optimization.optimize_image_batch`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import vmap

from lightning_gp.attacks.gradient_matching import (
    cosine_distance,
    functional_parameter_gradients,
    total_variation,
    vmapped_example_gradients,
)
from lightning_gp.attacks.view import ServerView
from lightning_gp.defenses.clipping import clipped_example_sum
from lightning_gp.validation import check_positive_int

#: ``distance(guess, target, names) -> scalar``: a gradient distance of :mod:`~lightning_gp.attacks.gradient_matching`.
Distance = Callable[[Mapping[str, Tensor], Mapping[str, Tensor], Sequence[str]], Tensor]


@dataclass
class ProblemBatch:
    """``P`` gradient-matching problems on one architecture, stacked along a leading dimension.

    Attributes:
        model: the module whose ``forward`` every problem uses (weights come from ``params``).
        loss_fn: the client's loss, the same for every problem.
        params: trainable parameters; ``[P, ...]`` per problem when ``params_batched``, else
            the one set every problem shares (clients of one FedSGD round get the same model).
        buffers: buffers and frozen parameters, ``[P, ...]`` per problem (cloned at every
            evaluation, so a BatchNorm layer in training mode updates its own copy, as
            :func:`~lightning_gp.attacks.parameter_gradients` does).
        shared: the shared gradients, ``[P, ...]`` per layer.
        support: ``[P, ...]`` 0/1 masks of the sent entries, or ``None`` (compare everything).
        labels: ``[P, B]`` labels.
        low, high: ``[P, 1, C, 1, 1]`` data box of each problem.
    """

    model: nn.Module
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    params: dict[str, Tensor]
    params_batched: bool
    buffers: dict[str, Tensor]
    shared: dict[str, Tensor]
    support: dict[str, Tensor] | None
    labels: Tensor
    low: Tensor
    high: Tensor

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def rows(self, index: slice | Tensor) -> ProblemBatch:
        """The problems in ``index`` (a chunk of the batch)."""
        return ProblemBatch(
            model=self.model,
            loss_fn=self.loss_fn,
            params={n: p[index] for n, p in self.params.items()} if self.params_batched else self.params,
            params_batched=self.params_batched,
            buffers={n: b[index] for n, b in self.buffers.items()},
            shared={n: g[index] for n, g in self.shared.items()},
            support=None if self.support is None else {n: s[index] for n, s in self.support.items()},
            labels=self.labels[index],
            low=self.low[index],
            high=self.high[index],
        )


def check_batchable(views: Sequence[ServerView], name: str = "views") -> None:
    """Refuse views that cannot share one vmapped optimisation, naming the first that differs.

    All views need one architecture (same module class, printed structure, train/eval modes,
    parameter and buffer names, shapes and dtypes), the same loss, ``input_shape``,
    ``batch_size``, ``num_classes`` and device. Weights, shared gradients, labels and the data
    normalisation may differ.
    """
    if isinstance(views, ServerView) or not isinstance(views, Sequence):
        raise TypeError(f"{name} must be a sequence of ServerView, got {type(views).__name__}")
    if len(views) == 0:
        raise ValueError(f"{name} is empty: give at least one ServerView")
    for i, view in enumerate(views):
        if not isinstance(view, ServerView):
            raise TypeError(f"{name}[{i}] must be a ServerView, got {type(view).__name__}")
    first = views[0]
    reference = _signature(first)
    for i, view in enumerate(views[1:], start=1):
        for field, expected, got in zip(_FIELDS, reference, _signature(view)):
            if expected != got:
                raise ValueError(
                    f"{name}[{i}] cannot join {name}[0] in one batched optimisation: its {field} differs "
                    f"({_short(got)} vs {_short(expected)}); attack such views separately (batched=False, or one "
                    "call per group)"
                )


def _short(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


_FIELDS = ("input_shape", "batch_size", "num_classes", "device", "model", "module modes", "parameters", "loss_fn")


def _signature(view: ServerView) -> tuple[object, ...]:
    model = view.model
    tensors = [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in model.named_parameters()]
    tensors += [(n, tuple(t.shape), t.dtype, False) for n, t in model.named_buffers()]
    return (
        view.input_shape,
        view.batch_size,
        view.num_classes,
        view.device,
        f"{type(model).__qualname__}: {model}",
        tuple(m.training for m in model.modules()),
        tuple(tensors),
        _loss_signature(view.loss_fn),
    )


def _loss_signature(loss_fn: Callable[[Tensor, Tensor], Tensor]) -> tuple[object, ...]:
    """Class, printed form and plain settings (reduction, label smoothing, ...) of the loss, plus its
    buffers (class weights); a plain function is itself (no two functions batch together)."""
    if not isinstance(loss_fn, nn.Module):
        return (type(loss_fn).__qualname__, id(loss_fn))
    settings = tuple(
        sorted((k, v) for k, v in vars(loss_fn).items() if not k.startswith("_") and isinstance(v, (int, float, str)))
    )
    buffers = tuple(
        (n, tuple(b.tolist()) if b.numel() < 10_000 else b.sum().item()) for n, b in loss_fn.named_buffers()
    )
    return (type(loss_fn).__qualname__, repr(loss_fn), settings, buffers)


def stack_problems(
    views: Sequence[ServerView], labels: Sequence[Tensor], *, repeats: int = 1, support_only: bool = False
) -> ProblemBatch:
    """Stack ``views`` (each repeated ``repeats`` times, e.g. for restarts) into one :class:`ProblemBatch`,
    view-major: rows ``i * repeats .. (i + 1) * repeats - 1`` are ``views[i]``.

    ``labels[i]`` are the labels the attack uses for ``views[i]``; ``support_only`` compares only the
    entries each client sent (the non-zeros of its shared gradient).
    """
    check_batchable(views)
    if len(labels) != len(views):
        raise ValueError(f"labels needs one tensor per view: {len(labels)} for {len(views)} views")

    def stack(tensors: Sequence[Tensor]) -> Tensor:
        return torch.stack(list(tensors)).repeat_interleave(repeats, dim=0)

    first = views[0].model
    params = [{n: p.detach() for n, p in v.model.named_parameters() if p.requires_grad} for v in views]
    same_weights = all(torch.equal(params[0][n], other[n]) for other in params[1:] for n in params[0])
    bounds = [v.data_bounds() for v in views]
    return ProblemBatch(
        model=first,
        loss_fn=views[0].loss_fn,
        params=params[0] if same_weights else {n: stack([p[n] for p in params]) for n in params[0]},
        params_batched=not same_weights,
        buffers={n: stack([_constants(v.model)[n] for v in views]) for n in _constants(first)},
        shared={n: stack([v.gradients[n] for v in views]) for n in views[0].gradients},
        support={n: stack([v.gradients[n].ne(0) for v in views]) for n in views[0].gradients} if support_only else None,
        labels=stack([torch.as_tensor(y, device=views[0].device) for y in labels]),
        low=stack([low for low, _ in bounds]),
        high=stack([high for _, high in bounds]),
    )


def _constants(model: nn.Module) -> dict[str, Tensor]:
    """What the forward pass reads but the attack does not differentiate: buffers and frozen parameters."""
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    return {**frozen, **{n: b.detach() for n, b in model.named_buffers()}}


def inverting_gradients_objective(problems: ProblemBatch, tv_weight: float) -> Callable[[Tensor], Tensor]:
    """Inverting Gradients' objective (Geiping et al. 2020, Eq. 4) of every problem at once:
    ``images [P, B, C, H, W] -> [P]`` with row ``p`` equal to ``1 - cos(grad_p(x_p), g_p) + tv TV(x_p)``,
    the objective :class:`~lightning_gp.attacks.InvertingGradients` minimises for problem ``p`` alone.

    The parameter gradient of each guess comes from :func:`torch.func.grad` inside the map; the
    result stays differentiable with respect to ``images`` for ordinary autograd (``.backward()``).
    """
    model, loss_fn = problems.model, problems.loss_fn

    def one(
        images: Tensor,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        shared: Mapping[str, Tensor],
        support: Mapping[str, Tensor] | None,
        labels: Tensor,
    ) -> Tensor:
        guess = functional_parameter_gradients(model, loss_fn, images, params, buffers, labels)
        if support is not None:
            guess = {n: g * support[n] for n, g in guess.items()}
        return cosine_distance(guess, shared) + tv_weight * total_variation(images)

    support_dims = None if problems.support is None else 0
    mapped = vmap(one, in_dims=(0, 0 if problems.params_batched else None, 0, 0, support_dims, 0))

    def objective(images: Tensor) -> Tensor:
        return mapped(images, problems.params, problems.buffers, problems.shared, problems.support, problems.labels)

    return objective


def gradient_match_rows(
    views: Sequence[ServerView],
    labels: Sequence[Tensor],
    distance: Distance,
    *,
    names: Sequence[str] | None = None,
    targets: Sequence[Mapping[str, Tensor]] | None = None,
    support: Sequence[Mapping[str, Tensor]] | None = None,
    scale: Sequence[Mapping[str, float | Tensor]] | None = None,
    transform: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
    per_example_clip: float | None = None,
    clients: int = 1,
    repeats: int = 1,
) -> Callable[[Tensor, Tensor], Tensor]:
    """The gradient match of ``repeats`` problems per view (restarts), view-major, for any subset of
    them at once: ``(images [A, B, C, H, W], rows [A]) -> [A]``, row ``a`` the ``distance`` between
    the gradient of ``images[a]`` and its view's target over ``names``, the view ``rows[a] // repeats``
    (its labels ``labels[rows[a] // repeats]``); for :func:`~lightning_gp.attacks.searches.adam_searches`.
    Each view's target is held once, however many problems share it.

    Without ``targets`` each view's shared gradient is the target (every layer unless ``names``).
    With a defense-aware match plan (:meth:`~lightning_gp.attacks.DefenseKnowledge.plan`), its
    pieces per view: ``targets``, ``support`` (the guess is zero off it) and ``scale`` (each layer's
    weight, a number or a tensor), as :meth:`~lightning_gp.attacks.adaptive.MatchPlan.restrict`
    applies them, after ``transform`` (the defense's known deterministic part, the same for every view,
    e.g. :func:`~lightning_gp.attacks.update_clip`; it must map: no branch on a tensor's value, see
    :func:`mappable`). ``per_example_clip``: DP-SGD's, the guess the mean
    of its examples' gradients each clipped to that L2 norm
    (:meth:`~lightning_gp.attacks.DefenseKnowledge.dummy_gradient`). ``clients``: each view is the
    secure aggregate of that many clients of equal batches, the guess the mean of its chunks'
    gradients, each through the clips and ``transform`` on its own, as the knowledge of an aggregate
    computes it (:meth:`~lightning_gp.attacks.DefenseKnowledge.over_clients`). A plan whose transform
    depends on its view is not a stacked match (run such problems one by one).
    """
    problems = stack_problems(views, labels)
    repeats = check_positive_int(repeats, "repeats")
    clients = check_positive_int(clients, "clients")
    if views[0].batch_size % clients:
        raise ValueError(f"clients: an aggregate batch of {views[0].batch_size} does not split into {clients} clients")
    names = list(views[0].gradients) if names is None else list(names)
    stacked_targets, stacked_support, stacked_scale = _stacked_plans(problems, views, names, targets, support, scale)
    model, loss_fn = problems.model, problems.loss_fn

    def one(
        images: Tensor,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        target: Mapping[str, Tensor],
        sent: Mapping[str, Tensor] | None,
        weight: Mapping[str, Tensor] | None,
        labels: Tensor,
    ) -> Tensor:
        guess = _shared_guess(model, loss_fn, images, params, buffers, labels, per_example_clip, transform, clients)
        if sent is not None:
            guess = {n: torch.where(sent[n], guess[n], torch.zeros_like(guess[n])) for n in names}
        if weight is not None:
            guess = {n: guess[n] * weight[n] for n in names}
        return distance(guess, target, names)

    mapped = vmap(
        one,
        in_dims=(
            0, 0 if problems.params_batched else None, 0, 0,
            None if stacked_support is None else 0, None if stacked_scale is None else 0, 0,
        ),
    )  # fmt: skip

    def value_of(images: Tensor, rows: Tensor) -> Tensor:
        owners = rows // repeats

        def take(stacked: Mapping[str, Tensor]) -> dict[str, Tensor]:
            return {n: t[owners] for n, t in stacked.items()}

        return mapped(
            images, take(problems.params) if problems.params_batched else problems.params, take(problems.buffers),
            take(stacked_targets), None if stacked_support is None else take(stacked_support),
            None if stacked_scale is None else take(stacked_scale), problems.labels[owners],
        )  # fmt: skip

    return value_of


def _shared_guess(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    images: Tensor,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    labels: Tensor,
    per_example_clip: float | None,
    transform: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None,
    clients: int,
) -> dict[str, Tensor]:
    """What one problem's dummy batch would share: its gradient through the clips and ``transform``; on
    an aggregate of ``clients``, the mean of its equal chunks' gradients, each through them on its own.
    With ``per_example_clip``, a client's gradient is each example's alone, clipped to that norm and
    averaged, as DP-SGD's client computed it (its noise aside)."""

    def client_gradient(chunk: Tensor, chunk_labels: Tensor) -> dict[str, Tensor]:
        if per_example_clip is None:
            guess = functional_parameter_gradients(model, loss_fn, chunk, params, buffers, chunk_labels)
        else:
            examples = vmapped_example_gradients(model, loss_fn, chunk, params, buffers, chunk_labels)
            guess = {n: t / len(chunk) for n, t in clipped_example_sum(examples, per_example_clip).items()}
        return guess if transform is None else transform(guess)

    if clients == 1:
        return client_gradient(images, labels)
    chunks = vmap(client_gradient)(images.unflatten(0, (clients, -1)), labels.unflatten(0, (clients, -1)))
    return {n: g.mean(0) for n, g in chunks.items()}


def _stacked_plans(
    problems: ProblemBatch,
    views: Sequence[ServerView],
    names: Sequence[str],
    targets: Sequence[Mapping[str, Tensor]] | None,
    support: Sequence[Mapping[str, Tensor]] | None,
    scale: Sequence[Mapping[str, float | Tensor]] | None,
) -> tuple[dict[str, Tensor], dict[str, Tensor] | None, dict[str, Tensor] | None]:
    """Each view's target, support and layer weights on ``names``, stacked ``[V, ...]`` (the shared
    gradients where no targets are given), after checking one entry per view."""
    for label, given in (("targets", targets), ("support", support), ("scale", scale)):
        if given is not None and len(given) != len(views):
            raise ValueError(f"{label} needs one entry per view: {len(given)} for {len(views)} views")
    stacked_targets = (
        {n: problems.shared[n] for n in names}
        if targets is None
        else {n: torch.stack([t[n] for t in targets]) for n in names}
    )
    stacked_support = None if support is None else {n: torch.stack([s[n] for s in support]) for n in names}
    stacked_scale = (
        None if scale is None else {n: _stacked_scale([s[n] for s in scale], views[0].gradients[n]) for n in names}
    )
    return stacked_targets, stacked_support, stacked_scale


def _stacked_scale(weights: Sequence[float | Tensor], like: Tensor) -> Tensor:
    """``[P, ...]`` layer weights: numbers as ``[P, 1, ..., 1]`` (broadcast over the layer), tensors stacked."""
    if all(not isinstance(w, Tensor) for w in weights):
        return torch.tensor([float(w) for w in weights], dtype=like.dtype, device=like.device).reshape(
            -1, *([1] * like.ndim)
        )
    return torch.stack([torch.as_tensor(w, dtype=like.dtype, device=like.device).expand_as(like) for w in weights])


def mappable(match_rows: Callable[[Tensor, Tensor], Tensor], view: ServerView) -> bool:
    """Whether a vmapped match evaluates on ``view``'s model: a model whose forward pass reads a value
    out of a tensor (``.item()``) or uses an operation without a batching rule cannot be mapped, and
    the caller then evaluates its problems one at a time (the same objective)."""
    probe = torch.zeros(1, view.batch_size, *view.input_shape, device=view.device, requires_grad=True)
    try:
        with torch.enable_grad():
            torch.autograd.grad(match_rows(probe, torch.zeros(1, dtype=torch.long, device=view.device)).sum(), probe)
    except RuntimeError:
        return False
    return True
