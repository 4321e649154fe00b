"""How fast the federated simulation runs, and what a defense adds to a round.

1. Per-client gradients for one FedSGD round: torch.func vmap over clients vs one autograd pass
   per client, on LeNetZhu and ConvNet (Fashion-MNIST shapes, 8 images per client), for several
   clients per round. Reports the speedup and the largest difference between the two paths.
2. Whole rounds through ``Trainer.fit`` on the built-in sample (10 clients): undefended vs
   MagnitudePruning(0.8); the defense's cost as a ratio to the undefended round, measured in one run.

Writes benchmarks/results/simulation_throughput.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from _common import RESULTS_DIR, median_seconds, write_results
from torch import nn

from lightning_gp.callbacks import MagnitudePruning
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.federated import FederatedSimulation, client_gradients
from lightning_gp.models import ConvNet, LeNetZhu


def gradient_rows(clients_list: list[int], repeats: int) -> list[dict]:
    rows = []
    loss = nn.CrossEntropyLoss()
    for name, make in (("LeNetZhu", lambda: LeNetZhu()), ("ConvNet", lambda: ConvNet())):
        model = make()
        for clients in clients_list:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(clients, 8, 1, 28, 28, generator=g)
            y = torch.randint(0, 10, (clients, 8), generator=g)
            vmapped, _ = client_gradients(model, loss, x, y, vectorize=True)
            looped, _ = client_gradients(model, loss, x, y, vectorize=False)
            diff = max(float((vmapped[n] - looped[n]).abs().max()) for n in vmapped)
            t_vmap = median_seconds(lambda: client_gradients(model, loss, x, y, vectorize=True), repeats)
            t_loop = median_seconds(lambda: client_gradients(model, loss, x, y, vectorize=False), repeats)
            rows.append(
                {
                    "model": name,
                    "clients": clients,
                    "vmap_ms": 1e3 * t_vmap,
                    "loop_ms": 1e3 * t_loop,
                    "speedup": t_loop / t_vmap,
                    "max_abs_diff": diff,
                }
            )
            print(f"{name} clients={clients}: vmap {1e3 * t_vmap:.1f} ms, loop {1e3 * t_loop:.1f} ms", flush=True)
    return rows


def round_seconds(defenses: list, rounds: int) -> float:
    L.seed_everything(0, verbose=False)
    simulation = FederatedSimulation(
        LeNetZhu(),
        datamodule=FashionMNISTSampleDataModule(),
        num_clients=10,
        clients_per_round=10,
        local_batch_size=8,
        server_optimizer="adam",
        server_lr=1e-3,
        rounds_per_epoch=10**6,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=rounds,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=defenses,
    )
    start = time.perf_counter()
    trainer.fit(simulation)
    return (time.perf_counter() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 10, 32])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    rows = gradient_rows(args.clients, args.repeats)
    write_results(
        "simulation_throughput",
        rows,
        f"Per-client FedSGD gradients, 8 images per client, median of {args.repeats} (CPU, "
        f"{torch.get_num_threads()} threads). speedup = loop / vmap.",
    )

    round_seconds([], 20)  # warm-up: first-call costs of torch.func and the data
    undefended = [round_seconds([], args.rounds) for _ in range(2)]
    defended = [round_seconds([MagnitudePruning(rate=0.8)], args.rounds) for _ in range(2)]
    base, pruned = min(undefended), min(defended)
    round_rows = [
        {"run": "undefended", "ms_per_round": 1e3 * base, "ratio_to_undefended": 1.0},
        {"run": "MagnitudePruning(0.8)", "ms_per_round": 1e3 * pruned, "ratio_to_undefended": pruned / base},
    ]
    write_results(
        "simulation_rounds",
        round_rows,
        f"Whole FedSGD rounds through Trainer.fit: LeNetZhu, 10 clients x 8 images, built-in sample, "
        f"{args.rounds} rounds, best of 2 runs each.",
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for model in ("LeNetZhu", "ConvNet"):
        sub = [r for r in rows if r["model"] == model]
        ax.plot([r["clients"] for r in sub], [r["vmap_ms"] for r in sub], "o-", label=f"{model} vmap")
        ax.plot([r["clients"] for r in sub], [r["loop_ms"] for r in sub], "s--", label=f"{model} loop")
    ax.set(
        xlabel="clients per round", ylabel="ms per round (client gradients)", title="Per-client gradients: vmap vs loop"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "simulation_throughput.png", dpi=120)
    print(f"results in {RESULTS_DIR}")


if __name__ == "__main__":
    main()
