"""benchmarks/distributed.py at CI size: 2 gloo processes launched by Lightning, and its bad input."""

import csv
import subprocess
from pathlib import Path

import pytest
from helpers import run_benchmark


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_benchmark("distributed.py", *args, cwd=cwd, timeout=300)


# 18 s: a benchmark's smoke run, left to the benchmarks (pytest -m slow); the DDP paths it times are
# tested by tests/test_ddp.py
@pytest.mark.slow
@pytest.mark.multiprocess
def test_quick_run_reports_every_path_at_one_and_two_gloo_processes(tmp_path):
    result = run(
        "--quick",
        "--devices",
        "2",
        "--defenses",
        "undefended",
        "Top-k 20%",
        "--output-dir",
        str(tmp_path),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "distributed.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["world_size"], r["defense"], r["path"]) for r in rows} == {
        (size, defense, path)
        for size in ("1", "2")
        for defense, path in (("undefended", "ddp"), ("Top-k 20%", "bucketwise"), ("Top-k 20%", "held"))
    }
    for row in rows:
        assert float(row["step_ms"]) > 0 and float(row["speedup"]) > 0
        assert float(row["allreduce_MB"]) == float(rows[0]["allreduce_MB"])  # DDP all-reduces dense buckets
        if row["defense"] == "undefended":
            assert float(row["added_pct"]) == 0 and float(row["defense_ms"]) == 0
            assert float(row["upload_MB"]) == float(row["allreduce_MB"])
        else:
            assert 0 < float(row["defense_share"]) < 1
            # Top-k 20% sends a fifth of the values plus a bitmap: under a third of the dense bytes
            assert float(row["upload_MB"]) < float(row["allreduce_MB"]) / 3
    assert "| world_size |" in (tmp_path / "distributed.md").read_text()


def test_bad_device_counts_are_refused_before_launching(tmp_path):
    result = run("--devices", "4096", "--output-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert "--devices 4096 is more than the" in result.stderr
    result = run("--devices", "1", "--num_nodes", "2", "--output-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert "--num_nodes 2 needs a multi-node launch" in result.stderr and "torchrun or srun" in result.stderr
    assert not (tmp_path / "distributed.csv").exists()
