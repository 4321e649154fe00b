"""Sparse Gradient Inversion (SGI, PriPrune Alg. 2): Inverting Gradients on what a pruned client sent.

A pruned client reveals its pruning: the weights it did not send arrive as exact zeros. SGI reads
the mask from them and matches only those entries:

1. ``m_rec[j] = [w_received[j] != 0]`` (Alg. 2 line 2);
2. target ``(w_prev - w_received) * m_rec`` (line 3), the client's update on the support;
3. dummy data ``x' ~ N(0, 1)`` and soft labels (lines 4-5), optimised to minimise
   ``1 - cos(dummy update * m_rec, target) + tau TV(x')`` (lines 6-9) with Inverting Gradients'
   optimiser (:func:`~lightning_gp.attacks.optimization.optimize_images`: Adam, optionally on
   signed gradients, projected into the data box).

The dummy update is the gradient of the dummy batch for one local step, and for a FedAvg update of
``S`` local steps the unrolled local training (``S`` SGD steps at the client's learning rate on
``S`` dummy batches from ``w_prev``, the pruned weights of the sent model held at zero), so the
true batch reproduces the update exactly. Given a FedSGD shared gradient instead, the support is
the gradient's nonzero pattern and SGI is Inverting Gradients on the shared support: the adaptive
attack on any pruning defense.

SGI is registered here as the adaptive attack of :class:`~lightning_gp.priprune.PrunedFedAvgModule`
(PriPrune's module inherits it).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_gp.attacks.base import AttackNotApplicable, GradientAttack, Reconstruction
from lightning_gp.attacks.fedavg import local_sgd_update
from lightning_gp.attacks.gradient_matching import cosine_distance, parameter_gradients, total_variation
from lightning_gp.attacks.labels import recover_labels
from lightning_gp.attacks.optimization import best_of_restarts
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.view import ServerView
from lightning_gp.validation import check_choice, check_nonnegative, check_positive, check_positive_int

UpdateKind = Literal["auto", "weights", "gradient"]
LabelMode = Literal["soft", "recover"]
MaskRule = Literal["observed", "received"]


def recover_mask(received: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Alg. 2 line 2: ``True`` where the received tensor is nonzero (what the client sent)."""
    return {n: w != 0 for n, w in received.items()}


def received_weights(view: ServerView) -> dict[str, Tensor]:
    """The weights a FedAvg client sent, ``w_received = w_prev - update``, from the view's sent model
    and the update it shared (a pseudo-gradient ``w_prev - w_shared``, as the simulation taps it)."""
    params = {n: p.detach() for n, p in view.model.named_parameters() if p.requires_grad}
    return {n: params[n] - g.to(params[n].dtype) for n, g in view.gradients.items()}


class SGI(GradientAttack):
    """Sparse Gradient Inversion (PriPrune, Alg. 2), for FedAvg weight updates and FedSGD gradients.

    Args:
        iterations, lr: optimiser steps per restart and Adam's learning rate (the paper's 10,000
            and 0.01).
        tv_weight: ``tau``, the weight of the total-variation prior.
        restarts, signed, boxed, lr_decay: as :class:`~lightning_gp.attacks.InvertingGradients`.
        labels: ``"soft"`` (Alg. 2: label logits optimised with the images, the labels returned
            are their argmax) or ``"recover"`` (:func:`~lightning_gp.attacks.recover_labels` on the
            target). Labels the threat model grants (``view.labels``) are used as given.
        update: what ``view.gradients`` holds: ``"weights"``, a FedAvg update ``w_prev - w_received``
            (the mask comes from the received weights); ``"gradient"``, a FedSGD gradient (the mask is
            its support); ``"auto"``: ``"weights"`` when ``view.meta["algorithm"] == "fedavg"``.
        local_steps, local_lr: the client's local SGD steps and learning rate behind a FedAvg
            update (default: ``view.meta["local_steps"]``/``["local_lr"]``, else one step). The
            batch of ``view.batch_size`` images is split into ``local_steps`` equal local batches.
        mask: for a FedAvg update, ``"received"`` is Alg. 2's mask, the nonzeros of the received
            weights; ``"observed"`` (default) also drops the entries the update leaves exactly
            unchanged (a defense that prunes the update rather than the weights, e.g. a gradient
            pruning callback after the client). The two agree when every sent weight moved.
    """

    # class C: it simulates the client's local steps and reads its pruning
    requires = requirements("basic_knowledge", "training_details")

    def __init__(
        self,
        iterations: int = 10_000,
        lr: float = 0.01,
        tv_weight: float = 1e-4,
        restarts: int = 1,
        signed: bool = True,
        boxed: bool = True,
        lr_decay: bool = True,
        labels: LabelMode = "soft",
        update: UpdateKind = "auto",
        local_steps: int | None = None,
        local_lr: float | None = None,
        mask: MaskRule = "observed",
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.iterations = check_positive_int(iterations, "iterations")
        self.lr = check_positive(lr, "lr")
        self.tv_weight = check_nonnegative(tv_weight, "tv_weight")
        self.restarts = check_positive_int(restarts, "restarts")
        self.signed, self.boxed, self.lr_decay = signed, boxed, lr_decay
        self.labels = check_choice(labels, "labels", ("soft", "recover"))
        self.update = check_choice(update, "update", ("auto", "weights", "gradient"))
        self.local_steps = None if local_steps is None else check_positive_int(local_steps, "local_steps")
        self.local_lr = None if local_lr is None else check_positive(local_lr, "local_lr")
        self.mask = check_choice(mask, "mask", ("observed", "received"))

    # ------------------------------------------------------------------ what the server observed
    def update_kind(self, view: ServerView) -> str:
        if self.update != "auto":
            return self.update
        return "weights" if view.meta.get("algorithm") == "fedavg" else "gradient"

    def support(self, view: ServerView) -> dict[str, Tensor]:
        """The recovered mask: nonzeros of the received weights (FedAvg; with ``mask="observed"`` also
        of the update) or of the shared gradient (FedSGD)."""
        observed = recover_mask(view.gradients)
        if self.update_kind(view) == "gradient":
            return observed
        received = recover_mask(received_weights(view))
        if self.mask == "received":
            return received
        return {n: received[n] & observed[n] for n in received}

    def target(self, view: ServerView, mask: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Alg. 2 line 3: the update restricted to the recovered mask."""
        return {n: torch.where(mask[n], g, torch.zeros_like(g)) for n, g in view.gradients.items()}

    def local_training(self, view: ServerView) -> tuple[int, float]:
        """``(local steps, local learning rate)`` behind the update (one step for a gradient)."""
        if self.update_kind(view) == "gradient":
            return 1, 1.0
        steps = self.local_steps if self.local_steps is not None else int(view.meta.get("local_steps", 1))
        lr = self.local_lr if self.local_lr is not None else float(view.meta.get("local_lr", 1.0))
        if view.batch_size % steps:
            raise AttackNotApplicable(
                f"local_steps ({steps}) must divide the batch of {view.batch_size} images behind the update "
                "(the images of all local steps)"
            )
        return steps, lr

    # ------------------------------------------------------------------ the dummy update
    def dummy_update(self, view: ServerView, images: Tensor, targets: Tensor) -> dict[str, Tensor]:
        """The update the dummy batch would produce (differentiable in ``images`` and soft ``targets``).

        One step: the gradient (a FedAvg update of one step is ``lr`` times it, and the cosine
        ignores the scale). ``S`` steps: ``w_prev - w_S`` of ``S`` unrolled SGD steps on the sent
        model, entries that are zero in the sent model (pruned) held at zero.
        """
        steps, lr = self.local_training(view)
        if steps == 1:
            return parameter_gradients(view.model, view.loss_fn, images, targets)
        trainable = {n: p.detach() != 0 for n, p in view.model.named_parameters() if p.requires_grad}
        batches = zip(images.chunk(steps), targets.chunk(steps))
        return local_sgd_update(view.model, view.loss_fn, batches, lr, keep=trainable)

    def objective(
        self, view: ServerView, mask: Mapping[str, Tensor], fixed_labels: Tensor | None
    ) -> Callable[[Tensor], Tensor]:
        """``packed -> 1 - cos(dummy update * m_rec, target) + tau TV(x')`` (Alg. 2 lines 6-7); ``packed``
        holds the images and, without fixed labels, the label logits (:meth:`unpack`)."""
        target = self.target(view, mask)

        def loss(packed: Tensor) -> Tensor:
            images, label_logits = self.unpack(view, packed, fixed_labels is None)
            targets = fixed_labels if fixed_labels is not None else label_logits.softmax(dim=-1)
            guess = self.dummy_update(view, images, targets)
            guess = {n: g * mask[n] for n, g in guess.items()}
            return cosine_distance(guess, target) + self.tv_weight * total_variation(images)

        return loss

    @staticmethod
    def unpack(view: ServerView, packed: Tensor, soft: bool) -> tuple[Tensor, Tensor]:
        """Split the optimised vector into images ``[B, *input_shape]`` and label logits ``[B, K]``."""
        n_images = view.batch_size * math.prod(view.input_shape)
        images = packed[:n_images].view(view.batch_size, *view.input_shape)
        logits = packed[n_images:].view(view.batch_size, view.num_classes if soft else 0)
        return images, logits

    # ------------------------------------------------------------------ the attack
    def fixed_labels(self, view: ServerView, mask: Mapping[str, Tensor]) -> Tensor | None:
        if view.labels is not None:
            return view.labels
        if self.labels == "soft":
            return None
        on_support = copy.copy(view)
        on_support.gradients = self.target(view, mask)
        return recover_labels(on_support).to(view.device)

    def reconstruct(self, view: ServerView) -> Reconstruction:
        view, generator = self._prepare(view)
        mask = self.support(view)
        fixed = self.fixed_labels(view, mask)
        objective = self.objective(view, mask, fixed)
        shape = (view.batch_size, *view.input_shape)
        bounds = None
        if self.boxed:
            low, high = view.data_bounds()
            label_room = torch.full((0 if fixed is not None else view.batch_size * view.num_classes,), math.inf)
            bounds = (
                torch.cat([low.expand(shape).flatten(), -label_room.to(low)]),
                torch.cat([high.expand(shape).flatten(), label_room.to(high)]),
            )

        def start() -> Tensor:
            parts = [torch.randn(shape, generator=generator, device=view.device).flatten()]
            if fixed is None:
                parts.append(torch.randn((view.batch_size, view.num_classes), generator=generator, device=view.device))
            return torch.cat([p.flatten() for p in parts])

        packed, trace, final, restart, objectives = best_of_restarts(
            objective,
            start,
            restarts=self.restarts,
            iterations=self.iterations,
            lr=self.lr,
            signed=self.signed,
            bounds=bounds,
            lr_decay=self.lr_decay,
            report=self._report,
        )
        images, label_logits = self.unpack(view, packed, fixed is None)
        labels = fixed if fixed is not None else label_logits.argmax(dim=-1)
        sent = sum(int(m.sum()) for m in mask.values())
        total = sum(m.numel() for m in mask.values())
        steps, lr = self.local_training(view)
        return Reconstruction(
            images=images.detach().clone(),
            labels=labels.detach().clone(),
            loss_trace=trace,
            attack=type(self).__name__,
            meta={
                "objective": final,
                "best_restart": restart,
                "objectives": objectives,
                "update": self.update_kind(view),
                "support_fraction": sent / total if total else 0.0,
                "local_steps": steps,
                "local_lr": lr,
            },
        )


def sgi_adaptive_attacks(target: Any, kwargs: dict[str, Any]) -> list[GradientAttack]:
    """The adaptive attack of pruned FedAvg and PriPrune (a subclass), registered beside
    :class:`~lightning_gp.priprune.PrunedFedAvgModule`: SGI (Adam only)."""
    kwargs.pop("lbfgs_iterations", None)
    return [SGI(**kwargs)]
