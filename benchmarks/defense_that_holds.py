"""Issue 28's measurement: one defense configuration against every attack of the suite, image by image.

For each client batch size and audited round, the catalogue setting ``--setting`` (default
``LocalGaussianMechanism``: z = 0.5, C = 1) is audited on ``--images`` training images by every
published attack, its adaptive attacks (with ``NoiseAwareMAP``), the learned inverter and its
refined variant (judged with the prior-only control) and the active Robbing the Fed (at a trained
round on the model built on that round's weights, where the setting carries no state across rounds),
at the audit's default budgets; with ``--aggregate`` also the secure-aggregation view (the
published passive attacks on the round's mean of the defended updates).

Besides the audit's verdicts, each image is held to issue 28's bar: worst-case PSNR < 15 dB, SSIM
< 0.3 and semantic score under its line, over every attack of the threat model.

    python benchmarks/defense_that_holds.py --batch-sizes 1 8 --rounds 0 50 --images 16 --aggregate

``--setting`` is a catalogue name, or ``Name(keyword=literal, ...)``: that frontier family at those
arguments (``'LocalGaussianMechanism(noise_multiplier=0.03)'``: the frontier's own point, by its name).

Data: full Fashion-MNIST when installed, else the built-in sample (``--sample`` forces it).
Writes benchmarks/results/<name>.{csv,md} (per audit) and <name>_images.csv (per image).

``--beside-frontier`` attacks nothing: it reads the frontier's points (``benchmarks/frontier.py``,
whose grid holds the shipped strength) and puts the shipped setting's point beside the best point of
every other family at the same batch size and threat model (each family's private strength with the
highest PMM over every audited round, else its point closest to private;
``lightning_gp.frontier.report.family_bests``), as a table and a figure:

    python benchmarks/defense_that_holds.py --beside-frontier benchmarks/results/frontier.csv

writes benchmarks/results/defense_that_holds_beside_frontier.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path

import lightning as L
import torch
from _common import RESULTS_DIR, setting_builder, write_results

from lightning_gp.audit import (
    AttackBudget,
    LeakRule,
    audit_setting,
    published_attacks,
)
from lightning_gp.audit.figure import VERDICT_COLORS
from lightning_gp.audit.quiet import library_noise_silenced
from lightning_gp.audit.setting_audit import THREAT_MODELS
from lightning_gp.audit.summary import Candidate, format_score
from lightning_gp.data import FashionMNISTDataModule, FashionMNISTSampleDataModule
from lightning_gp.frontier.report import PSNR_CAP, family_bests, read_csv, setting_candidates
from lightning_gp.frontier.run import attacked_images
from lightning_gp.metrics.semantic import SEMANTIC_LINE
from lightning_gp.models import LeNetZhu

#: Issue 28's per-image bar (the semantic line is the audit's).
BAR = {"psnr": 15.0, "ssim": 0.3, "semantic": SEMANTIC_LINE}


def below_bar(values: dict[str, float | None]) -> bool | None:
    """Whether an image's worst case is under every line of :data:`BAR` (``None``: a score is missing)."""
    for metric, line in BAR.items():
        value = values.get(metric)
        if value is None or math.isnan(value):
            return None
        if value >= line:
            return False
    return True


#: The shipped configuration's name in the frontier's grid (configs/frontier.yaml).
SHIPPED = "LocalGaussianMechanism(noise_multiplier=0.5)"


#: The shipped row's verdict where the frontier holds no audit of the shipped point at a batch size.
NOT_AUDITED = "not audited yet"


def _beside_row(size: int, threat: str, family: str, point: str, c: Candidate) -> dict[str, str | int]:
    return {
        "batch size": size,
        "threat model": threat,
        "family": family,
        "point": point,
        "verdict (every round)": f"{c.verdict} ({NOT_AUDITED})" if c.reason == NOT_AUDITED else c.verdict,
        "images leaked (worst round)": "-" if c.leak_fraction is None else f"{c.leak_fraction:.0%}",
        "worst PSNR (dB)": format_score(c.worst_psnr, ".1f"),
        "cost": c.cost or "-",
    }


def beside_the_frontier(path: Path, shipped: str, name: str, output_dir: Path = RESULTS_DIR) -> None:
    """The shipped setting's frontier point beside every other family's best, as a table and a figure."""
    if not path.is_file():
        raise SystemExit(f"--beside-frontier: {path} does not exist; run benchmarks/frontier.py first")
    points = read_csv(path)
    if not any(p.setting == shipped for p in points):
        raise SystemExit(
            f"--shipped {shipped!r} is not a point of {path}: add its strength to the frontier's grid "
            "(configs/frontier.yaml) and run benchmarks/frontier.py"
        )
    bests = family_bests([p for p in points if p.setting != shipped])
    sizes, stages = sorted({p.batch_size for p in points}), sorted({p.stage for p in points})
    rows, marks = [], {}
    for size in sizes:
        for threat in THREAT_MODELS:
            others = [b for b in bests if (b.batch_size, b.threat) == (size, threat) and b.candidate is not None]
            own = {c.name: c for c in setting_candidates(points, size, threat)}.get(shipped)
            if own is None and not others:
                continue
            if own is None:  # not audited at this batch size yet (or its records went stale): never private
                own = Candidate(shipped, "inconclusive", reason=NOT_AUDITED)
            marks[size, threat] = (own, [(b.grid, b.candidate) for b in others])
            rows.append(_beside_row(size, threat, "shipped", f"**{shipped}**", own))
            rows += [_beside_row(size, threat, b.grid, b.label, b.candidate) for b in others]
    rounds = " and ".join(map(str, stages))
    preamble = (
        f"From `{path}` ({len({p.setting for p in points})} settings). Each row is judged over rounds {rounds} "
        "together (private only if private at every round; a round not audited yet makes it inconclusive), as the "
        "frontier's recommendation is. 'shipped' is the shipped configuration's own frontier point; every other row is "
        "its family's private strength with the highest PMM, else its point closest to private. PMM is the "
        "frontier's: accuracy after its training (its num_clients per round) over the undefended run's; the shipped "
        "setting reaches PMM >= 0.97 only with many more clients per round (benchmarks/results/many_clients_*.md). "
        "Issue 28's bar per image (PSNR < 15 dB, SSIM < 0.3, semantic score under its line) is checked on 16 images "
        "by the rest of this script (defense_that_holds*.md).\n\n"
        f"Run: `python benchmarks/defense_that_holds.py --beside-frontier {path}`"
    )
    write_results(name, rows, preamble, output_dir)
    save_beside_figure(marks, shipped, output_dir / f"{name}.png", rounds)


#: The beside-the-frontier figure's family shapes (colour is the verdict, so shape names the family);
#: past the last, the shapes come again half filled.
FAMILY_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "h", "<", ">", "p", "d")


def family_marker(index: int) -> dict[str, str]:
    """The marker keywords of the ``index``-th family: a shape, filled whole or (second time round) half."""
    shape = FAMILY_MARKERS[index % len(FAMILY_MARKERS)]
    return {"marker": shape, "fillstyle": "full" if index < len(FAMILY_MARKERS) else "left"}


def save_beside_figure(
    marks: dict[tuple[int, str], tuple[Candidate, list[tuple[str, Candidate]]]],
    shipped: str,
    path: Path,
    rounds: str,
) -> None:
    """One panel per batch size (columns) and threat model (rows): x = PMM, y = worst-case PSNR over the
    rounds; each family's best point a marker of its own shape, filled by its verdict, the shipped one a
    star; the leak line and issue 28's bar. Families are named in one legend below the panels (labels
    beside the points overlap where the families crowd near PMM 1)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    sizes = sorted({size for size, _ in marks})
    families = sorted({family for _, others in marks.values() for family, _ in others})
    marker = {f: family_marker(i) for i, f in enumerate(families)}
    fig = Figure(figsize=(6.5 * len(sizes), 11), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(THREAT_MODELS), len(sizes), squeeze=False)
    for c_index, size in enumerate(sizes):
        for r_index, threat in enumerate(THREAT_MODELS):
            ax = axes[r_index][c_index]
            if (size, threat) not in marks:
                ax.set_axis_off()
                continue
            own, others = marks[size, threat]
            for family, c in [*others, ("shipped", own)]:
                if c.accuracy is None or c.worst_psnr is None:
                    continue
                star = family == "shipped"
                ax.plot(
                    [c.accuracy], [min(c.worst_psnr, PSNR_CAP)], ls="none",
                    **({"marker": "*"} if star else marker[family]), color=VERDICT_COLORS[c.verdict],
                    markerfacecoloralt="white", markersize=18 if star else 8, mec="black", mew=0.8 if star else 0.5,
                    alpha=1.0 if star else 0.85, zorder=5 if star else 3,
                )  # fmt: skip
            ax.axhline(LeakRule().thresholds["psnr"], color="#d73027", ls=":", lw=1.2)
            ax.axhline(BAR["psnr"], color="black", ls="--", lw=1)
            ax.set_title(f"batch {size}, {threat} server, rounds {rounds}", fontsize=10)
            ax.set_xlabel("PMM (frontier training)", fontsize=9)
            ax.set_ylabel(f"worst-case PSNR over the rounds (dB, cap {PSNR_CAP:g})", fontsize=9)
            ax.grid(alpha=0.3)
    handles = [Line2D([], [], ls="none", marker="*", ms=14, color="white", mec="black", label=f"shipped: {shipped}")]
    handles += [
        Line2D([], [], ls="none", **marker[f], ms=8, color="#9e9e9e", markerfacecoloralt="white", mec="black", label=f)
        for f in families
    ]
    handles += [
        Line2D([], [], ls="none", marker="s", ms=9, color=VERDICT_COLORS[v], mec="black", mew=0.5, label=v)
        for v in ("private", "leaks", "inconclusive")
    ]
    handles += [
        Line2D([], [], color="#d73027", ls=":", lw=1.2, label="leak line (PSNR 20 dB)"),
        Line2D([], [], color="black", ls="--", lw=1, label="issue 28's bar (PSNR 15 dB)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(
        f"{shipped} (star) beside each family's best point (shape: family; colour: verdict over rounds {rounds})",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.13, 1, 0.96))
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--setting",
        default="LocalGaussianMechanism",
        help="a catalogue name, or Name(keyword=literal, ...): that frontier family at those arguments",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, nargs="+", default=[0, 50])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--aggregate", action="store_true", help="also the secure-aggregation view")
    parser.add_argument(
        "--refined-decoys",
        type=int,
        default=AttackBudget().refined_decoys,
        help="the refined inverter's prior-only guesses (AttackBudget.refined_decoys; 255: a 1-in-256 control)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--name", default="defense_that_holds")
    parser.add_argument("--quick", action="store_true", help="tiny attack budgets: checks the script, measures nothing")
    parser.add_argument(
        "--beside-frontier",
        type=Path,
        default=None,
        help="attack nothing: the shipped point beside every family's best in this frontier CSV",
    )
    parser.add_argument("--shipped", default=SHIPPED, help="the shipped setting's name in the frontier")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)  # before the audits, not after their hour of work
    if args.beside_frontier is not None:
        beside_the_frontier(args.beside_frontier, args.shipped, f"{args.name}_beside_frontier", args.output_dir)
        return
    torch.set_num_threads(1)
    datamodule = FashionMNISTSampleDataModule(batch_size=500) if args.sample else FashionMNISTDataModule(batch_size=500)
    budget = AttackBudget(learned_inversion=True, learned_min_batch=1, refined_decoys=args.refined_decoys)
    if args.quick:
        budget = AttackBudget(
            ig_iterations=2, lbfgs_iterations=2, rtf_bins=8, learned_inversion=True, learned_max_epochs=1,
            refined_decoys=args.refined_decoys,
        )  # fmt: skip
    build = setting_builder(args.setting)
    rows, image_rows, total = [], [], time.perf_counter()
    for batch_size in args.batch_sizes:
        indices = attacked_images(datamodule, args.images, batch_size, args.seed)
        for round_ in args.rounds:
            setting = build(args.seed)
            start = time.perf_counter()
            with library_noise_silenced():
                L.seed_everything(args.seed, verbose=False)
                audit = audit_setting(
                    setting, LeNetZhu(), datamodule, indices=indices, published=published_attacks(budget),
                    budget=budget, seed=args.seed, round=round_, aggregate=args.aggregate and round_ == 0,
                    log=lambda line: print(line, flush=True),
                )  # fmt: skip
            seconds = time.perf_counter() - start
            views = {"passive": audit.passive, "active": audit.active}
            if audit.aggregate is not None:
                views["secure aggregation"] = audit.aggregate
            if audit.aggregate_active is not None:
                views["secure aggregation, malicious server"] = audit.aggregate_active
            for threat, worst in views.items():
                if worst is None:
                    continue
                bars = [below_bar(row.values) for row in worst.rows]
                for row, ok in zip(worst.rows, bars):
                    image_rows.append(
                        {
                            "setting": setting.name, "batch_size": batch_size, "round": round_, "threat": threat,
                            "image": row.index, **{m: row.values.get(m) for m in ("psnr", "ssim", "semantic")},
                            "leaks": row.leaks, "below_issue_bar": ok, "strongest": row.attacks.get("psnr"),
                            "why it leaks": "; ".join(f"{a}: {', '.join(c)}" for a, c in row.criteria.items()),
                        }
                    )  # fmt: skip
                worst_of = {
                    m: max((r.values[m] for r in worst.rows if r.values.get(m) is not None), default=None) for m in BAR
                }
                rows.append(
                    {
                        "setting": setting.name,
                        "batch_size": batch_size,
                        "round": round_,
                        "threat": threat,
                        "verdict": worst.verdict,
                        "leaked": f"{worst.leaked}/{len(worst.rows)}",
                        "max PSNR": f"{worst_of['psnr']:.1f}" if worst_of["psnr"] is not None else "-",
                        "max SSIM": f"{worst_of['ssim']:.3f}" if worst_of["ssim"] is not None else "-",
                        "max semantic": f"{worst_of['semantic']:.2f}" if worst_of["semantic"] is not None else "-",
                        "images under issue 28's bar": f"{sum(b is True for b in bars)}/{len(bars)}",
                        "reasons": "; ".join(worst.verdict_reasons)[:300],
                        "audit seconds": f"{seconds:.0f}",
                    }
                )
            print(rows[-1], flush=True)
    with open(args.output_dir / f"{args.name}_images.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(image_rows[0]))
        writer.writeheader()
        writer.writerows(image_rows)
    preamble = (
        f"LeNetZhu, {'the built-in sample' if args.sample else 'full Fashion-MNIST'}, {args.images} attacked images per "
        f"point (seed {args.seed}), every attack of the suite at the audit's default budgets (IG/GradInversion/adaptive "
        "Adam 1000 steps, L-BFGS 300 on convergence, Robbing the Fed 64 bins (at a trained round built on its weights where the setting allows it), the learned inverter with the "
        "prior-only control). Issue 28's bar per image: worst-case PSNR < 15 dB, SSIM < 0.3, semantic score < "
        f"{SEMANTIC_LINE:g}. Total {(time.perf_counter() - total) / 60:.0f} min, one torch thread.\n\n"
        f"Run: `python benchmarks/defense_that_holds.py --setting '{args.setting}' --batch-sizes "
        f"{' '.join(map(str, args.batch_sizes))} --rounds {' '.join(map(str, args.rounds))} --images {args.images}"
        f"{' --aggregate' if args.aggregate else ''}"
        f"{f' --refined-decoys {args.refined_decoys}' if args.refined_decoys != AttackBudget().refined_decoys else ''}"
        f"`; per image: `{args.name}_images.csv`."
    )
    write_results(args.name, rows, preamble, args.output_dir)


if __name__ == "__main__":
    main()
