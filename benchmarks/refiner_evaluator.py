"""Refiner's shipped evaluation networks: how well they predict the noise ratio, and what they cost (issue 10).

For each shipped network (``lightning_gp/refiner/checkpoints``) and each set of images it never
trained on, every image is mixed with uniform noise at r = 0, 0.1, ..., 1 (``(1 - r) x + r u``,
seeded) and scored; per r: the mean absolute error of the predicted r, the mean and standard
deviation of the prediction, and the fraction of images on the private side of Refiner's 0.4
threshold (App. N).

Image sets:
* 1 channel: the held-out Fashion-MNIST test images (last 100 per class; when the full dataset
  is installed) and the built-in sample's TRAINING images (client data, never seen by D).
* 3 channels: crops of the two held-out photographs (chelsea, coffee; when scikit-image is
  installed) and smooth synthetic images (random colour grids upsampled, plus a gradient).

Cost: one forward + backward of D with respect to its input (what Refiner pays per iteration)
as a ratio to one undefended LeNetZhu training step, batch 8 and 128, CPU, median of repeats.

Writes benchmarks/results/refiner_evaluator.{csv,md}, refiner_evaluator_cost.{csv,md} and
refiner_evaluator.png (predicted vs true r).
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
from _common import RESULTS_DIR, median_seconds, write_results

from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.metrics import PRIVACY_THRESHOLDS
from lightning_gp.models import LeNetZhu
from lightning_gp.refiner.evaluator import EvaluationNetwork, load_evaluator
from lightning_gp.refiner.training import (
    HELDOUT_PHOTOS,
    NOISE_RATIOS,
    TrainingImagesError,
    fashion_mnist_images,
    mix_with_noise,
    random_crops,
    read_photo,
    scikit_image_photo_dir,
    smooth_images,
)


def image_sets(limit: int) -> list[tuple[int, str, torch.Tensor]]:
    """(channels, name, pixels in [0, 1]) for every available image set."""
    sets: list[tuple[int, str, torch.Tensor]] = []
    try:
        heldout = fashion_mnist_images().heldout[:limit].float() / 255
        sets.append((1, "Fashion-MNIST test, held out", heldout))
    except TrainingImagesError as err:
        print(f"skipped the held-out Fashion-MNIST images: {err}")
    sample = FashionMNISTSampleDataModule(normalize=False)
    sample.setup("fit")
    picked = torch.linspace(0, len(sample.train_dataset) - 1, limit).long()
    sets.append(
        (1, "Fashion-MNIST train (sample, client data)", torch.stack([sample.train_dataset[int(i)][0] for i in picked]))
    )
    if importlib.util.find_spec("skimage") is not None:
        folder = scikit_image_photo_dir()
        photos = [read_photo(folder / name) for name in HELDOUT_PHOTOS]
        crops = random_crops(photos, limit, 32, seed=1)  # the held-out crops of the shipped config (seed 0 + 1)
        sets.append((3, "held-out photos (chelsea, coffee), 32x32 crops", crops.float() / 255))
    else:
        print("skipped the held-out photographs: scikit-image is not installed (pip install '.[refiner-train]')")
    sets.append((3, "smooth synthetic 32x32", smooth_images(limit, 3, 32, seed=2)))
    return sets


@torch.no_grad()
def accuracy_rows(network: EvaluationNetwork, name: str, images: torch.Tensor, seed: int) -> list[dict]:
    mixes, _ = mix_with_noise(images, NOISE_RATIOS, torch.Generator().manual_seed(seed))
    predicted = torch.cat([network(chunk) for chunk in mixes.split(2048)])
    rows = []
    for r, values in zip(NOISE_RATIOS, predicted.double().chunk(len(NOISE_RATIOS))):
        rows.append(
            {
                "network": f"{network.in_channels}ch (width {network.width:g})",
                "images": name,
                "n": images.shape[0],
                "r": r,
                "mae": float((values - r).abs().mean()),
                "mean_predicted": float(values.mean()),
                "std_predicted": float(values.std()),
                "private (> 0.4)": float((values > PRIVACY_THRESHOLDS["noise_ratio"]).double().mean()),
            }
        )
    return rows


def cost_rows(repeats: int) -> list[dict]:
    rows = []
    for channels, size in ((1, 28), (3, 32)):
        network = load_evaluator(channels)
        for batch in (8, 128):
            x = torch.rand(batch, channels, size, size)
            y = torch.randint(0, 10, (batch,))
            model = LeNetZhu(num_classes=10, in_channels=channels, image_size=size)

            def lenet_step() -> None:
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()

            def evaluator_pass() -> None:
                xx = x.clone().requires_grad_(True)
                network(xx).sum().backward()

            step, evaluator = median_seconds(lenet_step, repeats), median_seconds(evaluator_pass, repeats)
            rows.append(
                {
                    "network": f"{channels}ch (width {network.width:g})",
                    "image": f"{channels}x{size}x{size}",
                    "batch": batch,
                    "LeNetZhu step (ms)": step * 1e3,
                    "D forward+backward (ms)": evaluator * 1e3,
                    "ratio": evaluator / step,
                }
            )
    return rows


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    for key in dict.fromkeys((r["network"], r["images"]) for r in rows):
        sel = [r for r in rows if (r["network"], r["images"]) == key]
        ax.errorbar(
            [r["r"] for r in sel],
            [r["mean_predicted"] for r in sel],
            yerr=[r["std_predicted"] for r in sel],
            marker="o",
            capsize=2,
            label=f"{key[0]}: {key[1]}",
        )
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="ideal")
    ax.axhline(PRIVACY_THRESHOLDS["noise_ratio"], color="red", linewidth=0.8, linestyle=":", label="0.4 threshold")
    ax.set_xlabel("true noise ratio r")
    ax.set_ylabel("predicted r (mean ± std)")
    ax.set_title("Refiner evaluation networks on images they never trained on")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1000, help="images per set (default 1000)")
    parser.add_argument("--repeats", type=int, default=30, help="timing repeats (default 30)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    networks = {1: load_evaluator(1), 3: load_evaluator(3)}
    rows = []
    for channels, name, images in image_sets(args.images):
        rows += accuracy_rows(networks[channels], name, images, args.seed + 12345)
    for channels, network in networks.items():
        info = network.checkpoint_info
        print(f"{channels}ch: {info['trained_on']}\n  reproduce: {info['command']}")
    write_results(
        "refiner_evaluator",
        rows,
        "Predicted noise ratio of the shipped evaluation networks on mixes (1 - r) x + r u of images they never "
        "trained on (one seeded u per image and r). Refiner counts a reconstruction with ratio < 0.4 as leaking.",
    )
    write_results(
        "refiner_evaluator_cost",
        cost_rows(args.repeats),
        f"One forward + backward of D w.r.t. its input vs one undefended LeNetZhu step (CPU, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}).",
    )
    plot(rows, RESULTS_DIR / "refiner_evaluator.png")
    print(f"written to {RESULTS_DIR}/refiner_evaluator.{{csv,md,png}} and refiner_evaluator_cost.{{csv,md}}")


if __name__ == "__main__":
    main()
