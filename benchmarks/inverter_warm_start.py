"""The learned inverter fine-tuned across strengths instead of trained from scratch (issue 48, a lever
measured and not adopted).

Issue 48 names the lever: train the inverter once per defense family and fine-tune it across the
strengths. This trains, per pair ``WEAKER:STRONGER`` of one family (LeNetZhu at initialisation, full
Fashion-MNIST's public split of 10,000 images, the audit's ``InverterConfig``, one torch thread), the
weaker strength's inverter from scratch, then the stronger one's twice: from scratch, and started from
the weaker one's network (its weights; the feature normalisation is fitted again, as every training
fits it). Each training stops on convergence (no better validation loss for ``patience`` epochs) and
keeps its best epoch. A row per training: epochs, best validation MSE (pixels; lower is a stronger
attacker), CPU seconds and the server's simulation of the clients inside them.

    python benchmarks/inverter_warm_start.py --pairs 'TopKPruning(rate=0.8):TopKPruning(rate=0.9)' \
        'LocalGaussianMechanism(noise_multiplier=0.3):LocalGaussianMechanism(noise_multiplier=0.5)' \
        --batch-sizes 1 8

Writes benchmarks/results/inverter_warm_start.{csv,md}.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any
from unittest import mock

import torch
from _common import fashion_mnist_datasets, setting_builder, write_results
from network_adam import _view

import lightning_gp.attacks.learned as learned_module
from lightning_gp.attacks import InverterCache
from lightning_gp.attacks.learned import TrainedInverter
from lightning_gp.audit import learned_inversion_attacks


def _train(spec: str, datamodule: Any, batch_size: int, seed: int, start: dict | None = None) -> TrainedInverter:
    """``spec``'s inverter at ``batch_size``, from scratch or (``start``) from that network state."""
    setting = setting_builder(spec, "--pairs")(seed)
    view = _view(setting, datamodule, batch_size, seed)
    inverter = learned_inversion_attacks(setting, datamodule, cache=InverterCache(), seed=seed)[0]
    if start is None:
        return inverter.train(view)
    scratch = learned_module.InverterNetwork

    def warm(*args: Any, **kwargs: Any) -> learned_module.InverterNetwork:
        network = scratch(*args, **kwargs)
        network.load_state_dict(start)  # train() then fits the feature mean and std to its own pairs
        return network

    with mock.patch.object(learned_module, "InverterNetwork", warm):
        return inverter.train(view)


def _row(pair: str, batch_size: int, start: str, spec: str, trained: TrainedInverter) -> dict:
    cost = trained.cost
    return {
        "pair": pair, "batch": batch_size, "trained": spec, "start": start, "epochs": cost.epochs,
        "validation_mse": round(cost.validation_mse, 5), "cpu_s": round(cost.cpu_seconds, 1),
        "simulation_s": round(cost.simulation_seconds, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=["LocalGaussianMechanism(noise_multiplier=0.3):LocalGaussianMechanism(noise_multiplier=0.5)"],
        help="WEAKER:STRONGER settings of one family",
    )
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="inverter_warm_start")
    args = parser.parse_args()
    pairs = [p.split(":") for p in args.pairs]
    if any(len(p) != 2 for p in pairs):
        sys.exit("--pairs: give each pair as WEAKER:STRONGER, e.g. 'TopKPruning(rate=0.8):TopKPruning(rate=0.9)'")
    torch.set_num_threads(1)
    datamodule = fashion_mnist_datasets(full=True).get("fashion-mnist")
    if datamodule is None:
        sys.exit("full Fashion-MNIST is needed: apt-get install -y dataset-fashion-mnist")
    datamodule.setup("fit")
    preamble = (
        "The learned inverter of the stronger setting of each pair trained from scratch and fine-tuned from "
        "the weaker setting's inverter (its network's weights), LeNetZhu at initialisation, the public split of "
        "full Fashion-MNIST, the audit's InverterConfig, one torch thread, CPU seconds (simulation_s: the "
        "server's simulation of the clients inside them). validation_mse: the best epoch's, in pixels (lower: "
        "a stronger attacker).\n\n"
        f"Run: `python benchmarks/inverter_warm_start.py --pairs {' '.join(repr(p) for p in args.pairs)} "
        f"--batch-sizes {' '.join(map(str, args.batch_sizes))}`"
    )
    rows: list[dict] = []
    for (weaker, stronger), pair in zip(pairs, args.pairs, strict=True):
        for batch_size in args.batch_sizes:
            base = _train(weaker, datamodule, batch_size, args.seed)
            rows.append(_row(pair, batch_size, "scratch", weaker, base))
            rows.append(
                _row(pair, batch_size, "scratch", stronger, _train(stronger, datamodule, batch_size, args.seed))
            )
            warm = _train(stronger, datamodule, batch_size, args.seed, start=base.network.state_dict())
            rows.append(_row(pair, batch_size, f"from {weaker}", stronger, warm))
            for row in rows[-3:]:
                print(row, flush=True)
            write_results(args.name, rows, preamble)


if __name__ == "__main__":
    main()
