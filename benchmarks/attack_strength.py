"""How strong the attacks are against the undefended baseline (issue 3's strength targets).

Every attack attacks real FedSGD client gradients (``lightning_gp.audit``: the round runs in
``FederatedSimulation``, the gradient is tapped as shared) on the built-in Fashion-MNIST sample
and, when installed, the full Fashion-MNIST. Fixed seeds. Targets reported against:

- InvertingGradients (2500 iterations), LeNetZhu, 1 image per client: mean PSNR >= 25 over 8 images
  (the default signed-gradient Adam, and the unsigned variant).
- DLG / IDLG on LeNetZhu: mean PSNR >= 30; IDLG label accuracy 100%.
- RobbingTheFed, batch 16: >= 80% of images recovered with PSNR > 40.
- RGAP on CNN6: mean PSNR >= 30.
- One InvertingGradients iteration on LeNetZhu: ms per iteration on this CPU.

Writes benchmarks/results/attack_strength.{csv,md} and a reconstruction grid per attack.
"""

from __future__ import annotations

import argparse
import math
import time

import lightning as L
import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, write_results

from lightning_gp.attacks import DLG, IDLG, RGAP, InvertingGradients, RobbingTheFed
from lightning_gp.audit import attack_record, mean_scores, tap_fedsgd_round
from lightning_gp.metrics import save_reconstruction_grid
from lightning_gp.models import CNN6, LeNetZhu


def run_attack(name, attack, make_model, datamodule, images: int, batch: int, dataset: str, target: str, seed: int):
    clients = list(range(images // batch))
    L.seed_everything(seed, verbose=False)  # the model's initialisation is part of the setting
    start = time.perf_counter()
    records, model, secrets = tap_fedsgd_round(
        make_model(),
        datamodule,
        attack=attack,
        clients=clients,
        num_clients=max(10, len(clients)),
        local_batch_size=batch,
        seed=seed,
    )
    results = [
        attack_record(
            r,
            model,
            attack,
            num_classes=datamodule.num_classes,
            mean=datamodule.mean,
            std=datamodule.std,
            server_secrets=secrets,
        )
        for r in records
    ]
    elapsed = time.perf_counter() - start
    means = mean_scores(results)
    psnrs = [row.psnr for r in results for row in r.report.rows]
    finite = [p for p in psnrs if math.isfinite(p)]
    grid = RESULTS_DIR / f"attack_strength_{dataset}_{name}.png"
    save_reconstruction_grid(
        torch.cat([r.report.original_pixels for r in results]),
        torch.cat([r.report.reconstructed_pixels for r in results]),
        grid,
        scores=[{"psnr": row.psnr, "ssim": row.ssim} for r in results for row in r.report.rows],
    )
    row = {
        "dataset": dataset,
        "attack": name,
        "images": len(psnrs),
        "batch": batch,
        "mean_psnr": means["psnr"],
        "median_psnr": float(torch.tensor(finite).median()) if finite else math.inf,
        "frac_psnr_gt_40": sum(p > 40 for p in psnrs) / len(psnrs),
        "mean_ssim": means["ssim"],
        "mean_lpips": means["lpips"],
        "label_acc": "" if means["label_accuracy"] is None else means["label_accuracy"],
        "seconds": elapsed,
        "target": target,
    }
    print(
        f"{dataset} {name}: mean PSNR {row['mean_psnr']:.2f}, >40 dB {row['frac_psnr_gt_40']:.0%}, "
        f"SSIM {row['mean_ssim']:.3f}, {elapsed:.0f}s",
        flush=True,
    )
    return row


def ig_ms_per_iteration(datamodule) -> float:
    records, model, _ = tap_fedsgd_round(LeNetZhu(), datamodule, clients=[0])
    attack = InvertingGradients(iterations=200)
    result = attack_record(
        records[0], model, attack, num_classes=10, mean=datamodule.mean, std=datamodule.std, lpips=False
    )
    return 1e3 * result.seconds / 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=8, help="images per optimisation attack (1 per client)")
    parser.add_argument("--ig-iterations", type=int, default=2500)
    parser.add_argument("--dlg-iterations", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full", action="store_true", help="also run on the full Fashion-MNIST when installed")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)

    datasets = fashion_mnist_datasets(args.full)
    lenet = lambda: LeNetZhu()  # noqa: E731
    cnn6 = lambda: CNN6(in_channels=1, image_size=28, num_classes=10)  # noqa: E731
    rows = []
    for dataset, dm in datasets.items():
        n = args.images
        runs = [
            ("IG_signed", InvertingGradients(iterations=args.ig_iterations), lenet, n, 1, "mean PSNR >= 25"),
            (
                "IG_unsigned",
                InvertingGradients(iterations=args.ig_iterations, signed=False),
                lenet,
                n,
                1,
                "mean PSNR >= 25",
            ),
            ("DLG", DLG(iterations=args.dlg_iterations), lenet, n, 1, "mean PSNR >= 30"),
            ("IDLG", IDLG(iterations=args.dlg_iterations), lenet, n, 1, "mean PSNR >= 30, labels 100%"),
            ("RGAP_CNN6", RGAP(), cnn6, n, 1, "mean PSNR >= 30"),
            ("RobbingTheFed_b16", RobbingTheFed(num_bins=128), lenet, 64, 16, ">= 80% with PSNR > 40"),
        ]
        for name, attack, make_model, images, batch, target in runs:
            rows.append(run_attack(name, attack, make_model, dm, images, batch, dataset, target, args.seed))
    ms = ig_ms_per_iteration(datasets["sample"])
    print(f"InvertingGradients on LeNetZhu: {ms:.2f} ms per iteration", flush=True)
    write_results(
        "attack_strength",
        rows,
        f"Undefended FedSGD round 0, client gradients tapped as shared. CPU, {torch.get_num_threads()} threads. "
        f"InvertingGradients on LeNetZhu (1 image): {ms:.2f} ms/iteration. Seed {args.seed}.",
    )


if __name__ == "__main__":
    main()
