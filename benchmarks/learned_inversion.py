"""The learned inverter (Wu et al., UAI 2023) against the attacks the audit ran before it (issue 25).

For each defense (catalogue names, default: undefended, GaussianNoise, LaplaceNoise, TopKPruning)
:func:`lightning_gp.audit.audit_setting` attacks ``--images`` clients of one training image each
(LeNetZhu at initialisation, FedSGD round 0; images drawn by ``--seed``, as the matrix draws them)
with the published attacks named by ``--attacks``, the setting's adaptive attacks and the learned
inverter with and without gradient-matching refinement (``AttackBudget(learned_inversion=True)``).
The inverter trains on the public split (the test split), with the setting's own callbacks
replayed by the server (:func:`lightning_gp.audit.setting_simulator`).

A row: the best attack without the learned ones (highest mean PSNR over the images among the
passive cells) and its leak fraction; the learned inverter and its refined variant; the passive
worst case over every attack (learned included) and what training the inverter cost.

``--learned-only`` runs the learned inverter and its refined variant alone (the other attacks'
columns read "not run"), and adds each one's mean PSNR over the first 8 images: the matrix draws
its images with the same seed, so its 8 images are these, and its cells are the comparison.

Writes benchmarks/results/learned_inversion.{csv,md} (the built-in sample:
learned_inversion_sample.{csv,md}; ``--output-dir`` to change).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning as L
import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, write_results
from matrix import choose_images

from lightning_gp.attacks import InverterConfig
from lightning_gp.audit import (
    AttackBudget,
    Cell,
    LeakRule,
    attack_record,
    audit_setting,
    defense_catalog,
    learned_inversion_attacks,
    published_attacks,
    tap_defended_round,
    trivial_baselines,
)
from lightning_gp.audit.setting_audit import reference_pixels
from lightning_gp.metrics import concatenate_reports
from lightning_gp.models import LeNetZhu

LEARNED = ("adaptive:LearnedInversion", "adaptive:RefinedLearnedInversion")
DEFAULT_DEFENSES = ["undefended", "GaussianNoise", "LaplaceNoise", "TopKPruning"]


def _psnr(cell: Cell | None) -> float | None:
    return None if cell is None or not cell.means else cell.means.get("psnr")


def _text(cell: Cell | None) -> str:
    psnr = _psnr(cell)
    if cell is None:
        return "not run"
    if psnr is None:
        return f"{cell.status}: {cell.note}"
    return f"{psnr:.1f} ({cell.leak_fraction:.0%})"


def _cost_columns(cost: dict) -> dict[str, object]:
    return {
        "inverter training s (CPU s)": f"{cost.get('seconds', float('nan')):.0f} ({cost.get('cpu_seconds', float('nan')):.0f})",
        "simulation s": round(cost.get("simulation_seconds", float("nan")), 1),
        "pairs": cost.get("samples", "-"),
        "epochs": cost.get("epochs", "-"),
        "stopped": cost.get("stopped", "-"),
    }


def learned_only(setting, datamodule, indices, args) -> tuple[dict[str, str], dict]:
    """The learned inverter and its refined variant alone on ``setting``'s tapped round:
    ``({attack: "PSNR (leaked)"}, training cost)``."""
    L.seed_everything(args.seed, verbose=False)
    records, sent, _ = tap_defended_round(
        setting, LeNetZhu(), datamodule, indices=indices, num_clients=len(indices), seed=args.seed
    )
    config = InverterConfig(max_epochs=args.max_epochs)
    reference = reference_pixels(datamodule)
    cells, cost = {}, {}
    for attack in learned_inversion_attacks(setting, datamodule, config=config, seed=args.seed):
        results = [
            attack_record(r, sent, attack, num_classes=datamodule.num_classes, mean=datamodule.mean, std=datamodule.std)
            for r in records
        ]
        merged = concatenate_reports([r.report for r in results])
        leaked = LeakRule().leak_fraction(merged, trivial_baselines(merged.original_pixels, reference_images=reference))
        first = [row.psnr for row in merged.rows[:8]]
        cells[f"adaptive:{type(attack).__name__}"] = (
            f"{merged.means['psnr']:.1f} ({leaked:.0%}); first 8: {sum(first) / len(first):.1f}"
        )
        print(f"{type(attack).__name__} per-image PSNR: {[round(row.psnr, 2) for row in merged.rows]}", flush=True)
        cost = results[0].reconstruction.meta["training"]
        print(f"{setting.name}: {type(attack).__name__} {cells[f'adaptive:{type(attack).__name__}']}", flush=True)
    return cells, cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sample", action="store_true", help="use the built-in sample even if the full set is installed"
    )
    parser.add_argument("--defenses", nargs="*", default=DEFAULT_DEFENSES, help="catalogue names")
    parser.add_argument("--attacks", nargs="*", default=["DLG", "iDLG"], help="published attacks to compare with")
    parser.add_argument("--images", type=int, default=16, help="attacked clients, one image each")
    parser.add_argument("--ig-iterations", type=int, default=1000, help="Adam attacks' steps")
    parser.add_argument("--lbfgs-iterations", type=int, default=100, help="L-BFGS attacks' steps")
    parser.add_argument("--max-epochs", type=int, default=60, help="cap on the inverter's epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--learned-only", action="store_true", help="run the learned inverter alone")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.images < 1:
        parser.error("--images must be >= 1")
    torch.set_num_threads(args.threads)
    datasets = fashion_mnist_datasets(full=not args.sample)
    dataset_name = "fashion-mnist" if "fashion-mnist" in datasets else "sample"
    datamodule = datasets[dataset_name]
    budget = AttackBudget(
        ig_iterations=args.ig_iterations,
        lbfgs_iterations=args.lbfgs_iterations,
        learned_inversion=True,
        learned_max_epochs=args.max_epochs,
    )
    indices = choose_images(datamodule, args.images, args.seed)
    rows = []
    for entry in defense_catalog(args.defenses):
        setting = entry.build(args.seed, 1)
        print(f"\n== {setting.name}", flush=True)
        L.seed_everything(args.seed, verbose=False)
        start = time.perf_counter()
        if args.learned_only:
            learned_cells, cost = learned_only(setting, datamodule, indices, args)
            rows.append(
                {
                    "defense": setting.name,
                    "best other attack": "not run (--learned-only)",
                    "its PSNR (leaked)": "-",
                    "LearnedInversion": learned_cells[LEARNED[0]],
                    "RefinedLearnedInversion": learned_cells[LEARNED[1]],
                    "passive worst PSNR (leaked)": "-",
                    "passive verdict": "-",
                    **_cost_columns(cost),
                    "audit s": round(time.perf_counter() - start),
                }
            )
            continue

        audit = audit_setting(
            setting,
            LeNetZhu(),
            datamodule,
            indices=indices,
            published=published_attacks(budget, args.attacks),
            budget=budget,
            seed=args.seed,
            log=lambda line: print(line, flush=True),
        )
        for line in audit.summary_lines():
            print(line, flush=True)
        cells = {c.attack: c for c in audit.cells}
        others = [c for c in audit.cells if c.attack not in LEARNED and c.threat == "passive" and _psnr(c) is not None]
        best = max(others, key=lambda c: _psnr(c) or float("-inf"), default=None)
        learned = audit.results.get(LEARNED[0])
        cost = learned[0].reconstruction.meta.get("training", {}) if learned else {}
        passive = audit.passive
        rows.append(
            {
                "defense": setting.name,
                "best other attack": "-" if best is None else best.attack,
                "its PSNR (leaked)": _text(best),
                "LearnedInversion": _text(cells.get(LEARNED[0])),
                "RefinedLearnedInversion": _text(cells.get(LEARNED[1])),
                "passive worst PSNR (leaked)": "-"
                if passive is None or passive.means.get("psnr") is None
                else f"{passive.means['psnr']:.1f} ({passive.leak_fraction:.0%})",
                "passive verdict": audit.verdict("passive"),
                **_cost_columns(cost),
                "audit s": round(time.perf_counter() - start),
            }
        )
    preamble = (
        f"LeNetZhu at initialisation, FedSGD round 0, {args.images} clients x 1 image of {dataset_name} "
        f"(training indices {[i[0] for i in indices]}, drawn with seed {args.seed}); "
        + (
            ""
            if args.learned_only
            else f"published attacks {args.attacks} (L-BFGS {args.lbfgs_iterations} iterations), the setting's "
            f"adaptive attacks (Adam {args.ig_iterations} iterations, L-BFGS {args.lbfgs_iterations} x 4 restarts), "
        )
        + "the learned inverter "
        f"(trained on the test split, at most {args.max_epochs} epochs, stops when its validation loss has not "
        "improved for 4 epochs) and the same refined by 200 Adam steps of the setting's defense-aware Inverting "
        "Gradients objective (the published one where the setting has none)"
        + (" (--learned-only: the learned attacks alone ran)" if args.learned_only else "")
        + ". Cells: mean "
        "PSNR (dB) over the images (fraction of images that attack leaks under the audit's LeakRule; no LPIPS, so "
        f"no verdict can be 'private'). torch threads: {args.threads}. Command: python benchmarks/learned_inversion.py "
        + " ".join(sys.argv[1:])
    )
    name = "learned_inversion" if dataset_name == "fashion-mnist" else "learned_inversion_sample"
    write_results(name, rows, preamble, args.output_dir)


if __name__ == "__main__":
    main()
