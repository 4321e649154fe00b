"""Attack throughput: Inverting Gradients on several clients at once (issue 15, part 3).

The same Fashion-MNIST images (a real FedSGD round of LeNetZhu, one image per client, tapped as
shared: the setting of ``attack_strength.py``'s IG row) are attacked with
``InvertingGradients.reconstruct_many``:

- ``sequential``: one client after another (``batched=False``, the reference path);
- ``batched``: every client's problem in one vmapped optimisation (``lightning_gp.attacks.batched``);
- ``sequential_1xN`` (not with ``--quick``): the same N images as ONE client's batch of N, one
  optimisation (a harder problem: one gradient mixes all images), for comparison;
- ``*_no_onednn`` (not with ``--quick``): both paths with PyTorch's oneDNN convolutions switched
  off (``torch.backends.mkldnn.flags(enabled=False)``). At batch 1 oneDNN's per-call overhead is
  a large share of an IG iteration; the native kernels round differently, so the library keeps
  the default backend (the sequential path's results stay bit for bit what they were).

Columns: ``ms_per_iteration`` is the time of one iteration of one client's attack: the median
time of one optimiser step, from short runs of every mode taking turns (so that all modes see
the same background load on a shared machine), divided by the clients the step serves (all of
them when batched); ``iterations_per_s`` its inverse (client-iterations per second); ``seconds``
the wall time of the full run (load-dependent); ``speedup`` the sequential row's time for one
iteration over all images divided by this row's; ``time_to_25db_s`` the first iteration at which
the mean PSNR over the images reaches 25 dB times the time of one iteration of all clients
(``inf``: not within the budget); ``max_image_diff`` and ``mean_abs_psnr_diff`` compare the
reconstructions with the sequential ones. In float64 the batched path repeats every client's
trajectory (tests/test_attack_batching.py); in float32 rounding in the batched kernels flips the
sign of a near-zero gradient entry after ~100 steps, after which the trajectories part (the
images then differ, the quality statistically does not).

Writes benchmarks/results/attack_throughput.{csv,md}.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from _common import write_results
from torch import Tensor

from lightning_gp.attacks import InvertingGradients, ServerView
from lightning_gp.audit import tap_fedsgd_round
from lightning_gp.metrics import match_reconstructions, psnr
from lightning_gp.models import LeNetZhu

TARGET_DB = 25.0


@dataclass
class Setting:
    """The clients' views and the images behind them (``originals[i]`` is client ``i``'s batch)."""

    views: list[ServerView]
    originals: list[Tensor]


def tapped_setting(datamodule, clients: int, seed: int, indices: Sequence[int] | None = None) -> Setting:
    """One FedSGD round of LeNetZhu: ``clients`` clients with one image each, or, with ``indices``,
    one client whose batch is exactly those training images."""
    L.seed_everything(seed, verbose=False)  # the model's initialisation is part of the setting
    chosen = None if indices is None else [list(indices)]
    records, model, _ = tap_fedsgd_round(
        LeNetZhu(),
        datamodule,
        clients=list(range(clients)) if indices is None else [0],
        num_clients=max(10, clients),
        local_batch_size=1 if indices is None else len(indices),
        indices=chosen,
        seed=seed,
    )
    views = [
        ServerView.from_tap(r, copy.deepcopy(model), num_classes=10, mean=datamodule.mean, std=datamodule.std)
        for r in records
    ]
    return Setting(views, [r.inputs for r in records if r.inputs is not None])


def mean_psnr(images: Sequence[Tensor], setting: Setting) -> float:
    """Mean PSNR over every image of every client, reconstructions matched to originals by MSE."""
    values = []
    for found, original, view in zip(images, setting.originals, setting.views):
        found_px, original_px = view.denormalize(found), view.denormalize(original)
        order = match_reconstructions(found_px, original_px)
        values += psnr(found_px[order], original_px).tolist()
    return sum(values) / len(values)


@dataclass
class Run:
    """One attack of every view: wall time, the duration of every optimiser step, the
    reconstructions and the mean PSNR along the run (every 1% of the budget)."""

    seconds: float
    steps: list[float]
    images: list[Tensor]
    curve: list[tuple[int, float]]


@dataclass
class Mode:
    """How to attack a setting: one view after another or batched, with or without oneDNN convolutions."""

    name: str
    setting: Setting
    batched: bool
    onednn: bool = True


def run(mode: Mode, iterations: int, watch: bool = True) -> Run:
    """Attack every view with :meth:`InvertingGradients.reconstruct_many`, timing every step and,
    with ``watch``, keeping the images every 1% of the budget."""
    setting, batched = mode.setting, mode.batched
    every = max(1, iterations // 100)
    clients = len(setting.views)
    snapshots: dict[int, list[Tensor | None]] = {}
    current = [-1]  # on the sequential path, the view now attacked (a new run starts at iteration 0)
    stamps: list[list[float]] = []

    def observe(iteration: int, images: Tensor) -> None:
        if iteration == 0:
            stamps.append([])
            current[0] += 0 if batched else 1
        stamps[-1].append(time.perf_counter())
        if watch and ((iteration + 1) % every == 0 or iteration == iterations - 1):
            row = snapshots.setdefault(iteration + 1, [None] * clients)
            if batched:
                row[:] = list(images.clone())
            else:
                row[current[0]] = images[0].clone()

    attack = InvertingGradients(iterations=iterations, observer=observe)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*TF32.*")  # torch's note on Intel GPUs, printed per toggle
        with torch.backends.mkldnn.flags(enabled=mode.onednn):
            start = time.perf_counter()
            results = attack.reconstruct_many(setting.views, batched=batched)
            seconds = time.perf_counter() - start
    steps = [b - a for times in stamps for a, b in itertools.pairwise(times)]
    curve = [
        (done, mean_psnr([x for x in row if x is not None], setting))
        for done, row in sorted(snapshots.items())
        if all(x is not None for x in row)
    ]
    return Run(seconds, steps, [r.images for r in results], curve)


def time_to(curve: Sequence[tuple[int, float]], seconds_per_iteration: float, target: float = TARGET_DB) -> float:
    """Time until the mean PSNR first reaches ``target`` (``inf`` if it never does)."""
    return next((done * seconds_per_iteration for done, value in curve if value >= target), math.inf)


def interleaved_step_seconds(modes: Sequence[Mode], iterations: int, repeats: int) -> dict[str, float]:
    """Median optimiser-step time of each mode, from ``repeats`` rounds of short runs taking turns
    (the modes see the same background load on a shared machine)."""
    steps: dict[str, list[float]] = {mode.name: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:
            steps[mode.name] += run(mode, iterations, watch=False).steps
    return {mode: statistics.median(values) for mode, values in steps.items()}


def measure(
    iterations: int = 2500,
    clients: int = 8,
    threads: int = 1,
    quick: bool = False,
    *,
    dataset: str = "sample",
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Sequential vs batched Inverting Gradients on ``clients`` one-image clients (LeNetZhu), in one
    process with ``threads`` intra-op threads; ``quick`` skips the one-client-batch row and times
    fewer rounds.

    ``dataset``: ``"sample"`` (the built-in Fashion-MNIST sample) or ``"fashion-mnist"`` (the
    full set, when installed). Rows as described in the module docstring.
    """
    from lightning_gp.data import FashionMNISTDataModule, FashionMNISTSampleDataModule

    if dataset not in ("sample", "fashion-mnist"):
        raise ValueError(f"dataset must be 'sample' or 'fashion-mnist', got {dataset!r}")
    datamodule = FashionMNISTSampleDataModule() if dataset == "sample" else FashionMNISTDataModule()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        setting = tapped_setting(datamodule, clients, seed)
        modes = [Mode("sequential", setting, False), Mode("batched", setting, True)]
        if not quick:
            indices = [i for view in setting.views for i in view.meta["dataset_indices"]]
            one = tapped_setting(datamodule, 1, seed, indices=indices)
            modes.append(Mode(f"sequential_1x{len(indices)}", one, False))
            # where the time goes at batch 1: oneDNN's per-call overhead (a different rounding, so not the default)
            modes += [
                Mode("sequential_no_onednn", setting, False, False),
                Mode("batched_no_onednn", setting, True, False),
            ]
        for mode in modes:  # warm-up: the first vmapped call traces the model's operators
            run(mode, 3, watch=False)
        step = interleaved_step_seconds(modes, min(iterations, 100), 3 if quick else 7)
        rows: list[dict[str, Any]] = []
        runs: dict[str, Run] = {}
        for mode in modes:
            runs[mode.name] = result = run(mode, iterations)
            clients_here = len(mode.setting.views)
            per_client = step[mode.name] / (clients_here if mode.batched else 1)  # a batched step serves all
            rows.append(
                {
                    "mode": mode.name,
                    "clients": clients_here,
                    "images_per_client": mode.setting.views[0].batch_size,
                    "iterations": iterations,
                    "ms_per_iteration": 1e3 * per_client,
                    "iterations_per_s": 1 / per_client,
                    "seconds": result.seconds,
                    "mean_psnr": mean_psnr(result.images, mode.setting),
                    "time_to_25db_s": time_to(result.curve, per_client * clients_here),
                }
            )
        reference = rows[0]["ms_per_iteration"] * rows[0]["clients"]  # one iteration over all the images
        for row in rows:
            row["speedup"] = reference / (row["ms_per_iteration"] * row["clients"])
            same_clients = not row["mode"].startswith("sequential_1x")
            result = runs[row["mode"]]
            row["max_image_diff"] = (
                max(float((a - b).abs().max()) for a, b in zip(result.images, runs["sequential"].images))
                if same_clients
                else math.nan
            )
            row["mean_abs_psnr_diff"] = (
                _mean_abs_psnr_diff(result.images, runs["sequential"].images, setting) if same_clients else math.nan
            )
            log(
                f"{row['mode']}: {row['ms_per_iteration']:.2f} ms/iteration, {row['mean_psnr']:.1f} dB, "
                f"25 dB after {row['time_to_25db_s']:.1f} s, speedup {row['speedup']:.2f}x"
            )
        return rows
    finally:
        torch.set_num_threads(previous_threads)


def _mean_abs_psnr_diff(images: Sequence[Tensor], reference: Sequence[Tensor], setting: Setting) -> float:
    """Mean over images of |PSNR(images) - PSNR(reference)|: how far two runs' per-image quality lies apart."""
    diffs = [
        abs(mean_psnr([a], Setting([view], [original])) - mean_psnr([b], Setting([view], [original])))
        for a, b, view, original in zip(images, reference, setting.views, setting.originals)
    ]
    return sum(diffs) / len(diffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI size: 200 iterations, no one-client-batch row")
    parser.add_argument("--iterations", type=int, default=None, help="Adam steps per client (default 2500)")
    parser.add_argument("--clients", type=int, default=8, help="clients attacked together, one image each")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--dataset", choices=("sample", "fashion-mnist"), default="sample")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    iterations = args.iterations or (200 if args.quick else 2500)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {iterations} iterations", flush=True)
    rows = measure(iterations, args.clients, args.threads, args.quick, dataset=args.dataset, seed=args.seed)
    write_results(
        "attack_throughput",
        rows,
        f"InvertingGradients (signed Adam, lr 0.1, TV 1e-4, box) on LeNetZhu, {args.dataset} Fashion-MNIST, "
        f"FedSGD round 0, {args.clients} clients x 1 image, {iterations} iterations, CPU, {args.threads} "
        f"thread(s), seed {args.seed}; measured in one run. ms_per_iteration: median optimiser step (short runs of "
        "the modes taking turns) / clients it serves; time_to_25db_s: iterations until the mean PSNR reaches 25 dB x the time of one iteration of all "
        "clients; max_image_diff, mean_abs_psnr_diff: against the sequential reconstructions (float32: the "
        "trajectories part after a rounding-level sign flip, see the script's docstring).",
    )


if __name__ == "__main__":
    main()
