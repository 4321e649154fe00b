"""Independent Adam searches side by side: restarts and decoys of one attack in one loop.

The latent search of GGL and the low-resolution inversion of ROG each run a handful of restarts per
client and, for their prior-only control, the whole attack again on 31 public decoy batches. Each of
those is a small, independent minimisation; at a client batch of one image most of a step is
per-call overhead, so the searches share one loop here: every step evaluates the problems still
running together (``value_of`` maps ``[A, ...]`` iterates to ``[A]`` objectives, vmapped where the
caller can, see :func:`lightning_gp.attacks.batched.gradient_match_rows`), and Adam, which acts
elementwise, moves each row exactly as it moves that problem alone (up to the summation order of
batched kernels).

Each problem keeps its own bookkeeping, as a search run alone does: it records its objective
before the step, keeps the best iterate seen, and stops on a non-finite objective or a plateau of
its best value (:func:`~lightning_gp.attacks.optimization.plateaued`). A stopped problem leaves the
loop (its Adam moments are dropped with it), so the cost of a step falls as problems converge.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_gp.attacks.base import Reconstruction
from lightning_gp.attacks.lockstep import BATCHED_IMAGES, RowObjective, values_and_gradients
from lightning_gp.attacks.optimization import plateaued
from lightning_gp.attacks.view import ServerView
from lightning_gp.validation import check_int, check_number, check_positive, check_positive_int

#: Gradient entries of the decoys searched side by side (their targets are held at once): 2^26
#: floats, 256 MiB; on LeNetZhu every decoy, on ResNet-18 six at a time.
DECOY_ENTRIES = 2**26


def decoys_per_search(view: ServerView, count: int) -> int:
    """How many of ``count`` decoys of ``view``'s shape one side-by-side search takes (:data:`DECOY_ENTRIES`)."""
    entries = sum(g.numel() for g in view.gradients.values())
    return max(1, min(count, DECOY_ENTRIES // max(1, entries)))


def decoy_guesses(
    view: ServerView,
    public: tuple[Tensor, Tensor],
    held_out: Tensor,
    count: int,
    draws: torch.Generator,
    gradients_of: Callable[[Tensor, Tensor, int], dict[str, Tensor]],
    rng_of: Callable[[int], torch.Generator],
    attack: Callable[[list[ServerView], list[torch.Generator]], list[Reconstruction]],
) -> Tensor:
    """``[count, B, C, H, W]``: an attack's output on ``count`` decoys of ``view``, each a batch of
    ``view``'s size drawn (from ``draws``) among the ``held_out`` rows of the ``public`` images, its
    gradient ``gradients_of(images, labels, k)``, attacked seeded by ``rng_of(k)``; as many decoys per
    call of ``attack`` as :func:`decoys_per_search` allows (they are searched side by side there)."""
    images, labels = public
    guesses: list[Tensor] = []
    group = decoys_per_search(view, count)
    for first in range(0, count, group):
        decoys, rngs = [], []
        for k in range(first, min(first + group, count)):
            rows = held_out[torch.randperm(len(held_out), generator=draws)[: view.batch_size].to(view.device)]
            decoys.append(
                dataclasses.replace(
                    view,
                    gradients=gradients_of(images[rows], labels[rows], k),
                    labels=None if view.labels is None else labels[rows],
                    public_data=(images, labels),
                )
            )
            rngs.append(rng_of(k))
        guesses += [result.images.detach() for result in attack(decoys, rngs)]
    return torch.stack(guesses).cpu()


@dataclass
class SearchResult:
    """One problem's search: its best iterate, that iterate's objective, the objective at every step
    it took, and why it stopped (``"iterations"``, ``"non-finite objective"`` or a plateau)."""

    best: Tensor
    value: float
    trace: list[float]
    stopped: str


def step_decay(iterations: int) -> Callable[[int], float]:
    """The learning-rate factor of step ``s``: divided by 10 at 3/8, 5/8 and 7/8 of ``iterations``
    (Inverting Gradients' schedule, as :class:`torch.optim.lr_scheduler.MultiStepLR` steps it)."""
    milestones = [int(iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
    return lambda step: 0.1 ** sum(m <= step for m in milestones)


def cosine_to(final: float, iterations: int) -> Callable[[int], float]:
    """The learning-rate factor of step ``s``: a cosine from 1 to ``final`` over ``iterations``
    (:class:`torch.optim.lr_scheduler.CosineAnnealingLR` with ``eta_min = final * lr``)."""
    return lambda step: final + (1 - final) * (1 + math.cos(math.pi * step / iterations)) / 2


def adam_searches(
    starts: Tensor,
    value_of: RowObjective,
    *,
    iterations: int,
    lr: float,
    schedule: Callable[[int], float],
    plateau_steps: int,
    plateau_rtol: float,
    rows_per_call: int,
    project: Callable[[Tensor], Tensor] | None = None,
    report: Callable[[int, int, float], None] | None = None,
) -> list[SearchResult]:
    """Minimise ``P`` independent objectives with Adam from ``starts`` ``[P, ...]``, each until
    ``iterations`` steps, a non-finite objective or a plateau (module docstring).

    Args:
        value_of: the objectives of a subset of problems at their iterates (``RowObjective``);
            differentiable with respect to the iterates.
        lr, schedule: Adam's learning rate and its factor at each step (:func:`step_decay`,
            :func:`cosine_to`).
        plateau_steps, plateau_rtol: the plateau rule of
            :func:`~lightning_gp.attacks.optimization.plateaued` (``plateau_steps=0``: never).
        rows_per_call: problems evaluated per call of ``value_of`` (bounds the memory of one call).
        project: applied to the iterates after each step (e.g. a clamp to a box).
        report: ``(step, iterations, best objective among the running problems)`` once per step.

    Returns:
        one :class:`SearchResult` per problem, in the order of ``starts``.
    """
    iterations = check_positive_int(iterations, "iterations")
    check_positive(lr, "lr")
    check_int(plateau_steps, "plateau_steps", low=0)
    check_number(plateau_rtol, "plateau_rtol", low=0.0, high=1.0)
    rows_per_call = check_positive_int(rows_per_call, "rows_per_call")
    if not isinstance(starts, Tensor) or starts.ndim < 1 or len(starts) == 0:
        raise ValueError(
            f"starts must be a tensor [P, ...] of at least one problem, got {getattr(starts, 'shape', starts)}"
        )
    count = len(starts)
    best = starts.detach().clone()
    values = [math.inf] * count
    traces: list[list[float]] = [[] for _ in range(count)]
    stopped = ["iterations"] * count
    rows = torch.arange(count, device=starts.device)
    running = starts.detach().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([running], lr=lr)
    for step in range(iterations):
        current, gradient = values_and_gradients(running.detach(), rows, value_of, rows_per_call)
        listed = current.tolist()
        finite = [v for v in listed if math.isfinite(v)]
        if report is not None:
            report(step, iterations, min(finite) if finite else math.nan)
        keep = []
        for i, (row, value) in enumerate(zip(rows.tolist(), listed)):
            if not math.isfinite(value):
                stopped[row] = "non-finite objective"
                continue
            traces[row].append(value)
            if value < values[row]:
                best[row], values[row] = running[i].detach(), value
            if plateaued(traces[row], plateau_steps, plateau_rtol):
                stopped[row] = f"plateau (best fell by < {plateau_rtol:g} in {plateau_steps} steps)"
                continue
            keep.append(i)
        if not keep:
            break
        if len(keep) < len(rows):
            running, optimizer, gradient = _kept(running, optimizer, gradient, keep, lr)
            rows = rows[keep]
        optimizer.param_groups[0]["lr"] = lr * schedule(step)
        running.grad = gradient
        optimizer.step()
        if project is not None:
            with torch.no_grad():
                running.copy_(project(running))
    return [SearchResult(best[p], values[p], traces[p], stopped[p]) for p in range(count)]


def best_restarts(
    results: Sequence[SearchResult], restarts: int, **meta: Any
) -> list[tuple[Tensor, float, list[float], dict[str, Any]]]:
    """Per view (``restarts`` consecutive problems each, view-major), the search of the lowest
    objective (the first of equal ones): ``(best iterate, objective, trace, info)``, ``info`` what to
    report of it (``restart``, ``steps``, ``stopped``, ``objectives`` of every restart, and ``meta``)."""
    best = []
    for first in range(0, len(results), restarts):
        runs = results[first : first + restarts]
        restart = min(range(len(runs)), key=lambda r: runs[r].value)
        run = runs[restart]
        info = {
            "restart": restart,
            "steps": len(run.trace),
            "stopped": run.stopped,
            "objectives": [r.value for r in runs],
            **meta,
        }
        best.append((run.best, run.value, run.trace, info))
    return best


def _kept(
    running: Tensor, optimizer: torch.optim.Adam, gradient: Tensor, keep: list[int], lr: float
) -> tuple[Tensor, torch.optim.Adam, Tensor]:
    """The iterates, Adam (its moments and step count) and gradients of the problems in ``keep`` only."""
    index = torch.tensor(keep, device=running.device)
    state = optimizer.state[running]
    kept = running.detach()[index].clone().requires_grad_(True)
    fresh = torch.optim.Adam([kept], lr=lr)
    if state:  # after the first step: carry each kept row's moments and the shared step count
        fresh.state[kept] = {
            "step": state["step"].clone(),
            "exp_avg": state["exp_avg"][index].clone(),
            "exp_avg_sq": state["exp_avg_sq"][index].clone(),
        }
    return kept, fresh, gradient[index]


__all__ = [
    "BATCHED_IMAGES",
    "DECOY_ENTRIES",
    "RowObjective",
    "SearchResult",
    "adam_searches",
    "best_restarts",
    "cosine_to",
    "decoy_guesses",
    "decoys_per_search",
    "step_decay",
]
