"""Reconstruction robustness (ReRo) of a clipped, (Poisson-subsampled) Gaussian mechanism.

A mechanism is ``(eta, kappa)``-ReRo when no informed adversary (who knows every record but the
target) reconstructs the target with probability above ``eta``, where ``kappa`` is the success
probability of the best guess that sees only the prior (Balle, Cherubin, Hayes, "Reconstructing
Training Data with Informed Adversaries", S&P 2022, Def. 2). A mechanism with f-DP trade-off curve
``f`` is ``(1 - f(kappa), kappa)``-ReRo (Kaissis, Hayes, Ziller, Rueckert, "Bounding data
reconstruction attacks with the hypothesis testing interpretation of differential privacy", 2023,
Thm. 1; the same bound drives Hayes, Mahloujifar, Balle, "Bounding Training Data Reconstruction in
DP-SGD", NeurIPS 2023): the reconstruction test "the adversary's output lies within the success
region of the target" has false-positive rate at most ``kappa`` on the output of the mechanism run
without the target, so its power on the output with the target is at most ``1 - f(kappa)``.

For ``T`` steps of a Gaussian mechanism with noise multiplier ``sigma`` (noise std over the L2
sensitivity) on the full data, ``f = G_mu`` with ``mu = sqrt(T) / sigma`` (Dong, Roth, Su, "Gaussian
Differential Privacy", 2019, Cor. 3.3), so ``eta = Phi(Phi^-1(kappa) + sqrt(T) / sigma)``. With
Poisson sampling at rate ``q < 1`` the curve is that of the subsampled Gaussian composed ``T``
times; it is computed from its privacy-loss distribution (``dp_accounting``'s PLD, composed ``T``
times) and turned into a trade-off curve by ``riskcal`` (Kulynych et al., "Attack-Aware Noise
Calibration for Differential Privacy", NeurIPS 2024, Alg. 1). The same code path serves ``q = 1``;
the closed form above is its check (``tests/test_privacy_bounds.py``).
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from typing import Any, Literal

from lightning_gp.validation import check_choice, check_number, check_positive, check_positive_int

Neighbouring = Literal["add_remove", "replace_one"]
NEIGHBOURING: tuple[Neighbouring, ...] = ("add_remove", "replace_one")
#: The PLD's discretisation of the privacy loss (dp_accounting's default): ``eta`` is exact to ~1e-6 at
#: ``q = 1`` and pessimistic (never below the true bound) under subsampling.
PLD_GRID = 1e-4
#: Below this noise multiplier a PLD grid of :data:`PLD_GRID` would not fit in memory (its privacy
#: losses span about 1 / sigma^2); the bound there is the one without subsampling, never lower.
PLD_MIN_NOISE_MULTIPLIER = 0.05
#: How far one record moves a release, in clipping norms, under each relation.
_SENSITIVITY: dict[str, float] = {"add_remove": 1.0, "replace_one": 2.0}


@dataclass(frozen=True)
class GaussianMechanism:
    """``steps`` releases of a sum of records, each clipped to L2 norm ``clip_norm``, plus
    ``N(0, noise_std^2 I)``; each record joins each release independently with probability
    ``sample_rate`` (Poisson sampling; ``1``: every release sees every record).

    ``neighbouring`` is the relation the guarantee is stated for: ``"add_remove"`` (one record present
    or absent: the sum moves by at most ``clip_norm``, DP-SGD's usual sensitivity ``C``) or
    ``"replace_one"`` (one record replaced by another: the sensitivity doubles, ``2 C``).
    ``description`` says in words what was counted as a record and a release (for reports).
    """

    noise_std: float
    clip_norm: float
    steps: int = 1
    sample_rate: float = 1.0
    neighbouring: Neighbouring = "add_remove"
    description: str = ""

    def __post_init__(self) -> None:
        check_number(self.noise_std, "noise_std", low=0.0)
        check_positive(self.clip_norm, "clip_norm")
        check_positive_int(self.steps, "steps")
        check_number(self.sample_rate, "sample_rate", low=0.0, high=1.0, low_open=True)
        check_choice(self.neighbouring, "neighbouring", NEIGHBOURING)

    @property
    def noise_multiplier(self) -> float:
        """``sigma``: the noise std over the clipping norm (``0``: no noise)."""
        return self.noise_std / self.clip_norm

    @property
    def sensitivity(self) -> float:
        """The L2 sensitivity of one release under :attr:`neighbouring`: ``C`` or ``2 C``."""
        return self.clip_norm * _SENSITIVITY[self.neighbouring]

    def epsilon(self, delta: float) -> float:
        """The ``(epsilon, delta)`` guarantee of the mechanism, from the same PLD (``inf`` without noise)."""
        check_number(delta, "delta", low=0.0, high=1.0, low_open=True, high_open=True)
        if self.noise_std == 0:
            return math.inf
        pld = _pld(self.noise_multiplier, self.sample_rate, self.steps, self.neighbouring)
        return float(pld.get_epsilon_for_delta(delta))

    def eta(self, kappa: float) -> float:
        """The ReRo bound ``eta = 1 - f(kappa)`` of this mechanism: see :func:`reconstruction_bound`."""
        return reconstruction_bound(
            self.noise_multiplier,
            steps=self.steps,
            sample_rate=self.sample_rate,
            kappa=kappa,
            neighbouring=self.neighbouring,
        )


def reconstruction_bound(
    noise_multiplier: float,
    *,
    steps: int = 1,
    sample_rate: float = 1.0,
    kappa: float,
    neighbouring: Neighbouring = "add_remove",
) -> float:
    """The ReRo bound ``eta = 1 - f(kappa)`` (Kaissis et al. 2023, Thm. 1) of ``steps`` compositions of
    the Gaussian mechanism with ``noise_multiplier`` (noise std over the clipping norm ``C``), Poisson
    subsampled at ``sample_rate``: no informed adversary reconstructs a target with probability above
    ``eta`` when a guess from the prior alone succeeds with probability ``kappa`` (e.g. ``1 / n`` in a
    game with ``n`` equally likely candidates).

    At ``sample_rate = 1`` and ``"add_remove"`` (sensitivity ``C``) this is
    ``Phi(Phi^-1(kappa) + sqrt(steps) / noise_multiplier)``; ``"replace_one"`` doubles the sensitivity
    (computed in that closed form, also as the upper bound where ``noise_multiplier`` is below
    :data:`PLD_MIN_NOISE_MULTIPLIER`). Under subsampling the trade-off
    curve ``f`` comes from dp_accounting's privacy-loss distribution and riskcal's ``get_beta_from_pld``
    (symmetrised over the two directions of the relation, so never below the one-directional bound).
    ``noise_multiplier = 0`` (no noise) gives ``1``.
    """
    check_number(noise_multiplier, "noise_multiplier", low=0.0)
    check_positive_int(steps, "steps")
    check_number(sample_rate, "sample_rate", low=0.0, high=1.0, low_open=True)
    check_number(kappa, "kappa", low=0.0, high=1.0)
    check_choice(neighbouring, "neighbouring", NEIGHBOURING)
    if noise_multiplier == 0 or kappa == 1:
        return 1.0
    if sample_rate == 1 or noise_multiplier < PLD_MIN_NOISE_MULTIPLIER:
        # Without subsampling the composition is exactly Gaussian DP with mu = sqrt(steps) * s / sigma
        # (s = 1 or 2, the relation's sensitivity; Dong, Roth & Su 2022, Cor. 2.5): eta = Phi(Phi^-1(kappa)
        # + mu), no PLD needed. Subsampling only lowers it, so where sigma is too small for a PLD
        # grid to fit in memory this is a safe upper bound (it errs against the mechanism).
        if kappa == 0:
            return 0.0
        mu = math.sqrt(steps) * _SENSITIVITY[neighbouring] / float(noise_multiplier)
        normal = statistics.NormalDist()
        z = normal.inv_cdf(float(kappa)) + mu
        return min(1.0, max(float(kappa), normal.cdf(z) if z < 38 else 1.0))
    from riskcal.analysis import get_beta_from_pld

    pld = _pld(float(noise_multiplier), float(sample_rate), int(steps), neighbouring)
    beta = float(get_beta_from_pld(pld, alpha=float(kappa)))
    return min(1.0, max(float(kappa), 1.0 - beta))


@functools.lru_cache(maxsize=64)
def _pld(noise_multiplier: float, sample_rate: float, steps: int, neighbouring: Neighbouring) -> Any:
    """dp_accounting's PLD of ``steps`` Poisson-subsampled Gaussian steps at unit sensitivity (cached:
    a bound and its epsilon share one composition)."""
    from dp_accounting import NeighboringRelation
    from dp_accounting.pld import privacy_loss_distribution

    relation = (
        NeighboringRelation.ADD_OR_REMOVE_ONE if neighbouring == "add_remove" else NeighboringRelation.REPLACE_ONE
    )
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        sensitivity=1.0,  # the clipping norm; dp_accounting doubles it under REPLACE_ONE itself
        sampling_prob=sample_rate,
        use_connect_dots=True,
        value_discretization_interval=PLD_GRID,
        neighboring_relation=relation,
    ).self_compose(steps)
