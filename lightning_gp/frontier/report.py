"""The frontier read out: one point per setting, batch size, stage and threat model; the Pareto set;
the recommendation per batch size and threat model; the CSV, the Markdown and the figure.

- **Pareto set** (:func:`pareto_mask`): per batch size, stage and threat model, the points no other
  point beats on every axis at once: higher PMM, lower worst-case PSNR, lower leak fraction.
- **Recommendation** (:func:`recommend`): per batch size and threat model, one candidate per setting,
  judged over every audited stage together (:func:`~lightning_gp.audit.combined_verdict`: private only
  if private at every stage; a stage not audited makes it inconclusive), and the pick is
  :func:`~lightning_gp.audit.choose`'s: the private setting with the highest PMM, never an inconclusive
  one; with none private, "none in the grid" and the closest point.
- **Each family's best** (:func:`family_bests`): the same choice made within one grid line: the
  family's cheapest private strength, else its point closest to private.

Nothing here scores an attack: every verdict, leak fraction and PSNR is the audit's
(:func:`~lightning_gp.audit.audit_setting`), read from the records of
:mod:`~lightning_gp.frontier.run`.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from lightning_gp.audit.setting_audit import THREAT_MODELS
from lightning_gp.audit.summary import Candidate, Choice, choice_sentence, choose, combined_verdict, format_score
from lightning_gp.audit.verdict import LeakRule


@dataclass(frozen=True)
class FrontierPoint:
    """One setting at one batch size and stage, under one threat model.

    Attributes:
        grid, family, knob, value, index: the grid line and the strength (``index``: its position).
        setting: the setting's full name; ``batch_size``, ``stage`` (the audited round), ``threat``.
        verdict, leak_fraction, worst_psnr, worst_ssim, worst_lpips, reason, strongest: the audit's
            worst case over every attack of the threat model (``reason``: the verdict's first reason;
            ``strongest``: the attacks that leaked an image).
        rero_eta: the setting's ReRo bound at the rule's kappa (``None``: no formal bound).
        test_acc, pmm: accuracy after the training run and its ratio to the undefended run's at the
            same batch size; ``cost_ratio``: the training's wall time over the undefended reference's
            (the mean of the same rounds trained just before and after it in the same process; ``None``
            for a record without one);
            ``upload_bytes``, ``upload_ratio``: bytes a client uploads per round and over the dense size.
        audit_seconds: the attacks' time; ``pareto``: on the Pareto set of its client (batch size and
            training), stage and threat.
        training: how its clients trained before they shared (``"FedSGD"``, or e.g. ``"FedAvg E=5, b=8"``:
            :class:`~lightning_gp.frontier.grid.ClientTraining`); each is a frontier of its own.
    """

    grid: str
    family: str
    knob: str
    value: Any
    index: int
    setting: str
    batch_size: int
    stage: int
    threat: str
    verdict: str
    leak_fraction: float | None
    worst_psnr: float | None
    worst_ssim: float | None
    worst_lpips: float | None
    reason: str
    strongest: str
    rero_eta: float | None
    test_acc: float | None
    pmm: float | None
    cost_ratio: float | None
    upload_bytes: float | None
    upload_ratio: float | None
    audit_seconds: float
    pareto: bool = False
    training: str = "FedSGD"

    @property
    def client(self) -> str:
        """The client the point describes: its batch size, and its training where that is not FedSGD."""
        return client_label(self.batch_size, self.training)


def client_label(batch_size: int, training: str) -> str:
    """``"8"`` for a FedSGD client of 8 images, ``"8 (FedAvg E=5, b=8)"`` for a FedAvg one."""
    return str(batch_size) if training == "FedSGD" else f"{batch_size} ({training})"


def trainings(points: Sequence[Any]) -> list[str]:
    """The client trainings of ``points`` (FrontierPoint or Recommendation-like), FedSGD first."""
    return sorted({p.training for p in points}, key=lambda t: (t != "FedSGD", t))


def _reason(scores: dict[str, Any], record: dict[str, Any]) -> str:
    """The verdict's first reason, and the attacks an audit stopped before (its PSNR a lower bound)."""
    reason = (scores.get("reasons") or [""])[0]
    if record.get("skipped_attacks"):
        n = len(record["skipped_attacks"])
        reason += f"; every image leaked before the last {n} attack(s), not run (worst PSNR is a lower bound)"
    elif record.get("partial_attacks"):
        reason += "; later attacks skipped clients whose images had leaked (worst PSNR is a lower bound)"
    return reason


def _finite(value: Any) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def frontier_points(jobs: Sequence[Any], records: dict[str, dict[str, Any]]) -> list[FrontierPoint]:
    """The points of ``jobs`` from their finished ``records`` (by job key), Pareto flags set."""
    trained = {(j.setting, j.batch_size): records[j.key] for j in jobs if j.kind == "train" and j.key in records}
    # the undefended reference of each client training and batch size (named "+model checks" with the checks)
    references = {
        (j.training.label, j.batch_size): records[j.key]
        for j in jobs
        if j.kind == "train" and j.point.family == "undefended" and j.key in records
    }
    points = []
    for job in jobs:
        if job.kind != "audit" or job.key not in records:
            continue
        record = records[job.key]
        training = trained.get((job.setting, job.batch_size))
        base = references.get((job.training.label, job.batch_size))
        for threat in THREAT_MODELS:
            scores: dict[str, Any] = record["threats"][threat]
            points.append(
                FrontierPoint(
                    grid=job.point.grid,
                    family=job.point.family,
                    knob=job.point.knob,
                    value=job.point.value,
                    index=job.point.index,
                    setting=job.setting,
                    batch_size=job.batch_size,
                    stage=job.stage,
                    threat=threat,
                    verdict=scores["verdict"],
                    leak_fraction=_finite(scores.get("leak_fraction")),
                    worst_psnr=_finite(scores.get("psnr")),
                    worst_ssim=_finite(scores.get("ssim")),
                    worst_lpips=_finite(scores.get("lpips")),
                    reason=_reason(scores, record),
                    strongest=", ".join(scores.get("strongest", [])),
                    rero_eta=_finite(record.get("rero_eta")),
                    test_acc=None if training is None else training["test_acc"],
                    pmm=_ratio(training, base, "test_acc"),
                    cost_ratio=_cost_ratio(training),
                    upload_bytes=None if training is None else training["upload_bytes"],
                    upload_ratio=None if training is None else training["upload_bytes"] / training["dense_bytes"],
                    audit_seconds=float(record.get("seconds", 0.0)),
                    training=job.training.label,
                )
            )
    return _with_pareto(points)


def _cost_ratio(training: dict | None) -> float | None:
    if training is None or not training.get("reference_seconds"):
        return None
    return training["train_seconds"] / training["reference_seconds"]


def _ratio(record: dict | None, base: dict | None, name: str) -> float | None:
    if record is None or base is None or not base[name]:
        return None
    return record[name] / base[name]


def pareto_mask(objectives: Sequence[Sequence[float | None]]) -> list[bool]:
    """Which rows are Pareto-optimal when every objective is to be minimised: no other row is as low
    on every objective and lower on one. A row with an unknown (``None``/NaN) objective is never on
    the set (it cannot be compared), and never removes another."""
    known = [all(v is not None and not math.isnan(v) for v in row) for row in objectives]

    def dominates(a: Sequence[Any], b: Sequence[Any]) -> bool:
        return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))

    return [
        known[i] and not any(known[j] and dominates(objectives[j], row) for j in range(len(objectives)) if j != i)
        for i, row in enumerate(objectives)
    ]


def _with_pareto(points: list[FrontierPoint]) -> list[FrontierPoint]:
    """``points`` with ``pareto`` set per batch size, stage and threat model: higher PMM, lower
    worst-case PSNR, lower leak fraction."""
    out = list(points)
    groups: dict[tuple[str, int, int, str], list[int]] = {}
    for i, p in enumerate(points):
        groups.setdefault((p.training, p.batch_size, p.stage, p.threat), []).append(i)
    for members in groups.values():
        objectives = [[_negated(points[i].pmm), points[i].worst_psnr, points[i].leak_fraction] for i in members]
        for i, on in zip(members, pareto_mask(objectives)):
            out[i] = FrontierPoint(**{**asdict(points[i]), "pareto": on})
    return out


def _negated(value: float | None) -> float | None:
    return None if value is None else -value


@dataclass(frozen=True)
class Recommendation:
    """The pick for one batch size and threat model (``choice.pick`` is ``None``: none in the grid),
    judged over every stage together (``stage=None``) or at one stage only."""

    batch_size: int
    threat: str
    choice: Choice
    stage: int | None = None
    training: str = "FedSGD"

    @property
    def client(self) -> str:
        """The batch size, and the client training where that is not FedSGD."""
        return client_label(self.batch_size, self.training)

    @property
    def stages(self) -> str:
        return "all stages" if self.stage is None else f"round {self.stage}"


def _cost(points: Sequence[FrontierPoint]) -> str:
    p = points[0]
    if p.setting == "undefended":  # its PMM and time are 1 by definition; a measured ratio to itself reads as an error
        dense = "" if p.upload_ratio is None else f", upload {p.upload_ratio:.0%} of dense (exact zeros go sparse)"
        return f"the reference{dense}"
    parts = []
    if p.pmm is not None:
        parts.append(f"PMM {p.pmm:.2f}")
    if p.cost_ratio is not None:
        parts.append(f"time x{p.cost_ratio:.2f}")
    if p.upload_ratio is not None:
        parts.append(f"upload {p.upload_ratio:.0%}")
    return ", ".join(parts)


def setting_candidates(
    points: Sequence[FrontierPoint], batch_size: int, threat: str, training: str = "FedSGD"
) -> list[Candidate]:
    """One :class:`~lightning_gp.audit.Candidate` per setting at ``batch_size`` under ``threat``, with
    clients that train as ``training`` says, judged over every stage together (the worst stage's leak
    fraction and PSNR)."""
    stages = sorted({p.stage for p in points})
    by_setting: dict[str, list[FrontierPoint]] = {}
    for p in points:
        if p.batch_size == batch_size and p.threat == threat and p.training == training:
            by_setting.setdefault(p.setting, []).append(p)
    candidates = []
    for name, found in by_setting.items():
        verdicts = [p.verdict for p in found] + ["inconclusive"] * (len(stages) - len(found))
        leaks = [p.leak_fraction for p in found if p.leak_fraction is not None]
        psnrs = [p.worst_psnr for p in found if p.worst_psnr is not None]
        worst = max(found, key=lambda p: (p.verdict == "leaks", p.leak_fraction or 0.0))
        candidates.append(
            Candidate(
                name=name,
                verdict=combined_verdict(verdicts),
                leak_fraction=max(leaks) if len(leaks) == len(found) else None,
                worst_psnr=max(psnrs) if len(psnrs) == len(found) else None,
                accuracy=found[0].pmm,
                cost=_cost(found),
                reason=f"round {worst.stage}: {worst.reason}" if worst.reason else "",
            )
        )
    return candidates


def recommend(points: Sequence[FrontierPoint]) -> list[Recommendation]:
    """Per batch size and threat model, :func:`~lightning_gp.audit.choose` over the settings judged
    over every stage together; with more than one stage, also at each stage alone (at a trained round
    the active attacks run only on settings without state across rounds, so the all-stage active
    pick of a stateful setting is never private; its round-0 pick still says which setting holds
    against the malicious server where that server was audited)."""
    stages = sorted({p.stage for p in points})
    out = []
    for training in trainings(points):
        for size in sorted({p.batch_size for p in points if p.training == training}):
            for threat in THREAT_MODELS:
                only = stages[0] if len(stages) == 1 else None  # one stage audited: say which
                choice = choose(setting_candidates(points, size, threat, training))
                out.append(Recommendation(size, threat, choice, only, training))
                for stage in stages if len(stages) > 1 else []:
                    at_stage = [p for p in points if p.stage == stage]
                    choice = choose(setting_candidates(at_stage, size, threat, training))
                    out.append(Recommendation(size, threat, choice, stage, training))
    return out


@dataclass(frozen=True)
class FamilyBest:
    """One grid line's best point at one batch size under one threat model, judged over every stage
    together (``choice.pick``: its private strength with the highest PMM; else ``choice.closest``)."""

    grid: str
    batch_size: int
    threat: str
    choice: Choice
    training: str = "FedSGD"

    @property
    def client(self) -> str:
        """The batch size, and the client training where that is not FedSGD."""
        return client_label(self.batch_size, self.training)

    @property
    def candidate(self) -> Candidate | None:
        """The pick, else the closest point."""
        return self.choice.pick or self.choice.closest

    @property
    def label(self) -> str:
        """The pick's name, else "none private; closest: <name>"."""
        c = self.candidate
        if c is None:
            return "nothing audited"
        return c.name if self.choice.pick is not None else f"none private; closest: {c.name}"


def family_bests(points: Sequence[FrontierPoint]) -> list[FamilyBest]:
    """Per batch size, threat model and grid line (in the order they come), :func:`recommend`'s choice
    made among that grid line's settings alone (each judged over every stage of ``points``: a stage a
    setting lacks makes it inconclusive)."""
    out = []
    for training in trainings(points):
        for size in sorted({p.batch_size for p in points if p.training == training}):
            for threat in THREAT_MODELS:
                candidates = {c.name: c for c in setting_candidates(points, size, threat, training)}
                for grid in dict.fromkeys(p.grid for p in points):
                    names = dict.fromkeys(p.setting for p in points if p.grid == grid and p.setting in candidates)
                    if names:
                        out.append(FamilyBest(grid, size, threat, choose([candidates[n] for n in names]), training))
    return out


_FAMILY_TABLE_HEAD = (
    "| batch size | threat model | family | best point | verdict | images leaked | worst PSNR (dB) | cost |\n"
    "|---|---|---|---|---|---|---|---|"
)


def _candidate_row(client: str, threat: str, family: str, name: str, candidate: Candidate) -> str:
    """One row of the family table: ``candidate`` shown as ``name``."""
    leaked = "-" if candidate.leak_fraction is None else f"{candidate.leak_fraction:.0%}"
    return (
        f"| {client} | {threat} | {family} | {name} | {candidate.verdict} | {leaked} | "
        f"{format_score(candidate.worst_psnr, '.1f')} | {candidate.cost or '-'} |"
    )


def family_table(bests: Sequence[FamilyBest]) -> str:
    """The Markdown table of :func:`family_bests`."""
    lines = [_FAMILY_TABLE_HEAD]
    for b in bests:
        if b.candidate is not None:
            lines.append(_candidate_row(b.client, b.threat, b.grid, b.label, b.candidate))
    return "\n".join(lines)


def recommendation_table(recommendations: Sequence[Recommendation]) -> str:
    """The Markdown table: the cheapest private setting per batch size and threat model, or "none in
    the grid" with the closest point."""
    lines = [
        "| batch size | threat model | stages | recommendation | verdict | images leaked | worst PSNR (dB) | cost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in recommendations:
        c = r.choice.pick or r.choice.closest
        if c is None:
            lines.append(f"| {r.client} | {r.threat} | {r.stages} | nothing audited | - | - | - | - |")
            continue
        name = f"**{c.name}**" if r.choice.pick is not None else f"none in the grid; closest: {c.name}"
        leaked = "-" if c.leak_fraction is None else f"{c.leak_fraction:.0%}"
        lines.append(
            f"| {r.client} | {r.threat} | {r.stages} | {name} | {c.verdict} | {leaked} | "
            f"{format_score(c.worst_psnr, '.1f')} | {c.cost or '-'} |"
        )
    return "\n".join(lines)


def write_csv(points: Sequence[FrontierPoint], path: Path) -> None:
    """One row per point (setting x batch size x stage x threat model)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in fields(FrontierPoint)])
        writer.writeheader()
        writer.writerows(asdict(p) for p in points)


_CSV_TYPES: dict[str, Callable[[str], Any]] = {
    "index": int,
    "batch_size": int,
    "stage": int,
    "audit_seconds": float,
    "pareto": lambda text: text == "True",
}


def read_csv(path: Path) -> list[FrontierPoint]:
    """The points :func:`write_csv` wrote (an empty score is ``None``; ``value`` comes back as text)."""
    optional = {f.name for f in fields(FrontierPoint) if "None" in str(f.type)}
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    points = []
    for row in rows:
        values: dict[str, Any] = {}
        for name, text in row.items():
            if name in optional:
                values[name] = None if text == "" else float(text)
            else:
                values[name] = _CSV_TYPES.get(name, str)(text)
        points.append(FrontierPoint(**values))
    return points


def frontier_markdown(points: Sequence[FrontierPoint], *, title: str, context: Sequence[str] = ()) -> str:
    """The report: the recommendation table, each pick in a sentence, each Pareto set, every point."""
    recommendations = recommend(points)
    stages = sorted({p.stage for p in points})
    lines = [f"# {title}", "", *context, "", "## Recommendation", "", recommendation_table(recommendations), ""]
    for r in recommendations:
        lines.append(f"- batch {r.client}, {r.threat}, {r.stages}: {choice_sentence(r.choice, 'PMM', 'setting')}")
    lines += [
        "",
        "## Each family's best point",
        "",
        (
            "Per grid line, the same choice among its own strengths: its private point with the highest PMM, "
            f"judged over every stage audited so far together (rounds {', '.join(map(str, stages))}), else its point "
            "closest to private."
        ),
        "",
        family_table(family_bests(points)),
    ]
    lines += ["", "## Pareto sets (higher PMM, lower worst-case PSNR, lower leak fraction)", ""]
    order = {t: i for i, t in enumerate(trainings(points))}
    groups = sorted(
        {(p.training, p.batch_size, p.stage, p.threat) for p in points}, key=lambda g: (order[g[0]], *g[1:])
    )
    for training, size, stage, threat in groups:
        front = [p for p in points if (p.training, p.batch_size, p.stage, p.threat) == (training, size, stage, threat)]
        front = sorted((p for p in front if p.pareto), key=lambda p: -(p.pmm or 0.0))
        text = "; ".join(
            f"{p.setting} (PMM {_num(p.pmm, '.2f')}, {_num(p.worst_psnr, '.1f')} dB, {p.verdict})" for p in front
        )
        client = client_label(size, training)
        lines.append(f"- batch {client}, round {stage}, {threat}: {text or 'none (PMM not measured)'}")
    lines += [
        "",
        "## Every point",
        "",
        (
            "| setting | batch | round | threat | verdict | leaked | worst PSNR | worst SSIM | ReRo eta | PMM | time "
            "| upload | Pareto | reason |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p.setting} | {p.client} | {p.stage} | {p.threat} | {p.verdict} | "
            f"{'-' if p.leak_fraction is None else f'{p.leak_fraction:.0%}'} | {_num(p.worst_psnr, '.1f')} | "
            f"{_num(p.worst_ssim, '.3f')} | {_num(p.rero_eta, '.3f')} | {_num(p.pmm, '.2f')} | "
            f"{_num(p.cost_ratio, '.2f')} | {'-' if p.upload_ratio is None else f'{p.upload_ratio:.0%}'} | "
            f"{'yes' if p.pareto else ''} | {p.reason.replace('|', '/')} |"
        )
    lines += ["", f"Leak rule (per image, any attack): {LeakRule().describe()}."]
    return "\n".join(lines) + "\n"


def _num(value: float | None, spec: str) -> str:
    return format_score(value, spec)


PSNR_CAP = 60.0  # an exact copy (inf dB) is drawn at the cap


def save_frontier_figure(points: Sequence[FrontierPoint], path: Path, *, title: str = "") -> None:
    """One panel per batch size and stage (rows) and threat model (columns): x = PMM, y = worst-case
    PSNR, one line per grid (its strengths in order), the Pareto set ringed and joined, the leak line
    (the rule's PSNR threshold) drawn, private points filled."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    order = {t: i for i, t in enumerate(trainings(points))}
    rows = sorted({(p.training, p.batch_size, p.stage) for p in points}, key=lambda r: (order[r[0]], *r[1:]))
    if not rows:  # a report of a run with no audit finished yet
        fig = Figure(figsize=(6, 2), dpi=100)
        FigureCanvasAgg(fig)
        fig.text(0.5, 0.5, f"{title}\nno audited point yet", ha="center", va="center", fontsize=11)
        fig.savefig(path, dpi=100)
        return
    grids = list(dict.fromkeys(p.grid for p in points))
    colours = colormaps["tab20"]
    colour = {g: colours(i % 20) for i, g in enumerate(grids)}
    fig = Figure(figsize=(11, 3.6 * len(rows) + 1.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), len(THREAT_MODELS), squeeze=False)
    line = LeakRule().thresholds["psnr"]
    for r, (training, size, stage) in enumerate(rows):
        for c, threat in enumerate(THREAT_MODELS):
            ax = axes[r][c]
            group = [
                p for p in points if (p.training, p.batch_size, p.stage, p.threat) == (training, size, stage, threat)
            ]
            for g in grids:
                line_points = sorted((p for p in group if p.grid == g and _plottable(p)), key=lambda p: p.index)
                if not line_points:
                    continue
                xs = [p.pmm for p in line_points]
                ys = [min(p.worst_psnr, PSNR_CAP) for p in line_points]  # type: ignore[type-var]
                marker = "*" if g == "undefended" else "o"
                ax.plot(xs, ys, "-", marker=marker, color=colour[g], markersize=7 if g == "undefended" else 4, lw=1)
                for p, x, y in zip(line_points, xs, ys):
                    if p.verdict == "private":
                        ax.plot([x], [y], "s", mfc="none", mec="#1a9850", mew=1.5, markersize=9, zorder=4)
            front = sorted((p for p in group if p.pareto and _plottable(p)), key=lambda p: p.pmm)  # type: ignore[arg-type, return-value]
            if front:
                fx = [p.pmm for p in front]
                fy = [min(p.worst_psnr, PSNR_CAP) for p in front]  # type: ignore[type-var]
                ax.plot(fx, fy, "--", color="black", lw=1.2, zorder=5)
                ax.plot(fx, fy, "o", mfc="none", mec="black", markersize=10, mew=1.5, zorder=5)
            ax.axhline(line, color="#d73027", ls=":", lw=1.5)
            ax.set_title(f"batch {client_label(size, training)}, round {stage}, {threat} server", fontsize=10)
            ax.set_xlabel("PMM (accuracy / undefended accuracy)", fontsize=9)
            ax.set_ylabel(f"worst-case PSNR (dB, cap {PSNR_CAP:g})", fontsize=9)
            ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colour[g], marker="*" if g == "undefended" else "o", label=g) for g in grids]
    handles += [
        Line2D([], [], color="black", ls="--", marker="o", mfc="none", label="Pareto set"),
        Line2D([], [], color="#d73027", ls=":", label=f"leak line (PSNR {line:g} dB)"),
        Line2D([], [], color="#1a9850", ls="", marker="s", mfc="none", label="private (green square)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 1.0 / (3.6 * len(rows) + 1.6), 1, 0.97))
    fig.savefig(path, dpi=100)


def _plottable(p: FrontierPoint) -> bool:
    return p.pmm is not None and p.worst_psnr is not None
