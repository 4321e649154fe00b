"""What a real FedAvg round leaks (issue 46): the attack built for it against the attacks of one gradient.

Clients of the built-in Fashion-MNIST sample with LeNetZhu, undefended, round 0. Each audited client
holds ``--local-images`` training images (classes in turn) and trains ``--local-epochs`` epochs over
them in local batches of ``--local-batch-size`` at local learning rate 0.1 (a fresh seeded order each
epoch), then shares ``w_global - w_local`` (``audit_setting(algorithm="fedavg", local_epochs=...,
local_batch_size=...)``). The attacks: ``FedAvgInversion`` (Dimitrov et al., TMLR 2022: simulates the
local steps on per-epoch dummy copies with the epoch-order prior) and, as the baseline that treats the
update as one gradient, Inverting Gradients and iDLG; the labels are granted (the audit does so under
local training). Each configuration is judged by the audit's leak rule, per attack and in the worst
case; ``--images`` images in all (clients of ``--local-images`` each).

Writes ``benchmarks/results/fedavg_leakage.{csv,md}``.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import write_results
from any_data import spread_indices

from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.setting_audit import AttackBudget, audit_setting, published_attacks
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.models import LeNetZhu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--local-images", type=int, default=8)
    parser.add_argument("--local-epochs", type=int, nargs="+", default=[5])
    parser.add_argument("--local-batch-size", type=int, default=8)
    parser.add_argument("--attacks", nargs="+", default=["FedAvgInversion", "IG", "iDLG"])
    parser.add_argument("--ig-iterations", type=int, default=AttackBudget().ig_iterations)
    args = parser.parse_args()
    torch.set_num_threads(1)
    datamodule = FashionMNISTSampleDataModule(seed=0)
    datamodule.setup("fit")
    picked = spread_indices(datamodule, args.images)
    indices = [picked[k : k + args.local_images] for k in range(0, len(picked), args.local_images)]
    budget = AttackBudget(ig_iterations=args.ig_iterations)
    rows = []
    for epochs in args.local_epochs:
        steps = epochs * args.local_images // args.local_batch_size
        torch.manual_seed(0)
        start = time.perf_counter()
        audit = audit_setting(
            DefenseSetting("undefended", []),
            LeNetZhu(),
            datamodule,
            indices=indices,
            published=published_attacks(budget, args.attacks),
            budget=budget,
            algorithm="fedavg",
            local_epochs=epochs,
            local_batch_size=args.local_batch_size,
            log=lambda line: None,
        )
        seconds = time.perf_counter() - start
        for cell in audit.cells:
            leaked = "-" if cell.leak_fraction is None else f"{round(cell.leak_fraction * len(picked))}/{len(picked)}"
            rows.append(
                {
                    "local epochs": epochs,
                    "local steps": steps,
                    "attack": cell.attack,
                    "status": cell.status,
                    "leaked": leaked,
                    "mean psnr": round(cell.means.get("psnr") or float("nan"), 2),
                    "mean ssim": round(cell.means.get("ssim") or float("nan"), 3),
                    "seconds": round(cell.seconds),
                }
            )
        worst = audit.passive
        rows.append(
            {
                "local epochs": epochs,
                "local steps": steps,
                "attack": "**worst case**",
                "status": audit.verdict("passive"),
                "leaked": f"{worst.leaked}/{len(picked)}" if worst else "-",
                "mean psnr": round(worst.means.get("psnr") or float("nan"), 2) if worst else "-",
                "mean ssim": round(worst.means.get("ssim") or float("nan"), 3) if worst else "-",
                "seconds": round(seconds),
            }
        )
        print(rows[-1], flush=True)
    preamble = (
        f"Built-in Fashion-MNIST sample, LeNetZhu, undefended, round 0; {len(indices)} clients of "
        f"{args.local_images} images ({len(picked)} in all), local batch {args.local_batch_size}, local lr 0.1, "
        f"labels granted; attacks at Adam {args.ig_iterations} steps (L-BFGS on convergence); the audit's leak "
        "rule (revision 5). One torch thread.\n\n"
        f"Run: `python benchmarks/fedavg_leakage.py --images {args.images} --local-images {args.local_images} "
        f"--local-epochs {' '.join(map(str, args.local_epochs))} --local-batch-size {args.local_batch_size}`"
    )
    write_results("fedavg_leakage", rows, preamble)


if __name__ == "__main__":
    main()
