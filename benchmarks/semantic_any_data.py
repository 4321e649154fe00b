"""The semantic leak test fitted at audit time (``fit_semantic_test``) beside the shipped one, on Fashion-MNIST.

Fits :func:`lightning_gp.metrics.fit_semantic_test` on the built-in sample's public split (its test
split, 1000 images: the shipped classifier's training data too), timed, then scores held-out images
with both tests:

* null groups (not recognisable as the original's class c): all zeros, grey 0.5, the dataset-mean
  image, uniform and Gaussian noise, a random real image of ANOTHER class scored for c, and "other
  class, every label": each held-out image scored for each of the 9 classes it is not (the pairs the
  fitted test's conformal level is stated for);
* recognisable groups: the clean original and the degradations of ``semantic_calibration.py`` (noise
  to 11 dB PSNR, blur sigma 1 and 2, silhouette, contrast 0.3, dimmed, brightened, x2 / x4 low
  resolution), plus its borderline groups (blur 4, another image of the same class) and blobs.

Per group: each test's median score and the fraction over its line (the shipped test: SEMANTIC_LINE
0.7; the fitted test: its conformal line). For the null groups that fraction is the measured false
alarm, given with a one-sided 95% Clopper-Pearson upper bound, beside the fitted test's stated level.

Held-out images: 1000 of the full Fashion-MNIST training split (indices 59000-59999, as
``semantic_calibration.py``) when it is installed, else (and with ``--quick``) the built-in sample's
training split (100 images; the quick run writes ``semantic_any_data_quick.*``).

Writes benchmarks/results/semantic_any_data.{csv,md}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, write_results
from semantic_calibration import NOT_RECOGNISABLE, RECOGNISABLE, groups, load_images

from lightning_gp.metrics import SemanticTest, fit_semantic_test, shipped_semantic_test
from lightning_gp.metrics.semantic import load_public_split
from lightning_gp.privacy import clopper_pearson  # its 90% two-sided upper limit: the one-sided 95% one


def held_out(quick: bool, images: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """(pixels, labels, mean image, description): full Fashion-MNIST when installed, else the sample."""
    if not quick:
        try:
            return load_images(False, images)
        except SystemExit as err:
            print(f"{err}; using the built-in sample's training split instead")
    return load_images(True, 100 if images == 1000 else images)


def every_other_label(test: SemanticTest, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Scores of each image for each class it is not: ``[N * (K - 1)]``."""
    matrix = test.score_matrix(x, torch.arange(test.num_classes))  # [K, N]
    return matrix[torch.arange(test.num_classes)[:, None] != labels[None, :]]


def kind_of(name: str) -> str:
    if name in NOT_RECOGNISABLE or name == "other class, every label":
        return "not recognisable"
    return "recognisable" if name in RECOGNISABLE or name == "clean original" else "borderline"


def measure(tests: dict[str, SemanticTest], x, labels, mean, seed: int) -> list[dict[str, Any]]:
    recons = {"clean original": x, **groups(x, labels, mean, seed)}
    rows = []
    for name in [*recons, "other class, every label"]:
        row: dict[str, Any] = {"group": name, "kind": kind_of(name)}
        for which, test in tests.items():
            if name == "other class, every label":
                scores = every_other_label(test, x, labels)
            else:
                scores = test.scores(recons[name], labels)
            hits = int((scores > test.line).sum())
            row["scores"] = len(scores)
            row[f"{which}_median"] = float(scores.median())
            row[f"{which}_p99"] = float(torch.quantile(scores.double(), 0.99))
            row[f"{which}_called"] = hits / len(scores)
            if row["kind"] == "not recognisable":
                row[f"{which}_called_ub95"] = clopper_pearson(hits, len(scores), 0.90)[1]
            else:
                row[f"{which}_called_ub95"] = float("nan")
        rows.append(row)
    return rows


def accuracy(test: SemanticTest, x: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return float((test.classifier(x).argmax(dim=1) == labels).float().mean())


def preamble(args, fitted: SemanticTest, shipped: SemanticTest, fit_s: float, what: str, rows, accs) -> str:
    nulls = [r for r in rows if r["kind"] == "not recognisable" and not r["group"].startswith("blob")]
    worst = max(nulls, key=lambda r: r["fitted_called"])
    every = next(r for r in rows if r["group"] == "other class, every label")
    return (
        ("QUICK RUN. " if args.quick else "")
        + f"Held-out images: {what}; seed {args.seed}, {args.threads} thread(s), torch {torch.__version__}. "
        f"Fitted test: fit_semantic_test on the built-in sample's public split (1000 images), false_alarm "
        f"{fitted.false_alarm}, {fitted.source}; line {fitted.line:.4f} from {fitted.calibration_size} null scores; "
        f"fit time {fit_s:.1f} s. Shipped test: {shipped.source}, line {shipped.line}. "
        f"Clean held-out accuracy: fitted {accs['fitted']:.3f}, shipped {accs['shipped']:.3f}. "
        f"Measured false alarm of the fitted test: {every['fitted_called']:.4f} over {every['scores']} other-class "
        f"image-label pairs (95% upper bound {every['fitted_called_ub95']:.4f}; stated level {fitted.false_alarm}); "
        f"the largest over the null groups (blobs excluded): {worst['fitted_called']:.4f} ({worst['group']}). "
        "*_called: fraction of scores over that test's line (for null groups: the false alarm; for the others: "
        "the power); *_called_ub95: one-sided 95% Clopper-Pearson upper bound on a null group's rate. Blobs (blur 6) "
        "are the shipped test's known weak spot, listed with the null groups but not part of either level."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="held-out: 100 built-in sample images; *_quick files")
    parser.add_argument("--images", type=int, default=1000, help="held-out images (default 1000; quick: 100)")
    parser.add_argument("--false-alarm", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default: the fit's rule)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    fitted = fit_semantic_test(*load_public_split(), false_alarm=args.false_alarm, seed=args.seed, epochs=args.epochs)
    fit_s = time.perf_counter() - start
    print(f"fitted in {fit_s:.1f} s: line {fitted.line:.4f} ({fitted.source})")
    x, labels, mean, what = held_out(args.quick, args.images)
    tests = {"shipped": shipped_semantic_test(), "fitted": fitted}
    rows = measure(tests, x, labels, mean, args.seed)
    accs = {which: accuracy(test, x, labels) for which, test in tests.items()}
    name = "semantic_any_data_quick" if args.quick else "semantic_any_data"
    text = preamble(args, fitted, tests["shipped"], fit_s, what, rows, accs)
    write_results(name, rows, text, args.output_dir)
    print(text)


if __name__ == "__main__":
    main()
