"""ReRo's kappa before and after scoring the fixed guesses by what the rule reads (issue 48).

Every audit with a formal bound measures kappa (:func:`lightning_gp.audit.bounds.prior_only_kappa`):
each of its fixed prior-only guesses (blank, mid-grey, the public mean and 256 public images) scored
against each of :data:`~lightning_gp.audit.bounds.KAPPA_IMAGES` training images and judged by the leak
rule, about 66,000 pairs. The scoring used to compute every similarity of a report (MSE, PSNR, SSIM and
NMI; NMI's joint entropies were half the cost) and to read each pair's scores by tensor indexing; it now
computes only the similarities the rule reads (:func:`~lightning_gp.audit.bounds.rule_similarities`) and
judges on Python floats. ``before`` below re-runs the old scoring (every similarity, the per-pair
indexing) beside ``after`` (the library's), in turns, one torch thread, on the same images; each row
says whether the two gave the same leak for every (original, guess) pair.

    python benchmarks/kappa_speed.py --repeats 3

Writes benchmarks/results/kappa_speed.{csv,md}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _common import write_results

from lightning_gp.audit import bounds
from lightning_gp.audit.recognition import datamodule_recognition_tests
from lightning_gp.audit.rounds import public_examples, training_examples
from lightning_gp.audit.verdict import LeakRule, guess_floors, trivial_baselines
from lightning_gp.metrics.report import METRICS, pair_scores
from lightning_gp.normalization import denormalize


def before(originals: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor, rule: LeakRule) -> torch.Tensor:
    """The fixed guesses' leaks as the code before this change judged them: every similarity scored."""
    guesses = bounds.prior_only_guesses(originals, reference, None)
    floors = guess_floors(originals, trivial_baselines(originals, reference_images=reference))
    with torch.no_grad():
        scores, _ = pair_scores(
            guesses,
            originals,
            torch.zeros(guesses.shape[0], dtype=torch.bool),
            None,
            rule.noise_ratio_line is not None,
            None,
            "semantic" in rule.thresholds,
            labels,
            bounds._guess_tests(rule, False),
        )
    leaks = torch.zeros(originals.shape[0], guesses.shape[0], dtype=torch.bool)
    for i in range(originals.shape[0]):
        for j in range(guesses.shape[0]):
            values = {m: None if m not in scores else float(scores[m][i, j]) for m in METRICS}
            leaks[i, j] = bool(rule.criteria(values, floors[i], None))
    return leaks


def datasets(names: list[str]) -> dict[str, Any]:
    from lightning_gp.data import FashionMNISTSampleDataModule
    from lightning_gp.data.photo_crops import PhotoCropsDataModule

    makers = {"fashion-mnist sample": FashionMNISTSampleDataModule, "photo crops": PhotoCropsDataModule}
    return {name: makers[name]() for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each, in turns (median)")
    parser.add_argument(
        "--datasets",
        nargs="+",
        default=["fashion-mnist sample", "photo crops"],
        choices=["fashion-mnist sample", "photo crops"],
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="kappa_speed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, datamodule in datasets(args.datasets).items():
        datamodule.setup("fit")
        images, labels = training_examples(datamodule, bounds.KAPPA_IMAGES, args.seed)
        originals = denormalize(images, datamodule.mean, datamodule.std).clamp(0, 1)
        reference = denormalize(public_examples(datamodule)[0], datamodule.mean, datamodule.std).clamp(0, 1)
        rule = LeakRule().calibrated(datamodule_recognition_tests(datamodule, log=lambda _: None))
        times: dict[str, list[float]] = {"before": [], "after": []}
        results: dict[str, torch.Tensor] = {}
        for _ in range(args.repeats):
            for label, run in (
                ("before", lambda: before(originals, reference, labels, rule)),
                ("after", lambda: bounds.prior_only_leaks(originals, reference, labels=labels, rule=rule)),
            ):
                start = time.process_time()
                results[label] = run()
                times[label].append(time.process_time() - start)
        old, new = statistics.median(times["before"]), statistics.median(times["after"])
        rows.append(
            {
                "data": name,
                "originals": originals.shape[0],
                "guesses": results["after"].shape[1],
                "rule reads": ", ".join(bounds.rule_similarities(rule)) or "-",
                "before CPU s": round(old, 2),
                "after CPU s": round(new, 2),
                "speed-up": round(old / new, 2),
                "same leaks": bool(torch.equal(results["before"], results["after"])),
                "leaking pairs": int(results["after"].sum()),
            }
        )
        print(rows[-1], flush=True)
    write_results(
        args.name,
        rows,
        f"`python benchmarks/kappa_speed.py --repeats {args.repeats}`: the fixed prior-only guesses of kappa judged "
        "under the default leak rule (calibrated on each data set's public split), before (every similarity "
        "scored, per-pair tensor indexing) and after (the similarities the rule reads, Python floats), in turns, "
        f"one torch thread, median CPU seconds of {args.repeats}. An audit whose secure-aggregation view reads "
        "the same images also measures kappa once now, not twice.",
    )


if __name__ == "__main__":
    main()
