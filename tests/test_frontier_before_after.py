"""``benchmarks/frontier_before_after.py``: two revisions' frontiers on the same points, side by side
(no attack runs here: the configs it writes, the tables it reads back, and its handling of a failed run)."""

from __future__ import annotations

import json
import sys
import time

import pytest
from helpers import BENCHMARKS

from lightning_gp.frontier.grid import point_settings

ROOT = BENCHMARKS.parent


@pytest.fixture
def before_after(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import frontier_before_after

    return frontier_before_after


def test_restricted_config_runs_only_the_named_points_with_the_revisions_own_budget(before_after, tmp_path):
    names = [
        "TopKPruning(rate=0.9) + GaussianNoise(scale=0.1)",
        "GaussianNoise(clip=1, scale=0.03)",
        "Outpost(noise_multiplier=3.2)",
    ]
    text = (ROOT / "configs" / "frontier.yaml").read_text()
    path = tmp_path / "cut.yaml"
    path.write_text(before_after.restricted_yaml(text, before_after.grid_entries(names), [8], [0, 50]))

    cut, published = before_after.load_config(path), before_after.load_config(ROOT / "configs" / "frontier.yaml")
    printed = [setting.name for _, _, setting in point_settings(cut, 1)]
    assert sorted(set(printed) - {"undefended"}) == sorted(names)
    assert (cut.batch_sizes, cut.stages) == ([8], [0, 50])
    assert (cut.budget, cut.images, cut.attacks) == (published.budget, published.images, published.attacks)


def test_restricted_config_refuses_a_yaml_without_one_of_its_keys(before_after):
    text = (ROOT / "configs" / "frontier.yaml").read_text().replace("\nstages:", "\nrounds:")
    with pytest.raises(SystemExit, match="'stages'"):
        before_after.restricted_yaml(text, [], [1], [0])


def _audit(verdict: str, fraction: float, cells: dict[str, float]) -> dict:
    threats = {t: {"verdict": verdict, "leak_fraction": fraction, "strongest": []} for t in ("passive", "active")}
    return {"kind": "audit", "threats": threats, "cells": [{"attack": a, "seconds": s} for a, s in cells.items()],
            "seconds": sum(cells.values())}  # fmt: skip


def test_tables_set_each_audit_and_attack_beside_its_other_run_with_the_ratio(before_after):
    key = "audit|TopKPruning(rate=0.9)|B=8|round=0"
    before = {
        key: _audit("private", 0.0, {"iDLG": 30.0, "IG": 10.0}),
        "train|TopKPruning(rate=0.9)|B=8": {"kind": "train", "seconds": 20.0},
        "audit|only before|B=1|round=0": _audit("leaks", 1.0, {"iDLG": 99.0}),
    }
    after = {
        key: _audit("leaks", 0.125, {"iDLG": 10.0, "IG": 10.0, "IG (dummy-input labels)": 5.0}),
        "train|TopKPruning(rate=0.9)|B=8": {"kind": "train", "seconds": 5.0},
    }
    rows = before_after.audit_rows(before, after)
    assert [r["setting"] for r in rows] == ["TopKPruning(rate=0.9)", "all 2 jobs"]
    audit, total = rows
    assert (audit["passive verdict"], audit["s before"], audit["s after"], audit["before / after"]) == (
        "private -> leaks",
        40,
        25,
        "1.60x",
    )
    assert (total["s before"], total["s after"], total["before / after"]) == (60, 30, "2.00x")
    attacks = {r["attack"]: r for r in before_after.attack_rows(before, after)}
    assert (attacks["iDLG"]["s before"], attacks["iDLG"]["s after"], attacks["iDLG"]["before / after"]) == (
        30,
        10,
        "3.00x",
    )
    assert (
        attacks["IG (dummy-input labels)"]["cells before"],
        attacks["IG (dummy-input labels)"]["before / after"],
    ) == (0, "-")


def test_a_failed_revision_stops_the_other_and_names_its_log(before_after, tmp_path):
    ready, stopped = tmp_path / "after ready", tmp_path / "after stopped"
    # the later revision's run would take two minutes; told to stop, it leaves a mark. The earlier one
    # fails once the later one listens.
    still_running = (
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(stopped)!r}).touch(), sys.exit(1)))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(120)\n"
    )
    failing = (
        f"import pathlib, sys, time\nwhile not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.05)\nsys.exit(3)\n"
    )
    trees = {}
    for way, body in (("before", failing), ("after", still_running)):
        (tmp_path / way / "benchmarks").mkdir(parents=True)
        (tmp_path / way / "benchmarks" / "frontier.py").write_text(body)
        trees[way] = tmp_path / way
    start = time.monotonic()
    cpu = {"before": 1.0, "after": 2.0}  # a resumed run's seconds so far
    with pytest.raises(SystemExit, match="before revision's frontier failed; its log"):
        before_after.run_side_by_side(trees, tmp_path, cpu)
    assert time.monotonic() - start < 60  # it did not wait for the other run to finish
    deadline = time.monotonic() + 30
    while not stopped.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stopped.exists(), "the other revision's run was left running"
    # both runs' CPU time is added, the stopped one's too (each started an interpreter: well over 1 ms)
    assert cpu["before"] > 1.001 and cpu["after"] > 2.001


def test_a_resumed_run_keeps_its_cpu_seconds_and_refuses_other_revisions(before_after, tmp_path):
    head = before_after.resolved("HEAD")  # a clean clone may hold no other commit
    revisions = {"before": head, "after": head}
    state = before_after.run_state(tmp_path, revisions)
    assert state["cpu_seconds"] == {"before": 0.0, "after": 0.0}
    state["cpu_seconds"]["before"] = 12.5
    (tmp_path / "run.json").write_text(json.dumps(state))
    assert before_after.run_state(tmp_path, revisions)["cpu_seconds"]["before"] == 12.5
    with pytest.raises(SystemExit, match="holds a run of"):
        before_after.run_state(tmp_path, {**revisions, "after": "0" * 12})
    with pytest.raises(SystemExit, match="not a commit"):
        before_after.resolved("no-such-revision")


def test_grid_estimate_scales_each_stored_job_by_its_strata_ratio(before_after):
    before = {
        "audit|TopKPruning(rate=0.9)|B=1|round=0": {"seconds": 200.0},
        "audit|DPSGD(noise_multiplier=1)|B=1|round=0": {"seconds": 300.0},
        "train|TopKPruning(rate=0.9)|B=1": {"seconds": 10.0},
    }
    after = {
        "audit|TopKPruning(rate=0.9)|B=1|round=0": {"seconds": 100.0},
        "audit|DPSGD(noise_multiplier=1)|B=1|round=0": {"seconds": 100.0},
        "train|TopKPruning(rate=0.9)|B=1": {"seconds": 10.0},
    }
    run = {
        "audit|Soteria(rate=0.5)|B=1|round=0": {"seconds": 40.0},  # another setting: the non-DP-SGD ratio
        "audit|DPSGD(noise_multiplier=4)|B=1|round=0": {"seconds": 90.0},  # DP-SGD's own ratio
        "train|Soteria(rate=0.5)|B=1": {"seconds": 5.0},
        "audit|Soteria(rate=0.5)|B=8|round=50": {"seconds": 70.0},  # no such stratum in the sample
    }
    seconds, estimate, unmatched = before_after.grid_estimate(before, after, run)
    assert (seconds, unmatched) == (205.0, 1)
    assert estimate == pytest.approx(40 / 2 + 90 / 3 + 5 + 70)


def test_report_only_refuses_a_run_without_its_scratch_directory(before_after, monkeypatch, tmp_path):
    monkeypatch.setattr("sys.argv", ["frontier_before_after.py", "--points", "TopKPruning(rate=0.9)", "--report-only"])
    with pytest.raises(SystemExit, match="--report-only: name the --scratch"):
        before_after.main()
    monkeypatch.setattr("sys.argv", [*sys.argv, "--scratch", str(tmp_path)])
    with pytest.raises(SystemExit, match="--report-only: name the --scratch"):
        before_after.main()
