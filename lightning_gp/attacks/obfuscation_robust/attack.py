"""ROG: gradient inversion in a low-resolution image space, robust to gradient obfuscation.

Yue, Jin, Wong, Baron, Dai, "Gradient Obfuscation Gives a False Sense of Security in Federated
Learning" (USENIX Security 2023). A client that prunes, quantises or noises its gradient leaves the
server an obfuscated ``g~``; full-resolution gradient matching (DLG, Inverting Gradients) then fits
the obfuscation's error with as many free pixels as the image has, and fails. ROG optimises a
low-resolution representation ``r`` of ``(H / s) x (W / s)`` pixels instead, the dummy image being
its bicubic upsampling ``U_s(r)``:

    r* = argmin_r  || grad_theta L(f(U_s(r)), y) - g~ ||^2,

Adam (lr 0.05), the rate annealed by a cosine from ``lr`` to ``0.1 lr`` over the iterations, from
``r ~ U[0, 1]^{C x H/s x W/s}`` (the authors' settings). ``s^2`` times fewer unknowns than pixels
make a smooth image the cheapest fit of the obfuscated gradient, which is what makes it robust.
Ours also boxes ``r`` to [0, 1] after each step (pixels; the authors leave it free) and stops on a
plateau of the objective (:func:`~lightning_gp.attacks.optimization.plateaued`); of ``restarts``
runs the lowest objective wins.

**Postprocessing** (``postprocess=True``): ``U_s(r*)`` is refined by a network trained on the
server's public images only to undo downsampling and noise, conditioned on the label
(:mod:`~lightning_gp.attacks.obfuscation_robust.restoration`; the authors average a conditional
generator and a denoiser with USRNet super-resolution, all trained on ImageNet).

**The scale factor** (``scale_factor=None``: :func:`default_scale_factor`): the authors' ``s = 4`` at
128 px keeps a 32 x 32 representation. At 28 or 32 px, ``s = 4`` would leave 7 x 7 or 8 x 8,
too coarse to stand for the image at all: the best bicubic upsampling of a 7 x 7 image reaches
16.3 dB PSNR on Fashion-MNIST, of a 14 x 14 one 20.0 dB (the public mean image: 10.9 dB), so ``s =
2`` below 64 px a side, ``4`` from there. A side not divisible by ``s`` is
:class:`~lightning_gp.attacks.AttackNotApplicable`.

**The prior-only control** (:meth:`ObfuscationRobustInversion.prior_only_guesses`): the restoration
network turns any low-resolution blur into a plausible image of its label's class, so the audit
credits a reconstruction only where it beats what the attack makes of gradients that say nothing of
the attacked batch: the attack run end to end on ``decoys`` public batches held out from the
network's training, their gradients as the published GGL makes them
(:meth:`~lightning_gp.attacks.GenerativeGradientLeakage.decoy_gradients` without knowledge: clean,
sparsified like the client's upload where it holds exact zeros).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.attacks.adaptive import stacked_match
from lightning_gp.attacks.base import AttackNotApplicable, GradientAttack, Reconstruction
from lightning_gp.attacks.generative.attack import sparsified_like
from lightning_gp.attacks.gradient_matching import parameter_gradients, squared_l2_distance
from lightning_gp.attacks.learned import model_fingerprint, tensor_fingerprint
from lightning_gp.attacks.monitor import tick
from lightning_gp.attacks.obfuscation_robust.restoration import (
    DEFAULT_RESTORATION_CACHE,
    RestorationCache,
    RestorationConfig,
    RestorationKey,
    TrainedRestoration,
    held_out_public,
    train_restoration,
    upsample,
)
from lightning_gp.attacks.optimization import known_or_recovered_labels
from lightning_gp.attacks.registry import Budget, register_attack
from lightning_gp.attacks.searches import (
    BATCHED_IMAGES,
    adam_searches,
    best_restarts,
    cosine_to,
    decoy_guesses,
)
from lightning_gp.attacks.threat_models import requirements
from lightning_gp.attacks.view import ServerView, checked_public_data
from lightning_gp.normalization import normalize
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_bool, check_int, check_number, check_positive, check_positive_int

#: Public batches attacked end to end for the prior-only control (a 1-in-32 test per metric), as GGL's.
DECOYS = 31
#: The fewest public images the restoration network is trained on (two held out, two to train on).
MIN_PUBLIC = 4
#: The image side from which the authors' scale factor 4 applies (:func:`default_scale_factor`).
PAPER_SCALE_FROM = 64
#: The learning rate at the end of the cosine annealing, as a fraction of ``lr`` (the authors' 0.1).
FINAL_LR_FRACTION = 0.1
#: Prior-only guesses kept per process (each set costs ``decoys`` whole attacks).
_MEMO_SIZE = 32
_PRIOR_ONLY_MEMO: OrderedDict[tuple[Any, ...], Tensor] = OrderedDict()


def default_scale_factor(input_shape: tuple[int, ...]) -> int:
    """ROG's scale factor ``s`` for images ``(C, H, W)``: 4 (the authors', at 128 px) from
    :data:`PAPER_SCALE_FROM` px a side, else 2, which keeps 14 x 14 of a 28 x 28 image (a 7 x 7
    representation cannot stand for it: module docstring)."""
    return 4 if min(int(s) for s in input_shape[1:]) >= PAPER_SCALE_FROM else 2


def _published(budget: Budget, seed: int, model: nn.Module) -> GradientAttack:
    """The published ROG of ``budget``: ``ig_iterations`` Adam steps at most per restart."""
    return ObfuscationRobustInversion(iterations=budget.ig_iterations, seed=seed)


@register_attack("ROG", order=10, build=_published)
class ObfuscationRobustInversion(GradientAttack):
    """ROG (Yue et al., USENIX Security 2023): squared-L2 gradient matching over a low-resolution
    image ``r``, the dummy image its bicubic upsampling, ``min_r ||grad L(f(U_s(r)), y) - g~||^2``,
    then a label-conditioned restoration network trained on public images (module docstring).
    Labels from ``view.labels`` or :func:`~lightning_gp.attacks.recover_labels`.

    Args:
        scale_factor: ``s``, the side ratio of the image to ``r`` (``None``: :func:`default_scale_factor`;
            ``1``: full-resolution matching, the ablation).
        iterations: the cap on Adam steps of each restart (it stops earlier on a plateau:
            ``plateau_steps``, ``plateau_rtol``, as :func:`~lightning_gp.attacks.optimization.plateaued`).
        restarts: independent inversions from ``r ~ U[0, 1]``; the lowest objective wins.
        lr: Adam's learning rate on ``r`` (pixels), annealed by a cosine to ``0.1 lr``.
        postprocess: refine ``U_s(r*)`` with the restoration network (needs public data).
        public_data: ``(images, labels)`` the server holds, normalised like the clients' inputs
            (default: each view's :attr:`~lightning_gp.attacks.ServerView.public_data`).
        restoration_config: the network's architecture and training
            (:class:`~lightning_gp.attacks.obfuscation_robust.RestorationConfig`).
        cache: where trained networks are kept (default:
            :data:`~lightning_gp.attacks.obfuscation_robust.DEFAULT_RESTORATION_CACHE`).
        decoys: public batches attacked end to end for :meth:`prior_only_guesses`.
        prior_seed: seeds what is built once per data set and shared by every client's attack: the
            network's training and the decoys (``seed`` seeds each client's restarts).
    """

    # class D: the restoration network is trained on the server's public (surrogate) data
    requires = requirements("basic_knowledge", "training_details", "surrogate_data")

    def __init__(
        self,
        *,
        scale_factor: int | None = None,
        iterations: int = 1000,
        restarts: int = 2,
        lr: float = 0.05,
        plateau_steps: int = 100,
        plateau_rtol: float = 1e-3,
        postprocess: bool = True,
        public_data: tuple[Tensor, Tensor] | None = None,
        restoration_config: RestorationConfig | None = None,
        cache: RestorationCache | None = None,
        decoys: int = DECOYS,
        prior_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.scale_factor = None if scale_factor is None else check_int(scale_factor, "scale_factor", low=1)
        self.iterations = check_positive_int(iterations, "iterations")
        self.restarts = check_positive_int(restarts, "restarts")
        self.lr = check_positive(lr, "lr")
        self.plateau_steps = check_int(plateau_steps, "plateau_steps", low=0)
        self.plateau_rtol = check_number(plateau_rtol, "plateau_rtol", low=0.0, high=1.0)
        self.postprocess = check_bool(postprocess, "postprocess")
        self.public_data = checked_public_data(public_data)
        self.restoration_config = RestorationConfig() if restoration_config is None else restoration_config
        if not isinstance(self.restoration_config, RestorationConfig):
            raise TypeError(f"restoration_config must be a RestorationConfig, got {type(restoration_config).__name__}")
        self.cache = DEFAULT_RESTORATION_CACHE if cache is None else cache
        if not isinstance(self.cache, RestorationCache):
            raise TypeError(f"cache must be a RestorationCache, got {type(cache).__name__}")
        self.decoys = check_positive_int(decoys, "decoys")
        self.prior_seed = check_int(prior_seed, "prior_seed", low=0)

    def __repr__(self) -> str:
        scale = "auto" if self.scale_factor is None else self.scale_factor
        return f"{type(self).__name__}(scale_factor={scale}{'' if self.postprocess else ', no postprocessing'})"

    # -------------------------------------------------------------------------------- refusals
    def scale_factor_for(self, view: ServerView) -> int:
        """``s`` for ``view``'s images (``scale_factor``, else :func:`default_scale_factor`);
        :class:`~lightning_gp.attacks.AttackNotApplicable` where the images are not ``(C, H, W)`` or
        a side is not divisible by it."""
        shape = tuple(int(s) for s in view.input_shape)
        if len(shape) != 3:
            raise AttackNotApplicable(f"{type(self).__name__} inverts images (C, H, W), got input_shape {shape}")
        scale = default_scale_factor(shape) if self.scale_factor is None else self.scale_factor
        if shape[1] % scale or shape[2] % scale:
            raise AttackNotApplicable(
                f"{type(self).__name__}: the image side {shape[1]} x {shape[2]} is not divisible by the scale factor "
                f"{scale} (the low-resolution image would not upsample to it)"
            )
        return scale

    def _check_gradients(self, view: ServerView) -> None:
        bad = [name for name, g in view.gradients.items() if not bool(torch.isfinite(g).all())]
        if bad:
            raise AttackNotApplicable(f"{type(self).__name__}: the shared gradient holds NaN or inf in {bad}")

    # ------------------------------------------------------------------ the restoration network
    def _public(self, view: ServerView) -> tuple[Tensor, Tensor]:
        """The public ``(images, labels)`` (:class:`~lightning_gp.attacks.AttackNotApplicable` without enough)."""
        public = self.public_data if self.public_data is not None else view.public_data
        if public is None:
            raise AttackNotApplicable(
                f"{type(self).__name__} trains its restoration network and draws its decoys from the server's public "
                "images: the view holds none (view.public_data) and none were given (public_data)"
            )
        if len(public[0]) < MIN_PUBLIC:
            raise AttackNotApplicable(
                f"{type(self).__name__}: {len(public[0])} public images are too few to train the restoration network "
                f"on (at least {MIN_PUBLIC})"
            )
        checked = checked_public_data(public, view.input_shape, view.num_classes)
        assert checked is not None
        return checked

    def restoration_key(self, view: ServerView) -> RestorationKey:
        """The cache key of the network that restores ``view``'s images: the public pixels and labels,
        shape, classes, scale factor, configuration and seed."""
        scale = self.scale_factor_for(view)
        images, labels = self._public(view)
        pixels = view.denormalize(images.to(view.device))
        shape = tuple(int(s) for s in view.input_shape)
        return RestorationKey(
            tensor_fingerprint(pixels), tensor_fingerprint(labels.float()), shape, int(view.num_classes), scale,
            repr(self.restoration_config), self.prior_seed,
        )  # fmt: skip

    def restoration(self, view: ServerView, key: RestorationKey | None = None) -> TrainedRestoration:
        """The restoration network for ``view``'s data (of ``key``, default :meth:`restoration_key`):
        cached, or trained now on the public images."""
        key = self.restoration_key(view) if key is None else key

        def train() -> TrainedRestoration:
            images, labels = self._public(view)
            pixels = view.denormalize(images.to(view.device)).cpu()
            return train_restoration(
                pixels, labels, view.num_classes, key.scale_factor, self.restoration_config, self.prior_seed,
                report=self._training_tick,
            )  # fmt: skip

        trained = self.cache.get(key, train)
        trained.network.to(view.device).eval().requires_grad_(False)
        return trained

    def _training_tick(self, step: int, total: int, value: float) -> None:
        tick(type(self).__name__, step, total, value)  # within monitored(): a heartbeat, or a requested stop

    # -------------------------------------------------------------------------------- the attack
    def reconstruct(self, view: ServerView) -> Reconstruction:
        self.scale_factor_for(view)
        self._check_gradients(view)
        prepared, generator = self._prepare(view)
        (result,) = self._attack([prepared], [generator])
        return result

    def _attack(self, views: Sequence[ServerView], rngs: Sequence[torch.Generator]) -> list[Reconstruction]:
        """The low-resolution inversion, then (``postprocess``) the restoration, on prepared views of
        one model and public data (a client's, or the decoys'), view ``i`` seeded by ``rngs[i]``; the
        inversions of all views and restarts run side by side (:meth:`_invert`)."""
        scale = self.scale_factor_for(views[0])
        network: nn.Module | None = None
        common: dict[str, Any] = {"scale_factor": scale, "postprocessed": self.postprocess}
        if self.postprocess:  # first: without public data the attack does not apply, and says so at once
            key = self.restoration_key(views[0])
            trained = self.restoration(views[0], key)
            network = trained.network
            common.update(restoration=asdict(trained.cost), restoration_key=key.digest())
        labels = [known_or_recovered_labels(view) for view in views]
        results = []
        for view, y, (low, objective, trace, info) in zip(views, labels, self._invert(views, labels, scale, rngs)):
            with torch.no_grad():
                images = self._restored(view, low, y, network)
            meta = {"objective": objective, **info, **common}
            results.append(Reconstruction(images, y, trace, attack=type(self).__name__, meta=meta))
        return results

    def _dummy(self, view: ServerView, low: Tensor) -> Tensor:
        """``U_s(r)`` in the model's normalised input space."""
        pixels = upsample(low, (int(view.input_shape[1]), int(view.input_shape[2])))
        return normalize(pixels, view.mean, view.std, sample_ndim=3)

    def _restored(self, view: ServerView, low: Tensor, labels: Tensor, network: nn.Module | None) -> Tensor:
        """The output: ``U_s(r)`` clipped to [0, 1], restored by ``network`` where given, normalised."""
        pixels = upsample(low, (int(view.input_shape[1]), int(view.input_shape[2]))).clamp(0, 1)
        if network is not None:
            pixels = network(pixels, labels).clamp(0, 1)
        return normalize(pixels, view.mean, view.std, sample_ndim=3)

    def _invert(
        self, views: Sequence[ServerView], labels: Sequence[Tensor], scale: int, rngs: Sequence[torch.Generator]
    ) -> list[tuple[Tensor, float, list[float], dict[str, Any]]]:
        """Per view, ``restarts`` low-resolution inversions from ``r ~ U[0, 1]`` (drawn from its
        ``rng``): Adam on ``r``, cosine-annealed to ``0.1 lr`` over ``iterations``, ``r`` boxed to
        [0, 1] after each step, until the cap, a plateau or a non-finite objective, every view's and
        restart's side by side (:func:`~lightning_gp.attacks.searches.adam_searches`). Per view the
        lowest objective wins: ``(r, objective, trace, info)``."""
        channels, height, width = (int(s) for s in views[0].input_shape)
        shape = (views[0].batch_size, channels, height // scale, width // scale)
        starts = torch.stack(
            [
                torch.rand(shape, generator=rng, device=view.device)
                for view, rng in zip(views, rngs)
                for _ in range(self.restarts)
            ]
        )
        match_rows, rows_per_call, batched = self._row_match(views, labels)

        def value_of(low: Tensor, rows: Tensor) -> Tensor:
            dummy = self._dummy(views[0], low.reshape(-1, *shape[1:]))
            return match_rows(dummy.reshape(len(low), *shape[:1], channels, height, width), rows)

        searched = adam_searches(
            starts, value_of, iterations=self.iterations, lr=self.lr,
            schedule=cosine_to(FINAL_LR_FRACTION, self.iterations), plateau_steps=self.plateau_steps,
            plateau_rtol=self.plateau_rtol, rows_per_call=rows_per_call, project=lambda low: low.clamp(0, 1),
            report=self._report,
        )  # fmt: skip
        return best_restarts(searched, self.restarts, batched=batched)

    def _row_match(
        self, views: Sequence[ServerView], labels: Sequence[Tensor]
    ) -> tuple[Callable[[Tensor, Tensor], Tensor], int, bool]:
        """``(dummies [A, B, C, H, W], rows) -> [A]``: the squared-L2 match of problems ``rows``
        (``restarts`` per view, view-major), the problems per call and whether it is vmapped
        (:func:`~lightning_gp.attacks.adaptive.stacked_match`; one problem at a time where the model
        does not map)."""
        stacked = stacked_match(None, views, labels, squared_l2_distance, repeats=self.restarts)
        if stacked is not None:
            return stacked, max(1, BATCHED_IMAGES // views[0].batch_size), True

        def one_by_one(dummies: Tensor, rows: Tensor) -> Tensor:
            values = []
            for dummy, row in zip(dummies, rows):
                view = views[int(row) // self.restarts]
                guess = parameter_gradients(view.model, view.loss_fn, dummy, labels[int(row) // self.restarts])
                values.append(squared_l2_distance(guess, view.gradients))
            return torch.stack(values)

        return one_by_one, 1, False

    # ------------------------------------------------------------------------ prior-only guesses
    def prior_only_guesses(self, view: ServerView, count: int) -> Tensor:
        """``[K, B, C, H, W]`` normalised images, ``K = min(count, decoys)``: this attack run end to end
        on ``K`` public batches of ``view``'s size drawn from the images held out from the restoration
        network's training, whose gradients (:meth:`decoy_gradients`) carry nothing of the attacked
        batch: the control the audit scores the reconstructions against
        (:mod:`lightning_gp.audit.prior_control`), as GGL's. Seeded by ``prior_seed`` alone, so every
        client's attack of a setting shares them; computed once per model, batch size, upload sparsity and count."""
        check_positive_int(count, "count")
        self.scale_factor_for(view)
        prepared, _ = self._prepare(view)
        count = min(count, self.decoys)
        key = self._prior_only_key(prepared, count)
        if key not in _PRIOR_ONLY_MEMO:
            _PRIOR_ONLY_MEMO[key] = self._decoy_reconstructions(prepared, count)
            while len(_PRIOR_ONLY_MEMO) > _MEMO_SIZE:
                _PRIOR_ONLY_MEMO.popitem(last=False)
        return _PRIOR_ONLY_MEMO[key].to(view.device)

    def _prior_only_key(self, view: ServerView, count: int) -> tuple[Any, ...]:
        search = (self.iterations, self.restarts, self.lr, self.plateau_steps, self.plateau_rtol, self.postprocess)
        sent = [round(float((g != 0).float().mean()), 2) for g in view.gradients.values()]
        return (
            self.restoration_key(view).digest(),
            model_fingerprint(view.model),
            view.batch_size,
            view.labels is None,
            count,
            search,
            tuple(sent),
            self.prior_seed,
        )

    def _decoy_reconstructions(self, view: ServerView, count: int) -> Tensor:
        images, labels = (t.to(view.device) for t in self._public(view))
        held_out = held_out_public(len(images), self.restoration_config, self.prior_seed)[0].to(view.device)
        if len(held_out) < view.batch_size:
            raise ValueError(
                f"{len(held_out)} public images are held out from the restoration network, fewer than a batch of "
                f"{view.batch_size}: give more public images or a larger restoration_config.val_fraction"
            )
        return decoy_guesses(
            view, (images, labels), held_out, count, seeded_generator(self.prior_seed, 0x20C0),
            lambda x, y, k: self.decoy_gradients(view, x, y),
            lambda k: seeded_generator(self.prior_seed, 0x20C1, k, device=view.device),
            self._attack,
        )  # fmt: skip

    def decoy_gradients(self, view: ServerView, images: Tensor, labels: Tensor) -> dict[str, Tensor]:
        """What a client holding the public batch ``(images, labels)`` would share as far as a server
        that does not model the defense can tell: the clean gradient, each layer cut to its largest
        entries in the count the client's upload holds nonzero (all where it has no exact zero)."""
        with torch.enable_grad():
            raw = parameter_gradients(view.model, view.loss_fn, images, labels, create_graph=False)
        return sparsified_like({n: g.detach() for n, g in raw.items()}, view.gradients)


__all__ = [
    "DECOYS",
    "FINAL_LR_FRACTION",
    "MIN_PUBLIC",
    "PAPER_SCALE_FROM",
    "ObfuscationRobustInversion",
    "default_scale_factor",
]
