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

Writes benchmarks/results/learned_inversion.{csv,md} (``--output-dir`` to change).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L
import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, write_results
from matrix import choose_images

from lightning_gp.audit import AttackBudget, Cell, audit_setting, defense_catalog, published_attacks
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
        lines: list[str] = []

        def log(line: str, lines: list[str] = lines) -> None:
            lines.append(line)
            print(line, flush=True)

        audit = audit_setting(
            setting,
            LeNetZhu(),
            datamodule,
            indices=indices,
            published=published_attacks(budget, args.attacks),
            budget=budget,
            seed=args.seed,
            log=log,
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
                "inverter training s": round(cost.get("seconds", float("nan")), 1),
                "simulation s": round(cost.get("simulation_seconds", float("nan")), 1),
                "pairs": cost.get("samples", "-"),
                "epochs": cost.get("epochs", "-"),
                "stopped": cost.get("stopped", "-"),
                "audit s": round(time.perf_counter() - start),
            }
        )
    preamble = (
        f"LeNetZhu at initialisation, FedSGD round 0, {args.images} clients x 1 image of {dataset_name} "
        f"(training indices {[i[0] for i in indices]}, drawn with seed {args.seed}); published attacks "
        f"{args.attacks} (L-BFGS {args.lbfgs_iterations} iterations), the setting's adaptive attacks (Adam "
        f"{args.ig_iterations} iterations, L-BFGS {args.lbfgs_iterations} x 4 restarts), the learned inverter "
        f"(trained on the test split, at most {args.max_epochs} epochs, stops when its validation loss has not "
        "improved for 4 epochs) and the same refined by 200 Adam steps of the adaptive objective. Cells: mean "
        "PSNR (dB) over the images (fraction of images that attack leaks under the audit's LeakRule; no LPIPS, so "
        f"no verdict can be 'private'). torch threads: {args.threads}. Command: python benchmarks/learned_inversion.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if k not in ("output_dir", "sample")
        )
        + (" --sample" if args.sample else "")
    )
    write_results("learned_inversion", rows, preamble, args.output_dir)


if __name__ == "__main__":
    main()
