"""A cell's clients attacked side by side against one by one (issue 48).

The audit attacks each client of a cell with an attack object of its own (its own seed). Where the
attack's problems stack, the audit now runs every client's problem together
(``lightning_gp.audit.engine.attack_records_side_by_side``), each client from the start its own attack
draws: Inverting Gradients and the defense-aware Inverting Gradients in one vmapped Adam optimisation
(one restart each, as the audit's budget runs them); iDLG and the defense-aware iDLG as L-BFGS runs in
lockstep (``lightning_gp.attacks.lockstep``: first every client's first restart, then the later
restarts of the clients whose first did not match). This measures both ways on the same tapped round
(LeNetZhu at initialisation, full Fashion-MNIST, ``--images`` training images drawn as the matrix
draws them, the audit's budget), one torch thread, CPU seconds, in turns (one by one first on even
settings, side by side first on odd ones), and scores both with the bare leak rule against the
trivial guesses (no prior-only control, the same for both), so that the two ways can be compared
image by image: mean PSNR, images leaked, and the largest per-image PSNR difference.

    python benchmarks/clients_side_by_side.py --settings 'LocalGaussianMechanism(noise_multiplier=0.5)' \
        'TopKPruning(rate=0.9)' 'GaussianNoise(scale=0.01)' --batch-sizes 1 8 --images 16

Writes benchmarks/results/clients_side_by_side.{csv,md} (``--name`` to change).

``--frontier POINT ...`` checks the verdicts instead: the published frontier's own jobs
(``configs/frontier.yaml``: its budget, attacks, learned inverter, 8 images, round 0) on those points
(``'Family(knob=value, other=value)'``, the first keyword the swept knob), run twice in this process
(``lightning_gp.frontier.frontier``, one worker): with the code before issue 48's cuts (every client
attacked on its own, the learned inverter trained with torch's default Adam) and with them, in turns.
A row per point and threat model: the verdicts and leak fractions both ways, and the audit's CPU
seconds both ways; then a row per attack cell whose leak fraction differs. Writes
``<name>_frontier.{csv,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import lightning as L
import torch
from _common import fashion_mnist_datasets, parse_call, setting_builder, torch_default_adam, write_results
from frontier import CONFIGS, load_config
from matrix import choose_images

import lightning_gp.attacks.learned as learned_module
from lightning_gp.attacks import IDLG, DefenseAwareIDLG, DefenseAwareInversion, GradientAttack, InvertingGradients
from lightning_gp.audit import AttackBudget, LeakRule, setting_audit, tap_defended_round
from lightning_gp.audit.engine import AttackResult, Scoring, attack_record, attack_records_side_by_side
from lightning_gp.audit.setting_audit import reference_pixels
from lightning_gp.audit.verdict import trivial_baselines
from lightning_gp.frontier import frontier
from lightning_gp.frontier.grid import Grid
from lightning_gp.metrics import concatenate_reports
from lightning_gp.models import LeNetZhu

ADAPTIVE = {"DefenseAwareInversion": DefenseAwareInversion, "DefenseAwareIDLG": DefenseAwareIDLG}


def _attacks(
    setting, model, datamodule, name: str, budget: AttackBudget, seed: int, clients: int
) -> list[GradientAttack]:
    """One attack per client, seeded by the client, at the audit's budget (as ``audit_setting`` builds them)."""
    if name == "IG":
        return [InvertingGradients(iterations=budget.ig_iterations, seed=seed + c) for c in range(clients)]
    if name == "iDLG":
        return [
            IDLG(iterations=budget.lbfgs_iterations, restarts=budget.lbfgs_restarts, seed=seed + c)
            for c in range(clients)
        ]
    found = []
    for c in range(clients):
        adaptive = setting.adaptive_attacks(
            model, datamodule, iterations=budget.ig_iterations, lbfgs_iterations=budget.lbfgs_iterations,
            restarts=budget.adaptive_restarts, seed=seed + c,
        )  # fmt: skip
        found += [a for a in adaptive if type(a) is ADAPTIVE[name]]
    return found


def _run(way: str, records, model, attacks, datamodule) -> tuple[list[AttackResult], float]:
    options = dict(num_classes=datamodule.num_classes, mean=datamodule.mean, std=datamodule.std)
    start = time.process_time()
    if way == "side by side":
        results = attack_records_side_by_side(records, model, attacks, scoring=Scoring(lpips=False), **options)
        if results is None:
            raise SystemExit(f"{type(attacks[0]).__name__} did not run side by side here")
    else:
        results = [attack_record(r, model, a, lpips=False, **options) for r, a in zip(records, attacks)]
    return results, time.process_time() - start


@contextlib.contextmanager
def code_before(active: bool) -> Iterator[None]:
    """Within it (``active``): the code before issue 48's cuts: the audit attacks every client on its own,
    and the learned inverter trains with torch's default Adam."""
    if not active:
        yield
        return
    with (
        mock.patch.object(setting_audit, "attack_records_side_by_side", return_value=None),
        mock.patch.object(learned_module, "fused_adam", torch_default_adam),
    ):
        yield


def _point_grid(spec: str) -> Grid:
    family, keywords = parse_call(spec, "--frontier", "Family(knob=value, other=value)")
    if not keywords:
        raise SystemExit(f"--frontier {spec!r}: name the swept knob and its value, e.g. TopKPruning(rate=0.9)")
    knob, *others = keywords
    return Grid(family=family, knob=knob, values=[keywords[knob]], params={k: keywords[k] for k in others})


def frontier_rows(args: argparse.Namespace) -> None:
    """The verdict check of ``--frontier`` (module docstring)."""
    config = load_config(CONFIGS / "frontier.yaml")
    config = dataclasses.replace(
        config, grids=[_point_grid(s) for s in args.frontier], batch_sizes=args.batch_sizes, stages=[0]
    )
    records: dict[str, dict[str, dict]] = {"before": {}, "after": {}}
    seconds: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    rows: list[dict] = []
    reported: set[str] = set()  # the undefended reference runs with every point: its first run is reported
    preamble = (
        "The published frontier's jobs (configs/frontier.yaml: its budget, attacks and learned inverter, "
        f"{config.images} images, round 0) on each point, run in this process with the code before issue 48's "
        "cuts (every client attacked on its own, the learned inverter trained with torch's default Adam) and "
        "with them, in turns (before first on even points); audit CPU seconds, one torch thread. A row per "
        "point and threat model; then a row per attack cell whose leak fraction differs.\n\nRun: "
        f"`python benchmarks/clients_side_by_side.py --frontier {' '.join(repr(s) for s in args.frontier)} "
        f"--batch-sizes {' '.join(map(str, args.batch_sizes))}`"
    )
    with tempfile.TemporaryDirectory() as scratch:
        for index, grid in enumerate(config.grids):
            one = dataclasses.replace(config, grids=[grid])
            for way in ["before", "after"][:: 1 if index % 2 == 0 else -1]:
                learned_module.DEFAULT_CACHE.clear()  # each way trains its own inverter
                out = Path(scratch) / f"{way}{index}"
                shutil.rmtree(out, ignore_errors=True)
                clock = [time.process_time()]

                def keep(job, record, way=way, clock=clock) -> None:
                    now = time.process_time()
                    records[way][job.key], seconds[way][job.key] = record, now - clock[0]
                    clock[0] = now

                with code_before(way == "before"):
                    frontier(one, out, workers=1, log=lambda line: None, on_job=keep)
            for key, after in records["after"].items():
                before = records["before"].get(key)
                if after.get("kind") != "audit" or before is None or key in reported:
                    continue
                reported.add(key)
                for threat, judged in after["threats"].items():
                    old = before["threats"][threat]
                    rows.append(
                        {
                            "point": key, "threat": threat, "verdict before": old["verdict"],
                            "verdict after": judged["verdict"], "leak fraction before": old["leak_fraction"],
                            "leak fraction after": judged["leak_fraction"],
                            "CPU s before": round(seconds["before"][key], 1),
                            "CPU s after": round(seconds["after"][key], 1),
                            "speedup": round(seconds["before"][key] / seconds["after"][key], 2),
                        }
                    )  # fmt: skip
                    print(rows[-1], flush=True)
            write_results(f"{args.name}_frontier", rows, preamble)
    for key, after in records["after"].items():
        before = records["before"].get(key)
        if after.get("kind") != "audit" or before is None:
            continue
        cells = {c["attack"]: c for c in before["cells"]}
        for cell in after["cells"]:
            old = cells.get(cell["attack"])
            if old is None or old["leak_fraction"] != cell["leak_fraction"]:
                rows.append(
                    {
                        "point": key, "threat": f"cell {cell['attack']}",
                        "verdict before": "-" if old is None else old["status"], "verdict after": cell["status"],
                        "leak fraction before": None if old is None else old["leak_fraction"],
                        "leak fraction after": cell["leak_fraction"], "CPU s before": "", "CPU s after": "",
                        "speedup": "",
                    }
                )  # fmt: skip
    write_results(f"{args.name}_frontier", rows, preamble)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["LocalGaussianMechanism(noise_multiplier=0.5)"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument(
        "--attacks", nargs="+", default=["IG", "DefenseAwareInversion", "iDLG", "DefenseAwareIDLG"],
        choices=["IG", "DefenseAwareInversion", "iDLG", "DefenseAwareIDLG"],
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="clients_side_by_side")
    parser.add_argument("--frontier", nargs="+", metavar="POINT", help="check these frontier points' verdicts")
    args = parser.parse_args()
    if args.frontier:
        frontier_rows(args)
        return
    torch.set_num_threads(1)
    budget = AttackBudget()
    datamodule = fashion_mnist_datasets(full=True).get("fashion-mnist")
    if datamodule is None:
        sys.exit("full Fashion-MNIST is needed: apt-get install -y dataset-fashion-mnist")
    reference = reference_pixels(datamodule)
    rows: list[dict] = []
    preamble = (
        f"Each client's attack one by one and every client's side by side on the same tapped round (LeNetZhu at "
        f"initialisation, full Fashion-MNIST, {args.images} images, seed {args.seed}, the audit's budget: "
        f"{budget.ig_iterations} Adam steps, one restart; L-BFGS at most {budget.lbfgs_iterations} steps, iDLG "
        f"{budget.lbfgs_restarts} restart(s), DefenseAwareIDLG 4), one torch thread, CPU seconds, the two ways in "
        "turns; leaked: the bare leak rule "
        "against the trivial guesses (no prior-only control), the same for both ways; max |dPSNR|: the largest "
        "per-image difference between the two ways (float32: the vmapped kernels round differently, and "
        "Adam's signed steps and L-BFGS' line search carry a rounding difference forward).\n\n"
        f"Run: `python benchmarks/clients_side_by_side.py --settings {' '.join(repr(s) for s in args.settings)} "
        f"--batch-sizes {' '.join(map(str, args.batch_sizes))} --images {args.images} --attacks {' '.join(args.attacks)}`"
    )
    for index, spec in enumerate(args.settings):
        setting = setting_builder(spec, "--settings")(args.seed)
        for batch_size in args.batch_sizes:
            indices = choose_images(datamodule, args.images, args.seed, batch_size)
            L.seed_everything(args.seed, verbose=False)
            records, model, _ = tap_defended_round(
                setting, LeNetZhu(), datamodule, indices=indices, num_clients=len(indices), seed=args.seed
            )
            for name in args.attacks:
                attacks = _attacks(setting, model, datamodule, name, budget, args.seed, len(records))
                if len(attacks) != len(records):
                    print(f"{spec}: no {name} among its adaptive attacks", flush=True)
                    continue
                ways = ["one by one", "side by side"][:: 1 if index % 2 == 0 else -1]
                measured = {way: _run(way, records, model, attacks, datamodule) for way in ways}
                row: dict = {"setting": spec, "batch": batch_size, "clients": len(records), "attack": name}
                psnrs = {}
                for way in ("one by one", "side by side"):
                    results, seconds = measured[way]
                    merged = concatenate_reports([r.report for r in results])
                    guesses = trivial_baselines(merged.original_pixels, reference_images=reference)
                    leaked = LeakRule().leak_fraction(merged, guesses)
                    psnrs[way] = [r.psnr for r in merged.rows]
                    row[f"{way} s/client"] = round(seconds / len(records), 2)
                    row[f"{way} PSNR"] = round(merged.means["psnr"], 2)
                    row[f"{way} leaked"] = f"{round(leaked * len(merged.rows))}/{len(merged.rows)}"
                row["speedup"] = round(row["one by one s/client"] / row["side by side s/client"], 2)
                row["max |dPSNR|"] = round(max(abs(a - b) for a, b in zip(*psnrs.values())), 3)
                rows.append(row)
                print(row, flush=True)
                write_results(args.name, rows, preamble)


if __name__ == "__main__":
    main()
