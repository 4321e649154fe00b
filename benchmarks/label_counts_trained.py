"""Batch label recovery on a trained model (issue 25, the trained-round matrix's weak point).

:func:`~lightning_gp.attacks.label_counts` (Geng et al. 2021, Sec. 3.2) estimates the batch's mean
softmax from uniformly random images; a trained model scores those unlike its data. For the
batch-8 matrix's clients (``--images`` training images drawn by ``--seed``, 8 per client, the
undefended setting), this script compares the recovered per-class counts with the true ones at
each ``--rounds`` round (the setting trained that many FedSGD rounds first, as the matrix's
``--audit-rounds`` does), and runs iDLG on each client at the last round twice: with the recovered
labels and with the true ones (``labels_known``), to show what the labels cost the attack.

Writes ``benchmarks/results/label_counts_trained.{csv,md}`` (``--output-dir`` to change).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L
import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, write_results
from matrix import choose_images

from lightning_gp.attacks import IDLG, label_counts
from lightning_gp.attacks.view import ServerView
from lightning_gp.audit import attack_record, defense_catalog
from lightning_gp.audit.rounds import tap_defended_round
from lightning_gp.models import LeNetZhu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=16, help="attacked images, 8 per client (default 16)")
    parser.add_argument("--rounds", type=int, nargs="+", default=[0, 50], help="rounds to tap (default 0 50)")
    parser.add_argument("--lbfgs-iterations", type=int, default=300, help="iDLG's cap on L-BFGS steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.images < 8 or args.images % 8:
        parser.error(f"--images must be a positive multiple of 8, got {args.images}")
    if any(r < 0 for r in args.rounds):
        parser.error(f"--rounds must be >= 0, got {args.rounds}")
    torch.set_num_threads(args.threads)
    datamodule = fashion_mnist_datasets(full=True)
    name = "fashion-mnist" if "fashion-mnist" in datamodule else "sample"
    dm = datamodule[name]
    indices = choose_images(dm, args.images, args.seed, batch_size=8)
    setting = defense_catalog(["undefended"])[0].build(args.seed, 1)
    rows = []
    for round_ in args.rounds:
        L.seed_everything(args.seed, verbose=False)
        records, model, _ = tap_defended_round(setting, LeNetZhu(), dm, indices=indices, round=round_)
        for client, record in enumerate(records):
            view = ServerView.from_tap(record, model, num_classes=10, mean=dm.mean, std=dm.std)
            recovered = label_counts(view)
            true = torch.bincount(record.targets, minlength=10)
            row = {
                "round": round_,
                "client": client,
                "true counts": true.tolist(),
                "recovered counts": recovered.tolist(),
                "labels wrong": int((recovered - true).abs().sum()) // 2,
            }
            if round_ == args.rounds[-1]:
                for known in (False, True):
                    L.seed_everything(args.seed, verbose=False)
                    start = time.perf_counter()
                    result = attack_record(
                        record,
                        model,
                        IDLG(iterations=args.lbfgs_iterations),
                        num_classes=10,
                        mean=dm.mean,
                        std=dm.std,
                        labels_known=known,
                        lpips=False,
                    )
                    which = "true labels" if known else "recovered labels"
                    row[f"iDLG PSNR, {which}"] = result.report.means["psnr"]
                    row[f"iDLG SSIM, {which}"] = result.report.means["ssim"]
                    print(f"round {round_} client {client} iDLG with {which}: {time.perf_counter() - start:.0f} s")
            rows.append(row)
    columns = list(rows[-1])  # the last round's rows carry the iDLG columns too
    rows = [{key: row.get(key, "-") for key in columns} for row in rows]
    preamble = (
        f"Undefended LeNetZhu, {len(indices)} clients x 8 images of {name} (training indices {indices}, seed "
        f"{args.seed}), tapped at FedSGD rounds {args.rounds} (each after that many rounds of training). "
        "'labels wrong': images whose label the recovered counts get wrong (half the L1 distance of the "
        f"counts). iDLG: {args.lbfgs_iterations} L-BFGS steps at most, 1 start, at round {args.rounds[-1]}; "
        "mean over the client's 8 images, matched one-to-one."
    )
    write_results("label_counts_trained", rows, preamble, args.output_dir)


if __name__ == "__main__":
    main()
