"""Issue 49's measurement: one defense configuration against every attack of the suite, judged against
the prior, beside its formal bound, its utility at 1,000 clients a round and its cost.

For each client batch size, client algorithm (FedSGD; FedAvg with ``--local-epochs`` local epochs over the client's batch) and
audited round, the setting ``--setting`` is audited on ``--images`` training images by every published
attack, its adaptive attacks, the learned inverter and its refined variant, the generative image prior
(GGL) and the obfuscation-robust inversion (each judged with its prior-only control), Robbing the Fed,
and on the secure aggregate the passive attacks, Cocktail Party and LOKI (``audit_setting(aggregate=True)``):
four threat models, the honest-but-curious and the malicious server, each with and without secure
aggregation. Each row holds issue 49's bar (``benchmarks/prior_bar.py``):

- the reconstruction advantage over the prior (:mod:`lightning_gp.audit.advantage`): images any attack
  identifies against the best prior-only guess's count on 256 training images, with its 95% interval,
  at most 0.05;
- the per-client ReRo bound over a deployment of ``--deployment-rounds`` rounds of ``--cohort`` clients
  drawn from every client the training set makes at that batch size (Poisson client sampling), at the
  kappa measured on 256 training images: eta <= kappa + 0.10;
- PMM at ``--cohort`` clients a round under the row's algorithm, read from ``--utility``
  (``benchmarks/many_clients.py``'s CSVs; FedAvg's from its ``--algorithm fedavg --local-epochs`` runs,
  the audited client: ``--local-epochs`` epochs over one batch): at least 0.97;
- the client's step with the defense over the undefended step (LeNetZhu, one thread, CPU time; FedAvg: its local
  steps and the defense on their update): at most 1.2x.

    python benchmarks/defense_that_holds.py --setting 'DistributedGaussianMechanism(noise_multiplier=2.0, cohort_size=1000)' \\
        --batch-sizes 1 8 --algorithms fedsgd fedavg --rounds 0 50 --utility benchmarks/results/many_clients_distributed_dp_z2_z4.csv \\
        benchmarks/results/many_clients_distributed_dp_z2_fedavg.csv

``--dataset photo-crops`` audits RGB 3x32x32 crops of photographs with LeNetZhu sized to them, the model
``benchmarks/many_clients.py --dataset photo-crops`` measures PMM with (the step ratio stays the 28x28
one's). Each audit is stored as it finishes (``.<name>_audits.jsonl``): an interrupted run resumes.
Writes benchmarks/results/<name>.{csv,md} (a row per batch, algorithm, round and threat model, and which
limit binds) and <name>_images.csv (per image: why it leaks, whether it is identified).

``--beside-frontier`` attacks nothing: it reads the frontier's points (``benchmarks/frontier.py``,
whose grid holds the shipped strength) and puts the shipped setting's point beside the best point of
every other family at the same batch size and threat model (each family's private strength with the
highest PMM over every audited round, else its point closest to private;
``lightning_gp.frontier.report.family_bests``), as a table and a figure:

    python benchmarks/defense_that_holds.py --beside-frontier benchmarks/results/frontier.csv

writes benchmarks/results/defense_that_holds_beside_frontier.{csv,md,png}.

``--beside-matrix`` attacks nothing either: issue 49's bar on every row a matrix run finished (its
stored audits of 16 images; the bound, PMM and step of each row's setting as above):

    python benchmarks/defense_that_holds.py --beside-matrix benchmarks/results/.matrix_batch8_new_attackers_rows.jsonl \\
        --batch-sizes 8 --rounds 0 --name defense_that_holds_matrix_batch8

writes benchmarks/results/<name>_beside_matrix.{csv,md}.
"""

from __future__ import annotations

import argparse
import base64
import csv
import json
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import RESULTS_DIR, setting_builder, write_results
from prior_bar import (
    VIEWS,
    Deployment,
    PriorCounts,
    bar_rows,
    closest,
    deployment_bound,
    prior_counts,
    read_pmm,
    smallest_population,
)
from speed import client_step_ratio
from torch import nn

from lightning_gp.audit import AttackBudget, LeakRule, audit_setting, datamodule_recognition_tests, published_attacks
from lightning_gp.audit.advantage import identified_images
from lightning_gp.audit.figure import VERDICT_COLORS
from lightning_gp.audit.quiet import library_noise_silenced
from lightning_gp.audit.setting_audit import THREAT_MODELS
from lightning_gp.audit.summary import Candidate, format_score
from lightning_gp.data import FashionMNISTDataModule, FashionMNISTSampleDataModule, PhotoCropsDataModule
from lightning_gp.frontier.report import PSNR_CAP, family_bests, read_csv, setting_candidates
from lightning_gp.frontier.run import ResultStore, attacked_images, run_fingerprint
from lightning_gp.models import LeNetZhu

#: Issue 28's per-image PSNR line (its bar, which no defense can meet: an uninformed guess fails it),
#: drawn in the beside-the-frontier figure for reference.
ISSUE_28_PSNR = 15.0

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
        "Issue 49's bar (the advantage over the prior, eta at the measured kappa, PMM at 1,000 clients, the step) "
        "is measured by the rest of this script (defense_that_holds*.md).\n\n"
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
            ax.axhline(ISSUE_28_PSNR, color="black", ls="--", lw=1)
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--setting",
        default="DistributedGaussianMechanism(noise_multiplier=2.0, cohort_size=1000)",
        help="a catalogue name, or Name(keyword=literal, ...): that frontier family at those arguments",
    )
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="fashion-mnist")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--algorithms", choices=("fedsgd", "fedavg"), nargs="+", default=["fedsgd", "fedavg"])
    parser.add_argument(
        "--local-epochs",
        type=int,
        default=None,
        help="FedAvg's local epochs over the client's one batch, the client the audit attacks (default 5)",
    )
    # the option's name before 2026-11-30: the published run lines use it
    parser.add_argument("--local-steps", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, nargs="+", default=[0, 50])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--cohort", type=int, default=1000, help="clients per round of the deployment")
    parser.add_argument("--deployment-rounds", type=int, default=100)
    parser.add_argument(
        "--utility",
        type=Path,
        nargs="+",
        default=None,
        help="many_clients.py's CSVs with the setting's PMM (FedSGD's; FedAvg's from --algorithm fedavg runs)",
    )
    parser.add_argument(
        "--model-checks",
        action="store_true",
        help="the clients check the model they receive (DefenseSetting.with_model_checks: the digest in the "
        "secure sum, the model's provenance); an active attack they refuse is an n/a cell",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample", action="store_true", help="the built-in Fashion-MNIST sample")
    parser.add_argument("--name", default="defense_that_holds")
    parser.add_argument("--quick", action="store_true", help="tiny attack budgets: checks the script, measures nothing")
    parser.add_argument(
        "--beside-frontier",
        type=Path,
        default=None,
        help="attack nothing: the shipped point beside every family's best in this frontier CSV",
    )
    parser.add_argument("--shipped", default=SHIPPED, help="the shipped setting's name in the frontier")
    parser.add_argument(
        "--beside-matrix",
        type=Path,
        default=None,
        help="attack nothing: issue 49's bar on every row of this matrix row store "
        "(benchmarks/results/.matrix*_rows.jsonl, audited at the first --batch-sizes and --rounds)",
    )
    parser.add_argument("--step-only", action="store_true", help="attack nothing: the step ratios alone, three repeats")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.local_steps is not None:
        if args.local_epochs is not None:
            parser.error("--local-steps is the old name of --local-epochs: give one of them")
        print("defense_that_holds.py: --local-steps is deprecated; it is --local-epochs", file=sys.stderr)
        args.local_epochs = args.local_steps
    elif args.local_epochs is None:
        args.local_epochs = 5
    for name in ("images", "cohort", "deployment_rounds", "local_epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.batch_sizes) < 1 or min(args.rounds) < 0:
        parser.error("--batch-sizes must be at least 1 and --rounds at least 0")
    if args.beside_matrix is not None and not args.beside_matrix.is_file():
        parser.error(f"--beside-matrix: {args.beside_matrix} does not exist; run benchmarks/matrix.py first")
    for path in args.utility or []:
        if not path.is_file():
            parser.error(f"--utility: {path} does not exist; run benchmarks/many_clients.py first")
    return args


#: The datasets the bar is measured on: datamodule and model factory (full Fashion-MNIST needs
#: ``apt-get install dataset-fashion-mnist``; without it, ``--sample``).
DATASETS: dict[str, tuple[Callable[[bool], Any], Callable[[], nn.Module], int]] = {
    "fashion-mnist": (
        lambda sample: (
            FashionMNISTSampleDataModule(batch_size=500) if sample else FashionMNISTDataModule(batch_size=500)
        ),
        lambda: LeNetZhu(),
        1,
    ),
    "photo-crops": (lambda sample: PhotoCropsDataModule(seed=0), lambda: LeNetZhu(11, 3, 32), 3),
}


def audit_budget(quick: bool) -> AttackBudget:
    """Every attack of the suite at the audit's default budgets (``quick``: tiny ones)."""
    if quick:
        return AttackBudget(
            ig_iterations=2, lbfgs_iterations=2, rtf_bins=8, learned_inversion=True, learned_max_epochs=1,
            generative_prior=True, generative_max_steps=2,
        )  # fmt: skip
    return AttackBudget(learned_inversion=True, generative_prior=True)


def local_epochs(args: argparse.Namespace, algorithm: str) -> int:
    """The audited client's epochs over its batch: ``--local-epochs`` under FedAvg, one under FedSGD."""
    return args.local_epochs if algorithm == "fedavg" else 1


def step_ratio(setting: Any, batch_size: int, local_epochs: int = 1) -> float | None:
    """The client's step with ``setting``'s one defense over the undefended step (LeNetZhu, CPU time;
    FedAvg: its ``local_epochs`` local steps on its batch and the defense on their update); ``None`` where the setting
    is not one tensor defense."""
    callbacks = list(setting.callbacks)
    defense = getattr(callbacks[0], "defense", None) if len(callbacks) == 1 else None
    if defense is None:
        return None
    return client_step_ratio(defense, batch_size, 9, time.process_time, torch.device("cpu"), local_epochs)[2]


def run_audit(args: argparse.Namespace, setting: Any, datamodule: Any, point: dict[str, Any]) -> Any:
    """The audit of one (batch, algorithm, round) point, every threat model."""
    indices = attacked_images(datamodule, args.images, point["batch"], args.seed)
    fedavg = point["algorithm"] == "fedavg"
    with library_noise_silenced():
        L.seed_everything(args.seed, verbose=False)
        return audit_setting(
            setting, DATASETS[args.dataset][1](), datamodule, indices=indices,
            published=published_attacks(audit_budget(args.quick)), budget=audit_budget(args.quick), seed=args.seed,
            round=point["round"], aggregate=True, algorithm=point["algorithm"],
            local_epochs=args.local_epochs if fedavg else None, local_batch_size=point["batch"] if fedavg else None,
            log=lambda line: print(line, flush=True),
        )  # fmt: skip


def image_rows(audit: Any, point: dict[str, Any]) -> list[dict[str, Any]]:
    """Per image and threat model: its worst case, why it leaks, which attacks identify it."""
    rows = []
    for attribute, threat in VIEWS.items():
        worst = getattr(audit, attribute, None)
        if worst is None:
            continue
        identified = identified_images(worst)
        for position, row in enumerate(worst.rows):
            rows.append(
                {
                    **point, "threat model": threat, "image": row.index,
                    **{m: row.values.get(m) for m in ("psnr", "ssim", "semantic", "identification")},
                    "leaks": row.leaks, "identified by": ", ".join(identified.get(position, [])),
                    "why it leaks": "; ".join(f"{a}: {', '.join(c)}" for a, c in row.criteria.items()),
                }
            )  # fmt: skip
    return rows


def main() -> None:
    args = parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)  # before the audits, not after their hour of work
    if args.beside_frontier is not None:
        beside_the_frontier(args.beside_frontier, args.shipped, f"{args.name}_beside_frontier", args.output_dir)
        return
    torch.set_num_threads(1)
    if args.step_only:
        step_rows(args)
        return
    make_data, _, channels = DATASETS[args.dataset]
    datamodule = make_data(args.sample)
    datamodule.setup("fit")
    if args.beside_matrix is not None:
        bar_beside_matrix(args, datamodule, channels)
        return
    plain = setting_builder(args.setting, channels=channels)
    build = (lambda seed: plain(seed).with_model_checks()) if args.model_checks else plain
    rule = LeakRule().calibrated(datamodule_recognition_tests(datamodule, log=lambda line: None))
    prior = prior_counts(datamodule, rule, args.seed)
    print(f"prior: {prior.identified}/{prior.images} identified by the best fixed guess; kappa {prior.kappa:.3f}")
    # "local_steps" is --local-epochs' key under its old name: renaming the key would make every stored audit stale
    store = ResultStore(args.output_dir / f".{args.name}_audits.jsonl", run_fingerprint({
        "script": "defense_that_holds", "setting": args.setting, "dataset": args.dataset, "sample": args.sample,
        "images": args.images, "seed": args.seed, "local_steps": args.local_epochs, "quick": args.quick,
        "model_checks": args.model_checks,
        "budget": asdict(audit_budget(args.quick)),
    }))  # fmt: skip
    done, rows, images, attack_seconds = store.load(), [], [], 0.0
    for batch in args.batch_sizes:
        population = len(datamodule.train_dataset) // batch
        reference = build(args.seed)  # read for its bound and cost; each audit builds a fresh one
        needed = smallest_population(reference, args.cohort, args.deployment_rounds, prior.kappa)
        eta, bound_text = deployment_bound(
            reference, Deployment(args.cohort, population, args.deployment_rounds), prior.kappa
        )
        print(f"batch {batch}: eta {eta} ({bound_text})", flush=True)
        for algorithm in args.algorithms:
            epochs = local_epochs(args, algorithm)
            pmm = read_pmm(args.utility, (args.setting, plain(args.seed).name), batch, args.cohort, algorithm, epochs)
            ratio = step_ratio(reference, batch, epochs)
            print(f"batch {batch}, {algorithm}: PMM {pmm}; step {ratio}", flush=True)
            for round_ in args.rounds:
                point = {"batch": batch, "algorithm": algorithm, "round": round_}
                key = f"{batch}|{algorithm}|{round_}"
                if key not in done:
                    audit = run_audit(args, build(args.seed), datamodule, point)
                    done[key] = {"pickle": base64.b64encode(pickle.dumps(audit)).decode("ascii")}
                    store.append(key, done[key])
                audit = pickle.loads(base64.b64decode(done[key]["pickle"]))
                attack_seconds += sum(c.seconds for c in [*audit.cells, *(audit.aggregate_cells or [])])
                deployment = {"clients": population, "clients for eta": "none" if needed is None else needed}
                rows += bar_rows(audit, {**point, **deployment}, prior, eta, pmm, ratio)
                images += image_rows(audit, point)
                print(rows[-1], flush=True)
    write_bar_results(args, rows, images, prior, attack_seconds)


def step_rows(args: argparse.Namespace, repeats: int = 3) -> None:
    """``--step-only``: the step ratio of every batch size and algorithm, ``repeats`` times each, taking
    turns (on a shared machine, run it when nothing else does: the ratio drifts with the load)."""
    reference = setting_builder(args.setting)(args.seed)
    rows = []
    for repeat in range(repeats):
        for batch in args.batch_sizes:
            for algorithm in args.algorithms:
                ratio = step_ratio(reference, batch, local_epochs(args, algorithm))
                rows.append({"repeat": repeat, "batch": batch, "algorithm": algorithm, "step": ratio})
                print(rows[-1], flush=True)
    preamble = (
        f"The client's step with {args.setting} over the undefended step (LeNetZhu, one thread, CPU time; "
        f"FedAvg: {args.local_epochs} local steps on its batch and the defense on their update), {repeats} "
        f"repeats.\n\nRun: `python benchmarks/defense_that_holds.py --step-only --setting '{args.setting}' "
        f"--batch-sizes {' '.join(map(str, args.batch_sizes))} --algorithms {' '.join(args.algorithms)} "
        f"--local-epochs {args.local_epochs} --name {args.name}`"
    )
    write_results(f"{args.name}_step", rows, preamble, args.output_dir)


def bar_beside_matrix(args: argparse.Namespace, datamodule: Any, channels: int) -> None:
    """Issue 49's bar on every finished row of a matrix row store (its audits, unchanged; the bound, PMM
    and step of each row's setting as for the measured configuration)."""
    audits = {}
    for line in args.beside_matrix.read_text().splitlines():  # the last record of each row wins
        entry = json.loads(line)
        audits[entry["key"]] = entry["record"]
    rule = LeakRule().calibrated(datamodule_recognition_tests(datamodule, log=lambda line: None))
    prior = prior_counts(datamodule, rule, args.seed)
    batch, round_ = args.batch_sizes[0], args.rounds[0]
    population = len(datamodule.train_dataset) // batch
    rows: list[dict[str, Any]] = []
    for spec, record in audits.items():
        audit = pickle.loads(base64.b64decode(record["pickle"]))[0]
        setting = setting_builder(spec, channels=channels)(args.seed)
        eta, _ = deployment_bound(setting, Deployment(args.cohort, population, args.deployment_rounds), prior.kappa)
        pmm = read_pmm(args.utility, (spec, setting.name), batch, args.cohort)
        point = {"setting": spec, "batch": batch, "round": round_, "clients": population}
        rows += bar_rows(audit, point, prior, eta, pmm, step_ratio(setting, batch))
    preamble = (
        f"Issue 49's bar on the audits of `{args.beside_matrix}` (every row the matrix finished; batch {batch}, round "
        f"{round_}): the advantage over the prior (the best fixed guess identifies {prior.identified} of {prior.images} "
        f"training images), eta over {args.deployment_rounds} rounds of {args.cohort} of {population} clients at kappa "
        f"{prior.kappa:.3f}, PMM from {_utility_files(args)}, the LeNetZhu client step. {closest(rows)}.\n\n"
        f"Run: `python benchmarks/defense_that_holds.py --beside-matrix {args.beside_matrix} --batch-sizes {batch} "
        f"--rounds {round_}{_utility_option(args)}"
        f"{' --sample' if args.sample else ''}`"
    )
    write_results(f"{args.name}_beside_matrix", rows, preamble, args.output_dir)


def write_bar_results(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    images: list[dict[str, Any]],
    prior: PriorCounts,
    attack_seconds: float,
) -> None:
    """The table (with the closest rows and what binds them) and the per-image CSV; ``attack_seconds``:
    what the audits' attacks took, whether run now or read from the store."""
    with open(args.output_dir / f"{args.name}_images.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(images[0]))
        writer.writeheader()
        writer.writerows(images)
    preamble = (
        f"`{args.setting}` on {args.dataset}{' (the built-in sample)' if args.sample else ''}, {args.images} attacked "
        f"images per point (seed {args.seed}), every attack of the suite at the audit's default budgets (the learned "
        "inverter and GGL with their prior-only controls; on the secure aggregate Cocktail Party and LOKI). "
        f"The prior: the best fixed prior-only guess identifies {prior.identified} of {prior.images} training images "
        f"(the advantage's baseline); kappa {prior.kappa:.3f} (the full rule, ungated, 95% upper limit). eta: per "
        f"client over {args.deployment_rounds} rounds of {args.cohort} clients drawn from every client of the "
        "training set at that batch size. PMM: from "
        f"{_utility_files(args)} (the row's algorithm at {args.cohort} clients a round). Step: "
        "LeNetZhu client step, CPU time (FedAvg: its local steps and the defense on their update). The bar: advantage 'holds' (<= 0.05, no gap in the audit), eta <= kappa + "
        f"0.10, PMM >= 0.97, step <= 1.2x. {closest(rows)}. The audits' attacks: {attack_seconds / 60:.0f} min, one torch thread.\n\n"
        f"Run: `python benchmarks/defense_that_holds.py --setting '{args.setting}' --dataset {args.dataset} "
        f"--batch-sizes {' '.join(map(str, args.batch_sizes))} --algorithms {' '.join(args.algorithms)} --rounds "
        f"{' '.join(map(str, args.rounds))} --images {args.images}"
        f"{_utility_option(args)}{' --model-checks' if args.model_checks else ''}"
        f"{' --sample' if args.sample else ''}{' --quick' if args.quick else ''}{_non_default_options(args)}`"
    )
    write_results(args.name, rows, preamble, args.output_dir)


def _utility_files(args: argparse.Namespace) -> str:
    """Where the rows' PMM comes from, in words."""
    return " and ".join(map(str, args.utility)) if args.utility else "no --utility CSV"


def _utility_option(args: argparse.Namespace) -> str:
    """The run line's ``--utility`` option (empty without one)."""
    return f" --utility {' '.join(map(str, args.utility))}" if args.utility else ""


def _non_default_options(args: argparse.Namespace) -> str:
    """The options of the run line that differ from their defaults (the results' name among them), so
    the line rewrites the same files."""
    options = {"name": "defense_that_holds", "cohort": 1000, "deployment_rounds": 100, "seed": 0}
    if "fedavg" in args.algorithms:
        options["local_epochs"] = None  # always stated where FedAvg runs
    return "".join(
        f" --{name.replace('_', '-')} {getattr(args, name)}"
        for name, default in options.items()
        if getattr(args, name) != default
    )


if __name__ == "__main__":
    main()
