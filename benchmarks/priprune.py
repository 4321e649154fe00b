"""PriPrune (issue 11; Chu et al., PriPrune, Table 2, Fig. 4, Fig. 8c, Fig. 9): pruned FedAvg, its leak, the defense.

Setting: LeNetZhu on Fashion-MNIST (the built-in sample; ``--full`` adds the full set), 50 clients holding two
label shards each (non-IID), 10 sampled per round, FedAvg (server SGD at lr 1), one local epoch of 3 steps of
20 images at lr 0.25, base pruning rate 0.3, a fixed budget of ``--rounds`` rounds.

1. Main (Table 2, Fig. 9): for each base scheme (random, magnitude/PruneFL-style, SNIP, SynFlow) without and
   with PriPrune: test accuracy after the budget, PriPrune's defense rate, bytes up/down per client-round
   (``CommunicationMeter``), and the leak of an attack round after training: ``--images`` clients each send
   the update of one image (one local step) from the trained model with their trained defense state, and
   SGI (Alg. 2) and plain Inverting Gradients attack it; PSNR, SSIM, LPIPS and the paper's NMI.
2. Rates (Fig. 4): SGI vs plain IG against each base scheme at base rates 0.1, 0.3, 0.5 (no defense).
3. Trade-off (Fig. 8c): PriPrune on magnitude at several mask learning rates, both aggregations.

Writes benchmarks/results/priprune_{main,rates,tradeoff}.{csv,md} and priprune_tradeoff.png (Fig. 9 style).
"""

from __future__ import annotations

import argparse
import inspect
import time
from typing import Any

import lightning as L
import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, write_results

from lightning_gp.attacks import SGI, InvertingGradients, ServerView
from lightning_gp.audit import quiet_lightning
from lightning_gp.callbacks import CommunicationMeter
from lightning_gp.federated import FederatedSimulation
from lightning_gp.metrics import LPIPS, reconstruction_report
from lightning_gp.models import LeNetZhu
from lightning_gp.priprune import BASE_SCHEMES, PriPruneModule, PrunedFedAvgModule

SCHEMES = ("random", "magnitude", "snip", "synflow")
LOCAL = {"num_clients": 50, "clients_per_round": 10, "local_batch_size": 20, "local_steps": 3, "local_lr": 0.25}


def train(datamodule, scheme: str, rate: float, defense: dict[str, Any] | None, rounds: int, seed: int):
    """One pruned-FedAvg run; returns the trained simulation, its test accuracy and its byte meter."""
    L.seed_everything(seed, verbose=False)
    model = LeNetZhu()
    if defense is None:
        module: PrunedFedAvgModule = PrunedFedAvgModule(model, base_scheme=scheme, base_rate=rate, seed=seed)
    else:
        module = PriPruneModule(model, base_scheme=scheme, base_rate=rate, seed=seed, **defense)
    sim = FederatedSimulation(
        module, datamodule=datamodule, algorithm="fedavg", partition="shards", server_lr=1.0, seed=seed, **LOCAL
    )
    meter = CommunicationMeter()
    with quiet_lightning():
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=rounds,
            val_check_interval=rounds,
            check_val_every_n_epoch=None,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[meter],
        )
        trainer.fit(sim)
        accuracy = trainer.test(sim, verbose=False)[0]["test_acc"]
    return sim, accuracy, meter


def attack_round(sim: FederatedSimulation, datamodule, images: int, iterations: int, lpips_fn) -> dict[str, dict]:
    """Clients 0..images-1 each send the update of their first image (one local step) from the trained model,
    with their trained defense state; SGI and plain IG attack each update. Mean scores per attack."""
    module = sim.module
    assert isinstance(module, PrunedFedAvgModule) and sim.client_indices is not None
    round_idx = int(sim.global_step)
    module.begin_round(round_idx)
    dataset = datamodule.train_dataset
    scores: dict[str, list[dict[str, float]]] = {"SGI": [], "IG": []}
    kwargs = {"noise_ratio": False} if "noise_ratio" in inspect.signature(reconstruction_report).parameters else {}
    for client in range(images):
        index = int(sim.client_indices[client][0])
        x, y = dataset[index]
        inputs, targets = torch.as_tensor(x)[None, None], torch.as_tensor(y).view(1, 1)
        update, _ = module.client_update(inputs, targets, client_id=client, round=round_idx, lr=LOCAL["local_lr"])
        bare = LeNetZhu()
        bare.load_state_dict(
            {n.removeprefix("module."): t for n, t in module.state_dict().items() if isinstance(t, torch.Tensor)}
        )
        view = ServerView(
            model=bare,
            gradients={n.removeprefix("module."): u for n, u in update.items()},
            batch_size=1,
            input_shape=tuple(inputs.shape[2:]),
            num_classes=10,
            mean=datamodule.mean,
            std=datamodule.std,
            meta={"algorithm": "fedavg", "local_steps": 1, "local_lr": LOCAL["local_lr"]},
        )
        for name, attack in (
            ("SGI", SGI(iterations=iterations, lr=0.1, seed=client)),
            ("IG", InvertingGradients(iterations=iterations, lr=0.1, seed=client)),
        ):
            reconstruction = attack.reconstruct(view)
            report = reconstruction_report(
                reconstruction, inputs[0], view, true_labels=targets[0], lpips_fn=lpips_fn, **kwargs
            )
            scores[name].append({k: float(v) for k, v in report.means.items() if v is not None})
    return {
        name: {metric: sum(s[metric] for s in runs) / len(runs) for metric in runs[0]} for name, runs in scores.items()
    }


def leak_columns(leak: dict[str, dict]) -> dict[str, float]:
    columns = {}
    for attack in ("SGI", "IG"):
        for metric in ("nmi", "psnr", "ssim", "lpips"):
            columns[f"{attack}_{metric}"] = leak[attack].get(metric, float("nan"))
    return columns


def defense_rate(sim: FederatedSimulation) -> float:
    rates = getattr(sim.module, "defense_rates", {})
    return sum(rates.values()) / len(rates) if rates else 0.0


def main_table(datamodule, dataset: str, args, defense: dict[str, Any], lpips_fn) -> list[dict]:
    rows = []
    for scheme in SCHEMES:
        for label, setting in (("base", None), ("+PriPrune", defense)):
            start = time.perf_counter()
            sim, accuracy, meter = train(datamodule, scheme, 0.3, setting, args.rounds, args.seed)
            rate = defense_rate(sim)  # the training rounds' defense rate, before the attack round
            leak = attack_round(sim, datamodule, args.images, args.iterations, lpips_fn)
            rows.append(
                {
                    "dataset": dataset,
                    "scheme": scheme,
                    "defense": label,
                    "test_acc": accuracy,
                    "defense_rate": rate,
                    **leak_columns(leak),
                    "upload_bytes": meter.total_upload_bytes / meter.uploads,
                    "download_bytes": meter.total_download_bytes / meter.uploads,
                    "dense_bytes": meter.total_dense_bytes / meter.uploads,
                }
            )
            print(
                f"main {dataset} {scheme} {label}: acc {accuracy:.4f} defense {rate:.3f} "
                f"SGI NMI {leak['SGI']['nmi']:.3f} PSNR {leak['SGI']['psnr']:.2f} | IG NMI {leak['IG']['nmi']:.3f} "
                f"({time.perf_counter() - start:.0f}s)",
                flush=True,
            )
    for base, defended in zip(rows[::2], rows[1::2]):
        for row in (base, defended):
            row["acc_drop_points"] = 100 * (base["test_acc"] - row["test_acc"])
            row["sgi_nmi_change_pct"] = 100 * (row["SGI_nmi"] - base["SGI_nmi"]) / base["SGI_nmi"]
    return rows


def rates_table(datamodule, dataset: str, args, main_rows: list[dict], lpips_fn) -> list[dict]:
    rows = []
    for scheme in SCHEMES:
        for rate in (0.1, 0.3, 0.5):
            if rate == 0.3:
                leak_row = next(r for r in main_rows if r["scheme"] == scheme and r["defense"] == "base")
                accuracy, columns = leak_row["test_acc"], {k: leak_row[k] for k in leak_columns({"SGI": {}, "IG": {}})}
            else:
                sim, accuracy, _ = train(datamodule, scheme, rate, None, args.rounds, args.seed)
                columns = leak_columns(attack_round(sim, datamodule, args.images, args.iterations, lpips_fn))
            rows.append({"dataset": dataset, "scheme": scheme, "base_rate": rate, "test_acc": accuracy, **columns})
            row = rows[-1]
            row["sgi_beats_ig_nmi"] = row["SGI_nmi"] > row["IG_nmi"]
            row["sgi_beats_ig_psnr"] = row["SGI_psnr"] > row["IG_psnr"]
            print(
                f"rates {dataset} {scheme} p={rate}: SGI NMI {row['SGI_nmi']:.3f} PSNR {row['SGI_psnr']:.2f} | "
                f"IG NMI {row['IG_nmi']:.3f} PSNR {row['IG_psnr']:.2f}",
                flush=True,
            )
    return rows


def tradeoff_table(datamodule, dataset: str, args, main_rows: list[dict], defense: dict[str, Any], lpips_fn):
    base = next(r for r in main_rows if r["scheme"] == "magnitude" and r["defense"] == "base")
    rows = [
        {"dataset": dataset, "mask_lr": 0.0, "aggregation": "-", "test_acc": base["test_acc"], "defense_rate": 0.0}
        | {k: base[k] for k in ("SGI_nmi", "SGI_psnr", "IG_nmi")}
    ]
    for aggregation in ("weighted", "mask_aware"):
        for mask_lr in args.tradeoff_mask_lr:
            setting = {**defense, "mask_lr": mask_lr, "aggregation": aggregation}
            sim, accuracy, _ = train(datamodule, "magnitude", 0.3, setting, args.rounds, args.seed)
            rate = defense_rate(sim)
            leak = attack_round(sim, datamodule, args.images, args.iterations, lpips_fn)
            rows.append(
                {
                    "dataset": dataset,
                    "mask_lr": mask_lr,
                    "aggregation": aggregation,
                    "test_acc": accuracy,
                    "defense_rate": rate,
                    "SGI_nmi": leak["SGI"]["nmi"],
                    "SGI_psnr": leak["SGI"]["psnr"],
                    "IG_nmi": leak["IG"]["nmi"],
                }
            )
            print(
                f"tradeoff {dataset} mask_lr={mask_lr} {aggregation}: acc {accuracy:.4f} defense {rate:.3f} "
                f"SGI NMI {leak['SGI']['nmi']:.3f}",
                flush=True,
            )
    return rows


def plot(main_rows: list[dict], tradeoff_rows: list[dict], dataset: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(zip(SCHEMES, ("tab:green", "tab:red", "tab:blue", "tab:purple")))
    for scheme in SCHEMES:
        base = next(r for r in main_rows if r["scheme"] == scheme and r["defense"] == "base")
        ours = next(r for r in main_rows if r["scheme"] == scheme and r["defense"] == "+PriPrune")
        left.scatter(base["test_acc"], base["SGI_nmi"], color=colors[scheme], marker="o", s=60, label=scheme)
        left.scatter(
            ours["test_acc"], ours["SGI_nmi"], color=colors[scheme], marker="*", s=140, label=f"{scheme} + PriPrune"
        )
        left.annotate(
            "",
            xy=(ours["test_acc"], ours["SGI_nmi"]),
            xytext=(base["test_acc"], base["SGI_nmi"]),
            arrowprops={"arrowstyle": "->", "color": colors[scheme], "alpha": 0.5},
        )
    left.set(xlabel="test accuracy", ylabel="NMI of SGI (lower is more private)", title="Fig. 9: base vs + PriPrune")
    left.legend(fontsize=7)
    for aggregation, marker in (("weighted", "o"), ("mask_aware", "s")):
        points = [r for r in tradeoff_rows if r["aggregation"] == aggregation]
        right.plot([r["test_acc"] for r in points], [r["SGI_nmi"] for r in points], marker=marker, label=aggregation)
        for r in points:
            right.annotate(f"{r['mask_lr']:g}", (r["test_acc"], r["SGI_nmi"]), fontsize=7)
    base = tradeoff_rows[0]
    right.scatter(base["test_acc"], base["SGI_nmi"], color="black", marker="x", s=60, label="magnitude, no defense")
    right.set(xlabel="test accuracy", ylabel="NMI of SGI", title="Fig. 8c: PriPrune on magnitude, by mask_lr")
    right.legend(fontsize=7)
    fig.suptitle(f"LeNetZhu, {dataset} Fashion-MNIST, 50 non-IID clients, 10 per round", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / f"priprune_tradeoff{'' if dataset == 'sample' else '_' + dataset}.png", dpi=130)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few rounds, one image, few iterations")
    parser.add_argument("--full", action="store_true", help="also the full Fashion-MNIST (if installed)")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--images", type=int, default=4, help="attacked clients (one image each)")
    parser.add_argument("--iterations", type=int, default=1000, help="attack iterations (SGI and IG)")
    parser.add_argument("--mask-lr", type=float, default=1.0, help="PriPrune's mask learning rate in the main table")
    parser.add_argument("--aggregation", default="weighted", choices=("weighted", "mask_aware"))
    parser.add_argument("--tradeoff-mask-lr", type=float, nargs="*", default=[0.3, 1.0, 3.0, 10.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: immune to shared-core slowdowns)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.images, args.iterations, args.tradeoff_mask_lr = 10, 1, 50, [1.0]
    torch.set_num_threads(args.threads)
    assert set(SCHEMES) <= set(BASE_SCHEMES)
    defense = {"mask_lr": args.mask_lr, "aggregation": args.aggregation}
    lpips_fn = LPIPS()
    suffix = "_quick" if args.quick else ""
    preamble_common = (
        f"LeNetZhu, 50 clients x 2 label shards, 10 per round, FedAvg (3 local steps of 20 images, lr 0.25), base rate "
        f"0.3 unless stated, {args.rounds} rounds, seed {args.seed}. Attack round after training: {args.images} clients "
        f"each send the update of one image (one step) with their trained defense state; SGI (soft labels) and plain "
        f"Inverting Gradients (labels from the update), {args.iterations} Adam steps at lr 0.1 on signed gradients. "
        "NMI: 256 intensity levels (unrelated 28x28 images score about 0.45)."
    )
    for dataset, datamodule in fashion_mnist_datasets(args.full).items():
        datamodule.setup("fit")
        tag = "" if dataset == "sample" else f"_{dataset}"
        main_rows = main_table(datamodule, dataset, args, defense, lpips_fn)
        write_results(
            f"priprune_main{tag}{suffix}",
            main_rows,
            preamble_common
            + f" PriPrune: the paper's PruneFL lambdas (5, 15, 2e-5), temperature 1, alpha_init 0.1, mask_lr "
            f"{args.mask_lr}, {args.aggregation} aggregation. Bytes per client-round (CommunicationMeter: weights "
            "sent, pruned model received).",
        )
        rates_rows = rates_table(datamodule, dataset, args, main_rows, lpips_fn)
        write_results(f"priprune_rates{tag}{suffix}", rates_rows, preamble_common + " No defense (Fig. 4).")
        tradeoff_rows = tradeoff_table(datamodule, dataset, args, main_rows, defense, lpips_fn)
        write_results(
            f"priprune_tradeoff{tag}{suffix}",
            tradeoff_rows,
            preamble_common + " PriPrune on magnitude at several mask learning rates and both aggregations.",
        )
        if not args.quick:
            plot(main_rows, tradeoff_rows, dataset)


if __name__ == "__main__":
    main()
