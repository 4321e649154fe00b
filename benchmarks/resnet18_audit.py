"""How long the audit of a CIFAR ResNet-18 client takes on the CPU (issue 46): one batch of 8 RGB images.

``audit_setting`` on RGB 3x32x32 crops (``PhotoCropsDataModule``; CIFAR-10 with ``--cifar`` where its
files are installed) with ``ResNet18`` (BatchNorm, about 11M parameters), undefended, round 0, one
client of ``--batch`` images, the published attacks ``--attacks`` (default: every registered one) at the
audit's default budgets. Prints the audit's progress lines as they come (a line per attack, and a
heartbeat at least every 30 s within one) and writes the time per attack
and the verdict with its reasons; an attack that cannot handle a layer reads "n/a" with the reason.

Writes ``benchmarks/results/resnet18_audit.{csv,md}``.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import write_results
from any_data import spread_indices

from lightning_gp.attacks import monitored
from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.setting_audit import AttackBudget, audit_setting, published_attacks
from lightning_gp.data import CIFAR10DataModule, PhotoCropsDataModule
from lightning_gp.models import ResNet18


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--attacks", nargs="+", default=None, help="published attack names (default: all)")
    parser.add_argument("--cifar", action="store_true", help="CIFAR-10 from its standard files instead of crops")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    datamodule = CIFAR10DataModule() if args.cifar else PhotoCropsDataModule(seed=0)
    datamodule.setup("fit")
    indices = [spread_indices(datamodule, args.batch)]
    budget = AttackBudget()
    torch.manual_seed(0)
    start = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - start:7.0f} s] {line}", flush=True)

    with monitored():  # a heartbeat line at least every 30 s while an attack runs
        audit = audit_setting(
            DefenseSetting("undefended", []),
            ResNet18(num_classes=datamodule.num_classes),
            datamodule,
            indices=indices,
            published=published_attacks(budget, args.attacks),
            budget=budget,
            log=log,
        )
    total = time.perf_counter() - start
    rows = [
        {
            "attack": cell.attack,
            "status": cell.status,
            "note": cell.note[:160],
            "leaked": "-" if cell.leak_fraction is None else f"{round(cell.leak_fraction * args.batch)}/{args.batch}",
            "mean psnr": round(cell.means.get("psnr") or float("nan"), 2),
            "seconds": round(cell.seconds),
        }
        for cell in audit.cells
    ]
    for threat in ("passive", "active"):
        worst = audit.passive if threat == "passive" else audit.active
        rows.append(
            {
                "attack": f"**worst case, {threat}**",
                "status": audit.verdict(threat),
                "note": "; ".join(worst.verdict_reasons)[:160] if worst else "",
                "leaked": f"{worst.leaked}/{args.batch}" if worst else "-",
                "mean psnr": round(worst.means.get("psnr") or float("nan"), 2) if worst else "-",
                "seconds": round(total),
            }
        )
    data = "CIFAR-10" if args.cifar else "RGB photo crops (PhotoCropsDataModule)"
    preamble = (
        f"{data}, ResNet18 (BatchNorm, in training mode as the client trains), undefended, round 0, one client of "
        f"{args.batch} images, the audit's default budgets, {args.threads} torch threads. Whole audit: {total / 60:.1f} "
        "minutes.\n\n"
        f"Run: `python benchmarks/resnet18_audit.py --batch {args.batch} --threads {args.threads}`"
    )
    write_results("resnet18_audit", rows, preamble)


if __name__ == "__main__":
    main()
