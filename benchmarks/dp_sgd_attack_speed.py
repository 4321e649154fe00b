"""The attacks that model DP-SGD, with each dummy example's gradient in one vmapped pass (issue 48).

An attacker that knows DP-SGD clips every example of its dummy batch on its own
(:meth:`lightning_gp.attacks.DefenseKnowledge.dummy_gradient` with ``per_example_clip``). Its
per-example gradients were computed one example at a time, a forward and a double-differentiable
backward pass per example and per objective evaluation; they now come from one
:func:`torch.func.vmap` pass (:func:`lightning_gp.attacks.per_example_gradients`), equal to float
precision (tests/test_adaptive_attacks.py). Two measurements, both ways taking turns in one process:

- ``objective``: one evaluation of the gradient-matching objective and its gradient w.r.t. the dummy
  images (LeNetZhu, ``--batch-sizes``), CPU milliseconds, median of ``--repeats``;
- ``audit`` (``--audit SETTING ...``): each setting's adaptive attacks (``audit_setting(published=[])``,
  the frontier's L-BFGS and Adam budgets, no learned inverter) on ``--images`` training images of
  Fashion-MNIST at batch 8, the whole audit's CPU seconds, and per attack cell both leak fractions,
  mean PSNRs and the passive verdicts. In float32 the vmapped pass rounds differently and L-BFGS'
  line search amplifies that: the images may differ, the verdicts should not.

Writes benchmarks/results/<name>.{csv,md} (and <name>_audit.{csv,md}). One torch thread.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from _common import audits_both_ways, compared_cells, write_results
from torch import nn

from lightning_gp.attacks import DefenseKnowledge, ServerView, adaptive, parameter_gradients
from lightning_gp.attacks.gradient_matching import per_example_gradients
from lightning_gp.audit import AttackBudget
from lightning_gp.data import FashionMNISTDataModule, FashionMNISTSampleDataModule
from lightning_gp.frontier.run import attacked_images
from lightning_gp.models import LeNetZhu

MODES = ("vmapped", "one example at a time")  # the two ways of the objective timing


@contextlib.contextmanager
def examples_one_at_a_time(active: bool) -> Iterator[None]:
    """Within it (``active``), the attacks' dummy per-example gradients take the loop (as before)."""
    if not active:
        yield
        return
    adaptive.per_example_gradients = functools.partial(per_example_gradients, vectorize=False)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        adaptive.per_example_gradients = per_example_gradients  # type: ignore[attr-defined]


def objective_ms(view: ServerView, images: torch.Tensor, labels: torch.Tensor, knowledge: DefenseKnowledge) -> float:
    """CPU milliseconds of one matching objective and its gradient w.r.t. the dummy images."""
    dummy = images.clone().requires_grad_(True)
    start = time.process_time()
    guess = knowledge.dummy_gradient(view, dummy, labels)
    loss = sum(((guess[n] - view.gradients[n]) ** 2).sum() for n in guess)
    torch.autograd.grad(loss, dummy)
    return 1000 * (time.process_time() - start)


def objective_rows(args: argparse.Namespace, datamodule: Any) -> list[dict[str, Any]]:
    rows = []
    for batch in args.batch_sizes:
        torch.manual_seed(0)
        model = LeNetZhu()
        images = torch.stack([datamodule.train_dataset[i][0] for i in range(batch)])
        labels = torch.tensor([int(datamodule.train_dataset[i][1]) for i in range(batch)])
        shared = parameter_gradients(model, nn.CrossEntropyLoss(), images, labels, create_graph=False)
        view = ServerView(model=model, gradients=shared, batch_size=batch, input_shape=(1, 28, 28), num_classes=10)
        knowledge = DefenseKnowledge(support=False, per_example_clip=1.0)
        start = images + 0.1 * torch.randn(images.shape, generator=torch.Generator().manual_seed(1))
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else reversed(MODES):  # taking turns: each goes first half the time
                with examples_one_at_a_time(mode != MODES[0]):
                    times[mode].append(objective_ms(view, start, labels, knowledge))
        vmapped, loop = (statistics.median(times[m]) for m in MODES)
        rows.append(
            {
                "batch": batch, "ms, vmapped": round(vmapped, 2), "ms, one example at a time": round(loop, 2),
                "speedup": round(loop / vmapped, 2), "repeats": args.repeats,
            }
        )  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def audit_rows(args: argparse.Namespace, datamodule: Any, preamble: str) -> list[dict[str, Any]]:
    """Each ``--audit`` setting's adaptive attacks both ways (module docstring); rewritten after each setting."""
    rows: list[dict[str, Any]] = []
    budget = AttackBudget(ig_iterations=1000, lbfgs_iterations=300, stop_when_all_leak=False)
    labels = ("vmapped", "one at a time")
    ways = [(labels[0], lambda: examples_one_at_a_time(False)), (labels[1], lambda: examples_one_at_a_time(True))]
    for k, spec in enumerate(args.audit):
        indices = attacked_images(datamodule, args.images, 8, seed=0)
        audits, seconds = audits_both_ways(spec, datamodule, indices, budget, ways if k % 2 == 0 else ways[::-1])
        for label in labels:
            print(f"{spec}, {label}: {seconds[label]:.0f} CPU s", flush=True)
        for row in compared_cells(spec, 8, args.images, audits, labels):
            row |= {f"audit CPU s, {label}": round(seconds[label]) for label in labels}
            row["audit speedup"] = round(seconds[labels[1]] / seconds[labels[0]], 2)
            rows.append(row)
            print(row, flush=True)
        write_results(f"{args.name}_audit", rows, preamble)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--sample", action="store_true", help="the built-in Fashion-MNIST sample")
    parser.add_argument("--name", default="dp_sgd_attack_speed")
    parser.add_argument("--audit", nargs="+", default=None, help="DP-SGD frontier points to audit both ways")
    parser.add_argument("--images", type=int, default=16, help="attacked images per --audit point (batch 8)")
    args = parser.parse_args()
    if min(args.batch_sizes) < 1 or args.repeats < 2 or args.images < 8 or args.images % 8:
        parser.error("--batch-sizes must be at least 1, --repeats at least 2, --images a multiple of 8")
    torch.set_num_threads(1)
    datamodule = FashionMNISTSampleDataModule() if args.sample else FashionMNISTDataModule(batch_size=500)
    datamodule.setup("fit")
    data = "the built-in sample" if args.sample else "Fashion-MNIST"
    flags = f"{' --sample' if args.sample else ''} --name {args.name}"
    if args.audit is not None:
        preamble = (
            f"Each setting's adaptive attacks on {args.images} training images of {data} at batch 8 (seed 0), LeNetZhu "
            "at initialisation, IG 1000 steps, L-BFGS 300 (stopping on convergence), once with the dummy batch's "
            "per-example gradients vmapped and once one example at a time; the audit's CPU seconds on one thread "
            "(the two audits one after the other, the order alternating between settings).\n\n"
            f"Run: `python benchmarks/dp_sgd_attack_speed.py --audit {' '.join(repr(a) for a in args.audit)} "
            f"--images {args.images}{flags}`"
        )
        audit_rows(args, datamodule, preamble)
        return
    preamble = (
        f"One evaluation of a DP-SGD-aware gradient-matching objective (per-example clip 1.0) and its gradient "
        f"w.r.t. the dummy images, LeNetZhu at initialisation, {data}; CPU milliseconds on one thread, the median "
        f"of {args.repeats}, the two ways taking turns.\n\n"
        f"Run: `python benchmarks/dp_sgd_attack_speed.py --batch-sizes {' '.join(map(str, args.batch_sizes))} "
        f"--repeats {args.repeats}{flags}`"
    )
    write_results(args.name, objective_rows(args, datamodule), preamble)


if __name__ == "__main__":
    main()
