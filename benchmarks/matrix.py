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
rounds of training under each setting (its defenses' state carried; the malicious server's model
is built on the round-R weights where no client state carries across rounds, else the active attacks
are not run there and the active verdict names the gap), one table per round.

A cell is the mean PSNR over the images with, in the Markdown, the fraction of images that attack
leaks (the audit's leak rule, ``lightning_gp.audit.LeakRule``); ``n/a`` cells say why the attack does
not apply, ``fallback`` cells ran the published attack because nothing models the defense, ``error``
cells failed (printed). The worst case takes, per image, the attacker's best over every column of its
threat model; a defense is private only if no image leaks and the audit is complete (an error or a
fallback makes it "inconclusive"). Each row also reports the accuracy after ``--rounds`` FedSGD rounds as a
fraction of the undefended run's (PMM) and the bytes a client uploads per round.

``--model-checks`` gives every row's clients the replay of the public record (they refuse a model it
does not explain: Robbing the Fed's and LOKI's); ``--defenses`` takes catalogue names or frontier points
(``'TopKPruning(rate=0.8)'``); ``--model MLP`` audits a fully connected first layer (Cocktail Party's;
LeNetZhu is conv-first); ``--generative-prior`` adds GGL with each setting's defense knowledge;
``--aggregate`` adds the secure-aggregation views, each with its worst case and verdict: the honest
server (the passive attacks, Cocktail Party among them, on the round's mean of every client's defended
update) and the malicious server (LOKI too).

Writes benchmarks/results/matrix.{csv,md}, matrix_heatmap.png (mean PSNR and share leaked per cell,
PMM and the verdicts per row) and matrix_summary.md (one screen: which setting to pick and why,
``lightning_gp.audit.summary``); a run with training also writes matrix_training.csv (accuracy and
bytes per setting). ``--output-dir`` to change where; a batch size above 1 adds ``_batch{B}``
to the names, a trained round ``_round{R}``, ``--model MLP`` ``_mlp``, ``--tag T`` ``_T``. ``--replot`` redraws the heatmap and the
summary from the CSVs already written, without attacking or training again. ``--quick`` is a
CI-sized smoke run (2 images, tiny budgets, 10 rounds); the full run attacks 8 images.

An interrupted run resumes: each defense's row is kept as it finishes in
``<output-dir>/.matrix[_batchB][_roundR][_quick]_rows.jsonl`` (a pickle per line, read back only by this
script; ignored by git), keyed by a fingerprint of everything the row depends on (images, attacks,
budgets, rounds, seed, the leak rule's and the attacks' revisions), and the same command skips the
rows already there. ``--fresh`` recomputes every row.
"""

from __future__ import annotations

import argparse
import base64
import csv
import functools
import math
import pickle
import textwrap
import time
import traceback
import warnings
from collections.abc import Callable
from concurrent.futures import as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import RESULTS_DIR, fashion_mnist_datasets, markdown_table, setting_builder

from lightning_gp.attacks import LABEL_RECOVERY_REVISION, UnmodelledDefenseWarning
from lightning_gp.audit import (
    AttackBudget,
    LeakRule,
    SettingAudit,
    TrainingResult,
    WorstCaseReport,
    audit_setting,
    defense_catalog,
    published_attacks,
    train_setting,
)
from lightning_gp.audit.figure import VERDICT_COLORS
from lightning_gp.audit.summary import Candidate, choice_sentence, choose, combined_verdict, summary_markdown
from lightning_gp.frontier.run import ResultStore, run_fingerprint
from lightning_gp.frontier.workers import worker_pool
from lightning_gp.metrics.lpips import LPIPS
from lightning_gp.models import MLP, LeNetZhu

#: ``--model``: the architectures the matrix audits (MLP: a fully connected first layer, which Cocktail
#: Party needs; LeNetZhu is conv-first).
MODELS: dict[str, Callable[[], torch.nn.Module]] = {"LeNetZhu": LeNetZhu, "MLP": MLP}
#: The worst cases a row can report: the per-client threat models, then with ``--aggregate`` the
#: secure-aggregation views (honest server: the passive attacks on the round's mean of the defended
#: updates, Cocktail Party included; malicious server: also the attacks that send each client its own
#: model, LOKI).
THREATS = ("passive", "active", "aggregate", "aggregate_active")
THREAT_LABELS = {
    "passive": "passive",
    "active": "active",
    "aggregate": "secure aggregation",
    "aggregate_active": "secure aggregation, malicious server",
}
#: The heatmap's shorter names for them (its caption spells out "SA").
SHORT_THREAT_LABELS = {**THREAT_LABELS, "aggregate": "SA honest", "aggregate_active": "SA malicious"}


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


def threat_reports(audit: SettingAudit) -> list[tuple[str, WorstCaseReport | None]]:
    """The worst case per threat model the audit reports (:data:`THREATS`; ``None``: no attack of it
    produced a report, "inconclusive"): the secure-aggregation views only where they were audited."""
    reports = [("passive", audit.passive), ("active", audit.active)]
    if audit.aggregate is not None or audit.aggregate_cells:
        reports += [("aggregate", audit.aggregate), ("aggregate_active", audit.aggregate_active)]
    return reports


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
        for threat, worst in threat_reports(audit):
            label = THREAT_LABELS[threat]
            if worst is None:
                row[f"{label}: worst PSNR (leaked)"] = "-"
                row[f"{label} verdict"] = "inconclusive"
                continue
            row[f"{label}: worst PSNR (leaked)"] = f"{_num(worst.means['psnr'])} ({worst.leak_fraction:.0%})"
            row[f"{label} verdict"] = worst.verdict
        bound = audit.bound
        row["ReRo eta (kappa)"] = (
            "no formal bound"
            if bound is None or bound.mechanism is None
            else "-"
            if bound.eta is None or bound.kappa is None
            else f"{bound.eta:.3f} ({bound.kappa:.3f})"
        )
        worst = audit.active  # every row has every column: one without any report (every attack failed) too
        row["worst SSIM"] = _num(worst.means["ssim"], ".3f") if worst else "-"
        row["worst LPIPS"] = _num(worst.means.get("lpips"), ".3f") if worst else "-"
        row["strongest"] = _strongest(worst)
        if audit.aggregate_cells:
            row["secure aggregation: strongest"] = _strongest(audit.aggregate_active or audit.aggregate)
        result = training.get(audit.setting)
        if training:
            row["test acc"] = f"{result.test_acc:.3f}" if result else "-"
            row["PMM"] = f"{result.test_acc / base.test_acc:.3f}" if result and base else "-"
            row["upload/client-round"] = (
                f"{result.upload_bytes_per_client_round / 1024:.1f} KiB ({result.upload_ratio:.0%})" if result else "-"
            )
        rows.append(row)
    return rows


def _strongest(worst: WorstCaseReport | None) -> str:
    """The attacks that leak some image of a worst case, by name."""
    return (", ".join(sorted({a for r in worst.rows for a in r.leaked_by})) if worst else "") or "-"


def csv_rows(audits: list[SettingAudit], training: dict[str, TrainingResult]) -> list[dict]:
    """One CSV row per cell and per worst case; a secure-aggregation cell is of kind ``"aggregate"``
    (threat ``aggregate`` or ``aggregate_active``), so a reader keeps it apart from the per-client cell
    of the same attack."""
    out = []
    for audit in audits:
        result = training.get(audit.setting)
        aggregate_cells = [
            (cell, "aggregate", f"aggregate{'_active' if cell.threat == 'active' else ''}")
            for cell in audit.aggregate_cells
        ]
        for cell, kind, threat in [*((c, c.kind, c.threat) for c in audit.cells), *aggregate_cells]:
            out.append(
                {
                    "defense": audit.setting,
                    "attack": cell.attack,
                    "kind": kind,
                    "threat": threat,
                    "status": cell.status,
                    "psnr": cell.means.get("psnr", math.nan),
                    "ssim": cell.means.get("ssim", math.nan),
                    "lpips": cell.means.get("lpips", math.nan),
                    "leak_fraction": cell.leak_fraction if cell.leak_fraction is not None else math.nan,
                    "seconds": cell.seconds,
                    "note": cell.note,
                }
            )
        for threat, worst in threat_reports(audit):
            if worst is None:
                out.append(
                    {
                        "defense": audit.setting, "attack": f"worst case ({threat})", "kind": "worst",
                        "threat": threat, "status": "inconclusive", "psnr": math.nan, "ssim": math.nan,
                        "lpips": math.nan, "leak_fraction": math.nan, "seconds": sum(c.seconds for c in audit.cells),
                        "note": "no attack produced a report" + ("" if audit.cells else " (not audited)"),
                    }
                )  # fmt: skip
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


Score = tuple[float | None, float | None, str]  # (mean PSNR, share of images leaked, status or verdict)


@dataclass
class MatrixRow:
    """One row of the heatmap and the summary: what the audit and the training say of one setting
    (built from the audits of this run, :func:`matrix_rows`, or from the CSVs, :func:`rows_from_csv`)."""

    setting: str
    cells: dict[str, Score] = field(default_factory=dict)  # published attack -> its score
    adaptive: Score | None = None  # the best of the setting's adaptive attacks
    worst: dict[str, Score] = field(default_factory=dict)  # threat model -> worst case and verdict
    reasons: dict[str, str] = field(default_factory=dict)  # threat model -> the verdict's first reason
    test_acc: float | None = None
    upload_bytes: float | None = None
    dense_bytes: float | None = None


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def matrix_rows(audits: list[SettingAudit], columns: list[str], training: dict[str, TrainingResult]) -> list[MatrixRow]:
    """The heatmap's rows from this run's audits and training."""
    rows = []
    for audit in audits:
        row = MatrixRow(audit.setting)
        for column in columns:
            try:
                cell = audit.cell(column)
            except KeyError:
                continue
            row.cells[column] = (_finite_or_none(cell.means.get("psnr")), cell.leak_fraction, cell.status)
        adaptive = [c for c in audit.cells if c.kind == "adaptive" and c.means.get("psnr") is not None]
        if adaptive:
            best = max(adaptive, key=lambda c: c.means["psnr"])
            row.adaptive = (best.means["psnr"], best.leak_fraction, best.status)
        for threat, worst in threat_reports(audit):
            if worst is None:
                row.worst[threat] = (None, None, "inconclusive")
                row.reasons[threat] = "no attack produced a report"
                continue
            row.worst[threat] = (_finite_or_none(worst.means["psnr"]), worst.leak_fraction, worst.verdict)
            row.reasons[threat] = worst.verdict_reasons[0] if worst.verdict_reasons else ""
        result = training.get(audit.setting)
        if result is not None:
            row.test_acc = result.test_acc
            row.upload_bytes = result.upload_bytes_per_client_round
            row.dense_bytes = result.dense_bytes_per_client_round
        rows.append(row)
    return rows


def _number(text: str) -> float | None:
    try:
        return _finite_or_none(float(text))
    except (TypeError, ValueError):
        return None


def rows_from_csv(path: Path, training_path: Path | None = None) -> tuple[list[MatrixRow], list[str], str]:
    """The heatmap's rows and published columns from a matrix CSV (what ``csv_rows`` wrote), and where
    the accuracy comes from: the CSV's own notes (a run with training), else ``training_path``
    (``matrix_training.csv``: defense, rounds, test_acc, upload_bytes, dense_bytes, source)."""
    with open(path, newline="") as handle:
        records = list(csv.DictReader(handle))
    rows: dict[str, MatrixRow] = {}
    columns: list[str] = []
    adaptive: dict[str, list[Score]] = {}
    for record in records:
        row = rows.setdefault(record["defense"], MatrixRow(record["defense"]))
        score: Score = (_number(record["psnr"]), _number(record["leak_fraction"]), record["status"])
        if record["kind"] == "published":
            row.cells[record["attack"]] = score
            if record["attack"] not in columns:
                columns.append(record["attack"])
        elif record["kind"] == "adaptive":
            if score[0] is not None:
                adaptive.setdefault(row.setting, []).append(score)
        elif record["kind"] == "worst":
            row.worst[record["threat"]] = score
            notes = record["note"].split("; ")
            fields = dict(n.split("=", 1) for n in notes if "=" in n and n.split("=", 1)[0] in ("test_acc", "upload"))
            reasons = [n for n in notes if not ("=" in n and n.split("=", 1)[0] in ("test_acc", "upload"))]
            row.reasons[record["threat"]] = reasons[0] if reasons else ""
            if "test_acc" in fields:
                row.test_acc = float(fields["test_acc"])
                row.upload_bytes = float(fields["upload"].removesuffix("B"))
    for setting, scores in adaptive.items():
        rows[setting].adaptive = max(scores, key=lambda s: s[0] if s[0] is not None else -math.inf)
    source = f"the training recorded in {path.name}"
    if not any(r.test_acc is not None for r in rows.values()):
        source = "not measured (--no-training)"
        if training_path is not None and training_path.is_file():
            with open(training_path, newline="") as handle:
                trained = {r["defense"]: r for r in csv.DictReader(handle)}
            for row in rows.values():
                if row.setting in trained:
                    row.test_acc = _number(trained[row.setting]["test_acc"])
                    row.upload_bytes = _number(trained[row.setting]["upload_bytes"])
                    row.dense_bytes = _number(trained[row.setting]["dense_bytes"])
            sources = sorted({r["source"] for r in trained.values() if r.get("source")})
            source = training_path.name + "".join(f", {s}" for s in sources)
    return list(rows.values()), columns, source


def training_rows(training: dict[str, TrainingResult], source: str) -> list[dict]:
    """``matrix_training.csv``: what each setting cost (read back by ``--replot`` of a run without training)."""
    return [
        {
            "defense": r.setting,
            "rounds": r.rounds,
            "test_acc": r.test_acc,
            "upload_bytes": r.upload_bytes_per_client_round,
            "dense_bytes": r.dense_bytes_per_client_round,
            "source": source,
        }
        for r in training.values()
    ]


def pmm(rows: list[MatrixRow]) -> dict[str, float | None]:
    """Accuracy relative to the undefended row's (PMM), per setting (``None``: not measured)."""
    base = next((r.test_acc for r in rows if r.setting == "undefended"), None)
    return {r.setting: None if r.test_acc is None or not base else r.test_acc / base for r in rows}


def upload_ratio(row: MatrixRow, rows: list[MatrixRow]) -> float | None:
    """Bytes a client uploads per round relative to the dense gradient (the undefended upload when the row
    does not say its own dense size)."""
    dense = row.dense_bytes or next((r.upload_bytes for r in rows if r.setting == "undefended"), None)
    return None if row.upload_bytes is None or not dense else row.upload_bytes / dense


def candidates(rows: list[MatrixRow], threats: tuple[str, ...] = ("passive", "active")) -> list[Candidate]:
    """The summary's candidates: one per setting, judged over ``threats`` together (private only if
    private against every one; the leak and PSNR of the worst of them)."""
    ratios = pmm(rows)
    out = []
    for row in rows:
        scores = [row.worst.get(t, (None, None, "inconclusive")) for t in threats]
        verdict = combined_verdict(s[2] for s in scores)
        leaks = [s[1] for s in scores if s[1] is not None]
        psnrs = [s[0] for s in scores if s[0] is not None]
        reason = next((row.reasons.get(t, "") for t in threats if row.worst.get(t, ("", "", ""))[2] != "private"), "")
        ratio = upload_ratio(row, rows)
        out.append(
            Candidate(
                row.setting,
                verdict,
                max(leaks) if leaks else None,
                max(psnrs) if psnrs else None,
                accuracy=ratios[row.setting],
                cost=f"upload {ratio:.0%}" if ratio is not None else "",
                reason=reason,
            )
        )
    return out


def matrix_summary(rows: list[MatrixRow], accuracy_source: str, setup: str = "", suffix: str = "") -> str:
    """``matrix_summary.md``: the pick against both servers (the active worst case covers every attack)
    and, if it differs, against an honest-but-curious server only."""
    both = candidates(rows)
    passive, combined = choose(candidates(rows, ("passive",))), choose(both)
    notes = []
    if (passive.pick and passive.pick.name) != (combined.pick and combined.pick.name):
        notes.append("Against an honest-but-curious server only: " + choice_sentence(passive, "PMM"))
    context = [
        "Judged against both servers (passive and active; a setting is private only if private against each). "
        + (f"{setup} " if setup else "")
        + f"PMM: accuracy relative to undefended, from {accuracy_source}. Every cell: matrix{suffix}.md, "
        f"matrix{suffix}.csv; the picture: matrix{suffix}_heatmap.png."
    ]
    return summary_markdown(
        "Defense matrix: which setting to pick",
        both,
        rule=LeakRule().describe(),
        context=context,
        notes=notes,
        accuracy_name="PMM",
    )


def _line(points: float) -> float:
    """One line of text of ``points`` in inches, with the line spacing."""
    return points * 1.35 / 72


def _text_color(rgba: tuple[float, ...]) -> str:
    """Black on a light background, white on a dark one (relative luminance of the cell's colour)."""
    r, g, b = rgba[:3]
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "white"


def _psnr_text(score: Score | None) -> str:
    if score is None:
        return "-"
    psnr, leak, status = score
    if psnr is None:
        return status if status != "ok" else "-"
    text = ("inf" if math.isinf(psnr) else f"{psnr:.0f}") + (f"\n{leak:.0%}" if leak is not None else "")
    return text + {"fallback": " fb", "error": " err"}.get(status, "")


def heatmap(
    rows: list[MatrixRow], columns: list[str], path: Path, pick: str | None = None, stage: str = ""
) -> dict[str, Any]:
    """Draw the heatmap; return what it shows (``columns``; per row its ``labels`` and ``texts``,
    ``colors`` the text colour of each cell), for tests.

    PSNR cells (each published attack, the best adaptive one, the worst case per threat model) are
    coloured by mean PSNR (capped at 60 dB) with "PSNR / share of images leaked" in black or white by
    the background's luminance; then the PMM (accuracy relative to undefended) and the verdict per
    threat model, coloured red (leaks), orange (inconclusive) or green (private). ``pick``: the
    setting the summary picks, its label in bold; ``stage``: the round audited, in the title.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap, Normalize
    from matplotlib.figure import Figure

    threats = tuple(t for t in THREATS if t in ("passive", "active") or any(t in r.worst for r in rows))
    psnr_names = [*columns, "adaptive (best)", *(f"{SHORT_THREAT_LABELS[t]} worst" for t in threats)]
    names = [*psnr_names, "PMM", *(f"{SHORT_THREAT_LABELS[t]} verdict" for t in threats)]
    ratios = pmm(rows)
    n, m = len(rows), len(psnr_names)
    scores: list[list[Score | None]] = [
        [*(r.cells.get(c) for c in columns), r.adaptive, *(r.worst.get(t) for t in threats)] for r in rows
    ]
    values = [[math.nan if s is None or s[0] is None else min(s[0], 60.0) for s in row] for row in scores]

    font = 10  # pt: 14 px at DPI 100
    # the layout in inches: label | PSNR cells | PMM | verdicts, under the title and the rotated column names
    label_in = max(len(r.setting) for r in rows) * 0.6 * font / 72 + 0.3
    cell_w, cell_h, gap, pad = 0.9, 0.46, 0.12, 0.3
    width = label_in + (m + 1 + len(threats)) * cell_w + 2 * gap + 1.1  # 1.1: room for the last rotated column name
    title = textwrap.wrap(
        "Every defense against every attack"
        + (f" ({stage})" if stage else "")
        + ": PSNR and share of images leaked, worst case per threat model, accuracy kept (PMM), verdicts",
        int((width - 2 * pad) * 72 / (0.6 * 12)),
    )
    caption = textwrap.wrap(
        "Worst case: per image, the attacker's best over the attacks of the threat model"
        + (
            " (SA: secure aggregation, the attacks on the round's mean update; honest or malicious server)"
            if len(threats) > 2
            else ""
        )
        + ". PMM: accuracy / "
        f"undefended accuracy (n/m: not measured). Leak rule: {LeakRule().describe()}.",
        int((width - 2 * pad) * 72 / (0.55 * font)),
    )
    caption_in = len(caption) * _line(font) + pad
    bar_y = caption_in + 0.55  # the colour bar, its ticks and label under it
    grid_y = bar_y + 0.15 + 0.35
    grid_h = n * cell_h
    height = grid_y + grid_h + 1.3 + len(title) * _line(12) + pad  # 1.3: the rotated column names
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)

    def axes(x: float, y: float, w: float, h: float) -> Any:
        return fig.add_axes((x / width, y / height, w / width, h / height))

    x_acc = label_in + m * cell_w + gap
    ax_psnr = axes(label_in, grid_y, m * cell_w, grid_h)
    ax_acc = axes(x_acc, grid_y, cell_w, grid_h)
    ax_verdict = axes(x_acc + cell_w + gap, grid_y, len(threats) * cell_w, grid_h)
    bar = axes(label_in, bar_y, m * cell_w, 0.15)
    cmap = colormaps["magma_r"].with_extremes(bad="#eeeeee")
    norm = Normalize(0, 60)
    image = ax_psnr.imshow(values, cmap=cmap, norm=norm, aspect="auto")
    acc_cmap = colormaps["Greens"].with_extremes(bad="#eeeeee")
    acc_norm = Normalize(0.0, 1.3)
    accuracy = [[math.nan if ratios[r.setting] is None else ratios[r.setting]] for r in rows]
    ax_acc.imshow(accuracy, cmap=acc_cmap, norm=acc_norm, aspect="auto")
    codes = {"leaks": 0, "inconclusive": 1, "private": 2}
    verdict_cmap = ListedColormap([VERDICT_COLORS["leaks"], VERDICT_COLORS["inconclusive"], VERDICT_COLORS["private"]])
    verdicts = [[r.worst.get(t, (None, None, "inconclusive"))[2] for t in threats] for r in rows]
    ax_verdict.imshow(
        [[codes[v] for v in row] for row in verdicts], cmap=verdict_cmap, vmin=-0.5, vmax=2.5, aspect="auto"
    )

    texts: list[list[str]] = []
    colors: list[list[str]] = []
    for i, row in enumerate(rows):
        row_texts, row_colors = [], []
        for j, score in enumerate(scores[i]):
            text = _psnr_text(score)
            color = "#555555" if math.isnan(values[i][j]) else _text_color(cmap(norm(values[i][j])))
            ax_psnr.text(j, i, text, ha="center", va="center", fontsize=font, color=color)
            row_texts.append(text)
            row_colors.append(color)
        ratio = ratios[row.setting]
        text = "n/m" if ratio is None else f"{ratio:.2f}"
        color = "#555555" if ratio is None else _text_color(acc_cmap(acc_norm(ratio)))
        ax_acc.text(0, i, text, ha="center", va="center", fontsize=font, color=color)
        row_texts.append(text)
        row_colors.append(color)
        for j, verdict in enumerate(verdicts[i]):
            text = {"inconclusive": "inconcl."}.get(verdict, verdict)
            ax_verdict.text(j, i, text, ha="center", va="center", fontsize=font, color="white", fontweight="bold")
            row_texts.append(text)
            row_colors.append("white")
        texts.append(row_texts)
        colors.append(row_colors)

    labels = [f"{r.setting}  [pick]" if r.setting == pick else r.setting for r in rows]
    for ax, first, count in ((ax_psnr, 0, m), (ax_acc, m, 1), (ax_verdict, m + 1, len(threats))):
        ax.set_xticks(range(count), names[first : first + count], rotation=35, ha="right", fontsize=font)
        ax.xaxis.tick_top()
        ax.tick_params(axis="x", labeltop=True, labelbottom=False)
        for tick in ax.get_xticklabels():
            tick.set_rotation_mode("anchor")
            tick.set_ha("left")
        ax.set_yticks(range(n), labels if ax is ax_psnr else [], fontsize=font)
        ax.set_xticks([x - 0.5 for x in range(1, count)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, n)], minor=True)
        ax.grid(which="minor", color="white", linewidth=1)
        ax.tick_params(which="minor", length=0)
    for tick, row in zip(ax_psnr.get_yticklabels(), rows):
        if row.setting == pick:
            tick.set_fontweight("bold")
    for x in (len(columns) - 0.5, len(columns) + 0.5):  # published | adaptive | worst cases
        ax_psnr.axvline(x, color="black", linewidth=2)
    fig.text(
        pad / width,
        1 - pad / height,
        "\n".join(title),
        fontsize=12,
        fontweight="bold",
        va="top",
        ha="left",
        linespacing=1.3,
    )
    colorbar = fig.colorbar(image, cax=bar, orientation="horizontal")
    colorbar.set_label("mean PSNR (dB, capped at 60); cell text: PSNR / share of images leaked", fontsize=font)
    colorbar.ax.tick_params(labelsize=font)
    fig.text(pad / width, pad / height, "\n".join(caption), fontsize=font, va="bottom", ha="left", linespacing=1.3)
    fig.savefig(path, dpi=100)
    return {"columns": names, "labels": labels, "texts": texts, "colors": colors}


def run_defense(job: tuple) -> tuple[SettingAudit, TrainingResult | None]:
    """One row: audit the defense's default setting, then train it (run in a worker process with ``--jobs``)."""
    name, dataset_name, indices, published_names, budget, rounds, args = job
    torch.set_num_threads(args.threads)
    datamodule = fashion_mnist_datasets(full=dataset_name == "fashion-mnist")[dataset_name]
    datamodule.batch_size = 500
    lpips_fn = None if args.no_lpips else LPIPS()
    start = time.perf_counter()
    setting = setting_builder(name, "--defenses")(args.seed)
    if getattr(args, "model_checks", False):  # benchmarks/baselines.py has no such option
        setting = setting.with_model_checks()
    model = MODELS[getattr(args, "model", "LeNetZhu")]  # benchmarks/baselines.py audits LeNetZhu
    tag = f"[{setting.name}]"
    audit_round = getattr(args, "audit_round", 0)  # benchmarks/baselines.py audits round 0
    print(f"\n== {setting.name}" + (f" at round {audit_round}" if audit_round else ""), flush=True)
    L.seed_everything(args.seed, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("always", UnmodelledDefenseWarning)
        audit = audit_setting(
            setting,
            model(),
            datamodule,
            indices=indices,
            published=published_attacks(budget, published_names),
            budget=budget,
            seed=args.seed,
            lpips_fn=lpips_fn,
            log=lambda line: print(f"{tag} {line.strip()}", flush=True),
            round=audit_round,
            aggregate=getattr(args, "aggregate", False),
        )
    for line in audit.summary_lines():
        print(f"{tag} {line}", flush=True)
    audit.results = {}  # the per-attack reconstructions stay in the worker (not needed for the tables)
    if getattr(args, "no_training", False):  # benchmarks/baselines.py reuses this worker
        print(f"{tag} audited in {time.perf_counter() - start:.0f} s (no training: --no-training)", flush=True)
        return audit, None
    L.seed_everything(args.seed, verbose=False)
    result = train_setting(setting, model(), datamodule, rounds=rounds, seed=args.seed)
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
    parser.add_argument(
        "--defenses",
        nargs="*",
        default=None,
        help="catalogue names, or Name(keyword=literal, ...) for that frontier family's point, e.g. "
        "'TopKPruning(rate=0.8)' (default: the whole catalogue)",
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="LeNetZhu", help="the audited model")
    parser.add_argument(
        "--aggregate",
        action="store_true",
        help="also the secure-aggregation views: the honest server (passive attacks on the mean of the round's "
        "defended updates, Cocktail Party among them) and the malicious server (LOKI too)",
    )
    parser.add_argument(
        "--generative-prior",
        action="store_true",
        help="also GGL with each setting's defense knowledge (a DCGAN trained once on the public split, cached)",
    )
    parser.add_argument(
        "--model-checks",
        action="store_true",
        help="every row's clients accept only the public record's model (DefenseSetting.with_model_checks): "
        "an active attack that sends another model is refused",
    )
    parser.add_argument("--tag", default="", help="appended to the output files' names, e.g. new_attackers")
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
    parser.add_argument(
        "--lbfgs-iterations",
        type=int,
        default=None,
        help="L-BFGS attacks' cap on outer steps; they stop on convergence (default 300)",
    )
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
    parser.add_argument(
        "--learned-inversion",
        action="store_true",
        help="also run the learned inverter and its refined variant (trains one network per setting)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument(
        "--jobs", type=int, default=1, help="defenses run in parallel processes (e.g. 2 with --threads 1)"
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--fresh", action="store_true", help="recompute every row (default: keep the rows an interrupted run finished)"
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="redraw the heatmap and the summary from matrix[_batchB][_roundR][_quick].csv in --output-dir (no "
        "attack, no training; --batch-size, --audit-rounds and --quick name the run); accuracy from its notes, else "
        "from the run's _training.csv there",
    )
    args = parser.parse_args()
    quick = args.quick
    if args.replot:
        for audit_round in args.audit_rounds:
            stage = figure_stage(args.batch_size, audit_round)
            replot(args.output_dir, matrix_suffix(args.batch_size, audit_round, quick, args.model, args.tag), stage)
        return
    images = args.images or (2 if quick else 8)
    budget = AttackBudget(
        ig_iterations=args.ig_iterations or (40 if quick else 1000),
        lbfgs_iterations=args.lbfgs_iterations or (4 if quick else 300),
        rtf_bins=16 if quick else 64,
        learned_inversion=args.learned_inversion,
        learned_max_epochs=2 if quick else 60,
        generative_prior=args.generative_prior,
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
    names = args.defenses or [e.name for e in defense_catalog()]
    for name in names:  # a bad name or spec stops here, before any attack
        setting_builder(name, "--defenses")
    published = published_attacks(budget, args.attacks)
    columns = [s.name for s in published]
    indices = choose_images(datamodule, images, args.seed, args.batch_size)
    published_names = [s.name for s in published]
    failures: list[str] = []
    for audit_round in args.audit_rounds:
        round_args = argparse.Namespace(**vars(args), audit_round=audit_round)
        # the accuracy/bytes columns do not depend on the round audited: trained once, with the first
        round_args.no_training = args.no_training or audit_round != args.audit_rounds[0]
        failed = run_matrix(round_args, names, columns, published_names, indices, dataset_name, budget, rounds, images)
        failures += [f"round {audit_round}: {name}: {error}" for name, error in failed.items()]
    if failures:
        raise SystemExit(
            f"matrix: {len(failures)} rows failed ({'; '.join(failures)}); every other row is kept, and the same "
            "command again runs only the failed ones and writes the tables"
        )


def run_matrix(
    args: argparse.Namespace,
    names: list[str],
    columns: list[str],
    published_names: list[str],
    indices: list[list[int]],
    dataset_name: str,
    budget: AttackBudget,
    rounds: int,
    images: int,
) -> dict[str, str]:
    """Audit (and train) every defense at ``args.audit_round`` and write that round's table, CSV and
    heatmap. A row that raises (or whose worker dies) is not stored and does not stop the others: the
    failed rows are returned by name with their error, and that round's tables are not written."""
    quick, batch = args.quick, len(indices[0])
    chosen = [i for client in indices for i in client]
    at_round = f"FedSGD round {args.audit_round}" + (
        f" after {args.audit_round} rounds of training under the setting" if args.audit_round else ""
    )
    print(
        f"matrix: {len(names)} defenses x {len(columns)} published attacks + adaptive, {len(indices)} clients x "
        f"{batch} images of {dataset_name} {chosen}, {at_round}, IG {budget.ig_iterations} / L-BFGS "
        f"{budget.lbfgs_iterations} iterations, {rounds} training rounds",
        flush=True,
    )
    suffix = matrix_suffix(batch, args.audit_round, quick, args.model, args.tag)
    store = row_store(args, suffix, dataset_name, indices, published_names, budget, rounds)
    rows_done = {} if args.fresh else store.load()
    by_name = {name: pickle.loads(base64.b64decode(rows_done[name]["pickle"])) for name in names if name in rows_done}
    # a row an older version did not audit (DP-SGD at a trained round) runs now
    by_name = {name: row for name, row in by_name.items() if row[0].passive is not None or row[0].active is not None}
    if by_name:
        print(f"matrix: {len(by_name)} of {len(names)} rows already in {store.path}", flush=True)
    jobs = [
        (name, dataset_name, indices, published_names, budget, rounds, args) for name in names if name not in by_name
    ]

    failed: dict[str, str] = {}

    def keep(name: str, compute: Callable[[], tuple[SettingAudit, TrainingResult | None]]) -> None:
        try:
            row = compute()
        except Exception as err:  # one broken row must not cost the hours of the others
            failed[name] = f"{type(err).__name__}: {err}"
            traceback.print_exception(err)
            print(f"matrix: row {name} FAILED ({failed[name]}); not stored, a rerun retries it", flush=True)
            return
        by_name[name] = row
        store.append(name, {"pickle": base64.b64encode(pickle.dumps(row)).decode("ascii")})

    if args.jobs > 1 and len(jobs) > 1:
        with worker_pool(args.jobs) as pool:
            futures = {pool.submit(run_defense, job): job[0] for job in jobs}
            for future in as_completed(futures):
                keep(futures[future], future.result)
    else:
        for job in jobs:
            keep(job[0], functools.partial(run_defense, job))
    if failed:
        print(f"matrix: round {args.audit_round}: {len(failed)} rows failed, its tables are not written", flush=True)
        return failed
    done = [by_name[name] for name in names]
    audits = [audit for audit, _ in done]
    training = {result.setting: result for _, result in done if result is not None}

    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows = rows_for(audits, columns, training)
    table = markdown_table(rows)
    preamble = (
        f"{args.model}{'' if args.audit_round else ' at initialisation'}, {at_round}, {len(indices)} clients x {batch} image(s) of {dataset_name} "
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
            "GGL: a DCGAN trained once on the public split, its latent searched through each setting's own "
            "defense (adaptive:GenerativeGradientLeakage), judged against its prior-only guesses. "
            if budget.generative_prior
            else ""
        )
        + (
            "Secure aggregation: the honest server runs the passive attacks (Cocktail Party among them) on the "
            "round's mean of every client's defended update, every image of every client scored; the malicious "
            "server also sends each client its own model (LOKI). "
            if args.aggregate
            else ""
        )
        + (
            "At a trained round the malicious server builds its model on that round's weights, replayed where no "
            "client state carries across rounds; elsewhere the active attacks are not run (the active verdict names "
            "that gap); DP-SGD (the plain-Trainer runner) trains that many steps of the round's images first. "
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
    (args.output_dir / f"matrix{suffix}.md").write_text(f"# matrix\n\n{preamble}\n\n{table}\n")
    detailed = csv_rows(audits, training)
    with open(args.output_dir / f"matrix{suffix}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(detailed[0]))
        writer.writeheader()
        writer.writerows(detailed)
    source = "not measured (--no-training)"
    if training:
        source = f"{rounds} FedSGD rounds of this run (seed {args.seed})"
        with open(args.output_dir / f"matrix{suffix}_training.csv", "w", newline="") as handle:
            trained = training_rows(training, source)
            writer = csv.DictWriter(handle, fieldnames=list(trained[0]))
            writer.writeheader()
            writer.writerows(trained)
    print("\n" + table)
    stage = figure_stage(batch, args.audit_round)
    write_figures(matrix_rows(audits, columns, training), columns, args.output_dir, suffix, source, stage)
    return {}


def row_store(
    args: argparse.Namespace,
    suffix: str,
    dataset_name: str,
    indices: list[list[int]],
    published_names: list[str],
    budget: AttackBudget,
    rounds: int,
) -> ResultStore:
    """Where this run keeps its finished rows, under a fingerprint of all a row depends on."""
    shared = {
        "script": "matrix",
        "dataset": dataset_name,
        "indices": indices,
        "attacks": published_names,
        "budget": asdict(budget),
        "rounds": None if args.no_training else rounds,
        "lpips": not args.no_lpips,
        "seed": args.seed,
        "audit_round": args.audit_round,
        **({"model": args.model} if args.model != "LeNetZhu" else {}),
        **({"aggregate": True} if args.aggregate else {}),
        "label_recovery": LABEL_RECOVERY_REVISION if args.batch_size > 1 else None,
    }
    return ResultStore(args.output_dir / f".matrix{suffix}_rows.jsonl", run_fingerprint(shared))


def matrix_suffix(batch_size: int, audit_round: int, quick: bool, model: str = "LeNetZhu", tag: str = "") -> str:
    """The run's file-name suffix: ``_batch{B}`` above batch 1, ``_round{R}`` past round 0, the model's
    name in lower case where it is not LeNetZhu, ``_{tag}``, ``_quick``."""
    return (
        (f"_batch{batch_size}" if batch_size > 1 else "")
        + (f"_round{audit_round}" if audit_round else "")
        + (f"_{model.lower()}" if model != "LeNetZhu" else "")
        + (f"_{tag}" if tag else "")
        + ("_quick" if quick else "")
    )


def figure_stage(batch_size: int, audit_round: int) -> str:
    """What a run audited, for its heatmap's title."""
    return f"FedSGD round {audit_round}, {batch_size} image(s) per client"


def write_figures(
    rows: list[MatrixRow], columns: list[str], output_dir: Path, suffix: str, source: str, stage: str = ""
) -> str:
    """Write the heatmap and the summary of ``rows`` (``stage``: the round audited, for the title);
    return the summary."""
    both = choose(candidates(rows))
    quick = "QUICK RUN: budgets far too small for conclusions." if suffix == "_quick" else ""
    summary = matrix_summary(rows, source, quick, suffix)
    (output_dir / f"matrix{suffix}_summary.md").write_text(summary)
    pick = both.pick.name if both.pick else None
    heatmap(rows, columns, output_dir / f"matrix{suffix}_heatmap.png", pick=pick, stage=stage)
    print("\n" + summary)
    print(f"written: {output_dir}/matrix{suffix}_heatmap.png, matrix{suffix}_summary.md")
    return summary


def replot(output_dir: Path, suffix: str, stage: str = "") -> None:
    """Redraw the heatmap and the summary from the CSVs a run wrote (no attack, no training);
    ``stage``: what was audited, for the title."""
    path = output_dir / f"matrix{suffix}.csv"
    if not path.is_file():
        raise SystemExit(f"--replot: no {path} (run the matrix first, or give --output-dir / --quick)")
    rows, columns, source = rows_from_csv(path, output_dir / f"matrix{suffix}_training.csv")
    write_figures(rows, columns, output_dir, suffix, source, stage)


if __name__ == "__main__":
    main()
