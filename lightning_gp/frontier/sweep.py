"""The privacy-utility frontier: which defense at which strength keeps a client's images private
against the strongest attacker, at the smallest cost in accuracy, time and bytes.

:func:`frontier` sweeps every grid of a :class:`~lightning_gp.frontier.grid.FrontierConfig`
(each defense family over its strength knob, compositions included) over the client batch sizes and
model stages, audits each point with :func:`~lightning_gp.audit.audit_setting` (the worst case over
every published, adaptive and active attack, per threat model), trains each setting once per batch
size (PMM, time and upload bytes, :func:`~lightning_gp.audit.train_setting`), and reads out the
Pareto set and the recommendation (:mod:`~lightning_gp.frontier.report`). A bad config fails
before any work (:func:`~lightning_gp.frontier.grid.check_frontier_config`); a run writes each
finished job at once and a rerun resumes (:mod:`~lightning_gp.frontier.run`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_gp.frontier.grid import FrontierConfig, check_frontier_config, not_applicable
from lightning_gp.frontier.report import (
    FrontierPoint,
    Recommendation,
    frontier_markdown,
    frontier_points,
    recommend,
    save_frontier_figure,
    write_csv,
)
from lightning_gp.frontier.run import (
    Backend,
    Job,
    Progress,
    ResultStore,
    carried_records,
    current_records,
    decisive_first,
    execute,
    fingerprint,
    frontier_jobs,
    hours_minutes_seconds,
    job_estimates,
)
from lightning_gp.validation import check_bool, check_choice, check_positive_int


@dataclass
class FrontierResult:
    """A finished frontier.

    Attributes:
        points: one per setting x batch size x stage x threat model (:class:`FrontierPoint`).
        recommendations: per batch size and threat model, the pick or the closest point.
        ran: the jobs this call ran (the others were read back from the results file).
        files: what was written (the results file, the CSV, the Markdown, the figure).
        failed: the jobs that raised, each with its error; their points are missing from the report
            (never private there) and a rerun tries them again.
    """

    points: list[FrontierPoint]
    recommendations: list[Recommendation]
    ran: list[Job] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    failed: list[tuple[Job, str]] = field(default_factory=list)

    def markdown(self, title: str = "Privacy-utility frontier", context: tuple[str, ...] = ()) -> str:
        return frontier_markdown(self.points, title=title, context=context)


def _progress(
    jobs: list[Job],
    todo: list[Job],
    stored: dict[str, dict[str, Any]],
    store: ResultStore,
    workers: int,
    log: Callable[[str], None],
    *,
    estimate: bool,
) -> Progress:
    """Say what the run holds and has left (with an ETA from the stored jobs' times when ``estimate``)
    and give the progress bar over the jobs left."""
    stale = sum(job.key in stored for job in todo)
    log(
        f"frontier: {len(jobs)} jobs ({sum(j.kind == 'audit' for j in jobs)} audits, "
        f"{sum(j.kind == 'train' for j in jobs)} trainings); {len(jobs) - len(todo)} already done"
        + (f" in {store.path}" if store.path is not None else "")
        + (
            f"; run again though stored: {stale} (an older version's, or missing an attack this budget runs)"
            if stale
            else ""
        )
    )
    estimates = job_estimates(todo, stored) if estimate else None
    progress = Progress(len(jobs), len(jobs) - len(todo), workers, log, estimates=estimates, jobs=todo)
    if estimates:
        left = hours_minutes_seconds(progress.eta(0.0))
        log(f"frontier: about {left} left on {workers} workers at the finished jobs' pace")
    return progress


def _gap_notes(config: FrontierConfig, channels: int, log: Callable[[str], None]) -> tuple[str, ...]:
    """The report's lines on the grids a client-training entry leaves out (:func:`not_applicable`)."""
    gaps = not_applicable(config, channels)
    for gap in gaps:
        log(f"frontier: {gap}")
    return tuple(f"{gap}." for gap in gaps)


def _failed_note(failed: list[tuple[Job, str]], log: Callable[[str], None]) -> tuple[str, ...]:
    """The report's line on the jobs that raised (none: no line)."""
    if not failed:
        return ()
    log(f"frontier: {len(failed)} jobs failed (not stored; the same command again retries them)")
    listed = "; ".join(f"{job.describe()}: {error}" for job, error in failed)
    return (f"{len(failed)} jobs failed and are missing here (a rerun tries them again): {listed}.",)


def _carried_note(
    carried: dict[str, dict[str, Any]], records: dict[str, dict[str, Any]], log: Callable[[str], None]
) -> tuple[str, ...]:
    """The report's line on the ``carried`` records no rerun has replaced in ``records`` (none: no line)."""
    still = sum(records[key] is record for key, record in carried.items())
    if not still:
        return ()
    log(f"frontier: {still} stored audits that leaked everywhere are reported until rerun")
    note = (
        f"{still} audits not rerun yet show their stored record: each leaked to every server under an "
        "attacker weaker than today's (an older label recovery, or no learned inverter), so its verdict "
        "stands; its leak fraction and PSNR may still change."
    )
    return (note,)


def frontier(
    config: FrontierConfig,
    output_dir: str | Path | None = None,
    *,
    workers: int = 1,
    backend: Backend = "local",
    ray_address: str | None = None,
    name: str = "frontier",
    title: str = "Privacy-utility frontier",
    context: tuple[str, ...] = (),
    log: Callable[[str], None] = print,
    on_job: Callable[[Job, dict[str, Any]], None] | None = None,
    report_only: bool = False,
) -> FrontierResult:
    """Run the frontier of ``config``; with ``output_dir`` write ``<name>_points.jsonl`` (each job as
    it finishes; a rerun skips the jobs found there) and ``<name>.csv``, ``<name>.md``, ``<name>.png``.

    Args:
        workers: jobs run at once (``1``: in this process; ``backend="local"``: spawned processes).
        backend: ``"local"`` or ``"ray"`` (``ray_address``: an existing cluster; else a local one).
        log: where the progress lines go (one per finished job, with an ETA; a failed job's with the
            end of its traceback).
        on_job: called with each finished job and its record, after it is written (not for a job
            that failed: see :attr:`FrontierResult.failed`).
        report_only: run no job; report the jobs already in ``<name>_points.jsonl`` (a long run still
            going elsewhere, or cut short). A missing stage counts as not private (inconclusive).
            A stored audit that runs again under a stronger attack is reported as stored until its
            rerun finishes only where it leaked to every server (:func:`carried_records`).
    """
    check_positive_int(workers, "workers")
    check_bool(report_only, "report_only")
    check_choice(backend, "backend", ("local", "ray"))
    datamodule, _ = check_frontier_config(config)
    channels = int(datamodule.image_shape[0])
    jobs = frontier_jobs(config, channels)
    context = (*context, *_gap_notes(config, channels, log))
    directory = None if output_dir is None else Path(output_dir)
    results = f"{name}_points.jsonl"
    store = ResultStore(None if directory is None else directory / results, fingerprint(config))
    stored = store.load()
    records = current_records(jobs, stored, config, channels)
    todo = [job for job in jobs if job.key not in records]
    carried = carried_records(todo, stored)
    records.update(carried)  # reported until their reruns replace them
    todo = decisive_first(todo, records)
    progress = _progress(jobs, todo, stored, store, workers, log, estimate=not report_only)
    ran: list[Job] = []
    failed: list[tuple[Job, str]] = []
    if report_only and todo:
        log(f"frontier: report only; {len(todo)} jobs not run")
        context = (*context, f"Partial: {len(jobs) - len(todo)} of {len(jobs)} jobs finished; {len(todo)} not run yet.")
    # closing(): an exception here (Ctrl-C while a record is written, an error in on_job) closes the
    # executor at once, which ends its workers, instead of leaving it to the garbage collector.
    with closing(
        execute([] if report_only else todo, config, workers=workers, backend=backend, ray_address=ray_address)
    ) as finished:
        for job, record in finished:
            progress.update(job, record)
            if record.get("failed"):  # not stored: the point stays missing and a rerun tries it again
                failed.append((job, record["failed"]))
                log(record["traceback"].rstrip())
                continue
            store.append(job.key, record)
            records[job.key] = record
            ran.append(job)
            if on_job is not None:
                on_job(job, record)
    context = (*context, *_failed_note(failed, log), *_carried_note(carried, records, log))
    points = frontier_points(jobs, records)
    result = FrontierResult(points, recommend(points), ran, failed=failed)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        write_csv(points, directory / f"{name}.csv")
        (directory / f"{name}.md").write_text(result.markdown(title, context))
        save_frontier_figure(points, directory / f"{name}.png", title=title)
        result.files = [directory / results, *(directory / f"{name}.{ext}" for ext in ("csv", "md", "png"))]
    return result
