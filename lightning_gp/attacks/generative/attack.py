"""Gradient inversion through a generative image prior: GGL and GIAS.

Li, Zhang, Liu, Liu, "Auditing Privacy Defenses in Federated Learning via Generative Gradient
Leakage" (GGL, CVPR 2022): the reconstruction is ``x = G(z)`` for a generator ``G`` trained on public
data only, and the latent is searched so that the gradient of ``G(z)`` *through the defense's own
transform* ``T`` matches the shared one (their Eq. 4):

    z* = argmin_z  D(T(grad_theta L(G(z), y)), g_shared) + lambda_z R(z),

``R`` the KL divergence of ``z``'s per-sample mean and variance from the prior ``N(0, 1)`` (their
latent regulariser), ``D`` a gradient distance. Where ``T`` is differentiable the search is
gradient descent (Adam); where it is not (quantisation: a zero gradient almost everywhere) it is
CMA-ES (Hansen 2016; :mod:`~lightning_gp.attacks.generative.cmaes`), GGL's choice (their Sec. 3.3).

Jeon, Kim, Kwon, Lee, Ok, Cho, "Gradient Inversion with Generative Image Prior" (GIAS, NeurIPS
2021, Eqs. 4-5): after the latent search, a second stage optimises the generator's parameters
``w`` from the trained ones at the latent found, ``w* = argmin_w D(grad(G_w(z*)), g_shared)``, so
the image may leave the generator's range where the gradient asks for it
(``refine_generator=True``; kept only where it matches the gradient better).

What the server knows of the defense is a :class:`~lightning_gp.attacks.DefenseKnowledge`, used
exactly as :class:`~lightning_gp.attacks.DefenseAwareInversion` uses it: the dummy gradient goes
through :meth:`~lightning_gp.attacks.DefenseKnowledge.dummy_gradient` and the match plan
(:meth:`~lightning_gp.attacks.DefenseKnowledge.plan`: sent entries, per-layer noise weights,
skipped layers). Without knowledge the attack is the published one: the plain cosine (or squared
L2) match of every layer. A transform marked ``straight_through`` (quantisation) is the
non-differentiable case: ``optimizer="auto"`` runs CMA-ES on its exact forward pass there.

**The prior-only control** (:meth:`GenerativeGradientLeakage.prior_only_guesses`): a generator
turns any gradient into a plausible image of the task, so the audit credits a reconstruction only
where it beats what the attack makes of gradients that say nothing of the attacked batch. As for the
refined learned inverter, those are the attack run end to end on ``decoys`` public batches held out
from the generator's training, each defended as the server can reproduce the defense (see
:meth:`GenerativeGradientLeakage.decoy_gradients`).
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_gp.attacks.adaptive import DefenseKnowledge, stacked_match
from lightning_gp.attacks.base import AttackNotApplicable, GradientAttack, Reconstruction
from lightning_gp.attacks.generative.cmaes import cma_es
from lightning_gp.attacks.generative.networks import Generator, check_image_shape
from lightning_gp.attacks.generative.training import (
    DEFAULT_GENERATOR_CACHE,
    GeneratorCache,
    GeneratorConfig,
    GeneratorKey,
    TrainedGenerator,
    train_generator,
)
from lightning_gp.attacks.gradient_matching import cosine_distance, parameter_gradients, squared_l2_distance
from lightning_gp.attacks.learned import DefenseSimulator, model_fingerprint, tensor_fingerprint
from lightning_gp.attacks.monitor import tick
from lightning_gp.attacks.optimization import known_or_recovered_labels, plateaued
from lightning_gp.attacks.registry import Budget, register_attack
from lightning_gp.attacks.searches import (
    BATCHED_IMAGES,
    adam_searches,
    best_restarts,
    decoy_guesses,
    step_decay,
)
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.view import ServerView, checked_public_data
from lightning_gp.normalization import normalize
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import (
    check_bool,
    check_choice,
    check_int,
    check_nonnegative,
    check_number,
    check_positive,
    check_positive_int,
)

Distance = Literal["cosine", "l2"]
Optimizer = Literal["auto", "adam", "cmaes"]
#: ``match(images) -> distance``: the gradient match of normalised images ``[B, C, H, W]``.
Match = Callable[[Tensor], Tensor]

#: Public batches attacked end to end for the prior-only control (a 1-in-32 test per metric), as
#: :data:`~lightning_gp.attacks.learned.REFINED_DECOYS`: each is a whole latent search.
DECOYS = 31
#: The fewest public images a generator is trained on (two held out, two to train on).
MIN_PUBLIC = 4
#: Prior-only guesses kept per process (each set costs ``decoys`` latent searches).
_MEMO_SIZE = 32
#: key -> (the knowledge the guesses were made with, held so that no object id in the key is reused; the guesses)
_PRIOR_ONLY_MEMO: OrderedDict[tuple[Any, ...], tuple[DefenseKnowledge | None, Tensor]] = OrderedDict()


def _published(budget: Budget, seed: int, model: nn.Module) -> GradientAttack:
    """The published GGL of ``budget``: Adam latent search of ``ig_iterations`` steps at most."""
    return GenerativeGradientLeakage(iterations=budget.ig_iterations, seed=seed)


@register_attack("GGL", order=8, build=_published)
class GenerativeGradientLeakage(GradientAttack):
    """GGL (Li et al., CVPR 2022, Eq. 4) and, with ``refine_generator``, GIAS (Jeon et al., NeurIPS
    2021, Eqs. 4-5): gradient matching in the latent space of a generator trained on public images
    (module docstring). Images ``C x 28 x 28`` and ``C x 32 x 32`` (others:
    :class:`~lightning_gp.attacks.AttackNotApplicable`).

    Args:
        knowledge: what the server knows of the defense (``None``: the published attack, no defense
            modelled). A client that ran a defense it does not model gets the published attack,
            marked ``meta["fallback"]``.
        public_data: ``(images, labels)`` the server holds, normalised like the clients' inputs
            (default: each view's :attr:`~lightning_gp.attacks.ServerView.public_data`).
        generator_config: the generator's architecture and training (:class:`GeneratorConfig`).
        cache: where trained generators are kept (default: :data:`DEFAULT_GENERATOR_CACHE`).
        iterations: the cap on Adam steps of each restart's latent search (it stops earlier on a
            plateau: ``plateau_steps``, ``plateau_rtol``, as :func:`~lightning_gp.attacks.optimization.plateaued`).
        restarts: independent latent searches; the best gradient match wins.
        lr: Adam's learning rate on ``z`` (divided by 10 at 3/8, 5/8 and 7/8 of ``iterations``).
        latent_weight: ``lambda_z``, the weight of the latent regulariser ``R(z)``.
        distance: ``"cosine"`` (GIAS, Inverting Gradients) or ``"l2"`` (GGL's squared L2).
        optimizer: ``"adam"``, ``"cmaes"`` or ``"auto"`` (CMA-ES where the known transform is
            straight-through, i.e. not differentiable; Adam elsewhere).
        cma_generations, cma_population, cma_sigma: CMA-ES' cap on generations, its population
            ``lambda`` (default ``4 + floor(3 ln n)``) and initial step size (from ``z = 0``).
        refine_generator, refine_iterations, refine_lr: GIAS' second stage on the generator's weights.
        decoys: public batches attacked end to end for :meth:`prior_only_guesses`.
        simulate: the server's exact simulation of the client's defense
            (:data:`~lightning_gp.attacks.learned.DefenseSimulator`), used for the decoys' gradients.
        defense_key: names the defense (the setting) the decoys are made for, as the learned
            inverter's: required with ``simulate``; without it the decoys are keyed by the
            knowledge object itself (one attack per setting then shares them across clients only if
            its clients' attacks share that object).
        prior_seed: seeds what is built once per data set or setting and shared by every client's
            attack: the generator's training and the decoys (``seed`` seeds each client's restarts).
    """

    # class D: a generator trained on the server's public (surrogate) data, the training details known
    requires = requirements("basic_knowledge", "training_details", "surrogate_data")

    def __init__(
        self,
        *,
        knowledge: DefenseKnowledge | None = None,
        public_data: tuple[Tensor, Tensor] | None = None,
        generator_config: GeneratorConfig | None = None,
        cache: GeneratorCache | None = None,
        iterations: int = 500,
        restarts: int = 4,
        lr: float = 0.1,
        latent_weight: float = 0.01,
        distance: Distance = "cosine",
        optimizer: Optimizer = "auto",
        cma_generations: int = 150,
        cma_population: int | None = None,
        cma_sigma: float = 1.0,
        plateau_steps: int = 50,
        plateau_rtol: float = 1e-3,
        refine_generator: bool = False,
        refine_iterations: int = 200,
        refine_lr: float = 1e-4,
        decoys: int = DECOYS,
        simulate: DefenseSimulator | None = None,
        defense_key: str | None = None,
        prior_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if knowledge is not None and not isinstance(knowledge, DefenseKnowledge):
            raise TypeError(f"knowledge must be a DefenseKnowledge or None, got {type(knowledge).__name__}")
        self.knowledge = knowledge
        self.public_data = checked_public_data(public_data)
        self.generator_config = GeneratorConfig() if generator_config is None else generator_config
        if not isinstance(self.generator_config, GeneratorConfig):
            raise TypeError(f"generator_config must be a GeneratorConfig, got {type(generator_config).__name__}")
        self.cache = DEFAULT_GENERATOR_CACHE if cache is None else cache
        if not isinstance(self.cache, GeneratorCache):
            raise TypeError(f"cache must be a GeneratorCache, got {type(cache).__name__}")
        self._init_search(iterations, restarts, lr, latent_weight, distance, optimizer, plateau_steps, plateau_rtol)
        self.cma_generations = check_positive_int(cma_generations, "cma_generations")
        self.cma_population = None if cma_population is None else check_int(cma_population, "cma_population", low=2)
        self.cma_sigma = check_positive(cma_sigma, "cma_sigma")
        self.refine_generator = check_bool(refine_generator, "refine_generator")
        self.refine_iterations = check_positive_int(refine_iterations, "refine_iterations")
        self.refine_lr = check_positive(refine_lr, "refine_lr")
        self.decoys = check_positive_int(decoys, "decoys")
        if simulate is not None and not callable(simulate):
            raise TypeError(
                f"simulate must be callable (model, images, labels, seed) or None, got {type(simulate).__name__}"
            )
        if defense_key is not None and (not isinstance(defense_key, str) or not defense_key):
            raise ValueError(f"defense_key must be a non-empty str naming the defense, got {defense_key!r}")
        if simulate is not None and defense_key is None:
            raise ValueError("defense_key must name the defense that simulate replays (the decoys are keyed by it)")
        self.simulate = simulate
        self.defense_key = defense_key
        self.prior_seed = check_int(prior_seed, "prior_seed", low=0)

    def _init_search(
        self,
        iterations: int,
        restarts: int,
        lr: float,
        latent_weight: float,
        distance: str,
        optimizer: str,
        plateau_steps: int,
        plateau_rtol: float,
    ) -> None:
        self.iterations = check_positive_int(iterations, "iterations")
        self.restarts = check_positive_int(restarts, "restarts")
        self.lr = check_positive(lr, "lr")
        self.latent_weight = check_nonnegative(latent_weight, "latent_weight")
        self.distance = check_choice(distance, "distance", ("cosine", "l2"))
        self.optimizer = check_choice(optimizer, "optimizer", ("auto", "adam", "cmaes"))
        self.plateau_steps = check_int(plateau_steps, "plateau_steps", low=0)
        self.plateau_rtol = check_number(plateau_rtol, "plateau_rtol", low=0.0, high=1.0)

    def __repr__(self) -> str:
        known = "published" if self.knowledge is None else self.knowledge.describe()
        return f"{type(self).__name__}({known}{', GIAS' if self.refine_generator else ''})"

    # ------------------------------------------------------------------------------ the generator
    def _public(self, view: ServerView) -> tuple[Tensor, Tensor]:
        """The public ``(images, labels)`` the generator is trained on (``AttackNotApplicable`` without any)."""
        public = self.public_data if self.public_data is not None else view.public_data
        if public is None:
            raise AttackNotApplicable(
                f"{type(self).__name__} trains its generator on the server's public images: the view holds none "
                "(view.public_data) and none were given (public_data)"
            )
        if len(public[0]) < MIN_PUBLIC:
            raise AttackNotApplicable(
                f"{type(self).__name__}: {len(public[0])} public images are too few to train a generator "
                f"(at least {MIN_PUBLIC})"
            )
        if tuple(public[0].shape[1:]) != tuple(view.input_shape):
            raise ValueError(
                f"public_data holds images of shape {tuple(public[0].shape[1:])}, the view's are {view.input_shape}"
            )
        return public

    def generator_key(self, view: ServerView) -> GeneratorKey:
        """The cache key of the generator that attacks ``view``: its public pixels, shape, configuration and seed."""
        self._check_shape(view)
        pixels = view.denormalize(self._public(view)[0].to(view.device))
        shape = tuple(int(s) for s in view.input_shape)
        return GeneratorKey(tensor_fingerprint(pixels), shape, repr(self.generator_config), self.prior_seed)

    def generator(self, view: ServerView, key: GeneratorKey | None = None) -> TrainedGenerator:
        """The generator for ``view``'s data (of ``key``, default :meth:`generator_key`): cached, or
        trained now on the public images."""
        key = self.generator_key(view) if key is None else key

        def train() -> TrainedGenerator:
            pixels = view.denormalize(self._public(view)[0].to(view.device)).cpu()
            log = (lambda line: print(f"[{type(self).__name__}] {line}", flush=True)) if self.progress_every else None
            return train_generator(pixels, self.generator_config, self.prior_seed, report=self._training_tick, log=log)

        trained = self.cache.get(key, train)
        trained.generator.to(view.device).eval().requires_grad_(False)  # the latent search moves z only
        return trained

    def _training_tick(self, step: int, total: int, value: float) -> None:
        tick(type(self).__name__, step, total, value)  # within monitored(): a heartbeat, or a requested stop

    def _check_shape(self, view: ServerView) -> None:
        try:
            check_image_shape(tuple(view.input_shape))
        except ValueError as err:
            raise AttackNotApplicable(f"{type(self).__name__}: {err}") from err

    # -------------------------------------------------------------------------------- the attack
    def reconstruct(self, view: ServerView) -> Reconstruction:
        self._check_shape(view)
        knowledge, reason = self._knowledge_for(view, warn=True)
        prepared, generator = self._prepare(view)
        (result,) = self._attack([prepared], [generator], knowledge)
        return self._marked(result, prepared, knowledge, reason)

    def _knowledge_for(self, view: ServerView, *, warn: bool) -> tuple[DefenseKnowledge | None, str | None]:
        """The knowledge to match with on ``view`` (``None``: the published match) and why it is not
        used where the knowledge does not cover what the client ran (warned with ``warn``)."""
        if self.knowledge is None:
            return None, None
        if warn:
            reason = self.knowledge.fallback(view, type(self).__name__)
        else:
            missing = self.knowledge.unmodelled(view)
            reason = f"not modelled: {missing}" if missing else self.knowledge.fallback_reason
        return (None, reason) if reason is not None else (self.knowledge, None)

    def _marked(
        self, result: Reconstruction, view: ServerView, knowledge: DefenseKnowledge | None, reason: str | None
    ) -> Reconstruction:
        """``result`` with what was modelled of the defense in ``meta`` (as the defense-aware attacks write it)."""
        if self.knowledge is None:
            return result
        result.meta["defense"] = self.knowledge.defense
        if reason is not None:
            result.meta.update(fallback=True, fallback_reason=reason, unmodelled=self.knowledge.unmodelled(view))
            return result
        assert knowledge is not None
        plan = knowledge.plan(view)
        sent = sum(int(plan.support[n].sum()) for n in plan.names)
        total = sum(view.gradients[n].numel() for n in plan.names)
        result.meta.update(fallback=False, support_fraction=sent / total if total else 0.0, matched_layers=plan.names)
        if knowledge.caveats:
            result.meta["caveats"] = list(knowledge.caveats)
        return result

    def method(self, knowledge: DefenseKnowledge | None) -> str:
        """``"adam"`` or ``"cmaes"``: the latent search run with ``knowledge`` (see ``optimizer``)."""
        if self.optimizer != "auto":
            return self.optimizer
        transform = None if knowledge is None else knowledge.transform
        return "cmaes" if transform is not None and getattr(transform, "straight_through", False) else "adam"

    def _attack(
        self, views: Sequence[ServerView], rngs: Sequence[torch.Generator], knowledge: DefenseKnowledge | None
    ) -> list[Reconstruction]:
        """Latent search (and, with ``refine_generator``, GIAS' second stage) on prepared views of one
        model and public data (a client's, or the decoys'), view ``i`` seeded by ``rngs[i]``; the
        Adam searches of all views and restarts run side by side (:meth:`_adam_searches`)."""
        key = self.generator_key(views[0])
        trained = self.generator(views[0], key)
        net = trained.generator
        labels = [known_or_recovered_labels(view) for view in views]
        method = self.method(knowledge)
        if method == "adam":
            found = self._adam_searches(views, labels, net, knowledge, rngs)
        else:
            found = [
                self._cma_search(view, net, self._matcher(view, y, knowledge, differentiable=False), rng)
                for view, y, rng in zip(views, labels, rngs)
            ]
        results = []
        for view, y, (z, objective, trace, info) in zip(views, labels, found):
            with torch.no_grad():
                images = self._images(net, z, view)
            refined: dict[str, Any] = {}
            if self.refine_generator:
                match = self._matcher(view, y, knowledge, differentiable=True)
                images, objective, refined = self._refine(view, net, z, match, images, objective)
            meta = {
                "objective": objective,
                "optimizer": method,
                **info,
                **refined,
                "generator": asdict(trained.cost),
                "generator_key": key.digest(),
            }
            results.append(Reconstruction(images.detach(), y, trace, attack=type(self).__name__, meta=meta))
        return results

    def _images(self, net: nn.Module, z: Tensor, view: ServerView) -> Tensor:
        """``G(z)`` in the model's normalised input space."""
        return normalize(net(z), view.mean, view.std, sample_ndim=len(view.input_shape))

    def _matcher(
        self, view: ServerView, labels: Tensor, knowledge: DefenseKnowledge | None, *, differentiable: bool
    ) -> Match:
        """``D(T(grad L(x, y)), g_shared)`` for images ``x``: through ``knowledge``'s dummy gradient and
        match plan (as :class:`~lightning_gp.attacks.DefenseAwareInversion`), or over every layer of
        the raw gradient without it. ``differentiable``: a graph to the images is built."""
        distance = cosine_distance if self.distance == "cosine" else squared_l2_distance
        if knowledge is None:
            target, names = view.gradients, list(view.gradients)

            def plain(images: Tensor) -> Tensor:
                guess = parameter_gradients(view.model, view.loss_fn, images, labels, create_graph=differentiable)
                return distance(guess, target, names)

            return plain
        plan = knowledge.plan(view)

        def known(images: Tensor) -> Tensor:
            guess = plan.restrict(knowledge.dummy_gradient(view, images, labels))
            return distance(guess, plan.target, plan.names)

        return known

    def _latent_penalty(self, z: Tensor) -> Tensor:
        """``R(z)``: per latent, the KL divergence of ``N(mean(z), var(z))`` from ``N(0, 1)`` (GGL's
        regulariser), summed over the batch; ``[...]`` for ``z`` ``[..., B, d]``."""
        mean, var = z.mean(-1), z.var(-1, unbiased=False).clamp_min(1e-10)
        return (-0.5 * (1 + var.log() - mean.pow(2) - var)).sum(-1)

    # ------------------------------------------------------------------------------------ searches
    def _adam_searches(
        self,
        views: Sequence[ServerView],
        labels: Sequence[Tensor],
        net: Generator,
        knowledge: DefenseKnowledge | None,
        rngs: Sequence[torch.Generator],
    ) -> list[tuple[Tensor, float, list[float], dict[str, Any]]]:
        """Per view, ``restarts`` Adam searches of ``z`` from the prior (drawn from its ``rng``), all
        views' in one loop (:func:`~lightning_gp.attacks.searches.adam_searches`); per view the best
        match (objective included) wins."""
        batch, shape = views[0].batch_size, tuple(views[0].input_shape)
        starts = torch.stack(
            [
                torch.randn(batch, net.latent_dim, generator=rng, device=view.device)
                for view, rng in zip(views, rngs)
                for _ in range(self.restarts)
            ]
        )
        match_rows, rows_per_call, batched = self._row_match(views, labels, knowledge)

        def value_of(z: Tensor, rows: Tensor) -> Tensor:
            images = self._images(net, z.reshape(-1, net.latent_dim), views[0]).reshape(len(z), batch, *shape)
            return match_rows(images, rows) + self.latent_weight * self._latent_penalty(z)

        searched = adam_searches(
            starts, value_of, iterations=self.iterations, lr=self.lr, schedule=step_decay(self.iterations),
            plateau_steps=self.plateau_steps, plateau_rtol=self.plateau_rtol, rows_per_call=rows_per_call,
            report=self._report,
        )  # fmt: skip
        return best_restarts(searched, self.restarts, batched=batched)

    def _row_match(
        self, views: Sequence[ServerView], labels: Sequence[Tensor], knowledge: DefenseKnowledge | None
    ) -> tuple[Callable[[Tensor, Tensor], Tensor], int, bool]:
        """``(images [A, B, C, H, W], rows) -> [A]``: the match of problems ``rows`` (``restarts`` per
        view, view-major), the problems per call, and whether it is vmapped. Vmapped
        (:func:`~lightning_gp.attacks.adaptive.stacked_match`: through the knowledge's clips and each
        view's match plan; on a secure aggregate, the mean of its clients' chunks); one problem at a time
        through :meth:`_matcher` where that does not stack (an aggregate whose clients' own choice of
        entries the server models, a plan's transform of its own view, a model or transform that does
        not map)."""
        distance = cosine_distance if self.distance == "cosine" else squared_l2_distance
        stacked = stacked_match(knowledge, views, labels, distance, repeats=self.restarts)
        if stacked is not None:
            return stacked, max(1, BATCHED_IMAGES // views[0].batch_size), True
        matchers = [self._matcher(view, y, knowledge, differentiable=True) for view, y in zip(views, labels)]

        def one_by_one(images: Tensor, rows: Tensor) -> Tensor:
            return torch.stack([matchers[int(row) // self.restarts](x) for x, row in zip(images, rows)])

        return one_by_one, 1, False

    def _adam(
        self,
        parameters: Sequence[Tensor],
        objective: Callable[[], Tensor],
        snapshot: Callable[[], Any],
        iterations: int,
        lr: float,
    ) -> tuple[Any, float, list[float], str]:
        """Adam on ``parameters`` (learning rate / 10 at 3/8, 5/8, 7/8 of ``iterations``) until the
        cap, a plateau of the objective or a non-finite value; the best snapshot, its objective, the
        trace and why it stopped."""
        optimizer = torch.optim.Adam(parameters, lr=lr)
        milestones = [int(iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
        best, best_value, trace, stopped = snapshot(), math.inf, [], "iterations"
        for step in range(iterations):
            optimizer.zero_grad(set_to_none=True)
            with torch.enable_grad():
                loss = objective()
            value = float(loss.detach())
            self._report(step, iterations, value)
            if not math.isfinite(value):
                stopped = "non-finite objective"
                break
            trace.append(value)
            if value < best_value:
                best, best_value = snapshot(), value
            if plateaued(trace, self.plateau_steps, self.plateau_rtol):
                stopped = f"plateau (best fell by < {self.plateau_rtol:g} in {self.plateau_steps} steps)"
                break
            loss.backward()
            optimizer.step()
            scheduler.step()
        return best, best_value, trace, stopped

    def _cma_search(
        self, view: ServerView, net: Generator, match: Match, rng: torch.Generator
    ) -> tuple[Tensor, float, list[float], dict[str, Any]]:
        """``restarts`` CMA-ES searches of the flattened ``z`` (``B d`` numbers) from ``z = 0``, step
        ``cma_sigma``; each candidate's value is the exact (not straight-through-differentiated) match."""
        shape = (view.batch_size, net.latent_dim)

        def values(candidates: Tensor) -> Tensor:
            z = candidates.reshape(-1, *shape).float().to(view.device)
            with torch.no_grad():
                images = self._images(net, z.reshape(-1, shape[1]), view).reshape(
                    len(z), view.batch_size, *view.input_shape
                )
            with torch.enable_grad():
                scores = [float(match(x).detach()) for x in images]
            return (
                torch.tensor(scores, dtype=torch.float64) + self.latent_weight * self._latent_penalty(z).double().cpu()
            )

        best: tuple[Tensor, float, list[float], dict[str, Any]] | None = None
        for restart in range(self.restarts):
            seed = int(torch.randint(0, 2**62, (), generator=rng, device=rng.device))
            result = cma_es(
                values, torch.zeros(shape, dtype=torch.float64), self.cma_sigma, generator=torch.Generator().manual_seed(seed),
                population=self.cma_population, max_generations=self.cma_generations, tol_fun=1e-6, report=self._report,
            )  # fmt: skip
            if best is None or result.value < best[1]:
                info = {"restart": restart, "generations": result.generations, "evaluations": result.evaluations}
                best = (
                    result.x.float().to(view.device),
                    result.value,
                    result.trace,
                    {**info, "stopped": result.stopped},
                )
        assert best is not None
        return best

    def _refine(
        self, view: ServerView, net: Generator, z: Tensor, match: Match, images: Tensor, objective: float
    ) -> tuple[Tensor, float, dict[str, Any]]:
        """GIAS' second stage (Jeon et al., Eq. 5): Adam on a copy of the generator's weights at the
        latent found; the refined images are kept only where they match the gradient better (the
        objective here has no latent term: ``z`` is fixed)."""
        tuned = copy.deepcopy(net).eval().requires_grad_(True)
        fixed = z.detach()

        def objective_of_weights() -> Tensor:
            return match(self._images(tuned, fixed, view))

        with torch.enable_grad():
            start = float(match(images).detach())
        snapshot = lambda: copy.deepcopy(tuned.state_dict())  # noqa: E731
        params = [p for p in tuned.parameters() if p.requires_grad]
        state, value, trace, stopped = self._adam(
            params, objective_of_weights, snapshot, self.refine_iterations, self.refine_lr
        )
        kept = math.isfinite(value) and value < start
        meta = {"refined": kept, "refine_steps": len(trace), "refine_stopped": stopped, "refine_objective": value}
        if not kept:
            return images, objective, meta
        tuned.load_state_dict(state)
        with torch.no_grad():
            return self._images(tuned, fixed, view), objective - start + value, meta

    # ------------------------------------------------------------------------ prior-only guesses
    def prior_only_guesses(self, view: ServerView, count: int) -> Tensor:
        """``[K, B, C, H, W]`` normalised images, ``K = min(count, decoys)``: this attack run end to
        end on ``K`` public batches of ``view``'s size, drawn from the images held out from the
        generator's training, whose gradients (:meth:`decoy_gradients`) carry nothing of the attacked
        batch. The control the audit scores the reconstructions against
        (:mod:`lightning_gp.audit.prior_control`): only guesses made the same way are exchangeable with
        the attack's output when the gradient says nothing. Seeded by ``prior_seed`` alone, so every
        client's attack of a setting shares them; computed once per model, batch size, defense and count."""
        check_positive_int(count, "count")
        self._check_shape(view)
        knowledge, _ = self._knowledge_for(view, warn=False)
        prepared, _ = self._prepare(view)
        key = self._prior_only_key(prepared, knowledge, min(count, self.decoys))
        if key not in _PRIOR_ONLY_MEMO:
            guesses = self._decoy_reconstructions(prepared, knowledge, min(count, self.decoys))
            _PRIOR_ONLY_MEMO[key] = (knowledge, guesses)
            while len(_PRIOR_ONLY_MEMO) > _MEMO_SIZE:
                _PRIOR_ONLY_MEMO.popitem(last=False)
        return _PRIOR_ONLY_MEMO[key][1].to(view.device)

    def _prior_only_key(self, view: ServerView, knowledge: DefenseKnowledge | None, count: int) -> tuple[Any, ...]:
        search = (
            self.iterations, self.restarts, self.lr, self.latent_weight, self.distance, self.method(knowledge),
            self.cma_generations, self.cma_population, self.cma_sigma, self.plateau_steps, self.plateau_rtol,
            self.refine_generator, self.refine_iterations, self.refine_lr,
        )  # fmt: skip
        return (
            self.generator_key(view).digest(),
            tensor_fingerprint(self._public(view)[1].float()),
            model_fingerprint(view.model),
            view.batch_size,
            view.labels is None,
            count,
            search,
            self._decoy_signature(view, knowledge),
            self.prior_seed,
        )

    def _decoy_signature(self, view: ServerView, knowledge: DefenseKnowledge | None) -> str:
        """What the decoys' defense depends on: ``defense_key`` where given (the caller names the
        defense), else the knowledge's ``repr`` (its callables by identity: the memo holds the
        knowledge, so no identity is reused) and noise level; and, where the decoys copy the view's
        support, each layer's sent fraction."""
        if self.simulate is not None:
            return f"simulated: {self.defense_key}"
        if self.defense_key is not None:
            known = f"key: {self.defense_key}"
        else:
            known = "published" if knowledge is None else f"{knowledge!r}|noise={knowledge.noise_level(view)}"
        sent = [round(float((g != 0).float().mean()), 2) for g in view.gradients.values()]
        return f"{known}|sent={sent}" if knowledge is None or knowledge.support else known

    def _decoy_reconstructions(self, view: ServerView, knowledge: DefenseKnowledge | None, count: int) -> Tensor:
        images, labels = (t.to(view.device) for t in self._public(view))
        held_out = self.generator(view).held_out.to(view.device)
        if len(held_out) < view.batch_size:
            raise ValueError(
                f"the generator holds out {len(held_out)} public images, fewer than a batch of {view.batch_size}: "
                "give more public images or a larger generator_config.val_fraction"
            )
        return decoy_guesses(
            view, (images, labels), held_out, count, seeded_generator(self.prior_seed, 0xDEC0),
            lambda x, y, k: self.decoy_gradients(view, x, y, k),
            lambda k: seeded_generator(self.prior_seed, 0xDEC1, k, device=view.device),
            lambda decoys, rngs: self._attack(decoys, rngs, knowledge),
        )  # fmt: skip

    def decoy_gradients(self, view: ServerView, images: Tensor, labels: Tensor, index: int) -> dict[str, Tensor]:
        """What a client holding the public batch ``(images, labels)`` would share, as far as the
        server can reproduce the defense: ``simulate`` where given (exact); else the gradient through
        the knowledge's deterministic part (:meth:`~lightning_gp.attacks.DefenseKnowledge.dummy_gradient`),
        with, where the client's upload reveals a support (exact zeros) and the knowledge matches on
        one (or no knowledge is given), each layer's largest entries kept in the count the client sent,
        and the knowledge's noise (its std and law) added. The published attack (no knowledge) thus
        assumes an undefended client but for the zeros it sees: its control under a noise defense is
        that of clean gradients (approximate; the adaptive attack's is not)."""
        if self.simulate is not None:
            seed = int(seeded_generator(self.prior_seed, 0xDEC5, index).initial_seed() % (2**62))
            shared = self.simulate(copy.deepcopy(view.model), images[None], labels[None], seed)
            return {n: g[0].detach() for n, g in shared.items()}
        knowledge, _ = self._knowledge_for(view, warn=False)
        with torch.enable_grad():
            if knowledge is None:
                raw = parameter_gradients(view.model, view.loss_fn, images, labels, create_graph=False)
            else:
                raw = knowledge.dummy_gradient(view, images, labels)
        gradients = {n: g.detach() for n, g in raw.items()}
        if knowledge is None or knowledge.support:
            gradients = sparsified_like(gradients, view.gradients)
        sigma = None if knowledge is None else knowledge.noise_level(view)
        if sigma:
            assert knowledge is not None
            noise_rng = seeded_generator(self.prior_seed, 0xD015E, index, device=view.device)
            gradients = {n: g + _noise(g, sigma, knowledge.noise_law, noise_rng) for n, g in gradients.items()}
        return gradients


def sparsified_like(gradients: dict[str, Tensor], shared: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each layer of ``gradients`` with only its largest-magnitude entries kept, as many as ``shared``'s
    layer has nonzero entries (all where it has no zero)."""
    out = {}
    for name, g in gradients.items():
        kept = int((shared[name] != 0).sum())
        if kept >= g.numel():
            out[name] = g
            continue
        mask = torch.zeros(g.numel(), dtype=torch.bool, device=g.device)
        if kept:
            mask[g.abs().flatten().topk(kept).indices] = True
        out[name] = torch.where(mask.reshape(g.shape), g, torch.zeros_like(g))
    return out


def _noise(like: Tensor, std: float, law: str, generator: torch.Generator) -> Tensor:
    """Noise of standard deviation ``std``, Gaussian or Laplace (scale ``std / sqrt(2)``), shaped like ``like``."""
    if law == "laplace":
        u = torch.rand(like.shape, generator=generator, device=like.device, dtype=like.dtype) - 0.5
        return -(std / math.sqrt(2)) * u.sign() * torch.log1p(-2 * u.abs())
    return std * torch.randn(like.shape, generator=generator, device=like.device, dtype=like.dtype)


__all__ = ["DECOYS", "GenerativeGradientLeakage"]
