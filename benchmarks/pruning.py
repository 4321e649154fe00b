"""The pruning family against attacks, and what it costs (issue 4; DGP paper Tab. 1-4, Fig. 4).

1. Privacy: Inverting Gradients (as published, and matching only the entries the client sent)
   and Robbing the Fed against undefended, Top-k 20%, magnitude
   pruning 80%, DGP (k1 5%, k2 75%) and ADGP (k 20%, k1 5%), LeNetZhu on Fashion-MNIST, through
   real FedSGD rounds (``lightning_gp.audit``). Error feedback is irrelevant to one round's leak.
2. Utility: FedSGD, 10 clients x 8 images, a fixed number of rounds: test accuracy of
   undefended, DGP with and without error feedback, ADGP and Top-k (the DGP paper's Fig. 4
   ablation), learning curves as a PNG, and each method's upload/download bytes per client-round.
3. Cost: defense time per step as a ratio to the undefended training step (forward + backward)
   on LeNetZhu and ResNet18 (CPU, batch 32), measured in one run.

Writes benchmarks/results/pruning_{privacy,utility,cost}.{csv,md} and pruning_curves.png.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, median_seconds, write_results
from torch import nn

from lightning_gp import callbacks, defenses
from lightning_gp.attacks import InvertingGradients, RobbingTheFed
from lightning_gp.audit import attack_record, mean_scores, tap_fedsgd_round
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.federated import FederatedSimulation
from lightning_gp.models import LeNetZhu, ResNet18

PRIVACY_DEFENSES = {
    "undefended": list,
    "Top-k 20%": lambda: [callbacks.TopKPruning(rate=0.8)],
    "magnitude 80%": lambda: [callbacks.MagnitudePruning(rate=0.8)],
    "DGP (5%, 75%)": lambda: [callbacks.DualGradientPruning(k1=0.05, k2=0.75)],
    "ADGP (20%, 5%)": lambda: [callbacks.AlignedDualGradientPruning(k=0.2, k1=0.05)],
}
UTILITY_DEFENSES = {
    "undefended": list,
    "DGP + EF": lambda: [callbacks.DualGradientPruning(k1=0.05, k2=0.75, error_feedback=True)],
    "DGP no EF": lambda: [callbacks.DualGradientPruning(k1=0.05, k2=0.75, error_feedback=False)],
    "ADGP + EF": lambda: [callbacks.AlignedDualGradientPruning(k=0.2, k1=0.05, error_feedback=True)],
    "Top-k 20% + EF": lambda: [callbacks.TopKPruning(rate=0.8, error_feedback=True)],
}


def privacy(datamodule, dataset: str, images: int, ig_iterations: int, seed: int) -> list[dict]:
    rows = []
    for setting, make in PRIVACY_DEFENSES.items():
        for label, attack, batch, clients in (
            ("IG", InvertingGradients(iterations=ig_iterations), 1, list(range(images))),
            (
                "IG support-only",
                InvertingGradients(iterations=ig_iterations, support_only=True),
                1,
                list(range(images)),
            ),
            ("RobbingTheFed", RobbingTheFed(num_bins=128), 16, [0, 1]),
        ):
            L.seed_everything(seed, verbose=False)
            records, model, secrets = tap_fedsgd_round(
                LeNetZhu(),
                datamodule,
                defenses=make(),
                attack=attack,
                clients=clients,
                num_clients=max(10, len(clients)),
                local_batch_size=batch,
                seed=seed,
            )
            results = [
                attack_record(
                    r, model, attack, num_classes=10, mean=datamodule.mean, std=datamodule.std, server_secrets=secrets
                )
                for r in records
            ]
            means = mean_scores(results)
            psnrs = [row.psnr for r in results for row in r.report.rows]
            rows.append(
                {
                    "dataset": dataset,
                    "attack": label,
                    "defense": setting,
                    "images": len(psnrs),
                    "psnr": means["psnr"],
                    "ssim": means["ssim"],
                    "lpips": means["lpips"],
                    "frac_psnr_gt_40": sum(p > 40 for p in psnrs) / len(psnrs),
                }
            )
            print(
                f"privacy {dataset} {rows[-1]['attack']} vs {setting}: PSNR {means['psnr']:.2f} SSIM {means['ssim']:.3f}",
                flush=True,
            )
    return rows


class ValidationHistory(L.Callback):
    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and "val_acc" in trainer.callback_metrics:
            self.points.append((trainer.global_step, float(trainer.callback_metrics["val_acc"])))


def utility(rounds: int, seed: int) -> tuple[list[dict], dict[str, list[tuple[int, float]]]]:
    rows, curves = [], {}
    for setting, make in UTILITY_DEFENSES.items():
        L.seed_everything(seed, verbose=False)
        meter, history = callbacks.CommunicationMeter(), ValidationHistory()
        simulation = FederatedSimulation(
            LeNetZhu(),
            datamodule=FashionMNISTSampleDataModule(batch_size=500),
            num_clients=10,
            clients_per_round=10,
            local_batch_size=8,
            server_optimizer="adam",
            server_lr=1e-3,
            seed=seed,
        )
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=rounds,
            val_check_interval=max(1, rounds // 10),
            check_val_every_n_epoch=None,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[*make(), meter, history],
        )
        trainer.fit(simulation)
        test_acc = trainer.test(simulation, verbose=False)[0]["test_acc"]
        rows.append(
            {
                "defense": setting,
                "rounds": rounds,
                "test_acc": test_acc,
                "upload_ratio": meter.upload_ratio,
                "download_ratio": meter.download_ratio,
                "upload_bytes_per_client_round": meter.total_upload_bytes / meter.uploads,
                "download_bytes_per_client_round": meter.total_download_bytes / meter.uploads,
            }
        )
        curves[setting] = history.points
        print(
            f"utility {setting}: test acc {test_acc:.4f}, up {meter.upload_ratio:.3f}, down {meter.download_ratio:.3f}",
            flush=True,
        )
    base = rows[0]["test_acc"]
    for row in rows:
        row["acc_drop_points"] = 100 * (base - row["test_acc"])
    return rows, curves


def cost(repeats: int) -> list[dict]:
    rows = []
    for name, model, shape in (("LeNetZhu", LeNetZhu(), (32, 1, 28, 28)), ("ResNet18", ResNet18(), (32, 3, 32, 32))):
        x, y = torch.randn(shape), torch.randint(0, 10, (shape[0],))
        loss_fn = nn.CrossEntropyLoss()

        def step() -> None:
            model.zero_grad()
            loss_fn(model(x), y).backward()

        step_seconds = median_seconds(step, repeats)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        for label, defense in (
            ("Top-k 20%", defenses.TopKPruning(rate=0.8)),
            ("magnitude 80%", defenses.MagnitudePruning(0.8)),
            ("DGP (5%, 75%)", defenses.DualGradientPruning()),
            ("ADGP (20%, 5%)", defenses.AlignedDualGradientPruning()),
        ):
            seconds = median_seconds(lambda: defense(grads, 0), repeats)
            rows.append(
                {
                    "model": name,
                    "defense": label,
                    "step_ms": 1e3 * step_seconds,
                    "defense_ms": 1e3 * seconds,
                    "ratio_to_step": seconds / step_seconds,
                }
            )
            print(f"cost {name} {label}: {1e3 * seconds:.1f} ms vs step {1e3 * step_seconds:.1f} ms", flush=True)
    return rows


def plot_curves(curves: dict[str, list[tuple[int, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for setting, points in curves.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=setting)
    ax.set(
        xlabel="FedSGD round", ylabel="validation accuracy", title="LeNetZhu, 10 clients, built-in Fashion-MNIST sample"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "pruning_curves.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4, help="images attacked by IG per defense (1 per client)")
    parser.add_argument("--ig-iterations", type=int, default=2500)
    parser.add_argument("--rounds", type=int, default=1000, help="FedSGD rounds of the utility runs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full", action="store_true", help="privacy on the full Fashion-MNIST too, when installed")
    parser.add_argument(
        "--parts", nargs="+", default=["privacy", "utility", "cost"], choices=["privacy", "utility", "cost"]
    )
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    if "cost" in args.parts:
        write_results(
            "pruning_cost",
            cost(args.repeats),
            "Defense time per step vs an undefended forward+backward step, CPU, batch 32, median.",
        )
    if "utility" in args.parts:
        rows, curves = utility(args.rounds, args.seed)
        plot_curves(curves)
        write_results(
            "pruning_utility",
            rows,
            f"FedSGD, LeNetZhu, 10 clients x 8 images, {args.rounds} rounds, server Adam 1e-3, seed {args.seed}.",
        )
    if "privacy" in args.parts:
        datasets = fashion_mnist_datasets(args.full)
        rows = [
            row
            for name, dm in datasets.items()
            for row in privacy(dm, name, args.images, args.ig_iterations, args.seed)
        ]
        write_results(
            "pruning_privacy",
            rows,
            f"FedSGD round 0, LeNetZhu. IG: {args.images} clients x 1 image, {args.ig_iterations} iterations; RtF: 2 clients x 16 images, 128 bins.",
        )


if __name__ == "__main__":
    main()
