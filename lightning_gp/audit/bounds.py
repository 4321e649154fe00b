"""The formal reconstruction bound of a defense setting, reported beside the audit's measured leaks.

An audit measures what today's attacks rebuild; a ReRo bound (:mod:`lightning_gp.privacy.rero`) says
what no informed adversary can exceed. Only a mechanism with a formal guarantee has one:

- :class:`~lightning_gp.callbacks.DPSGD`: per-example clipping at ``C``, noise ``sigma C``, its
  Poisson rate and the steps it took (before training: the audit's one tapped step on a fixed batch,
  ``q = 1``); add/remove neighbouring (sensitivity ``C``), the relation of the informed adversary.
- :class:`~lightning_gp.defenses.GaussianNoise` with ``clip``: it clips the client's batch gradient
  *coordinate-wise* to ``[-c, c]``, not per example, so one image of the batch can move the clipped
  gradient across the whole box: the L2 sensitivity is its diameter ``2 c sqrt(d)`` for ``d``
  parameters (replace-one with clipping norm ``c sqrt(d)``), noise ``scale``, one round.
- :class:`~lightning_gp.defenses.LocalGaussianMechanism`: the client clips its whole update to L2 norm
  ``C`` and adds ``N(0, (z C)^2 I)``; replacing one image (or the whole client batch) moves the clipped
  update by at most ``2 C`` (replace-one, clipping norm ``C``), one round.
- everything else (pruning, quantisation, Soteria, PRECODE, Refiner, ATS, Laplace or Gaussian noise
  without clipping, compositions): no formal bound, with the reason; never a number.

**kappa** (the success of a guess that sees only the prior) is measured on the audited images with
the audit's own leak rule (:func:`prior_only_kappa`); eta grows with kappa, so kappa is taken from
above (the best of many prior-only guesses, then its Clopper-Pearson upper limit), never in the
defense's favour.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.audit.verdict import LeakRule
from lightning_gp.callbacks import DPSGD, GradientDefense
from lightning_gp.defenses import GaussianNoise, LocalGaussianMechanism
from lightning_gp.metrics.image_quality import psnr, ssim
from lightning_gp.privacy import GaussianMechanism, clopper_pearson

#: How many public (reference) images are tried as fixed prior-only guesses when measuring kappa.
KAPPA_GUESSES = 256


@dataclass(frozen=True)
class FormalBound:
    """A setting's mechanism and its ReRo bound ``eta`` at ``kappa``, or why it has none.

    ``mechanism is None`` means "no formal bound" (``reason`` says why); ``eta`` is then ``None``.
    """

    mechanism: GaussianMechanism | None
    reason: str = ""
    kappa: float | None = None
    eta: float | None = None

    def at(self, kappa: float) -> FormalBound:
        """This bound evaluated at ``kappa`` (no formal bound stays none)."""
        if self.mechanism is None:
            return self
        return FormalBound(self.mechanism, self.reason, kappa, self.mechanism.eta(kappa))

    def describe(self) -> str:
        """One line for reports: ``"eta <= 0.389 at kappa 0.100 (...)"`` or ``"no formal bound (...)"``."""
        if self.mechanism is None:
            return f"no formal bound ({self.reason})"
        if self.eta is None or self.kappa is None:
            return f"ReRo bound of {self.mechanism.description} (kappa not measured)"
        return (
            f"ReRo bound: no attack succeeds on more than eta = {self.eta:.3f} of targets at kappa = {self.kappa:.3f} "
            f"({self.mechanism.description})"
        )


def defense_mechanism(defense: Any, num_parameters: int | None = None) -> GaussianMechanism:
    """The Gaussian mechanism of one defense object (a :class:`DPSGD` callback, a ``GaussianNoise`` or
    ``LocalGaussianMechanism`` defense or its callback); a ``ValueError`` naming ``defense`` for one that has no formal bound.
    ``num_parameters``: the model's trainable parameter count (``GaussianNoise``'s sensitivity)."""
    if isinstance(defense, DPSGD):
        return _dp_sgd_mechanism(defense)
    inner = defense.defense if isinstance(defense, GradientDefense) else defense
    if isinstance(inner, LocalGaussianMechanism):
        return _local_gaussian_mechanism(inner)
    if isinstance(inner, GaussianNoise):
        if inner.clip is None:
            raise ValueError(f"defense: {type(inner).__name__} without clip has unbounded sensitivity: no formal bound")
        if num_parameters is None or num_parameters < 1:
            raise ValueError(
                f"num_parameters: GaussianNoise's sensitivity needs the model's size, got {num_parameters}"
            )
        return GaussianMechanism(
            noise_std=inner.scale,
            clip_norm=inner.clip * math.sqrt(num_parameters),
            neighbouring="replace_one",
            description=(
                f"GaussianNoise: one round, coordinate clip {inner.clip:g} of {num_parameters} parameters, any image "
                f"of the batch moves the gradient by <= 2 c sqrt(d) = {2 * inner.clip * math.sqrt(num_parameters):.3g}, "
                f"noise std {inner.scale:g}"
            ),
        )
    name = type(inner).__name__
    raise ValueError(f"defense: {name} has no formal mechanism (clipping-bounded Gaussian noise): no formal bound")


def _local_gaussian_mechanism(local: LocalGaussianMechanism) -> GaussianMechanism:
    """One upload of :class:`~lightning_gp.defenses.LocalGaussianMechanism`: the Gaussian mechanism
    (Dwork & Roth 2014, Thm. A.1) on the update clipped to ``C`` (McMahan et al. 2018), noise ``z C``;
    replace-one, sensitivity ``2 C`` (one image or the whole client batch replaced)."""
    C, z = local.max_update_norm, local.noise_multiplier
    return GaussianMechanism(
        noise_std=local.noise_std,
        clip_norm=C,
        neighbouring="replace_one",
        description=(
            f"LocalGaussianMechanism: one round, the client's whole update clipped to C = {C:g}, any image (or the "
            f"whole batch) replaced moves it by <= 2 C, noise std z C = {z:g} x {C:g}"
        ),
    )


def _dp_sgd_mechanism(dp: DPSGD) -> GaussianMechanism:
    history = [(float(s), float(q), int(n)) for s, q, n in dp.privacy_history]
    if history:
        settings = {(s, q) for s, q, _ in history}
        if len(settings) > 1:
            raise ValueError(f"defense: DPSGD ran with several (noise multiplier, rate) settings {sorted(settings)}")
        (sigma, rate), steps = settings.pop(), sum(n for _, _, n in history)
        counted = f"{steps} step(s) at Poisson rate q = {rate:.4g}"
    else:
        if dp.noise_multiplier is None:
            raise ValueError(
                "defense: DPSGD(target_epsilon=...) picks its noise at fit start; no bound before training"
            )
        sigma, rate, steps = dp.noise_multiplier, 1.0, 1
        counted = "the audited step on a fixed batch (q = 1)"
    return GaussianMechanism(
        noise_std=sigma * dp.max_grad_norm,
        clip_norm=dp.max_grad_norm,
        steps=steps,
        sample_rate=rate,
        neighbouring="add_remove",
        description=f"DP-SGD, sigma = {sigma:g}, C = {dp.max_grad_norm:g}, {counted}, add/remove",
    )


def setting_bound(setting: Any, model: nn.Module | None = None) -> FormalBound:
    """The formal bound of a :class:`~lightning_gp.audit.catalog.DefenseSetting` (no kappa yet): the
    mechanism of its one defense, or none. A composition is not analysed: no formal bound."""
    if setting.undefended:
        return FormalBound(None, "undefended")
    if setting.wrap is not None or setting.architecture is not None:
        return FormalBound(None, f"{setting.name} changes the model or its training, not a formal mechanism")
    defenses = [setting.declared] if setting.declared is not None else list(setting.callbacks)
    if len(defenses) != 1:
        return FormalBound(None, f"{setting.name} composes {len(defenses)} defenses; compositions are not analysed")
    size = None if model is None else sum(p.numel() for p in model.parameters() if p.requires_grad)
    try:
        return FormalBound(defense_mechanism(defenses[0], size))
    except ValueError as err:
        return FormalBound(None, str(err).removeprefix("defense: "))


def prior_only_kappa(
    originals: Tensor,
    reference: Tensor | None,
    *,
    labels: Sequence[int] | Tensor | None = None,
    rule: LeakRule | None = None,
    confidence: float = 0.95,
) -> float:
    """The success rate of the best guess that sees only the prior, under the leak rule, taken from above.

    Fixed guesses, each the same for every target: a blank (0 and 0.5) image, the mean of
    ``reference`` (public images, pixels in [0, 1]) and each of its first :data:`KAPPA_GUESSES`
    images (``None``: no public images, only the blank guesses: a smaller, less safe kappa). A guess succeeds on an original when it meets one of the rule's pixel lines (PSNR, SSIM,
    MSE); when the rule has the semantic test and ``labels`` are given, a typical image of the most
    common class is counted as succeeding on every original of that class. The best guess's count
    over the ``n`` originals is raised to its Clopper-Pearson upper limit at ``confidence``.
    """
    rule = rule if rule is not None else LeakRule()
    originals = originals.detach().float().cpu()
    n = originals.shape[0]
    guesses = [torch.zeros_like(originals[:1]), torch.full_like(originals[:1], 0.5)]
    if reference is not None:
        reference = reference.detach().float().cpu()
        guesses += [reference.mean(0, keepdim=True), *reference[:KAPPA_GUESSES].split(1)]
    best = 0
    for guess in guesses:
        met = torch.zeros(n, dtype=torch.bool)
        shaped = guess.expand_as(originals)
        for metric, line in rule.thresholds.items():
            if metric == "psnr":
                met |= psnr(shaped, originals) > line
            elif metric == "ssim" and min(originals.shape[-2:]) >= 11:
                met |= ssim(shaped, originals) > line
            elif metric == "mse":
                met |= (shaped - originals).pow(2).flatten(1).mean(1) < line
        best = max(best, int(met.sum()))
    if "semantic" in rule.thresholds and labels is not None:
        classes = torch.as_tensor(labels)
        classes = classes.argmax(-1) if classes.is_floating_point() and classes.ndim > 1 else classes
        counts = torch.bincount(classes.flatten().long())
        best = max(best, int(counts.max()))
    return clopper_pearson(best, n, confidence)[1]
