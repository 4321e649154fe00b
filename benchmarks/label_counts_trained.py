"""Batch label recovery on a trained model (issue 25, the trained-round matrix's weak point).

:func:`~lightning_gp.attacks.label_counts` models the batch's mean softmax by per-class means. From
uniformly random images (``softmax_from="dummy"``, Geng et al. 2021, Sec. 3.2) the means are one
vector for every class, which fits the model at initialisation but not a trained model; from the
server's labelled public images (``"public"``, the test split) they are the model's own per-class
scores. For ``--images`` training images drawn by ``--seed`` (8 per client, the matrix's draw at 16,
the undefended setting) this script compares both estimates with the true counts at each
``--rounds`` round (the setting trained that many FedSGD rounds first, as the matrix's
``--audit-rounds`` does), and runs iDLG on the first ``--attacked-clients`` clients at the last
round three times: with the counts of each estimate and with the true labels (``labels_known``).
With ``--defended-rounds`` it also counts, for every catalogue setting (``--defenses``), the labels
each estimate gets wrong at those rounds: what the matrix's batch-8 rows recover.

Writes ``benchmarks/results/label_counts_trained.{csv,md}`` and, with ``--defended-rounds``,
``label_counts_defended.{csv,md}`` (``--output-dir`` to change).
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
from lightning_gp.audit.rounds import public_examples, tap_defended_round
from lightning_gp.models import LeNetZhu

ESTIMATES = ("dummy", "public")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64, help="training images, 8 per client (default 64)")
    parser.add_argument("--rounds", type=int, nargs="+", default=[0, 50, 200], help="rounds to tap (default 0 50 200)")
    parser.add_argument("--attacked-clients", type=int, default=2, help="clients iDLG attacks at the last round")
    parser.add_argument("--lbfgs-iterations", type=int, default=300, help="iDLG's cap on L-BFGS steps")
    parser.add_argument(
        "--defended-rounds", type=int, nargs="*", default=[0, 50], help="rounds of the per-setting table (none: skip)"
    )
    parser.add_argument("--defenses", nargs="*", default=None, help="catalogue names of that table (default: all)")
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
    public = public_examples(dm)
    setting = defense_catalog(["undefended"])[0].build(args.seed, 1)
    rows = []
    for round_ in args.rounds:
        L.seed_everything(args.seed, verbose=False)
        records, model, _ = tap_defended_round(setting, LeNetZhu(), dm, indices=indices, round=round_)
        for client, record in enumerate(records):
            view = ServerView.from_tap(record, model, num_classes=10, mean=dm.mean, std=dm.std, public_data=public)
            true = torch.bincount(record.targets, minlength=10)
            row: dict[str, object] = {"round": round_, "client": client, "true counts": true.tolist()}
            for estimate in ESTIMATES:
                recovered = label_counts(view, softmax_from=estimate)
                row[f"counts from {estimate}"] = recovered.tolist()
                row[f"wrong, {estimate}"] = int((recovered - true).abs().sum()) // 2
            if round_ == args.rounds[-1] and client < args.attacked_clients:
                for labels in (*ESTIMATES, "true"):
                    L.seed_everything(args.seed, verbose=False)
                    start = time.perf_counter()
                    result = attack_record(
                        record,
                        model,
                        IDLG(iterations=args.lbfgs_iterations),
                        num_classes=10,
                        mean=dm.mean,
                        std=dm.std,
                        labels_known=labels == "true",
                        lpips=False,
                        public_data=public if labels == "public" else None,
                    )
                    row[f"iDLG PSNR, {labels} labels"] = result.report.means["psnr"]
                    row[f"iDLG SSIM, {labels} labels"] = result.report.means["ssim"]
                    print(f"round {round_} client {client} iDLG, {labels} labels: {time.perf_counter() - start:.0f} s")
            rows.append(row)
    columns = list(rows[-len(indices)])  # the last round's first rows carry the iDLG columns too
    rows = [{key: row.get(key, "-") for key in columns} for row in rows]
    preamble = (
        f"Undefended LeNetZhu, {len(indices)} clients x 8 images of {name} (training indices {indices}, seed "
        f"{args.seed}), tapped at FedSGD rounds {args.rounds} (each after that many rounds of training). "
        "'counts from dummy': the per-class softmax from 256 uniformly random images (Geng et al. 2021); 'counts "
        "from public': from the first 1000 test images, class by class. 'wrong': images whose label the counts "
        f"get wrong (half the L1 distance to the true counts). iDLG: {args.lbfgs_iterations} L-BFGS steps at most, "
        f"1 start, at round {args.rounds[-1]} on clients 0-{args.attacked_clients - 1}; mean over the client's 8 "
        "images, matched one-to-one."
    )
    write_results("label_counts_trained", rows, preamble, args.output_dir)
    if args.defended_rounds:
        defended_table(dm, name, indices, public, args)


def defended_table(dm, name: str, indices: list[list[int]], public, args: argparse.Namespace) -> None:
    """Per catalogue setting and round, the labels each estimate gets wrong over every client."""
    rows = []
    for entry in defense_catalog(args.defenses):
        setting = entry.build(args.seed, 1)
        for round_ in args.defended_rounds:
            L.seed_everything(args.seed, verbose=False)
            start = time.perf_counter()
            records, model, _ = tap_defended_round(setting, LeNetZhu(), dm, indices=indices, round=round_)
            row: dict[str, object] = {"setting": setting.name, "round": round_}
            for estimate in ESTIMATES:
                wrong = 0
                for record in records:
                    view = ServerView.from_tap(
                        record, model, num_classes=10, mean=dm.mean, std=dm.std, public_data=public
                    )
                    true = torch.bincount(record.targets, minlength=10)
                    wrong += int((label_counts(view, softmax_from=estimate) - true).abs().sum()) // 2
                row[f"labels wrong, {estimate}"] = wrong
            rows.append(row)
            print(f"{setting.name} round {round_}: {row} ({time.perf_counter() - start:.0f} s)", flush=True)
    preamble = (
        f"LeNetZhu, {len(indices)} clients x 8 images of {name} (the draw of label_counts_trained.md), each "
        "catalogue setting trained that many FedSGD rounds, then tapped: the labels of the "
        f"{8 * len(indices)} images that label_counts gets wrong from the defended gradients, with the per-class "
        "softmax from 256 uniformly random images ('dummy', Geng et al. 2021) and from the first 1000 test "
        "images ('public', what the audit uses)."
    )
    write_results("label_counts_defended", rows, preamble, args.output_dir)


if __name__ == "__main__":
    main()
