"""Issue 49's bar, measured on one audit: the advantage over the prior, the ReRo bound of the deployment,
utility at 1,000 clients a round and the client's step, and which of them binds.

The parts (used by ``benchmarks/defense_that_holds.py``):

- :func:`prior_counts`: on :data:`~lightning_gp.audit.bounds.KAPPA_IMAGES` training images drawn with the
  seed, the best fixed prior-only guess's identifications (the advantage's baseline,
  :mod:`lightning_gp.audit.advantage`) and its successes under the full leak rule, judged ungated
  (kappa from above, as the audit's bound takes it);
- :class:`Deployment` and :func:`deployment_bound`: the per-client ReRo bound over every round of a
  deployment in which a client takes part with probability ``cohort / population`` (Poisson client
  sampling), the secure sum of the cohort released each round;
- :func:`bar_rows`: one row per threat model of an audit, with each limit and the ones that fail.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_gp.audit import WorstCaseReport, identifying_rule, reconstruction_advantage
from lightning_gp.audit.bounds import KAPPA_IMAGES, defense_mechanism, prior_only_kappa, prior_only_successes
from lightning_gp.audit.rounds import public_examples, training_examples
from lightning_gp.audit.verdict import LeakRule
from lightning_gp.normalization import denormalize

#: Issue 49's limits beside the advantage's (:data:`~lightning_gp.audit.advantage.MAX_ADVANTAGE`).
ETA_MARGIN = 0.10
MIN_PMM = 0.97
MAX_STEP_RATIO = 1.2

#: The threat models of an audit, by the name its table gives them.
VIEWS = {
    "passive": "passive",
    "active": "active",
    "aggregate": "secure aggregation",
    "aggregate_active": "secure aggregation, malicious server",
}


@dataclass(frozen=True)
class PriorCounts:
    """The best fixed prior-only guess on ``images`` training images: ``identified`` by the identifying
    criteria with the identification test (from below), and ``kappa`` (the full rule, ungated, its 95%
    upper limit: the kappa the bound is read at)."""

    identified: int
    images: int
    kappa: float


def prior_counts(datamodule: Any, rule: LeakRule, seed: int, count: int = KAPPA_IMAGES) -> PriorCounts:
    """:class:`PriorCounts` on ``count`` training images of ``datamodule`` drawn with ``seed``, against its
    public split's images as the guesses (``rule`` calibrated on that split)."""
    images, labels = training_examples(datamodule, count, seed)
    originals = denormalize(images, datamodule.mean, datamodule.std).clamp(0, 1)
    public = denormalize(public_examples(datamodule)[0], datamodule.mean, datamodule.std).clamp(0, 1)
    identified = prior_only_successes(
        originals, public, labels=labels, rule=identifying_rule(rule), identification=True
    )
    kappa = prior_only_kappa(originals, public, labels=labels, rule=rule)
    return PriorCounts(identified, len(labels), kappa)


@dataclass(frozen=True)
class Deployment:
    """``rounds`` rounds of ``cohort`` clients drawn from ``population`` (each client in each round with
    probability ``cohort / population``)."""

    cohort: int
    population: int
    rounds: int

    @property
    def participation(self) -> float:
        return min(1.0, self.cohort / self.population)

    def describe(self) -> str:
        return (
            f"{self.rounds} rounds of {self.cohort} of {self.population} clients (q = {self.participation:.4g}), "
            "the secure sum of the cohort released each round"
        )


def deployment_bound(setting: Any, deployment: Deployment, kappa: float) -> tuple[float | None, str]:
    """``(eta, description)`` of ``setting``'s one defense over ``deployment`` at ``kappa``, or
    ``(None, why)`` where it has no formal bound with client sampling."""
    defenses = [setting.declared] if setting.declared is not None else list(setting.callbacks)
    if setting.undefended or len(defenses) != 1:
        return None, "no single formal mechanism"
    try:
        mechanism = defense_mechanism(
            defenses[0],
            releases=deployment.rounds,
            aggregate_of=deployment.cohort,
            participation=deployment.participation,
        )
    except ValueError as err:
        return None, str(err)
    return mechanism.eta(kappa), mechanism.description


def smallest_population(setting: Any, cohort: int, rounds: int, kappa: float, largest: int = 10**9) -> int | None:
    """The fewest clients a deployment of ``rounds`` rounds of ``cohort`` needs for ``setting``'s eta to
    meet ``kappa + ETA_MARGIN`` (client sampling at ``cohort / population``; to within 2%); ``None``
    where no population up to ``largest`` does, or the setting has no formal bound."""

    def meets(population: int) -> bool:
        eta, _ = deployment_bound(setting, Deployment(cohort, population, rounds), kappa)
        return eta is not None and eta <= kappa + ETA_MARGIN

    if not meets(largest):
        return None
    low, high = cohort, largest
    if meets(low):
        return low
    while high > low * 1.02:
        middle = int((low * high) ** 0.5)
        low, high = (low, middle) if meets(middle) else (middle, high)
    return high


def read_pmm(
    paths: Path | Sequence[Path] | None,
    names: Sequence[str],
    batch_size: int,
    cohort: int,
    algorithm: str = "fedsgd",
    local_epochs: int = 1,
) -> float | None:
    """The PMM ``benchmarks/many_clients.py`` measured for the setting (by any of its ``names``: the
    spec given on the command line, the setting's own name) at ``batch_size`` with ``cohort`` clients a
    round under ``algorithm`` (FedAvg: the audit's client, ``local_epochs`` epochs over one batch), from
    the first of its CSVs ``paths`` that holds it (``None``: not measured there). A CSV without an
    ``algorithm`` column is FedSGD's (written before FedAvg could be measured)."""
    if paths is None:
        return None
    wanted = (batch_size, cohort, algorithm, 1, local_epochs)
    for path in [paths] if isinstance(paths, Path) else paths:
        if not path.is_file():
            raise SystemExit(f"--utility: {path} does not exist; run benchmarks/many_clients.py first")
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                measured = (
                    int(row["batch_size"]),
                    int(row["clients_per_round"]),
                    row.get("algorithm", "fedsgd"),
                    int(row.get("local_steps", 1)),
                    int(row.get("local_epochs", 1)),
                )
                if row["defense"] in names and measured == wanted:
                    return float(row["PMM"])
    return None


def _limits(status: str, eta: float | None, kappa: float, pmm: float | None, step_ratio: float | None) -> list[str]:
    """What keeps one row from the bar, in words (empty: the row meets it)."""
    failed = []
    if status != "holds":
        failed.append(f"advantage {status}")
    if eta is None or eta > kappa + ETA_MARGIN:
        failed.append(
            "no formal bound" if eta is None else f"eta {eta:.3f} > kappa + {ETA_MARGIN:g} = {kappa + ETA_MARGIN:.3f}"
        )
    if pmm is None or pmm < MIN_PMM:
        failed.append("PMM not measured" if pmm is None else f"PMM {pmm:.3f} < {MIN_PMM:g}")
    if step_ratio is None or step_ratio > MAX_STEP_RATIO:
        failed.append("step not measured" if step_ratio is None else f"step {step_ratio:.3f}x > {MAX_STEP_RATIO:g}x")
    return failed


def bar_rows(
    audit: Any,
    point: dict[str, Any],
    prior: PriorCounts,
    eta: float | None,
    pmm: float | None,
    step_ratio: float | None,
) -> list[dict[str, Any]]:
    """One row per threat model ``audit`` judged: ``point`` (dataset, batch, algorithm, round) and every
    limit of the bar, with the ones that fail."""
    rows = []
    for attribute, threat in VIEWS.items():
        worst: WorstCaseReport | None = getattr(audit, attribute, None)
        if worst is None:
            continue
        advantage = reconstruction_advantage(worst, prior.identified, prior.images)
        low, high = advantage.interval
        failed = _limits(advantage.status, eta, prior.kappa, pmm, step_ratio)
        rows.append(
            {
                **point,
                "threat model": threat,
                "verdict (full rule)": f"{worst.verdict} ({worst.leaked}/{len(worst.rows)})",
                "identified": f"{advantage.successes}/{advantage.images}",
                "advantage [95% CI]": f"{advantage.advantage:+.3f} [{low:+.3f}, {high:+.3f}]",
                "advantage": advantage.status,
                "most by": advantage.worst_attack or "-",
                "kappa": f"{prior.kappa:.3f}",
                "eta": "-" if eta is None else f"{eta:.3f}",
                "PMM": "-" if pmm is None else f"{pmm:.3f}",
                "step": "-" if step_ratio is None else f"{step_ratio:.2f}x",
                "bar": "met" if not failed else "; ".join(failed),
            }
        )
    return rows


def closest(rows: list[dict[str, Any]]) -> str:
    """The rows nearest the bar (fewest failed limits) and what binds them, in a sentence."""
    if not rows:
        return "no audited row"
    counts = [0 if r["bar"] == "met" else len(r["bar"].split("; ")) for r in rows]
    best = min(counts)
    if best == 0:
        return f"{counts.count(0)} of {len(rows)} rows meet the bar"
    nearest = [r for r, c in zip(rows, counts) if c == best]
    binds = sorted({r["bar"] for r in nearest})
    return (
        f"no row meets the bar; the {len(nearest)} closest miss {best} limit{'s' if best > 1 else ''}: "
        + " | ".join(binds)
    )
