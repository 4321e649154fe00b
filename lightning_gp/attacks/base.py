"""The attack contract: ``reconstruct(view) -> Reconstruction``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_gp.attacks.batched import check_batchable
from lightning_gp.attacks.monitor import tick
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.view import ServerView

#: Raised whenever a change of an attack can change what it recovers at a given budget (stored
#: results, e.g. a frontier's, are keyed by it). 2: L-BFGS gradient matching stops on a plateau of
#: its objective (:class:`~lightning_gp.attacks.DLG`'s ``plateau_steps`` and ``plateau_rtol``).
ATTACK_REVISION = 2


class AttackNotApplicable(ValueError):
    """The attack's preconditions do not hold for this view: the model, the loss, the batch or what
    the server holds is outside what the attack can invert (R-GAP on a model with residual
    connections, GradInversion's BatchNorm prior without BatchNorm, Robbing the Fed without its
    imprinted model, distinct-label recovery for more images than classes).

    The audit marks such a cell "n/a" with this message. Any other exception an attack raises is an
    error of the attack: the audit marks the cell "error" and its verdict "inconclusive".
    """


@dataclass
class Reconstruction:
    """What an attack recovered from one shared gradient.

    Attributes:
        images: ``[B, C, H, W]`` in the model's normalised input space (``view.denormalize``
            maps them to [0, 1] pixels); order is the attack's, not the client's.
        labels: ``[B]`` recovered labels, or ``None`` if the attack does not recover them.
        loss_trace: the attack objective per iteration (empty for analytic attacks).
        attack: the attack's name; ``meta``: attack-specific details (e.g. which restart won).
    """

    images: Tensor
    labels: Tensor | None
    loss_trace: list[float] = field(default_factory=list)
    attack: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


class GradientAttack(ABC):
    """Base class of gradient inversion attacks.

    Args:
        seed: seeds the attack's own randomness (initial guesses, probes).
        device: where to run (``None``: the view's device).
        progress_every: print the objective every this many iterations (0: silent).
    """

    #: The capabilities the attack uses, as the SoK of gradient inversion names them
    #: (:mod:`~lightning_gp.attacks.threat_models`): its class is the weakest threat model granting them. The
    #: default, the update and basic knowledge of the task (model, loss, data shape and range), is threat
    #: model B; an attack that uses more (training details, public data, a modified model) declares it.
    requires: ClassVar[frozenset[str]] = requirements("basic_knowledge")

    def __init__(self, *, seed: int = 0, device: str | torch.device | None = None, progress_every: int = 0) -> None:
        if progress_every < 0:
            raise ValueError(f"progress_every must be >= 0, got {progress_every}")
        self.seed = seed
        self.device = None if device is None else torch.device(device)
        self.progress_every = progress_every

    @abstractmethod
    def reconstruct(self, view: ServerView) -> Reconstruction:
        """Recover the client's inputs (and labels) from the view alone."""

    def reconstruct_many(self, views: Sequence[ServerView]) -> list[Reconstruction]:
        """One reconstruction per view, each as :meth:`reconstruct` gives it. Attacks whose problems
        can share one optimisation override this (:meth:`InvertingGradients.reconstruct_many`)."""
        if isinstance(views, ServerView) or not isinstance(views, Sequence):
            raise TypeError(f"views must be a sequence of ServerView, got {type(views).__name__}")
        return [self.reconstruct(view) for view in views]

    def reconstruct_side_by_side(
        self, attacks: Sequence[GradientAttack], views: Sequence[ServerView]
    ) -> list[Reconstruction] | None:
        """``attacks[i].reconstruct(views[i])`` for every ``i`` (one attack object per client, this one
        among them, each with its own seed) in one shared optimisation, or ``None`` where they cannot
        share one: then the caller runs them one by one. ``None`` here; attacks whose problems stack
        override it (:meth:`InvertingGradients.reconstruct_side_by_side`)."""
        return None

    def _first_override(self, owner: type, names: Sequence[str]) -> str | None:
        """The first of ``names`` this attack's class implements otherwise than ``owner`` does (``None``:
        it inherits them all): a subclass with its own objective is not the objective a shared path models."""
        return next((name for name in names if getattr(type(self), name) is not getattr(owner, name)), None)

    def _settings(self) -> tuple[object, ...] | None:
        """What attacks must share, the seed aside, for their problems to share one optimisation
        (``None``: they never do)."""
        return None

    def _alike(self, attacks: Sequence[GradientAttack], views: Sequence[ServerView]) -> bool:
        """One attack per view, every one of this class with this one's :meth:`_settings`, and views
        that share one vmapped optimisation (:func:`~lightning_gp.attacks.batched.check_batchable`)."""
        settings = self._settings()
        if settings is None or len(attacks) != len(views) or not views:
            return False
        if any(type(a) is not type(self) or a._settings() != settings for a in attacks):
            return False
        try:
            check_batchable(views)
        except (TypeError, ValueError):
            return False
        return True

    def _prepare(self, view: ServerView) -> tuple[ServerView, torch.Generator]:
        """The view on the attack's device and a seeded generator there. The model keeps the mode
        the client trained it in (BatchNorm layers use batch statistics, as in the client's pass)."""
        if self.device is not None and self.device != view.device:
            view = view.to(self.device)
        generator = torch.Generator(device=view.device).manual_seed(self.seed)
        return view, generator

    def _report(self, iteration: int, total: int, loss: float) -> None:
        tick(type(self).__name__, iteration, total, loss)  # within monitored(): a heartbeat, or a requested stop
        if self.progress_every and (iteration % self.progress_every == 0 or iteration == total - 1):
            print(f"[{type(self).__name__}] iteration {iteration + 1}/{total} objective {loss:.6g}", flush=True)
