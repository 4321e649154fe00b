"""Running a frontier: its jobs, the results file a rerun resumes from, progress with an ETA, and the
backends that run jobs (this process, local worker processes, or a Ray cluster).

A **job** is one audit (a setting at one batch size and one stage: :func:`audit_point`, which is
:func:`~lightning_gp.audit.audit_setting` and nothing more) or one training (a setting at one batch
size: :func:`~lightning_gp.audit.train_setting`, for PMM, time and bytes). Each finished job is
appended to ``<name>_points.jsonl`` at once, keyed by what it computed and by a fingerprint of the
config fields every job depends on; a rerun with the same config skips the jobs it finds there, so an
interrupted run resumes where it stopped, and a changed budget or model never reuses stale lines. A job
that raises (or whose worker dies) gives a failure record (:func:`failure_record`) instead of ending
the run: the other jobs go on, the failure is never stored, and a rerun tries the job again.

Backends: ``"local"`` runs the jobs in this process (``workers=1``) or in ``workers`` spawned
processes; ``"ray"`` sends them to Ray (``ray.init(address=...)`` to join a cluster, else a local one
of ``workers`` CPUs), the engine the Flower extra already installs (``pip install
lightning-gp[frontier-ray]``), never a scheduler of our own.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import traceback
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch

from lightning_gp.attacks import ATTACK_REVISION, LABEL_RECOVERY_REVISION
from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.learned import simulation_refusal
from lightning_gp.audit.quiet import library_noise_silenced
from lightning_gp.audit.rounds import training_order
from lightning_gp.audit.setting_audit import (
    LEARNED_NOT_RUN,
    THREAT_MODELS,
    AttackBudget,
    SettingAudit,
    audit_setting,
    published_attacks,
)
from lightning_gp.audit.training import train_setting
from lightning_gp.audit.verdict import LEAK_RULE_MONOTONE_SINCE, LEAK_RULE_REVISION
from lightning_gp.frontier.grid import (
    ClientTraining,
    FrontierConfig,
    PointSpec,
    build_spec,
    grid_points,
    point_settings,
)
from lightning_gp.frontier.workers import worker_pool

#: Raised when a training job's record changes meaning; stored trainings of an older revision run
#: again. 2: each training job also trains the undefended reference for the same rounds in the same
#: process, before and after the setting (after a one-round warm-up), and the cost ratio is the job's
#: own ratio to their mean (revision 1 divided by the undefended *job*'s time, which ran first in a
#: cold worker: about twice its warm time).
TRAINING_REVISION = 2

#: The published attack built for FedAvg's multi-step update (Dimitrov et al., TMLR 2022): every audit of a
#: FedAvg point runs it, whichever attacks ``FrontierConfig.attacks`` names.
FEDAVG_ATTACK = "FedAvgInversion"

Backend = Literal["local", "ray"]
JobKind = Literal["audit", "train"]
RESULTS_FILE = "frontier_points.jsonl"  # of a run named "frontier": ``<name>_points.jsonl``


@dataclass(frozen=True)
class Job:
    """One unit of work: an audit of ``point`` at ``batch_size`` and ``stage``, or its training."""

    kind: JobKind
    point: PointSpec
    setting: str  # the setting's name (every keyword of every defense of it, and a FedAvg client's training)
    batch_size: int
    stage: int = 0
    training: ClientTraining = field(default_factory=ClientTraining)

    def defense_setting(self, config: FrontierConfig, channels: int) -> DefenseSetting:
        """The setting this job audits or trains: its point's, under its client training."""
        return self.training.apply(self.point.setting(config, channels))

    @property
    def key(self) -> str:
        where = f"B={self.batch_size}" + (f"|round={self.stage}" if self.kind == "audit" else "")
        return f"{self.kind}|{self.setting}|{where}"

    def describe(self) -> str:
        what = f"round {self.stage}" if self.kind == "audit" else "training"
        return f"{self.setting} B={self.batch_size} {what}"


def frontier_jobs(config: FrontierConfig, channels: int) -> list[Job]:
    """Every job of the run, stage by stage: at the first stage, per setting and batch size its
    training and its audit; then the audits of each later stage. Within a stage the grids take
    turns, each grid's ends first and then the strengths between (:func:`coverage_order`). A run cut
    short thus has whole stages, and in a stage every family's range, not all of the first families."""
    specs = grid_points(config)
    rank = {}
    for grid in dict.fromkeys(spec.grid for spec in specs):
        indices = sorted({spec.index for spec in specs if spec.grid == grid})  # two grids may share a name
        rank.update({(grid, indices[i]): r for r, i in enumerate(coverage_order(len(indices)))})
    # stable: within a rank the client trainings' order, then the grids'
    points = sorted(point_settings(config, channels), key=lambda found: rank[(found[0].grid, found[0].index)])
    jobs = []
    for i, stage in enumerate(config.stages):
        for point, training, setting in points:
            for size in config.batch_sizes:
                jobs += [Job("train", point, setting.name, size, training=training)] if i == 0 else []
                jobs.append(Job("audit", point, setting.name, size, stage, training=training))
    return jobs


def decisive_first(jobs: Sequence[Job], records: dict[str, dict[str, Any]]) -> list[Job]:
    """``jobs`` with the audits that cannot change a verdict over every stage put last: those of a
    setting (at its batch size) that already leaks to both the passive and the active server at an
    earlier stage, or at the job's own stage in a stored record a stronger attack reruns (see
    :func:`carried_records`). A run cut short then has audited the settings still in the running for
    a recommendation; the order is otherwise kept (stage by stage, trainings first)."""
    first_leak: dict[tuple[str, int], int] = {}  # (setting, batch size) -> its first round leaking to both
    for key, record in records.items():
        kind, setting, batch_size, stage = key_parts(key)
        if kind == "audit" and leaks_everywhere(record):
            first_leak[(setting, batch_size)] = min(stage, first_leak.get((setting, batch_size), stage))

    def settled(job: Job) -> bool:
        leaked = first_leak.get((job.setting, job.batch_size))
        if job.kind != "audit" or leaked is None:
            return False
        return leaked < job.stage or (leaked == job.stage and job.key in records)  # its own record, carried

    # the stages' blocks keep their order (a training belongs to the first block, as in frontier_jobs)
    block = {stage: i for i, stage in enumerate(dict.fromkeys(j.stage for j in jobs if j.kind == "audit"))}
    return sorted(jobs, key=lambda job: (settled(job), block[job.stage] if job.kind == "audit" else 0))


def leaks_everywhere(record: dict[str, Any]) -> bool:
    """Whether the audit ``record`` leaks to every threat model."""
    threats = record.get("threats", {})
    return all(threats.get(t, {}).get("verdict") == "leaks" for t in THREAT_MODELS)


def carried_records(jobs: Sequence[Job], stored: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The stored audit records of ``jobs`` (each to run again) that a report may show until their
    rerun finishes: those that leaked to every server. A record runs again because its attacker was
    weaker than today's (:func:`has_stale_labels`, :func:`misses_learned_inverter`) or because an
    older version skipped it; an image a weaker attacker rebuilt leaked all the same, so the verdict
    "leaks" stands and only the leak fraction and PSNR may change. Nothing else is carried: a record
    that read private or inconclusive could err in the defense's favour."""
    return {
        job.key: without_stale_bound(stored[job.key])
        for job in jobs
        if job.kind == "audit" and job.key in stored and leaks_everywhere(stored[job.key])
    }


def key_parts(key: str) -> tuple[str, str, int, int]:
    """``(kind, setting, batch size, stage)`` of a :attr:`Job.key` (a training's stage is 0)."""
    kind, setting, where = key.split("|", 2)
    size, _, stage = where.partition("|round=")
    return kind, setting, int(size.removeprefix("B=")), int(stage or 0)


def coverage_order(n: int) -> list[int]:
    """Positions ``0 .. n-1`` in the order that covers a range soonest: both ends, then the midpoint
    of the widest gap left, and so on (``5 -> [0, 4, 2, 1, 3]``)."""
    if n <= 2:
        return list(range(n))
    order, gaps = [0, n - 1], [(0, n - 1)]
    while len(order) < n:
        low, high = max(gaps, key=lambda g: (g[1] - g[0], -g[0]))
        gaps.remove((low, high))
        if high - low < 2:
            continue
        mid = (low + high) // 2
        order.append(mid)
        gaps += [(low, mid), (mid, high)]
    return order


def run_fingerprint(shared: dict[str, Any], leak_rule_revision: int = LEAK_RULE_REVISION) -> str:
    """A hash of ``shared`` (what a run's results depend on, JSON-able or ``repr``-able) and of the
    leak rule's and the attacks' revisions: results stored under another fingerprint are stale. A store
    that checks each record's own ``leak_rule_revision`` (the frontier's: :func:`has_stale_leak_rule`)
    passes :data:`UNSTAMPED_LEAK_RULE`."""
    stamped = {**shared, "leak_rule_revision": leak_rule_revision, "attack_revision": ATTACK_REVISION}
    return hashlib.sha256(json.dumps(stamped, sort_keys=True, default=repr).encode()).hexdigest()[:16]


#: The leak rule revision of an audit record that names none (records stored before revision 4), and the
#: one the frontier's fingerprint is stamped with (each record's own revision decides its staleness).
UNSTAMPED_LEAK_RULE = 3

#: Budget fields added after frontier results were stored, with the value those results ran under: at
#: that value a field is left out of :func:`fingerprint`, so adding it left the stored records current.
BUDGET_FIELDS_ADDED = {"refined_decoys": 31, "generative_prior": False, "generative_max_steps": 3000}


def fingerprint(config: FrontierConfig) -> str:
    """A hash of what every job's result depends on besides its own setting, batch size and stage.
    The budget's ``learned_min_batch`` is left out: each audit records the one it ran under, and
    :func:`is_current` runs again those it kept from the learned inverter that this config reaches
    (lowering it reruns the smaller batches' audits, not the whole frontier). So is a field of
    :data:`BUDGET_FIELDS_ADDED` at the value it was added with."""
    budget = {
        k: v
        for k, v in asdict(config.budget).items()
        if k != "learned_min_batch" and BUDGET_FIELDS_ADDED.get(k, object()) != v
    }
    return run_fingerprint(
        {
            "model": config.model,
            "datamodule": config.datamodule,
            "images": config.images,
            "train_rounds": config.train_rounds,
            "num_clients": config.num_clients,
            "attacks": config.attacks,
            "budget": budget,
            "lpips": config.lpips,
            "seed": config.seed,
        },
        # each audit record says its own revision (has_stale_leak_rule): a newer rule reruns only the
        # audits whose verdict it can change, not the whole frontier (nor its trainings)
        leak_rule_revision=UNSTAMPED_LEAK_RULE,
    )


class ResultStore:
    """Finished jobs, one JSON line each (``None`` path: in memory only)."""

    def __init__(self, path: Path | None, fingerprint: str) -> None:
        self.path = path
        self.fingerprint = fingerprint

    def load(self) -> dict[str, dict[str, Any]]:
        """The records of this config's finished jobs by key (lines of another config are ignored; a
        line cut short by a kill is dropped, its job runs again)."""
        if self.path is None or not self.path.is_file():
            return {}
        done = {}
        for line in self.path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if entry.get("fingerprint") == self.fingerprint:
                done[entry["key"]] = entry["record"]
        return done

    def append(self, key: str, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"fingerprint": self.fingerprint, "key": key, "record": record}) + "\n")
            handle.flush()


class Progress:
    """A progress bar over jobs with an ETA.

    The ETA is the work left over the workers that share it (``workers``, fewer once fewer jobs are
    left). With ``estimates`` (the expected seconds of each job left, by key: :func:`job_estimates`)
    the work left is their sum scaled by this run's pace, the finished jobs' own seconds over their
    estimates: jobs of very different sizes (a training of seconds, an audit of minutes) then count
    as long as they take. Without, the ``jobs`` left are estimated as :func:`job_estimates` does from
    the jobs this run finished (an audit by the audits' times once one has finished), and without
    ``jobs`` the work left is the finished jobs' mean seconds times the jobs left. Paced by each job's
    own seconds (its record's ``seconds``), not the wall time so far, so the jobs still running when
    the first ones finish do not inflate it (with ``W`` workers the first finished job holds about
    ``1 / W`` of the work done by then). ``clock``: seconds (tests)."""

    def __init__(
        self,
        total: int,
        done: int,
        workers: int,
        log: Callable[[str], None],
        width: int = 24,
        estimates: dict[str, float] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        jobs: Sequence[Job] | None = None,
    ) -> None:
        self.total, self.done, self.workers, self.log, self.width = total, done, workers, log, width
        self.left_jobs = None if jobs is None else {job.key: job for job in jobs}
        self.finished: dict[str, dict[str, Any]] = {}  # this run's jobs that gave their seconds, as records
        self.estimates = dict(estimates or {})
        self.estimated = bool(self.estimates)
        self.left_estimate = sum(self.estimates.values())
        self.done_estimate = 0.0  # the estimates of the jobs in ``finished``
        self.clock = clock
        self.start = clock()
        self.ran = 0

    def eta(self, elapsed: float) -> float:
        """Seconds left, ``elapsed`` seconds into this run (used only while no finished job has
        reported its seconds: a failed one reports none)."""
        left = self.total - self.done
        sharing = max(1, min(self.workers, left))
        busy = sum(record["seconds"] for record in self.finished.values())
        if self.estimated:
            pace = busy / self.done_estimate if self.done_estimate > 0 and busy > 0 else 1.0
            return self.left_estimate * pace / sharing
        if self.finished and self.left_jobs:
            return sum((job_estimates(list(self.left_jobs.values()), self.finished) or {}).values()) / sharing
        if self.finished:
            return busy / len(self.finished) * left / sharing
        return elapsed / max(1, self.ran) * left  # elapsed / ran is about per worker

    def update(self, job: Job, record: dict[str, Any]) -> str:
        self.done += 1
        self.ran += 1
        estimate = self.estimates.pop(job.key, 0.0)
        self.left_estimate -= estimate
        if self.left_jobs is not None:
            self.left_jobs.pop(job.key, None)
        seconds = record.get("seconds")
        if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0:
            self.done_estimate += estimate
            self.finished[job.key] = {"seconds": float(seconds)}
        elapsed = self.clock() - self.start
        filled = round(self.width * self.done / max(1, self.total))
        line = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {job.describe()}: "
            f"{record_summary(record)} | elapsed {hours_minutes_seconds(elapsed)}, ETA {hours_minutes_seconds(self.eta(elapsed))}"
        )
        self.log(line)
        return line


def job_estimates(jobs: Sequence[Job], records: dict[str, dict[str, Any]]) -> dict[str, float] | None:
    """Expected seconds of each of ``jobs`` from the finished ``records`` (stale ones too: their
    jobs take about as long again): the job's own earlier record, else the same setting's audit at
    another stage, else the mean of the finished jobs of its kind and batch size, of its kind, of all.
    ``None`` when no record has a time (a fresh run)."""
    finished = {key: float(r["seconds"]) for key, r in records.items() if r.get("seconds")}
    if not finished:
        return None
    groups: dict[tuple[Any, ...], list[float]] = {}
    for key, seconds in finished.items():
        kind, setting, batch_size, _ = key_parts(key)
        for group in ((kind, setting, batch_size), (kind, batch_size), (kind,), ()):
            groups.setdefault(group, []).append(seconds)
    estimates = {}
    for job in jobs:
        own = [finished[job.key]] if job.key in finished else None
        same_setting = groups.get(("audit", job.setting, job.batch_size)) if job.kind == "audit" else None
        pool = own or same_setting or groups.get((job.kind, job.batch_size)) or groups.get((job.kind,)) or groups[()]
        estimates[job.key] = sum(pool) / len(pool)
    return estimates


def hours_minutes_seconds(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS``."""
    whole = round(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def record_summary(record: dict[str, Any]) -> str:
    """One job's result in a few words."""
    if record.get("failed"):
        return f"FAILED, {record['failed']} (not stored: a rerun tries it again)"
    if record["kind"] == "train":
        return f"test acc {record['test_acc']:.3f} ({record['seconds']:.0f} s)"
    verdicts = ", ".join(f"{t} {record['threats'][t]['verdict']}" for t in THREAT_MODELS)
    return f"{verdicts} ({record['seconds']:.0f} s)"


def attacked_images(datamodule: Any, images: int, batch_size: int, seed: int) -> list[list[int]]:
    """``ceil(images / batch_size)`` clients of ``batch_size`` training images each, drawn by ``seed``
    (the same images for every setting at one batch size)."""
    clients = math.ceil(images / batch_size)
    chosen = [int(i) for i in training_order(datamodule, seed)[: clients * batch_size]]
    return [chosen[c * batch_size : (c + 1) * batch_size] for c in range(clients)]


def audit_point(
    setting: DefenseSetting,
    config: FrontierConfig,
    datamodule: Any,
    *,
    batch_size: int,
    stage: int,
    lpips_fn: Any = None,
    log: Callable[[str], None] = print,
) -> SettingAudit:
    """The audit of one point: :func:`~lightning_gp.audit.audit_setting` on ``setting`` with the
    model built from ``config.model`` under ``config.seed``, the attacked images of
    :func:`attacked_images` and round ``stage``; the frontier adds no scoring of its own."""
    L.seed_everything(config.seed, verbose=False)
    model = build_spec(config.model, "model")
    names = config.attacks
    if names is not None and setting.local_training and FEDAVG_ATTACK not in names:
        names = [*names, FEDAVG_ATTACK]  # the attack built for a FedAvg update is never left out
    return audit_setting(
        setting,
        model,
        datamodule,
        indices=attacked_images(datamodule, config.images, batch_size, config.seed),
        published=published_attacks(config.budget, names),
        budget=config.budget,
        num_clients=config.num_clients,
        seed=config.seed,
        lpips_fn=lpips_fn,
        log=log,
        round=stage,
    )


def audit_record(audit: SettingAudit) -> dict[str, Any]:
    """What the frontier keeps of an audit: per threat model the verdict, the leak fraction, the
    worst-case means and reasons; per attack its status, scores and seconds; the ReRo bound where one
    exists."""
    threats: dict[str, dict[str, Any]] = {}
    for threat in THREAT_MODELS:
        report = audit.passive if threat == "passive" else audit.active
        if report is None:
            threats[threat] = {
                "verdict": "inconclusive",
                "leak_fraction": None,
                "psnr": None,
                "ssim": None,
                "lpips": None,
                "reasons": ["no attack produced a report"],
                "strongest": [],
            }
            continue
        threats[threat] = {
            "verdict": report.verdict,
            "leak_fraction": report.leak_fraction,
            "psnr": report.means.get("psnr"),
            "ssim": report.means.get("ssim"),
            "lpips": report.means.get("lpips"),
            "reasons": list(report.verdict_reasons),
            "strongest": sorted({a for row in report.rows for a in row.leaked_by}),
            "control_false_alarm": report.control_false_alarm,
            # why each leaked image leaks: attack -> the criteria of the rule it met
            "criteria": {str(row.index): row.criteria for row in report.rows if row.criteria},
        }
    bound = audit.bound
    return {
        "kind": "audit",
        "setting": audit.setting,
        "threats": threats,
        "cells": [
            {
                "attack": c.attack,
                "kind": c.kind,
                "threat": c.threat,
                "sok_class": c.sok_class,
                "status": c.status,
                "psnr": c.means.get("psnr"),
                "leak_fraction": c.leak_fraction,
                "note": c.note,
                "seconds": c.seconds,
                "cpu_seconds": c.cpu_seconds,
            }
            for c in audit.cells
        ],
        "skipped_attacks": list(audit.skipped),
        "partial_attacks": dict(audit.partial),
        "rero_eta": None if bound is None else bound.eta,
        "rero_kappa": None if bound is None else bound.kappa,
        "seconds": sum(c.seconds for c in audit.cells),
        "label_recovery_revision": LABEL_RECOVERY_REVISION,
        "leak_rule_revision": LEAK_RULE_REVISION,
    }


_CACHE: dict[str, Any] = {}  # per process: the datamodule and LPIPS, built once for every job


def _cached(name: str, build: Callable[[], Any]) -> Any:
    if name not in _CACHE:
        _CACHE[name] = build()
    return _CACHE[name]


def run_job(job: Job, config: FrontierConfig) -> dict[str, Any]:
    """Run one job (in any process: everything it needs is in ``job`` and ``config``), without the
    libraries' known noise (:func:`~lightning_gp.audit.quiet.library_noise_silenced`). An exception
    of the job gives its :func:`failure_record` (a long run goes on with its other jobs)."""
    try:
        with library_noise_silenced():
            return _run_job(job, config)
    except Exception as err:
        return failure_record(job, err)


def failure_record(job: Job, error: BaseException) -> dict[str, Any]:
    """The record of a job that raised ``error`` (or whose worker died): kept out of the results
    file, so its point is missing from the report (never private) and a rerun runs it again."""
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    return {
        "kind": job.kind,
        "setting": job.setting,
        "failed": f"{type(error).__name__}: {error}",
        "traceback": "".join(lines if len(lines) <= 13 else ["Traceback (innermost frames):\n", *lines[-12:]]),
    }


def _run_job(job: Job, config: FrontierConfig) -> dict[str, Any]:
    torch.set_num_threads(config.threads)
    key = json.dumps(config.datamodule, sort_keys=True, default=repr)
    datamodule = _cached(f"data:{key}", lambda: build_spec(config.datamodule, "datamodule"))
    setting = job.defense_setting(config, int(datamodule.image_shape[0]))
    start, cpu_start = time.perf_counter(), time.process_time()
    if job.kind == "train":
        return {
            **_train_record(job, config, setting, datamodule, start),
            "cpu_seconds": time.process_time() - cpu_start,
        }
    lpips_fn = None
    if config.lpips:
        from lightning_gp.metrics.lpips import LPIPS

        lpips_fn = _cached("lpips", LPIPS)
    audit = audit_point(
        setting, config, datamodule, batch_size=job.batch_size, stage=job.stage, lpips_fn=lpips_fn, log=_silent
    )
    # the whole job's CPU time: its cells' and the taps, scoring and controls around them
    cpu_seconds = time.process_time() - cpu_start
    return {**audit_record(audit), "learned_min_batch": config.budget.learned_min_batch, "cpu_seconds": cpu_seconds}


def _train_record(
    job: Job, config: FrontierConfig, setting: DefenseSetting, datamodule: Any, start: float
) -> dict[str, Any]:
    """Train ``setting`` for PMM and bytes, and time it against the undefended reference (on the same
    runner, with the same algorithm and optimizers) trained for the same rounds just before and just after it in
    this process, their mean (a ratio of runs side by side, not of jobs that ran at other times under
    other loads, and no bias from which came first); a one-round warm-up first pays the process's
    one-time costs, which would otherwise fall on whichever training came first."""

    def train(trained_setting: DefenseSetting, rounds: int) -> Any:
        L.seed_everything(config.seed, verbose=False)
        return train_setting(
            trained_setting,
            build_spec(config.model, "model"),
            datamodule,
            rounds=rounds,
            num_clients=config.num_clients,
            local_batch_size=job.batch_size,
            seed=config.seed,
        )

    # undefended on the same runner, algorithm and optimizers: DP-SGD's plain Trainer, PriPrune's FedAvg
    reference_setting = replace(DefenseSetting("undefended"), **_runner_fields(setting))
    train(reference_setting, 1)
    before = train(reference_setting, config.train_rounds).train_seconds
    trained = train(setting, config.train_rounds)
    after = train(reference_setting, config.train_rounds).train_seconds
    return {
        "kind": "train",
        "setting": setting.name,
        "revision": TRAINING_REVISION,
        "test_acc": trained.test_acc,
        "upload_bytes": trained.upload_bytes_per_client_round,
        "dense_bytes": trained.dense_bytes_per_client_round,
        "train_seconds": trained.train_seconds,
        "reference_seconds": (before + after) / 2,
        "reference_runs": [before, after],
        "seconds": time.perf_counter() - start,
    }


def _runner_fields(setting: DefenseSetting) -> dict[str, Any]:
    """How ``setting`` trains, apart from its defenses: runner, algorithm, learning rates, optimizer."""
    names = ("runner", "algorithm", "local_lr", "server_optimizer", "server_lr")
    return {name: getattr(setting, name) for name in names}


def is_current(job: Job, record: dict[str, Any], config: FrontierConfig, channels: int) -> bool:
    """Whether the stored record of ``job`` still means what this version computes under
    ``config``: a training of an older :data:`TRAINING_REVISION` does not, nor an audit an older
    version skipped, nor one that :func:`misses_learned_inverter` or :func:`has_stale_labels`; their
    jobs run again."""
    if record.get("skipped"):  # a trained round of DP-SGD, which older versions did not audit
        return False
    if record.get("kind") == "train":
        return record.get("revision", 1) >= TRAINING_REVISION
    if has_stale_labels(job.key, record) or has_stale_leak_rule(record):
        return False
    return not misses_learned_inverter(
        job.key, record, config.budget, lambda: simulation_refusal(job.defense_setting(config, channels))
    )


def has_stale_leak_rule(record: dict[str, Any]) -> bool:
    """Whether the audit ``record`` was judged by an older leak rule
    (:data:`~lightning_gp.audit.verdict.LEAK_RULE_REVISION`; records before revision 4 say none) and the
    newer one could change its verdict. A record older than
    :data:`~lightning_gp.audit.verdict.LEAK_RULE_MONOTONE_SINCE` always could (that revision can turn a
    leak into another verdict); later revisions only add leaks and gaps, so a record from one of them that
    leaked to every server keeps its verdict (its bound is dropped: :func:`as_reported`)."""
    revision = record.get("leak_rule_revision", UNSTAMPED_LEAK_RULE)
    if revision >= LEAK_RULE_REVISION:
        return False
    return revision < LEAK_RULE_MONOTONE_SINCE or not leaks_everywhere(record)


def has_stale_labels(key: str, record: dict[str, Any]) -> bool:
    """Whether the audit ``record`` of job ``key`` recovered a batch's labels with an older
    :data:`~lightning_gp.attacks.LABEL_RECOVERY_REVISION` (one image's label never changed) where
    the labels could still change it: some image had not leaked to the passive server."""
    _, _, batch_size, _ = key_parts(key)
    if batch_size == 1 or record.get("label_recovery_revision", 1) >= LABEL_RECOVERY_REVISION:
        return False
    return record.get("threats", {}).get("passive", {}).get("leak_fraction") != 1.0


def misses_learned_inverter(
    key: str, record: dict[str, Any], budget: AttackBudget, refusal: Callable[[], str | None]
) -> bool:
    """Whether the audit ``record`` of job ``key`` has no learned-inverter cell where ``budget`` runs
    the inverter (at its batch size, ``learned_min_batch``) and the server can now replay the setting
    (``refusal()`` is ``None``: an older version refused DP-SGD, or the record was stored under a
    higher ``learned_min_batch``), and the inverter could still change it: some image had not leaked
    to the passive server (once every image has, no attack changes a verdict or a leak fraction)."""
    _, _, batch_size, _ = key_parts(key)
    if not budget.learned_inversion or batch_size < budget.learned_min_batch:
        return False
    if any(cell["attack"].endswith("LearnedInversion") for cell in record.get("cells", [])):
        return False
    if record.get("threats", {}).get("passive", {}).get("leak_fraction") == 1.0:
        return False
    return refusal() is None


def learned_inverter_gap(
    key: str, record: dict[str, Any], budget: AttackBudget, refusal: Callable[[], str | None]
) -> str | None:
    """The gap (:data:`~lightning_gp.audit.setting_audit.LEARNED_NOT_RUN`) the audit ``record`` of job
    ``key`` must name: ``budget`` asks for the learned inverter, the record has no cell of it, and
    no rerun gives it one: the clients are below ``learned_min_batch``, or the server cannot replay the
    setting (``refusal()``). ``None`` where the inverter ran, was not asked for, or a rerun runs it
    (:func:`misses_learned_inverter`). Today's audits name this gap themselves; records stored before
    they did read "private" without it."""
    if record.get("kind") != "audit" or not budget.learned_inversion:
        return None
    if any(cell["attack"].endswith("LearnedInversion") for cell in record.get("cells", [])):
        return None
    _, _, batch_size, _ = key_parts(key)
    if batch_size < budget.learned_min_batch:
        return LEARNED_NOT_RUN.format(
            f"a client holds {batch_size} image(s), below learned_min_batch={budget.learned_min_batch}"
        )
    why = refusal()
    return None if why is None else LEARNED_NOT_RUN.format(why)


def with_gap(record: dict[str, Any], gap: str) -> dict[str, Any]:
    """``record`` (an audit's) with ``gap`` named by every threat model that does not leak: a
    "private" verdict becomes "inconclusive" (a gap never reads as privacy). A verdict that names
    a gap of this kind already is kept as it is."""
    prefix = gap.split(":", 1)[0]
    threats = {}
    for threat, scores in record.get("threats", {}).items():
        reasons = list(scores.get("reasons", []))
        if scores.get("verdict") != "leaks" and not any(r.startswith(prefix) for r in reasons):
            scores = {**scores, "verdict": "inconclusive", "reasons": [*reasons, gap]}
        threats[threat] = scores
    return {**record, "threats": threats}


def current_records(
    jobs: Sequence[Job], stored: dict[str, dict[str, Any]], config: FrontierConfig, channels: int
) -> dict[str, dict[str, Any]]:
    """The ``stored`` records of ``jobs`` this version does not run again (:func:`is_current`), each as
    the report shows it (:func:`as_reported`)."""
    return {
        job.key: as_reported(job, stored[job.key], config, channels)
        for job in jobs
        if job.key in stored and is_current(job, stored[job.key], config, channels)
    }


def as_reported(job: Job, record: dict[str, Any], config: FrontierConfig, channels: int) -> dict[str, Any]:
    """The stored ``record`` of ``job`` (current: :func:`is_current`) as the report shows it: with the
    gap of a learned inverter ``config`` asks for and the record lacks (:func:`learned_inverter_gap`),
    and without the ReRo bound of a record judged under an older leak rule."""
    gap = learned_inverter_gap(
        job.key, record, config.budget, lambda: simulation_refusal(job.point.setting(config, channels))
    )
    return without_stale_bound(record if gap is None else with_gap(record, gap))


def without_stale_bound(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` without its ReRo bound where an older leak rule judged it: its verdict may stand
    (:func:`has_stale_leak_rule`), but its bound predates kappa under the full rule and the composition
    of the earlier rounds, and could be too small; it is not shown until a rerun."""
    if record.get("kind") != "audit" or record.get("leak_rule_revision", UNSTAMPED_LEAK_RULE) >= LEAK_RULE_REVISION:
        return record
    return {**record, "rero_eta": None, "rero_kappa": None}


def _silent(line: str) -> None:
    """Attack-by-attack lines stay in the worker; the progress line says what finished."""


def execute(
    jobs: Sequence[Job],
    config: FrontierConfig,
    *,
    workers: int = 1,
    backend: Backend = "local",
    ray_address: str | None = None,
) -> Generator[tuple[Job, dict[str, Any]], None, None]:
    """Run ``jobs``, yielding each with its record as it finishes (in any order). No jobs (a run
    resumed at its end, a report-only call) start no worker pool and no Ray cluster."""
    if not jobs:
        return
    if backend == "ray":
        yield from _execute_ray(jobs, config, workers, ray_address)
    elif workers == 1:
        for job in jobs:
            yield job, run_job(job, config)
    else:
        yield from _execute_processes(jobs, config, workers)


def _execute_processes(
    jobs: Sequence[Job], config: FrontierConfig, workers: int
) -> Generator[tuple[Job, dict], None, None]:
    # An interrupted run (SIGINT's KeyboardInterrupt, an error, the caller closing this generator)
    # leaves the block by an exception, which terminates the workers and their running jobs; the
    # finished jobs are already in the results file.
    with worker_pool(workers) as pool:
        pending: dict[Future, Job] = {pool.submit(run_job, job, config): job for job in jobs}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                job = pending.pop(future)
                try:
                    record = future.result()
                except Exception as err:  # the worker died (killed, out of memory) or its result did not pickle
                    record = failure_record(job, err)
                yield job, record


def _execute_ray(
    jobs: Sequence[Job], config: FrontierConfig, workers: int, address: str | None
) -> Generator[tuple[Job, dict], None, None]:
    try:
        import ray
    except ImportError as err:  # the optional extra
        raise ImportError("backend='ray' needs Ray: pip install 'lightning-gp[frontier-ray]'") from err
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {"address": address} if address else {"num_cpus": workers}
        ray.init(include_dashboard=False, log_to_driver=False, **kwargs)
    remote = ray.remote(num_cpus=1)(run_job)
    pending = {remote.remote(job, config): job for job in jobs}
    try:
        while pending:
            finished, _ = ray.wait(list(pending), num_returns=1)
            for ref in finished:
                job = pending.pop(ref)
                try:
                    record = ray.get(ref)
                except Exception as err:  # the task's worker died
                    record = failure_record(job, err)
                yield job, record
    finally:
        for ref in pending:
            ray.cancel(ref)
        if started:
            ray.shutdown()
