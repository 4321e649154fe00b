"""Accuracy of FedSGD or FedAvg when thousands of clients a round each defend their own update.

Issue 28 allows averaging over many clients per round as a lever: a client's own noise shrinks by
sqrt(clients) in the mean the server applies. For each defense, client batch size and number of
clients per round, LeNetZhu trains ``--rounds`` rounds (:func:`lightning_gp.federated.train_many_clients`:
the clients, batches, per-client defense streams, local training and server optimizer of
``FederatedSimulation`` / ``train_setting``, every client in every round by default) and is tested;
PMM is its test accuracy over the undefended run's with the SAME algorithm, clients per round, batch
size and rounds. The wall time per round of each run is reported beside it.

    python benchmarks/many_clients.py --defenses "GaussianNoise(scale=0.01)" \\
        --clients-per-round 10 100 1000 10000 --batch-sizes 1 8 --rounds 100

``--algorithm fedavg --local-epochs 5``: each client draws one batch of ``--batch-sizes`` images a
round, takes 5 local SGD steps on it (5 epochs) at the setting's local rate (``DefenseSetting.local_lr``,
0.1 unless the catalogue entry says otherwise) and shares ``w_global - w_local`` through its defense:
the FedAvg client the audit attacks (``defense_that_holds.py --local-steps 5``). ``--local-steps 5``
instead draws 5 batches and steps once on each, as ``train_setting`` trains a FedAvg setting.

A defense is a catalogue name (``GaussianNoise``: its catalogue setting) or a pure defense of
``lightning_gp.defenses`` with literal arguments (``"GaussianNoise(scale=0.05)"``,
``"LaplaceNoise(scale=0.1)"``); its ``seed`` defaults to ``--seed``. Data: full Fashion-MNIST when
installed, else the built-in sample (``--sample`` forces it); ``--dataset photo-crops``: RGB 3x32x32 crops
of photographs (``PhotoCropsDataModule``, 11 classes, as many training crops as the largest round needs),
LeNetZhu sized to them.

Writes benchmarks/results/<name>.{csv,md,png} (``--name``, default ``many_clients``).
"""

from __future__ import annotations

import argparse
import inspect
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, parse_call, write_results

from lightning_gp import defenses as pure_defenses
from lightning_gp.audit import DefenseSetting, defense_catalog
from lightning_gp.data import PhotoCropsDataModule
from lightning_gp.data.photo_crops import PHOTO_CLASSES
from lightning_gp.defenses import Defense
from lightning_gp.federated import ManyClientsRound, ManyClientsRun, accuracy_on_test_split, train_many_clients
from lightning_gp.models import LeNetZhu

#: The server optimizer every FedSGD setting trains with unless its catalogue entry says otherwise.
DEFAULT_SERVER = DefenseSetting("undefended")


def parse_defense(spec: str, seed: int, channels: int) -> tuple[str, Callable[[], Defense], DefenseSetting]:
    """``(label, build, setting)`` for a catalogue name or a ``Name(arg=literal, ...)`` spec of a pure
    defense; ``build()`` gives a fresh defense object for one run, ``setting`` its server optimizer."""
    if "(" not in spec:
        setting = defense_catalog([spec])[0].build(seed, channels)
        special = setting.wrap is not None or setting.architecture is not None or setting.runner != "simulation"
        if special or setting.algorithm != "fedsgd" or len(setting.callbacks) != 1:
            raise ValueError(
                f"--defenses {spec}: its catalogue setting {setting.name} is not one gradient defense of FedSGD "
                "clients (a wrapped model, DP-SGD's own runner or a composition); name a pure defense instead"
            )
        return setting.name, lambda: defense_catalog([spec])[0].build(seed, channels).callbacks[0].defense, setting
    name, kwargs = parse_call(spec, "--defenses", "Name(keyword=literal, ...) or a catalogue name")
    cls = getattr(pure_defenses, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, Defense)):
        raise ValueError(f"--defenses {spec!r}: {name} is not a defense of lightning_gp.defenses")
    kwargs.setdefault("seed", seed)
    cls(**kwargs)  # the defense checks its own arguments now, before any training
    return spec, lambda: cls(**kwargs), DEFAULT_SERVER


def train_once(
    datamodule: Any,
    defense: Defense | None,
    setting: DefenseSetting,
    clients: int,
    batch: int,
    args: argparse.Namespace,
) -> tuple[float, ManyClientsRun]:
    """Test accuracy of LeNetZhu (initialised from ``--seed``) after ``--rounds`` rounds, and the run."""
    label = "undefended" if defense is None else repr(defense)

    def progress(report: ManyClientsRound) -> None:
        if (report.round + 1) % args.progress_every == 0 or report.round + 1 == args.rounds:
            print(
                f"  [{label} b={batch} C={clients}] round {report.round + 1}/{args.rounds} "
                f"loss {report.loss:.3f} {report.seconds:.3f} s/round",
                flush=True,
            )

    torch.manual_seed(args.seed)
    channels, size, _ = datamodule.image_shape
    model = LeNetZhu(num_classes=datamodule.num_classes, in_channels=channels, image_size=size)
    run = train_many_clients(
        model,
        datamodule,
        defense=defense,
        clients_per_round=clients,
        num_clients=args.num_clients,
        client_batch_size=batch,
        rounds=args.rounds,
        algorithm=args.algorithm,
        local_steps=args.local_steps,
        local_epochs=args.local_epochs,
        local_lr=setting.local_lr,
        server_optimizer=setting.server_optimizer,
        server_lr=setting.server_lr,
        seed=args.seed,
        chunk_size=args.chunk_size,
        progress=progress,
    )
    return accuracy_on_test_split(model, datamodule), run


def measure(datamodule: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (defense, batch size, clients per round), each beside its undefended run."""
    channels = datamodule.image_shape[0]
    parsed = [parse_defense(spec, args.seed, channels) for spec in args.defenses if spec != "undefended"]
    rows = []
    for batch in args.batch_sizes:
        for clients in args.clients_per_round:
            base_acc, base = train_once(datamodule, None, DEFAULT_SERVER, clients, batch, args)
            rows.append(_row("undefended", batch, clients, base_acc, base_acc, base, base, args))
            for label, build, setting in parsed:
                acc, run = train_once(datamodule, build(), setting, clients, batch, args)
                rows.append(_row(label, batch, clients, acc, base_acc, run, base, args))
                print(f"{label} b={batch} C={clients}: acc {acc:.4f} PMM {acc / base_acc:.3f}", flush=True)
    return rows


def _row(
    label: str,
    batch: int,
    clients: int,
    acc: float,
    base_acc: float,
    run: ManyClientsRun,
    base: ManyClientsRun,
    args: argparse.Namespace,
) -> dict[str, Any]:
    return {
        "defense": label,
        "algorithm": args.algorithm,
        "local_steps": args.local_steps,
        "local_epochs": args.local_epochs,
        "batch_size": batch,
        "clients_per_round": clients,
        "num_clients": args.num_clients or clients,
        "rounds": args.rounds,
        "test_acc": round(acc, 4),
        "undefended_acc": round(base_acc, 4),
        "PMM": round(acc / base_acc, 4),
        "s_per_round": round(run.seconds_per_round, 4),
        "undefended_s_per_round": round(base.seconds_per_round, 4),
    }


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """PMM against clients per round (log scale), one line per defense and batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = sorted({(r["defense"], r["batch_size"]) for r in rows if r["defense"] != "undefended"})
    for defense, batch in lines:
        points = sorted(
            (r["clients_per_round"], r["PMM"]) for r in rows if (r["defense"], r["batch_size"]) == (defense, batch)
        )
        ax.plot(*zip(*points), marker="o", label=f"{defense}, batch {batch}")
    ax.axhline(0.97, color="grey", linestyle="--", linewidth=1, label="PMM 0.97 (issue 28)")
    ax.set_xscale("log")
    ax.set_xlabel("clients per round (each defends its own gradient)")
    ax.set_ylabel("PMM (accuracy / undefended at the same C, B, rounds)", fontsize=9)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--defenses", nargs="+", default=["GaussianNoise"], help="catalogue names or Name(k=v) specs")
    parser.add_argument("--clients-per-round", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--algorithm", choices=("fedsgd", "fedavg"), default="fedsgd")
    parser.add_argument("--local-steps", type=int, default=1, help="FedAvg's local batches a round")
    parser.add_argument("--local-epochs", type=int, default=1, help="FedAvg's passes over its local batches")
    parser.add_argument("--num-clients", type=int, default=None, help="clients in all (default: every one each round)")
    parser.add_argument("--chunk-size", type=int, default=1000, help="clients differentiated at once")
    parser.add_argument("--progress-every", type=int, default=10, help="rounds between progress lines")
    parser.add_argument("--sample", action="store_true", help="the built-in sample, not the full Fashion-MNIST")
    parser.add_argument(
        "--dataset",
        choices=("fashion-mnist", "photo-crops"),
        default="fashion-mnist",
        help="photo-crops: RGB 3x32x32 crops of photographs (PhotoCropsDataModule), enough training crops per "
        "class for the largest round (clients per round x batch size)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--name", default="many_clients", help="output file stem")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    for option in ("local_steps", "local_epochs"):
        flag = "--" + option.replace("_", "-")
        if getattr(args, option) < 1:
            parser.error(f"{flag} must be at least 1, got {getattr(args, option)}")
        if args.algorithm == "fedsgd" and getattr(args, option) != 1:
            parser.error(f"{flag} > 1 needs --algorithm fedavg (a FedSGD client shares one gradient)")
    torch.set_num_threads(args.threads)
    if args.dataset == "photo-crops":
        per_class = math.ceil(max(args.clients_per_round) * max(args.batch_sizes) / len(PHOTO_CLASSES))
        datasets, data_name = (
            {"photo-crops": PhotoCropsDataModule(per_class_train=per_class, seed=args.seed)},
            "photo-crops",
        )
    else:
        datasets = fashion_mnist_datasets(full=not args.sample)
        data_name = "fashion-mnist" if "fashion-mnist" in datasets else "sample"
    start = time.perf_counter()
    rows = measure(datasets[data_name], args)
    minutes = (time.perf_counter() - start) / 60
    clients = "every client in every round" if args.num_clients is None else f"of {args.num_clients} clients"
    algorithm = (
        "FedSGD"
        if args.algorithm == "fedsgd"
        else f"FedAvg ({args.local_epochs} epoch(s) over {args.local_steps} local batch(es) a round)"
    )
    preamble = (
        f"{algorithm} on {data_name}, LeNetZhu sized to the data (initialised from seed {args.seed}), {args.rounds} rounds, {clients}, "
        "each client defending its own update before the server averages (train_many_clients: the clients, "
        "batches, defense streams, local training and server optimizer of FederatedSimulation / train_setting). PMM: "
        "test accuracy over the undefended run's with the same algorithm, clients per round, batch size and rounds. "
        "s_per_round: wall time "
        f"of a round ({args.threads} torch thread(s), CPU; separate runs, so the ratio is only indicative). "
        f"Total {minutes:.1f} min.\n\n    python benchmarks/many_clients.py --defenses {' '.join(map(repr, args.defenses))} "
        f"--clients-per-round {' '.join(map(str, args.clients_per_round))} "
        f"--batch-sizes {' '.join(map(str, args.batch_sizes))} --rounds {args.rounds}"
        + (
            f" --algorithm fedavg --local-steps {args.local_steps} --local-epochs {args.local_epochs}"
            if args.algorithm == "fedavg"
            else ""
        )
        + (" --dataset photo-crops" if args.dataset == "photo-crops" else "")
    )
    write_results(args.name, rows, preamble, args.output_dir)
    plot(rows, args.output_dir / f"{args.name}.png", f"{algorithm} on {data_name}, {args.rounds} rounds, LeNetZhu")


if __name__ == "__main__":
    main()
