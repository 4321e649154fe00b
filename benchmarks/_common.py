"""Shared output helpers for the benchmark scripts: a printed table plus CSV and Markdown files."""

from __future__ import annotations

import ast
import contextlib
import csv
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def fashion_mnist_datasets(full: bool) -> dict[str, Any]:
    """The built-in sample, plus the full Fashion-MNIST when asked for and installed."""
    from lightning_gp.data import FashionMNISTDataModule, FashionMNISTSampleDataModule
    from lightning_gp.data.base import DatasetNotFoundError

    datasets: dict[str, Any] = {"sample": FashionMNISTSampleDataModule()}
    if full:
        try:
            datamodule = FashionMNISTDataModule()
            datamodule.prepare_data()
            datasets["fashion-mnist"] = datamodule
        except DatasetNotFoundError as err:
            print(f"full Fashion-MNIST not installed, skipped: {err}")
    return datasets


def torch_default_adam(
    parameters: Any, *, lr: float, betas: tuple[float, float] = (0.9, 0.999)
) -> Any:  # the stand-in for lightning_gp.optim.fused_adam when a benchmark measures the code before it
    """torch's default (looped) Adam, with ``fused_adam``'s signature."""
    import torch

    return torch.optim.Adam(parameters, lr=lr, betas=betas)


def median_seconds(
    fn: Callable[[], Any], repeats: int, warmup: int = 2, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The median of ``repeats`` timed calls of ``fn`` after ``warmup`` untimed ones, on ``clock`` (wall
    time; ``time.process_time`` for the process's CPU time, which other jobs on the cores do not add to)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def rounded(value: float | None, digits: int = 2) -> float | None:
    """``round(value, digits)``, ``None`` kept (a cell with no value)."""
    return None if value is None else round(value, digits)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    columns = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(name: str, rows: Sequence[dict[str, Any]], preamble: str, output_dir: Path = RESULTS_DIR) -> Path:
    """Write ``name.csv`` and ``name.md``; print the Markdown table."""
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / f"{name}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = markdown_table(rows)
    (output_dir / f"{name}.md").write_text(f"# {name}\n\n{preamble}\n\n{table}\n")
    print(table)
    return output_dir / f"{name}.md"


def parse_call(spec: str, option: str, hint: str) -> tuple[str, dict[str, Any]]:
    """``"Name(keyword=literal, ...)"`` -> ``("Name", {keyword: value})``; anything else is refused
    naming ``option`` and what to write (``hint``)."""
    call = ast.parse(spec, mode="eval").body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
        raise ValueError(f"{option} {spec!r}: write {hint}")
    return call.func.id, {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}


def setting_builder(spec: str, option: str = "--setting", channels: int = 1) -> Callable[[int], Any]:
    """``seed -> setting``: the catalogue entry named ``spec``, or for ``"Name(keyword=literal, ...)"``
    the frontier family ``Name`` at those arguments (the frontier's point of that name), for images of
    ``channels`` channels."""
    from lightning_gp.audit import defense_catalog
    from lightning_gp.frontier import frontier_families

    if "(" not in spec:
        entry = defense_catalog([spec])[0]
        return lambda seed: entry.build(seed, channels)
    try:
        name, keywords = parse_call(spec, option, "Name(keyword=literal, ...) or a catalogue name")
    except (ValueError, SyntaxError) as err:
        raise SystemExit(str(err)) from err
    families = frontier_families()
    if name not in families:
        raise SystemExit(f"{option} {spec!r}: {name!r} is no frontier family; they are {sorted(families)}")
    return lambda seed: families[name].build(keywords, seed, channels)


def audits_both_ways(
    spec: str,
    datamodule: Any,
    indices: Sequence[Sequence[int]],
    budget: Any,
    ways: Sequence[tuple[str, Callable[[], contextlib.AbstractContextManager[Any]]]],
) -> tuple[dict[str, Any], dict[str, float]]:
    """The frontier point ``spec``'s adaptive attacks (``audit_setting(published=[])``, LeNetZhu at seed
    0) once inside each way's context, in the order given: the audits and their CPU seconds by label."""
    import lightning as L

    from lightning_gp.audit import audit_setting
    from lightning_gp.audit.quiet import library_noise_silenced
    from lightning_gp.models import LeNetZhu

    audits, seconds = {}, {}
    for label, way in ways:
        L.seed_everything(0, verbose=False)
        start = time.process_time()
        with way(), library_noise_silenced():
            audits[label] = audit_setting(
                setting_builder(spec)(0), LeNetZhu(), datamodule, indices=indices, published=[], budget=budget,
                log=lambda line: None,
            )  # fmt: skip
        seconds[label] = time.process_time() - start
    return audits, seconds


def compared_cells(
    spec: str, batch: int, images: int, audits: dict[str, Any], labels: Sequence[str]
) -> list[dict[str, Any]]:
    """A row per attack cell of ``audits[labels[0]]``: each way's leak fraction, mean PSNR, seconds and
    passive verdict, in the order of ``labels``."""
    cells = {label: {c.attack: c for c in audits[label].cells} for label in labels}
    rows = []
    for name in cells[labels[0]]:
        row: dict[str, Any] = {"setting": spec, "batch": batch, "images": images, "attack": name}
        row |= {f"leak fraction, {label}": cells[label][name].leak_fraction for label in labels}
        row |= {f"mean PSNR, {label}": rounded(cells[label][name].means.get("psnr")) for label in labels}
        row |= {f"s, {label}": round(cells[label][name].seconds, 1) for label in labels}
        row |= {f"passive verdict, {label}": audits[label].verdict("passive") for label in labels}
        rows.append(row)
    return rows


def attack_outcome(audit: Any, name: str, rule: Any, reference: Any) -> tuple[Any, list[Any], Any, int]:
    """The audit's cell of the attack ``name``, its per-client results, their merged report, and how
    many images the bare leak rule ``rule`` credits it with, without its prior-only control (each image
    judged against the trivial guesses of ``reference``, as ``benchmarks/prior_control.py`` reports it)."""
    import dataclasses

    from lightning_gp.audit.verdict import trivial_baselines
    from lightning_gp.metrics import concatenate_reports

    (cell,) = [c for c in audit.cells if c.attack == name]
    results = audit.results[name]
    merged = concatenate_reports([r.report for r in results])
    bare = dataclasses.replace(merged, prior_only=None)
    guesses = trivial_baselines(merged.original_pixels, reference_images=reference)
    return cell, results, merged, sum(rule.leaked(bare, guesses))
