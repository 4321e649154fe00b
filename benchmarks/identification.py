"""The identification test's false-alarm rate and power (issue 46, item 1): ``lightning_gp.metrics.identification``.

Originals: held-out Fashion-MNIST images (full training split indices 59000-..., not in the built-in
sample; ``--quick`` or without the full data: the sample's training split). Public pools, per class:
the built-in sample's test split (100 per class) and, where installed, the full test split (up to
``--max-pool`` per class). Each original gets one output per group of ``semantic_calibration.py``
(uninformed: blanks, noise, the mean image, an image of another class or of the same class, a blob;
recognisable degradations of the original: noise to 11 dB, blurs, low resolution, a silhouette,
contrast changes), and the test gives that output's p-value for its original. Uninformed groups
measure the false alarm (the fraction of pairs at p <= the line), recognisable ones the power.
A degraded copy of one original (noise to 11 dB, blur 1) paired with every other original of its
chunk of 50 is uninformed about that other original: those "other original" pairs are a null group of
their own. (The "other class" and "same class" outputs are other held-out images, so they can be a
copy of another original of the chunk and are not used that way.)

Writes ``benchmarks/results/identification.{csv,md}`` (``--quick``: ``identification_quick.*``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from _common import write_results
from semantic_calibration import NOT_RECOGNISABLE, groups, load_images

from lightning_gp.metrics.identification import IDENTIFICATION_LINE, MIN_POOL, SHAPE_MARGIN, IdentificationTest
from lightning_gp.metrics.semantic import load_public_split
from lightning_gp.privacy import clopper_pearson  # its 90% two-sided upper limit: the one-sided 95% one

CHUNK = 50


def pools(quick: bool, max_pool: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Public pools by name: the sample's test split, and the full test split where installed."""
    found = {"sample test split (100 per class)": load_public_split()}
    if not quick:
        from lightning_gp.data import FashionMNISTDataModule
        from lightning_gp.data.base import DatasetNotFoundError

        datamodule = FashionMNISTDataModule()
        try:
            _, (test_x, test_y) = datamodule.read_splits(datamodule.locate())
        except DatasetNotFoundError as err:
            print(f"full Fashion-MNIST not installed, only the sample's pool: {err}")
        else:
            x = torch.from_numpy(np.asarray(test_x)).float() / 255
            found[f"full test split ({max_pool} per class)"] = (
                x[:, None] if x.ndim == 3 else x,
                torch.from_numpy(np.asarray(test_y)).long(),
            )
    return found


def pvalues_by_group(test: IdentificationTest, x: torch.Tensor, labels: torch.Tensor, mean: torch.Tensor, seed: int):
    """Group -> (own-original p-values [N], other-original p-values [M]), chunk by chunk."""
    outputs = {name: images.clamp(0, 1) for name, images in groups(x, labels, mean, seed).items()}
    outputs = {"copy": x.clone(), **outputs}
    own: dict[str, list[torch.Tensor]] = {name: [] for name in outputs}
    other: list[torch.Tensor] = []
    for start in range(0, len(x), CHUNK):
        rows = slice(start, start + CHUNK)
        for name, images in outputs.items():
            p = test.pvalues(images[rows], x[rows], labels[rows])
            own[name].append(p.diagonal())
            if name in ("noise to 11 dB", "blur 1"):  # made from another original: uninformed about this one
                other.append(p[~torch.eye(len(p), dtype=torch.bool)])
    return {name: torch.cat(v) for name, v in own.items()}, torch.cat(other)


def rows_for(pool: str, own: dict[str, torch.Tensor], other: torch.Tensor, seconds: float) -> list[dict[str, Any]]:
    rows = []
    for name, p in [*own.items(), ("other original (off-diagonal pairs)", other)]:
        uninformed = name in NOT_RECOGNISABLE or name.startswith("other original") or name == "same class"
        hits = int((p <= IDENTIFICATION_LINE).sum())
        rows.append(
            {
                "pool": pool,
                "group": name,
                "kind": "uninformed" if uninformed else "recognisable",
                "pairs": len(p),
                "identified": hits / len(p),
                "identified_ub95": clopper_pearson(hits, len(p), 0.90)[1] if uninformed else float("nan"),
                "at_1e-2": float((p <= 1e-2).double().mean()),
                "median_p": float(p.median()),
                "seconds": round(seconds, 1),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the built-in sample only")
    parser.add_argument("--images", type=int, default=200, help="held-out originals (default 200)")
    parser.add_argument("--max-pool", type=int, default=300, help="public images per class from the full test split")
    parser.add_argument("--lpips", action="store_true", help="add the LPIPS feature distance (slower)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, labels, mean, what = load_images(args.quick, args.images)
    lpips_fn = None
    if args.lpips:
        from lightning_gp.metrics.lpips import LPIPS

        lpips_fn = LPIPS()
    rows: list[dict[str, Any]] = []
    for pool_name, (public, public_labels) in pools(args.quick, args.max_pool).items():
        test = IdentificationTest(public, public_labels, lpips_fn=lpips_fn, max_pool=args.max_pool, seed=args.seed)
        start = time.perf_counter()
        own, other = pvalues_by_group(test, x, labels, mean, args.seed)
        rows += rows_for(pool_name, own, other, time.perf_counter() - start)
        print(f"{pool_name}: {time.perf_counter() - start:.0f} s", flush=True)
    preamble = (
        f"Originals: {what}; one output per group and original, its identification p-value for that original "
        f"({'SSIM or LPIPS' if args.lpips else 'SSIM'}; line p <= {IDENTIFICATION_LINE:g}, shape margin "
        f"{SHAPE_MARGIN:g}, pools of at least {MIN_POOL}). identified: fraction of pairs at p <= the line (for "
        "uninformed groups the false alarm, with its one-sided 95% Clopper-Pearson upper bound; for recognisable "
        "ones the power); at_1e-2: the same at p <= 0.01. One torch thread.\n\n"
        f"Run: `python benchmarks/identification.py{' --quick' if args.quick else ''} --images {args.images} "
        f"--max-pool {args.max_pool}{' --lpips' if args.lpips else ''}`"
    )
    write_results("identification_quick" if args.quick else "identification", rows, preamble)


if __name__ == "__main__":
    main()
