"""The formal reconstruction bound of a defense setting, reported beside the audit's measured leaks.

An audit measures what today's attacks rebuild; a ReRo bound (:mod:`lightning_gp.privacy.rero`) says
what no informed adversary can exceed. Only a mechanism with a formal guarantee has one:

- :class:`~lightning_gp.callbacks.DPSGD`: per-example clipping at ``C``, noise ``sigma C``, its
  Poisson rate and the steps it took (before training: the audit's tapped step on a fixed batch and
  the steps of the simulation before it, ``q = 1``); add/remove neighbouring (sensitivity ``C``),
  the relation of the informed adversary.
- :class:`~lightning_gp.defenses.GaussianNoise` with ``clip``: it clips the client's batch gradient
  *coordinate-wise* to ``[-c, c]``, not per example, so one image of the batch can move the clipped
  gradient across the whole box: the L2 sensitivity is its diameter ``2 c sqrt(d)`` for ``d``
  parameters (replace-one with clipping norm ``c sqrt(d)``), noise ``scale``, one release per round.
- :class:`~lightning_gp.defenses.LocalGaussianMechanism`: the client clips its whole update to L2 norm
  ``C`` and adds ``N(0, (z C)^2 I)``; replacing one image (or the whole client batch) moves the clipped
  update by at most ``2 C`` (replace-one, clipping norm ``C``), one release per round. Behind secure
  aggregation (``aggregate_of = K'`` clients) the release is the sum of ``K'`` uploads, whose noises add
  up to ``N(0, K' (z C)^2 I)`` while one client still moves it by ``2 C``: the sum's mechanism.
  :class:`~lightning_gp.defenses.DistributedGaussianMechanism` (each client's share ``(z C)^2 / K`` of
  one central noise) has noise ``z C`` on the sum of its cohort of ``K``.
- everything else (pruning, quantisation, Soteria, PRECODE, Refiner, ATS, Laplace or Gaussian noise
  without clipping, compositions): no formal bound, with the reason; never a number.

**Rounds.** A client audited at round ``r`` has taken part in rounds ``0 .. r`` of the audit's
simulation, and the earlier releases shaped the attacked model: the bound composes all ``r + 1``
releases, each charged in full (``q = 1``), and its description says how many rounds it covers
(:func:`setting_bound`'s ``round``, :func:`defense_mechanism`'s ``releases``).

**kappa** (ReRo's baseline: the success of the best guess that sees only the prior) is measured on
at least :data:`KAPPA_IMAGES` training images (the audited ones, then a seeded draw of the rest, where
the training set has them: at 16 images the 95% upper limit of even 0 successes is 0.17 and of 3 is
0.46, which makes most bounds vacuous) with the audit's own leak rule, every fixed guess judged by
:meth:`~lightning_gp.audit.verdict.LeakRule.criteria` as the verdict judges a reconstruction
(:func:`prior_only_kappa`); eta grows with kappa, so kappa is taken from above (the best of many
prior-only guesses, then its Clopper-Pearson upper limit), never in the defense's favour.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.audit.verdict import BaselineScores, LeakRule, guess_floors, trivial_baselines
from lightning_gp.callbacks import DPSGD, GradientDefense
from lightning_gp.defenses import GaussianNoise, LocalGaussianMechanism
from lightning_gp.metrics.image_quality import check_pixel_range
from lightning_gp.metrics.recognition import RecognitionTests
from lightning_gp.metrics.report import METRICS, SIMILARITIES, pair_scores
from lightning_gp.privacy import GaussianMechanism, clopper_pearson
from lightning_gp.validation import check_int, check_number, check_positive_int

#: How many public (reference) images are tried as fixed prior-only guesses when measuring kappa.
KAPPA_GUESSES = 256
#: The training images an audit measures kappa on (where the training set holds that many).
KAPPA_IMAGES = 256


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


def defense_mechanism(
    defense: Any,
    num_parameters: int | None = None,
    *,
    releases: int = 1,
    aggregate_of: int | None = None,
    participation: float = 1.0,
) -> GaussianMechanism:
    """The Gaussian mechanism of one defense object (a :class:`DPSGD` callback, a ``GaussianNoise`` or
    ``LocalGaussianMechanism`` defense or its callback); a ``ValueError`` naming ``defense`` for one that has no formal bound.
    ``num_parameters``: the model's trainable parameter count (``GaussianNoise``'s sensitivity).

    ``releases``: how many releases of the client's update the bound composes: the audited one and
    every earlier one of the same client, each charged in full (``q = 1``: the target may be in each),
    e.g. ``r + 1`` for round ``r`` of a simulation whose clients take part in every round. A
    :class:`DPSGD` that has accounted steps (its ``privacy_history``) is charged what it accounted;
    more ``releases`` on top of such a history cannot be composed at one rate (a ``ValueError``).

    ``aggregate_of``: the release is the secure aggregate of that many clients' uploads (the server sees
    only their sum); a ``LocalGaussianMechanism`` is then charged the sum's noise. For the other
    mechanisms the bound stays the one upload's (valid for the sum by post-processing).

    ``participation``: the chance ``q`` that the client takes part in each of the ``releases`` rounds,
    drawn independently per round (Poisson client sampling, McMahan et al., ICLR 2018: the cohort of
    ``K`` of ``N`` clients, ``q = K / N``), as the accountant's sampling rate; for the client-level
    mechanisms (``LocalGaussianMechanism`` and its distributed variant) and a ``DPSGD`` without
    accounted steps of its own (one step on the client's batch per round: each example is in the
    step exactly when its client is). 1: every round, as the audit's simulation runs."""
    releases = check_positive_int(releases, "releases")
    summed = 1 if aggregate_of is None else check_positive_int(aggregate_of, "aggregate_of")
    check_number(participation, "participation", low=0.0, high=1.0, low_open=True)
    inner = defense.defense if isinstance(defense, GradientDefense) else defense
    if participation < 1.0 and not isinstance(inner, (LocalGaussianMechanism, DPSGD)):
        raise ValueError(
            f"participation: client sampling is accounted for the client-level Gaussian mechanisms and DP-SGD, "
            f"not {type(inner).__name__}"
        )
    if isinstance(defense, DPSGD):
        return _dp_sgd_mechanism(defense, releases, participation)
    if isinstance(inner, LocalGaussianMechanism):
        return _local_gaussian_mechanism(inner, releases, summed, participation)
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
            steps=releases,
            neighbouring="replace_one",
            description=(
                f"GaussianNoise: {_rounds_phrase(releases)}, coordinate clip {inner.clip:g} of {num_parameters} "
                f"parameters, any image of the batch moves the gradient by <= 2 c sqrt(d) = "
                f"{2 * inner.clip * math.sqrt(num_parameters):.3g}, noise std {inner.scale:g}"
            ),
        )
    name = type(inner).__name__
    raise ValueError(f"defense: {name} has no formal mechanism (clipping-bounded Gaussian noise): no formal bound")


def _rounds_phrase(releases: int) -> str:
    """``"one round"`` or ``"6 rounds composed (...)"``: what a bound of ``releases`` releases covers."""
    if releases == 1:
        return "one round"
    return (
        f"{releases} rounds composed (the audited round and the {releases - 1} before it, the client in every one, "
        "each charged in full, q = 1)"
    )


def _local_gaussian_mechanism(
    local: LocalGaussianMechanism, releases: int = 1, summed: int = 1, participation: float = 1.0
) -> GaussianMechanism:
    """``releases`` uploads of :class:`~lightning_gp.defenses.LocalGaussianMechanism` (or, with
    ``summed = K'``, of the secure sum of ``K'`` clients' uploads): the Gaussian mechanism (Dwork & Roth
    2014, Thm. A.1) on the update clipped to ``C`` (McMahan et al. 2018), noise the upload's std times
    ``sqrt(K')`` (independent noises add in variance), composed over the rounds; replace-one,
    sensitivity ``2 C`` (one image or the whole client batch replaced)."""
    C, name = local.max_update_norm, type(local).__name__
    noise = local.noise_std * math.sqrt(summed)
    what = "the client's whole update" if summed == 1 else f"the secure sum of {summed} clients' updates, each"
    rounds = (
        _rounds_phrase(releases)
        if participation == 1.0
        else f"{releases} rounds, the client in each with probability q = {participation:.4g} (Poisson client sampling)"
    )
    return GaussianMechanism(
        noise_std=noise,
        clip_norm=C,
        steps=releases,
        sample_rate=participation,
        neighbouring="replace_one",
        description=(
            f"{name}: {rounds}, {what} clipped to C = {C:g}, any image (or a whole client batch) "
            f"replaced moves it by <= 2 C, noise std {noise:.4g} ({noise / C:.4g} C)"
        ),
    )


def _dp_sgd_mechanism(dp: DPSGD, releases: int = 1, participation: float = 1.0) -> GaussianMechanism:
    history = [(float(s), float(q), int(n)) for s, q, n in dp.privacy_history]
    if history and participation < 1.0:
        raise ValueError(
            "participation: DPSGD accounted its own steps (privacy_history); client sampling is not composed"
        )
    if history:
        settings = {(s, q) for s, q, _ in history}
        if len(settings) > 1:
            raise ValueError(f"defense: DPSGD ran with several (noise multiplier, rate) settings {sorted(settings)}")
        (sigma, rate), steps = settings.pop(), sum(n for _, _, n in history)
        if releases > 1:
            raise ValueError(
                f"defense: DPSGD accounted {steps} step(s) of its own at q = {rate:.4g} (privacy_history); "
                f"{releases - 1} earlier round(s) on top of them cannot be composed at one rate"
            )
        counted = f"{steps} step(s) at Poisson rate q = {rate:.4g}"
    else:
        if dp.noise_multiplier is None:
            raise ValueError(
                "defense: DPSGD(target_epsilon=...) picks its noise at fit start; no bound before training"
            )
        sigma, rate, steps = dp.noise_multiplier, participation, releases
        counted = (
            "the audited step on a fixed batch (q = 1)"
            if releases == 1 and participation == 1.0
            else f"{releases} steps composed (the audited step on a fixed batch and the {releases - 1} training "
            "steps before it, each charged in full, q = 1)"
            if participation == 1.0
            else f"{releases} rounds of one step on the client's batch, the client in each with probability "
            f"q = {participation:.4g} (Poisson client sampling)"
        )
    return GaussianMechanism(
        noise_std=sigma * dp.max_grad_norm,
        clip_norm=dp.max_grad_norm,
        steps=steps,
        sample_rate=rate,
        neighbouring="add_remove",
        description=f"DP-SGD, sigma = {sigma:g}, C = {dp.max_grad_norm:g}, {counted}, add/remove",
    )


def setting_bound(
    setting: Any, model: nn.Module | None = None, *, round: int = 0, aggregate_of: int | None = None
) -> FormalBound:
    """The formal bound of a :class:`~lightning_gp.audit.catalog.DefenseSetting` (no kappa yet): the
    mechanism of its one defense, or none. A composition is not analysed: no formal bound.

    ``round``: the audited round. The audit's simulation
    (:func:`~lightning_gp.audit.rounds.tap_defended_round`) has every client take part in every round
    (on the plain-Trainer runner, every image may be in every step), so the client audited at round
    ``r`` has released ``r + 1`` updates that shaped or are the attacked one: the bound composes all
    ``r + 1``, each charged in full (``q = 1``). ``aggregate_of``: the bound of the secure aggregate of
    that many clients (:func:`defense_mechanism`)."""
    round = check_int(round, "round", low=0)
    if setting.undefended:
        return FormalBound(None, "undefended")
    if setting.wrap is not None or setting.architecture is not None:
        return FormalBound(None, f"{setting.name} changes the model or its training, not a formal mechanism")
    defenses = [setting.declared] if setting.declared is not None else list(setting.callbacks)
    if len(defenses) != 1:
        return FormalBound(None, f"{setting.name} composes {len(defenses)} defenses; compositions are not analysed")
    size = None if model is None else sum(p.numel() for p in model.parameters() if p.requires_grad)
    try:
        return FormalBound(defense_mechanism(defenses[0], size, releases=round + 1, aggregate_of=aggregate_of))
    except ValueError as err:
        return FormalBound(None, str(err).removeprefix("defense: "))


def lpips_for_rule(rule: LeakRule, lpips_fn: nn.Module | None = None) -> nn.Module | None:
    """The LPIPS module :func:`prior_only_kappa` needs under ``rule``: ``lpips_fn``, a new
    :class:`~lightning_gp.metrics.lpips.LPIPS` where the rule has an LPIPS line and none is given
    (an audit run with LPIPS off still owes its bound the rule's every line), else ``None``."""
    if "lpips" not in rule.thresholds or lpips_fn is not None:
        return lpips_fn
    from lightning_gp.metrics.lpips import LPIPS

    return LPIPS()


def prior_only_guesses(
    originals: Tensor, reference: Tensor | None = None, dataset_mean: Sequence[float] | None = None
) -> Tensor:
    """The fixed prior-only guesses :func:`prior_only_kappa` tries, ``[G, C, H, W]`` pixels in [0, 1]:
    an all-zero and a mid-grey 0.5 image, the mean image of ``reference`` (public images, pixels in
    [0, 1]) and its first :data:`KAPPA_GUESSES` images, and a constant image of ``dataset_mean`` (one
    value or one per channel) where it is given. ``originals`` give the image shape."""
    like = originals.detach().float().cpu()[:1]
    guesses = [torch.zeros_like(like), torch.full_like(like, 0.5)]
    if reference is not None:
        reference = reference.detach().float().cpu()
        if reference.ndim != 4 or reference.shape[0] == 0 or reference.shape[1:] != like.shape[1:]:
            raise ValueError(
                f"reference {tuple(reference.shape)} must hold public images of the originals' shape "
                f"{tuple(like.shape[1:])}"
            )
        guesses += [reference.mean(0, keepdim=True).clamp(0, 1), reference[:KAPPA_GUESSES]]
    if dataset_mean is not None:
        values = [float(dataset_mean)] if isinstance(dataset_mean, (int, float)) else [float(v) for v in dataset_mean]
        values = values * like.shape[1] if len(values) == 1 else values
        if len(values) != like.shape[1]:
            raise ValueError(f"dataset_mean needs 1 or {like.shape[1]} per-channel values, got {len(values)}")
        guesses.append(torch.tensor(values).view(1, -1, 1, 1).expand_as(like).clamp(0, 1))
    return torch.cat(guesses)


def prior_only_leaks(
    originals: Tensor,
    reference: Tensor | None,
    *,
    labels: Sequence[int] | Tensor | None = None,
    rule: LeakRule | None = None,
    lpips_fn: nn.Module | None = None,
    dataset_mean: Sequence[float] | None = None,
    baselines: Sequence[BaselineScores] | None = None,
    identification: bool = False,
) -> Tensor:
    """Which originals each fixed prior-only guess leaks under ``rule``: ``[B, G]`` bool, column ``j``
    the guess ``prior_only_guesses(originals, reference, dataset_mean)[j]``.

    Each guess is the same for every original ("a guess repeated B times": no matching), scored
    against each original by the reports' own scoring code (what
    :func:`~lightning_gp.metrics.report.reconstruction_report` computes for every output and
    original: PSNR, SSIM, MSE, NMI, LPIPS with ``lpips_fn`` where the rule has an LPIPS line, the
    noise ratio of the guess, the semantic score of the guess for the original's label), and judged
    by the rule itself, :meth:`LeakRule.criteria` with no prior-only control and the trivial-guess
    floors of the paired noise-ratio test built as :func:`~lightning_gp.audit.verdict.worst_case_report`
    builds them: ``baselines``, by default ``trivial_baselines(originals, reference_images=reference,
    dataset_mean=dataset_mean)`` (pass the verdict's own where it was judged with other trivial
    guesses).

    A score the reports cannot compute on these images (the noise ratio for a channel count no
    evaluation network takes, the semantic test for images or labels its classifier was not built
    for) cannot fire in the verdict either and is left out; a score the rule needs from the caller is
    an error naming the argument: ``labels`` for the semantic test, ``lpips_fn`` for an LPIPS line.

    ``identification=True`` also scores the guesses by the rule's identification test (``rule.tests``),
    so the gate applies to them as to any output. A public guess then competes with its own copy in the
    test's pool, which only raises its p-value: fewer successes, a count from below, for a comparison
    that must not overstate the prior (:mod:`~lightning_gp.audit.advantage`). By default the guesses
    are judged ungated (:data:`UNSCORED_GUESS_IDENTIFICATION`: more successes, kappa from above).
    """
    rule = rule if rule is not None else LeakRule()
    if not isinstance(originals, Tensor) or originals.ndim != 4 or originals.shape[0] == 0:
        raise ValueError(
            f"originals must be a [B, C, H, W] batch of pixel images, got {getattr(originals, 'shape', originals)}"
        )
    originals = originals.detach().float().cpu()
    check_pixel_range(originals, "originals")
    if "lpips" in rule.thresholds and lpips_fn is None:
        raise ValueError("lpips_fn: the rule has an LPIPS line; pass the LPIPS module the reports score with")
    classes = _class_labels(labels, originals.shape[0]) if labels is not None else None
    if "semantic" in rule.thresholds and classes is None:
        raise ValueError("labels: the rule has the semantic test, which scores a guess for each original's label")
    guesses = prior_only_guesses(originals, reference, dataset_mean)
    if baselines is None:
        baselines = trivial_baselines(originals, reference_images=reference, dataset_mean=dataset_mean)
    floors = guess_floors(originals, baselines)
    assert floors is not None
    scores = _guess_scores(guesses, originals, rule, classes, lpips_fn, identification)
    # the rule's own criteria pair by pair, on Python floats (indexing a tensor per pair cost more than the rule)
    table = {m: scores[m].double().tolist() for m in METRICS if m in scores}
    leaks = [
        [
            bool(rule.criteria({m: table[m][i][j] if m in table else None for m in METRICS}, floors[i], None))
            for j in range(guesses.shape[0])
        ]
        for i in range(originals.shape[0])
    ]
    return torch.tensor(leaks, dtype=torch.bool).view(originals.shape[0], guesses.shape[0])


def _class_labels(labels: Sequence[int] | Tensor, count: int) -> Tensor:
    """``labels`` as ``[count]`` class indices (one-hot or soft labels: their argmax)."""
    classes = torch.as_tensor(labels)
    classes = classes.argmax(-1) if classes.is_floating_point() and classes.ndim > 1 else classes
    classes = classes.detach().cpu().long().reshape(-1)
    if classes.numel() != count:
        raise ValueError(f"labels: {classes.numel()} labels for {count} originals")
    return classes


#: Why the fixed guesses are not scored by the identification test: a public image's copy sits in the
#: test's own pool, so it cannot identify an original, and without their p-values the fixed lines judge the
#: guesses ungated, which can only count more of them as successes (kappa stays taken from above) at a
#: fraction of the cost (every guess against every public image).
UNSCORED_GUESS_IDENTIFICATION = (
    "the fixed prior-only guesses are judged without the identification gate (kappa from above)"
)


def _guess_scores(
    guesses: Tensor,
    originals: Tensor,
    rule: LeakRule,
    classes: Tensor | None,
    lpips_fn: nn.Module | None,
    identification: bool = False,
) -> dict[str, Tensor]:
    """Every guess scored against every original by the reports' own scoring
    (:func:`~lightning_gp.metrics.report.reconstruction_report` scores every output against every
    original the same way): metric -> ``[B, G]``; a metric the reports cannot compute here is absent."""
    with torch.no_grad():
        scores, _ = pair_scores(
            guesses,
            originals,
            torch.zeros(guesses.shape[0], dtype=torch.bool),
            lpips_fn if "lpips" in rule.thresholds else None,
            rule.noise_ratio_line is not None,
            None,
            "semantic" in rule.thresholds,
            classes,
            _guess_tests(rule, identification),
            rule_similarities(rule),
        )
    return scores


def rule_similarities(rule: LeakRule) -> tuple[str, ...]:
    """The similarities of :data:`~lightning_gp.metrics.report.SIMILARITIES` that ``rule`` reads: its own lines,
    and PSNR and SSIM where its paired noise-ratio test compares them with the trivial guesses'."""
    read = set(rule.thresholds) | ({"psnr", "ssim"} if rule.noise_ratio_line is not None else set())
    return tuple(m for m in SIMILARITIES if m in read)


def _guess_tests(rule: LeakRule, identification: bool) -> RecognitionTests | None:
    """The rule's tests the fixed guesses are scored by: without identification unless asked for."""
    if rule.tests is None or identification:
        return rule.tests
    return rule.tests.without("identification", UNSCORED_GUESS_IDENTIFICATION)


def prior_only_successes(
    originals: Tensor,
    reference: Tensor | None,
    *,
    labels: Sequence[int] | Tensor | None = None,
    rule: LeakRule | None = None,
    lpips_fn: nn.Module | None = None,
    dataset_mean: Sequence[float] | None = None,
    baselines: Sequence[BaselineScores] | None = None,
    identification: bool = False,
) -> int:
    """How many of the originals the best prior-only guess succeeds on, under ``rule``: the most any
    fixed guess of :func:`prior_only_leaks` leaks, and, where the rule has the semantic test, at
    least the count of the most common class (a typical image of that class would be named on every
    original of it). The count behind :func:`prior_only_kappa`; arguments as there."""
    rule = rule if rule is not None else LeakRule()
    leaks = prior_only_leaks(
        originals,
        reference,
        labels=labels,
        rule=rule,
        lpips_fn=lpips_fn,
        dataset_mean=dataset_mean,
        baselines=baselines,
        identification=identification,
    )
    best = int(leaks.sum(0).max())
    if "semantic" in rule.thresholds and labels is not None:
        best = max(best, int(torch.bincount(_class_labels(labels, originals.shape[0])).max()))
    return best


def prior_only_kappa(
    originals: Tensor,
    reference: Tensor | None,
    *,
    labels: Sequence[int] | Tensor | None = None,
    rule: LeakRule | None = None,
    lpips_fn: nn.Module | None = None,
    dataset_mean: Sequence[float] | None = None,
    baselines: Sequence[BaselineScores] | None = None,
    confidence: float = 0.95,
) -> float:
    """ReRo's kappa on ``originals`` (pixels in [0, 1]) under the audit's leak rule, taken from above.

    In ReRo (Balle, Cherubin & Hayes 2022; Hayes, Mahloujifar & Balle, NeurIPS 2023) kappa is the
    success probability of the best guess that sees only the prior, a fixed image tried on every
    target, under the same success criterion as the attack's; the bound ``eta = 1 - f(kappa)`` grows
    with it, so it is measured here from above:

    - the guesses (:func:`prior_only_guesses`): all-zero and mid-grey images, the mean image of
      ``reference`` (public images, pixels in [0, 1]) and its first :data:`KAPPA_GUESSES` images, a
      constant image of ``dataset_mean`` where given (``reference=None``: only the constant guesses,
      a smaller, less safe kappa);
    - a guess succeeds on an original when the leak rule, :meth:`LeakRule.criteria` as the verdict
      applies it, calls it a leak of that original (:func:`prior_only_leaks`): every line of
      ``rule.thresholds`` (PSNR, SSIM, the semantic test for the original's ``labels``, LPIPS with
      ``lpips_fn``, NMI, MSE) and the paired noise-ratio test against the floors of the trivial
      guesses (``baselines``; by default those ``worst_case_report`` scores with the same
      ``reference``/``dataset_mean``), without the identification test and so without its gate
      (:data:`UNSCORED_GUESS_IDENTIFICATION`: more successes, never fewer);
    - with the semantic test, a typical image of the most common class counts as succeeding on
      every original of that class;
    - the best count over the ``B`` originals (:func:`prior_only_successes`) is raised to its
      Clopper-Pearson upper limit at ``confidence``.
    """
    count = prior_only_successes(
        originals,
        reference,
        labels=labels,
        rule=rule,
        lpips_fn=lpips_fn,
        dataset_mean=dataset_mean,
        baselines=baselines,
    )
    return clopper_pearson(count, int(originals.shape[0]), confidence)[1]
