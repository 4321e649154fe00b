"""DP-FedAvg behind secure aggregation: the measured worst case beside its ReRo bound, and its PMM.

For each noise multiplier z, ``--clients`` clients of one Fashion-MNIST training image each share
their FedSGD gradient at round 0 (LeNetZhu at initialisation); DP-FedAvg (McMahan et al., ICLR 2018;
:class:`lightning_gp.federated.ClientLevelDP`) clips each to ``--clip`` and the server sees the noised
mean only (the audit's aggregate view, ``audit_setting(client_dp=...)``): the published passive
attacks reconstruct the batch of every client's images from it and every image is scored. The bound
is one round's eta at the audit's kappa. PMM: test accuracy after ``--rounds`` FedSGD rounds of 10
clients x 8 images under DP-FedAvg over the same training without it.

    python benchmarks/client_dp.py                  # full Fashion-MNIST when installed, else the sample

Writes benchmarks/results/client_dp.{md,csv}.
"""

from __future__ import annotations

import argparse

import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, write_results
from matrix import choose_images

from lightning_gp.audit import AttackBudget, DefenseSetting, audit_setting, published_attacks, train_setting
from lightning_gp.federated import ClientLevelDP
from lightning_gp.metrics import LPIPS
from lightning_gp.models import LeNetZhu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noise-multipliers", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--clip", type=float, default=1.0, help="max_update_norm C")
    parser.add_argument("--clients", type=int, default=8, help="clients behind the aggregate, one image each")
    parser.add_argument("--rounds", type=int, default=200, help="FedSGD rounds of the PMM training")
    parser.add_argument("--sample", action="store_true", help="the built-in sample, not the full Fashion-MNIST")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    datasets = fashion_mnist_datasets(full=not args.sample)
    name = "fashion-mnist" if "fashion-mnist" in datasets else "sample"
    datamodule = datasets[name]
    indices = choose_images(datamodule, args.clients, args.seed)  # the matrix's draw: one image per client
    budget = AttackBudget()
    lpips_fn = LPIPS()
    undefended = DefenseSetting("undefended")
    torch.manual_seed(args.seed)
    baseline = train_setting(undefended, LeNetZhu(), datamodule, rounds=args.rounds, seed=args.seed)
    rows = []
    for z in args.noise_multipliers:
        dp = ClientLevelDP(z, args.clip, seed=args.seed)
        torch.manual_seed(args.seed)
        audit = audit_setting(
            undefended,
            LeNetZhu(),
            datamodule,
            indices=indices,
            published=published_attacks(budget, ["iDLG", "IG", "GradInversion"]),
            budget=budget,
            adaptive=False,
            client_dp=dp,
            lpips_fn=lpips_fn,
            seed=args.seed,
        )
        torch.manual_seed(args.seed)
        trained = train_setting(undefended, LeNetZhu(), datamodule, rounds=args.rounds, seed=args.seed, client_dp=dp)
        worst, bound = audit.aggregate, audit.aggregate_bound
        rows.append(
            {
                "z": z,
                "C": args.clip,
                "epsilon (1 round, delta 1e-5)": round(dp.epsilon(1, 1.0), 3),
                "eta (audit's kappa)": None if bound is None or bound.eta is None else round(bound.eta, 3),
                "kappa": None if bound is None or bound.kappa is None else round(bound.kappa, 3),
                "images leaked": None if worst is None else f"{worst.leak_fraction:.0%}",
                "worst PSNR (dB)": None if worst is None else round(worst.means.get("psnr", float("nan")), 1),
                "verdict": audit.verdict("aggregate"),
                "PMM": round(trained.test_acc / baseline.test_acc, 3),
            }
        )
        print(rows[-1], flush=True)
    preamble = (
        f"DP-FedAvg behind secure aggregation on {name}: {args.clients} clients x 1 image (training indices "
        f"{[i[0] for i in indices]}, seed {args.seed}), LeNetZhu at initialisation, FedSGD round 0; the server "
        "sees the noised mean of the clipped gradients; attacks iDLG, IG, GradInversion at the matrix budgets "
        f"(no adaptive attack models the aggregate, so no verdict reads private). PMM after {args.rounds} rounds "
        f"of 10 clients x 8 images, over the undefended run's test accuracy {baseline.test_acc:.3f}."
    )
    write_results("client_dp", rows, preamble, RESULTS_DIR)


if __name__ == "__main__":
    main()
