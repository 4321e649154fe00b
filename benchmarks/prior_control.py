"""What the learned inverter recovers beyond its prior: the leak rule with and without the prior-only control.

For each setting, the audit runs the learned inverter and its refined variant
(:func:`lightning_gp.audit.learned.learned_inversion_attacks`) on ``--images`` training images in
clients of ``--batch-size``, at round 0, and judges their reconstructions twice: with the
prior-only control (:mod:`lightning_gp.audit.prior_control`, what the audit does) and without it
(the rule before the control). Per client batch it also says on which metrics the inverter was
informed (its batch mean beat all 255 of its guesses from public batches). The gradient-matching
attacks run with 2 steps only: this measures the learned inverter, not the defenses' full audits.

    python benchmarks/prior_control.py --settings undefended "TopKPruning(rate=0.8)" \\
        "LocalGaussianMechanism(noise_multiplier=100.0, max_update_norm=1.0)" --batch-size 8 --images 16

A setting is ``undefended``, a catalogue name (its catalogue setting) or a callback of
``lightning_gp.callbacks`` with literal keyword arguments. Data: full Fashion-MNIST when installed,
else the built-in sample (``--sample`` forces it). Writes benchmarks/results/<name>.{csv,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import time

import lightning as L
import torch
from _common import parse_call, write_results

from lightning_gp import callbacks as callback_classes
from lightning_gp.audit import AttackBudget, DefenseSetting, audit_setting, defense_catalog, published_attacks
from lightning_gp.audit.quiet import library_noise_silenced
from lightning_gp.audit.setting_audit import reference_pixels
from lightning_gp.audit.verdict import LeakRule, trivial_baselines
from lightning_gp.data import FashionMNISTDataModule, FashionMNISTSampleDataModule
from lightning_gp.frontier.run import attacked_images
from lightning_gp.metrics import concatenate_reports
from lightning_gp.models import LeNetZhu

LEARNED = ("adaptive:LearnedInversion", "adaptive:RefinedLearnedInversion")


def parse_setting(spec: str, seed: int) -> DefenseSetting:
    """``undefended``, a catalogue name, or ``Callback(keyword=literal, ...)``."""
    if spec == "undefended":
        return DefenseSetting("undefended")
    if "(" not in spec:
        return defense_catalog([spec])[0].build(seed, 1)
    name, kwargs = parse_call(spec, "--settings", "Callback(keyword=literal, ...), a catalogue name or undefended")
    cls = getattr(callback_classes, name, None)
    if cls is None:
        raise ValueError(f"--settings {spec!r}: lightning_gp.callbacks has no {name}")
    if "seed" in inspect.signature(cls).parameters:
        kwargs.setdefault("seed", seed)
    return DefenseSetting(spec, [cls(**kwargs)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", required=True)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sample", action="store_true", help="use the built-in sample even when the full set is installed"
    )
    parser.add_argument("--name", default="prior_control")
    args = parser.parse_args()
    torch.set_num_threads(1)
    datamodule = FashionMNISTSampleDataModule(batch_size=500) if args.sample else FashionMNISTDataModule(batch_size=500)
    indices = attacked_images(datamodule, args.images, args.batch_size, args.seed)
    budget = AttackBudget(ig_iterations=2, lbfgs_iterations=2, learned_inversion=True, learned_min_batch=1)
    rule, reference = LeakRule(), reference_pixels(datamodule)
    rows = []
    for spec in args.settings:
        setting = parse_setting(spec, args.seed)
        start = time.perf_counter()
        with library_noise_silenced():
            L.seed_everything(args.seed, verbose=False)
            audit = audit_setting(
                setting, LeNetZhu(), datamodule, indices=indices, published=published_attacks(budget, ["IG"]),
                budget=budget, adaptive=True, num_clients=10, seed=args.seed, log=lambda line: None,
            )  # fmt: skip
        seconds = time.perf_counter() - start
        for name in LEARNED:
            if name not in audit.results:
                rows.append({"setting": setting.name, "attack": name, "note": "not run (the server cannot replay it)"})
                continue
            results = audit.results[name]
            merged = concatenate_reports([r.report for r in results])
            bare = dataclasses.replace(merged, prior_only=None)
            guesses = trivial_baselines(merged.original_pixels, reference_images=reference)
            informed = [
                sorted(m for m, bar in r.report.prior_only[0].items() if abs(bar) != float("inf"))
                for r in results
                if r.report.prior_only
            ]
            rows.append(
                {
                    "setting": setting.name,
                    "attack": name.split(":")[1],
                    "mean PSNR": f"{merged.means['psnr']:.1f}",
                    "mean SSIM": f"{merged.means['ssim']:.3f}",
                    "leaked without control": f"{sum(rule.leaked(bare, guesses))}/{merged.batch_size}",
                    "leaked with control": f"{sum(rule.leaked(merged, guesses))}/{merged.batch_size}",
                    "informed on (per client)": "; ".join(",".join(m) or "-" for m in informed),
                    "audit seconds": f"{seconds:.0f}",
                }
            )
        print(rows[-2:], flush=True)
    preamble = (
        f"LeNetZhu at initialisation, round 0, {len(indices)} clients x {args.batch_size} images "
        f"({'the built-in sample' if args.sample else 'Fashion-MNIST'}, seed {args.seed}). The learned inverter "
        "(Wu et al., UAI 2023) and its refined variant, trained on the public test split through each setting's "
        "own defense, judged by the audit's leak rule with the prior-only control (what the audit does) and "
        "without it. 'informed on': the metrics on which a client's batch mean beat all 255 of the attack's (the refined variant: all 31 of its) "
        "guesses from public batches ('-': none, so nothing of that client is credited).\n\n"
        f"Run: `python benchmarks/prior_control.py --settings {' '.join(repr(s) for s in args.settings)} "
        f"--batch-size {args.batch_size} --images {args.images}`"
    )
    write_results(args.name, rows, preamble)


if __name__ == "__main__":
    main()
