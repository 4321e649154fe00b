"""Defense-aware gradient matching: the attacker who knows the defense.

A defense is credible only against the attacker who knows it (Carlini et al., "On Evaluating
Adversarial Robustness", 2019: adaptive attacks). What the server knows of a defense is a
:class:`DefenseKnowledge`; two attacks use it, so the worst case sees both optimisers:

- :class:`DefenseAwareInversion`: Inverting Gradients (Geiping et al. 2020, Eq. 4: cosine + TV,
  Adam on signed gradients, in the data box);
- :class:`DefenseAwareIDLG`: iDLG (Zhao et al. 2020: analytic labels, squared L2, L-BFGS), with
  restarts. On a pruned gradient the sent entries of the true batch match exactly, so the L2 match
  on the support reaches the client's image where L-BFGS converges (restarts pick the run with the
  lowest objective).

The dummy gradient goes through what the server knows of the defense before it is compared with
the shared one:

- **support** (every pruning defense, quantisation, Soteria-style column pruning): a pruned
  gradient reveals which entries were kept, as exact zeros; only the sent entries are compared
  (PriPrune's SGI mask, :func:`~lightning_gp.attacks.sgi.recover_mask`, on a FedSGD gradient);
- **known transform** (clipping, quantisation): the defense's deterministic part is applied to the
  dummy gradient (:func:`coordinate_clip`, :func:`update_clip`, :func:`straight_through_quantization`,
  ``per_example_clip`` for DP-SGD's per-example clipping), so the true batch reproduces the
  shared gradient up to the noise;
- **known noise** (Gaussian/Laplace/optimal noise, DP-SGD): with the per-coordinate noise std
  ``sigma`` known, each layer is weighted by its Wiener gain ``max(0, 1 - n_l sigma^2 / ||g_l||^2)``
  estimated from the shared gradient, so layers the noise swamps stop steering the match;
- **skipped layers**: layers a defense is known to perturb (e.g. the layer Soteria defends) are
  left out of the match.

Which of these applies is declared per defense at the end of this module (the defense-aware pair
of :func:`defense_aware_attacks`, registered with
:func:`~lightning_gp.attacks.registry.register_defense_knowledge` on each defense class;
GradDefense's and Outpost's in :mod:`lightning_gp.attacks.perturbation_aware`, the noise
defenses', with the noise-aware MAP beside the pair, in :mod:`lightning_gp.attacks.noise_aware`). An attack
given a view whose recorded defenses (``meta["defenses"]``, written by the shared-gradient
pipeline) include one it does not model says so (:class:`UnmodelledDefenseWarning`), runs the
published attack instead and marks the result ``meta["fallback"]``.

A client that runs several defenses is modelled by one knowledge, :func:`compose_knowledge` of the
stages' knowledge in the order the pipeline applies them (see its docstring for what composes how).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar, cast

import torch
from torch import Tensor

from lightning_gp.attacks.base import GradientAttack, Reconstruction
from lightning_gp.attacks.batched import gradient_match_rows, mappable
from lightning_gp.attacks.gradient_matching import (
    cosine_distance,
    parameter_gradients,
    per_example_gradients,
    squared_l2_distance,
    total_variation,
)
from lightning_gp.attacks.optimization import (
    DLG,
    IDLG,
    InvertingGradients,
    known_or_recovered_labels,
    random_images,
    stacked_rows_agree,
)
from lightning_gp.attacks.registry import register_defense_knowledge
from lightning_gp.attacks.sgi import recover_mask
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.view import ServerView
from lightning_gp.defenses.clipping import clipped_example_sum, squared_update_norm
from lightning_gp.defenses.optimal import OptimalGradientPruning
from lightning_gp.defenses.quantization import GradientQuantization, quantize
from lightning_gp.defenses.soteria import Soteria
from lightning_gp.defenses.sparsification import SparsifyingDefense
from lightning_gp.validation import check_nonnegative, check_positive, check_positive_int

#: A differentiable map of the dummy gradient: the deterministic part of a defense.
KnownTransform = Callable[[dict[str, Tensor]], dict[str, Tensor]]
#: The noise std per coordinate of the shared gradient, fixed or read from the view (DP-SGD's
#: ``sigma C / B`` depends on the batch size).
NoiseStd = float | Callable[[ServerView], float]
#: Per-entry match weights read from the view (GradDefense's per-slice, Outpost's per-layer noise gains).
CoordinateWeights = Callable[[ServerView], dict[str, Tensor]]
#: A known transform that depends on the shared gradient itself (GradDefense's compensation keeps a
#: subspace the shared gradient reveals): built once per view.
ViewTransform = Callable[[ServerView], KnownTransform]
#: The per-entry noise variance of a data-dependent noise (optimal noise) at a guess of the client's
#: batch: ``noise_variance(view, images, labels) -> {name: variance}``, each shaped like its layer.
NoiseVariance = Callable[[ServerView, Tensor, Tensor], dict[str, Tensor]]
#: The noise laws a likelihood can be written for.
NOISE_LAWS = ("gaussian", "laplace")


class UnmodelledDefenseWarning(UserWarning):
    """An adaptive attack met a defense it does not model and fell back to the published attack."""


def coordinate_clip(clip: float) -> KnownTransform:
    """Clip every coordinate to ``[-clip, clip]`` (GaussianNoise(clip=...), OptimalDPSGD, Eq. 9)."""
    clip = check_positive(clip, "clip")

    def transform(gradients: dict[str, Tensor]) -> dict[str, Tensor]:
        return {n: g.clamp(-clip, clip) for n, g in gradients.items()}

    return transform


def update_clip(max_update_norm: float) -> KnownTransform:
    """Scale the whole gradient, every layer together, onto the L2 ball of radius ``max_update_norm``
    (:class:`~lightning_gp.defenses.LocalGaussianMechanism`; McMahan et al. 2018, Alg. 1 ``ClipFn``):
    :func:`~lightning_gp.defenses.clip_update`'s values, differentiable through the norm and without a
    branch on it, so that it maps over many dummy batches (:func:`torch.func.vmap`): the factor
    ``C / sqrt(max(||g||^2, C^2))`` is exactly 1 inside the ball (``sqrt(C^2) = C`` in floating point)
    and carries no gradient there, as the unchanged update does."""
    max_update_norm = check_positive(max_update_norm, "max_update_norm")

    def transform(gradients: dict[str, Tensor]) -> dict[str, Tensor]:
        squared = squared_update_norm(gradients)
        factor = max_update_norm / squared.clamp_min(max_update_norm**2).sqrt()
        return {name: g * factor.to(g.dtype) for name, g in gradients.items()}

    return transform


def straight_through_quantization(bits: int) -> KnownTransform:
    """:class:`~lightning_gp.defenses.GradientQuantization`'s rounding in the forward pass, the
    identity in the backward pass (straight-through), so the match sees the quantised dummy
    gradient and can still move the images."""
    bits = check_positive_int(bits, "bits")

    def transform(gradients: dict[str, Tensor]) -> dict[str, Tensor]:
        return {n: g + (quantize(g.detach(), bits) - g).detach() for n, g in gradients.items()}

    transform.straight_through = True  # type: ignore[attr-defined]  # read by DefenseKnowledge.dummy_gradient
    return transform


def layer_noise_weights(
    shared: Mapping[str, Tensor], noise_std: float, support: Mapping[str, Tensor]
) -> dict[str, float]:
    """Per-layer Wiener gains ``max(0, 1 - n_l sigma^2 / ||g_l||^2)`` over each layer's sent entries.

    ``||g_l||^2`` of the shared gradient is ``||signal||^2 + n_l sigma^2`` in expectation, so the gain
    estimates the share of the layer's energy that is signal. When every layer is swamped, all
    weights are 1 (there is nothing better to do than the published match).
    """
    weights = {}
    for name, g in shared.items():
        count = int(support[name].sum())
        energy = float(g.double().pow(2).sum())
        weights[name] = 0.0 if energy == 0 else max(0.0, 1.0 - count * noise_std**2 / energy)
    if not any(w > 0 for w in weights.values()):
        return dict.fromkeys(shared, 1.0)
    return weights


@dataclass
class MatchPlan:
    """How one view is matched: the layers compared, the sent entries, and each layer's weight."""

    names: list[str]
    support: dict[str, Tensor]
    scale: dict[str, float | Tensor]
    target: dict[str, Tensor]
    transform: KnownTransform | None = None

    def restrict(self, guess: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The dummy gradient (through the view's known transform, if any) on the compared layers
        and sent entries, weighted like the target."""
        if self.transform is not None:
            guess = self.transform(dict(guess))
        return {
            n: torch.where(self.support[n], guess[n], torch.zeros_like(guess[n])) * self.scale[n] for n in self.names
        }


@dataclass
class DefenseKnowledge:
    """What the server knows of the defense a client ran (the adaptive attacker's model of it).

    Attributes:
        defense: the name of the defense modelled (for reports), e.g. ``"TopKPruning"``.
        models: defense class names this knowledge covers. When a view's ``meta["defenses"]`` names
            one outside the list, the attack falls back to the published one (and says so). Empty:
            no check.
        support: compare only the entries the client sent (nonzero in the shared gradient).
        transform: the defense's deterministic part, applied to the dummy gradient.
        per_example_clip: DP-SGD's per-example L2 bound ``C``: each dummy example's gradient is
            scaled by ``min(1, C / ||g_b||)`` before averaging.
        noise_std: per-coordinate std of the defense's noise (a number or a function of the view);
            enables the per-layer Wiener weights of :func:`layer_noise_weights`.
        skip_layers: parameter names (or prefixes ending in ``.``) left out of the match.
        coordinate_weights: per-entry weights (``>= 0``, shaped like each layer) read from the view,
            used instead of the per-layer Wiener gains of ``noise_std`` (e.g. GradDefense's noised
            slices, Outpost's per-layer noise); a layer weighted 0 everywhere is left out.
        view_transform: builds, once per view, a known transform of the dummy gradient that
            depends on the shared gradient (GradDefense's compensation projection).
        fallback_reason: set when nothing models the defense: the published attack runs and every
            result is marked ``meta["fallback"]``.
        caveats: what the knowledge knows of the defense but cannot use (e.g. a composition whose
            pruning a later noise hides); written to every result's ``meta["caveats"]``.
        noise_law: the law of the noise whose std is ``noise_std``: ``"gaussian"`` or ``"laplace"``
            (read by the noise-aware likelihood, :class:`~lightning_gp.attacks.NoiseAwareMAP`).
        noise_variance: the per-entry variance of a data-dependent noise at a guess of the batch
            (optimal noise); the likelihood uses it instead of the isotropic ``noise_std``.
        client_selection: the defense's own choice of the entries one client sends, applied to a dummy
            gradient (Top-k's mask reads the gradient alone). One client's support match stands in for
            it; on an aggregate, where which client sent which entry does not show in the mean, each
            client's chunk goes through it.
        clients: the shared gradient is the secure aggregate of this many clients that each ran the
            defense on an equal batch (the mean of their defended updates): the dummy batch is that
            many equal chunks in client order, each through the defense's known part on its own, then
            averaged; the noise std is one client's over ``sqrt(clients)`` (:meth:`over_clients`).
        noise_shares: on an aggregate, how many clients' noises its sum carries (``None``: one per
            client); more than ``clients`` where the other members of a distributed mechanism's cohort,
            honest and not attacked, add their shares: the noise std is then one client's times
            ``sqrt(noise_shares) / clients``.
    """

    defense: str = ""
    models: tuple[str, ...] = ()
    support: bool = True
    transform: KnownTransform | None = None
    per_example_clip: float | None = None
    noise_std: NoiseStd | None = None
    skip_layers: tuple[str, ...] = ()
    coordinate_weights: CoordinateWeights | None = None
    view_transform: ViewTransform | None = None
    fallback_reason: str | None = None
    caveats: tuple[str, ...] = ()
    noise_law: str = "gaussian"
    noise_variance: NoiseVariance | None = None
    client_selection: KnownTransform | None = None
    clients: int = 1
    noise_shares: int | None = None

    def __post_init__(self) -> None:
        self.clients = check_positive_int(self.clients, "clients")
        if self.noise_shares is not None and check_positive_int(self.noise_shares, "noise_shares") < self.clients:
            raise ValueError(f"noise_shares: {self.noise_shares} noises cannot be summed by {self.clients} clients")
        self.models = tuple(str(m) for m in self.models)
        self.skip_layers = tuple(str(s) for s in self.skip_layers)
        self.caveats = tuple(str(c) for c in self.caveats)
        if self.per_example_clip is not None:
            self.per_example_clip = check_positive(self.per_example_clip, "per_example_clip")
        if self.noise_std is not None and not callable(self.noise_std):
            self.noise_std = check_nonnegative(self.noise_std, "noise_std")
        if self.noise_law not in NOISE_LAWS:
            raise ValueError(f"noise_law must be one of {list(NOISE_LAWS)}, got {self.noise_law!r}")
        for name in ("transform", "coordinate_weights", "view_transform", "noise_variance", "client_selection"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable, got {type(value).__name__}")

    def describe(self) -> str:
        parts = [f"defense={self.defense!r}"] if self.defense else []
        parts += ["support"] if self.support else []
        parts += ["transform"] if self.transform is not None else []
        parts += [f"per_example_clip={self.per_example_clip:g}"] if self.per_example_clip is not None else []
        parts += ["noise_std"] if self.noise_std is not None else []
        parts += [f"noise_law={self.noise_law}"] if self.noise_law != "gaussian" else []
        parts += ["noise_variance"] if self.noise_variance is not None else []
        parts += [f"skip_layers={list(self.skip_layers)}"] if self.skip_layers else []
        parts += ["coordinate_weights"] if self.coordinate_weights is not None else []
        parts += ["view_transform"] if self.view_transform is not None else []
        parts += ["fallback"] if self.fallback_reason else []
        parts += [f"caveats={len(self.caveats)}"] if self.caveats else []
        parts += [f"clients={self.clients}"] if self.clients > 1 else []
        return ", ".join(parts)

    def over_clients(self, clients: int, noise_shares: int | None = None) -> DefenseKnowledge:
        """This knowledge on the secure aggregate of ``clients`` clients that each ran the defense on an
        equal batch (Bonawitz et al., CCS 2017: the server sees only the mean of the defended updates);
        ``noise_shares``: the noises the sum carries where more clients than those attacked add theirs
        (:attr:`noise_shares`).
        Raises ``ValueError`` where the defense's model does not carry over to the mean: a transform
        read off one client's shared gradient (``view_transform``), a data-dependent noise variance, or
        a pruning whose choice of entries is not a known function of the gradient (``client_selection``)."""
        clients = check_positive_int(clients, "clients")
        if self.clients != 1:
            raise ValueError(f"this knowledge is already of an aggregate of {self.clients} clients")
        if self.view_transform is not None:
            raise ValueError(
                f"{self.defense or 'the defense'} reads its transform off one client's shared gradient "
                "(view_transform): it has no model on the mean of several"
            )
        if self.noise_variance is not None:
            raise ValueError(
                f"{self.defense or 'the defense'} adds a data-dependent noise (noise_variance): its variance on "
                "the mean of several clients' updates is not modelled"
            )
        if self.support and self.client_selection is None:
            raise ValueError(
                f"{self.defense or 'the defense'} prunes each client's update, and which client sent which entry "
                "does not show in the mean: its choice of entries is not a known function of the gradient (random, "
                "aligned across clients or read off the data)"
            )
        if self.client_selection is not None and (self.transform is not None or self.per_example_clip is not None):
            raise ValueError(f"{self.defense}: a pruning composed with other stages has no model on the aggregate")
        caveats = self.caveats
        if self.client_selection is not None:
            residual = "a residual the client carries (error feedback's, zero in the first round) is not modelled"
            caveats += (f"each client's mask is recomputed on its chunk of the dummy gradient: {residual}",)
        if self.noise_law == "laplace" and clients > 1 and self.noise_std is not None:
            caveats += (f"the mean of {clients} Laplace noises is not Laplace: the likelihood is approximate",)
        return replace(self, clients=clients, caveats=caveats, noise_shares=noise_shares)

    def unmodelled(self, view: ServerView) -> list[str]:
        """Defenses recorded with the view that this knowledge does not cover."""
        if not self.models:
            return []
        recorded = [d["name"] if isinstance(d, Mapping) else str(d) for d in view.meta.get("defenses", [])]
        return [name for name in recorded if name not in self.models]

    def fallback(self, view: ServerView, attack: str) -> str | None:
        """Why ``attack`` must run the published attack on ``view`` (warned here), or ``None``."""
        missing = self.unmodelled(view)
        if missing:
            warnings.warn(
                f"{attack}({self.describe()}) models {list(self.models)}, but the client also ran {missing}: falling "
                "back to the published attack (the result is marked meta['fallback'])",
                UnmodelledDefenseWarning,
                stacklevel=3,
            )
            return f"not modelled: {missing}"
        return self.fallback_reason

    def noise_level(self, view: ServerView) -> float | None:
        """The per-coordinate noise std of the shared gradient; for an aggregate, one client's (a noise
        read off the view, as DP-SGD's ``sigma C / B``, at one client's batch) over ``sqrt(clients)``
        (times ``sqrt(noise_shares / clients)`` where more noises than clients are summed)."""
        if self.noise_std is None:
            return None
        scale = math.sqrt(self.noise_shares or self.clients) / self.clients
        if not callable(self.noise_std):
            return float(self.noise_std) * scale
        if self.clients > 1:
            if view.batch_size % self.clients:
                raise ValueError(f"an aggregate batch of {view.batch_size} does not split into {self.clients} clients")
            view = copy.copy(view)  # one client's view: its batch (the view's tensors are not touched)
            view.batch_size //= self.clients
        return float(self.noise_std(view)) * scale

    def plan(self, view: ServerView) -> MatchPlan:
        """The layers, entries and per-layer weights of the match, from the shared gradient alone."""
        names = [
            n
            for n in view.gradients
            if not any(n == s or (s.endswith(".") and n.startswith(s)) for s in self.skip_layers)
        ]
        if not names:
            raise ValueError(f"skip_layers {list(self.skip_layers)} leave no layer of the shared gradient to match")
        if self.support:
            support = recover_mask(view.gradients)
        else:
            support = {n: torch.ones_like(g, dtype=torch.bool) for n, g in view.gradients.items()}
        transform = None if self.view_transform is None else self.view_transform(view)
        scale: dict[str, float | Tensor]
        if self.coordinate_weights is not None:
            entry_weights = self.coordinate_weights(view)
            names = [n for n in names if bool((entry_weights[n] > 0).any())] or names
            scale = {n: entry_weights[n].to(view.gradients[n].dtype).sqrt() for n in names}
        else:
            sigma = self.noise_level(view)
            weights = (
                layer_noise_weights(view.gradients, sigma, support) if sigma else dict.fromkeys(view.gradients, 1.0)
            )
            names = [n for n in names if weights[n] > 0] or names
            scale = {n: math.sqrt(weights[n]) for n in names}
        return MatchPlan(names, support, scale, {n: view.gradients[n] * scale[n] for n in names}, transform)

    def dummy_gradient(
        self, view: ServerView, images: Tensor, targets: Tensor, *, straight_through: bool = True
    ) -> dict[str, Tensor]:
        """The gradient the dummy batch would share, through the defense's known deterministic part
        (without a straight-through transform when ``straight_through`` is false); on an aggregate, the
        mean of each client's chunk through it (``clients``)."""
        if self.clients > 1:
            if images.shape[0] % self.clients:
                raise ValueError(f"a dummy batch of {images.shape[0]} does not split into {self.clients} equal clients")
            one = replace(self, clients=1)
            parts = [
                one.dummy_gradient(view, x, y, straight_through=straight_through)
                for x, y in zip(images.chunk(self.clients), targets.chunk(self.clients))
            ]
            if self.client_selection is not None and straight_through:
                # the mask in the forward pass, the identity in the backward one: a dummy whose own mask
                # differs from the client's still gets a gradient on every entry (without
                # ``straight_through``, as L-BFGS asks, the masks are left out: the support match)
                parts = [
                    {n: p[n] + (kept[n] - p[n]).detach() for n in p}
                    for p, kept in ((p, self.client_selection(p)) for p in parts)
                ]
            return {n: torch.stack([p[n] for p in parts]).mean(0) for n in parts[0]}
        if self.per_example_clip is None:
            guess = parameter_gradients(view.model, view.loss_fn, images, targets)
        else:  # DP-SGD's per-example clip and mean, as the client computed it (its noise aside)
            per_example = per_example_gradients(view.model, view.loss_fn, images, targets)
            clipped = clipped_example_sum(per_example, self.per_example_clip)
            guess = {n: t / images.shape[0] for n, t in clipped.items()}
        if self.transform is None:
            return guess
        if not straight_through and getattr(self.transform, "straight_through", False):
            # a composed transform drops only its straight-through stages; a plain one is dropped
            without = getattr(self.transform, "without_straight_through", None)
            return guess if without is None else without()(guess)
        return self.transform(guess)


def _mark(
    result: Reconstruction, knowledge: DefenseKnowledge, view: ServerView, plan: MatchPlan | None, reason: str | None
) -> Reconstruction:
    if reason is not None:
        result.meta.update(
            fallback=True, fallback_reason=reason, unmodelled=knowledge.unmodelled(view), defense=knowledge.defense
        )
        return result
    assert plan is not None
    sent = sum(int(plan.support[n].sum()) for n in plan.names)
    total = sum(view.gradients[n].numel() for n in plan.names)
    result.meta.update(
        fallback=False,
        defense=knowledge.defense,
        support_fraction=sent / total if total else 0.0,
        matched_layers=plan.names,
    )
    if knowledge.caveats:
        result.meta["caveats"] = list(knowledge.caveats)
    return result


class _KnowsTheDefense:
    """What both defense-aware attacks share: the knowledge, the match plan of the running
    reconstruction, and the fallback to the published attack."""

    # class C: the defense's configuration is a training detail
    requires: ClassVar[frozenset[str]] = requirements("basic_knowledge", "training_details")

    knowledge: DefenseKnowledge
    _plan: MatchPlan | None

    def _init_knowledge(self, knowledge: DefenseKnowledge) -> None:
        if not isinstance(knowledge, DefenseKnowledge):
            raise TypeError(f"knowledge must be a DefenseKnowledge, got {type(knowledge).__name__}")
        self.knowledge = knowledge
        self._plan = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.knowledge.describe()})"

    def _knowledge_alike(self, attacks: Sequence[_KnowsTheDefense], views: Sequence[ServerView]) -> bool:
        """Whether every attack's knowledge describes as this one's and covers its view (none falls back):
        the first condition for their clients to run side by side."""
        described = self.knowledge.describe()
        return all(
            a.knowledge.describe() == described and a.knowledge.fallback(view, type(self).__name__) is None
            for a, view in zip(attacks, views)
        )

    def _match_plan(self, view: ServerView) -> MatchPlan:
        """The match plan of ``view`` (the knowledge's; an attack with its own weighting overrides it)."""
        return self.knowledge.plan(view)

    def _reconstruct_knowing(
        self,
        view: ServerView,
        published: Callable[[], GradientAttack],
        run: Callable[[ServerView], Reconstruction],
    ) -> Reconstruction:
        """``run`` with the match plan of ``view`` in place, or the ``published`` attack (marked) when the
        knowledge does not cover what the client ran."""
        reason = self.knowledge.fallback(view, type(self).__name__)
        if reason is not None:
            result = published().reconstruct(view)
            result.attack = type(self).__name__
            return _mark(result, self.knowledge, view, None, reason)
        prepared, _ = cast(GradientAttack, self)._prepare(view)
        self._plan = self._match_plan(prepared)
        try:
            result = run(prepared)
        finally:
            plan, self._plan = self._plan, None
        return _mark(result, self.knowledge, prepared, plan, None)


def stacked_match(
    knowledge: DefenseKnowledge | None,
    views: Sequence[ServerView],
    labels: Sequence[Tensor],
    distance: Callable[..., Tensor],
    *,
    repeats: int = 1,
    plans: Sequence[MatchPlan] | None = None,
) -> Callable[[Tensor, Tensor], Tensor] | None:
    """The match of ``repeats`` problems per view through what the server knows, every problem in one
    vmapped call (:func:`~lightning_gp.attacks.batched.gradient_match_rows`): ``knowledge``'s clips
    (the update's, DP-SGD's per example) and each view's match plan (``plans``: an attack's own, one
    per view; else the knowledge's), over the union of the plans'
    layers (a layer a view's plan leaves out, e.g. one its Wiener gain zeroes, weighs 0 in that
    view's rows: no term of either distance). Without knowledge: every layer of the plain gradient.
    On a secure aggregate each row's guess is the mean of its clients' chunks, each through the clips.
    ``None`` where it does not stack: on an aggregate whose clients' own choice of entries the server
    models (``client_selection``), where a plan carries a transform of its own view, or where the
    model or the transform does not map (:func:`~lightning_gp.attacks.batched.mappable`)."""
    if knowledge is None:
        match = gradient_match_rows(views, labels, distance, repeats=repeats)
        return match if mappable(match, views[0]) else None
    if knowledge.clients != 1 and knowledge.client_selection is not None:
        return None
    plans = [knowledge.plan(view) for view in views] if plans is None else list(plans)
    if len(plans) != len(views):
        raise ValueError(f"plans needs one plan per view: {len(plans)} for {len(views)} views")
    if any(plan.transform is not None for plan in plans):
        return None
    names = [n for n in views[0].gradients if any(n in plan.names for plan in plans)]
    match = gradient_match_rows(
        views, labels, distance, repeats=repeats, names=names,
        targets=[{n: plan.target[n] if n in plan.names else torch.zeros_like(view.gradients[n]) for n in names}
                 for plan, view in zip(plans, views)],
        support=[plan.support for plan in plans],
        scale=[{n: plan.scale[n] if n in plan.names else 0.0 for n in names} for plan in plans],
        transform=knowledge.transform, per_example_clip=knowledge.per_example_clip, clients=knowledge.clients,
    )  # fmt: skip
    return match if mappable(match, views[0]) else None


class DefenseAwareInversion(_KnowsTheDefense, InvertingGradients):
    """Inverting Gradients that models the defense the client ran (see the module docstring).

    Args:
        knowledge: what the server knows of the defense.
        iterations, lr, tv_weight, restarts, signed, boxed, lr_decay: as :class:`InvertingGradients`.
    """

    def __init__(
        self,
        knowledge: DefenseKnowledge,
        iterations: int = 4800,
        lr: float = 0.1,
        tv_weight: float = 1e-4,
        restarts: int = 1,
        signed: bool = True,
        boxed: bool = True,
        lr_decay: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(iterations, lr, tv_weight, restarts, signed, boxed, lr_decay, support_only=False, **kwargs)
        self._init_knowledge(knowledge)

    def objective(self, view: ServerView, labels: Tensor) -> Callable[[Tensor], Tensor]:
        plan = self._plan if self._plan is not None else self.knowledge.plan(view)

        def loss(images: Tensor) -> Tensor:
            guess = plan.restrict(self.knowledge.dummy_gradient(view, images, labels))
            return cosine_distance(guess, plan.target, plan.names) + self.tv_weight * total_variation(images)

        return loss

    def stacked_objective(
        self, views: Sequence[ServerView], labels: Sequence[Tensor], *, plans: Sequence[MatchPlan] | None = None
    ) -> Callable[[Tensor], Tensor] | None:
        """:meth:`objective` of every view at once (``[P, B, C, H, W] -> [P]``), vmapped through the
        knowledge's clips and each view's match plan (``plans``, else the knowledge's; :func:`stacked_match`);
        ``None`` where that does not stack."""
        match = stacked_match(self.knowledge, views, labels, cosine_distance, plans=plans)
        if match is None:
            return None
        rows = torch.arange(len(views), device=views[0].device)
        tv = torch.func.vmap(total_variation)

        def objective(images: Tensor) -> Tensor:
            return match(images, rows) + self.tv_weight * tv(images)

        return objective

    def reconstruct(self, view: ServerView) -> Reconstruction:
        def published() -> GradientAttack:
            return InvertingGradients(
                self.iterations, self.lr, self.tv_weight, self.restarts, self.signed, self.boxed, self.lr_decay,
                seed=self.seed, device=self.device, progress_every=self.progress_every,
            )  # fmt: skip

        return self._reconstruct_knowing(view, published, super().reconstruct)

    def reconstruct_side_by_side(
        self, attacks: Sequence[GradientAttack], views: Sequence[ServerView]
    ) -> list[Reconstruction] | None:
        """As :meth:`InvertingGradients.reconstruct_side_by_side`, through the knowledge: each view's
        problem (one restart each) matched by :meth:`stacked_objective` with its own match plan, each
        result marked as :meth:`reconstruct` marks it. ``None`` also where the attacks' knowledge differs
        (by what it describes, or by value: each view's stacked objective must equal its own attack's at its
        start), where it does not cover some view (that view's fallback runs alone), where the match does
        not stack, or for a subclass with an objective of its own."""
        own = ("objective", "reconstruct", "stacked_objective", "reconstruct_side_by_side")
        if self._first_override(DefenseAwareInversion, own) is not None:
            return None
        if self.restarts != 1 or not self._alike(attacks, views):
            return None
        knowing = cast(Sequence[DefenseAwareInversion], attacks)
        if not self._knowledge_alike(knowing, views):
            return None
        prepared = [attack._prepare(view) for attack, view in zip(knowing, views)]
        views = [view for view, _ in prepared]
        plans = [attack._match_plan(view) for attack, view in zip(knowing, views)]
        labels = [known_or_recovered_labels(view) for view in views]
        chunk = self._side_by_side_chunk(views)
        objectives = [
            self.stacked_objective(views[i : i + chunk], labels[i : i + chunk], plans=plans[i : i + chunk])
            for i in range(0, len(views), chunk)
        ]
        if any(objective is None for objective in objectives):
            return None
        starts = torch.stack([random_images(view, generator) for view, generator in prepared])
        for i, objective in enumerate(objectives):
            rows = slice(i * chunk, (i + 1) * chunk)
            alone = [
                _own_objective(a, v, y, plan)
                for a, v, y, plan in zip(knowing[rows], views[rows], labels[rows], plans[rows])
            ]
            if not stacked_rows_agree(cast(Callable[[Tensor], Tensor], objective), alone, starts[rows]):
                return None
        low, high = (torch.stack(bound) for bound in zip(*(view.data_bounds() for view in views)))
        finals, images, traces = self._optimize_chunks(
            starts, chunk, lambda rows: cast(Callable[[Tensor], Tensor], objectives[rows.start // chunk]),
            lambda rows: (low[rows], high[rows]),
        )  # fmt: skip
        results = self._kept_restarts(labels, finals, images, traces)
        return [_mark(r, a.knowledge, view, plan, None) for r, a, view, plan in zip(results, knowing, views, plans)]


def _own_objective(
    attack: DefenseAwareInversion, view: ServerView, labels: Tensor, plan: MatchPlan
) -> Callable[[Tensor], Tensor]:
    """``attack``'s own objective on ``view`` with ``plan`` as its running match plan."""
    attack._plan = plan
    try:
        return attack.objective(view, labels)
    finally:
        attack._plan = None


class DefenseAwareIDLG(_KnowsTheDefense, IDLG):
    """iDLG (analytic labels, squared L2 distance, L-BFGS) that models the defense: the L2 match runs
    on the layers and entries of :meth:`DefenseKnowledge.plan`, each layer weighted by its Wiener
    gain when the noise is known. A straight-through transform (quantisation) is not applied here:
    its piecewise-constant forward pass stalls L-BFGS' line search; the support still is.

    Args:
        knowledge: what the server knows of the defense.
        iterations, restarts, lr, max_iter, line_search, tolerance: as :class:`~lightning_gp.attacks.DLG`
            (restarts matter here: an L-BFGS run either converges to the client's image or stalls).
    """

    def __init__(self, knowledge: DefenseKnowledge, iterations: int = 300, restarts: int = 4, **kwargs) -> None:
        super().__init__(iterations=iterations, restarts=restarts, **kwargs)
        self._init_knowledge(knowledge)

    def dummy_gradient(self, view: ServerView, images: Tensor, targets: Tensor) -> dict[str, Tensor]:
        return self.knowledge.dummy_gradient(view, images, targets, straight_through=False)

    def gradient_distance(self, guess: dict[str, Tensor], shared: dict[str, Tensor]) -> Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("DefenseAwareIDLG.gradient_distance runs inside reconstruct only")
        return squared_l2_distance(plan.restrict(guess), plan.target, plan.names)

    def _stacked_objective(
        self, views: Sequence[ServerView], labels: Sequence[Tensor], count: int, peers: Sequence[DLG] | None = None
    ) -> Callable[[Tensor, Tensor], Tensor] | None:
        """The restarts' match through the knowledge (:func:`stacked_match`), each view's rows through
        its attack's match plan (the running one, else the knowledge's); ``None`` where the transform is
        straight-through (this attack leaves that stage out, the stacked match would not)."""
        if getattr(self.knowledge.transform, "straight_through", False):
            return None
        plans = [cast(DefenseAwareIDLG, peer)._plan for peer in (peers or [self] * len(views))]
        known = None if any(plan is None for plan in plans) else cast(list[MatchPlan], plans)
        return stacked_match(self.knowledge, views, labels, squared_l2_distance, repeats=count, plans=known)

    def _published(self) -> GradientAttack:
        """The published iDLG of this attack's budget: what runs when the knowledge does not cover the client."""
        return IDLG(
            iterations=self.iterations, restarts=self.restarts, lr=self.lr, max_iter=self.max_iter,
            line_search=self.line_search, tolerance=self.tolerance, plateau_steps=self.plateau_steps,
            plateau_rtol=self.plateau_rtol, observer=self.observer, seed=self.seed, device=self.device,
            progress_every=self.progress_every,
        )  # fmt: skip

    def reconstruct(self, view: ServerView) -> Reconstruction:
        return self._reconstruct_knowing(view, self._published, super().reconstruct)

    def reconstruct_side_by_side(
        self, attacks: Sequence[GradientAttack], views: Sequence[ServerView]
    ) -> list[Reconstruction] | None:
        """As :meth:`DLG.reconstruct_side_by_side <lightning_gp.attacks.DLG.reconstruct_side_by_side>`,
        through the knowledge: each client's runs matched with its own match plan, each result marked as
        :meth:`reconstruct` marks it. ``None`` also where the attacks' knowledge differs (by what it
        describes, or by value at the clients' first starts) or does not cover some client (that client's
        fallback runs alone), or for a subclass with a reconstruction of its own (the noise-aware MAP
        attack's two stages)."""
        if self._first_override(DefenseAwareIDLG, ("reconstruct",)) is not None or not self._alike(attacks, views):
            return None
        knowing = cast(Sequence[DefenseAwareIDLG], attacks)
        if not self._knowledge_alike(knowing, views):
            return None
        prepared = [attack._prepare(view) for attack, view in zip(knowing, views)]
        plans = [attack._match_plan(view) for attack, (view, _) in zip(knowing, prepared)]
        for attack, plan in zip(knowing, plans):
            attack._plan = plan
        try:
            runs = self._clients_side_by_side(knowing, prepared)
        finally:
            for attack in knowing:
                attack._plan = None
        if runs is None:
            return None
        return [
            _mark(r, a.knowledge, view, plan, None) for r, a, (view, _), plan in zip(runs, knowing, prepared, plans)
        ]


# ------------------------------------------------------------------------------ compositions
class ComposedTransform:
    """Known transforms applied one after another, in the order the pipeline applies the defenses.

    ``straight_through`` is true when any stage is straight-through (quantisation); iDLG's L-BFGS
    then runs :meth:`without_straight_through`, the other stages alone (a clip before a
    quantisation is still applied)."""

    stages: tuple[KnownTransform, ...]

    def __init__(self, stages: Sequence[KnownTransform]) -> None:
        flat: list[KnownTransform] = []
        for i, stage in enumerate(stages):
            if not callable(stage):
                raise TypeError(f"stages[{i}] must be a callable transform, got {type(stage).__name__}")
            flat += list(stage.stages) if isinstance(stage, ComposedTransform) else [stage]
        self.stages = tuple(flat)

    @property
    def straight_through(self) -> bool:
        return any(getattr(stage, "straight_through", False) for stage in self.stages)

    def without_straight_through(self) -> ComposedTransform:
        return ComposedTransform([s for s in self.stages if not getattr(s, "straight_through", False)])

    def __call__(self, gradients: dict[str, Tensor]) -> dict[str, Tensor]:
        for stage in self.stages:
            gradients = stage(gradients)
        return gradients


def _hides_zeros(stage: DefenseKnowledge) -> bool:
    """The stage adds noise on every coordinate (no support of its own): earlier exact zeros are gone."""
    if stage.support or stage.noise_std is None:
        return False
    return callable(stage.noise_std) or float(stage.noise_std) > 0


def compose_knowledge(stages: Sequence[DefenseKnowledge]) -> DefenseKnowledge:
    """One knowledge of a client that ran ``stages`` (each defense's knowledge) one after another,
    in the order the pipeline applies them. One stage is returned as it is.

    - **models**: the union of the stages' (empty, i.e. no check, if any stage has none);
      ``defense`` is their names joined by ``+``.
    - **per-example clip** (DP-SGD): the runner clips each example's gradient before any defense
      stage runs, wherever it stands in the list, so that stage is moved first; two are refused.
    - **transforms**: applied in order to the dummy gradient (e.g. a clip, then a quantisation). A
      transform after a noising stage is applied to the noiseless dummy, not to the noised gradient
      the client transformed (noted in ``caveats``).
    - **noise**: independent noises add in variance, ``sigma = sqrt(sum sigma_i^2)`` (a function of
      the view if any stage's is). The std is carried through later stages unchanged: exact for
      pruning (a sent entry keeps its noise), an upper bound after a clip (1-Lipschitz); the
      rounding error a later quantisation adds to the noise is not counted (as for quantisation
      alone). The noise law is the noising stage's when there is one, else Gaussian (noted in
      ``caveats`` when a Laplace or data-dependent noise is among them); a data-dependent variance
      (optimal noise) is kept only when its stage is the one noise.
    - **support**: used when a stage reveals one (exact zeros) and no later stage noises every
      coordinate (GaussianNoise, LaplaceNoise, DP-SGD); a support such a stage hides is dropped:
      every entry is matched with the Wiener weights of the total noise, and ``caveats`` says so.
      A later quantisation keeps the zeros (its own rounded-to-zero entries then leave the match).
    - **skip_layers**: the union; **fallback_reason**: the stages' reasons, joined.
    - **coordinate weights / view transforms** (GradDefense, Outpost) are computed from the shared
      gradient as if their defense ran alone: a composition with one is refused (``ValueError``).
    """
    _check_stages(stages)
    if len(stages) == 1:
        return stages[0]
    names = [stage.defense or f"stage {i}" for i, stage in enumerate(stages)]
    _refuse_per_view_stages(stages, names)
    stages, names = _clipping_stage_first(stages, names)
    caveats: list[str] = [c for s in stages for c in s.caveats]
    support, hidden_supports = _composed_support(stages, names)
    caveats += hidden_supports + _transform_caveats(stages, names)
    noise_std = _composed_noise_std(stages)
    noise_law, noise_variance, law_caveats = _composed_noise_law(stages, names)
    caveats += law_caveats
    reasons = [s.fallback_reason for s in stages if s.fallback_reason]
    return DefenseKnowledge(
        defense="+".join(names),
        models=() if any(not s.models for s in stages) else tuple(dict.fromkeys(m for s in stages for m in s.models)),
        support=support,
        transform=_composed_transform(stages),
        per_example_clip=stages[0].per_example_clip,
        noise_std=noise_std,
        skip_layers=tuple(dict.fromkeys(layer for s in stages for layer in s.skip_layers)),
        fallback_reason="; ".join(reasons) if reasons else None,
        caveats=tuple(dict.fromkeys(caveats)),
        noise_law=noise_law,
        noise_variance=noise_variance,
    )


def _check_stages(stages: Sequence[DefenseKnowledge]) -> None:
    """``stages`` is a non-empty sequence (not a string) of :class:`DefenseKnowledge`."""
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence):
        raise TypeError(f"stages must be a sequence of DefenseKnowledge, got {type(stages).__name__}")
    for i, stage in enumerate(stages):
        if not isinstance(stage, DefenseKnowledge):
            raise TypeError(f"stages[{i}] must be a DefenseKnowledge, got {type(stage).__name__}")
    if not stages:
        raise ValueError("stages must hold at least one DefenseKnowledge")


def _refuse_per_view_stages(stages: Sequence[DefenseKnowledge], names: list[str]) -> None:
    """A stage whose weights or transform are read from the shared gradient does not compose."""
    per_view = [
        names[i] for i, s in enumerate(stages) if s.coordinate_weights is not None or s.view_transform is not None
    ]
    if per_view:
        raise ValueError(
            f"cannot compose {names}: the per-entry weights or view transform of {per_view} are computed from the "
            "shared gradient as if that defense ran alone"
        )


def _clipping_stage_first(
    stages: Sequence[DefenseKnowledge], names: list[str]
) -> tuple[list[DefenseKnowledge], list[str]]:
    """The stages (and names) with the per-example clip moved first (the runner clips first); two are refused."""
    clipping = [i for i, s in enumerate(stages) if s.per_example_clip is not None]
    if len(clipping) > 1:
        raise ValueError(f"cannot compose {names}: {[names[i] for i in clipping]} all clip per example (one runner)")
    order = clipping + [i for i in range(len(stages)) if i not in clipping]
    return [stages[i] for i in order], [names[i] for i in order]


def _composed_support(stages: list[DefenseKnowledge], names: list[str]) -> tuple[bool, list[str]]:
    """Whether a stage's support reaches the server (no later stage noises over it), and a caveat
    for each support a later noise hides."""
    caveats = []
    support = False
    for i, stage in enumerate(stages):
        if not stage.support:
            continue
        hiders = [names[j] for j in range(i + 1, len(stages)) if _hides_zeros(stages[j])]
        if hiders:
            caveats.append(f"{names[i]}'s pruned entries are noised over by {hiders[0]}: every entry is matched")
        else:
            support = True
    return support, caveats


def _transform_caveats(stages: list[DefenseKnowledge], names: list[str]) -> list[str]:
    """A caveat for each transform that follows a noising stage (it is applied to the noiseless dummy)."""
    caveats = []
    for i, stage in enumerate(stages):
        noised_before = [names[j] for j in range(i) if stages[j].noise_std is not None]
        if stage.transform is not None and noised_before:
            caveats.append(
                f"{names[i]}'s transform is applied to the noiseless dummy gradient; the client applied it after the "
                f"noise of {noised_before}"
            )
    return caveats


def _composed_noise_std(stages: list[DefenseKnowledge]) -> NoiseStd | None:
    """Independent noises add in variance, ``sqrt(sum sigma_i^2)``: a function of the view if any stage's is."""
    noise = [s.noise_std for s in stages if s.noise_std is not None]
    if not noise:
        return None
    if all(not callable(n) for n in noise):
        return math.sqrt(sum(float(cast(float, n)) ** 2 for n in noise))

    def noise_std(view: ServerView) -> float:
        return math.sqrt(sum((float(n(view)) if callable(n) else float(n)) ** 2 for n in noise))

    return noise_std


def _composed_noise_law(
    stages: list[DefenseKnowledge], names: list[str]
) -> tuple[str, NoiseVariance | None, list[str]]:
    """The noise law and data-dependent variance of the composition: the one noising stage's, else a
    Gaussian of the summed variance (and a caveat for what that approximates)."""
    noising = [i for i, s in enumerate(stages) if s.noise_std is not None]
    if len(noising) == 1:
        stage = stages[noising[0]]
        return stage.noise_law, stage.noise_variance, []
    if all(stages[i].noise_law == "gaussian" and stages[i].noise_variance is None for i in noising):
        return "gaussian", None, []
    return "gaussian", None, [f"the noises of {[names[i] for i in noising]} are modelled as one isotropic Gaussian"]


def _composed_transform(stages: list[DefenseKnowledge]) -> KnownTransform | None:
    """The stages' transforms in order: none, the one, or a :class:`ComposedTransform` of them."""
    transforms = [s.transform for s in stages if s.transform is not None]
    return None if not transforms else transforms[0] if len(transforms) == 1 else ComposedTransform(transforms)


_Attack = TypeVar("_Attack", bound=GradientAttack)
_MARKED_CLASSES: dict[type, type] = {}


def mark_fallback(attack: _Attack, reason: str, unmodelled: Sequence[str] = ()) -> _Attack:
    """``attack`` (changed in place and returned) with every reconstruction marked
    ``meta["fallback"] = True``, ``meta["fallback_reason"] = reason`` and ``meta["unmodelled"]``: an
    attack that models part of what the client ran. Its class name stays the attack's own (reports
    name attacks by it); a reason the attack gave itself is kept in front of ``reason``."""
    if not isinstance(attack, GradientAttack):
        raise TypeError(f"attack must be a GradientAttack, got {type(attack).__name__}")
    if not isinstance(reason, str) or not reason:
        raise ValueError(f"reason must be a non-empty string, got {reason!r}")
    cls = type(attack)
    base = cast(type[GradientAttack], getattr(cls, "_unmarked_class", cls))
    marked = _MARKED_CLASSES.get(base)
    if marked is None:

        def reconstruct(self: GradientAttack, view: ServerView) -> Reconstruction:
            result = base.reconstruct(self, view)
            why, missing = self._fallback_marking  # type: ignore[attr-defined]
            own = result.meta.get("fallback_reason") if result.meta.get("fallback") else None
            unmodelled_before = list(result.meta.get("unmodelled", [])) if own else []
            result.meta.update(
                fallback=True,
                fallback_reason=why if not own or own == why else f"{own}; {why}",
                unmodelled=list(dict.fromkeys([*unmodelled_before, *missing])),
            )
            return result

        namespace = {
            "reconstruct": reconstruct,
            "_unmarked_class": base,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
        }
        marked = _MARKED_CLASSES[base] = type(base.__name__, (base,), namespace)
    attack.__class__ = marked
    attack._fallback_marking = (reason, tuple(str(u) for u in unmodelled))  # type: ignore[attr-defined]
    return attack


# ------------------------------------------------------------------------------ the attacks on a knowledge
def defense_aware_attacks(knowledge: DefenseKnowledge, kwargs: dict[str, Any]) -> list[GradientAttack]:
    """The two defense-aware optimisers on ``knowledge``: Inverting Gradients (Adam, cosine) and
    iDLG (L-BFGS, L2, restarts). Budget keys: ``iterations`` (Adam), ``lbfgs_iterations``,
    ``restarts`` (IG's; iDLG keeps at least 4), ``seed``, ``device``, ``progress_every``; any other
    key goes to :class:`DefenseAwareInversion`."""
    kwargs = dict(kwargs)
    common = {k: kwargs.pop(k) for k in ("seed", "device", "progress_every") if k in kwargs}
    lbfgs_iterations = kwargs.pop("lbfgs_iterations", 100)
    restarts = kwargs.get("restarts", 1)
    return [
        DefenseAwareInversion(knowledge, **kwargs, **common),
        DefenseAwareIDLG(knowledge, iterations=lbfgs_iterations, restarts=max(4, restarts), **common),
    ]


def defense_aware_inversion(knowledge: DefenseKnowledge, kwargs: dict[str, Any]) -> list[GradientAttack]:
    """The defense-aware Inverting Gradients alone (Adam), for a knowledge whose transform L-BFGS
    cannot use (quantisation: without the straight-through rounding iDLG is the published one)."""
    kwargs = dict(kwargs)
    kwargs.pop("lbfgs_iterations", None)
    return [DefenseAwareInversion(knowledge, **kwargs)]


# ------------------------------------------------------------------------------ registered here
# What the server knows of each defense whose adaptive attack is the defense-aware pair (or, for
# quantisation, its Adam half); GradDefense's and Outpost's are in perturbation_aware, the noise
# defenses' (the pair and the noise-aware MAP) in noise_aware.
def class_knowledge(target: Any, **options: Any) -> DefenseKnowledge:
    """The knowledge of ``target``, named by its class and modelling exactly it."""
    name = type(target).__name__
    return DefenseKnowledge(defense=name, models=(name,), **options)


# Soteria's pruned columns arrive as exact zeros: the support-restricted match skips them
@register_defense_knowledge(Soteria)
@register_defense_knowledge(OptimalGradientPruning)
@register_defense_knowledge(SparsifyingDefense)
def _pruning(target: Any) -> DefenseKnowledge:
    if not getattr(target, "mask_reads_gradient_alone", False):
        return class_knowledge(target, support=True)
    return class_knowledge(target, support=True, client_selection=own_mask(target))


def own_mask(target: SparsifyingDefense) -> KnownTransform:
    """``target``'s own keep-mask, computed on the (detached) dummy gradient and applied as a product,
    so the kept entries stay differentiable: a pruning whose mask of a layer reads that layer alone."""

    def prune(gradients: dict[str, Tensor]) -> dict[str, Tensor]:
        masks = target.select({n: g.detach() for n, g in gradients.items()}, torch.Generator())
        return {n: g * masks[n].to(g.dtype) for n, g in gradients.items()}

    return prune


@register_defense_knowledge(GradientQuantization, attacks=defense_aware_inversion)
def _quantization(target: Any) -> DefenseKnowledge:
    # A zero of a quantised layer says |g| < m / 2L, not "not sent": every entry is matched. The
    # rounding is applied straight-through (stochastic rounding is unbiased: nothing to apply).
    # Only the Adam attack (defense_aware_inversion): L-BFGS cannot use the straight-through
    # rounding, and without it it is the published iDLG.
    transform = None if target.stochastic_rounding else straight_through_quantization(target.bits)
    return class_knowledge(target, support=False, transform=transform)


def dp_sgd_knowledge(target: Any) -> DefenseKnowledge:
    """What the server knows of a :class:`~lightning_gp.callbacks.DPSGD` client (registered beside
    ``DPSGD``): each example clipped to ``max_grad_norm``, Gaussian noise of the multiplier used."""

    def noise_std(view: ServerView) -> float:
        sigma = target.noise_multiplier_used if target.noise_multiplier_used is not None else target.noise_multiplier
        if sigma is None:
            raise ValueError("DPSGD has not chosen its noise multiplier yet (it does at fit start)")
        return float(sigma) * target.max_grad_norm / view.batch_size

    return class_knowledge(target, support=False, per_example_clip=target.max_grad_norm, noise_std=noise_std)
