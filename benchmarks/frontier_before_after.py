"""The frontier's jobs with the code before issue 48's speed work and after it, side by side (issue 48).

The published frontier's seconds and a rerun's are two runs on a shared machine: their ratio mixes
the code with whatever else the machine ran. This script measures the code alone. It exports two
revisions of this repository (``git archive``: ``--before``, by default the last commit before issue
48's attack-speed work, and ``--after``, by default ``HEAD``), cuts each revision's own
``configs/frontier.yaml`` to the named points (and the undefended reference), batch sizes and stages,
and runs both frontiers at once, one process and one torch thread each: on an otherwise idle 2-core
machine each holds a core for the whole run, so their times are a ratio measured in one run.

Writes ``benchmarks/results/<name>.{csv,md}``: every audit both ways (verdicts and leak fractions per
threat model, the attacks that leaked, the largest change of an attack's mean PSNR, the job's seconds
both ways and their ratio), and ``<name>_attacks.{csv,md}``: each attack's cells' seconds both ways.
Each process's CPU time (its own and its workers') is in the preamble. The stores and logs stay in
``--scratch`` (default: a temporary directory), so an interrupted run is resumed by the same command
with the same ``--scratch``; ``--report-only`` rewrites the tables from it and runs nothing.
``--estimate POINTS_FILE`` scales a stored run's jobs (the published frontier's, say) by the ratios of
their strata (kind, batch size, round, DP-SGD apart) and says what that run would take now.

Run it with nothing else on the machine (pause a background run with ``kill -STOP``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _common import RESULTS_DIR, write_results
from frontier import CONFIGS, compared_row, load_config, only_points

REPOSITORY = Path(__file__).resolve().parent.parent
#: The last commit before issue 48's attack-speed work (77d2ba0, the L-BFGS restarts side by side, is its first).
BEFORE = "8eff6b0"
#: What a revision needs to run its frontier: the package (with its shipped checkpoints), the scripts, the configs.
EXPORTED = ("lightning_gp", "benchmarks", "configs")
WAYS = ("before", "after")
NAME = "frontier_before_after"  # the results files' default name


def export(revision: str, into: Path) -> Path:
    """The package, benchmarks and configs of the commit ``revision`` written under ``into`` (``git archive``)."""
    archive = subprocess.run(
        ["git", "-C", str(REPOSITORY), "archive", "--format=tar", revision, *EXPORTED],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise SystemExit(f"--before/--after {revision!r}: git archive failed: {archive.stderr.decode().strip()}")
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def resolved(revision: str) -> str:
    """``revision``'s commit (12 hex digits), so a resumed run compares the same code."""
    found = subprocess.run(
        ["git", "-C", str(REPOSITORY), "rev-parse", "--short=12", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode != 0:
        raise SystemExit(f"--before/--after {revision!r}: not a commit of this repository ({found.stderr.strip()})")
    return found.stdout.strip()


def run_state(scratch: Path, revisions: dict[str, str]) -> dict:
    """The run's revisions and CPU seconds so far (``scratch/run.json``); a scratch directory of a run of
    other revisions is refused (its stores would mix two comparisons)."""
    path = scratch / "run.json"
    if not path.exists():
        return {"revisions": revisions, "cpu_seconds": dict.fromkeys(WAYS, 0.0)}
    state = json.loads(path.read_text())
    if state["revisions"] != revisions:
        raise SystemExit(f"--scratch {scratch} holds a run of {state['revisions']}, not {revisions}: use another")
    return state


def restricted_yaml(text: str, grids: list[dict], batch_sizes: list[int], stages: list[int]) -> str:
    """A frontier YAML's text with its ``grids`` block, ``batch_sizes`` and ``stages`` replaced (each
    grid written as a JSON flow mapping, which YAML reads); everything else, the budget included, as
    the revision wrote it. Refuses a text without the three keys."""
    replacements = {
        "grids": (r"^grids:\n(?:[ \t].*\n|\n)*", "grids:\n" + "".join(f"  - {json.dumps(g)}\n" for g in grids)),
        "batch_sizes": (r"^batch_sizes:.*$", f"batch_sizes: {json.dumps(batch_sizes)}"),
        "stages": (r"^stages:.*$", f"stages: {json.dumps(stages)}"),
    }
    for key, (pattern, replacement) in replacements.items():
        text, count = re.subn(pattern, lambda _: replacement, text, count=1, flags=re.MULTILINE)
        if count != 1:
            raise SystemExit(f"the revision's configs/frontier.yaml has no {key!r} key")
    return text


def grid_entries(points: list[str]) -> list[dict]:
    """The published grids cut to ``points`` (by the names the report prints), as YAML-ready dicts."""
    config = only_points(load_config(CONFIGS / "frontier.yaml"), points)
    entries = []
    for grid in config.grids:
        entry = {"family": grid.family, "knob": grid.knob, "values": list(grid.values), "params": dict(grid.params)}
        if grid.before:
            entry["before"] = [{"family": f.family, "params": dict(f.params)} for f in grid.before]
        if grid.label:
            entry["label"] = grid.label
        entries.append(entry)
    return entries


def run_side_by_side(trees: dict[str, Path], scratch: Path, cpu: dict[str, float]) -> None:
    """Both revisions' frontiers at once (one worker, one torch thread each), each one's CPU seconds (user
    + system, its workers included) added to ``cpu`` as it ends, or is stopped: a failure or an interrupt
    stops both, and what they spent still counts. Progress lines are printed as they come."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    running: dict[int, tuple[str, subprocess.Popen, Path]] = {}
    try:
        for way, tree in trees.items():
            log = scratch / f"{way}.log"
            command = [sys.executable, "benchmarks/frontier.py", "--config", str(scratch / f"{way}.yaml")]
            command += ["--workers", "1", "--output-dir", str(scratch / way)]
            with open(log, "a") as handle:
                process = subprocess.Popen(
                    command, cwd=tree, env={**env, "PYTHONPATH": str(tree)}, stdout=handle, stderr=subprocess.STDOUT
                )
            running[process.pid] = (way, process, log)
        _wait_all(running, cpu)
    finally:
        for pid, (way, _, _) in running.items():  # not reaped yet: stop it, then read its usage
            os.kill(pid, signal.SIGTERM)
            _, _, usage = os.wait4(pid, 0)
            cpu[way] += usage.ru_utime + usage.ru_stime


def _wait_all(running: dict[int, tuple[str, subprocess.Popen, Path]], cpu: dict[str, float]) -> None:
    printed: dict[str, int] = defaultdict(int)
    while running:
        for pid, (way, _, log) in list(running.items()):
            done, status, usage = os.wait4(pid, os.WNOHANG)
            lines = log.read_text().splitlines()  # read after the wait: an ended run's log is whole
            for line in lines[printed[way] :]:
                if line.startswith("["):
                    print(f"{way}: {line}", flush=True)
            printed[way] = len(lines)
            if done == 0:
                continue
            del running[pid]
            cpu[way] += usage.ru_utime + usage.ru_stime
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"the {way} revision's frontier failed; its log: {log}\n" + "\n".join(lines[-15:]))
        time.sleep(2)


def stored(path: Path) -> dict[str, dict]:
    """Every record of a frontier points file by job key (the last one of a key), whatever its
    fingerprint (the two revisions' may differ)."""
    records = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        records[entry["key"]] = entry["record"]
    return records


def audit_rows(before: dict[str, dict], after: dict[str, dict]) -> list[dict]:
    """Every audit in both stores (:func:`frontier.compared_row`), with its seconds' ratio, then a total
    row of every job the two runs share, trainings included."""
    rows = []
    for key in before:
        if key in after and after[key].get("kind") == "audit":
            spent = [_seconds(records[key]) for records in (before, after)]
            row = _renamed(compared_row(key, before[key], after[key]))
            rows.append(
                {**row, "s before": round(spent[0]), "s after": round(spent[1]), "before / after": _ratio(*spent)}
            )
    if not rows:
        raise SystemExit("no audit finished in both runs: nothing to compare")
    shared = [k for k in before if k in after]
    total = [sum(_seconds(records[k]) for k in shared) for records in (before, after)]
    rows.append({**dict.fromkeys(rows[0], ""), "setting": f"all {len(shared)} jobs", "s before": round(total[0]),
                 "s after": round(total[1]), "before / after": _ratio(*total)})  # fmt: skip
    return rows


def _renamed(row: dict) -> dict:
    """:func:`frontier.compared_row`'s columns named before/after, without its seconds (one clock each)."""
    kept = {k: v for k, v in row.items() if k not in ("s, earlier (wall)", "s, now")}
    return {k.replace("earlier", "before").replace(", now", ", after"): v for k, v in kept.items()}


def _seconds(record: dict) -> float:
    """A job's or a cell's seconds as its revision recorded them (0 where it recorded none)."""
    return float(record.get("seconds") or 0.0)


def _ratio(before: float, after: float) -> str:
    return f"{before / after:.2f}x" if after > 0 else "-"


def _stratum(key: str) -> tuple[str, ...]:
    kind, setting, *axes = key.split("|")
    return (kind, *axes, "DP-SGD" if setting.startswith("DPSGD(") else "other")


def grid_estimate(before: dict[str, dict], after: dict[str, dict], run: dict[str, dict]) -> tuple[float, float, int]:
    """``(seconds, estimate, unmatched)``: a stored run's job seconds, and those seconds each scaled by the
    after / before ratio of its stratum among the jobs both sides share (kind, batch size, round; DP-SGD's
    jobs apart, its attacks take a path of their own); a job of a stratum the sample lacks keeps its
    seconds (``unmatched`` counts them)."""
    sums: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for key in before:
        if key in after:
            pair = sums[_stratum(key)]
            pair[0] += _seconds(before[key])
            pair[1] += _seconds(after[key])
    seconds = estimate = 0.0
    unmatched = 0
    for key, record in run.items():
        spent = _seconds(record)
        was, now = sums.get(_stratum(key), (0.0, 0.0))
        seconds += spent
        estimate += spent * now / was if was > 0 and now > 0 else spent
        unmatched += not (was > 0 and now > 0)
    return seconds, estimate, unmatched


def attack_rows(before: dict[str, dict], after: dict[str, dict]) -> list[dict]:
    """Each attack's cells' seconds summed over the audits both runs finished (a cell only one run has,
    such as a rerun on the second label estimate one revision makes and the other does not, counts on its
    side alone)."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0])
    for key in before:
        if key not in after or after[key].get("kind") != "audit":
            continue
        for side, record in enumerate((before[key], after[key])):
            for cell in record.get("cells", []):
                entry = sums[cell["attack"]]
                entry[side] += _seconds(cell)
                entry[2 + side] += 1
    rows = [
        {"attack": attack, "cells before": int(c0), "cells after": int(c1), "s before": round(s0, 1),
         "s after": round(s1, 1), "before / after": _ratio(s0, s1) if c0 and c1 else "-"}
        for attack, (s0, s1, c0, c1) in sorted(sums.items(), key=lambda item: -item[1][0])
    ]  # fmt: skip
    return rows


def main() -> None:
    args = _parser().parse_args()
    grids = grid_entries(args.points)
    if args.report_only and (args.scratch is None or not (args.scratch / "run.json").exists()):
        raise SystemExit("--report-only: name the --scratch directory of a finished run")
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="frontier_before_after_"))
    scratch.mkdir(parents=True, exist_ok=True)
    state = run_state(scratch, {"before": resolved(args.before), "after": resolved(args.after)})
    revisions = state["revisions"]
    if not args.report_only:
        trees = {way: export(revisions[way], scratch / f"{way}_tree") for way in WAYS}
        for way, tree in trees.items():
            text = (tree / "configs" / "frontier.yaml").read_text()
            (scratch / f"{way}.yaml").write_text(restricted_yaml(text, grids, args.batch_sizes, args.stages))
        print(f"frontier before/after: {revisions['before']} and {revisions['after']} in {scratch}", flush=True)
        try:
            run_side_by_side(trees, scratch, state["cpu_seconds"])
        finally:  # an interrupted run's seconds count when it resumes
            (scratch / "run.json").write_text(json.dumps(state))
    before, after = (stored(scratch / way / "frontier_points.jsonl") for way in WAYS)
    preamble = _preamble(args, revisions, state["cpu_seconds"])
    if args.estimate is not None:
        seconds, estimate, unmatched = grid_estimate(before, after, stored(args.estimate))
        preamble += (
            f" Weighted by these ratios (each job of `{args.estimate}` scaled by its stratum's: kind, batch size, "
            f"round, DP-SGD apart), its {seconds / 3600:.1f} job-hours would be {estimate / 3600:.1f}"
            + (f" ({unmatched} jobs of strata the sample lacks kept their seconds)." if unmatched else ".")
        )
    write_results(args.name, audit_rows(before, after), preamble, args.output_dir)
    write_results(f"{args.name}_attacks", attack_rows(before, after), preamble, args.output_dir)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--points", nargs="+", required=True, help="frontier points by name, e.g. 'TopKPruning(rate=0.9)'"
    )
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--stages", nargs="+", type=int, default=[0])
    parser.add_argument("--before", default=BEFORE, help=f"the earlier revision (default {BEFORE})")
    parser.add_argument(
        "--after", default="HEAD", help="the later revision (default HEAD; uncommitted changes are not in it)"
    )
    parser.add_argument(
        "--scratch", type=Path, default=None, help="where the revisions, stores and logs go (resumable)"
    )
    parser.add_argument("--report-only", action="store_true", help="rewrite the tables from --scratch; run nothing")
    parser.add_argument("--estimate", type=Path, default=None, help="a stored run's points file to scale by the ratios")
    parser.add_argument("--name", default=NAME)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    return parser


def _preamble(args: argparse.Namespace, revisions: dict[str, str], cpu: dict[str, float]) -> str:
    run = (
        f"`python benchmarks/frontier_before_after.py --points {' '.join(repr(p) for p in args.points)} "
        f"--batch-sizes {' '.join(map(str, args.batch_sizes))} --stages {' '.join(map(str, args.stages))} "
        f"--before {revisions['before']} --after {revisions['after']}"
        + (f" --estimate {args.estimate}" if args.estimate is not None else "")
        + (f" --name {args.name}`" if args.name != NAME else "`")
    )
    return (
        f"The published frontier's jobs (`configs/frontier.yaml` of each revision: its budget, attacks, learned "
        f"inverter and images) on the named points and the undefended reference, run by revision "
        f"{revisions['before']} (before) and {revisions['after']} (after) at once, one process and one torch thread "
        f"each, on two cores. Seconds are each job's as its revision records them (an audit's: its attack cells'). "
        f"CPU seconds of the whole processes (their workers and every resumption included): before "
        f"{cpu['before']:.0f}, after {cpu['after']:.0f} ({_ratio(cpu['before'], cpu['after'])}). Run: {run}."
    )


if __name__ == "__main__":
    main()
