"""benchmarks/speed.py: the script the performance page (docs/results/performance.md) quotes runs and writes its table."""

from __future__ import annotations

import csv
import math

import pytest
from helpers import BENCHMARKS, run_benchmark


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


# 9 s: a benchmark's smoke run, left to the benchmarks (pytest -m slow)
@pytest.mark.slow
def test_speed_refiner_times_a_cold_and_a_warm_step_against_its_floor_and_the_target(tmp_path):
    result = run_benchmark("speed.py", "--quick", "--parts", "refiner", "--threads", "1", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "speed_refiner_quick.csv") as handle:
        rows = {r["setting"]: r for r in csv.DictReader(handle)}
    assert list(rows) == [f"Refiner {s}, LeNetZhu b{b}" for b in (8, 128) for s in ("cold (I = 10)", "warm (I = 5)")]
    for setting, row in rows.items():
        # every iteration runs the model forward and backward at least once: I iterations cost over I steps
        iterations = 10 if "cold" in setting else 5
        assert float(row["ratio_to_step"]) > iterations
        if iterations == 10:
            assert row["target"] == "<= 25x" and row["met"] == ("yes" if float(row["ratio_to_step"]) <= 25 else "no")
            assert float(row["floor"]) > iterations  # I utility-measure gradients, a double backward each
        else:
            assert row["target"] == "" and math.isnan(float(row["floor"]))


@pytest.mark.parametrize("local_steps", [1, 3])
def test_the_client_step_ratio_defends_each_round_once_and_leaves_the_model_where_it_was(local_steps, monkeypatch):
    """A FedSGD round defends its gradient, a FedAvg round its update after ``local_steps`` local steps:
    once a round either way, so the ratio times what the client pays for its defense per upload."""
    import time

    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import speed

    from lightning_gp.defenses import DistributedGaussianMechanism

    calls, norms = [], []

    class Counted(DistributedGaussianMechanism):
        def __call__(self, gradients, client_id, **kwargs):
            calls.append(client_id)
            norms.append(float(torch.sqrt(sum((g**2).sum() for g in gradients.values()))))
            return super().__call__(gradients, client_id, **kwargs)

    defense = Counted(noise_multiplier=1.0, cohort_size=10, seed=0)
    undefended, defended, ratio = speed.client_step_ratio(
        defense, 2, 1, time.process_time, torch.device("cpu"), local_steps, block=8
    )
    assert len(calls) == 2 * 8  # a warm-up block and one timed block of 8 rounds
    assert min(undefended, defended, ratio) > 0
    if local_steps > 1:  # the weights are put back after a round: the 8 batches' updates repeat exactly
        assert norms[:8] == norms[8:]
