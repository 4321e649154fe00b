"""benchmarks/speed.py: the script the performance page (docs/results/performance.md) quotes runs and writes its table."""

from __future__ import annotations

import csv
import math

import pytest
from helpers import run_benchmark


# 19 s, the suite's second-longest: a benchmark's smoke run, left to the benchmarks (pytest -m slow)
@pytest.mark.slow
def test_speed_quick_measures_every_optimal_mode_with_its_estimator_error_every_pruning_and_the_client_step(tmp_path):
    result = run_benchmark(
        "speed.py",
        "--quick",
        "--parts",
        "optimal",
        "pruning",
        "client",
        "--threads",
        "1",
        "--output-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # a run of some parts writes speed_<parts>, so it never overwrites the full run's table
    with open(tmp_path / "speed_optimal_pruning_client_quick.csv") as handle:
        table = list(csv.DictReader(handle))
    rows = {r["setting"]: r for r in table}
    optimal = [r for r in rows.values() if r["part"] == "optimal"]
    assert len(optimal) == 15  # 3 defenses x 5 sensitivity modes
    for row in optimal:
        # a relative error of a non-negative estimate of a positive quantity: in [0, inf), finite
        assert 0.0 <= float(row["estimator_error"]) < math.inf
        assert float(row["ratio_to_step"]) > 0
        refreshed = "refresh" in row["setting"]
        assert math.isnan(float(row["stale_error"])) != refreshed
    pruning = {s for s, r in rows.items() if r["part"] == "pruning"}
    assert {"DGP (5%, 75%)", "ADGP (20%, 5%), another client's mask"} <= pruning
    client = [r for r in table if r["part"] == "client"]
    assert [r["model"] for r in client] == [
        f"LeNetZhu b{b}, {clock}" for b in (1, 8) for clock in ("CPU time", "wall time")
    ]
    assert all(float(r["ratio_to_step"]) > 0 for r in client)
    assert "QUICK RUN" in (tmp_path / "speed_optimal_pruning_client_quick.md").read_text()
