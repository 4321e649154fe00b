"""``benchmarks/frontier.py --compare`` and ``--timing``: a rerun of the published frontier set against
the stored one, verdict by verdict and in job-hours (no attack runs)."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from helpers import run_benchmark

from lightning_gp.cli.frontier import build_parser, config_from
from lightning_gp.frontier.run import TRAINING_REVISION, fingerprint

ROOT = Path(__file__).resolve().parents[1]


def _quick_fingerprint() -> str:
    """The store fingerprint of ``benchmarks/frontier.py --quick`` (the quick config on the sample)."""
    parser = build_parser()
    config = config_from(parser.instantiate(parser.parse_args(["--config", str(ROOT / "configs/frontier_quick.yaml")])))
    sample = {"class_path": "lightning_gp.data.FashionMNISTSampleDataModule", "init_args": {"batch_size": 500}}
    return fingerprint(dataclasses.replace(config, datamodule=sample))


def _audit(
    passive: str, fraction: float, cells: list[tuple[str, float]], cpu: float | None = None, psnr: float = 10.0
) -> dict:
    threats = {
        "passive": {"verdict": passive, "leak_fraction": fraction, "strongest": ["IG"] if fraction else []},
        "active": {"verdict": "leaks", "leak_fraction": 1.0, "strongest": ["RtF"]},
    }
    record = {
        "kind": "audit",
        "threats": threats,
        "cells": [{"attack": a, "seconds": s, "psnr": psnr} for a, s in cells],
        "seconds": sum(s for _, s in cells),
        "leak_rule_revision": 5 if cpu is not None else 4,
    }
    return record if cpu is None else {**record, "cpu_seconds": cpu}


def _store(path: Path, records: dict[str, dict]) -> Path:
    stamp = _quick_fingerprint()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"fingerprint": stamp, "key": k, "record": r}) + "\n" for k, r in records.items())
    )
    return path


def test_compare_lists_the_verdicts_that_moved_first_and_discounts_the_earlier_run_s_stalled_cells(
    tmp_path: Path,
) -> None:
    moved, kept = "audit|TopKPruning(rate=0.9)|B=8|round=0", "audit|undefended|B=1|round=0"
    earlier = _store(
        tmp_path / "earlier.jsonl",
        {
            # the IG cell on the dummy-input labels waited 99,000 s longer than its twin: a stall
            moved: _audit("private", 0.0, [("IG", 1000.0), ("IG (dummy-input labels)", 100000.0)]),
            # stored before audits were stamped with their leak rule: revision 3
            kept: {k: v for k, v in _audit("leaks", 1.0, [("iDLG", 2000.0)]).items() if k != "leak_rule_revision"},
            "train|undefended|B=1": {"kind": "train", "seconds": 3000.0},
            "audit|only|B=1|round=0": _audit("leaks", 1.0, [("iDLG", 5.0)]),  # not rerun: not compared
        },
    )
    now = tmp_path / "now"
    _store(
        now / "frontier_quick_points.jsonl",
        {
            kept: _audit("leaks", 1.0, [("iDLG", 3600.0)], cpu=3000.0),
            moved: _audit(
                "leaks", 0.125, [("IG", 1800.0), ("IG (dummy-input labels)", 1800.0)], cpu=5400.0, psnr=10.25
            ),
            "train|undefended|B=1": {"kind": "train", "seconds": 2700.0, "cpu_seconds": 1800.0},
        },
    )
    result = run_benchmark("frontier.py", "--quick", "--output-dir", str(now), "--compare", str(earlier))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(now / "frontier_quick_compared.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["setting"], r["same verdicts"]) for r in rows] == [
        ("TopKPruning(rate=0.9)", "no"),
        ("undefended", "yes"),
    ]
    assert rows[0]["passive verdict"] == "private -> leaks" and rows[0]["passive leak fraction"] == "0.000 -> 0.125"
    assert rows[0]["leaked by, now"] == "IG, RtF" and rows[0]["leaked by, earlier"] == "RtF"
    assert rows[0]["leak rule"] == "4 -> 5" and rows[0]["largest cell PSNR change (dB)"] == "0.25"
    assert rows[1]["largest cell PSNR change (dB)"] == "0.00" and rows[1]["leak rule"] == "3 -> 5"
    preamble = (now / "frontier_quick_compared.md").read_text()
    assert "3 jobs in both, 2 of them audits, of which 1 changed their verdict" in preamble
    # earlier: 101,000 + 2,000 + 3,000 s wall, 99,000 s of it the stall; now 10,200 CPU s, 9,900 wall
    assert "earlier 29.44 wall (1.94 without its stalled cells)" in preamble
    assert "this run 2.83 (CPU seconds), 2.75 wall" in preamble


def test_compare_refuses_a_points_file_with_nothing_in_common(tmp_path: Path) -> None:
    earlier = _store(tmp_path / "earlier.jsonl", {"audit|undefended|B=1|round=0": _audit("leaks", 1.0, [])})
    _store(
        tmp_path / "now" / "frontier_quick_points.jsonl", {"train|undefended|B=1": {"kind": "train", "seconds": 1.0}}
    )
    result = run_benchmark("frontier.py", "--quick", "--output-dir", str(tmp_path / "now"), "--compare", str(earlier))
    assert result.returncode != 0 and "no job of" in result.stderr


def test_points_runs_only_the_named_settings_into_the_same_store_and_reports_the_whole_run(tmp_path: Path) -> None:
    # one stored job of the named point: it counts as done, so the restricted run shares the whole run's store
    _store(
        tmp_path / "frontier_quick_points.jsonl",
        {"train|DPSGD(noise_multiplier=1)|B=1": {"kind": "train", "revision": TRAINING_REVISION}},
    )
    result = run_benchmark(
        "frontier.py", "--quick", "--points", "DPSGD(noise_multiplier=1)", "--report-only",
        "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # 2 settings x 2 batch sizes x (a training and 2 audited stages), one of them stored
    assert "report only; 11 jobs not run" in result.stdout
    # the reports then describe the whole run's store, never the named points alone
    assert "; 5 grids; " in (tmp_path / "frontier_quick.md").read_text()


def test_points_takes_the_names_the_report_prints_with_the_clients_model_checks(tmp_path: Path) -> None:
    config = tmp_path / "checked.yaml"
    config.write_text((ROOT / "configs/frontier_quick.yaml").read_text() + "model_checks: true\n")
    result = run_benchmark(
        "frontier.py", "--quick", "--config", str(config), "--points", "DPSGD(noise_multiplier=1) +model checks",
        "--report-only", "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "report only; 12 jobs not run" in result.stdout  # the named setting and the reference, nothing else


def test_points_refuses_a_name_no_grid_has_and_lists_the_names(tmp_path: Path) -> None:
    result = run_benchmark(
        "frontier.py", "--quick", "--points", "DPSGD(noise_multiplier=1.0)", "--report-only",
        "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode != 0
    assert (
        "no grid has ['DPSGD(noise_multiplier=1.0)']" in result.stderr and "DPSGD(noise_multiplier=1)," in result.stderr
    )


def test_points_times_only_the_named_settings_and_timing_refuses_a_store_with_none_of_them(tmp_path: Path) -> None:
    _store(
        tmp_path / "frontier_quick_points.jsonl",
        {
            "train|DPSGD(noise_multiplier=1)|B=1": {"kind": "train", "seconds": 5.0},
            "train|TopKPruning(rate=0.5)|B=1": {"kind": "train", "seconds": 7.0},
        },
    )
    timed = run_benchmark(
        "frontier.py", "--quick", "--points", "DPSGD(noise_multiplier=1)", "--timing", "--output-dir", str(tmp_path)
    )
    assert timed.returncode == 0, timed.stderr
    with open(tmp_path / "frontier_quick_timing.csv", newline="") as handle:
        totals = {row["grid"]: float(row["total s"]) for row in csv.DictReader(handle)}
    assert totals == {"undefended": 0.0, "DPSGD": 5.0, "all": 5.0}
    refused = run_benchmark(
        "frontier.py", "--quick", "--points", "GaussianNoise(scale=1)", "--timing", "--output-dir", str(tmp_path)
    )
    assert refused.returncode != 0 and "--timing: no job of this config is finished" in refused.stderr
