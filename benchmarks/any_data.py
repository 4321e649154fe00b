"""The audit on data other than Fashion-MNIST (issue 46): what ``audit_setting`` says on each data set.

Each dataset with a model made for it (the built-in Fashion-MNIST sample with LeNetZhu; RGB 3x32x32
crops of scikit-image's photographs, ``PhotoCropsDataModule``, with the ConvNet of Inverting
Gradients; CIFAR-10 with the ConvNet where its files are installed), each setting (undefended, and
Gaussian noise of std 10 per coordinate, which no attack should see through), client batch 1, 16
training images spread over the classes, round 0, the published attacks ``--attacks`` and every
adaptive attack of the setting, at the audit's default budgets unless told. The leak rule is the
audit's (revision 5): the identification test and a semantic test, both calibrated on the data's
public split (the shipped classifier for Fashion-MNIST), and the fixed PSNR/SSIM lines only on an
output that passes the identification gate. The table counts the leaked images and, among them, those
an output identifies, those the semantic test names and those a gated pixel line catches (one image
may count under several). Per image: ``any_data_images.csv``.

Writes ``benchmarks/results/any_data.{csv,md}`` and ``any_data_images.csv``.
"""

from __future__ import annotations

import argparse
import csv
import time
from typing import Any

import torch
from _common import RESULTS_DIR, write_results

from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.setting_audit import AttackBudget, SettingAudit, audit_setting, published_attacks
from lightning_gp.callbacks import GaussianNoise
from lightning_gp.data import CIFAR10DataModule, FashionMNISTSampleDataModule, PhotoCropsDataModule
from lightning_gp.data.base import DatasetNotFoundError
from lightning_gp.models import ConvNet, LeNetZhu


def datasets() -> dict[str, tuple[Any, Any]]:
    """Name -> (datamodule, model factory); CIFAR-10 only where its files are installed."""
    found: dict[str, tuple[Any, Any]] = {
        "Fashion-MNIST sample (1x28x28), LeNetZhu": (FashionMNISTSampleDataModule(seed=0), lambda: LeNetZhu()),
        "photo crops (3x32x32, 11 classes), ConvNet": (PhotoCropsDataModule(seed=0), lambda: ConvNet(11, 3, 32)),
    }
    try:
        cifar = CIFAR10DataModule()
        cifar.setup("fit")
        found["CIFAR-10 (3x32x32), ConvNet"] = (cifar, lambda: ConvNet(10, 3, 32))
    except DatasetNotFoundError as err:
        print(f"CIFAR-10 not installed, skipped: {str(err).splitlines()[0]}")
    return found


def spread_indices(datamodule: Any, count: int) -> list[int]:
    """``count`` training indices taking the classes in turn (the first images of each class)."""
    dataset = datamodule.train_dataset
    labels = torch.as_tensor([int(dataset[i][1]) for i in range(len(dataset))])
    per_class = [(labels == c).nonzero().flatten().tolist() for c in labels.unique().tolist()]
    picked: list[int] = []
    for rank in range(count):
        for indices in per_class:
            if len(picked) < count and rank < len(indices):
                picked.append(indices[rank])
    return picked


def criterion_counts(audit: SettingAudit) -> dict[str, int]:
    """How many images of the passive worst case leak by each kind of criterion (any attack)."""
    counts = {"identified": 0, "semantic": 0, "pixel line": 0}
    for row in audit.passive.rows if audit.passive else []:
        met = " ".join(c for criteria in row.criteria.values() for c in criteria)
        counts["identified"] += "identification" in met
        counts["semantic"] += "semantic" in met
        counts["pixel line"] += any(k in met for k in ("psnr", "ssim", "noise_ratio"))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--attacks", nargs="+", default=["iDLG", "IG", "RtF"])
    parser.add_argument("--ig-iterations", type=int, default=AttackBudget().ig_iterations)
    args = parser.parse_args()
    torch.set_num_threads(1)
    budget = AttackBudget(ig_iterations=args.ig_iterations)
    rows, image_rows = [], []
    for data_name, (datamodule, make_model) in datasets().items():
        datamodule.setup("fit")
        indices = [[i] for i in spread_indices(datamodule, args.images)]
        settings = [
            DefenseSetting("undefended", []),
            DefenseSetting("GaussianNoise(scale=10)", [GaussianNoise(scale=10.0, seed=0)]),
        ]
        for setting in settings:
            torch.manual_seed(0)
            start = time.perf_counter()
            audit = audit_setting(
                setting,
                make_model(),
                datamodule,
                indices=indices,
                published=published_attacks(budget, args.attacks),
                budget=budget,
                log=lambda line: None,
            )
            seconds = time.perf_counter() - start
            passive = audit.passive
            leaked = [row.index for row in passive.rows if row.leaks] if passive else []
            counts = criterion_counts(audit)
            rows.append(
                {
                    "data": data_name,
                    "setting": setting.name,
                    "passive": audit.verdict("passive"),
                    "active": audit.verdict("active"),
                    "leaked": f"{len(leaked)}/{len(indices)}",
                    **{f"by {name}": f"{n}/{len(indices)}" for name, n in counts.items()},
                    "reasons": "; ".join(passive.verdict_reasons) if passive else "",
                    "active reasons": "; ".join(audit.active.verdict_reasons) if audit.active else "",
                    "seconds": round(seconds),
                }
            )
            for row in passive.rows if passive else []:
                image_rows.append(
                    {
                        "data": data_name,
                        "setting": setting.name,
                        "image": row.index,
                        "psnr": row.values.get("psnr"),
                        "ssim": row.values.get("ssim"),
                        "identification_p": row.values.get("identification"),
                        "semantic": row.values.get("semantic"),
                        "leaks": row.leaks,
                        "criteria": "; ".join(f"{a}: {', '.join(c)}" for a, c in row.criteria.items()),
                    }
                )
            print(rows[-1], flush=True)
    with open(RESULTS_DIR / "any_data_images.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(image_rows[0]))
        writer.writeheader()
        writer.writerows(image_rows)
    preamble = (
        f"Client batch 1, {args.images} training images spread over the classes, round 0, attacks "
        f"{', '.join(args.attacks)} and every adaptive attack (Adam {args.ig_iterations} steps, L-BFGS on "
        "convergence), the audit's leak rule (revision 5: identification and semantic tests calibrated on "
        "the public split, the first 1000 test images; pixel lines gated by identification). One torch "
        "thread.\n\n"
        f"Run: `python benchmarks/any_data.py --images {args.images} --attacks {' '.join(args.attacks)} "
        f"--ig-iterations {args.ig_iterations}`"
    )
    write_results("any_data", rows, preamble)


if __name__ == "__main__":
    main()
