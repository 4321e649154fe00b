"""An adaptive attack on Refiner: the server knows the defense and its settings, not ``x`` or ``g``.

Refiner (Fan et al., USENIX Security 2025) uploads ``u``, the gradient ``g*`` of robust data ``x*`` projected to
within ``eps`` of the raw gradient ``g`` (App. J, Eq. 14), where ``x*`` was optimised from the
noise blend ``x0 = (1 - alpha) x + alpha v``, ``v ~ U[0, 1]`` (Sec. 3.4). The paper's adaptive
attack (Sec. 4.4, App. M) first solves ``||g* - g||^2 = const`` for some ``g'`` and then runs a
published attack on ``g'``; the equation is under-determined, so ``g'`` is an arbitrary point of a
sphere around ``u`` and the attack mostly inverts noise (the paper reports PSNR ~10.5).

That attack throws away the two facts the defense guarantees, which this attack uses instead:

* **the ball** (App. J): ``||u - g(x)|| <= eps`` for the true batch, with equality whenever the
  projection moved the upload (in the global L2 norm; per layer with ``projection="layer"``).
  So rather than guessing one ``g'`` on the sphere, search the images whose gradient lies in
  that ball: minimise ``(||grad(x') - u|| - eps)_+^2 / ||u||^2 + tv_weight TV(x')`` (strategy
  ``"ball"``; ``"sphere"`` penalises both sides, the equality case). The true batch scores
  exactly 0, every image App. M's ``g'`` would single out is just one of the candidates, and
  with ``eps = 0`` this is L2 gradient matching. When ``eps`` is small next to ``||g||``, the
  ball is a small region around ``g`` and the raw batch is recovered about as well as without
  the defense. With Refiner's ``eps_relative=True`` the radius is ``eps ||g||``; the attacker
  does not know ``||g||`` but tests each guess against its own: ``||grad(x') - u|| <= eps
  ||grad(x')||`` holds for ``x' = x`` exactly as the defense guarantees it, so the hinge becomes
  ``(||grad(x') - u|| - eps ||grad(x')||)_+^2 / ||u||^2`` (per layer likewise) and still scores
  the true batch 0. ``"ball_lbfgs"`` minimises the same hinge (without the TV prior) with DLG's
  L-BFGS and iDLG's labels (:class:`~lightning_gp.attacks.IDLG` with its gradient distance
  swapped), then clamps into the data box: the strongest solver on small models.
* **the blend** (Sec. 3.4): when ``eps`` is large, ``u = g*`` and a gradient attack recovers
  ``x*`` (Sec. 4.2: "attackers can reconstruct x*"; Fig. 14 shows reconstructions that keep
  the robust data's colours). ``x*`` started at ``(1 - alpha) x + alpha v`` with
  ``E[v] = 1/2``, so ``(x0 - alpha / 2) / (1 - alpha)`` is an unbiased estimator of ``x`` given
  ``x0``, with i.i.d. per-pixel noise of standard deviation ``sigma = alpha / ((1 - alpha)
  sqrt(12))`` (uniform ``v``); applied to a reconstruction ``x*'`` of ``x*`` it ignores the drift
  of Refiner's ``I`` optimisation steps away from ``x0`` (small: Refiner's own Fig. 5 keeps the
  blend visible). Strategy ``"unblend"`` inverts
  ``u`` with Inverting Gradients, applies that estimator, clamps to [0, 1] and removes the
  i.i.d. blend noise with a total-variation (ROF) denoise whose weight is ``denoise * sigma``
  (Chambolle 2004). Strategy ``"invert"`` keeps the Inverting Gradients image itself (what the
  non-adaptive attacker gets; identical to :class:`InvertingGradients` with the same seed).

Choosing among the strategies uses only what the server observes: each strategy's final images
are scored by the ball's hinge ``(||grad(x') - u|| - eps)_+^2 / ||u||^2`` (the one condition the
true batch is guaranteed to meet), the lowest wins, and scores within ``tie_tolerance`` of the
lowest are broken by the order of ``strategies`` (when ``eps`` is large every candidate sits inside
the ball, and the ball then says nothing; ``"unblend"`` comes first by default for that case).
A batch is chosen as a whole (the gradient of a batch does not split per image), and
``meta["strategy"]`` names the strategy of each returned image; ``meta["candidates"]`` holds every
strategy's images so a benchmark can also score the best strategy per image against the truth
(the worst case), which the attack itself never does.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_gp.attacks.base import GradientAttack, Reconstruction
from lightning_gp.attacks.gradient_matching import cosine_distance, parameter_gradients, total_variation
from lightning_gp.attacks.optimization import IDLG, best_of_restarts, known_or_recovered_labels, random_images
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.view import ServerView
from lightning_gp.normalization import normalize
from lightning_gp.validation import check_bool, check_choice, check_nonnegative, check_positive, check_positive_int

Strategy = Literal["ball", "ball_lbfgs", "sphere", "unblend", "invert"]
STRATEGIES: tuple[str, ...] = ("ball", "ball_lbfgs", "sphere", "unblend", "invert")
DEFAULT_STRATEGIES: tuple[str, ...] = ("unblend", "ball", "ball_lbfgs", "invert")


def ball_distance(
    guess: Mapping[str, Tensor],
    upload: Mapping[str, Tensor],
    eps: float,
    *,
    per_layer: bool = False,
    two_sided: bool = False,
    eps_relative: bool = False,
) -> Tensor:
    """How far ``guess`` lies outside the radius-``r`` ball around ``upload`` (Refiner App. J, Eq. 14).

    ``(||guess - upload|| - r)_+^2 / ||upload||^2`` in the global L2 norm, or summed over layers
    of ``(||guess_l - upload_l|| - r_l)_+^2`` with ``per_layer`` (Refiner's per-layer projection).
    ``r = eps``, or with ``eps_relative`` (Refiner's radius ``eps ||g||``) ``r = eps ||guess||``
    (per layer ``eps ||guess_l||``): the guess stands in for the raw gradient ``g`` the attacker
    does not know, which makes the condition exact at ``guess = g``. ``two_sided`` penalises
    ``(... - r)^2`` on both sides: the sphere ``||g - u|| = r`` on which the raw gradient lies
    whenever the projection moved the upload. Zero at the raw gradient; with ``eps = 0`` it is
    the squared L2 distance (DLG's) relative to ``||upload||^2``.
    """
    check_bool(eps_relative, "eps_relative")
    names = list(upload)
    if not names:
        raise ValueError("upload names no layers")
    scale = torch.stack([upload[n].detach().pow(2).sum() for n in names]).sum().clamp_min(1e-30)

    def excess(layers: list[str]) -> Tensor:
        # sqrt has an infinite derivative at 0: a tiny floor inside it (it moves the norm by < 1e-15)
        distance = (torch.stack([(guess[n] - upload[n]).pow(2).sum() for n in layers]).sum() + 1e-30).sqrt()
        if eps_relative:
            gap = distance - eps * (torch.stack([guess[n].pow(2).sum() for n in layers]).sum() + 1e-30).sqrt()
        else:
            gap = distance - eps
        return gap.pow(2) if two_sided else gap.clamp_min(0).pow(2)

    if per_layer:
        return torch.stack([excess([n]) for n in names]).sum() / scale
    return excess(names) / scale


def tv_denoise(images: Tensor, weight: float, iterations: int = 100) -> Tensor:
    """ROF total-variation denoising ``argmin_z ||z - f||^2 / 2 + weight TV(z)`` (isotropic TV),
    per image and channel, by Chambolle's dual projection algorithm (J. Math. Imaging Vis. 2004),
    step 1/8 (its convergence bound). ``weight = 0`` returns a copy of ``images``."""
    check_nonnegative(weight, "weight")
    check_positive_int(iterations, "iterations")
    f = images.detach()
    if weight == 0:
        return f.clone()

    def grad(z: Tensor) -> tuple[Tensor, Tensor]:
        gx, gy = torch.zeros_like(z), torch.zeros_like(z)
        gx[..., :, :-1] = z[..., :, 1:] - z[..., :, :-1]
        gy[..., :-1, :] = z[..., 1:, :] - z[..., :-1, :]
        return gx, gy

    def div(px: Tensor, py: Tensor) -> Tensor:
        dx, dy = px.clone(), py.clone()
        dx[..., :, 1:] -= px[..., :, :-1]
        dy[..., 1:, :] -= py[..., :-1, :]
        return dx + dy

    px, py = torch.zeros_like(f), torch.zeros_like(f)
    step = 0.125
    for _ in range(iterations):
        gx, gy = grad(div(px, py) - f / weight)
        norm = (gx.pow(2) + gy.pow(2)).sqrt()
        px = (px + step * gx) / (1 + step * norm)
        py = (py + step * gy) / (1 + step * norm)
    return f - weight * div(px, py)


class RefinerAwareInversion(GradientAttack):
    """Adaptive gradient inversion against Refiner (see the module docstring for the reasoning).

    The attacker knows Refiner's settings (``eps``, ``eps_relative``, ``alpha``, ``projection``), the model and the
    upload ``u``; not ``x``, ``x*``, ``v`` or ``g``. Labels come from ``view.labels`` or
    :func:`recover_labels` on ``u`` (Refiner keeps the true labels, so the last layer's gradient
    still reveals them). Every strategy uses Inverting Gradients' optimiser
    (:func:`~lightning_gp.attacks.optimization.optimize_images`: Adam on signed gradients, lr
    ``lr``, decayed at 3/8, 5/8, 7/8, the data box, ``restarts`` N(0, 1) starts) and TV prior.

    Args:
        eps: Refiner's projection radius (>= 0; App. J).
        eps_relative: Refiner's radius is ``eps ||g||`` (a fraction of the raw gradient's norm);
            the ball's hinge then measures each guess against ``eps ||grad(x')||`` (see :func:`ball_distance`).
        alpha: Refiner's noise blend (in [0, 1]; ``"unblend"`` needs ``alpha < 1``).
        projection: ``"global"`` or ``"layer"``, as Refiner was configured.
        strategies: which of ``"ball"``, ``"ball_lbfgs"``, ``"sphere"``, ``"unblend"``, ``"invert"``
            to run (each at most once); their order breaks ties in the selection.
        iterations, lr, tv_weight, restarts, signed, boxed, lr_decay: the optimiser, as in
            :class:`~lightning_gp.attacks.InvertingGradients`.
        lbfgs_iterations: outer L-BFGS steps of ``"ball_lbfgs"`` (20 inner steps each, strong-Wolfe
            line search, stops once inside the ball), as in :class:`~lightning_gp.attacks.DLG`.
        denoise: the ROF weight of ``"unblend"`` in units of the blend noise's standard deviation
            ``alpha / ((1 - alpha) sqrt(12))`` (0: no denoising). The default 0.5 is a light denoise:
            the Inverting Gradients image it starts from is already TV-regularised.
        denoise_iterations: Chambolle iterations of that denoise.
        tie_tolerance: selection scores within this of the lowest count as ties (>= 0).
    """

    # class C: it knows Refiner's configuration
    requires = requirements("basic_knowledge", "training_details")

    def __init__(
        self,
        eps: float = 0.1,
        alpha: float = 0.5,
        projection: Literal["global", "layer"] = "global",
        strategies: Sequence[str] = DEFAULT_STRATEGIES,
        iterations: int = 4800,
        lr: float = 0.1,
        tv_weight: float = 1e-4,
        restarts: int = 1,
        signed: bool = True,
        boxed: bool = True,
        lr_decay: bool = True,
        lbfgs_iterations: int = 100,
        denoise: float = 0.5,
        denoise_iterations: int = 100,
        tie_tolerance: float = 1e-6,
        eps_relative: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.eps = check_nonnegative(eps, "eps")
        self.eps_relative = check_bool(eps_relative, "eps_relative")
        self.alpha = check_nonnegative(alpha, "alpha")
        if self.alpha > 1:
            raise ValueError(f"alpha must be in [0, 1] (Refiner's noise blend), got {alpha!r}")
        self.projection = check_choice(projection, "projection", ("global", "layer"))
        if isinstance(strategies, str) or not isinstance(strategies, Sequence):
            raise ValueError(f"strategies must be a list of names from {STRATEGIES}, got {strategies!r}")
        self.strategies = tuple(check_choice(s, "strategies", STRATEGIES) for s in strategies)
        if not self.strategies or len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies must name at least one of {STRATEGIES}, each once, got {list(strategies)}")
        if "unblend" in self.strategies and self.alpha >= 1:
            raise ValueError(
                "strategies: 'unblend' undoes the blend (1 - alpha) x + alpha v and needs alpha < 1; with alpha = 1 "
                "the robust data started from pure noise (drop 'unblend')"
            )
        self.iterations = check_positive_int(iterations, "iterations")
        self.lr = check_positive(lr, "lr")
        self.tv_weight = check_nonnegative(tv_weight, "tv_weight")
        self.restarts = check_positive_int(restarts, "restarts")
        self.signed = check_bool(signed, "signed")
        self.boxed = check_bool(boxed, "boxed")
        self.lr_decay = check_bool(lr_decay, "lr_decay")
        self.lbfgs_iterations = check_positive_int(lbfgs_iterations, "lbfgs_iterations")
        self.denoise = check_nonnegative(denoise, "denoise")
        self.denoise_iterations = check_positive_int(denoise_iterations, "denoise_iterations")
        self.tie_tolerance = check_nonnegative(tie_tolerance, "tie_tolerance")

    # ------------------------------------------------------------------ the objectives
    def ball_objective(
        self, view: ServerView, labels: Tensor, *, two_sided: bool = False, tv_weight: float | None = None
    ) -> Callable[[Tensor], Tensor]:
        """``images -> ball_distance(grad(images), u, eps) + tv_weight TV(images)`` (strategy
        ``"ball"``; ``"sphere"`` with ``two_sided``). Zero at the client's batch when ``tv_weight=0``."""
        weight = self.tv_weight if tv_weight is None else tv_weight
        per_layer = self.projection == "layer"

        def loss(images: Tensor) -> Tensor:
            guess = parameter_gradients(view.model, view.loss_fn, images, labels)
            value = ball_distance(
                guess,
                view.gradients,
                self.eps,
                per_layer=per_layer,
                two_sided=two_sided,
                eps_relative=self.eps_relative,
            )
            return value + weight * total_variation(images) if weight > 0 else value

        return loss

    def inverting_objective(self, view: ServerView, labels: Tensor) -> Callable[[Tensor], Tensor]:
        """Inverting Gradients' ``1 - cos(grad(images), u) + tv_weight TV(images)`` (Geiping et al. 2020)."""

        def loss(images: Tensor) -> Tensor:
            guess = parameter_gradients(view.model, view.loss_fn, images, labels)
            return cosine_distance(guess, view.gradients) + self.tv_weight * total_variation(images)

        return loss

    def blend_noise_std(self) -> float:
        """Per-pixel std of ``alpha (v - 1/2) / (1 - alpha)``, ``v ~ U[0, 1]``: the unblend estimator's noise."""
        return self.alpha / ((1 - self.alpha) * math.sqrt(12)) if self.alpha < 1 else math.inf

    def unblend(self, view: ServerView, robust: Tensor) -> Tensor:
        """Estimate ``x`` from a reconstruction of ``x*`` (normalised inputs in, normalised inputs out):
        ``clamp((x*' - alpha / 2) / (1 - alpha), 0, 1)``, then the ROF denoise (see the module docstring)."""
        if self.alpha >= 1:
            raise ValueError("unblend needs alpha < 1")
        sample_ndim = len(view.input_shape)
        pixels = view.denormalize(robust.detach())
        estimate = ((pixels - self.alpha / 2) / (1 - self.alpha)).clamp(0, 1)
        weight = self.denoise * self.blend_noise_std()
        if weight > 0 and sample_ndim >= 2:
            estimate = tv_denoise(estimate, weight, self.denoise_iterations).clamp(0, 1)
        return normalize(estimate, view.mean, view.std, sample_ndim=sample_ndim)

    # ------------------------------------------------------------------ the attack
    def _optimise(
        self, view: ServerView, objective: Callable[[Tensor], Tensor]
    ) -> tuple[Tensor, list[float], float, int]:
        """Restarts of the IG optimiser from N(0, 1), drawn from a generator seeded with ``seed``
        (so ``"invert"`` repeats :class:`InvertingGradients` exactly); the lowest objective wins."""
        generator = torch.Generator(device=view.device).manual_seed(self.seed)
        images, trace, final, restart, _ = best_of_restarts(
            objective,
            lambda: random_images(view, generator),
            restarts=self.restarts,
            iterations=self.iterations,
            lr=self.lr,
            signed=self.signed,
            bounds=view.data_bounds() if self.boxed else None,
            lr_decay=self.lr_decay,
            report=self._report,
        )
        return images, trace, final, restart

    def _ball_lbfgs(self, view: ServerView, labels: Tensor) -> tuple[Tensor, list[float], float]:
        """DLG's L-BFGS loop (restarts, strong Wolfe, early stop) on the ball's hinge, labels fixed."""
        per_layer = self.projection == "layer"
        norm2 = float(sum(g.detach().double().pow(2).sum() for g in view.gradients.values()))
        eps, eps_relative = self.eps, self.eps_relative

        class BallLBFGS(IDLG):
            def gradient_distance(self, guess: dict[str, Tensor], shared: dict[str, Tensor]) -> Tensor:
                return ball_distance(guess, shared, eps, per_layer=per_layer, eps_relative=eps_relative)

        solver = BallLBFGS(
            iterations=self.lbfgs_iterations,
            restarts=self.restarts,
            tolerance=1e-12 / max(norm2, 1e-30),  # DLG stops below tolerance * ||u||^2: a hinge of 1e-12
            seed=self.seed,
            progress_every=self.progress_every,
        )
        result = solver.reconstruct(_with_labels(view, labels))
        images = result.images
        if self.boxed:
            low, high = view.data_bounds()
            images = torch.maximum(torch.minimum(images, high), low)
        return images, result.loss_trace, float(result.meta["objective"])

    def reconstruct(self, view: ServerView) -> Reconstruction:
        view, _ = self._prepare(view)
        labels = known_or_recovered_labels(view)
        candidates: dict[str, Tensor] = {}
        traces: dict[str, list[float]] = {}
        objectives: dict[str, float] = {}
        for strategy in self.strategies:
            if strategy in ("ball", "sphere"):
                objective = self.ball_objective(view, labels, two_sided=strategy == "sphere")
                images, trace, final, _ = self._optimise(view, objective)
                candidates[strategy], traces[strategy], objectives[strategy] = images, trace, final
            elif strategy == "ball_lbfgs":
                candidates[strategy], traces[strategy], objectives[strategy] = self._ball_lbfgs(view, labels)
        if "unblend" in self.strategies or "invert" in self.strategies:
            robust, trace, final, _ = self._optimise(view, self.inverting_objective(view, labels))
            if "invert" in self.strategies:
                candidates["invert"], traces["invert"], objectives["invert"] = robust, trace, final
            if "unblend" in self.strategies:
                candidates["unblend"], traces["unblend"], objectives["unblend"] = (
                    self.unblend(view, robust),
                    trace,
                    final,
                )
        consistency = self.ball_objective(view, labels, tv_weight=0.0)
        scores: dict[str, float] = {}
        for strategy in self.strategies:
            with torch.enable_grad():
                value = float(consistency(candidates[strategy]).detach())
            scores[strategy] = value if math.isfinite(value) else math.inf
        lowest = min(scores.values())
        chosen = next(s for s in self.strategies if scores[s] <= lowest + self.tie_tolerance)
        return Reconstruction(
            images=candidates[chosen],
            labels=labels,
            loss_trace=traces[chosen],
            attack=type(self).__name__,
            meta={
                "strategy": [chosen] * view.batch_size,
                "selected": chosen,
                "selection_scores": scores,
                "objectives": objectives,
                "candidates": {s: candidates[s] for s in self.strategies},
                "eps": self.eps,
                "eps_relative": self.eps_relative,
                "alpha": self.alpha,
                "projection": self.projection,
            },
        )


def _with_labels(view: ServerView, labels: Tensor) -> ServerView:
    """A shallow copy of ``view`` that carries ``labels`` (so every strategy uses the same ones)."""
    labelled = copy.copy(view)
    labelled.labels = labels
    return labelled


__all__ = [
    "DEFAULT_STRATEGIES",
    "STRATEGIES",
    "RefinerAwareInversion",
    "ball_distance",
    "tv_denoise",
]


def refiner_adaptive_attacks(target: Any, kwargs: dict[str, Any]) -> list[GradientAttack]:
    """The adaptive attack of a :class:`~lightning_gp.refiner.RefinerModule` (registered beside it): this module's attack with the module's ``eps``, ``eps_relative``, ``alpha`` and projection."""
    config = target.config
    kwargs.pop("lbfgs_iterations", None)
    return [
        RefinerAwareInversion(
            eps=config.eps,
            eps_relative=config.eps_relative,
            alpha=config.alpha,
            projection=config.projection,
            **kwargs,
        )
    ]
