"""The noise-aware MAP attack against isotropic noise at batch 1 (issue 25, the noise targets).

For each setting (default ``GaussianNoise(scale=0.01)`` and ``LaplaceNoise(scale=0.01)`` of the
catalogue), LeNetZhu at initialisation, FedSGD round 0, ``--images`` clients with one training image
each (drawn by ``--seed``, never tuned), every passive published attack (DLG, iDLG, Inverting
Gradients, GradInversion; R-GAP does not apply to LeNetZhu, Robbing the Fed is the active server's)
and the setting's adaptive attacks (the defense-aware pair and :class:`~lightning_gp.attacks.NoiseAwareMAP`)
run through :func:`~lightning_gp.audit.audit_setting`, with the matrix's budgets. The table gives
each attack's mean PSNR, the passive worst case (per image, the best attack) over today's attacks
(everything but the noise-aware MAP) and over all of them, and the gain.

The clients are split into ``--jobs`` worker processes (a chunk of clients each, its own round and
defense seed ``seed + chunk``: the noise every client draws is its own either way); the model is the
same LeNetZhu (``--seed``) in every chunk. LPIPS is not computed (PSNR is the target; the leak rule
uses PSNR, SSIM, the semantic score and the noise ratio).

Writes ``benchmarks/results/noise_aware.{csv,md}`` (``--output-dir`` to change).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, write_results

from lightning_gp.attacks import UnmodelledDefenseWarning
from lightning_gp.audit import AttackBudget, audit_setting, defense_catalog, published_attacks, worst_case_report
from lightning_gp.audit.setting_audit import reference_pixels
from lightning_gp.frontier.workers import worker_pool
from lightning_gp.metrics import ReconstructionReport, concatenate_reports
from lightning_gp.models import LeNetZhu

PASSIVE = ["DLG", "iDLG", "IG", "GradInversion"]
NEW = "adaptive:NoiseAwareMAP"


def choose_images(datamodule: Any, count: int, seed: int) -> list[list[int]]:
    """``count`` training images drawn by ``seed`` (one per client), as the matrix draws them."""
    datamodule.setup("fit")
    order = torch.randperm(len(datamodule.train_dataset), generator=torch.Generator().manual_seed(seed))[:count]
    return [[int(i)] for i in order]


def run_chunk(job: tuple) -> tuple[str, int, dict[str, ReconstructionReport], dict[str, float]]:
    """One worker: audit one setting on a chunk of clients; the per-attack reports and seconds."""
    name, dataset_name, indices, chunk, budget, seed, threads = job
    torch.set_num_threads(threads)
    datamodule = fashion_mnist_datasets(full=dataset_name == "fashion-mnist")[dataset_name]
    datamodule.batch_size = 500
    setting = defense_catalog([name])[0].build(seed + chunk, 1)
    L.seed_everything(seed, verbose=False)
    model = LeNetZhu()  # the same initialisation in every chunk
    with warnings.catch_warnings():
        warnings.simplefilter("always", UnmodelledDefenseWarning)
        audit = audit_setting(
            setting,
            model,
            datamodule,
            indices=indices,
            published=published_attacks(budget, PASSIVE),
            budget=budget,
            seed=seed + chunk,
            lpips_fn=None,
            log=lambda line: print(f"[{name} chunk {chunk}] {line.strip()}", flush=True),
        )
    reports = {attack: concatenate_reports([r.report for r in out]) for attack, out in audit.results.items()}
    seconds = {cell.attack: cell.seconds for cell in audit.cells}
    for cell in audit.cells:
        if cell.status != "ok":
            print(f"[{name} chunk {chunk}] {cell.attack}: {cell.status}: {cell.note}", flush=True)
    return name, chunk, reports, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="*", default=["GaussianNoise", "LaplaceNoise"], help="catalogue names")
    parser.add_argument("--images", type=int, default=16, help="attacked clients, one image each (default 16)")
    parser.add_argument("--sample", action="store_true", help="the built-in sample even if the full set is installed")
    parser.add_argument("--ig-iterations", type=int, default=1000, help="Adam attacks' steps (the matrix's 1000)")
    parser.add_argument("--lbfgs-iterations", type=int, default=100, help="L-BFGS steps per run (the matrix's 100)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (chunks of clients)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.images < 1 or args.jobs < 1:
        parser.error("--images and --jobs must be >= 1")
    datasets = fashion_mnist_datasets(full=not args.sample)
    dataset_name = "fashion-mnist" if "fashion-mnist" in datasets else "sample"
    datamodule = datasets[dataset_name]
    indices = choose_images(datamodule, args.images, args.seed)
    budget = AttackBudget(ig_iterations=args.ig_iterations, lbfgs_iterations=args.lbfgs_iterations)
    chunks = [indices[i :: args.jobs] for i in range(min(args.jobs, len(indices)))]
    jobs = [
        (name, dataset_name, chunk, c, budget, args.seed, args.threads)
        for name in args.settings
        for c, chunk in enumerate(chunks)
    ]
    print(
        f"noise_aware: {args.settings} x {args.images} images of {dataset_name} {[i[0] for i in indices]}", flush=True
    )
    start = time.perf_counter()
    with worker_pool(args.jobs) as pool:
        done = list(pool.map(run_chunk, jobs))
    reference = reference_pixels(datamodule)
    rows = []
    for name in args.settings:
        parts = sorted((c, reports, seconds) for n, c, reports, seconds in done if n == name)
        attacks = list(parts[0][1])
        merged = {a: concatenate_reports([reports[a] for _, reports, _ in parts]) for a in attacks}
        seconds = {a: sum(s.get(a, 0.0) for _, _, s in parts) for a in attacks}
        judge = lambda chosen: worst_case_report([merged[a] for a in chosen], reference_images=reference)  # noqa: E731
        today, now = judge([a for a in attacks if a != NEW]), judge(attacks)
        row: dict[str, Any] = {"setting": name, "images": args.images}
        for a in attacks:
            row[f"{a} PSNR"] = round(float(merged[a].means["psnr"]), 2)
        best_today = max((a for a in attacks if a != NEW), key=lambda a: merged[a].means["psnr"])
        row["best attack today"] = best_today
        row["worst case today PSNR (leaked)"] = f"{today.means['psnr']:.2f} ({today.leak_fraction:.0%})"
        row["worst case with NoiseAwareMAP PSNR (leaked)"] = f"{now.means['psnr']:.2f} ({now.leak_fraction:.0%})"
        row["gain over worst case today (dB)"] = round(now.means["psnr"] - today.means["psnr"], 2)
        if NEW in merged:
            wins = sum(r.psnr > w.values["psnr"] for r, w in zip(merged[NEW].rows, today.rows))
            row["images NoiseAwareMAP beats today's worst case"] = f"{wins}/{len(today.rows)}"
        row["NoiseAwareMAP s/image"] = round(seconds.get(NEW, 0.0) / args.images, 1)
        row["adaptive:DefenseAwareIDLG s/image"] = round(seconds.get("adaptive:DefenseAwareIDLG", 0.0) / args.images, 1)
        rows.append(row)
    preamble = (
        f"LeNetZhu at initialisation, FedSGD round 0, {args.images} clients x 1 image of {dataset_name} (training "
        f"indices {[i[0] for i in indices]}, drawn with seed {args.seed}); DLG/iDLG/adaptive L-BFGS "
        f"{args.lbfgs_iterations} steps per run (the adaptive ones and NoiseAwareMAP: 4 restarts), IG/GradInversion/"
        f"adaptive Adam {args.ig_iterations} steps. Worst case: per image, the best passive attack (PSNR in dB, "
        f"mean over the images; leaked: the audit's leak rule without LPIPS). 'today': every attack but "
        f"NoiseAwareMAP. Wall time {time.perf_counter() - start:.0f} s with {args.jobs} workers x {args.threads} "
        f"thread(s). Command: benchmarks/noise_aware.py {' '.join(sys.argv[1:])}"
    )
    write_results("noise_aware", rows, preamble, args.output_dir)
    for row in rows:
        print(row, flush=True)


if __name__ == "__main__":
    main()
