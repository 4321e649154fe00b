"""The noise-aware attack: the most probable image given the shared gradient and the defense's noise law.

Balunovic, Dimitrov, Staab and Vechev, "Bayesian Framework for Gradient Leakage" (ICLR 2022): the
Bayes optimal adversary maximises ``log p(g | x) + log p(x)`` (Sec. 3), and the gradient-matching
attacks are that adversary under a noise law and a prior they assume without saying so (Sec. 4: the
squared L2 distance is the Gaussian likelihood, L1 the Laplace one, TV a Laplace prior on pixel
differences). Against a defense whose noise the server knows, :class:`NoiseAwareMAP` writes both out:

- **likelihood** of the shared gradient ``g`` given a guess ``x``, with ``D`` the defense's known
  deterministic part applied to the guess's gradient (a coordinate clip, DP-SGD's per-example clip,
  LocalGaussianMechanism's L2 clip of the whole update: the client clipped before it noised, so the
  clipped gradient is what the noise is added to) and
  ``r = g - D(grad(x))`` over the entries the defense sent:

  - Gaussian noise ``N(0, s_i^2)``: ``sum_i r_i^2 / (2 s_i^2)`` (GaussianNoise, DP-SGD's
    ``sigma C / B``, GradDefense's slice noise, optimal noise's per-entry variance);
  - Laplace noise of scale ``b``: ``sum_i |r_i| / b`` (LaplaceNoise), its kink smoothed to a
    pseudo-Huber within ``b / 10`` of ``|r|`` so that L-BFGS can use it;

- **prior**: a Laplace prior of scale ``beta`` on each difference of neighbouring pixels,
  ``-log p(x) = TV(x) / beta`` (anisotropic TV summed over every pair, in pixels, as Inverting
  Gradients' TV). ``beta`` is not tuned to a dataset: it is the maximum-likelihood estimate of the
  prior's scale from the attack's own maximum-likelihood reconstruction, ``mean |d|`` over its pixel
  differences (empirical Bayes). The noise left in that reconstruction inflates it, so the prior is,
  if anything, weaker than the data's.

Why this helps against one noisy gradient, where the defense-aware matching (per-layer Wiener gains,
which stay near 1) is the published attack in effect: the likelihood gives every entry its own
precision ``1 / s_i^2`` (for data-dependent noise the last layers, whose gradients are large, are not
drowned as under cosine similarity, which weighs entries by the gradient's own size); Laplace noise is
matched in L1, whose estimate has half the variance of the L2 one in the linear regime (the median
against the mean of a Laplace sample); and the prior decides the directions the noisy gradient
leaves undetermined.

The attack runs in two stages, both with L-BFGS (:class:`~lightning_gp.attacks.DLG`'s optimiser,
which stops on convergence), the labels from the last layer's gradient (iDLG,
:func:`~lightning_gp.attacks.recover_labels`) unless the threat model grants them:

1. **maximum likelihood** from ``restarts`` random starts, the run with the lowest negative
   log-likelihood kept;
2. **maximum a posteriori** from that estimate, with the prior scale (and, for a data-dependent
   noise, the per-entry variance: a plug-in estimate) computed at it. The result is projected
   into the data box (pixels in [0, 1]).

Registered here (:func:`~lightning_gp.attacks.registry.register_defense_knowledge`, with
:func:`noise_aware_attacks`: the defense-aware pair plus this attack; the worst case takes the best)
for GaussianNoise, LaplaceNoise, LocalGaussianMechanism, OptimalGradientNoise and OptimalDPSGD; DP-SGD and the GradDefense
callback declare it in their own modules, the pure GradDefense in
:mod:`lightning_gp.attacks.perturbation_aware`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_gp.attacks.adaptive import (
    DefenseAwareIDLG,
    DefenseKnowledge,
    MatchPlan,
    NoiseVariance,
    class_knowledge,
    coordinate_clip,
    defense_aware_attacks,
    stacked_match,
    update_clip,
)
from lightning_gp.attacks.base import GradientAttack, Reconstruction
from lightning_gp.attacks.gradient_matching import (
    gaussian_nll,
    laplace_nll,
    parameter_gradients,
    total_variation,
)
from lightning_gp.attacks.optimization import DLG
from lightning_gp.attacks.registry import register_defense_knowledge
from lightning_gp.attacks.view import ServerView
from lightning_gp.defenses.noise import GaussianNoise, LaplaceNoise, LocalGaussianMechanism
from lightning_gp.defenses.optimal import OptimalDPSGD, OptimalGradientNoise, optimal_noise_variance
from lightning_gp.defenses.sensitivity import gradient_sensitivity
from lightning_gp.normalization import channel_tensor
from lightning_gp.validation import check_nonnegative, check_positive, check_positive_int

#: no entry of a data-dependent noise is trusted beyond this fraction of the isotropic variance: the
#: plug-in variance at an estimate can be near 0 where the client's was not
VARIANCE_FLOOR_RATIO = 1e-2

Scales = Mapping[str, float | Tensor]


class NoiseAwareMAP(DefenseAwareIDLG):
    """The maximum a posteriori image under the defense's known noise law and a TV prior (see the
    module docstring; Balunovic et al., ICLR 2022, Sec. 3-5).

    Args:
        knowledge: what the server knows of the defense; it must know the noise (``noise_std``, or
            ``noise_variance`` for a data-dependent one) and its law (``noise_law``).
        iterations: outer L-BFGS steps of each run (each with ``max_iter`` inner ones); a run stops
            earlier once the objective stops changing.
        restarts: random starts of the maximum-likelihood stage (the lowest likelihood is kept).
        prior_weight: multiplies the prior's log-density: 1 is the Bayesian posterior, 0 drops the
            prior (maximum likelihood only, no second stage).
        prior_scale: the prior's scale ``beta`` in pixels; ``None`` estimates it from the
            maximum-likelihood reconstruction.
        likelihood_smoothing: the Laplace likelihood's ``|r|`` is smoothed within this fraction of
            ``b`` (pseudo-Huber); the TV prior within ``prior_smoothing`` of ``beta``.
        seed, device, progress_every, lr, max_iter, line_search, tolerance: as :class:`~lightning_gp.attacks.DLG`.
    """

    def __init__(
        self,
        knowledge: DefenseKnowledge,
        iterations: int = 100,
        restarts: int = 4,
        *,
        prior_weight: float = 1.0,
        prior_scale: float | None = None,
        likelihood_smoothing: float = 0.1,
        prior_smoothing: float = 0.01,
        **kwargs: Any,
    ) -> None:
        super().__init__(knowledge, iterations=iterations, restarts=restarts, **kwargs)
        if knowledge.noise_std is None and knowledge.noise_variance is None:
            raise ValueError(
                f"NoiseAwareMAP needs the noise of the defense: knowledge {knowledge.describe()!r} has neither "
                "noise_std nor noise_variance"
            )
        self.prior_weight = check_nonnegative(prior_weight, "prior_weight")
        self.prior_scale = None if prior_scale is None else check_positive(prior_scale, "prior_scale")
        self.likelihood_smoothing = check_nonnegative(likelihood_smoothing, "likelihood_smoothing")
        self.prior_smoothing = check_nonnegative(prior_smoothing, "prior_smoothing")
        self._scales: Scales | None = None  # per-entry noise scale of the running stage
        self._beta: float | None = None  # the prior's scale in the MAP stage (None: no prior)
        self._pixels: tuple[Tensor, Tensor] | None = None  # (std, mean) mapping inputs to pixels

    # -------------------------------------------------------------------------------- the objective
    def _match_plan(self, view: ServerView) -> MatchPlan:
        """The entries compared, each at weight 1: the likelihood weighs entries by their noise, not by
        Wiener gains. Per-entry weights the knowledge reads from the view (GradDefense's noised
        slices) stay: an entry of weight ``w`` is modelled as noise of std ``s / sqrt(w)``."""
        if self.knowledge.coordinate_weights is not None:
            return self.knowledge.plan(view)
        return dataclasses.replace(self.knowledge, noise_std=None).plan(view)

    def noise_scales(self, view: ServerView, images: Tensor | None = None, labels: Tensor | None = None) -> Scales:
        """Per matched layer, the std of the Gaussian noise (``noise_law="gaussian"``) or the scale ``b``
        of the Laplace noise: a number, or a tensor of the layer's shape for a data-dependent noise,
        evaluated at ``images, labels`` when given (the isotropic ``noise_std`` otherwise). An entry of
        plan weight ``w`` (GradDefense's slices) has its residual scaled by ``sqrt(w)`` in the plan:
        precision ``w / s^2``."""
        plan = self._require_plan()
        knowledge = self.knowledge
        sigma = knowledge.noise_level(view) or 0.0
        per_entry: dict[str, Tensor] | None = None
        if knowledge.noise_variance is not None and images is not None and labels is not None:
            variance = knowledge.noise_variance(view, images.detach(), labels)
            reference = sigma**2 or float(torch.cat([variance[n].reshape(-1) for n in plan.names]).mean())
            floor = VARIANCE_FLOOR_RATIO * reference
            per_entry = {n: variance[n].to(view.gradients[n].dtype).clamp_min(floor).sqrt() for n in plan.names}
        law = 1 / math.sqrt(2) if knowledge.noise_law == "laplace" else 1.0  # Laplace: b = std / sqrt(2)
        return {n: (per_entry[n] if per_entry is not None else sigma) * law for n in plan.names}

    def gradient_distance(self, guess: dict[str, Tensor], shared: dict[str, Tensor]) -> Tensor:
        """The negative log-likelihood of the shared gradient given the guess's (up to a constant)."""
        plan = self._require_plan()
        if self._scales is None:
            raise RuntimeError("NoiseAwareMAP.gradient_distance runs inside reconstruct only")
        restricted = plan.restrict(guess)
        if self.knowledge.noise_law == "laplace":
            return laplace_nll(restricted, plan.target, self._scales, plan.names, smoothing=self.likelihood_smoothing)
        return gaussian_nll(restricted, plan.target, self._scales, plan.names)

    def _stacked_objective(
        self, views: Sequence[ServerView], labels: Sequence[Tensor], count: int, peers: Sequence[DLG] | None = None
    ) -> Callable[[Tensor, Tensor], Tensor] | None:
        """The maximum-likelihood stage's restarts of its one view at once: the likelihood through the
        knowledge's clips and this attack's plan (:func:`~lightning_gp.attacks.adaptive.stacked_match`);
        ``None`` for several views (each client's noise scales are its own), in the MAP stage (one run),
        or where the transform is straight-through."""
        if (
            len(views) != 1
            or self._beta is not None
            or self._scales is None
            or getattr(self.knowledge.transform, "straight_through", False)
        ):
            return None
        scales, smoothing = self._scales, self.likelihood_smoothing
        laplace = self.knowledge.noise_law == "laplace"

        def likelihood(guess: Mapping[str, Tensor], target: Mapping[str, Tensor], names: Sequence[str]) -> Tensor:
            if laplace:
                return laplace_nll(guess, target, scales, names, smoothing=smoothing)
            return gaussian_nll(guess, target, scales, names)

        return stacked_match(self.knowledge, views, labels, likelihood, repeats=count, plans=[self._require_plan()])

    def image_prior(self, images: Tensor) -> Tensor | None:
        """``TV(pixels) / beta`` in the MAP stage (times ``prior_weight``), nothing in the ML stage."""
        if self._beta is None or self._pixels is None:
            return None
        std, mean = self._pixels
        smoothing = self.prior_smoothing * self._beta
        return (
            self.prior_weight / self._beta * total_variation(images * std + mean, reduction="sum", smoothing=smoothing)
        )

    def negative_log_likelihood(self, view: ServerView, images: Tensor, labels: Tensor) -> Tensor:
        """``-log p(shared gradient | images, labels)`` up to a constant: the objective of the first
        stage (a data-dependent noise's variance taken at ``images``). For diagnostics and tests."""
        prepared, _ = self._prepare(view)
        self._plan = self._match_plan(prepared)
        try:
            noiseless = not self.knowledge.noise_level(prepared) and self.knowledge.noise_variance is None
            plan_names = self._plan.names
            self._scales = dict.fromkeys(plan_names, 1.0) if noiseless else self.noise_scales(prepared, images, labels)
            guess = self.dummy_gradient(prepared, images.to(prepared.device), labels.to(prepared.device))
            return self.gradient_distance(guess, prepared.gradients).detach()
        finally:
            self._plan, self._scales = None, None

    # ------------------------------------------------------------------------------------ the attack
    def reconstruct(self, view: ServerView) -> Reconstruction:
        return self._reconstruct_knowing(view, self._published, self._posterior_mode)

    def _posterior_mode(self, view: ServerView) -> Reconstruction:
        """Stage 1 (maximum likelihood, restarts), then stage 2 (MAP from it); see the module docstring."""
        sample_ndim = len(view.input_shape)
        self._pixels = tuple(  # type: ignore[assignment]
            channel_tensor(v, sample_ndim=sample_ndim, device=view.device) for v in (view.std, view.mean)
        )
        noiseless = not self.knowledge.noise_level(view) and self.knowledge.noise_variance is None
        self._scales = dict.fromkeys(self._require_plan().names, 1.0) if noiseless else self.noise_scales(view)
        self._beta = None
        try:
            ml = super(DefenseAwareIDLG, self).reconstruct(view)  # DLG's restarts on the likelihood
            assert ml.labels is not None
            meta: dict[str, Any] = {
                "noise_law": self.knowledge.noise_law,
                "ml_objective": ml.meta["objective"],
                "prior_scale": None,
            }
            if "restarts_side_by_side" in ml.meta:
                meta["restarts_side_by_side"] = ml.meta["restarts_side_by_side"]

            def likelihood_only(reason: str) -> Reconstruction:
                meta.update(objective=ml.meta["objective"], map_skipped=reason)
                return Reconstruction(self._boxed(view, ml.images), ml.labels, ml.loss_trace, type(self).__name__, meta)

            if noiseless or self.prior_weight == 0:
                # no noise: the likelihood's limit is the exact match, which no prior may pull away from
                return likelihood_only("no noise" if noiseless else "prior_weight=0")
            if self.knowledge.noise_variance is not None:
                self._scales = self.noise_scales(view, ml.images, ml.labels)
            beta = self.prior_scale if self.prior_scale is not None else pixel_difference_scale(view, ml.images)
            if beta <= 0:
                return likelihood_only("a constant image: no pixel difference to estimate the prior's scale from")
            self._beta = beta
            final, images, labels, trace = self._one_run(view, (ml.images, None), ml.labels, -math.inf)
            if not math.isfinite(final):
                return likelihood_only("the MAP run diverged")
            meta.update(objective=final, prior_scale=beta)
            return Reconstruction(self._boxed(view, images), labels, ml.loss_trace + trace, type(self).__name__, meta)
        finally:
            self._scales, self._beta, self._pixels = None, None, None

    def _require_plan(self) -> MatchPlan:
        if self._plan is None:
            raise RuntimeError("NoiseAwareMAP's objective runs inside reconstruct only")
        return self._plan

    @staticmethod
    def _boxed(view: ServerView, images: Tensor) -> Tensor:
        low, high = view.data_bounds()
        return torch.maximum(torch.minimum(images, high), low)


def pixel_difference_scale(view: ServerView, images: Tensor) -> float:
    """``mean |d|`` over the differences of neighbouring pixels of ``images`` (pixels in [0, 1]): the
    maximum-likelihood scale of a Laplace prior on them."""
    pixels = view.denormalize(images.detach())
    count = pixels[..., :, 1:].numel() + pixels[..., 1:, :].numel()
    return float(total_variation(pixels, reduction="sum")) / count


def noise_aware_attacks(knowledge: DefenseKnowledge, kwargs: dict[str, Any]) -> list[GradientAttack]:
    """The defense-aware pair (:func:`~lightning_gp.attacks.adaptive.defense_aware_attacks`) and
    :class:`NoiseAwareMAP` on ``knowledge``. Budget keys: as the pair's; the MAP attack takes
    ``lbfgs_iterations`` (default 100) and ``restarts`` (at least 4), ``seed``, ``device``, ``progress_every``."""
    common = {k: kwargs[k] for k in ("seed", "device", "progress_every") if k in kwargs}
    restarts = max(4, int(kwargs.get("restarts", 1)))
    iterations = check_positive_int(kwargs.get("lbfgs_iterations", 100), "lbfgs_iterations")
    return [
        *defense_aware_attacks(knowledge, kwargs),
        NoiseAwareMAP(knowledge, iterations=iterations, restarts=restarts, **common),
    ]


# ------------------------------------------------------------------------------ registered here
def optimal_noise_variance_at(defense: Any, clip: float | None = None) -> NoiseVariance:
    """The per-entry variance :class:`~lightning_gp.defenses.OptimalGradientNoise` (``clip=None``) or
    :class:`~lightning_gp.defenses.OptimalDPSGD` would give a batch (Eq. 8, 13): its gradient and its
    sensitivity (:func:`~lightning_gp.defenses.gradient_sensitivity`, seeded) at the guess."""

    def variance(view: ServerView, images: Tensor, labels: Tensor) -> dict[str, Tensor]:
        with torch.enable_grad():
            gradients = parameter_gradients(view.model, view.loss_fn, images, labels, create_graph=False)
            generator = torch.Generator(device=images.device).manual_seed(0)
            sensitivity = gradient_sensitivity(view.model, view.loss_fn, images, labels, generator=generator)
        gradients = {n: g.detach() for n, g in gradients.items()}
        return optimal_noise_variance(
            gradients, sensitivity, scale=defense.scale, c=defense.c, max_variance=defense.max_variance, clip=clip
        )

    return variance


@register_defense_knowledge(GaussianNoise, attacks=noise_aware_attacks)
def _gaussian(target: Any) -> DefenseKnowledge:
    transform = None if target.clip is None else coordinate_clip(target.clip)
    return class_knowledge(target, support=False, transform=transform, noise_std=target.scale)


@register_defense_knowledge(LaplaceNoise, attacks=noise_aware_attacks)
def _laplace(target: Any) -> DefenseKnowledge:
    # Laplace of scale b has std sqrt(2) b: the Wiener gains read the std, the likelihood the law
    return class_knowledge(target, support=False, noise_std=math.sqrt(2) * target.scale, noise_law="laplace")


@register_defense_knowledge(LocalGaussianMechanism, attacks=noise_aware_attacks)
def _local_gaussian(target: Any) -> DefenseKnowledge:
    # the exact law: u = clip_C(g(x)) + N(0, (z C)^2 I), the guess's gradient clipped as a whole
    return class_knowledge(
        target, support=False, transform=update_clip(target.max_update_norm), noise_std=target.noise_std
    )


@register_defense_knowledge(OptimalGradientNoise, attacks=noise_aware_attacks)
def _optimal_noise(target: Any) -> DefenseKnowledge:
    # zero-gradient coordinates get no noise (Eq. 8), so the support is known; the per-coordinate
    # variance depends on the client's data (its average power is scale^2): the likelihood evaluates
    # it at the maximum-likelihood estimate
    return class_knowledge(
        target, support=True, noise_std=target.scale, noise_variance=optimal_noise_variance_at(target)
    )


@register_defense_knowledge(OptimalDPSGD, attacks=noise_aware_attacks)
def _optimal_dp_sgd(target: Any) -> DefenseKnowledge:
    return class_knowledge(
        target,
        support=True,
        transform=coordinate_clip(target.clip),
        noise_std=target.scale,
        noise_variance=optimal_noise_variance_at(target, clip=target.clip),
    )
