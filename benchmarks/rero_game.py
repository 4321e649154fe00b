"""The prior-aware reconstruction game against DP-SGD, checked against its ReRo bound (issue 27 item 2).

For each noise multiplier sigma the adversary of Hayes, Mahloujifar, Balle (NeurIPS 2023, Alg. 2)
knows ``n`` Fashion-MNIST training images, one of which the client trains on, and picks the one whose
clipped gradient best explains the released DP-SGD gradients (lightning_gp.privacy.reconstruction_game).
Its success rate, with a Clopper-Pearson interval, must stay below the bound eta at kappa = 1/n
(lightning_gp.privacy.reconstruction_bound); a lower CI limit above eta is a bug in one of the two.

    python benchmarks/rero_game.py                      # sample data, 2000 trials per row
    python benchmarks/rero_game.py --data full --trials 5000

Writes benchmarks/results/rero_game.{md,csv}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, write_results
from torch import nn

from lightning_gp.models import LeNetZhu
from lightning_gp.privacy import reconstruction_game


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--candidates", type=int, default=10, help="n: kappa = 1/n")
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument(
        "--runs",
        default="1:1.0,4:0.5",
        help="comma-separated steps:sample_rate pairs, e.g. '1:1.0,4:0.5' (one full-batch step; 4 steps at q=0.5)",
    )
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.1, help="the model moves by lr x the released gradient")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--data", choices=["sample", "full"], default="sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()

    datamodule = fashion_mnist_datasets(args.data == "full")["fashion-mnist" if args.data == "full" else "sample"]
    datamodule.setup("fit")
    dataset = datamodule.train_dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))[: args.candidates]
    inputs = torch.stack([torch.as_tensor(dataset[int(i)][0]) for i in order])
    targets = torch.tensor([int(dataset[int(i)][1]) for i in order])
    torch.manual_seed(args.seed)
    model = LeNetZhu(in_channels=inputs.shape[1], num_classes=10, image_size=inputs.shape[-1])
    runs = [(int(s), float(q)) for s, q in (pair.split(":") for pair in args.runs.split(","))]
    rows = []
    for steps, rate in runs:
        for sigma in args.sigmas:
            result = reconstruction_game(
                model,
                nn.functional.cross_entropy,
                inputs,
                targets,
                noise_multiplier=sigma,
                max_grad_norm=args.max_grad_norm,
                steps=steps,
                sample_rate=rate,
                lr=args.lr,
                trials=args.trials,
                seed=args.seed,
            )
            low, high = result.interval(0.95)
            rows.append(
                {
                    "sigma": sigma,
                    "steps": steps,
                    "q": rate,
                    f"epsilon (delta={args.delta:g})": result.mechanism.epsilon(args.delta),
                    "kappa": result.kappa,
                    "eta (bound)": result.bound,
                    "game success": result.success_rate,
                    "95% CI": f"[{low:.3f}, {high:.3f}]",
                    "below bound": "yes" if low <= result.bound else "NO: bug",
                    "clipped": result.clipped_fraction,
                }
            )
            print(rows[-1], flush=True)
    preamble = (
        f"Prior-aware game ({args.candidates} candidates from {args.data} Fashion-MNIST, LeNetZhu, C = "
        f"{args.max_grad_norm:g}, lr {args.lr:g}, {args.trials} trials per row, seed {args.seed}); eta from "
        "dp_accounting's PLD and riskcal (add/remove); epsilon from the same PLD. 'clipped': share of candidate "
        "gradients longer than C. Command: python benchmarks/rero_game.py "
        f"--trials {args.trials} --data {args.data}"
    )
    write_results("rero_game", rows, preamble, args.output_dir)


if __name__ == "__main__":
    main()
