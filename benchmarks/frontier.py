"""The privacy-utility frontier, our published run (issue 26).

Runs ``configs/frontier.yaml`` (``--quick``: ``configs/frontier_quick.yaml``, CI-sized) through
``lightning_gp.frontier.frontier``: every defense family over its strength grid, at client batch sizes
1 and 8, at initialisation and after training, each point attacked by every published, adaptive and
active attack (worst case per threat model), each setting trained for PMM, time and upload bytes.
The full run reads the full Fashion-MNIST when installed (``FashionMNISTDataModule``), else the
built-in sample (``--sample`` forces it); the quick run always uses the sample.

Writes ``benchmarks/results/frontier[_quick].{csv,md,png}`` and ``frontier[_quick]_points.jsonl``
(each job as it finishes: rerun the same command to resume an interrupted run). ``--workers`` runs
jobs in parallel processes (``--backend ray`` on a Ray cluster). ``--timing`` runs nothing: it writes
``frontier[_quick]_timing.{csv,md}``, the finished jobs' seconds per grid, and what the cheapest grids
would take on ``--workers`` workers. ``--compare EARLIER_POINTS`` runs nothing either: it writes
``frontier[_quick]_compared.{csv,md}``, each audit finished in both runs with its verdicts both ways
(a rerun with newer code: ``--output-dir`` elsewhere, then ``--compare`` the published points file).
``--points NAME ...`` runs only those points of the grids (their settings' names as the report prints
them, e.g. ``'DPSGD(noise_multiplier=0.3)'``) and the undefended reference, at every batch size and
stage (with ``--timing``: times only their jobs), into the same points file: their records are the whole
run's (the store's fingerprint does not hold the grids), so a rerun can settle the recommended points
first and the whole command resumes after. The reports it writes still describe everything the store
holds of the whole run.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterable
from pathlib import Path

from _common import RESULTS_DIR, fashion_mnist_datasets, write_results

from lightning_gp.audit import LeakRule
from lightning_gp.cli.frontier import build_parser, config_from
from lightning_gp.frontier import FrontierConfig, frontier
from lightning_gp.frontier.grid import check_frontier_config, point_settings
from lightning_gp.frontier.run import (
    UNSTAMPED_LEAK_RULE,
    Job,
    ResultStore,
    fingerprint,
    frontier_jobs,
    hours_minutes_seconds,
)
from lightning_gp.frontier.workers import keep_freed_memory

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def load_config(path: Path) -> FrontierConfig:
    """A :class:`FrontierConfig` from a YAML, read as ``lightning-gp frontier --config`` reads it."""
    parser = build_parser()
    return config_from(parser.instantiate(parser.parse_args(["--config", str(path)])))


def only_points(config: FrontierConfig, names: list[str]) -> FrontierConfig:
    """``config`` with each grid cut to the values whose setting is named in ``names``, by the names its
    jobs and report carry (:func:`~lightning_gp.frontier.grid.point_settings`: with the clients' model
    checks or a FedAvg training in them); grids left with none are dropped, the undefended reference
    kept. A name no point has is an error that lists the names."""
    datamodule, _ = check_frontier_config(config)
    printed = {
        setting.name: (point.grid, point.index)
        for point, _, setting in point_settings(config, int(datamodule.image_shape[0]))
    }
    unknown = sorted(set(names) - printed.keys())
    if unknown:
        raise SystemExit(f"--points: no grid has {unknown}; the points are: {', '.join(printed)}")
    keep = {printed[name] for name in names}
    grids = []
    for grid in config.grids:
        values = [v for i, v in enumerate(grid.values) if (grid.name, i) in keep]
        if values:
            grids.append(dataclasses.replace(grid, values=values))
    return dataclasses.replace(config, grids=grids)


def timing(config: FrontierConfig, output_dir: Path, name: str, workers: int, families: int) -> None:
    """The finished jobs' seconds per grid (trainings, and audits per batch size and stage), and the
    wall time of the ``families`` cheapest grids (the undefended reference included) on ``workers``
    workers: their job-seconds over the workers, a lower bound (the last jobs may leave a worker idle)."""
    datamodule, _ = check_frontier_config(config)
    channels = int(datamodule.image_shape[0])
    jobs = frontier_jobs(config, channels)
    stored = ResultStore(output_dir / f"{name}_points.jsonl", fingerprint(config)).load()
    # every stored record of this config, current or not: a record a newer leak rule or attacker reruns
    # still took the seconds it says (timing measures the code that ran, not the verdict)
    done = {j.key: stored[j.key] for j in jobs if j.key in stored}
    if not done:
        raise SystemExit(f"--timing: no job of this config is finished in {output_dir / f'{name}_points.jsonl'}")

    def column(job: Job) -> str:
        return f"train B={job.batch_size} s" if job.kind == "train" else f"audit B={job.batch_size} round {job.stage} s"

    labels = sorted(dict.fromkeys(column(j) for j in jobs), key=lambda label: (not label.startswith("train"), label))
    rows, missing, complete = [], 0, set()
    for grid in dict.fromkeys(j.point.grid for j in jobs):
        mine = [j for j in jobs if j.point.grid == grid]
        finished = sum(j.key in done for j in mine)
        missing += len(mine) - finished
        if finished == len(mine):
            complete.add(grid)
        row: dict = {"grid": grid, "points": len({j.point.key for j in mine}), "jobs done": f"{finished}/{len(mine)}"}
        row.update(dict.fromkeys(labels, 0.0))
        for job in mine:
            row[column(job)] += spent_seconds(done[job.key]) if job.key in done else 0.0
        row.update({label: round(row[label]) for label in labels})
        row["total s"] = sum(v for k, v in row.items() if k.endswith(" s"))
        rows.append(row)
    total = sum(r["total s"] for r in rows)
    reference = [r for r in rows if r["grid"] == "undefended"]
    candidates = [r for r in rows if r["grid"] in complete and r["grid"] != "undefended" and r["points"] >= 5]
    cheapest = sorted(candidates, key=lambda r: r["total s"])
    chosen = reference + cheapest[:families]
    subset = sum(r["total s"] for r in chosen)
    rows.append(
        {**dict.fromkeys(rows[0], ""), "grid": "all", "points": sum(r["points"] for r in rows), "total s": total}
    )
    preamble = (
        f"Seconds of the finished jobs of `{name}_points.jsonl` ({len(jobs) - missing} of {len(jobs)}, current or "
        f"stale; each job timed in its worker, one torch thread; {clocks(done.values())}). All grids: {round(total)} job-seconds, about "
        f"{hours_minutes_seconds(total / workers)} on {workers} workers. The {families} cheapest finished grids of at "
        f"least 5 points ({', '.join(r['grid'] for r in cheapest[:families])}) with the undefended reference: "
        f"{round(subset)} job-seconds, about {hours_minutes_seconds(subset / workers)} on {workers} workers "
        "(job-seconds over workers: a lower bound)."
    )
    write_results(f"{name}_timing", rows, preamble, output_dir)
    print(preamble)
    attack_breakdown(done, output_dir, name)


#: What an audit cell's name says of the attack's kind (the rest are the published gradient matchers).
LABEL_VARIANT = " (dummy-input labels)"

#: A cell whose wall time is this many times its twin's (the same attack on the other label estimate,
#: in the same job) and over ``STALLED_MIN_SECONDS`` is counted as stalled: its worker waited (a
#: paused machine, no free core). The twins attack the same images with the same budget.
STALLED_FACTOR = 20
STALLED_MIN_SECONDS = 300.0


def spent_seconds(part: dict) -> float:
    """A job's or a cell's CPU seconds where its record has them (the frontier records them since
    they were added), else its wall seconds."""
    cpu = part.get("cpu_seconds")
    return float(cpu if cpu is not None else part.get("seconds") or 0.0)


def clocks(records: Iterable[dict]) -> str:
    """Which clock the seconds of ``records`` are on."""
    records = list(records)
    cpu = sum("cpu_seconds" in r for r in records)
    if cpu == len(records):
        return "CPU seconds"
    if cpu == 0:
        return "wall seconds"
    return f"CPU seconds for the {cpu} jobs that recorded them, wall seconds for the other {len(records) - cpu}"


def stalled_cells(done: dict[str, dict]) -> list[tuple[str, str, float, float]]:
    """The cells of ``done`` (records by job key) that stalled (``STALLED_FACTOR``), as (job key,
    attack, wall seconds, its twin's wall seconds), longest first."""
    stalled = []
    for key, record in done.items():
        walls = {c["attack"]: float(c.get("seconds") or 0.0) for c in record.get("cells", [])}
        for attack, wall in walls.items():
            twin = attack.removesuffix(LABEL_VARIANT) if attack.endswith(LABEL_VARIANT) else attack + LABEL_VARIANT
            if twin in walls and wall > max(STALLED_FACTOR * walls[twin], STALLED_MIN_SECONDS):
                stalled.append((key, attack, wall, walls[twin]))
    return sorted(stalled, key=lambda item: -item[2])


def attack_breakdown(done: dict[str, dict], output_dir: Path, name: str) -> None:
    """Where the finished jobs' seconds go: per attack (its runs on the second label estimate counted
    apart, ``LABEL_VARIANT``), the trainings, and the audits' time outside the attacks (tapping the
    rounds, scoring, the prior-only controls), as shares of all job-seconds."""
    seconds: dict[str, float] = {}
    cells: dict[str, int] = {}
    audits = trainings = in_cells = 0.0
    for record in done.values():
        if record.get("kind") == "train":
            trainings += spent_seconds(record)
            continue
        audits += spent_seconds(record)
        for cell in record.get("cells", []):
            spent = spent_seconds(cell)
            seconds[cell["attack"]] = seconds.get(cell["attack"], 0.0) + spent
            cells[cell["attack"]] = cells.get(cell["attack"], 0) + 1
            in_cells += spent
    total = audits + trainings
    rows = [
        {
            "part": attack,
            "hours": round(spent / 3600, 2),
            "share": f"{spent / total:.1%}",
            "cells": cells[attack],
            "s per cell": round(spent / cells[attack], 1),
        }
        for attack, spent in sorted(seconds.items(), key=lambda item: -item[1])
    ]
    variants = sum(v for k, v in seconds.items() if k.endswith(LABEL_VARIANT))
    for part, spent, count in (
        ("(the trainings: PMM, time, bytes)", trainings, sum(r.get("kind") == "train" for r in done.values())),
        ("(audits outside the attacks: taps, scoring, controls)", audits - in_cells, 0),
    ):
        rows.append({"part": part, "hours": round(spent / 3600, 2), "share": f"{spent / total:.1%}", "cells": count})
        rows[-1]["s per cell"] = round(spent / count, 1) if count else ""
    stalled = stalled_cells(done)
    excess = sum(wall - median for *_, wall, median in stalled)
    preamble = (
        f"Where the {len(done)} finished jobs' {total / 3600:.1f} job-hours go (one torch thread each; {clocks(done.values())}; "
        f"an audit's cells are its attacks, each over all attacked images). Runs on the second label estimate "
        f"(`{LABEL_VARIANT.strip()}`, where the two estimates disagree) take {variants / total:.1%}."
        + (
            f" {len(stalled)} cells took over {STALLED_FACTOR} times the wall time of the same attack on the other label "
            f"estimate in the same job ({', '.join(f'{attack} of {key} {wall:.0f} s' for key, attack, wall, _ in stalled[:3])}"
            f"{', ...' if len(stalled) > 3 else ''}): {excess / 3600:.2f} job-hours above their twins, most "
            "likely a worker that waited (a paused machine, no free core), counted in the wall seconds."
            if stalled
            else ""
        )
    )
    write_results(f"{name}_attack_time", rows, preamble, output_dir)


def compared_with(config: FrontierConfig, output_dir: Path, name: str, earlier: Path) -> None:
    """``<name>_compared.{csv,md}``: every audit finished in both this run (``output_dir``) and an
    earlier run of the same config (its points file ``earlier``), its verdicts and leak fractions per
    threat model both ways (the ones that differ first, with the leak rule revision and the attacks that
    leaked), and both runs' job-hours over the jobs they share."""
    store = fingerprint(config)
    now = ResultStore(output_dir / f"{name}_points.jsonl", store).load()
    before = ResultStore(earlier, store).load()
    shared = [key for key in now if key in before]
    if not shared:
        raise SystemExit(f"--compare: no job of {earlier} is finished in {output_dir} under this config")
    rows = [compared_row(key, before[key], now[key]) for key in shared if now[key].get("kind") == "audit"]
    rows.sort(key=lambda row: row["same verdicts"] == "yes")
    differ = sum(row["same verdicts"] != "yes" for row in rows)
    shared_before = {k: before[k] for k in shared}
    stalled = sum(wall - twin for key, _, wall, twin in stalled_cells(shared_before))
    wall_before = sum(float(before[k].get("seconds") or 0.0) for k in shared)
    preamble = (
        f"This run's finished jobs ({len(now)}, in `{output_dir / f'{name}_points.jsonl'}`) against an earlier run "
        f"of the same config (`{earlier}`): {len(shared)} jobs in both, {len(rows)} of them audits, of which "
        f"{differ} changed their verdict for some server (listed first; where the attacks' mean PSNRs barely moved, the leak "
        "rule, not the attacks, moved the verdict). Job-hours of the shared jobs: earlier "
        f"{wall_before / 3600:.2f} wall ({(wall_before - stalled) / 3600:.2f} without its stalled cells); this run "
        f"{sum(spent_seconds(now[k]) for k in shared) / 3600:.2f} ({clocks(now[k] for k in shared)}), "
        f"{sum(float(now[k].get('seconds') or 0.0) for k in shared) / 3600:.2f} wall. An audit's wall seconds "
        "are its cells' (the attacks); its CPU seconds the whole job's."
    )
    write_results(f"{name}_compared", rows, preamble, output_dir)


def compared_row(key: str, before: dict, now: dict) -> dict:
    """One audit both ways: per threat model the verdict and leak fraction, earlier -> now."""
    _, setting, batch, stage = key.split("|")
    row = {"setting": setting, "batch": batch.removeprefix("B="), "round": stage.removeprefix("round=")}
    same = True
    for threat in ("passive", "active"):
        old, new = before["threats"].get(threat, {}), now["threats"].get(threat, {})
        row[f"{threat} verdict"] = f"{old.get('verdict')} -> {new.get('verdict')}"
        row[f"{threat} leak fraction"] = f"{fraction(old.get('leak_fraction'))} -> {fraction(new.get('leak_fraction'))}"
        same = same and old.get("verdict") == new.get("verdict")
    row["same verdicts"] = "yes" if same else "no"
    revisions = [record.get("leak_rule_revision", UNSTAMPED_LEAK_RULE) for record in (before, now)]
    row["leak rule"] = " -> ".join(map(str, revisions))
    for when, record in (("earlier", before), ("now", now)):
        row[f"leaked by, {when}"] = ", ".join(
            sorted({a for t in record["threats"].values() for a in t.get("strongest") or []})
        )
    # the attacks' own outputs moved (not only the rule that judges them): their mean PSNRs, cell by cell
    psnrs = {c["attack"]: c.get("psnr") for c in before.get("cells", []) if c.get("psnr") is not None}
    moved = [
        abs(c["psnr"] - psnrs[c["attack"]])
        for c in now.get("cells", [])
        if c.get("psnr") is not None and c["attack"] in psnrs
    ]
    row["largest cell PSNR change (dB)"] = f"{max(moved):.2f}" if moved else "-"
    row["s, earlier (wall)"] = round(float(before.get("seconds") or 0.0))
    row["s, now"] = round(spent_seconds(now))
    return row


def fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def run_context(config: FrontierConfig, data: str, quick: bool) -> str:
    """The report's account of the run: model, data, axes, budgets, costs and the leak rule."""
    budget = config.budget
    return (
        f"{config.model['class_path'].rsplit('.', 1)[1]} on {data}; {len(config.grids)} grids; batch sizes "
        f"{config.batch_sizes}; stages (audited rounds) {config.stages}; {config.images} attacked images per point "
        f"(ceil(images / B) clients of B images, drawn with seed {config.seed}); published attacks "
        f"{config.attacks or 'all'} plus each setting's adaptive attacks; IG/adaptive Adam {budget.ig_iterations} "
        f"iterations, L-BFGS {budget.lbfgs_iterations}, Robbing the Fed {budget.rtf_bins} bins; LPIPS "
        f"{'on' if config.lpips else 'off'}. PMM: test accuracy after "
        f"{config.train_rounds} FedSGD rounds ({config.num_clients} clients of B images) over the undefended run's at "
        f"the same B; time: that training's wall time over the undefended reference's (same runner), trained for the "
        f"same rounds just before and after it in the same worker; upload: bytes per client-round over "
        f"the dense gradient. Leak rule: {LeakRule().describe()}."
        + (" QUICK RUN: budgets far too small for conclusions." if quick else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="configs/frontier_quick.yaml: the sample, tiny budgets")
    parser.add_argument("--sample", action="store_true", help="the built-in sample even if the full set is installed")
    parser.add_argument("--config", type=Path, default=None, help="another frontier YAML")
    parser.add_argument("--workers", type=int, default=2, help="jobs in parallel (one torch thread each)")
    parser.add_argument("--backend", default="local", choices=("local", "ray"))
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--report-only", action="store_true", help="report the jobs already finished (e.g. while a run goes on)"
    )
    parser.add_argument(
        "--timing", action="store_true", help="write <name>_timing.{csv,md} from the finished jobs (runs nothing)"
    )
    parser.add_argument("--families", type=int, default=10, help="with --timing: the cheapest grids to time together")
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="the points file of an earlier run of this config: write <name>_compared.{csv,md} (runs nothing)",
    )
    parser.add_argument(
        "--points",
        nargs="+",
        default=None,
        metavar="NAME",
        help="run only these points (setting names, e.g. 'DPSGD(noise_multiplier=0.3)') and the reference",
    )
    args = parser.parse_args()
    name = "frontier_quick" if args.quick else "frontier"
    config = load_config(args.config or CONFIGS / f"{name}.yaml")
    data = "sample"
    if not args.quick and not args.sample and "fashion-mnist" in fashion_mnist_datasets(full=True):
        data = "fashion-mnist"
    else:
        datamodule = {"class_path": "lightning_gp.data.FashionMNISTSampleDataModule", "init_args": {"batch_size": 500}}
        config = dataclasses.replace(config, datamodule=datamodule)
    full_config = config
    if args.points:  # before --timing, which then times only these points' jobs
        config = only_points(config, args.points)
    if args.timing:
        timing(config, args.output_dir, name, args.workers, args.families)
        return
    if args.compare is not None:
        compared_with(config, args.output_dir, name, args.compare)
        return
    title = f"Privacy-utility frontier ({'quick, ' if args.quick else ''}{data})"
    keep_freed_memory()  # this command's process runs the jobs itself with one worker
    start = time.perf_counter()
    result = frontier(
        config,
        args.output_dir,
        workers=args.workers,
        backend=args.backend,
        name=name,
        title=title,
        context=(run_context(config, data, args.quick),),
        report_only=args.report_only,
    )
    if args.points:  # the reports describe everything the store holds of the whole run, never these points alone
        whole = frontier(
            full_config, args.output_dir, name=name, title=title, context=(run_context(full_config, data, args.quick),),
            report_only=True, log=lambda line: None,
        )  # fmt: skip
        result.files = whole.files
    seconds = time.perf_counter() - start
    print(f"{len(result.ran)} jobs ran in {seconds:.0f} s with {args.workers} workers")
    print("\n".join(str(p) for p in result.files))
    if result.failed:
        raise SystemExit(f"{len(result.failed)} jobs failed (listed above and in {name}.md); rerun to retry them")


if __name__ == "__main__":
    main()
