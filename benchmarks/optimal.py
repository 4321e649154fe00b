"""Optimal defenses against isotropic ones: privacy vs utility, and what they cost (issue 5).

The MNIST experiment of "Optimal Defenses Against Gradient Reconstruction Attacks" (Sec. 4.1,
App. C.1), on Fashion-MNIST: ConvNet (the paper's SimpleConvNet, LeakyReLU), 4 clients x 16
images per step, k = 10 probes, c = 1e-6.

1. Privacy: Inverting Gradients (``--ig-iterations``) on the defended gradient a client shares in
   a real FedSGD round (``lightning_gp.audit``; the callbacks run in the simulation), averaged
   over ``--attack-clients`` clients holding ``--attack-batch`` images each (the paper attacks
   CIFAR-10 gradients two images at a time; a CPU budget does the same here). Reconstruction
   MSE and PSNR in [0, 1] pixel space.
2. Utility: the paper's scatter-plot protocol (App. C.1): one batch of 64 images (4 clients x
   16), ``--steps`` Adam updates (lr 1e-3 for noise, 5e-4 for pruning), each the mean of the 4
   clients' separately defended gradients; the training loss on that batch afterwards.
3. Cost: time of one defended step (forward + backward + sensitivity + defense) as a ratio to
   the undefended step, ConvNet, batch 16, CPU, median of ``--repeats``.

Pairs compared (Figs. 4, 7, 9, 11): GaussianNoise(scale) vs OptimalGradientNoise(scale) (equal
noise power), GaussianNoise(scale, clip) vs OptimalDPSGD(clip, scale), MagnitudePruning(rate) vs
OptimalGradientPruning(rate).

4. Estimator: median relative error of the k-probe sensitivity against the exact Jacobian on a
   tiny model, for k = 1 ... 300.

Writes benchmarks/results/optimal_{tradeoff,estimator,cost}.{csv,md} and optimal_tradeoff.png.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from collections.abc import Callable

import lightning as L
import numpy as np
import torch
from _common import RESULTS_DIR, median_seconds, write_results
from torch import nn

from lightning_gp import callbacks
from lightning_gp.attacks import InvertingGradients
from lightning_gp.audit import attack_record, mean_scores, tap_fedsgd_round
from lightning_gp.callbacks import GradientDefense, SensitivityGradientDefense
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.defenses import gradient_sensitivity
from lightning_gp.models import ConvNet

SCALES = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
RATES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
CLIENTS, PER_CLIENT = 4, 16
Factory = Callable[[], GradientDefense]


CE = nn.functional.cross_entropy  # the loss every model here trains with


def settings(clip: float) -> list[tuple[str, str, float, Factory, float]]:
    """(panel, method, strength, callback factory, Adam lr)."""
    rows: list[tuple[str, str, float, Factory, float]] = []
    for scale in SCALES:
        rows.append(("noise", "isotropic", scale, lambda s=scale: callbacks.GaussianNoise(scale=s, seed=0), 1e-3))
        rows.append(
            (
                "noise",
                "optimal",
                scale,
                lambda s=scale: callbacks.OptimalGradientNoise(scale=s, seed=0, loss_fn=CE),
                1e-3,
            )
        )
        rows.append(
            (
                "clipped",
                "clipped isotropic",
                scale,
                lambda s=scale: callbacks.GaussianNoise(scale=s, clip=clip, seed=0),
                1e-3,
            )
        )
        rows.append(
            (
                "clipped",
                "clipped optimal",
                scale,
                lambda s=scale: callbacks.OptimalDPSGD(clip=clip, scale=s, seed=0, loss_fn=CE),
                1e-3,
            )
        )
    for rate in RATES:
        rows.append(("pruning", "magnitude", rate, lambda r=rate: callbacks.MagnitudePruning(rate=r), 5e-4))
        rows.append(
            (
                "pruning",
                "optimal",
                rate,
                lambda r=rate: callbacks.OptimalGradientPruning(rate=r, seed=0, loss_fn=CE),
                5e-4,
            )
        )
    return rows


def training_batch(datamodule) -> tuple[torch.Tensor, torch.Tensor]:
    datamodule.setup("fit")
    dataset = datamodule.train_dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))[: CLIENTS * PER_CLIENT]
    x = torch.stack([dataset[int(i)][0] for i in order])
    y = torch.tensor([int(dataset[int(i)][1]) for i in order])
    return x.view(CLIENTS, PER_CLIENT, *x.shape[1:]), y.view(CLIENTS, PER_CLIENT)


def defended(
    callback: GradientDefense | None, model: nn.Module, x: torch.Tensor, y: torch.Tensor, client: int, step: int
) -> dict:
    """One client's shared gradient, through the callback's own defense and sensitivity estimate."""
    loss = CE(model(x), y)
    names = [n for n, _ in model.named_parameters()]
    raw = dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))
    if callback is None:
        return raw
    if isinstance(callback, SensitivityGradientDefense):
        sensitivity = callback.estimate(model, x, y, seed_words=(step, client, 0))
        return callback.defense(raw, client, sensitivity=sensitivity)
    return callback.defense(raw, client)


def utility(factory: Factory | None, batch, steps: int, lr: float, seed: int) -> float:
    """Training loss on the 64-image batch after ``steps`` defended FedSGD updates (App. C.1)."""
    torch.manual_seed(seed)
    model = ConvNet()
    callback = factory() if factory else None
    if callback is not None:
        callback.defense.set_num_clients(CLIENTS)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    xs, ys = batch
    for step in range(steps):
        shared = [defended(callback, model, xs[c], ys[c], c, step) for c in range(CLIENTS)]
        optimizer.zero_grad()
        for name, p in model.named_parameters():
            p.grad = torch.stack([s[name] for s in shared]).mean(0)
        optimizer.step()
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(xs.flatten(0, 1)), ys.flatten(0, 1)))


def privacy(
    factory: Factory | None, datamodule, attack_clients: int, attack_batch: int, iterations: int, seed: int
) -> dict:
    attack = InvertingGradients(iterations=iterations, seed=seed)
    torch.manual_seed(seed)
    records, model, _ = tap_fedsgd_round(
        ConvNet(),
        datamodule,
        defenses=[factory()] if factory else [],
        clients=list(range(attack_clients)),
        num_clients=CLIENTS,
        local_batch_size=attack_batch,
        seed=seed,
    )
    results = [
        attack_record(r, model, attack, num_classes=10, mean=datamodule.mean, std=datamodule.std, lpips=False)
        for r in records
    ]
    return mean_scores(results)


def tradeoff(args: argparse.Namespace) -> list[dict]:
    datamodule = FashionMNISTSampleDataModule()
    batch = training_batch(datamodule)
    rows = []
    baseline: list[tuple[str, str, float, Factory | None, float]] = [
        ("all", "undefended", 0.0, None, 1e-3),
        ("all", "undefended", 0.0, None, 5e-4),
    ]
    for panel, method, strength, factory, lr in baseline + settings(args.clip):
        start = time.perf_counter()
        losses = [utility(factory, batch, args.steps, lr, seed) for seed in range(args.seeds)]
        scores = (
            privacy(factory, datamodule, args.attack_clients, args.attack_batch, args.ig_iterations, args.seed)
            if panel != "all" or lr == 1e-3
            else None
        )
        row = {
            "panel": panel,
            "method": method,
            "strength": strength,
            "lr": lr,
            "train_loss": float(np.mean(losses)),
            "mse": scores["mse"] if scores else math.nan,
            "psnr": scores["psnr"] if scores else math.nan,
            "seconds": time.perf_counter() - start,
        }
        rows.append(row)
        print(
            f"{panel:8s} {method:18s} {strength:<6g} loss {row['train_loss']:.4f}  MSE {row['mse']:.4f}  PSNR {row['psnr']:.2f}  ({row['seconds']:.0f} s)",
            flush=True,
        )
    # the undefended point has no attack at the pruning lr: it shares the noise run's privacy
    rows[1]["mse"], rows[1]["psnr"] = rows[0]["mse"], rows[0]["psnr"]
    return rows


def interpolated_loss(points: list[dict], mse: float) -> float | None:
    """The loss a method reaches at reconstruction MSE ``mse`` (linear in log MSE), inside its range."""
    pts = sorted((math.log(p["mse"]), p["train_loss"]) for p in points)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if not xs[0] <= math.log(mse) <= xs[-1]:
        return None
    return float(np.interp(math.log(mse), xs, ys))


def verdicts(rows: list[dict]) -> list[str]:
    lines = []
    for panel, ours, theirs in (("noise", "optimal", "isotropic"), ("clipped", "clipped optimal", "clipped isotropic")):
        mine = [r for r in rows if r["panel"] == panel and r["method"] == ours]
        other = [r for r in rows if r["panel"] == panel and r["method"] == theirs]
        for r in mine:
            matched = interpolated_loss(other, r["mse"])
            if matched is None:
                lines.append(
                    f"{panel}: {ours} at scale {r['strength']:g} (MSE {r['mse']:.4f}) is outside {theirs}'s MSE range"
                )
            else:
                verdict = "lower" if r["train_loss"] < matched else "NOT lower"
                lines.append(
                    f"{panel}: {ours} at scale {r['strength']:g}: MSE {r['mse']:.4f}, loss {r['train_loss']:.4f}; {theirs} at the "
                    f"same MSE: loss {matched:.4f} -> {verdict}"
                )
    prune = {(r["method"], r["strength"]): r for r in rows if r["panel"] == "pruning"}
    if ("optimal", 0.8) in prune and ("magnitude", 0.9) in prune:
        o, m = prune[("optimal", 0.8)], prune[("magnitude", 0.9)]
        trains = o["train_loss"] <= m["train_loss"]
        hides = o["mse"] >= m["mse"]
        lines.append(
            f"pruning: optimal 80% loss {o['train_loss']:.4f} MSE {o['mse']:.4f} vs magnitude 90% loss {m['train_loss']:.4f} "
            f"MSE {m['mse']:.4f} -> trains at least as well: {trains}; MSE at least as high: {hides}"
        )
    return lines


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("noise", "Gaussian noise (equal power)"),
        ("clipped", "clipped noise (DP-SGD style)"),
        ("pruning", "pruning"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (panel, title) in zip(axes, panels):
        # the undefended run at the panel's learning rate (pruning trains at 5e-4)
        lr = next(r["lr"] for r in rows if r["panel"] == panel)
        undefended = next(r for r in rows if r["method"] == "undefended" and r["lr"] == lr)
        for method in dict.fromkeys(r["method"] for r in rows if r["panel"] == panel):
            pts = [r for r in rows if r["panel"] == panel and r["method"] == method]
            ax.plot([p["train_loss"] for p in pts], [p["mse"] for p in pts], marker="o", label=method)
            for p in pts:
                ax.annotate(
                    f"{p['strength']:g}",
                    (p["train_loss"], p["mse"]),
                    fontsize=7,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
        ax.scatter(
            [undefended["train_loss"]], [undefended["mse"]], marker="*", s=120, color="black", label="undefended"
        )
        ax.set(
            title=title,
            xlabel="training loss after the updates (lower = more useful)",
            ylabel="reconstruction MSE (higher = more private)",
        )
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle("ConvNet on Fashion-MNIST, 4 clients x 16 images; Inverting Gradients")
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "optimal_tradeoff.png", dpi=120)


def cost(repeats: int) -> list[dict]:
    torch.manual_seed(0)
    model = ConvNet()
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(callback: GradientDefense | None) -> None:
        optimizer.zero_grad()
        shared = defended(callback, model, x, y, 0, 0)
        for name, p in model.named_parameters():
            p.grad = shared[name]
        optimizer.step()

    undefended = median_seconds(lambda: step(None), repeats)
    rows = []
    for label, callback in (
        ("GaussianNoise", callbacks.GaussianNoise(scale=0.01, seed=0)),
        ("LaplaceNoise", callbacks.LaplaceNoise(scale=0.01, seed=0)),
        ("GradientQuantization 8 bit", callbacks.GradientQuantization(bits=8)),
        ("MagnitudePruning 90%", callbacks.MagnitudePruning(rate=0.9)),
        ("OptimalGradientNoise k=10", callbacks.OptimalGradientNoise(scale=0.01, seed=0, loss_fn=CE)),
        ("OptimalGradientPruning k=10", callbacks.OptimalGradientPruning(rate=0.8, seed=0, loss_fn=CE)),
        ("OptimalDPSGD k=10", callbacks.OptimalDPSGD(clip=0.01, scale=0.01, seed=0, loss_fn=CE)),
    ):
        seconds = median_seconds(lambda c=callback: step(c), repeats)
        rows.append(
            {
                "defense": label,
                "undefended_step_ms": 1e3 * undefended,
                "defended_step_ms": 1e3 * seconds,
                "ratio_to_step": seconds / undefended,
            }
        )
        print(f"cost {label}: {1e3 * seconds:.1f} ms vs {1e3 * undefended:.1f} ms undefended", flush=True)
    return rows


def estimator() -> list[dict]:
    """Median relative error of the k-probe estimate of s against the exact Jacobian (tiny LeakyReLU CNN)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.LeakyReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 3, 5, 9])
    loss = nn.functional.cross_entropy
    exact = gradient_sensitivity(model, loss, x, y, exact=True)
    rows = []
    for k in (1, 3, 10, 30, 100, 300):
        errors = []
        for seed in range(5):
            estimate = gradient_sensitivity(
                model, loss, x, y, probes=k, chunk_size=50, generator=torch.Generator().manual_seed(seed)
            )
            rel = torch.cat(
                [((estimate[n] - exact[n]).abs() / exact[n]).flatten() for n in exact if (exact[n] > 0).all()]
            )
            errors.append(rel.median().item())
        rows.append({"probes": k, "median_relative_error": float(np.mean(errors)), "worst_of_5_seeds": max(errors)})
        print(f"estimator k={k}: median relative error {rows[-1]['median_relative_error']:.3f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("tradeoff", "estimator", "cost", "plot"),
        default=("tradeoff", "estimator", "cost"),
        help="plot: redraw optimal_tradeoff.png from the CSV of an earlier run",
    )
    parser.add_argument("--steps", type=int, default=5, help="Adam updates of the utility runs (the paper's 5)")
    parser.add_argument("--seeds", type=int, default=2, help="utility runs per setting (noise draws), averaged")
    parser.add_argument(
        "--clip", type=float, default=0.01, help="per-coordinate clip P (about the 90th percentile of |g| here)"
    )
    parser.add_argument("--attack-clients", type=int, default=2)
    parser.add_argument("--attack-batch", type=int, default=2)
    parser.add_argument("--ig-iterations", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    L.seed_everything(args.seed, verbose=False)
    if "tradeoff" in args.parts:
        rows = tradeoff(args)
        lines = verdicts(rows)
        preamble = (
            f"ConvNet, Fashion-MNIST sample, {CLIENTS} clients x {PER_CLIENT} images, {args.steps} Adam updates, "
            f"{args.seeds} seeds; IG {args.ig_iterations} iterations on {args.attack_clients} clients x {args.attack_batch} "
            f"images; clip P = {args.clip:g}; k = 10 probes.\n\n" + "\n".join(f"- {line}" for line in lines)
        )
        write_results("optimal_tradeoff", rows, preamble)
        print("\n".join(lines))
        plot(rows)
    if "estimator" in args.parts:
        write_results(
            "optimal_estimator",
            estimator(),
            "Sensitivity s_i = ||d g_i / d x||^2 from k jvp probes vs the exact Jacobian (jacfwd): "
            "a Conv(1->4, 3x3) + LeakyReLU + Linear model, 4 images of 8x8, mean over 5 probe seeds of the per-coordinate median relative error.",
        )
    if "plot" in args.parts:
        with open(RESULTS_DIR / "optimal_tradeoff.csv") as handle:
            rows = [
                {k: v if k in ("panel", "method") else float(v) for k, v in r.items()} for r in csv.DictReader(handle)
            ]
        plot(rows)
    if "cost" in args.parts:
        write_results(
            "optimal_cost",
            cost(args.repeats),
            "Time of one defended step (incl. sensitivity) vs the undefended step, ConvNet, batch 16, CPU, median.",
        )


if __name__ == "__main__":
    main()
