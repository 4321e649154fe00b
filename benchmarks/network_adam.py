"""The learned inverter's training with torch's default Adam against the fused one (issue 48).

``lightning_gp.optim.fused_adam`` trains the networks a server fits on public data (the learned
inverter, the generative prior's GAN, ROG's restoration network) with torch's fused Adam kernel. This
measures what that buys where the frontier pays it: the learned inverter of a frontier point
(LeNetZhu at initialisation, full Fashion-MNIST's public split of 10,000 images, the audit's
``InverterConfig``), trained from scratch with each optimiser in turn (default, fused, default, ...),
one torch thread, CPU seconds. A row per training: the whole training, the server's simulation of the
clients inside it, the fit (the rest: the epochs), the epochs run and the best validation MSE; the
summary rows give each setting's median ratio, default over fused, of the fit per epoch and of the whole
training, from the same run.

    python benchmarks/network_adam.py --settings 'LocalGaussianMechanism(noise_multiplier=0.5)' \
        'TopKPruning(rate=0.9)' --batch-sizes 1 8 --repeats 2

Writes benchmarks/results/network_adam.{csv,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from unittest import mock

import torch
from _common import fashion_mnist_datasets, setting_builder, torch_default_adam, write_results

import lightning_gp.attacks.learned as learned_module
from lightning_gp.attacks import InverterCache, ServerView
from lightning_gp.audit import learned_inversion_attacks, tap_defended_round
from lightning_gp.models import LeNetZhu


def _view(setting, datamodule, batch_size: int, seed: int) -> ServerView:
    torch.manual_seed(seed)
    model = LeNetZhu()
    records, sent, _ = tap_defended_round(
        setting, model, datamodule, indices=[list(range(batch_size))], num_clients=1, seed=seed
    )
    return ServerView.from_tap(
        records[0], sent, num_classes=datamodule.num_classes, mean=tuple(datamodule.mean), std=tuple(datamodule.std)
    )


def _train(setting, datamodule, view: ServerView, optimiser: str, seed: int) -> dict:
    inverter = learned_inversion_attacks(setting, datamodule, cache=InverterCache(), seed=seed)[0]
    if optimiser == "default":
        with mock.patch.object(learned_module, "fused_adam", torch_default_adam):
            cost = inverter.train(view).cost
    else:
        cost = inverter.train(view).cost
    return {
        "cpu_s": round(cost.cpu_seconds, 2),
        "simulation_s": round(cost.simulation_seconds, 2),
        "fit_cpu_s": round(cost.cpu_seconds - cost.simulation_seconds, 2),
        "epochs": cost.epochs,
        "fit_s_per_epoch": round((cost.cpu_seconds - cost.simulation_seconds) / cost.epochs, 3),
        "validation_mse": round(cost.validation_mse, 5),
        "samples": cost.samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["LocalGaussianMechanism(noise_multiplier=0.5)"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2, help="trainings per optimiser, interleaved")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="network_adam")
    args = parser.parse_args()
    if args.repeats < 1:
        sys.exit("--repeats must be >= 1")
    torch.set_num_threads(args.threads)
    datamodule = fashion_mnist_datasets(full=True).get("fashion-mnist")
    if datamodule is None:
        sys.exit("full Fashion-MNIST is needed: apt-get install -y dataset-fashion-mnist")
    datamodule.setup("fit")
    rows: list[dict] = []
    preamble = (
        f"The learned inverter of a frontier point trained from scratch with torch's default Adam and with "
        f"`lightning_gp.optim.fused_adam`, in turn ({args.repeats} each), {args.threads} torch thread(s), CPU "
        "seconds; fit = the whole training less the server's simulation of the clients (the epochs; they stop on "
        "convergence, so their count can differ with the rounding). Summary rows: the median default/fused "
        "ratio of the fit per epoch and of the whole training (cpu_s column).\n\n"
        f"Run: `python benchmarks/network_adam.py --settings {' '.join(repr(s) for s in args.settings)} "
        f"--batch-sizes {' '.join(map(str, args.batch_sizes))} --repeats {args.repeats}`"
    )
    for spec in args.settings:
        setting = setting_builder(spec, "--settings")(args.seed)
        for batch_size in args.batch_sizes:
            view = _view(setting, datamodule, batch_size, args.seed)
            measured: dict[str, list[dict]] = {"default": [], "fused": []}
            for repeat in range(args.repeats):
                for optimiser in ("default", "fused"):
                    row = _train(setting, datamodule, view, optimiser, args.seed)
                    measured[optimiser].append(row)
                    rows.append({"setting": spec, "batch": batch_size, "optimiser": optimiser, "repeat": repeat, **row})
                    print(rows[-1], flush=True)
            for part in ("fit_s_per_epoch", "cpu_s"):
                ratio = statistics.median(
                    d[part] / f[part] for d, f in zip(measured["default"], measured["fused"], strict=True)
                )
                rows.append(
                    {"setting": spec, "batch": batch_size, "optimiser": f"default/fused ({part})", "repeat": "-",
                     "cpu_s": round(ratio, 2), "simulation_s": "", "fit_cpu_s": "", "epochs": "",
                     "fit_s_per_epoch": "", "validation_mse": "", "samples": ""}
                )  # fmt: skip
            write_results(args.name, rows, preamble)


if __name__ == "__main__":
    main()
