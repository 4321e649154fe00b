"""``lightning-gp refiner ...``: Refiner's command-line tools.

    lightning-gp refiner train-evaluator --config configs/refiner_evaluator_1ch.yaml
    lightning-gp refiner train-evaluator --config configs/refiner_evaluator_3ch.yaml --epochs 5

``train-evaluator`` trains the evaluation network of Refiner (Sec. 3.3, App. D) on public
images (see :mod:`lightning_gp.refiner.training`), prints the held-out mean absolute error of the
predicted noise ratio per ratio, and writes the checkpoint that
:func:`lightning_gp.refiner.evaluator.load_evaluator` reads.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

import torch
from jsonargparse import ActionConfigFile, ArgumentParser

from lightning_gp.refiner.training import (
    FASHION_MNIST_SOURCE,
    NOISE_RATIOS,
    PHOTOS_SOURCE,
    TrainingImagesError,
    evaluator_images,
    train_evaluator,
)


def build_train_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="lightning-gp refiner train-evaluator",
        description="Train Refiner's evaluation network (App. D recipe) and write its checkpoint.",
        env_prefix="LIGHTNING_GP",
        default_env=False,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config (see configs/refiner_evaluator_*.yaml)")
    parser.add_argument(
        "--images",
        type=str,
        required=True,
        help=f"training images: {FASHION_MNIST_SOURCE!r} (1 channel), {PHOTOS_SOURCE!r} (3 channels, needs "
        "the refiner-train extra) or the path of an .npz with train_images and heldout_images [N, C, H, W]",
    )
    parser.add_argument(
        "--data_dir",
        type=str | None,
        default=None,
        help="folder of the Fashion-MNIST idx files or of the photographs (default: where they are installed)",
    )
    parser.add_argument("--crop_size", type=int, default=32, help="photo crops: side in pixels")
    parser.add_argument("--train_crops", type=int, default=25600, help="photo crops to train on")
    parser.add_argument("--heldout_crops", type=int, default=2000, help="crops of the held-out photos")
    parser.add_argument("--width", type=float, default=0.125, help="factor on the 128/256/512 filters of App. D")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=128, help="clean images per step (each mixed 11 times)")
    parser.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    parser.add_argument("--ratios", type=list[float], default=list(NOISE_RATIOS), help="noise ratios mixed per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int | None, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--output", type=str, default="evaluator.pt", help="checkpoint file to write")
    return parser


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="lightning-gp refiner", description="Refiner tools (Fan et al., USENIX Security 2025)."
    )
    subcommands = parser.add_subcommands(dest="subcommand")
    subcommands.add_subcommand(
        "train-evaluator", build_train_parser(), help="train the evaluation network and write its checkpoint"
    )
    return parser


def train_command(config: Any, command: str) -> dict[str, Any]:
    """Run ``train-evaluator`` for a parsed config; returns the checkpoint dict it wrote."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    images = evaluator_images(
        config.images, config.data_dir, config.crop_size, config.train_crops, config.heldout_crops, config.seed
    )
    print(f"training on: {images.description}", flush=True)
    checkpoint = train_evaluator(
        images,
        width=config.width,
        epochs=config.epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        ratios=config.ratios,
        seed=config.seed,
        output=config.output,
        command=command,
    )
    lines = ["| r | held-out MAE | mean predicted r |", "|---|---|---|"]
    for r, mae in checkpoint["heldout_mae"].items():
        lines.append(f"| {r:g} | {mae:.4f} | {checkpoint['heldout_mean_prediction'][r]:.4f} |")
    print("\n".join(lines))
    print(
        f"worst held-out MAE {max(checkpoint['heldout_mae'].values()):.4f}; trained in "
        f"{checkpoint['train_seconds']:.0f} s; written to {config.output}",
        flush=True,
    )
    return checkpoint


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """``lightning-gp refiner <subcommand>``; returns what the subcommand produced."""
    argv = sys.argv[1:] if argv is None else list(argv)
    config = build_parser().parse_args(argv)
    if config.subcommand == "train-evaluator":
        try:
            return train_command(config["train-evaluator"], "lightning-gp refiner " + shlex.join(argv))
        except TrainingImagesError as err:
            raise SystemExit(f"lightning-gp refiner train-evaluator: error: {err}") from err
    return None
