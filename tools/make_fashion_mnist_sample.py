#!/usr/bin/env python3
"""Build lightning_gp/data/sample/fashion_mnist_sample.npz from the full Fashion-MNIST idx files.

Selection (deterministic, class-balanced): the first 300 images of each class, in file order, from
the official training set and the first 100 of each class from the official test set. Within each
split the selected images keep their original file order.

    python tools/make_fashion_mnist_sample.py [--source /usr/share/datasets/fashion-mnist]
"""

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(REPO))

from lightning_gp.data.mnist import FASHION_MNIST_SYSTEM_DIR, FashionMNISTDataModule  # noqa: E402

DEFAULT_OUTPUT = REPO / "lightning_gp" / "data" / "sample" / "fashion_mnist_sample.npz"


def first_per_class(labels: np.ndarray, per_class: int, num_classes: int = 10) -> np.ndarray:
    """Indices (sorted) of the first ``per_class`` items of every class, in file order."""
    picked = [np.flatnonzero(labels == c)[:per_class] for c in range(num_classes)]
    short = [c for c, idx in enumerate(picked) if len(idx) < per_class]
    if short:
        raise ValueError(f"classes {short} have fewer than {per_class} items")
    return np.sort(np.concatenate(picked))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=FASHION_MNIST_SYSTEM_DIR, help="folder with the four idx files")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--train-per-class", type=int, default=300)
    parser.add_argument("--test-per-class", type=int, default=100)
    args = parser.parse_args(argv)

    module = FashionMNISTDataModule(data_dir=args.source)
    (train_x, train_y), (test_x, test_y) = module.read_splits(module.locate())
    train_idx = first_per_class(train_y, args.train_per_class)
    test_idx = first_per_class(test_y, args.test_per_class)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.output,
        train_images=train_x[train_idx].astype(np.uint8),
        train_labels=train_y[train_idx].astype(np.int64),
        test_images=test_x[test_idx].astype(np.uint8),
        test_labels=test_y[test_idx].astype(np.int64),
    )
    size = args.output.stat().st_size
    print(f"wrote {args.output} ({size / 1e6:.2f} MB): {len(train_idx)} train, {len(test_idx)} test images")


if __name__ == "__main__":
    main()
