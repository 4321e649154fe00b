"""Issue 49's grid for one dataset, from the tables ``benchmarks/defense_that_holds.py`` wrote: attacks nothing.

Each run of ``defense_that_holds.py`` audits some cells of the grid (client batch 1 and 8, FedSGD and
FedAvg, round 0 and a trained round, four threat models) and writes a table with a row per threat
model. This script gathers the runs of one dataset into one table, a row per (batch, algorithm, round,
run): the images identified and the advantage in each threat model, eta, PMM, the step, and every limit
of the bar that the row misses; and it names the cells of the grid that no run covers. Beside it,
``<name>_by_threat`` holds the same runs a row per (batch, algorithm, round, threat model), each with its
advantage and interval, eta and kappa, PMM, the step and its bar (a threat model a run did not audit: a
row that says so and misses)::

    python benchmarks/defense_that_holds_grid.py --dataset fashion-mnist \\
        benchmarks/results/defense_that_holds_ddp_z2.csv benchmarks/results/defense_that_holds_ddp_z2_round50.csv ...

writes benchmarks/results/<name>.{csv,md} and <name>_by_threat.{csv,md} (default name
``defense_that_holds_grid_<dataset>``).
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from pathlib import Path

from _common import RESULTS_DIR, write_results
from prior_bar import VIEWS

#: The grid of issue 49 (the trained round is round 50 in every published run).
GRID = [(batch, algorithm, round_) for batch in (1, 8) for algorithm in ("fedsgd", "fedavg") for round_ in (0, 50)]
#: The columns of a defense_that_holds.py table this script reads.
COLUMNS = (
    "batch",
    "algorithm",
    "round",
    "threat model",
    "identified",
    "advantage [95% CI]",
    "eta",
    "kappa",
    "PMM",
    "step",
    "bar",
)
#: What the misses column reads for a row that meets every limit.
MEETS = "none: meets the bar"
#: The threat models in the order of the table's "a / b / c / d" columns.
THREATS = list(VIEWS.values())


def read_table(path: Path) -> dict[tuple[int, str, int], dict[str, dict[str, str]]]:
    """``(batch, algorithm, round) -> threat model -> row`` of one ``defense_that_holds.py`` table."""
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: give the CSVs benchmarks/defense_that_holds.py wrote")
    cells: dict[tuple[int, str, int], dict[str, dict[str, str]]] = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            missing = set(COLUMNS) - set(row)
            if missing:
                raise SystemExit(f"{path} is not a defense_that_holds.py table: no column {sorted(missing)}")
            cells.setdefault((int(row["batch"]), row["algorithm"], int(row["round"])), {})[row["threat model"]] = row
    return cells


def _limits(views: dict[str, dict[str, str]]) -> str:
    """Every limit of the bar the cell misses, each once: the advantage with the threat models where it
    fails (or is inconclusive), the others (the same in every threat model) once; a threat model the run
    did not audit is a miss too."""
    advantage, others = [], []
    for threat in THREATS:
        row = views.get(threat)
        if row is None:
            others.append(f"{threat} not audited")
            continue
        for part in row["bar"].split("; "):
            if part.startswith("advantage "):
                advantage.append(
                    f"{part.removeprefix('advantage ')} {row['advantage [95% CI]'].split(' ')[0]} ({threat})"
                )
            elif part != "met" and part not in others:  # eta, PMM and the step are the cell's, not the view's
                others.append(part)
    missed = ([f"advantage {', '.join(advantage)}"] if advantage else []) + others
    return "; ".join(missed) or MEETS


Tables = dict[Path, dict[tuple[int, str, int], dict[str, dict[str, str]]]]


def grid_rows(tables: Tables) -> list[dict[str, str | int]]:
    """One row per (batch, algorithm, round) of each table, in the grid's order."""
    rows = []
    for path, cells in tables.items():
        for (batch, algorithm, round_), views in cells.items():
            first = next(iter(views.values()))
            rows.append(
                {
                    "batch": batch,
                    "algorithm": algorithm,
                    "round": round_,
                    "identified (" + " / ".join(THREATS) + ")": " / ".join(
                        views[t]["identified"] if t in views else "-" for t in THREATS
                    ),
                    "advantage, worst view": max(
                        (v["advantage [95% CI]"] for v in views.values()), key=lambda a: float(a.split(" ")[0])
                    ),
                    "eta": first["eta"],
                    "kappa": first["kappa"],
                    "PMM": first["PMM"],
                    "step": first["step"],
                    "misses": _limits(views),
                    "run": path.stem,
                }
            )
    return sorted(rows, key=lambda r: (r["batch"], r["algorithm"] == "fedavg", r["round"], str(r["run"])))


def threat_rows(tables: Tables) -> list[dict[str, str | int]]:
    """One row per (batch, algorithm, round, threat model) of each table, in the grid's order; a threat
    model the run did not audit is a row that says so and misses the bar."""
    rows: list[dict[str, str | int]] = []
    for path, cells in tables.items():
        for (batch, algorithm, round_), views in cells.items():
            first = next(iter(views.values()))
            for threat in THREATS:
                row = views.get(threat)
                rows.append(
                    {
                        "batch": batch,
                        "algorithm": algorithm,
                        "round": round_,
                        "threat model": threat,
                        "identified": "not audited" if row is None else row["identified"],
                        "advantage [95% CI]": "-" if row is None else row["advantage [95% CI]"],
                        "eta": first["eta"],
                        "kappa": first["kappa"],
                        "PMM": first["PMM"],
                        "step": first["step"],
                        "bar": f"{threat} not audited" if row is None else row["bar"],
                        "run": path.stem,
                    }
                )
    order = {t: k for k, t in enumerate(THREATS)}
    return sorted(
        rows,
        key=lambda r: (
            r["batch"],
            r["algorithm"] == "fedavg",
            r["round"],
            str(r["run"]),
            order[str(r["threat model"])],
        ),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tables", type=Path, nargs="+", help="defense_that_holds.py's CSVs of one dataset")
    parser.add_argument("--dataset", required=True, help="the dataset the tables were measured on (the title)")
    parser.add_argument("--name", default=None, help="the results' name (default defense_that_holds_grid_<dataset>)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    tables = {path: read_table(path) for path in args.tables}  # each table read once, for both views
    rows = grid_rows(tables)
    covered = {(r["batch"], r["algorithm"], r["round"]) for r in rows}
    missing = [f"batch {b} {a} round {r}" for b, a, r in GRID if (b, a, r) not in covered]
    meeting = [r for r in rows if r["misses"] == MEETS]
    preamble = (
        f"Issue 49's grid on {args.dataset}, from {len(args.tables)} runs of `benchmarks/defense_that_holds.py` "
        "(each 16 attacked images per cell, every attack of the suite). `identified`: images identified in each "
        f"threat model ({' / '.join(THREATS)}); `misses`: every limit of the bar (advantage <= 0.05, "
        "eta <= kappa + 0.10, PMM >= 0.97, step <= 1.2x) the row misses. "
        f"{len(meeting)} of {len(rows)} rows meet the bar. "
        f"Cells of the grid no run covers: {', '.join(missing) if missing else 'none'}.\n\n"
        f"Run: `python benchmarks/defense_that_holds_grid.py --dataset {args.dataset} "
        f"{' '.join(str(p) for p in args.tables)}`"
    )
    name = args.name or f"defense_that_holds_grid_{args.dataset.replace('-', '_')}"
    write_results(name, rows, preamble, args.output_dir)
    write_results(
        f"{name}_by_threat",
        threat_rows(tables),
        f"The runs of `{name}.md`, a row per (batch, algorithm, round, threat model): `bar` is every limit "
        f"that row misses (`met`: none). {preamble}",
        args.output_dir,
    )


if __name__ == "__main__":
    main()
