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
    python benchmarks/prior_control_speed.py --attacks GGL --aggregate 16 --batch-sizes 1

``--aggregate K`` attacks the secure aggregate of ``K`` clients of the shipped
:class:`~lightning_gp.defenses.LocalGaussianMechanism`, each clipping its own upload, with GGL knowing
the defense (``DefenseKnowledge.over_clients(K)``: each guess the mean of its clients' chunks through
the clip), the secure-aggregation view of the matrix and the audit.

Writes benchmarks/results/prior_control_speed[_<attacks>][_aggregate<K>][_quick].{csv,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from _common import write_results
from attack_throughput import tapped_setting

from lightning_gp.attacks import (
    GenerativeGradientLeakage,
    GeneratorCache,
    InverterCache,
    InvertingGradients,
    ObfuscationRobustInversion,
    RefinedLearnedInversion,
    RestorationCache,
    ServerView,
    adaptive,
    defense_knowledge,
    parameter_gradients,
)
from lightning_gp.attacks.generative import attack as ggl_module
from lightning_gp.attacks.obfuscation_robust import attack as rog_module
from lightning_gp.audit import DefenseSetting, learned_inversion_attacks
from lightning_gp.audit.rounds import public_examples
from lightning_gp.data import FashionMNISTDataModule, FashionMNISTSampleDataModule
from lightning_gp.defenses import LocalGaussianMechanism

#: The attacks with a prior-only control of decoys attacked end to end.
ATTACKS = ("GGL", "ROG", "RefinedLearnedInversion")

#: Each attack's trained networks (the generator, the restoration network, the inverter), trained once
#: per process: an attack is built again for each view, its training is not
CACHES: dict[str, Any] = {
    "GGL": GeneratorCache(),
    "ROG": RestorationCache(),
    "RefinedLearnedInversion": InverterCache(),
}


@contextmanager
def one_at_a_time(one_by_one: bool) -> Iterator[None]:
    """With ``one_by_one``, every match and refinement objective refuses to stack (what the attacks ran
    before: each search alone)."""
    if not one_by_one:
        yield
        return
    saved_mappable, saved_stacked = adaptive.mappable, InvertingGradients.stacked_objective
    adaptive.mappable = lambda match, view: False
    InvertingGradients.stacked_objective = lambda self, views, labels: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        adaptive.mappable, InvertingGradients.stacked_objective = saved_mappable, saved_stacked  # type: ignore[method-assign]


def guesses(attack: Any, forget: Callable[[], None], view: ServerView, one_by_one: bool) -> tuple[float, torch.Tensor]:
    """Seconds to make the attack's prior-only guesses from nothing (``forget`` clears its memo), and the guesses."""
    forget()
    with one_at_a_time(one_by_one):
        start = time.perf_counter()
        made = attack.prior_only_guesses(view, 255)
        return time.perf_counter() - start, made


def measure(name: str, attack: Any, forget: Callable[[], None], view: ServerView, repeats: int) -> list[dict[str, Any]]:
    attack.reconstruct(view)  # trains (and caches) the generator, restoration network or inverter: not timed
    times: dict[bool, list[float]] = {False: [], True: []}
    made: dict[bool, torch.Tensor] = {}
    for _ in range(repeats):
        for one_by_one in (True, False):
            seconds, made[one_by_one] = guesses(attack, forget, view, one_by_one)
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


def aggregate_view(datamodule: Any, clients: int, batch: int, public: Any) -> tuple[ServerView, Any]:
    """The secure aggregate of ``clients`` clients of ``batch`` training images each (images
    ``0 .. clients * batch - 1``), each upload through the shipped Gaussian mechanism, and what the server
    knows of it (the clip of each client, the noise of the mean)."""
    setting = tapped_setting(datamodule, 1, seed=0, indices=range(clients * batch))
    view, images = setting.views[0], setting.originals[0]
    datamodule.setup("fit")
    labels = torch.tensor([int(datamodule.train_dataset[i][1]) for i in range(clients * batch)])
    defense = LocalGaussianMechanism(seed=0)
    uploads = [
        defense({n: g.detach() for n, g in parameter_gradients(view.model, view.loss_fn, x, y).items()}, client)
        for client, (x, y) in enumerate(zip(images.chunk(clients), labels.chunk(clients)))
    ]
    mean = {n: torch.stack([u[n] for u in uploads]).mean(0).detach() for n in uploads[0]}
    knowledge = defense_knowledge(defense)
    assert knowledge is not None
    return dataclasses.replace(view, gradients=mean, labels=labels, public_data=public), knowledge.over_clients(clients)


def attacks_of(
    names: Sequence[str], decoys: int, iterations: int, datamodule: Any, knowledge: Any = None
) -> dict[str, tuple[Any, Callable[[], None]]]:
    """The attacks measured, each with what clears its memo of guesses (GGL with ``knowledge``); their
    trained networks kept in :data:`CACHES` across batch sizes."""
    built: dict[str, tuple[Any, Callable[[], None]]] = {}
    if "GGL" in names:
        ggl = GenerativeGradientLeakage(knowledge=knowledge, iterations=iterations, decoys=decoys, cache=CACHES["GGL"])
        built["GGL"] = (ggl, ggl_module._PRIOR_ONLY_MEMO.clear)
    if "ROG" in names:
        rog = ObfuscationRobustInversion(iterations=iterations, decoys=decoys, cache=CACHES["ROG"])
        built["ROG"] = (rog, rog_module._PRIOR_ONLY_MEMO.clear)
    if "RefinedLearnedInversion" in names:
        refined = learned_inversion_attacks(
            DefenseSetting("undefended"),
            datamodule,
            cache=CACHES["RefinedLearnedInversion"],
            refined_decoys=decoys,
            seed=0,
        )[1]
        assert isinstance(refined, RefinedLearnedInversion)
        built["RefinedLearnedInversion"] = (refined, refined._prior_only.clear)
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 decoys, 200 steps, batch 1 only")
    parser.add_argument("--decoys", type=int, default=None, help="decoys per attack (default 31, the audit's)")
    parser.add_argument("--iterations", type=int, default=None, help="step cap of each search (default 1000)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="client batch sizes (default 1 8)")
    parser.add_argument("--repeats", type=int, default=1, help="turns of the two modes")
    parser.add_argument("--dataset", choices=("sample", "fashion-mnist"), default="sample")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS), help="attacks measured")
    parser.add_argument(
        "--aggregate", type=int, default=0, help="the secure aggregate of this many clients (GGL knowing the defense)"
    )
    args = parser.parse_args()
    if args.aggregate and args.attacks != ["GGL"]:
        parser.error("--aggregate: only GGL models the defense on an aggregate here (--attacks GGL)")
    torch.set_num_threads(args.threads)
    decoys = args.decoys or (4 if args.quick else 31)
    iterations = args.iterations or (200 if args.quick else 1000)
    batch_sizes = args.batch_sizes or ([1] if args.quick else [1, 8])
    datamodule = FashionMNISTSampleDataModule() if args.dataset == "sample" else FashionMNISTDataModule()
    public = public_examples(datamodule, 10_000)
    rows: list[dict[str, Any]] = []
    for batch in batch_sizes:
        if args.aggregate:
            view, knowledge = aggregate_view(datamodule, args.aggregate, batch, public)
        else:
            setting = tapped_setting(datamodule, 1, seed=0, indices=range(batch))
            view, knowledge = dataclasses.replace(setting.views[0], public_data=public), None
        for name, (attack, forget) in attacks_of(args.attacks, decoys, iterations, datamodule, knowledge).items():
            rows += measure(name, attack, forget, view, args.repeats)
    preamble = (
        f"The prior-only guesses of GGL (4 restarts; published unless the view below says otherwise), ROG (2 restarts) and the refined learned inverter "
        f"(200 refinement steps of Inverting Gradients), {decoys} decoys, each GGL or ROG search "
        f"capped at {iterations} Adam steps (stopping earlier on a plateau), LeNetZhu at initialisation, "
        f"{args.dataset} Fashion-MNIST, {args.threads} thread(s), CPU; the two modes taking turns {args.repeats} "
        "time(s) in one process (seconds: the median). one_by_one: each search alone, as before; side_by_side: all "
        "decoys' searches in one vmapped loop (lightning_gp.attacks.searches). max_guess_diff: the largest difference "
        "of the two modes' guesses (normalised pixels)."
    )
    if args.aggregate:
        preamble += (
            f" The view: the secure aggregate of {args.aggregate} clients (batch_size: the aggregate's images), each "
            "upload through the shipped LocalGaussianMechanism, GGL knowing it (each guess the mean of its "
            "clients' chunks, each clipped on its own)."
        )
    subset = "" if set(args.attacks) == set(ATTACKS) else "_" + "_".join(args.attacks)
    subset += f"_aggregate{args.aggregate}" if args.aggregate else ""
    write_results("prior_control_speed" + subset + ("_quick" if args.quick else ""), rows, preamble)


if __name__ == "__main__":
    main()
