"""What the prior-only control of GGL and ROG costs: their decoys searched side by side vs one by one.

GGL (:class:`lightning_gp.attacks.GenerativeGradientLeakage`) and ROG
(:class:`lightning_gp.attacks.ObfuscationRobustInversion`) are judged against their own guesses from
``--decoys`` public batches (31 in the audit: a 1-in-32 test), each the whole attack run end to end:
31 x 4 latent searches for GGL, 31 x 2 inversions for ROG, on top of the client's own restarts. On
the new-attackers matrix they took 50 to 85% of a row's time. The searches are independent, so they
now share one loop (:func:`lightning_gp.attacks.searches.adam_searches`), evaluated vmapped
(:func:`lightning_gp.attacks.batched.gradient_match_rows`).

For each attack and client batch size, the same decoys are searched both ways in one process, the
two modes taking turns ``--repeats`` times (the machine is shared: a ratio of times taken side by
side is what is compared); ``one_by_one`` forces the one-problem-at-a-time match (what the attacks ran
before). The generator and the restoration network are trained first and not timed. Columns:
``seconds`` (median over the repeats), ``speedup`` (one by one over side by side), ``max_guess_diff``
(the largest pixel difference between the two modes' guesses, normalised units: float32 kernels that
batch sum in another order).

    python benchmarks/prior_control_speed.py             # 31 decoys, batch 1 and 8, the audit's 1000-step cap
    python benchmarks/prior_control_speed.py --quick     # 4 decoys, 200 steps

Writes benchmarks/results/prior_control_speed[_quick].{csv,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import write_results
from attack_throughput import tapped_setting

from lightning_gp.attacks import (
    GenerativeGradientLeakage,
    GeneratorCache,
    ObfuscationRobustInversion,
    RestorationCache,
    ServerView,
    adaptive,
)
from lightning_gp.attacks.generative import attack as ggl_module
from lightning_gp.attacks.obfuscation_robust import attack as rog_module
from lightning_gp.audit.rounds import public_examples
from lightning_gp.data import FashionMNISTDataModule, FashionMNISTSampleDataModule


def guesses(attack: Any, module: Any, view: ServerView, one_by_one: bool) -> tuple[float, torch.Tensor]:
    """Seconds to make the attack's prior-only guesses from nothing (its memo cleared), and the guesses."""
    module._PRIOR_ONLY_MEMO.clear()
    original = adaptive.mappable
    if one_by_one:
        adaptive.mappable = lambda match, view: False
    try:
        start = time.perf_counter()
        made = attack.prior_only_guesses(view, 255)
        return time.perf_counter() - start, made
    finally:
        adaptive.mappable = original


def measure(name: str, build: Callable[[], Any], module: Any, view: ServerView, repeats: int) -> list[dict[str, Any]]:
    attack = build()
    attack.reconstruct(view)  # trains (and caches) the generator or the restoration network: not timed
    times: dict[bool, list[float]] = {False: [], True: []}
    made: dict[bool, torch.Tensor] = {}
    for _ in range(repeats):
        for one_by_one in (True, False):
            seconds, made[one_by_one] = guesses(attack, module, view, one_by_one)
            times[one_by_one].append(seconds)
            print(
                f"[{name} batch {view.batch_size}] {'one by one' if one_by_one else 'side by side'}: {seconds:.1f} s",
                flush=True,
            )
    reference = statistics.median(times[True])
    diff = float((made[True] - made[False]).abs().max())
    return [
        {
            "attack": name,
            "batch_size": view.batch_size,
            "decoys": int(made[one_by_one].shape[0]),
            "mode": "one_by_one" if one_by_one else "side_by_side",
            "seconds": statistics.median(times[one_by_one]),
            "speedup": reference / statistics.median(times[one_by_one]),
            "max_guess_diff": 0.0 if one_by_one else diff,
        }
        for one_by_one in (True, False)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 decoys, 200 steps, batch 1 only")
    parser.add_argument("--decoys", type=int, default=None, help="decoys per attack (default 31, the audit's)")
    parser.add_argument("--iterations", type=int, default=None, help="step cap of each search (default 1000)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="client batch sizes (default 1 8)")
    parser.add_argument("--repeats", type=int, default=1, help="turns of the two modes")
    parser.add_argument("--dataset", choices=("sample", "fashion-mnist"), default="sample")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    decoys = args.decoys or (4 if args.quick else 31)
    iterations = args.iterations or (200 if args.quick else 1000)
    batch_sizes = args.batch_sizes or ([1] if args.quick else [1, 8])
    datamodule = FashionMNISTSampleDataModule() if args.dataset == "sample" else FashionMNISTDataModule()
    public = public_examples(datamodule, 10_000)
    generators, restorations = GeneratorCache(), RestorationCache()
    rows: list[dict[str, Any]] = []
    for batch in batch_sizes:
        setting = tapped_setting(datamodule, 1, seed=0, indices=range(batch))
        view = dataclasses.replace(setting.views[0], public_data=public)
        rows += measure(
            "GGL",
            lambda: GenerativeGradientLeakage(iterations=iterations, decoys=decoys, cache=generators),
            ggl_module, view, args.repeats,
        )  # fmt: skip
        rows += measure(
            "ROG",
            lambda: ObfuscationRobustInversion(iterations=iterations, decoys=decoys, cache=restorations),
            rog_module, view, args.repeats,
        )  # fmt: skip
    preamble = (
        f"The prior-only guesses of GGL (published, 4 restarts) and ROG (2 restarts), {decoys} decoys, each search "
        f"capped at {iterations} Adam steps (stopping earlier on a plateau), LeNetZhu at initialisation, "
        f"{args.dataset} Fashion-MNIST, {args.threads} thread(s), CPU; the two modes taking turns {args.repeats} "
        "time(s) in one process (seconds: the median). one_by_one: each search alone, as before; side_by_side: all "
        "decoys' searches in one vmapped loop (lightning_gp.attacks.searches). max_guess_diff: the largest difference "
        "of the two modes' guesses (normalised pixels)."
    )
    write_results("prior_control_speed" + ("_quick" if args.quick else ""), rows, preamble)


if __name__ == "__main__":
    main()
