"""The L-BFGS restarts of the defense-aware iDLG side by side (issue 48): time and reconstructions.

``DefenseAwareIDLG`` (the audit's budget: 300 outer L-BFGS steps, 4 restarts, the plateau stop) on
noised FedSGD gradients of LeNetZhu (Fashion-MNIST, ``GaussianNoise`` at each ``--scales``, the
attacker knowing it), each client attacked twice, the two taking turns:

- ``one by one``: every restart after the other (as before the side-by-side path);
- ``side by side``: the first restart alone, the others in one vmapped objective
  (:mod:`lightning_gp.attacks.lockstep`).

Columns: CPU seconds per client of each (one torch thread; the process's CPU time, which other jobs
on a shared machine move less than wall time), their ratio, the mean PSNR of each, the largest
per-image PSNR difference, and the images each puts over 20 dB. In float32 the vmapped objective rounds
differently from one run's, and L-BFGS' line search amplifies that: the images differ, the quality
should not (tests/test_lockstep.py holds the two to float64 precision on short runs).

Writes benchmarks/results/<name>.{csv,md}.

``--audit SETTING ...`` instead audits each setting (a frontier point, e.g. ``'GaussianNoise(scale=0.01)'``)
on ``--images`` training images at each batch size with its adaptive attacks (``audit_setting(published=[])``,
the audit's default budgets), once with the restarts side by side and once one by one, and writes per
setting and attack cell both leak fractions, mean PSNRs and seconds, and the passive verdict of each,
as ``benchmarks/results/<name>_audit.{csv,md}``: the verdicts a frontier rerun must keep.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from _common import audits_both_ways, compared_cells, write_results
from attack_throughput import tapped_setting

from lightning_gp.attacks import DLG, DefenseAwareIDLG, ServerView, defense_knowledge
from lightning_gp.audit import AttackBudget
from lightning_gp.data import FashionMNISTDataModule, FashionMNISTSampleDataModule
from lightning_gp.defenses import GaussianNoise
from lightning_gp.frontier.run import attacked_images
from lightning_gp.metrics import match_reconstructions, psnr


def noised(view: ServerView, scale: float, seed: int) -> ServerView:
    """``view`` with N(0, scale^2) added to every gradient entry (as ``GaussianNoise(scale)`` does)."""
    generator = torch.Generator().manual_seed(seed)
    gradients = {n: g + scale * torch.randn(g.shape, generator=generator) for n, g in view.gradients.items()}
    return ServerView(**{**view.__dict__, "gradients": gradients})


def image_psnr(found: torch.Tensor, original: torch.Tensor, view: ServerView) -> list[float]:
    found_px, original_px = view.denormalize(found), view.denormalize(original)
    return psnr(found_px[match_reconstructions(found_px, original_px)], original_px).tolist()


def attack(view: ServerView, scale: float, seed: int, side_by_side: bool) -> tuple[float, torch.Tensor, dict]:
    """CPU seconds, images and meta of the defense-aware iDLG on ``view``."""
    attacker = DefenseAwareIDLG(defense_knowledge(GaussianNoise(scale=scale)), iterations=300, restarts=4, seed=seed)
    start = time.process_time()
    with restarts_one_by_one(not side_by_side):
        result = attacker.reconstruct(view)
    return time.process_time() - start, result.images, result.meta


@contextlib.contextmanager
def restarts_one_by_one(active: bool) -> Iterator[None]:
    """Within it (``active``), every DLG-family attack runs its restarts one after another."""
    if not active:
        yield
        return
    original = DLG._restarts_side_by_side
    DLG._restarts_side_by_side = lambda self, view, labels, starts: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        DLG._restarts_side_by_side = original  # type: ignore[method-assign]


def audit_rows(args: argparse.Namespace, datamodule: Any, preamble: str) -> list[dict[str, Any]]:
    """Issue 48's verdict check: each ``--audit`` setting's adaptive attacks both ways (module docstring);
    the results are rewritten after every (setting, batch size), so a stopped run keeps what it did."""
    rows: list[dict[str, Any]] = []
    ways = [("side by side", lambda: restarts_one_by_one(False)), ("one by one", lambda: restarts_one_by_one(True))]
    for spec in args.audit:
        for batch in args.batch_sizes:
            indices = attacked_images(datamodule, args.images, batch, seed=0)
            audits, _ = audits_both_ways(spec, datamodule, indices, AttackBudget(), ways)
            for row in compared_cells(spec, batch, args.images, audits, [label for label, _ in ways]):
                rows.append(row)
                print(row, flush=True)
            write_results(f"{args.name}_audit", rows, preamble)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--scales", type=float, nargs="+", default=[1e-3, 1e-2])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--sample", action="store_true", help="the built-in Fashion-MNIST sample")
    parser.add_argument("--name", default="lbfgs_restarts")
    parser.add_argument("--audit", nargs="+", default=None, help="frontier points to audit both ways")
    parser.add_argument("--images", type=int, default=16, help="attacked images per --audit point")
    args = parser.parse_args()
    if min(args.batch_sizes) < 1 or args.clients < 1 or min(args.scales) <= 0 or args.images < 1:
        parser.error("--batch-sizes, --clients and --images must be at least 1, --scales positive")
    torch.set_num_threads(1)
    datamodule = FashionMNISTSampleDataModule() if args.sample else FashionMNISTDataModule(batch_size=500)
    datamodule.setup("fit")
    if args.audit is not None:
        preamble = (
            f"Each setting's adaptive attacks on {args.images} training images (seed 0), LeNetZhu at "
            "initialisation, the audit's default budgets, once with DLG-family restarts side by side and once "
            "one by one. The seconds are the cells' wall time, the two runs one after the other (not taking turns): "
            "on a shared machine read the speed from the CPU-time rows of lbfgs_restarts.md, the verdicts from "
            f"here.\n\nRun: `python benchmarks/lbfgs_restarts.py --audit {' '.join(repr(a) for a in args.audit)} "
            f"--batch-sizes {' '.join(map(str, args.batch_sizes))} --images {args.images}"
            f"{' --sample' if args.sample else ''} --name {args.name}`"
        )
        audit_rows(args, datamodule, preamble)
        return
    rows = []
    for batch in args.batch_sizes:
        if batch == 1:
            setting = tapped_setting(datamodule, args.clients, seed=0)
            clients = list(zip(setting.views, setting.originals))
        else:
            clients = []
            for c in range(args.clients):
                one = tapped_setting(datamodule, 1, seed=c, indices=range(c * batch, (c + 1) * batch))
                clients.append((one.views[0], one.originals[0]))
        for scale in args.scales:
            times: dict[bool, list[float]] = {False: [], True: []}
            scores: dict[bool, list[float]] = {False: [], True: []}
            ran_together = 0
            for c, (view, original) in enumerate(clients):
                view = noised(view, scale, seed=1000 + c)
                for side_by_side in (c % 2 == 0, c % 2 == 1):  # taking turns: each goes first on half
                    seconds, images, meta = attack(view, scale, c, side_by_side)
                    times[side_by_side].append(seconds)
                    scores[side_by_side] += image_psnr(images, original, view)
                    ran_together += side_by_side and "restarts_side_by_side" in meta
                print(f"batch {batch}, scale {scale:g}, client {c}: {times[False][-1]:.1f}s / {times[True][-1]:.1f}s")
            rows.append(
                {
                    "batch": batch,
                    "noise scale": f"{scale:g}",
                    "clients": len(clients),
                    "ran side by side": ran_together,
                    "s per client, one by one": round(statistics.mean(times[False]), 2),
                    "s per client, side by side": round(statistics.mean(times[True]), 2),
                    "speedup": round(sum(times[False]) / sum(times[True]), 2),
                    "mean PSNR, one by one": round(statistics.mean(scores[False]), 2),
                    "mean PSNR, side by side": round(statistics.mean(scores[True]), 2),
                    "max |PSNR diff| (dB)": round(max(abs(a - b) for a, b in zip(scores[False], scores[True])), 2),
                    "images > 20 dB, one by one": sum(v > 20 for v in scores[False]),
                    "images > 20 dB, side by side": sum(v > 20 for v in scores[True]),
                }
            )
            print(rows[-1], flush=True)
    data = "the built-in sample" if args.sample else "Fashion-MNIST"
    preamble = (
        f"DefenseAwareIDLG (300 steps, 4 restarts) on {args.clients} clients per batch size, {data}, "
        "LeNetZhu at initialisation, GaussianNoise known to the attacker; CPU time, one torch thread.\n\n"
        f"Run: `python benchmarks/lbfgs_restarts.py --batch-sizes {' '.join(map(str, args.batch_sizes))} "
        f"--scales {' '.join(f'{s:g}' for s in args.scales)} --clients {args.clients}"
        f"{' --sample' if args.sample else ''} --name {args.name}`"
    )
    write_results(args.name, rows, preamble)


if __name__ == "__main__":
    main()
