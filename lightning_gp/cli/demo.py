"""``make demo``: what a defense costs and what an attacker who knows it still recovers.

On the built-in Fashion-MNIST sample, for undefended FedSGD, Top-k 20% and dual gradient pruning
(DGP) at their defaults (``--defenses`` adds any other catalogue defense):

1. Cost: trains LeNetZhu with 10 clients x 8 images per round and measures test accuracy and the
   bytes each client uploads.
2. Privacy: eight clients (``--images``), one image each, FedSGD round 0. The server attacks exactly what each
   client shared with the published iDLG and Inverting Gradients AND with the defense's adaptive
   attack (the attacker who knows the defense: matching only the entries a pruned client sent);
   a malicious server also sends a modified model (Robbing the Fed). Each defense is judged by the
   worst case over the attacks, per image and per threat model (passive: honest-but-curious
   server; active: malicious server), by the audit's one leak rule
   (:class:`~lightning_gp.audit.LeakRule`); a defense is private only if no image leaks and the
   audit is complete. The report says plainly when a defense that holds against the published
   attacks fails against its adaptive attack.

Attacks stop once every attacked image has leaked (``AttackBudget(stop_when_all_leak=True)``: the
adaptive attacks first, then only the clients whose image has not leaked yet): an attack run after
that changes neither verdict nor leak fraction, and the report lists what was not run.
``--every-attack`` runs them all. The settings are trained and audited in parallel worker processes
(``--workers``, one torch thread each): the attacks' small double-backward passes gain nothing from
a second thread, and a second process halves the wall time on two cores. About 3 minutes on 2 idle
cores (10 before both changes), with the same verdicts.

Writes ``demo_output/report.md`` (+ ``report.json``), one grid per defense (``audit_<defense>.png``:
the originals, each attack's reconstructions, the worst case) and the tapped gradients of client 0,
round 0 of each training run (``taps/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch

from lightning_gp.attacks import monitored
from lightning_gp.audit import (
    VERDICT_THRESHOLDS,
    AttackBudget,
    LeakRule,
    SettingAudit,
    TrainingResult,
    audit_setting,
    defense_catalog,
    library_noise_silenced,
    published_attacks,
    train_setting,
)
from lightning_gp.callbacks import GradientTap
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.frontier.workers import worker_pool
from lightning_gp.metrics import save_comparison_grid
from lightning_gp.metrics.lpips import LPIPS
from lightning_gp.models import LeNetZhu

DEFAULT_DEFENSES = ("undefended", "TopKPruning", "DualGradientPruning")
#: Attacked images by default: the first eight training images of the built-in sample, one per
#: client (fewer hide leaks: a defense that looked private on four images leaked one on another draw).
DEFAULT_IMAGES = 8


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


Write = Callable[[str], None]


def say(line: str) -> None:
    print(line, flush=True)


def train(name: str, rounds: int, output_dir: Path, seed: int, write: Write = say) -> TrainingResult:
    setting = defense_catalog([name])[0].build(seed, 1)
    write(f"== training {setting.name}: FedSGD, 10 clients x 8 images per round, {rounds} rounds")
    tap = GradientTap(clients=0, rounds=[0], dirpath=str(output_dir / "taps" / slug(setting.name)))
    L.seed_everything(seed, verbose=False)
    result = train_setting(
        setting, LeNetZhu(), FashionMNISTSampleDataModule(batch_size=500), rounds=rounds, seed=seed, callbacks=[tap]
    )
    write(f"   test accuracy {result.test_acc:.4f} in {result.train_seconds:.0f} s")
    return result


def attacked(images: int) -> list[list[int]]:
    """The attacked clients' batches: the first ``images`` training images of the sample, one per client."""
    return [[i] for i in range(images)]


def audit(
    name: str, budget: AttackBudget, lpips_fn: Any, output_dir: Path, seed: int, images: int, write: Write = say
) -> SettingAudit:
    setting = defense_catalog([name])[0].build(seed, 1)
    write(f"== attacking {setting.name}: iDLG, Inverting Gradients, Robbing the Fed and its adaptive attack")
    L.seed_everything(seed, verbose=False)  # the same initial model for every defense
    with monitored(write=write):  # each attack as it starts, and a line at least every 30 s while it runs
        result = audit_setting(
            setting,
            LeNetZhu(),
            FashionMNISTSampleDataModule(),
            indices=attacked(images),
            published=published_attacks(budget, ["iDLG", "IG", "RtF"]),
            budget=budget,
            seed=seed,
            lpips_fn=lpips_fn,
            log=lambda line: write(f"   {line}"),
        )
    for line in result.summary_lines():
        write(f"   {line}")
    save_grid(result, output_dir / f"audit_{slug(setting.name)}.png")
    return result


def save_grid(result: SettingAudit, path: Path) -> None:
    rows = []
    for attack, results in result.results.items():
        originals = [r.pixels()[0] for r in results]
        reconstructed = [r.pixels()[1] for r in results]
        scores = [{"psnr": row.psnr, "ssim": row.ssim} for r in results for row in r.report.rows]
        rows.append((attack.removeprefix("adaptive:"), torch.cat(originals), torch.cat(reconstructed), scores))
    worst = result.worst
    if worst is not None and worst.original_pixels is not None and worst.best_psnr_pixels is not None:
        scores = [{"psnr": r.values["psnr"] or 0.0, "ssim": r.values["ssim"] or 0.0} for r in worst.rows]
        rows.append(("worst case", worst.original_pixels, worst.best_psnr_pixels, scores))
    if rows:
        save_comparison_grid(rows, path)


def verdict_sentence(result: SettingAudit) -> str:
    """What the audit says of one defense, in words: the passive server, then the active one."""
    sentences = [_threat_sentence(result, threat) for threat in ("passive", "active")]
    if result.skipped:
        sentences.append(
            f"Not run, as every image had already leaked to an attack run before: {', '.join(result.skipped)} "
            "(`--every-attack` runs them)."
        )
    return f"- **{result.setting}**: " + " ".join(sentences)


def _threat_sentence(result: SettingAudit, threat: str) -> str:
    report = result.passive if threat == "passive" else result.active
    who = "an honest-but-curious server" if threat == "passive" else "a malicious server"
    if report is None:
        return f"Against {who}: inconclusive (no attack ran)."
    psnr = report.means["psnr"]
    at_least = "at least " if result.skipped or result.partial else ""  # attacks stopped once images leaked
    leaked = f"{report.leaked} of {report.batch_size} images leak (worst-case PSNR {at_least}{_fmt(psnr, '.1f')} dB)"
    if report.verdict == "private":
        return f"Against {who}: holds, no image leaks to any attack run here ({leaked})."
    if report.verdict == "inconclusive":
        return f"Against {who}: inconclusive, {'; '.join(report.verdict_reasons)} ({leaked})."
    cells = [c for c in result.cells if threat == "active" or c.threat == "passive"]
    published_leak = max((c.leak_fraction or 0.0 for c in cells if c.kind == "published"), default=0.0)
    adaptive_leak = max((c.leak_fraction or 0.0 for c in cells if c.kind == "adaptive"), default=0.0)
    # "the published attacks recover no image" only where each of them ran on every client
    published_whole = not result.skipped and not any(
        c.kind == "published" and c.attack in result.partial for c in cells
    )
    if result.setting != "undefended" and published_leak == 0.0 and adaptive_leak > 0 and published_whole:
        return (
            f"Against {who}: FAILS against its adaptive attack: the published attacks recover no image, but "
            f"the attacker who knows the defense does: {leaked}."
        )
    strongest = ", ".join(sorted({a for r in report.rows for a in r.leaked_by})) or "the worst-case means"
    return f"Against {who}: leaks, {leaked}; strongest: {strongest}."


def write_report(
    training: list[TrainingResult], audits: list[SettingAudit], budget: AttackBudget, output_dir: Path, images: int
) -> Path:
    lines = _training_section(training) + _attack_section_intro(budget, images)
    for result in audits:
        lines += _audit_rows(result, clients=images)
    lines += _blank_baseline_note(audits)
    lines += ["", "## Verdicts", "", *[verdict_sentence(r) for r in audits]]
    lines += [
        "",
        (
            "Grids: `audit_<defense>.png` (originals, each attack's reconstructions, the worst case). Tapped shared "
            "gradients of client 0, round 0 of the training runs: `taps/`."
        ),
    ]
    path = output_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    payload = _report_payload(training, audits, budget)
    (output_dir / "report.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def _training_section(training: list[TrainingResult]) -> list[str]:
    """The report's title and its table of the training runs (accuracy relative to the first, undefended run)."""
    base = training[0]
    lines = [
        "# lightning-gp demo: FedSGD on the built-in Fashion-MNIST sample",
        "",
        (
            "LeNetZhu, 10 clients, 8 images per client per round, server Adam (lr 1e-3); test set: 1000 images of the "
            "built-in sample."
        ),
        "",
        "| defense | test acc | acc / undefended (PMM) | upload per client-round | vs dense | train time |",
        "|---|---|---|---|---|---|",
    ]
    for r in training:
        lines.append(
            f"| {r.setting} | {r.test_acc:.4f} | {r.test_acc / base.test_acc:.3f} | "
            f"{r.upload_bytes_per_client_round / 1024:.1f} KiB | {r.upload_ratio:.1%} | {r.train_seconds:.0f} s |"
        )
    return lines


def _attack_section_intro(budget: AttackBudget, images: int) -> list[str]:
    """The attack section's heading, what the audit does and how it judges, and its table's header."""
    return [
        "",
        (
            "Upload bytes use the cheapest per-layer encoding of each shared gradient: dense float32, values + bitmap, "
            "or values + int32 indices."
        ),
        "",
        "## What an attacker recovers from one shared gradient",
        "",
        (
            f"{images} clients, one image each, FedSGD round 0 (LeNetZhu at initialisation). The server attacks "
            f"exactly the gradient each client shared: iDLG ({budget.lbfgs_iterations} L-BFGS steps), Inverting "
            f"Gradients ({budget.ig_iterations} steps) and each defense's adaptive attack (defense-aware Inverting "
            "Gradients and defense-aware iDLG with 4 restarts: for pruning, they match only the entries the client "
            "sent); a malicious server also sends a modified model (Robbing the Fed). An image **leaks** when any "
            f"attack gets {LeakRule().describe()}; the worst case takes, per image, the attacker's best over every "
            "attack. A defense is **private** only if no image leaks, the worst-case means pass PSNR < "
            f"{VERDICT_THRESHOLDS['psnr']:g} dB, SSIM < {VERDICT_THRESHOLDS['ssim']:g} and LPIPS > "
            f"{VERDICT_THRESHOLDS['lpips']:g}, and the audit is complete (else **inconclusive**). **Passive**: an "
            "honest-but-curious server (it sees what clients send and knows the defense); **active**: a malicious "
            "server that may also send a modified model (worst case over every attack)."
        ),
        "",
        (
            "Unless `--every-attack` is given, the adaptive attacks run first and an attack is not run on a client "
            "whose image has already leaked, nor at all once every image has: it could change neither verdict nor "
            "leak fraction, only raise the worst-case PSNR, which is then a lower bound. Such rows say so."
        ),
        "",
        "| defense | attack | kind | PSNR (dB) | SSIM | LPIPS | noise ratio | images leaked | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]


def _audit_rows(result: SettingAudit, clients: int) -> list[str]:
    """One setting's rows of the attack table (``clients`` attacked): each attack's cell, then the
    passive and active worst cases."""
    lines = []
    for cell in result.cells:
        if not cell.means:
            lines.append(f"| {result.setting} | {cell.attack} | {cell.kind} | {cell.status}: {cell.note} |||||")
            continue
        m = cell.means
        attack = cell.attack
        if cell.attack in result.partial:  # the other clients' images had leaked
            attack += f" (on {clients - result.partial[cell.attack]} of {clients} clients)"
        lines.append(
            f"| {result.setting} | {attack} | {cell.kind}{' (fallback)' if cell.status == 'fallback' else ''} "
            f"| {_fmt(m['psnr'], '.2f')} | {_fmt(m['ssim'])} | {_fmt(m['lpips'])} | {_fmt(m['noise_ratio'])} "
            f"| {cell.leak_fraction:.0%} | {cell.seconds:.0f} |"
        )
    for name in result.skipped:
        lines.append(
            f"| {result.setting} | {name} | not run | every attacked image had already leaked to an attack run "
            "before: it could change neither verdict nor leak fraction |||||"
        )
    for threat, w in (("passive", result.passive), ("active", result.active)):
        if w is None:
            continue
        lines.append(
            f"| **{result.setting}** | **worst case, {threat}** | | **{_fmt(w.means['psnr'], '.2f')}** "
            f"| **{_fmt(w.means['ssim'])}** | **{_fmt(w.means.get('lpips'))}** | **{_fmt(w.means.get('noise_ratio'))}** "
            f"| **{w.leak_fraction:.0%}** | **{w.verdict}** |"
        )
    return lines


def _blank_baseline_note(audits: list[SettingAudit]) -> list[str]:
    """What a blank guess scores on the first setting's images (nothing without its worst case)."""
    blank = audits[0].worst.baseline("blank") if audits and audits[0].worst is not None else None
    if blank is None:
        return []
    return [
        "",
        (
            f"Trivial baseline: a blank guess scores PSNR {blank.means['psnr']:.2f} dB, SSIM {blank.means['ssim']:.3f} on "
            "these images; a 'private' PSNR near it means the attacks recovered nothing."
        ),
    ]


def _report_payload(training: list[TrainingResult], audits: list[SettingAudit], budget: AttackBudget) -> dict[str, Any]:
    """``report.json``: the training runs, every setting's cells and worst cases, and the attack budget."""
    return {
        "training": [{**r.__dict__, "upload_ratio": r.upload_ratio} for r in training],
        "audit": [
            {
                "defense": result.setting,
                "cells": [{**c.__dict__} for c in result.cells],
                "passive": result.passive.to_dict() if result.passive is not None else None,
                "active": result.active.to_dict() if result.active is not None else None,
            }
            for result in audits
        ],
        "budget": budget.__dict__,
        "not_run": {result.setting: list(result.skipped) for result in audits},
        "partial": {result.setting: dict(result.partial) for result in audits},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's arguments, checked (a bad one exits with the parser's usage and the reason)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="demo_output", type=Path)
    parser.add_argument("--rounds", default=600, type=int, help="FedSGD rounds per training run (default 600)")
    parser.add_argument(
        "--defenses",
        nargs="+",
        default=list(DEFAULT_DEFENSES),
        help=f"catalogue defenses to compare, undefended first (default {' '.join(DEFAULT_DEFENSES)})",
    )
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--ig-iterations", default=1000, type=int, help="Inverting Gradients budget (default 1000)")
    parser.add_argument("--idlg-iterations", default=100, type=int, help="iDLG L-BFGS steps (default 100)")
    parser.add_argument(
        "--images",
        default=DEFAULT_IMAGES,
        type=int,
        help=f"attacked clients, one image each (default {DEFAULT_IMAGES}; fewer hide leaks)",
    )
    parser.add_argument("--no-lpips", action="store_true", help="skip LPIPS")
    parser.add_argument(
        "--every-attack",
        action="store_true",
        help="run every attack on every client, also after every image has leaked (about 3 times as long)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="settings trained and audited at once, each in its own process (default: one per core, at most one "
        "per setting; 1: in this process)",
    )
    args = parser.parse_args(argv)
    for flag in ("rounds", "ig_iterations", "idlg_iterations", "images", "workers"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    try:
        defense_catalog(args.defenses)
    except ValueError as err:
        parser.error(str(err))
    sample = FashionMNISTSampleDataModule()
    sample.setup("fit")
    available = len(cast(Sized, sample.train_dataset))
    if args.images > available:
        parser.error(f"--images must be at most the sample's {available} training images")
    if args.defenses[0] != "undefended":
        args.defenses = ["undefended", *[d for d in args.defenses if d != "undefended"]]
    if args.workers is None:
        args.workers = max(1, min(os.cpu_count() or 1, len(args.defenses)))
    return args


def demo_budget(args: argparse.Namespace) -> AttackBudget:
    """The attacks' budget from the demo's arguments."""
    return AttackBudget(
        ig_iterations=args.ig_iterations,
        lbfgs_iterations=args.idlg_iterations,
        stop_when_all_leak=not args.every_attack,
    )


def run_setting(name: str, args: argparse.Namespace, threads: int | None) -> tuple[TrainingResult, SettingAudit]:
    """Train, then audit, one setting (``threads``: torch threads of a worker process), its lines
    prefixed with its name. The grid is saved here; the reconstructions are not sent back."""
    if threads is not None:
        torch.set_num_threads(threads)

    def write(line: str) -> None:
        say(f"[{name}] {line}")

    with library_noise_silenced():  # the suite's entry point: known library noise goes, the rest shows
        training = train(name, args.rounds, args.output_dir, args.seed, write)
        lpips_fn = None if args.no_lpips else LPIPS()
        result = audit(name, demo_budget(args), lpips_fn, args.output_dir, args.seed, args.images, write)
    result.results = {}
    return training, result


def run_settings(args: argparse.Namespace) -> list[tuple[TrainingResult, SettingAudit]]:
    """Every setting of ``args.defenses``, in order: in this process, or on ``args.workers`` worker
    processes of one torch thread each (more where there are more cores than workers)."""
    workers = min(args.workers, len(args.defenses))
    if workers == 1:
        return [run_setting(name, args, None) for name in args.defenses]
    threads = max(1, (os.cpu_count() or 1) // workers)
    say(f"{len(args.defenses)} settings on {workers} worker processes, {threads} torch thread(s) each")
    with worker_pool(workers) as pool:
        futures = [pool.submit(run_setting, name, args, threads) for name in args.defenses]
        return [future.result() for future in futures]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    outcomes = run_settings(args)
    training, audits = [t for t, _ in outcomes], [a for _, a in outcomes]
    report = write_report(training, audits, demo_budget(args), args.output_dir, args.images)
    print("\n" + report.read_text())
    print(f"report written to {report} and {report.with_suffix('.json')} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
