"""Where L-BFGS gradient matching stops improving: the evidence for DLG's plateau rule.

Per case (a setting, an attack, a client batch size) and per attacked client (LeNetZhu at
initialisation, FedSGD round 0, Fashion-MNIST), runs the attack with the plateau rule off
(``plateau_steps=0``) for ``--iterations`` outer L-BFGS steps and records, after every step, the
objective and each image's PSNR (matched one-to-one to the client's batch). It then replays the rule
(``DLG.plateau_steps`` W, ``DLG.plateau_rtol``) on each trace: the step it stops at, the mean and the
max PSNR there against those at the cap, and, for a run the rule never stops, how close it came (the
largest ratio of the best objective to the best W steps earlier: the rule stops at 1 - rtol).

    python benchmarks/lbfgs_convergence.py --cases "undefended:iDLG:8" "TopKPruning(rate=0.5):iDLG:1" \\
        "GaussianNoise(scale=0.01):iDLG:1" "TopKPruning(rate=0.8):adaptive:1" --images 8

A case is ``setting:attack:batch``: the setting ``undefended`` or a callback of
``lightning_gp.callbacks`` with literal keyword arguments; the attack ``iDLG`` (published) or
``adaptive`` (the setting's defense-aware iDLG, one restart). Data: full Fashion-MNIST when installed,
else the built-in sample (``--sample`` forces it). Writes
benchmarks/results/<name>.{csv,md} and the per-step traces <name>_traces.csv.
"""

from __future__ import annotations

import argparse
import copy
import csv
import statistics
import time
from pathlib import Path

import lightning as L
import torch
from _common import RESULTS_DIR, write_results
from prior_control import parse_setting

from lightning_gp.attacks import IDLG, DefenseAwareIDLG, ServerView
from lightning_gp.attacks.optimization import Observer, plateaued
from lightning_gp.audit import DefenseSetting
from lightning_gp.audit.quiet import library_noise_silenced
from lightning_gp.audit.rounds import tap_defended_round
from lightning_gp.data import FashionMNISTDataModule, FashionMNISTSampleDataModule
from lightning_gp.frontier.run import attacked_images
from lightning_gp.metrics.image_quality import psnr
from lightning_gp.metrics.matching import match_reconstructions
from lightning_gp.models import LeNetZhu
from lightning_gp.records import TappedGradient

DEFAULT_CASES = (
    "undefended:iDLG:8",
    "TopKPruning(rate=0.5):iDLG:1",
    "RandomPruning(rate=0.5):iDLG:1",
    "TopKPruning(rate=0.5):iDLG:8",
    "GaussianNoise(scale=0.01):iDLG:1",
    "GaussianNoise(scale=0.001):iDLG:1",
    "TopKPruning(rate=0.8):adaptive:1",
)
RULES = ((20, 1e-3), (20, 1e-2), (10, 1e-2), (50, 1e-3))


def build_attack(setting: DefenseSetting, kind: str, iterations: int, seed: int, observer: Observer) -> IDLG:
    """The case's attack with the plateau rule off, reporting its images after every step."""
    if kind == "iDLG":
        return IDLG(iterations=iterations, seed=seed, plateau_steps=0, observer=observer)
    if kind != "adaptive":
        raise ValueError(f"--cases: the attack must be iDLG or adaptive, got {kind!r}")
    attacks = setting.adaptive_attacks(LeNetZhu(), None, lbfgs_iterations=iterations, seed=seed)
    attack = next((a for a in attacks if isinstance(a, DefenseAwareIDLG)), None)
    if attack is None:
        raise ValueError(f"--cases: {setting.name} declares no defense-aware iDLG")
    attack.restarts, attack.plateau_steps, attack.observer = 1, 0, observer
    return attack


def trace_client(
    record: TappedGradient, model: torch.nn.Module, datamodule, setting: DefenseSetting, kind: str, iterations: int,
    seed: int,
) -> list[dict]:  # fmt: skip
    """One client's run: per outer step, the objective and every image's PSNR (matched one-to-one)."""
    view = ServerView.from_tap(
        record, copy.deepcopy(model), num_classes=10, mean=tuple(datamodule.mean), std=tuple(datamodule.std)
    )
    assert record.inputs is not None
    original = view.denormalize(record.inputs).clamp(0, 1)
    steps: list[dict] = []

    def observe(step: int, images: torch.Tensor) -> None:
        pixels = view.denormalize(images[0]).clamp(0, 1)
        order = match_reconstructions(pixels, original)
        steps.append({"step": step + 1, "psnr": [float(v) for v in psnr(pixels[order], original).view(-1)]})

    reconstruction = build_attack(setting, kind, iterations, seed, observe).reconstruct(view)
    for row, objective in zip(steps, reconstruction.loss_trace):
        row["objective"] = objective
    return steps


def replay(steps: list[dict], window: int, rtol: float) -> tuple[int, float | None]:
    """The step at which the plateau rule (``window``, ``rtol``) stops this trace (its last step if
    never) and, over the trace, the largest ratio of the best objective to the best ``window`` steps
    earlier (the rule stops where it exceeds ``1 - rtol``; ``None`` for a trace of ``window`` steps or fewer)."""
    objectives = [row["objective"] for row in steps]
    best: list[float] = []
    closest: float | None = None
    for value in objectives:
        best.append(min(value, best[-1]) if best else value)
    stop = len(steps)
    for i in range(window, len(steps)):
        ratio = best[i] / best[i - window] if best[i - window] > 0 else 1.0
        closest = ratio if closest is None else max(closest, ratio)
        if stop == len(steps) and plateaued(objectives[: i + 1], window, rtol):  # the rule DLG runs
            stop = i + 1
    return stop, closest


def summarise(case: str, traces: list[list[dict]], rules=RULES) -> list[dict]:
    """One row per rule: where it stops the case's runs and what PSNR it keeps against the cap's."""
    at_cap = [im for steps in traces for im in steps[-1]["psnr"]]
    rows = []
    for window, rtol in rules:
        stops: list[int] = []
        kept: list[float] = []
        closest: list[float] = []
        for steps in traces:
            stop, ratio = replay(steps, window, rtol)
            stops.append(stop)
            kept += steps[stop - 1]["psnr"]
            if stop == len(steps) and ratio is not None:
                closest.append(ratio)
        rows.append(
            {
                "case": case,
                "rule (steps, rtol)": f"{window}, {rtol:g}",
                "runs": len(traces),
                "steps at cap (mean)": f"{statistics.mean(len(s) for s in traces):.0f}",
                "stops at (mean; max)": f"{statistics.mean(stops):.0f}; {max(stops)}",
                "runs stopped early": sum(stop < len(s) for stop, s in zip(stops, traces)),
                "mean PSNR at stop / at cap": f"{_mean(kept):.2f} / {_mean(at_cap):.2f}",
                "max PSNR at stop / at cap": f"{max(kept):.2f} / {max(at_cap):.2f}",
                "images over 20 dB at stop / at cap": f"{sum(v > 20 for v in kept)} / {sum(v > 20 for v in at_cap)}",
                "closest ratio (runs not stopped)": f"{max(closest):.4f}" if closest else "-",
            }
        )
    return rows


def _mean(values: list[float]) -> float:
    finite = [min(v, 100.0) for v in values]  # a perfect match is +inf dB; count it as 100
    return statistics.mean(finite)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES))
    parser.add_argument("--images", type=int, default=8, help="attacked images per case (clients x batch)")
    parser.add_argument("--iterations", type=int, default=300, help="outer L-BFGS steps, the audit's cap")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample", action="store_true", help="the built-in sample even when the full set is installed")
    parser.add_argument("--name", default="lbfgs_convergence")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    torch.set_num_threads(1)
    datamodule = FashionMNISTSampleDataModule(batch_size=500) if args.sample else FashionMNISTDataModule(batch_size=500)
    rows: list[dict] = []
    trace_rows: list[dict] = []
    for case in args.cases:
        spec, kind, batch = case.rsplit(":", 2)
        setting = parse_setting(spec, args.seed)
        indices = attacked_images(datamodule, args.images, int(batch), args.seed)
        start = time.perf_counter()
        with library_noise_silenced():
            L.seed_everything(args.seed, verbose=False)
            model = LeNetZhu()
            records, sent, _ = tap_defended_round(setting, model, datamodule, indices=indices, seed=args.seed)
            traces = [
                trace_client(r, sent, datamodule, setting, kind, args.iterations, args.seed + c)
                for c, r in enumerate(records)
            ]
        for c, steps in enumerate(traces):
            trace_rows += [
                {"case": case, "client": c, "step": s["step"], "objective": s["objective"],
                 **{f"psnr_{i}": v for i, v in enumerate(s["psnr"])}}
                for s in steps
            ]  # fmt: skip
        rows += summarise(case, traces)
        print(f"{case}: {time.perf_counter() - start:.0f} s", rows[-len(RULES)], flush=True)
    preamble = (
        f"LeNetZhu at initialisation, FedSGD round 0, {args.images} attacked images per case "
        f"({'the built-in sample' if args.sample else 'Fashion-MNIST'}, seed {args.seed}); each run takes "
        f"{args.iterations} outer L-BFGS steps (20 objective evaluations each, strong-Wolfe line search) with "
        "the plateau rule off, or stops earlier on tolerance. Per rule: where it would have stopped each run, and "
        "the PSNR of the images there against those at the cap (inf counted as 100 dB). The default rule of "
        "`DLG` is (20, 0.001).\n\n"
        f"Run: `python benchmarks/lbfgs_convergence.py --cases {' '.join(repr(c) for c in args.cases)} "
        f"--images {args.images} --iterations {args.iterations}`"
    )
    write_results(args.name, rows, preamble, args.output_dir)
    with open(args.output_dir / f"{args.name}_traces.csv", "w", newline="") as handle:
        columns = list(dict.fromkeys(k for r in trace_rows for k in r))
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(trace_rows)


if __name__ == "__main__":
    main()
