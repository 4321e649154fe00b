"""What a server that knows GradDefense or Outpost feeds the defense-aware attacks (:class:`DefenseKnowledge`).

**GradDefense** (Wang et al. 2022). The slices are public: the server holds the root set and the
model it sent, so it computes the same sensitivity and the same slices. Which slices were noised
is random, but a noised slice of ``n`` entries carries noise energy ``sigma^2 n`` (chi-square with
``n`` degrees of freedom), so a slice whose shared energy lies far below that (6 standard
deviations) was certainly not noised. Exactly ``perturbed_slices`` slices are noised: of the
others, that many with the most energy relative to ``sigma^2 n`` are taken as the noised ones and
left out of the match, the rest are matched in full. Without the root set (the pure defense alone)
the slices are unknown: every layer is judged as one slice and an uncertain layer is weighted by
its Wiener gain ``max(0, 1 - n sigma^2 / ||shared_l||^2)``. Compensation is deterministic: it
keeps a subspace of the rows of the gradient matrix, and the shared gradient's rows span exactly
that subspace, so the server projects the dummy gradient onto it too; the true image then meets
the shared gradient up to the projected noise (a fraction ``k / w`` of it). Clipping acts only on
the noised slices, which the weights already discount; it is not modelled.

**Outpost** (Wang et al. 2023). Whether a step was perturbed shows in the exact zeros pruning
leaves. When it was, the known per-layer pruning is applied to the dummy gradient (the true image's
gradient prunes to the same entries) and each layer is weighted by its Wiener gain with the known
noise std ``lambda min(Var(W_l), 1)``, from the weights the server sent; entries that are zero in
the shared gradient are compared too (the pruned dummy must be zero there). When it was not, the
shared gradient is the raw one and the published match applies. (Matching only the entries
estimated as kept, the layer's largest ``|shared|``, did worse on LeNet: at ``lambda = 0.8`` the
noise is not small next to the kept entries, and noise on pruned entries pollutes the estimate.)

Both are registered here (:func:`~lightning_gp.attacks.registry.register_defense_knowledge`):
GradDefense as the pure defense and as its callback (which holds the root set), with the
noise-aware MAP beside the pair (:func:`~lightning_gp.attacks.noise_aware.noise_aware_attacks`:
its likelihood matches the slices the weights keep at the noise std ``sigma``), Outpost.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_gp.attacks.adaptive import DefenseKnowledge, KnownTransform
from lightning_gp.attacks.noise_aware import noise_aware_attacks
from lightning_gp.attacks.registry import register_defense_knowledge
from lightning_gp.attacks.view import ServerView
from lightning_gp.defenses.graddefense import GradDefense, compensation_shape
from lightning_gp.defenses.outpost import Outpost, outpost_noise_std, prune_below_percentile
from lightning_gp.defenses.selection import count_for_rate
from lightning_gp.named_tensors import flatten_named, unflatten_named

#: standard deviations below its mean energy at which a noised slice is ruled out
_NOISE_FLOOR_SIGMAS = 6.0
#: singular values below this fraction of the largest are the directions compensation removed
_RANK_TOLERANCE = 1e-5

Slicing = Callable[[ServerView], list[int]]


def compensation_basis(shared: Mapping[str, Tensor], q: float) -> Tensor | None:
    """An orthonormal basis ``[w, k]`` of the row space of the shared gradient's ``v x w`` matrix:
    the subspace GradDefense's compensation kept (``None`` when it could not compensate)."""
    flat = flatten_named(shared, dtype=torch.float64)
    v, w = compensation_shape(flat.numel(), q)
    if w < 2:
        return None
    _, values, rows = torch.linalg.svd(flat.view(v, w), full_matrices=False)
    top = float(values.max()) if values.numel() else 0.0
    return rows[values > top * _RANK_TOLERANCE].T


def subspace_projection(basis: Tensor, q: float) -> KnownTransform:
    """The dummy gradient's ``v x w`` matrix projected onto ``basis`` (differentiable)."""

    def transform(gradients: dict[str, Tensor]) -> dict[str, Tensor]:
        flat = torch.cat([g.reshape(-1) for g in gradients.values()])
        v, w = compensation_shape(flat.numel(), q)
        b = basis.to(device=flat.device, dtype=flat.dtype)
        projected = (flat.view(v, w) @ b) @ b.T
        return unflatten_named(projected.reshape(-1), gradients)

    return transform


def slice_noise_weights(
    shared: Mapping[str, Tensor],
    boundaries: list[int],
    noise_var: float,
    kept_fraction: float = 1.0,
    *,
    noised_at_most: int | None = None,
) -> dict[str, Tensor]:
    """Per-entry match weights over the slices ``boundaries`` delimit.

    A slice whose energy lies more than 6 standard deviations below the noise energy a noised
    slice carries (``noise_var`` per entry; ``kept_fraction`` of it left by a projection, which
    also scales the degrees of freedom) was certainly not noised: weight 1. With ``noised_at_most``
    (GradDefense noises exactly that many slices), the other slices with the most energy relative
    to the noise they would carry, that many of them, are taken as the noised ones and left out
    (weight 0: matching noise only pulls the reconstruction away), and the rest are matched at
    weight 1: a noised slice carries its noise on top of its signal, so its ratio is above 1, while
    a clean slice's ratio is its signal alone. Without it, each uncertain slice gets its Wiener
    gain ``max(0, 1 - E[noise] / ||shared_s||^2)``.
    """
    flat = flatten_named(shared, dtype=torch.float64)
    weights = torch.ones_like(flat)
    if noise_var > 0:
        uncertain: list[tuple[float, int, int]] = []
        for start, stop in itertools.pairwise(boundaries):
            if stop <= start:
                continue
            energy = float(flat[start:stop].pow(2).sum())
            dof = (stop - start) * kept_fraction
            # ||g + n||^2 >= ||n||^2 - k^2 sigma^2 whatever g is (the cross term at k sigma), and
            # ||n||^2 >= sigma^2 (dof - k sqrt(2 dof)) but with chi-square odds beyond k = 6
            floor = noise_var * (dof - _NOISE_FLOOR_SIGMAS * math.sqrt(2 * dof) - _NOISE_FLOOR_SIGMAS**2)
            if energy >= floor and energy > 0:
                uncertain.append((energy / (noise_var * dof), start, stop))
        if noised_at_most is not None:
            for _, start, stop in sorted(uncertain, reverse=True)[:noised_at_most]:
                weights[start:stop] = 0.0
        else:
            for ratio, start, stop in uncertain:
                weights[start:stop] = max(0.0, 1.0 - 1.0 / ratio)
    if not bool((weights > 0).any()):
        weights.fill_(1.0)  # everything swamped: nothing better than the published match
    return unflatten_named(weights, shared)


def layer_boundaries(shared: Mapping[str, Tensor]) -> list[int]:
    """Flat offsets of the layers: each layer as one slice (when the true slices are unknown)."""
    boundaries = [0]
    for g in shared.values():
        boundaries.append(boundaries[-1] + g.numel())
    return boundaries


def graddefense_knowledge(
    defense: Any, slicing: Slicing | None = None, *, name: str = "GradDefense"
) -> DefenseKnowledge:
    """The server's model of a :class:`~lightning_gp.defenses.GradDefense` (its ``sigma``, slice
    counts and ``q``); ``slicing(view)`` gives the flat slice boundaries (the callback's root set),
    without it every layer is judged as one slice."""
    sigma, q = float(defense.scale), defense.q

    def basis(view: ServerView) -> Tensor | None:
        return None if q is None else compensation_basis(view.gradients, float(q))

    def weights(view: ServerView) -> dict[str, Tensor]:
        boundaries = slicing(view) if slicing is not None else layer_boundaries(view.gradients)
        kept = 1.0
        if q is not None:
            b = basis(view)
            if b is not None:
                kept = b.shape[1] / compensation_shape(sum(g.numel() for g in view.gradients.values()), float(q))[1]
        # exactly perturbed_slices slices are noised; per layer that count says nothing
        noised = int(defense.perturbed_slices) if slicing is not None else None
        return slice_noise_weights(view.gradients, boundaries, sigma**2, kept, noised_at_most=noised)

    def view_transform(view: ServerView) -> KnownTransform:
        b = basis(view)
        return (lambda g: g) if b is None else subspace_projection(b, float(q))

    return DefenseKnowledge(
        defense=name,
        models=(name,),
        support=False,
        noise_std=sigma,  # the noised slices' (the likelihood's scale; the weights decide what is matched)
        coordinate_weights=weights,
        view_transform=view_transform if q is not None else None,
    )


def outpost_was_perturbed(shared: Mapping[str, Tensor], phi: float, rho: float) -> bool:
    """Whether an Outpost step was perturbed: pruning leaves at least ``pruned - noised`` exact
    zeros (at least one when that bound is not positive)."""
    pruned = sum(count_for_rate(rho / 100, g.numel()) for g in shared.values())
    noised = count_for_rate(phi / 100, sum(g.numel() for g in shared.values()))
    zeros = sum(int((g == 0).sum()) for g in shared.values())
    return pruned > 0 and zeros >= max(1, pruned - noised)


@register_defense_knowledge(Outpost)
def outpost_knowledge(defense: Any, *, name: str = "Outpost") -> DefenseKnowledge:
    """The server's model of an :class:`~lightning_gp.defenses.Outpost` (``phi``, ``rho``, ``noise_multiplier``)."""
    phi, rho, lam = float(defense.phi), float(defense.rho), float(defense.noise_multiplier)

    def weights(view: ServerView) -> dict[str, Tensor]:
        shared = view.gradients
        if not outpost_was_perturbed(shared, phi, rho):
            return {n: torch.ones_like(g) for n, g in shared.items()}
        params = dict(view.model.named_parameters())
        std = outpost_noise_std({n: params[n] for n in shared}, lam)
        out = {}
        for n, g in shared.items():
            energy = float(g.double().pow(2).sum())
            noise = int((g != 0).sum()) * std[n] ** 2  # at most every sent entry is noised
            out[n] = torch.full_like(g, 1.0 if energy == 0 else max(0.0, 1.0 - noise / energy))
        if not any(bool((w > 0).any()) for w in out.values()):
            out = {n: torch.ones_like(g) for n, g in shared.items()}
        return out

    def view_transform(view: ServerView) -> KnownTransform:
        if not outpost_was_perturbed(view.gradients, phi, rho):
            return lambda g: g
        return lambda g: {n: prune_below_percentile(t, rho) for n, t in g.items()}

    return DefenseKnowledge(
        defense=name, models=(name,), support=False, coordinate_weights=weights, view_transform=view_transform
    )


@register_defense_knowledge(GradDefense, attacks=noise_aware_attacks)
def _graddefense(target: Any) -> DefenseKnowledge:
    # without the root set the slices are unknown: every layer is judged as one slice
    return graddefense_knowledge(target)


def graddefense_callback_knowledge(target: Any) -> DefenseKnowledge:
    """What the server knows of a :class:`~lightning_gp.callbacks.GradDefense` client (registered
    beside it): the defense, and the slices, since it holds the public root set and the model it sent."""
    # the server holds the public root set and the model it sent: it cuts the same slices
    return graddefense_knowledge(
        target.defense, lambda view: target.slice_boundaries_for(view.model, view.gradients, view.loss_fn)
    )
