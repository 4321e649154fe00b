"""The baselines the papers compare with, side by side under the same attacks (issue 13).

Rows: the catalogue's baselines (family ``"baseline"``: Soteria, GradDefense, Outpost, PRECODE,
ATS) at their defaults, next to the undefended model and the pruning defenses the DGP paper
compares them with (Top-k 20%, DGP). Everything else is the matrix's protocol
(``benchmarks/matrix.py``, whose row runner this script reuses): LeNetZhu at initialisation,
FedSGD round 0, ``--images`` clients with one training image each (chosen by ``--seed``), full
Fashion-MNIST when installed.

1. Privacy: Inverting Gradients, Robbing the Fed, R-GAP (n/a where the model does not allow it:
   LeNetZhu has convolution biases), and the defense's adaptive attack(s): PSNR / SSIM / LPIPS
   and the fraction of images leaked per attack, and the worst case over attacks per image. For
   ATS the reconstructions are scored against the raw image (ATS-R, the privacy question) and
   against the transformed image the client trained on (ATS-T).
2. Utility and cost: test accuracy after ``--rounds`` FedSGD rounds (10 clients x 8 images) as a
   fraction of the undefended run's (PMM), bytes uploaded per client and round, and the time of a
   training round as a ratio to the undefended round measured in the same run.
3. Soteria's feature scores: the official one-backward-per-feature loop, the vmapped forward-mode
   Jacobian and the k-probe estimate, each as a multiple of one undefended training step
   (LeNetZhu, batch 8, median of ``--repeats``), the largest deviation of the Jacobian scores from
   the loop's, and how much of the exactly pruned feature set the probe estimate prunes too.

Target (DGP paper, Table 1): against Robbing the Fed, Soteria and PRECODE fail (SSIM > 0.8 in
the paper) while pruning holds.

4. R-GAP on the model it applies to (CNN6 without biases), per defense, in its own table.

Writes benchmarks/results/baselines.{md,csv}, baselines_rgap.{md,csv} and baselines_soteria_cost.{md,csv}.
"""

from __future__ import annotations

import argparse
import csv
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, markdown_table, median_seconds, write_results
from matrix import choose_images, run_defense
from torch import nn

from lightning_gp.audit import (
    AttackBudget,
    SettingAudit,
    TrainingResult,
    audit_setting,
    defense_catalog,
    published_attacks,
)
from lightning_gp.defenses import Soteria, defended_layer, representation_scores
from lightning_gp.frontier.workers import worker_pool
from lightning_gp.models import CNN6, LeNetZhu

REFERENCES = ("undefended", "TopKPruning", "DualGradientPruning")
ATTACKS = ("IG", "RtF", "R-GAP")


# ------------------------------------------------------------------------------------- privacy
def attack_rows(audits: list[SettingAudit]) -> list[dict[str, Any]]:
    """One row per (defense, attack, scored against) with PSNR / SSIM / LPIPS and the leak fraction."""
    rows = []
    for audit in audits:
        for cell in audit.cells:
            rows.append(
                {
                    "defense": audit.setting,
                    "attack": cell.attack,
                    "kind": cell.kind,
                    "status": cell.status,
                    "psnr": cell.means.get("psnr", math.nan),
                    "ssim": cell.means.get("ssim", math.nan),
                    "lpips": cell.means.get("lpips", math.nan),
                    "leaked": cell.leak_fraction if cell.leak_fraction is not None else math.nan,
                    "psnr vs transformed": cell.trained_means.get("psnr", math.nan),
                    "ssim vs transformed": cell.trained_means.get("ssim", math.nan),
                    "note": cell.note,
                }
            )
        worst = audit.worst
        if worst is not None:
            rows.append(
                {
                    "defense": audit.setting,
                    "attack": "worst case",
                    "kind": "worst",
                    "status": worst.verdict,
                    "psnr": worst.means["psnr"],
                    "ssim": worst.means["ssim"],
                    "lpips": worst.means.get("lpips") if worst.means.get("lpips") is not None else math.nan,
                    "leaked": worst.leak_fraction,
                    "psnr vs transformed": math.nan,
                    "ssim vs transformed": math.nan,
                    "note": "",
                }
            )
    return rows


def _scores(audit: SettingAudit, attack: str) -> str:
    """``PSNR / SSIM`` of one attack (and against the transformed images, ATS-T, where scored)."""
    try:
        cell = audit.cell(attack)
    except KeyError:
        return "-"
    if cell.status in ("n/a", "error"):
        return cell.status
    text = f"{cell.means['psnr']:.1f} / {cell.means['ssim']:.3f}"
    if cell.trained_means:
        text += f" (T: {cell.trained_means['psnr']:.1f} / {cell.trained_means['ssim']:.3f})"
    return text


def summary_rows(audits: list[SettingAudit], training: dict[str, TrainingResult]) -> list[dict[str, Any]]:
    base = training.get("undefended")
    rows = []
    for audit in audits:
        adaptive = [c for c in audit.cells if c.kind == "adaptive" and c.status in ("ok", "fallback")]
        best = max(adaptive, key=lambda c: c.means["psnr"]) if adaptive else None
        row: dict[str, Any] = {
            "defense": audit.setting,
            "IG PSNR/SSIM": _scores(audit, ATTACKS[0]),
            "adaptive PSNR/SSIM": "-"
            if best is None
            else f"{best.means['psnr']:.1f} / {best.means['ssim']:.3f}" + (" fb" if best.status == "fallback" else ""),
            "RtF PSNR/SSIM": _scores(audit, ATTACKS[1]),
            "R-GAP PSNR/SSIM": _scores(audit, ATTACKS[2]),
        }
        worst = audit.worst
        if worst is not None:
            row["worst PSNR/SSIM"] = f"{worst.means['psnr']:.1f} / {worst.means['ssim']:.3f}"
            row["leaked"] = f"{worst.leak_fraction:.0%}"
            row["verdict"] = worst.verdict
        result = training.get(audit.setting)
        if result is not None:
            row["PMM"] = f"{result.test_acc / base.test_acc:.3f}" if base is not None else "-"
            # against the undefended model's dense gradient: PRECODE's bottleneck makes its own larger
            dense = base.dense_bytes_per_client_round if base is not None else result.dense_bytes_per_client_round
            row["upload vs undefended"] = f"{result.upload_bytes_per_client_round / dense:.0%}"
            if base is not None:
                row["round time x"] = (
                    f"{(result.train_seconds / result.rounds) / (base.train_seconds / base.rounds):.2f}"
                )
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------- R-GAP where it applies
def rgap_rows(names: list[str], datamodule: Any, indices: list[list[int]], seed: int) -> list[dict[str, Any]]:
    """R-GAP on its own model, CNN6 without biases (LeNetZhu has biases: R-GAP is n/a there)."""
    rows = []
    spec = published_attacks(AttackBudget(), ["R-GAP"])
    for entry in defense_catalog(names):
        setting = entry.build(seed, 1)
        torch.manual_seed(seed)
        model = CNN6(num_classes=10, in_channels=1, image_size=28)
        audit = audit_setting(
            setting,
            model,
            datamodule,
            indices=indices,
            published=spec,
            adaptive=False,
            seed=seed,
            log=lambda line: None,
        )
        cell = audit.cell("R-GAP")
        row: dict[str, Any] = {"defense": setting.name, "status": cell.status}
        row["PSNR / SSIM"] = _scores(audit, "R-GAP")
        row["leaked"] = f"{cell.leak_fraction:.0%}" if cell.leak_fraction is not None else "-"
        row["note"] = cell.note[:120]
        print(f"[R-GAP on CNN6] {setting.name}: {row['PSNR / SSIM']} {row['note']}", flush=True)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------- Soteria's cost
def soteria_cost(datamodule: Any, repeats: int, batches: int, seed: int) -> list[dict[str, Any]]:
    """Score methods as multiples of one undefended step, and the probe estimate's agreement."""
    torch.manual_seed(seed)
    model = LeNetZhu()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    datamodule.setup("fit")
    loader = torch.utils.data.DataLoader(datamodule.train_dataset, batch_size=8, shuffle=True)
    stream = iter(loader)
    x, y = next(stream)
    name, _ = defended_layer(model, None, x)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    step_seconds = median_seconds(step, repeats)
    exact = representation_scores(model, x, name, method="jacobian")
    loop = representation_scores(model, x, name, method="loop")
    deviation = float(((exact - loop).abs() / loop.abs().clamp_min(1e-12)).max())
    rows = []
    for method, probes in (("loop", 0), ("jacobian", 0), ("probes", 10), ("probes", 3)):
        generator = torch.Generator().manual_seed(seed)
        seconds = median_seconds(
            lambda: representation_scores(model, x, name, method=method, probes=max(probes, 1), generator=generator),
            max(3, repeats // 4) if method == "loop" else repeats,
            warmup=1,
        )
        agreement = math.nan
        if method == "probes":  # the share of the exactly pruned features the estimate prunes too
            shares = []
            for _ in range(batches):
                xb, _ = next(stream)
                scores = representation_scores(model, xb, name, method="jacobian")
                estimate = representation_scores(model, xb, name, method="probes", probes=probes, generator=generator)
                shares.append(_pruned_overlap(scores, estimate, name))
            agreement = sum(shares) / len(shares)
        rows.append(
            {
                "method": method if method != "probes" else f"probes (k={probes})",
                "seconds": seconds,
                "x undefended step": seconds / step_seconds,
                "max rel. deviation from loop": deviation if method == "jacobian" else math.nan,
                "pruned-set agreement": agreement,
            }
        )
    loop_seconds = rows[0]["seconds"]
    for row in rows:
        row["speed-up vs loop"] = loop_seconds / row["seconds"]
    return rows


def _pruned_overlap(exact: torch.Tensor, estimate: torch.Tensor, layer: str) -> float:
    """|pruned(exact) & pruned(estimate)| / |pruned(exact)| for Soteria's default rate."""
    columns = exact.numel()
    probe = {f"{layer}.weight": torch.ones(1, columns)}
    keep_exact = Soteria(0.8, seed=0)(probe, 0, scores=exact, layer=layer)[f"{layer}.weight"][0] != 0
    keep_estimate = Soteria(0.8, seed=0)(probe, 0, scores=estimate, layer=layer)[f"{layer}.weight"][0] != 0
    pruned_exact, pruned_estimate = ~keep_exact, ~keep_estimate
    return float((pruned_exact & pruned_estimate).sum() / pruned_exact.sum().clamp_min(1))


# ------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI-sized: 2 images, tiny budgets, 10 rounds")
    parser.add_argument("--sample", action="store_true", help="use the built-in sample even if the full set is here")
    parser.add_argument("--defenses", nargs="*", default=None, help="catalogue names (default: references + baselines)")
    parser.add_argument("--images", type=int, default=None, help="attacked clients, one image each (default 4)")
    parser.add_argument("--ig-iterations", type=int, default=None, help="Adam attacks' steps (default 1000)")
    parser.add_argument("--lbfgs-iterations", type=int, default=None, help="L-BFGS attacks' steps (default 100)")
    parser.add_argument("--rounds", type=int, default=None, help="training rounds for accuracy/bytes (default 200)")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats (default 20)")
    parser.add_argument("--no-lpips", action="store_true", help="skip LPIPS")
    parser.add_argument("--skip-privacy", action="store_true", help="only Soteria's score cost and R-GAP on CNN6")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--jobs", type=int, default=1, help="defenses in parallel processes (timings then contend)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    quick = args.quick
    images = args.images or (2 if quick else 4)
    rounds = args.rounds or (10 if quick else 200)
    repeats = args.repeats or (4 if quick else 20)
    for flag, value in (("--images", images), ("--rounds", rounds), ("--repeats", repeats)):
        if value < 1:
            parser.error(f"{flag} must be >= 1")
    torch.set_num_threads(args.threads)
    suffix = "_quick" if quick else ""
    datasets = fashion_mnist_datasets(full=not args.sample)
    dataset_name = "fashion-mnist" if "fashion-mnist" in datasets else "sample"
    datamodule = datasets[dataset_name]

    cost = soteria_cost(datamodule, repeats, batches=2 if quick else 20, seed=args.seed)
    write_results(
        f"baselines_soteria_cost{suffix}",
        cost,
        f"Soteria's feature scores on LeNetZhu (588 features), batch 8 of {dataset_name}, {args.threads} threads, "
        f"median of {repeats} runs, as multiples of one undefended training step (forward + backward + SGD) "
        "measured in the same process. Agreement: the share of the exactly pruned 80% of features that the probe "
        "estimate prunes too, mean over batches.",
        args.output_dir,
    )
    names = args.defenses or [*REFERENCES, *[e.name for e in defense_catalog() if e.family == "baseline"]]
    entries = defense_catalog(names)
    datamodule.batch_size = 500
    indices = choose_images(datamodule, images, args.seed)
    write_results(
        f"baselines_rgap{suffix}",
        rgap_rows(names, datamodule, indices, args.seed),
        f"R-GAP (analytic, recursive per-layer solves) on its own model, CNN6 without biases at initialisation, "
        f"FedSGD round 0, {images} clients x 1 image of {dataset_name} (training indices {[i[0] for i in indices]}). "
        "PSNR (dB) / SSIM against the raw image (T: against the transformed image the client trained on, ATS); "
        "n/a: R-GAP cannot attack the model the defense sends (e.g. PRECODE's bottleneck).",
        args.output_dir,
    )
    if args.skip_privacy:
        return

    budget = AttackBudget(
        ig_iterations=args.ig_iterations or (40 if quick else 1000),
        lbfgs_iterations=args.lbfgs_iterations or (4 if quick else 100),
        rtf_bins=16 if quick else 64,
    )
    published_names = [s.name for s in published_attacks(budget, list(ATTACKS))]
    print(
        f"baselines: {[e.name for e in entries]}, {images} images of {dataset_name} {[i[0] for i in indices]}, "
        f"attacks {published_names} + adaptive, {rounds} training rounds",
        flush=True,
    )
    jobs = [(e.name, dataset_name, indices, published_names, budget, rounds, args) for e in entries]
    with warnings.catch_warnings():
        if args.jobs > 1:
            with worker_pool(args.jobs) as pool:
                done = list(pool.map(run_defense, jobs))
        else:
            done = [run_defense(job) for job in jobs]
    audits = [audit for audit, _ in done]
    training = {result.setting: result for _, result in done}

    args.output_dir.mkdir(parents=True, exist_ok=True)
    summary = markdown_table(summary_rows(audits, training))
    detail_rows = attack_rows(audits)
    detail = markdown_table(detail_rows)
    preamble = (
        f"LeNetZhu at initialisation, FedSGD round 0, {images} clients x 1 image of {dataset_name} (training indices "
        f"{[i[0] for i in indices]}, seed {args.seed}); IG and adaptive Adam {budget.ig_iterations} iterations, "
        f"adaptive L-BFGS {budget.lbfgs_iterations}, Robbing the Fed {budget.rtf_bins} bins. PSNR in dB (lower is "
        "more private), SSIM (lower), LPIPS (higher); leaked: fraction of images with PSNR > 20 dB or SSIM > 0.5; "
        "worst case: per image the attacker's best over every attack; T: scored against the transformed images the "
        "client trained on (ATS-T; the first score is against the raw image, ATS-R). 'fb': the adaptive attack fell "
        "back to the "
        f"published one. PMM: test accuracy after {rounds} FedSGD rounds (10 clients x 8 images, server Adam 1e-3) "
        "over the undefended run's; upload: bytes per client-round over the undefended dense gradient's; round time x: one "
        "training round over the undefended round, same run"
        + (" (processes ran in parallel: contended)" if args.jobs > 1 else "")
        + "."
        + (" QUICK RUN: budgets far too small for conclusions." if quick else "")
    )
    (args.output_dir / f"baselines{suffix}.md").write_text(
        f"# baselines\n\n{preamble}\n\n## Summary\n\n{summary}\n\n## Every attack\n\n{detail}\n"
    )
    with open(args.output_dir / f"baselines{suffix}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(detail_rows[0]))
        writer.writeheader()
        writer.writerows(detail_rows)
    print("\n" + summary)
    print(f"\nwritten: {args.output_dir / f'baselines{suffix}.md'}, .csv")


if __name__ == "__main__":
    main()
