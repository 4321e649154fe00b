"""benchmarks/matrix.py's heatmap and summary: readable cells, an accuracy column, the verdicts, and a
replot from the CSVs a run wrote (no attack, no training)."""

from __future__ import annotations

import csv
import shutil
import struct

import pytest
from helpers import BENCHMARKS, run_benchmark

RESULTS = BENCHMARKS / "results"
FIELDS = ["defense", "attack", "kind", "threat", "status", "psnr", "ssim", "lpips", "leak_fraction", "seconds", "note"]


@pytest.fixture
def matrix(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import matrix

    return matrix


def write_matrix_csv(path, trained: bool) -> None:
    """A matrix CSV as ``csv_rows`` writes it: three settings, two published attacks, one adaptive."""

    def worst(defense, threat, verdict, psnr, leak, acc, note=""):
        cost = f"test_acc={acc:.4f}; upload=53704B; " if trained else ""
        return [defense, f"worst case ({threat})", "worst", threat, verdict, psnr, 0.5, 0.1, leak, 1.0, cost + note]

    rows = [
        ["undefended", "DLG", "published", "passive", "ok", 78.0, 1.0, 0.0, 1.0, 1.0, ""],
        ["undefended", "RtF", "published", "active", "ok", "inf", 1.0, 0.0, 1.0, 1.0, ""],
        worst("undefended", "passive", "leaks", 78.0, 1.0, 0.70, "8 of 8 images leak"),
        worst("undefended", "active", "leaks", "inf", 1.0, 0.70, "8 of 8 images leak"),
        ["dp", "DLG", "published", "passive", "ok", 3.0, 0.0, 0.5, 0.0, 1.0, ""],
        ["dp", "RtF", "published", "active", "ok", 8.0, 0.0, 0.5, 0.0, 1.0, ""],
        ["dp", "adaptive:DefenseAwareIDLG", "adaptive", "passive", "ok", 5.0, 0.0, 0.5, 0.0, 1.0, ""],
        worst("dp", "passive", "private", 5.0, 0.0, 0.38),
        worst("dp", "active", "private", 8.0, 0.0, 0.38),
        ["half", "DLG", "published", "passive", "ok", 4.0, 0.0, 0.5, 0.0, 1.0, ""],
        ["half", "RtF", "published", "active", "n/a", "nan", "nan", "nan", "nan", 1.0, "no imprint"],
        ["half", "adaptive:X", "adaptive", "passive", "fallback", 4.5, 0.0, 0.5, 0.0, 1.0, "unmodelled"],
        worst("half", "passive", "inconclusive", 4.5, 0.0, 0.69, "X fell back to the published attack"),
        worst("half", "active", "inconclusive", 4.5, 0.0, 0.69, "X fell back to the published attack"),
    ]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(FIELDS)
        writer.writerows(rows)


def test_the_heatmap_has_an_accuracy_column_verdicts_and_text_that_contrasts_with_its_cell(matrix, tmp_path):
    write_matrix_csv(tmp_path / "matrix.csv", trained=True)
    rows, columns, source = matrix.rows_from_csv(tmp_path / "matrix.csv")
    assert columns == ["DLG", "RtF"] and "matrix.csv" in source
    shown = matrix.heatmap(rows, columns, tmp_path / "heatmap.png", pick="dp")
    names = shown["columns"]
    assert names == [
        "DLG",
        "RtF",
        "adaptive (best)",
        "passive worst",
        "active worst",
        "PMM",
        "passive verdict",
        "active verdict",
    ]
    by_row = {label: dict(zip(names, texts)) for label, texts in zip(shown["labels"], shown["texts"])}
    colors = {label: dict(zip(names, c)) for label, c in zip(shown["labels"], shown["colors"])}
    assert set(by_row) == {"undefended", "dp  [pick]", "half"}
    assert by_row["dp  [pick]"]["PMM"] == "0.54" and by_row["undefended"]["PMM"] == "1.00"  # 0.38 / 0.70
    assert by_row["dp  [pick]"]["passive verdict"] == "private" and by_row["half"]["active verdict"] == "inconcl."
    assert by_row["undefended"]["DLG"] == "78\n100%" and by_row["undefended"]["active worst"] == "inf\n100%"
    assert by_row["half"]["RtF"] == "n/a" and by_row["half"]["adaptive (best)"] == "4\n0% fb"
    # contrast: white on the near-black 78 dB cell, black on the pale 3 dB one
    assert colors["undefended"]["DLG"] == "white" and colors["dp  [pick]"]["DLG"] == "black"
    width, height = struct.unpack(">II", (tmp_path / "heatmap.png").read_bytes()[16:24])
    assert width <= 2000 and height <= 1000  # sized to 3 rows x 8 columns, not a fixed canvas


def test_the_summary_picks_the_private_setting_and_never_the_inconclusive_one(matrix, tmp_path):
    write_matrix_csv(tmp_path / "matrix.csv", trained=True)
    rows, _, source = matrix.rows_from_csv(tmp_path / "matrix.csv")
    summary = matrix.matrix_summary(rows, source)
    assert "**Pick: dp**" in summary and "PMM 0.543" in summary  # "half" has the higher PMM but is inconclusive
    assert "1 inconclusive setting not counted as private" in summary
    assert len(summary.splitlines()) <= 40


def test_a_run_without_training_takes_its_accuracy_from_the_training_csv_or_says_not_measured(matrix, tmp_path):
    write_matrix_csv(tmp_path / "matrix.csv", trained=False)
    rows, _, source = matrix.rows_from_csv(tmp_path / "matrix.csv", tmp_path / "matrix_training.csv")
    assert source == "not measured (--no-training)" and all(r.test_acc is None for r in rows)
    with open(tmp_path / "matrix_training.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["defense", "rounds", "test_acc", "upload_bytes", "dense_bytes", "source"])
        writer.writerows([[d, 200, acc, 53704, 53704, "run X"] for d, acc in (("undefended", 0.7), ("dp", 0.35))])
    rows, _, source = matrix.rows_from_csv(tmp_path / "matrix.csv", tmp_path / "matrix_training.csv")
    assert source == "matrix_training.csv, run X"
    assert matrix.pmm(rows) == {"undefended": 1.0, "dp": pytest.approx(0.5), "half": None}


def test_replot_redraws_the_committed_results_without_attacking(tmp_path):
    for name in ("matrix.csv", "matrix_training.csv"):
        shutil.copy(RESULTS / name, tmp_path / name)
    result = run_benchmark("matrix.py", "--replot", "--output-dir", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (tmp_path / "matrix_summary.md").read_text()
    assert summary.splitlines()[2].startswith("**Pick: DPSGD(sigma=1, C=1)**")  # the only private row
    assert (tmp_path / "matrix_heatmap.png").stat().st_size > 0
    assert not (tmp_path / "matrix.md").exists()  # the tables are the run's; a replot draws only
    missing = run_benchmark("matrix.py", "--replot", "--quick", "--output-dir", str(tmp_path), timeout=300)
    assert missing.returncode != 0 and "no " in missing.stderr and "matrix_quick.csv" in missing.stderr


def test_a_setting_not_audited_gets_every_column_and_inconclusive_worst_cases(matrix):
    """A setting without audit reports: its table row has the columns of every other row ("-"), and
    the CSV says both worst cases are inconclusive."""
    from lightning_gp.audit import SettingAudit, TrainingResult

    unaudited = SettingAudit("DPSGD(sigma=1, C=1)", [], None, None)
    trained = {"undefended": TrainingResult("undefended", 2, 0.7, 100.0, 100.0, 1.0)}
    (row,) = matrix.rows_for([unaudited], ["DLG"], trained)
    assert row["passive verdict"] == row["active verdict"] == "inconclusive"
    assert row["worst SSIM"] == row["strongest"] == row["test acc"] == row["PMM"] == "-"
    worst = {r["threat"]: r for r in matrix.csv_rows([unaudited], trained) if r["kind"] == "worst"}
    assert {t: r["status"] for t, r in worst.items()} == {"passive": "inconclusive", "active": "inconclusive"}
    assert "not audited" in worst["active"]["note"]


def test_a_row_that_raises_is_not_stored_stops_no_other_row_and_is_retried(matrix, monkeypatch, tmp_path, capsys):
    """One row raising (TopKPruning's): the run finishes the other row (the undefended one, really
    audited at the quick budget) and stores it, writes no table, exits naming the failure; the same
    command again runs only the failed row (standing in with the undefended audit, renamed) and
    writes the tables."""
    import dataclasses

    audit_row = matrix.run_defense
    ran: list[str] = []
    rows: dict = {}

    def run_defense(job):
        ran.append(job[0])
        if job[0] == "TopKPruning":
            if broken:
                raise RuntimeError("broke on purpose")
            return dataclasses.replace(rows["undefended"][0], setting="TopKPruning(rate=0.8)"), None
        rows[job[0]] = audit_row(job)
        return rows[job[0]]

    monkeypatch.setattr(matrix, "run_defense", run_defense)
    argv = ["matrix.py", "--quick", "--sample", "--no-training", "--no-lpips", "--attacks", "iDLG"]
    argv += ["--defenses", "undefended", "TopKPruning", "--threads", "1", "--output-dir", str(tmp_path)]
    monkeypatch.setattr("sys.argv", argv)
    broken = True
    with pytest.raises(SystemExit, match=r"1 rows failed \(round 0: TopKPruning: RuntimeError: broke on purpose\)"):
        matrix.main()
    assert ran == ["undefended", "TopKPruning"] and not (tmp_path / "matrix_quick.md").exists()
    assert "row TopKPruning FAILED" in capsys.readouterr().out
    broken, ran[:] = False, []
    matrix.main()
    assert ran == ["TopKPruning"] and (tmp_path / "matrix_quick.md").is_file()


def test_the_secure_aggregation_views_get_their_own_columns_and_never_overwrite_a_per_client_cell(matrix, tmp_path):
    """``--aggregate``: a secure-aggregation cell (kind ``aggregate``) stays apart from the per-client cell
    of the same attack, and each view gets a worst case and a verdict column; a view whose attacks
    produced no report reads inconclusive, never private."""
    from lightning_gp.audit import SettingAudit
    from lightning_gp.audit.setting_audit import Cell

    write_matrix_csv(tmp_path / "matrix.csv", trained=False)
    with open(tmp_path / "matrix.csv", "a", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["dp", "DLG", "aggregate", "aggregate", "ok", 40.0, 0.9, 0.0, 1.0, 1.0, ""])
        writer.writerow(["dp", "worst case (aggregate)", "worst", "aggregate", "leaks", 40.0, 0.9, 0.0, 1.0, 1.0, ""])
        writer.writerow(
            ["dp", "worst case (aggregate_active)", "worst", "aggregate_active", "leaks", 41.0, 0.9, 0.0, 1.0, 1.0, ""]
        )
    rows, columns, _ = matrix.rows_from_csv(tmp_path / "matrix.csv")
    dp = next(r for r in rows if r.setting == "dp")
    assert columns == ["DLG", "RtF"] and dp.cells["DLG"][0] == 3.0  # the per-client DLG, not the aggregate's 40 dB
    shown = matrix.heatmap(rows, columns, tmp_path / "heatmap.png")
    names = shown["columns"]
    assert names[-4:] == ["passive verdict", "active verdict", "SA honest verdict", "SA malicious verdict"]
    by_row = {label: dict(zip(names, texts)) for label, texts in zip(shown["labels"], shown["texts"])}
    assert by_row["dp"]["SA malicious verdict"] == "leaks" and by_row["dp"]["passive verdict"] == "private"
    assert by_row["undefended"]["SA honest verdict"] == "inconcl."  # not audited there: never private

    cell = Cell("dp", "LOKI", "published", "n/a", note="no imprint", threat="active")
    audited = SettingAudit("dp", [], None, None, aggregate_cells=[cell])
    (row,) = matrix.rows_for([audited], ["DLG"], {})
    assert row["secure aggregation verdict"] == row["secure aggregation, malicious server verdict"] == "inconclusive"
    kinds = {(r["attack"], r["kind"], r["threat"]) for r in matrix.csv_rows([audited], {})}
    assert ("LOKI", "aggregate", "aggregate_active") in kinds
    assert ("worst case (aggregate_active)", "worst", "aggregate_active") in kinds
