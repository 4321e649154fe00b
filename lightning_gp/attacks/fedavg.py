"""Data leakage in federated averaging (Dimitrov, Balunović, Konstantinov, Vechev, TMLR 2022).

A FedAvg client runs ``E`` local epochs over its ``n`` images in mini-batches of ``b`` (``ceil(n / b)``
SGD steps per epoch, each epoch in a fresh random order) at learning rate ``lr`` and shares
``w_global - w_local``. The attack has the paper's three parts (as its abstract lists them; the
details below follow the authors' code, eth-sri/fedavg_leakage):

1. *Simulation*: dummy images are pushed through the same local SGD steps, with the
   weights carried through the steps as tensors (``functional_call``, ``create_graph``), so the
   simulated update is differentiable in the images (:func:`local_sgd_update`). It is matched to
   the shared one with Inverting Gradients' cosine distance plus a total-variation prior.
2. *Epoch order-invariant prior*: the client's order is unknown and differs per epoch, so
   every epoch gets its own copy ``X^e`` of the ``n`` dummy images (epoch ``e``'s batches are
   consecutive slices of ``X^e``), and the copies are tied by a prior that ignores their order:
   ``R_inv = 1/E^2 sum_{e, f} mean((g(X^e) - g(X^f))^2)`` with ``g(X)`` the mean image of the set
   (the authors' ``l2_mean`` prior of their FEMNIST runs), i.e. twice the mean squared distance of
   each epoch's mean image to their mean over the epochs. The reconstruction is the mean over the
   epochs once every epoch's copy is matched one-to-one to the first epoch's (Hungarian matching on
   the L2 distance, between images of one label only).
3. *Labels*: as Geng et al.'s FedSGD counts, with the model's softmax taken along the
   client's trajectory: the counts of :func:`~lightning_gp.attacks.recover_labels` on the update
   divided by ``lr T`` (``T = E ceil(n / b)`` steps, which makes the classifier's bias update
   ``mean softmax - n_c / n`` for ``b`` dividing ``n``), at the model ``w - a Δ`` with
   ``a = (T - 1) / 2T``. The paper averages the count estimate over the models ``w - (t / T) Δ``,
   ``t < T``; the estimate is linear in the mean softmax, and we take that softmax at the mean of those
   models (exact to first order). The labels the threat model grants (``view.labels``) are used as
   given. Every epoch's copy gets the same label sequence (the paper's reading: the counts in one
   random order, drawn from the attack's seed; granted labels in the client's order).

Readings taken where the suite's conventions differ from the authors' scripts: the distance is
the cosine (their FEMNIST runs use an L2 distance with exponentially decaying layer weights), the
images are projected into the data box after every step of Adam on signed gradients (their clip
prior penalises leaving it), and the step size falls by 10 whenever the objective plateaus.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn
from torch.func import functional_call

from lightning_gp.attacks.base import AttackNotApplicable, GradientAttack, Reconstruction
from lightning_gp.attacks.gradient_matching import cosine_distance, total_variation
from lightning_gp.attacks.labels import recover_labels, update_as_gradient
from lightning_gp.attacks.optimization import plateaued
from lightning_gp.attacks.registry import register_attack
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.view import ServerView
from lightning_gp.validation import (
    as_int,
    check_int,
    check_nonnegative,
    check_number,
    check_positive,
    check_positive_int,
)

LossFn = Callable[[Tensor, Tensor], Tensor]

#: divisions of the step size by 10 on a plateau before the run stops (Inverting Gradients' three)
LR_DECAYS = 3


def local_sgd_update(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Iterable[tuple[Tensor, Tensor]],
    lr: float,
    *,
    keep: Mapping[str, Tensor] | None = None,
    create_graph: bool = True,
) -> dict[str, Tensor]:
    """``w - w_T`` after the SGD steps ``w <- w - lr * grad loss_fn(model_w(x), y)`` on ``batches`` in
    turn, from the model's trainable weights ``w``: the update a FedAvg client shares, with the sign
    of :func:`~lightning_gp.federated.client_updates.client_local_updates`.

    The weights are tensors carried through the steps (``functional_call``), so with ``create_graph``
    the update is differentiable in the inputs (and soft targets). The model runs in its own mode; its
    buffers are cloned, so a BatchNorm layer in training mode leaves the model's statistics alone.
    ``keep``: per-weight masks, steps move only where they are true (weights pruned from the model
    stay put). A weight no step's loss reaches does not move.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    current: dict[str, Tensor] = dict(params)
    for inputs, targets in batches:
        loss = loss_fn(functional_call(model, {**current, **buffers}, (inputs,)), targets)
        grads = torch.autograd.grad(loss, list(current.values()), create_graph=create_graph, allow_unused=True)
        for name, grad in zip(list(current), grads):
            if grad is not None:
                current[name] = current[name] - lr * (grad if keep is None else grad * keep[name])
    return {n: params[n] - current[n] for n in params}


@dataclass(frozen=True)
class LocalSchedule:
    """A FedAvg client's local training: ``epochs`` passes over ``images`` in batches of ``batch_size``
    (the last one smaller when it does not divide ``images``; larger than ``images``: one batch)."""

    images: int
    epochs: int
    batch_size: int
    lr: float

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.images / self.batch_size)

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def slices(self) -> list[slice]:
        """The batches of one epoch, as slices of its (shuffled) images."""
        return [slice(s * self.batch_size, (s + 1) * self.batch_size) for s in range(self.steps_per_epoch)]

    def batches(self, epoch_images: Tensor, labels: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every step's batch from ``[E, n, ...]`` per-epoch images: epoch ``e``'s are consecutive
        slices of ``epoch_images[e]``, with the same slices of ``labels`` in every epoch."""
        return [(images[s], labels[s]) for images in epoch_images for s in self.slices()]


def epoch_order_prior(epoch_images: Tensor) -> Tensor:
    """The epoch order-invariant prior (part 2 of the module's description) of ``[E, n, ...]``
    per-epoch copies: ``1/E^2 sum_{e, f} mean((g(X^e) - g(X^f))^2)`` with ``g`` the mean image of an
    epoch's set, computed as twice the mean squared distance of each ``g(X^e)`` to their mean."""
    means = epoch_images.mean(dim=1)
    return 2 * (means - means.mean(dim=0, keepdim=True)).pow(2).mean()


def merge_epochs(epoch_images: Tensor, labels: Tensor) -> Tensor:
    """The mean over epochs of ``[E, n, ...]`` copies, each epoch's images first matched one-to-one to
    the first epoch's (Hungarian matching on the L2 distance, among images of one label): ``[n, ...]``."""
    reference = epoch_images[0]
    aligned = [reference]
    for copy_ in epoch_images[1:]:
        cost = torch.nan_to_num(torch.cdist(reference.flatten(1).double(), copy_.flatten(1).double()), nan=0.0)
        cost = cost + (labels[:, None] != labels[None, :]).double() * (1.0 + len(labels) * float(cost.max()))
        rows, cols = linear_sum_assignment(cost.cpu().numpy())
        order = torch.empty(len(labels), dtype=torch.long)
        order[torch.as_tensor(rows, dtype=torch.long)] = torch.as_tensor(cols, dtype=torch.long)
        aligned.append(copy_[order.to(copy_.device)])
    return torch.stack(aligned).mean(dim=0)


def trajectory_view(view: ServerView, schedule: LocalSchedule) -> ServerView:
    """The shared update read as one batch-mean gradient of the ``n`` images (for label recovery,
    part 3 of the module's description): the update divided by ``lr T``, with the model moved to
    ``w - a Δ``, ``a = (T - 1) / 2T``, the mean of the models ``w - (t / T) Δ`` of the ``T`` steps."""
    return update_as_gradient(view, schedule.lr, schedule.steps)


def _meta_count(view: ServerView, key: str) -> int | None:
    value = view.meta.get(key)
    return None if value is None else check_positive_int(as_int(value), f'view.meta["{key}"]')


def _meta_rate(view: ServerView, key: str) -> float | None:
    value = view.meta.get(key)
    if isinstance(value, Real) and not isinstance(value, bool):
        value = float(value)
    return None if value is None else check_positive(value, f'view.meta["{key}"]')


@register_attack(
    "FedAvgInversion",
    order=6,
    build=lambda budget, seed, model: FedAvgInversion(iterations=budget.ig_iterations, seed=seed),
)
class FedAvgInversion(GradientAttack):
    """The FedAvg leakage attack of Dimitrov et al. (TMLR 2022), as the module describes it.

    Args:
        local_epochs, local_batch_size, local_lr: the client's local schedule (``view.batch_size``
            is its ``n`` images). ``None``: read from ``view.meta["local_epochs"]``,
            ``["local_batch_size"]``, ``["local_lr"]``; without ``"local_epochs"``, the epochs are
            ``view.meta["local_steps"] / ceil(n / b)`` (the suite's FedAvg clients take one pass of
            ``local_steps`` batches). What is neither given nor recorded makes the attack not
            applicable, as does a FedSGD gradient (``view.meta["algorithm"] == "fedsgd"``:
            :class:`~lightning_gp.attacks.InvertingGradients` is this attack for one step).
        iterations: the cap on Adam steps per restart; ``lr``: Adam's initial step size.
        tv_weight: the weight of the total-variation prior (per image, as Inverting Gradients').
        epoch_prior_weight: the weight of the epoch order-invariant prior (0: independent epochs).
        restarts: random starts; the one with the lowest final objective wins.
        plateau_steps, plateau_rtol: convergence: when the best objective fell by less than a fraction
            ``plateau_rtol`` over the last ``plateau_steps`` steps
            (:func:`~lightning_gp.attacks.optimization.plateaued`), the step size is divided by 10,
            and after :data:`LR_DECAYS` such divisions the run stops (``plateau_steps=0``: every run
            takes ``iterations`` steps at ``lr``).
    """

    # the SoK's class C: it simulates the client's local epochs, batches and learning rate
    requires = requirements("basic_knowledge", "training_details")

    def __init__(
        self,
        iterations: int = 2000,
        lr: float = 0.1,
        tv_weight: float = 1e-4,
        epoch_prior_weight: float = 1.0,
        restarts: int = 1,
        local_epochs: int | None = None,
        local_batch_size: int | None = None,
        local_lr: float | None = None,
        plateau_steps: int = 100,
        plateau_rtol: float = 1e-3,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.iterations = check_positive_int(iterations, "iterations")
        self.lr = check_positive(lr, "lr")
        self.tv_weight = check_nonnegative(tv_weight, "tv_weight")
        self.epoch_prior_weight = check_nonnegative(epoch_prior_weight, "epoch_prior_weight")
        self.restarts = check_positive_int(restarts, "restarts")
        self.local_epochs = None if local_epochs is None else check_positive_int(local_epochs, "local_epochs")
        self.local_batch_size = (
            None if local_batch_size is None else check_positive_int(local_batch_size, "local_batch_size")
        )
        self.local_lr = None if local_lr is None else check_positive(local_lr, "local_lr")
        self.plateau_steps = check_int(plateau_steps, "plateau_steps", low=0)
        self.plateau_rtol = check_number(plateau_rtol, "plateau_rtol", low=0.0, high=1.0)

    def schedule(self, view: ServerView) -> LocalSchedule:
        """The client's local schedule, from the arguments, else from ``view.meta``."""
        if view.meta.get("algorithm") == "fedsgd":
            raise AttackNotApplicable(
                "FedAvgInversion inverts a FedAvg update; the view holds a FedSGD gradient (one step: Inverting Gradients)"
            )
        batch_size = (
            self.local_batch_size if self.local_batch_size is not None else _meta_count(view, "local_batch_size")
        )
        lr = self.local_lr if self.local_lr is not None else _meta_rate(view, "local_lr")
        epochs = self.local_epochs if self.local_epochs is not None else _meta_count(view, "local_epochs")
        steps = _meta_count(view, "local_steps") if epochs is None else None
        given = {"local_epochs": epochs or steps, "local_batch_size": batch_size, "local_lr": lr}
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise AttackNotApplicable(
                f"FedAvgInversion needs the client's local schedule; {', '.join(missing)} neither given nor in view.meta "
                '(local_epochs may also come from view.meta["local_steps"])'
            )
        assert batch_size is not None and lr is not None
        if epochs is None:
            assert steps is not None
            per_epoch = math.ceil(view.batch_size / batch_size)
            if steps % per_epoch:
                raise AttackNotApplicable(
                    f'view.meta["local_steps"] = {steps} is not a whole number of epochs of {per_epoch} steps '
                    f"({view.batch_size} images in batches of {batch_size}); pass local_epochs"
                )
            epochs = steps // per_epoch
        return LocalSchedule(images=view.batch_size, epochs=epochs, batch_size=batch_size, lr=lr)

    def slot_labels(self, view: ServerView, schedule: LocalSchedule, generator: torch.Generator) -> Tensor:
        """The label of each image slot of every epoch: the granted labels, else the recovered counts
        in a random order (part 3 of the module's description)."""
        if view.labels is not None:
            return view.labels
        labels = recover_labels(trajectory_view(view, schedule)).to(view.device)
        return labels[torch.randperm(len(labels), generator=generator, device=view.device)]

    def objective(self, view: ServerView, schedule: LocalSchedule, labels: Tensor) -> Callable[[Tensor], Tensor]:
        """``[E, n, ...] per-epoch images -> 1 - cos(simulated update, shared update) + tv_weight TV
        + epoch_prior_weight R_inv``."""

        def loss(epoch_images: Tensor) -> Tensor:
            guess = local_sgd_update(view.model, view.loss_fn, schedule.batches(epoch_images, labels), schedule.lr)
            value = cosine_distance(guess, view.gradients) + self.tv_weight * total_variation(
                epoch_images.flatten(0, 1)
            )
            if schedule.epochs > 1 and self.epoch_prior_weight > 0:
                value = value + self.epoch_prior_weight * epoch_order_prior(epoch_images)
            return value

        return loss

    def descend(
        self, objective: Callable[[Tensor], Tensor], init: Tensor, bounds: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, list[float]]:
        """Adam on signed gradients, projected into the data box; the step size falls by 10 on each
        plateau, and the run stops on the plateau after the last fall (or at ``iterations``)."""
        images = init.clone().requires_grad_(True)
        optimizer = torch.optim.Adam([images], lr=self.lr)
        trace: list[float] = []
        since, decays = 0, 0
        for iteration in range(self.iterations):
            optimizer.zero_grad()
            value = objective(images)
            value.backward()
            if images.grad is not None:
                images.grad.sign_()
            optimizer.step()
            with torch.no_grad():
                images.copy_(torch.maximum(torch.minimum(images, bounds[1]), bounds[0]))
            trace.append(float(value.detach()))
            self._report(iteration, self.iterations, trace[-1])
            if not math.isfinite(trace[-1]):
                break
            if plateaued(trace[since:], self.plateau_steps, self.plateau_rtol):
                if decays == LR_DECAYS:
                    break
                decays, since = decays + 1, len(trace)
                for group in optimizer.param_groups:
                    group["lr"] *= 0.1
        return images.detach(), trace

    def reconstruct(self, view: ServerView) -> Reconstruction:
        view, generator = self._prepare(view)
        view.check_gradients()
        schedule = self.schedule(view)
        labels = self.slot_labels(view, schedule, generator)
        objective = self.objective(view, schedule, labels)
        bounds = view.data_bounds()
        dtype = next(view.model.parameters()).dtype
        runs = []
        for restart in range(self.restarts):
            shape = (schedule.epochs, schedule.images, *view.input_shape)
            init = torch.randn(shape, generator=generator, device=view.device).to(dtype)
            epoch_images, trace = self.descend(objective, init, bounds)
            with torch.enable_grad():
                final = float(objective(epoch_images).detach())
            runs.append((final if math.isfinite(final) else math.inf, restart, epoch_images, trace))
        final, restart, epoch_images, trace = min(runs, key=lambda run: run[0])
        return Reconstruction(
            images=merge_epochs(epoch_images, labels),
            labels=labels.detach().clone(),
            loss_trace=trace,
            attack=type(self).__name__,
            meta={
                "objective": final,
                "best_restart": restart,
                "objectives": [run[0] for run in runs],
                "local_epochs": schedule.epochs,
                "local_batch_size": schedule.batch_size,
                "local_lr": schedule.lr,
                "local_steps": schedule.steps,
                "epoch_images": epoch_images,
            },
        )


def fedavg_client_view(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    *,
    local_epochs: int,
    local_batch_size: int,
    local_lr: float,
    num_classes: int,
    seed: int = 0,
    labels_known: bool = False,
    loss_fn: LossFn | None = None,
    **view_kwargs: Any,
) -> ServerView:
    """One FedAvg client's round as the server sees it (for tests and benchmarks): ``local_epochs``
    passes of ``torch.optim.SGD`` at ``local_lr`` over ``images`` in batches of ``local_batch_size``,
    each epoch in a fresh order drawn from ``seed``, on a copy of ``model``. The view holds ``model``
    as sent, the update ``w - w_local``, the schedule in ``meta`` (``algorithm="fedavg"``), the labels
    when ``labels_known``, and ``view_kwargs`` (``mean``, ``std``, ...)."""
    check_positive_int(local_epochs, "local_epochs")
    check_positive_int(local_batch_size, "local_batch_size")
    check_positive(local_lr, "local_lr")
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    client = copy.deepcopy(model)
    optimizer = torch.optim.SGD([p for p in client.parameters() if p.requires_grad], lr=local_lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(local_epochs):
        order = torch.randperm(len(images), generator=generator).to(images.device)
        for batch in order.split(local_batch_size):
            optimizer.zero_grad()
            loss_fn(client(images[batch]), labels[batch]).backward()
            optimizer.step()
    sent = dict(model.named_parameters())
    update = {n: (sent[n] - p).detach() for n, p in client.named_parameters() if p.requires_grad}
    meta = {
        "algorithm": "fedavg",
        "local_epochs": local_epochs,
        "local_batch_size": local_batch_size,
        "local_lr": local_lr,
    }
    return ServerView(
        model=model,
        gradients=update,
        batch_size=len(images),
        input_shape=tuple(images.shape[1:]),
        num_classes=num_classes,
        labels=labels if labels_known else None,
        loss_fn=loss_fn,
        meta=meta,
        **view_kwargs,
    )
