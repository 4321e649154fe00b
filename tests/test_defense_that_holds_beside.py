"""``benchmarks/defense_that_holds.py --beside-frontier``: the shipped setting's frontier point beside
every other family's best, read from the frontier's CSV (no attack runs)."""

from __future__ import annotations

import csv
from pathlib import Path

from helpers import frontier_point, run_benchmark

from lightning_gp.audit.frontier_report import write_csv

SHIPPED = "LocalGaussianMechanism(noise_multiplier=0.5)"


def test_the_shipped_point_comes_first_beside_each_other_family_s_best(tmp_path: Path) -> None:
    """Per batch size and threat model: the shipped row (its own verdict over both rounds), then one row
    per family: "noise" by its private strength with the higher PMM, "prune" by its closest point."""
    points = []
    for stage in (0, 50):
        for threat in ("passive", "active"):
            points += [
                frontier_point(SHIPPED, stage, threat, "private", 0.4, grid="LocalGaussianMechanism"),
                frontier_point("LocalGaussianMechanism(noise_multiplier=3)", stage, threat, "private", 0.2, grid="LocalGaussianMechanism"),
                frontier_point("GaussianNoise(scale=1)", stage, threat, "private", 0.5, grid="GaussianNoise"),
                frontier_point("GaussianNoise(scale=0.1)", stage, threat, "private", 0.7, grid="GaussianNoise"),
                frontier_point("TopKPruning(rate=0.9)", stage, threat, "leaks", 0.9, grid="TopKPruning"),
            ]  # fmt: skip
    write_csv(points, tmp_path / "frontier.csv")
    result = run_benchmark(
        "defense_that_holds.py", "--beside-frontier", str(tmp_path / "frontier.csv"), "--output-dir", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "defense_that_holds_beside_frontier.csv") as handle:
        rows = list(csv.DictReader(handle))
    passive = [(r["family"], r["point"], r["verdict (every round)"]) for r in rows if r["threat model"] == "passive"]
    assert passive == [
        ("shipped", f"**{SHIPPED}**", "private"),
        ("LocalGaussianMechanism", "LocalGaussianMechanism(noise_multiplier=3)", "private"),  # the shipped one aside
        ("GaussianNoise", "GaussianNoise(scale=0.1)", "private"),
        ("TopKPruning", "none private; closest: TopKPruning(rate=0.9)", "leaks"),
    ]
    assert (tmp_path / "defense_that_holds_beside_frontier.png").stat().st_size > 0

    without = [p for p in points if p.setting != SHIPPED]
    write_csv(without, tmp_path / "other.csv")
    missing = run_benchmark("defense_that_holds.py", "--beside-frontier", str(tmp_path / "other.csv"))
    assert missing.returncode != 0 and "--shipped" in missing.stderr and "configs/frontier.yaml" in missing.stderr
