"""Every defense against every attack, judged by the worst case (issue 12, part 4).

Rows: every defense of the catalogue (``lightning_gp.audit.catalog``, so Refiner, PriPrune and the
baselines join as they register) at its default setting. Columns: DLG, iDLG, Inverting Gradients,
GradInversion (its BatchNorm prior only where the model has BatchNorm), R-GAP (where the model
allows it), Robbing the Fed, each defense's adaptive attack(s), and the worst case last, per threat
model: passive (an honest-but-curious server: every attack but the ones that send a modified model)
and active (a malicious server: every attack, Robbing the Fed and ATS-aware Robbing included). LeNetZhu
at initialisation, FedSGD round 0, ``--images`` attacked training images (chosen by ``--seed``, never
tuned) held ``--batch-size`` per client (default 1: one client per image), on the full Fashion-MNIST
when installed, else the built-in sample. ``--audit-rounds 0 R`` also audits round ``R`` after ``R``
rounds of training under each setting (its defenses' state carried; the active attacks are not run
there), one table per round.

A cell is the mean PSNR over the images with, in the Markdown, the fraction of images that attack
leaks (the audit's leak rule, ``lightning_gp.audit.LeakRule``); ``n/a`` cells say why the attack does
not apply, ``fallback`` cells ran the published attack because nothing models the defense, ``error``
cells failed (printed). The worst case takes, per image, the attacker's best over every column of its
threat model; a defense is private only if no image leaks and the audit is complete (an error or a
fallback makes it "inconclusive"). Each row also reports the accuracy after ``--rounds`` FedSGD rounds as a
fraction of the undefended run's (PMM) and the bytes a client uploads per round.

Writes benchmarks/results/matrix.{csv,md} and matrix_heatmap.png (``--output-dir`` to change); a batch
size above 1 adds ``_batch{B}`` to the names, a trained round ``_round{R}``.
``--quick`` is a CI-sized smoke run (2 images, tiny budgets, 10 rounds); the full run attacks 8 images.
"""

from __future__ import annotations

import argparse
import csv
import math
import multiprocessing
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, markdown_table

from lightning_gp.attacks import UnmodelledDefenseWarning
from lightning_gp.audit import (
    AttackBudget,
    LeakRule,
    SettingAudit,
    TrainingResult,
    audit_setting,
    defense_catalog,
    published_attacks,
    train_setting,
)
from lightning_gp.metrics.lpips import LPIPS
from lightning_gp.models import LeNetZhu


def choose_images(datamodule: Any, count: int, seed: int, batch_size: int = 1) -> list[list[int]]:
    """``count`` training images drawn by ``seed``, ``batch_size`` per client (``count`` a multiple of it)."""
    if count % batch_size:
        raise ValueError(f"--images ({count}) must be a multiple of --batch-size ({batch_size})")
    datamodule.setup("fit")
    generator = torch.Generator().manual_seed(seed)
    order = [int(i) for i in torch.randperm(len(datamodule.train_dataset), generator=generator)[:count]]
    return [order[c : c + batch_size] for c in range(0, count, batch_size)]


def _num(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def cell_text(audit: SettingAudit, attack: str) -> str:
    try:
        cell = audit.cell(attack)
    except KeyError:
        return "-"
    if cell.status == "n/a" or cell.means.get("psnr") is None:
        return cell.status
    text = f"{cell.means['psnr']:.1f} ({cell.leak_fraction:.0%})"
    if cell.trained_means:  # ATS: also against the transformed images the client trained on
        text += f" T {cell.trained_means['psnr']:.1f} ({cell.trained_leak_fraction:.0%})"
    return text + {"fallback": " fb", "error": " err"}.get(cell.status, "")


def rows_for(audits: list[SettingAudit], columns: list[str], training: dict[str, TrainingResult]) -> list[dict]:
    base = training.get("undefended")
    rows = []
    for audit in audits:
        row: dict[str, Any] = {"defense": audit.setting}
        for column in columns:
            row[column] = cell_text(audit, column)
        adaptive = [c for c in audit.cells if c.kind == "adaptive" and c.means.get("psnr") is not None]
        row["adaptive (best)"] = (
            max(f"{c.means['psnr']:.1f} ({c.leak_fraction:.0%})" for c in adaptive) if adaptive else "-"
        )
        for threat, worst in (("passive", audit.passive), ("active", audit.active)):
            if worst is None:
                row[f"{threat}: worst PSNR (leaked)"] = "-"
                row[f"{threat} verdict"] = "inconclusive"
                continue
            row[f"{threat}: worst PSNR (leaked)"] = f"{_num(worst.means['psnr'])} ({worst.leak_fraction:.0%})"
            row[f"{threat} verdict"] = worst.verdict
        worst = audit.active
        if worst is not None:
            row["worst SSIM"] = _num(worst.means["ssim"], ".3f")
            row["worst LPIPS"] = _num(worst.means.get("lpips"), ".3f")
            row["strongest"] = ", ".join(sorted({a for r in worst.rows for a in r.leaked_by})) or "-"
        result = training.get(audit.setting)
        if result is not None:
            row["test acc"] = f"{result.test_acc:.3f}"
            row["PMM"] = f"{result.test_acc / base.test_acc:.3f}" if base is not None else "-"
            row["upload/client-round"] = (
                f"{result.upload_bytes_per_client_round / 1024:.1f} KiB ({result.upload_ratio:.0%})"
            )
        rows.append(row)
    return rows


def csv_rows(audits: list[SettingAudit], training: dict[str, TrainingResult]) -> list[dict]:
    out = []
    for audit in audits:
        result = training.get(audit.setting)
        for cell in audit.cells:
            out.append(
                {
                    "defense": audit.setting,
                    "attack": cell.attack,
                    "kind": cell.kind,
                    "threat": cell.threat,
                    "status": cell.status,
                    "psnr": cell.means.get("psnr", math.nan),
                    "ssim": cell.means.get("ssim", math.nan),
                    "lpips": cell.means.get("lpips", math.nan),
                    "leak_fraction": cell.leak_fraction if cell.leak_fraction is not None else math.nan,
                    "seconds": cell.seconds,
                    "note": cell.note,
                }
            )
        for threat, worst in (("passive", audit.passive), ("active", audit.active)):
            if worst is None:
                continue
            cost = (
                f"test_acc={result.test_acc:.4f}; upload={result.upload_bytes_per_client_round:.0f}B; "
                if result
                else ""
            )
            out.append(
                {
                    "defense": audit.setting,
                    "attack": f"worst case ({threat})",
                    "kind": "worst",
                    "threat": threat,
                    "status": worst.verdict,
                    "psnr": worst.means["psnr"] if worst.means["psnr"] is not None else math.nan,
                    "ssim": worst.means["ssim"] if worst.means["ssim"] is not None else math.nan,
                    "lpips": worst.means.get("lpips") if worst.means.get("lpips") is not None else math.nan,
                    "leak_fraction": worst.leak_fraction,
                    "seconds": sum(c.seconds for c in audit.cells),
                    "note": cost + "; ".join(worst.verdict_reasons),
                }
            )
    return out


def heatmap(audits: list[SettingAudit], columns: list[str], path: Path, title: str = "FedSGD round 0") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*columns, "adaptive", "worst case"]
    values = torch.full((len(audits), len(names)), math.nan)
    labels = [["" for _ in names] for _ in audits]
    for i, audit in enumerate(audits):
        for j, column in enumerate(columns):
            try:
                cell = audit.cell(column)
            except KeyError:
                continue
            if cell.means.get("psnr") is not None:
                values[i, j] = min(cell.means["psnr"], 60.0)
                labels[i][j] = f"{cell.means['psnr']:.0f}\n{cell.leak_fraction:.0%}"
            else:
                labels[i][j] = cell.status
        adaptive = [c for c in audit.cells if c.kind == "adaptive" and c.means.get("psnr") is not None]
        if adaptive:
            best = max(adaptive, key=lambda c: c.means["psnr"])
            values[i, -2] = min(best.means["psnr"], 60.0)
            labels[i][-2] = f"{best.means['psnr']:.0f}\n{best.leak_fraction:.0%}"
        if audit.worst is not None and audit.worst.means["psnr"] is not None:
            values[i, -1] = min(audit.worst.means["psnr"], 60.0)
            labels[i][-1] = (
                f"{audit.worst.means['psnr']:.0f}\n{audit.worst.leak_fraction:.0%}\n{audit.worst.verdict[:5]}"
            )
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 3, 0.55 * len(audits) + 1.5))
    image = ax.imshow(values.numpy(), cmap="magma_r", vmin=0, vmax=60, aspect="auto")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_yticks(range(len(audits)), [a.setting for a in audits])
    for i in range(len(audits)):
        for j in range(len(names)):
            ax.text(j, i, labels[i][j], ha="center", va="center", fontsize=7, color="tab:cyan")
    fig.colorbar(image, ax=ax, label="mean PSNR (dB, capped at 60); text: PSNR / images leaked")
    ax.set_title(f"Defense x attack (LeNetZhu, {title}); worst case = per image, best attack")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_defense(job: tuple) -> tuple[SettingAudit, TrainingResult | None]:
    """One row: audit the defense's default setting, then train it (run in a worker process with ``--jobs``)."""
    name, dataset_name, indices, published_names, budget, rounds, args = job
    torch.set_num_threads(args.threads)
    datamodule = fashion_mnist_datasets(full=dataset_name == "fashion-mnist")[dataset_name]
    datamodule.batch_size = 500
    lpips_fn = None if args.no_lpips else LPIPS()
    start = time.perf_counter()
    setting = defense_catalog([name])[0].build(args.seed, 1)
    tag = f"[{setting.name}]"
    audit_round = getattr(args, "audit_round", 0)  # benchmarks/baselines.py audits round 0
    print(f"\n== {setting.name}" + (f" at round {audit_round}" if audit_round else ""), flush=True)
    if audit_round > 0 and setting.runner == "trainer":
        print(f"{tag} not audited at round {audit_round}: the plain-Trainer runner taps round 0 only", flush=True)
        return SettingAudit(setting.name, [], None, None), None
    L.seed_everything(args.seed, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("always", UnmodelledDefenseWarning)
        audit = audit_setting(
            setting,
            LeNetZhu(),
            datamodule,
            indices=indices,
            published=published_attacks(budget, published_names),
            budget=budget,
            seed=args.seed,
            lpips_fn=lpips_fn,
            log=lambda line: print(f"{tag} {line.strip()}", flush=True),
            round=audit_round,
        )
    for line in audit.summary_lines():
        print(f"{tag} {line}", flush=True)
    audit.results = {}  # the per-attack reconstructions stay in the worker (not needed for the tables)
    if getattr(args, "no_training", False):  # benchmarks/baselines.py reuses this worker
        print(f"{tag} audited in {time.perf_counter() - start:.0f} s (no training: --no-training)", flush=True)
        return audit, None
    L.seed_everything(args.seed, verbose=False)
    result = train_setting(setting, LeNetZhu(), datamodule, rounds=rounds, seed=args.seed)
    print(
        f"{tag} trained {rounds} rounds: test acc {result.test_acc:.3f}, upload "
        f"{result.upload_bytes_per_client_round / 1024:.1f} KiB/client-round; {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return audit, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI-sized: 2 images, tiny attack budgets, 10 rounds")
    parser.add_argument(
        "--sample", action="store_true", help="use the built-in sample even if the full set is installed"
    )
    parser.add_argument("--defenses", nargs="*", default=None, help="catalogue names (default: all)")
    parser.add_argument("--attacks", nargs="*", default=None, help="published attacks (default: all)")
    parser.add_argument("--images", type=int, default=None, help="attacked images in all (default 8)")
    parser.add_argument(
        "--batch-size", type=int, default=1, help="images per attacked client (default 1; --images a multiple of it)"
    )
    parser.add_argument(
        "--audit-rounds",
        type=int,
        nargs="+",
        default=[0],
        help="FedSGD rounds to audit, e.g. 0 50: round R after R rounds of training under the setting (default 0)",
    )
    parser.add_argument("--ig-iterations", type=int, default=None, help="Adam attacks' steps (default 1000)")
    parser.add_argument("--lbfgs-iterations", type=int, default=None, help="L-BFGS attacks' steps (default 100)")
    parser.add_argument(
        "--lbfgs-restarts", type=int, default=1, help="DLG/iDLG restarts, the lowest gradient distance kept (default 1)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="training rounds for accuracy/bytes (default 200)")
    parser.add_argument("--no-lpips", action="store_true", help="skip LPIPS")
    parser.add_argument(
        "--no-training",
        action="store_true",
        help="audit only: no accuracy/bytes columns (they depend on the defenses, not on the audit)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument(
        "--jobs", type=int, default=1, help="defenses run in parallel processes (e.g. 2 with --threads 1)"
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    quick = args.quick
    images = args.images or (2 if quick else 8)
    budget = AttackBudget(
        ig_iterations=args.ig_iterations or (40 if quick else 1000),
        lbfgs_iterations=args.lbfgs_iterations or (4 if quick else 100),
        rtf_bins=16 if quick else 64,
        lbfgs_restarts=args.lbfgs_restarts,
    )
    rounds = args.rounds or (10 if quick else 200)
    for flag, value in (("--images", images), ("--rounds", rounds), ("--batch-size", args.batch_size)):
        if value < 1:
            parser.error(f"{flag} must be >= 1")
    if images % args.batch_size:
        parser.error(f"--images ({images}) must be a multiple of --batch-size ({args.batch_size})")
    if any(r < 0 for r in args.audit_rounds):
        parser.error(f"--audit-rounds must be >= 0, got {args.audit_rounds}")
    torch.set_num_threads(args.threads)
    datasets = fashion_mnist_datasets(full=not args.sample)
    dataset_name = "fashion-mnist" if "fashion-mnist" in datasets else "sample"
    datamodule = datasets[dataset_name]
    datamodule.batch_size = 500
    entries = defense_catalog(args.defenses)
    published = published_attacks(budget, args.attacks)
    columns = [s.name for s in published]
    indices = choose_images(datamodule, images, args.seed, args.batch_size)
    published_names = [s.name for s in published]
    for audit_round in args.audit_rounds:
        round_args = argparse.Namespace(**vars(args), audit_round=audit_round)
        # the accuracy/bytes columns do not depend on the round audited: trained once, with the first
        round_args.no_training = args.no_training or audit_round != args.audit_rounds[0]
        run_matrix(round_args, entries, columns, published_names, indices, dataset_name, budget, rounds, images)


def run_matrix(
    args: argparse.Namespace,
    entries: list,
    columns: list[str],
    published_names: list[str],
    indices: list[list[int]],
    dataset_name: str,
    budget: AttackBudget,
    rounds: int,
    images: int,
) -> None:
    """Audit (and train) every defense at ``args.audit_round`` and write that round's table, CSV and heatmap."""
    quick, batch = args.quick, len(indices[0])
    chosen = [i for client in indices for i in client]
    at_round = f"FedSGD round {args.audit_round}" + (
        f" after {args.audit_round} rounds of training under the setting" if args.audit_round else ""
    )
    print(
        f"matrix: {len(entries)} defenses x {len(columns)} published attacks + adaptive, {len(indices)} clients x "
        f"{batch} images of {dataset_name} {chosen}, {at_round}, IG {budget.ig_iterations} / L-BFGS "
        f"{budget.lbfgs_iterations} iterations, {rounds} training rounds",
        flush=True,
    )
    jobs = [(name, dataset_name, indices, published_names, budget, rounds, args) for name in [e.name for e in entries]]
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(run_defense, jobs))
    else:
        done = [run_defense(job) for job in jobs]
    audits = [audit for audit, _ in done]
    training = {result.setting: result for _, result in done if result is not None}

    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows = rows_for(audits, columns, training)
    table = markdown_table(rows)
    preamble = (
        f"LeNetZhu at initialisation, {at_round}, {len(indices)} clients x {batch} image(s) of {dataset_name} "
        f"(training indices {chosen}, drawn with seed {args.seed}); attacks: IG/GradInversion/adaptive Adam "
        f"{budget.ig_iterations} iterations, DLG/iDLG/adaptive L-BFGS {budget.lbfgs_iterations} (DLG/iDLG: "
        f"{budget.lbfgs_restarts} restart(s), adaptive L-BFGS: 4), Robbing the Fed {budget.rtf_bins} bins. Cells: mean PSNR (dB) over the images (fraction of "
        f"images that attack leaks: {LeakRule().describe()}). 'adaptive (best)': the best of the defense's "
        "adaptive attacks; 'fb': it fell back to the published attack; 'err': it failed on some client (those images "
        "score 'not reconstructed'); 'T': scored against the transformed images the "
        "client trained on (ATS-T; the first score is against the raw images, ATS-R). Worst case: per image the "
        "attacker's best over the columns of a threat model: passive (honest-but-curious server: every attack but "
        "Robbing the Fed and ATS-aware Robbing) and active (malicious server: every column). A verdict is 'leaks' when "
        "an image leaks or a worst-case mean crosses Refiner's thresholds, else 'inconclusive' when the audit is "
        "incomplete (an error, a fallback), else 'private'. "
        + (
            "At a trained round the active attacks are not run (the active verdict names that gap), and a setting on "
            "the plain-Trainer runner (DP-SGD) is not audited. "
            if args.audit_round
            else ""
        )
        + (
            "Accuracy and bytes: not measured in this run (--no-training)."
            if args.no_training
            else f"Accuracy after {rounds} FedSGD rounds (10 clients x 8 images, server Adam 1e-3; PriPrune: "
            "FedAvg, local lr 0.25; DP-SGD: one batch of 80 per step); PMM = accuracy / undefended accuracy."
        )
        + (" QUICK RUN: budgets far too small for conclusions." if quick else "")
    )
    suffix = (
        (f"_batch{batch}" if batch > 1 else "")
        + (f"_round{args.audit_round}" if args.audit_round else "")
        + ("_quick" if quick else "")
    )
    (args.output_dir / f"matrix{suffix}.md").write_text(f"# matrix\n\n{preamble}\n\n{table}\n")
    detailed = csv_rows(audits, training)
    with open(args.output_dir / f"matrix{suffix}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(detailed[0]))
        writer.writeheader()
        writer.writerows(detailed)
    heatmap(audits, columns, args.output_dir / f"matrix{suffix}_heatmap.png", title=at_round.split(" after")[0])
    print("\n" + table)
    print(f"\nwritten: {args.output_dir / f'matrix{suffix}.md'}, .csv, matrix{suffix}_heatmap.png")


if __name__ == "__main__":
    main()
