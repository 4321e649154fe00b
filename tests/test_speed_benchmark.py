"""benchmarks/speed.py: the script the README's performance table quotes runs and writes its table."""

from __future__ import annotations

import csv
import math

from helpers import run_benchmark


def test_speed_quick_measures_every_optimal_mode_with_its_estimator_error_and_every_pruning(tmp_path):
    result = run_benchmark(
        "speed.py",
        "--quick",
        "--parts",
        "optimal",
        "pruning",
        "--threads",
        "1",
        "--output-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "speed_quick.csv") as handle:
        rows = {r["setting"]: r for r in csv.DictReader(handle)}
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
    assert "QUICK RUN" in (tmp_path / "speed_quick.md").read_text()
