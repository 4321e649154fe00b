"""``benchmarks/defense_that_holds_grid.py``: issue 49's grid of one dataset gathered from the tables
``defense_that_holds.py`` wrote (no attack runs)."""

from __future__ import annotations

import csv
from pathlib import Path

from helpers import run_benchmark

COLUMNS = [
    "batch", "algorithm", "round", "clients", "clients for eta", "threat model", "verdict (full rule)",
    "identified", "advantage [95% CI]", "advantage", "most by", "kappa", "eta", "PMM", "step", "bar",
]  # fmt: skip
VIEWS = ["passive", "active", "secure aggregation", "secure aggregation, malicious server"]


def _table(path: Path, batch: int, algorithm: str, round_: int, bars: list[str], advantages: list[str]) -> Path:
    """A ``defense_that_holds.py`` table of one cell: a row per threat model with its bar and advantage."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        for threat, bar, advantage in zip(VIEWS, bars, advantages):
            writer.writerow(
                {
                    "batch": batch, "algorithm": algorithm, "round": round_, "clients": 7500,
                    "clients for eta": 35225, "threat model": threat, "verdict (full rule)": "private (0/16)",
                    "identified": "2/16" if bar.startswith("advantage") else "0/16",
                    "advantage [95% CI]": advantage, "advantage": "fails" if bar.startswith("advantage") else "holds",
                    "most by": "-", "kappa": "0.262", "eta": "0.319", "PMM": "0.980", "step": "1.03x", "bar": bar,
                }
            )  # fmt: skip
    return path


def test_the_grid_names_every_missed_limit_once_the_failing_views_and_the_cells_no_run_covers(tmp_path: Path) -> None:
    holds = "-0.043 [-0.075, +0.152]"
    meets = _table(tmp_path / "a.csv", 8, "fedavg", 0, ["met"] * 4, [holds] * 4)
    misses = _table(
        tmp_path / "b.csv",
        1,
        "fedsgd",
        50,
        [
            "PMM 0.854 < 0.97",
            "PMM 0.854 < 0.97",
            "advantage fails; PMM 0.854 < 0.97",
            "advantage fails; PMM 0.854 < 0.97",
        ],
        [holds, holds, "+0.082 [-0.014, +0.318]", "+0.082 [-0.014, +0.318]"],
    )
    result = run_benchmark(
        "defense_that_holds_grid.py",
        "--dataset",
        "fashion-mnist",
        str(meets),
        str(misses),
        "--output-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "defense_that_holds_grid_fashion_mnist.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["batch"], r["algorithm"], r["round"]) for r in rows] == [("1", "fedsgd", "50"), ("8", "fedavg", "0")]
    assert rows[0]["misses"] == (
        "advantage fails +0.082 (secure aggregation), fails +0.082 (secure aggregation, malicious server); PMM 0.854 < 0.97"
    )
    assert rows[0]["advantage, worst view"] == "+0.082 [-0.014, +0.318]"
    assert rows[0]["identified (" + " / ".join(VIEWS) + ")"] == "0/16 / 0/16 / 2/16 / 2/16"
    assert rows[1]["misses"] == "none: meets the bar"
    text = (tmp_path / "defense_that_holds_grid_fashion_mnist.md").read_text()
    assert "1 of 2 rows meet the bar" in text
    uncovered = text.split("Cells of the grid no run covers: ")[1].split(".")[0]
    assert uncovered.split(", ") == [
        "batch 1 fedsgd round 0", "batch 1 fedavg round 0", "batch 1 fedavg round 50",
        "batch 8 fedsgd round 0", "batch 8 fedsgd round 50", "batch 8 fedavg round 50",
    ]  # fmt: skip
    with open(tmp_path / "defense_that_holds_grid_fashion_mnist_by_threat.csv") as handle:
        by_threat = list(csv.DictReader(handle))
    assert [(r["batch"], r["round"], r["threat model"]) for r in by_threat] == [
        *(("1", "50", v) for v in VIEWS), *(("8", "0", v) for v in VIEWS)
    ]  # fmt: skip
    assert by_threat[2]["advantage [95% CI]"] == "+0.082 [-0.014, +0.318]"
    assert by_threat[2]["bar"] == "advantage fails; PMM 0.854 < 0.97" and by_threat[4]["bar"] == "met"


def test_a_threat_model_a_run_did_not_audit_is_a_miss_never_a_met_bar(tmp_path: Path) -> None:
    table = _table(tmp_path / "a.csv", 8, "fedsgd", 0, ["met"] * 2, ["-0.043 [-0.075, +0.152]"] * 2)
    result = run_benchmark(
        "defense_that_holds_grid.py", "--dataset", "x", str(table), "--output-dir", str(tmp_path), "--name", "g"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "g.csv") as handle:
        (row,) = csv.DictReader(handle)
    assert row["misses"] == "secure aggregation not audited; secure aggregation, malicious server not audited"
    with open(tmp_path / "g_by_threat.csv") as handle:
        by_threat = list(csv.DictReader(handle))
    assert [r["bar"] for r in by_threat] == ["met", "met", f"{VIEWS[2]} not audited", f"{VIEWS[3]} not audited"]
    assert by_threat[3]["identified"] == "not audited"


def test_a_missing_file_or_another_table_is_refused_by_name(tmp_path: Path) -> None:
    result = run_benchmark("defense_that_holds_grid.py", "--dataset", "x", str(tmp_path / "nope.csv"))
    assert result.returncode != 0 and "nope.csv does not exist" in result.stderr
    other = tmp_path / "other.csv"
    other.write_text("setting,psnr\nx,1\n")
    result = run_benchmark("defense_that_holds_grid.py", "--dataset", "x", str(other))
    assert result.returncode != 0 and "is not a defense_that_holds.py table" in result.stderr
