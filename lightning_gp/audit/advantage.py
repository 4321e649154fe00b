"""The reconstruction advantage over the prior: how much more often the attacks identify an original than
a guess that sees only the prior does.

Hayes, Mahloujifar and Balle ("Bounding data reconstruction attacks with the hypothesis testing
interpretation of differential privacy", NeurIPS 2023) measure a reconstruction attack by its success
rate against ``kappa``, the success rate of the best guess made from the prior alone: an attack that
succeeds on 20% of the images where a fixed guess succeeds on 20% has learned nothing from the
gradient. The audit's leak rule (:class:`~lightning_gp.audit.verdict.LeakRule`) answers "does anything
recognisable come back"; this module answers "does the gradient tell the attacker which individual it
was, beyond what it knew".

**Success** is the rule's criteria that point at one individual (:func:`identifying_criteria`): the
identification test, and the fixed similarity lines and the paired noise-ratio test, which count only
on an output that passes the identification gate. The semantic line is left out: a classifier naming
the original's class is met by a typical image of that class (on Fashion-MNIST the best prior-only
guess meets the full rule on about a fifth of the images), so it measures class membership, which the
prior already holds. An attack with a data prior counts only where it also beats its own prior-only
guesses on that image (the prior-only control, :mod:`~lightning_gp.audit.prior_control`), as in the
verdict. An image succeeds when **any** attack of the threat model succeeds on it (the worst case over
attacks, image by image).

**The prior's rate** is the best fixed prior-only guess's success rate under the same criteria on at
least :data:`MIN_PRIOR_IMAGES` images (:func:`~lightning_gp.audit.bounds.prior_only_successes` with
:func:`identifying_rule` and the guesses scored by the identification test). A public guess sits in
the identification test's own pool, which can only make its p-value larger: the prior's rate is taken
from below, so the advantage errs against the defense.

**The advantage** is ``successes / images - prior_successes / prior_images``, with Newcombe's hybrid
score interval for a difference of two independent proportions (Newcombe, Statistics in Medicine 17,
1998, method 10). :attr:`ReconstructionAdvantage.status` holds it to a line (:data:`MAX_ADVANTAGE`):
"fails" when the advantage is above it (a found identification counts however incomplete the audit),
"inconclusive" when the worst case names a gap in the audit (or was stored without recording its
gaps), else "holds". With 16 images one identified image is an advantage of 0.0625: the line then
reads "no image identified"; the interval says how much more a larger sample could still show.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

from lightning_gp.audit.verdict import LeakRule, WorstCaseReport
from lightning_gp.validation import check_int, check_number, check_positive_int

#: The rule's lines that a guess of the original's class meets without knowing the individual.
CLASS_LEVEL_METRICS: tuple[str, ...] = ("semantic",)
#: The largest advantage over the prior a defense may leave (issue 49's bar).
MAX_ADVANTAGE: float = 0.05
#: The fewest images the prior's rate is measured on: at 8 images the 95% upper limit of 3 successes is
#: 0.76, which makes any comparison vacuous.
MIN_PRIOR_IMAGES: int = 200

AdvantageStatus = Literal["holds", "fails", "inconclusive"]


def criterion_metric(criterion: str) -> str:
    """The metric a criterion of :meth:`~lightning_gp.audit.verdict.LeakRule.criteria` names (its first
    word: ``"semantic > 0.7"`` -> ``"semantic"``, ``"noise_ratio < 0.4 and ..."`` -> ``"noise_ratio"``)."""
    return criterion.split(" ", 1)[0]


def identifying_criteria(criteria: Sequence[str]) -> list[str]:
    """The criteria of one reconstruction that point at its individual original (all but
    :data:`CLASS_LEVEL_METRICS`)."""
    return [c for c in criteria if criterion_metric(c) not in CLASS_LEVEL_METRICS]


def identifying_rule(rule: LeakRule) -> LeakRule:
    """``rule`` without its class-level lines: the success criterion the prior's rate is measured under."""
    thresholds = {m: t for m, t in rule.thresholds.items() if m not in CLASS_LEVEL_METRICS}
    if not thresholds:
        raise ValueError(
            f"rule: its only lines are class-level ({rule.describe()}); give it a similarity or identification line"
        )
    return dataclasses.replace(rule, thresholds=thresholds)


def identified_images(worst: WorstCaseReport) -> dict[int, list[str]]:
    """Image position -> the attacks that identify it (:func:`identifying_criteria` of their criteria)."""
    out: dict[int, list[str]] = {}
    for position, row in enumerate(worst.rows):
        attacks = [a for a, criteria in row.criteria.items() if identifying_criteria(criteria)]
        if attacks:
            out[position] = attacks
    return out


def _wilson(successes: int, trials: int, z: float) -> tuple[float, float]:
    """Wilson's score interval of a binomial rate."""
    p = successes / trials
    scale = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / scale
    half = z / scale * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_interval(
    successes: int, trials: int, other_successes: int, other_trials: int, confidence: float = 0.95
) -> tuple[float, float]:
    """Newcombe's hybrid score interval (method 10) of ``successes / trials - other_successes / other_trials``
    for two independent binomial samples."""
    check_positive_int(trials, "trials")
    check_positive_int(other_trials, "other_trials")
    check_int(successes, "successes", low=0, high=trials)
    check_int(other_successes, "other_successes", low=0, high=other_trials)
    check_number(confidence, "confidence", low=0.0, high=1.0, low_open=True, high_open=True)
    z = NormalDist().inv_cdf((1 + confidence) / 2)
    p1, p2 = successes / trials, other_successes / other_trials
    (l1, u1), (l2, u2) = _wilson(successes, trials, z), _wilson(other_successes, other_trials, z)
    delta = p1 - p2
    return delta - math.hypot(p1 - l1, u2 - p2), delta + math.hypot(u1 - p1, p2 - l2)


@dataclass(frozen=True)
class ReconstructionAdvantage:
    """The attacks' identification rate on one threat model's images against the prior's rate.

    Attributes:
        successes: images any attack identifies, of ``images``; ``by_attack``: attack -> its own count.
        prior_successes: images the best prior-only guess identifies, of ``prior_images``.
        gaps: what the audit did not cover (``None``: not recorded, as on results stored before).
        confidence: the interval's level.
    """

    successes: int
    images: int
    prior_successes: int
    prior_images: int
    by_attack: dict[str, int]
    gaps: list[str] | None
    confidence: float = 0.95

    @property
    def rate(self) -> float:
        return self.successes / self.images

    @property
    def prior_rate(self) -> float:
        return self.prior_successes / self.prior_images

    @property
    def advantage(self) -> float:
        return self.rate - self.prior_rate

    @property
    def interval(self) -> tuple[float, float]:
        return difference_interval(
            self.successes, self.images, self.prior_successes, self.prior_images, self.confidence
        )

    @property
    def status(self) -> AdvantageStatus:
        """ "fails" above :data:`MAX_ADVANTAGE`, else "inconclusive" with a gap in the audit, else "holds"."""
        if self.advantage > MAX_ADVANTAGE:
            return "fails"
        return "inconclusive" if self.gaps is None or self.gaps else "holds"

    @property
    def worst_attack(self) -> str | None:
        """The attack that identifies the most images (``None``: none identifies any)."""
        best = max(self.by_attack.items(), key=lambda item: item[1], default=None)
        return None if best is None or best[1] == 0 else best[0]

    def describe(self) -> str:
        low, high = self.interval
        text = (
            f"{self.status}: advantage {self.advantage:+.3f} ({self.confidence:.0%} CI {low:+.3f} .. {high:+.3f}); "
            f"{self.successes}/{self.images} identified against the prior's {self.prior_successes}/{self.prior_images}"
        )
        if self.worst_attack is not None:
            text += f", most by {self.worst_attack} ({self.by_attack[self.worst_attack]})"
        if self.status == "inconclusive":
            text += "; " + ("; ".join(self.gaps) if self.gaps else "the audit's gaps were not recorded")
        return text


def reconstruction_advantage(
    worst: WorstCaseReport, prior_successes: int, prior_images: int, *, confidence: float = 0.95
) -> ReconstructionAdvantage:
    """The advantage of ``worst``'s attacks over the prior (module docstring).

    Args:
        worst: one threat model's worst case (:attr:`~lightning_gp.audit.SettingAudit.passive`, ...).
        prior_successes: images the best prior-only guess identifies, out of ``prior_images``
            (:func:`~lightning_gp.audit.bounds.prior_only_successes` with :func:`identifying_rule` and
            ``identification=True``), measured on at least :data:`MIN_PRIOR_IMAGES` images.
    """
    if not isinstance(worst, WorstCaseReport):
        raise TypeError(f"worst must be a WorstCaseReport, got {type(worst).__name__}")
    if not worst.rows:
        raise ValueError("worst: a worst case of no images has no advantage")
    check_positive_int(prior_images, "prior_images")
    if prior_images < MIN_PRIOR_IMAGES:
        raise ValueError(
            f"prior_images: the prior's rate needs at least {MIN_PRIOR_IMAGES} images (got {prior_images}); "
            "on a few images its interval makes every comparison vacuous"
        )
    check_int(prior_successes, "prior_successes", low=0, high=prior_images)
    identified = identified_images(worst)
    by_attack = {a: sum(a in attacks for attacks in identified.values()) for a in worst.attacks}
    return ReconstructionAdvantage(
        successes=len(identified),
        images=len(worst.rows),
        prior_successes=prior_successes,
        prior_images=prior_images,
        by_attack=by_attack,
        gaps=recorded_gaps(worst),
        confidence=confidence,
    )


def recorded_gaps(worst: WorstCaseReport) -> list[str] | None:
    """What the audit behind ``worst`` did not cover: its recorded gaps, or on a report stored before they
    were kept, what its verdict implies ("private": none, "inconclusive": its reasons; "leaks": unknown,
    ``None``)."""
    if worst.gaps is not None:
        return list(worst.gaps)
    if worst.verdict == "private":
        return []
    return list(worst.verdict_reasons) if worst.verdict == "inconclusive" else None
