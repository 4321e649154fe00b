"""``lightning-gp frontier --config configs/frontier_quick.yaml``: the privacy-utility frontier.

Sweeps each defense family of ``grids`` over its strengths, at every client batch size and model
stage, audits each point against every attack (worst case per threat model), trains each setting for
PMM, time and bytes, and writes ``frontier_points.jsonl`` (each job as it finishes: rerun the same
command to resume), ``frontier.csv``, ``frontier.md`` (the recommendation table) and
``frontier.png`` (the frontier) to ``output_dir``. ``--check true`` validates the config and prints
the jobs without running them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser

from lightning_gp.audit import AttackBudget
from lightning_gp.cli.help import short_help
from lightning_gp.frontier.grid import (
    ClientTraining,
    FrontierConfig,
    Grid,
    check_frontier_config,
    config_fields,
    not_applicable,
)
from lightning_gp.frontier.run import frontier_jobs
from lightning_gp.frontier.sweep import frontier
from lightning_gp.frontier.workers import keep_freed_memory

USAGE = "lightning-gp frontier --config configs/frontier_quick.yaml [--output_dir DIR] [--workers N]"
EXAMPLES = (
    "lightning-gp frontier --config configs/frontier_quick.yaml --output_dir runs/frontier_quick",
    "lightning-gp frontier --config configs/frontier.yaml --workers 2 --check true",
    "lightning-gp frontier --config configs/frontier.yaml --backend ray --ray_address auto",
)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="lightning-gp frontier", description=__doc__, env_prefix="LIGHTNING_GP")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config (see configs/frontier*.yaml)")
    parser.add_argument("--model", type=dict[str, Any], required=True, help="the client model (class_path + init_args)")
    parser.add_argument(
        "--datamodule", type=dict[str, Any], required=True, help="the clients' data (class_path + init_args)"
    )
    parser.add_argument("--grids", type=list[Grid], required=True, help="defense families and their strength grids")
    parser.add_argument("--batch_sizes", type=list[int], default=[1, 8], help="images per client batch")
    parser.add_argument("--stages", type=list[int], default=[0, 50], help="audited rounds (0: at initialisation)")
    parser.add_argument("--images", type=int, default=8, help="attacked images per point")
    parser.add_argument("--train_rounds", type=int, default=200, help="FedSGD rounds of the PMM training")
    parser.add_argument("--num_clients", type=int, default=10, help="clients of the federation")
    parser.add_argument("--attacks", type=list[str] | None, default=None, help="published attacks (default: all)")
    parser.add_argument("--budget", type=AttackBudget, default=AttackBudget(), help="the attacks' budget")
    parser.add_argument(
        "--lpips",
        type=bool,
        default=True,
        help="score LPIPS (needs the pretrained AlexNet weights; the verdict's mean-LPIPS line goes unchecked without it)",
    )
    parser.add_argument("--undefended", type=bool, default=True, help="add the undefended reference")
    parser.add_argument("--seed", type=int, default=0, help="seeds the images, the models and the attacks")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument(
        "--client_training",
        type=list[ClientTraining],
        default=[ClientTraining()],
        help="how clients train before they share, each a frontier of its own: FedSGD (one gradient), or FedAvg "
        "(e.g. {algorithm: fedavg, local_epochs: 5, local_batch_size: 8})",
    )
    parser.add_argument(
        "--model_checks",
        type=bool,
        default=False,
        help="the clients check every model they receive (its digest in the secure sum, its provenance); "
        "an active attack whose model they refuse is an n/a cell",
    )
    parser.add_argument("--output_dir", type=str, default="frontier", help="where results go (a rerun resumes)")
    parser.add_argument("--workers", type=int, default=1, help="jobs in parallel (worker processes or Ray tasks)")
    parser.add_argument("--backend", type=str, default="local", help="'local' (processes) or 'ray'")
    parser.add_argument("--ray_address", type=str | None, default=None, help="join a Ray cluster (e.g. 'auto')")
    parser.add_argument("--title", type=str, default="Privacy-utility frontier", help="the report's title")
    parser.add_argument("--check", type=bool, default=False, help="validate the config and list the jobs; run nothing")
    parser.add_argument(
        "--report_only", type=bool, default=False, help="write the report of the finished jobs; run nothing"
    )
    return parser


def config_from(namespace: Any) -> FrontierConfig:
    """The :class:`FrontierConfig` of parsed, instantiated arguments."""
    values = {name: namespace[name] for name in config_fields()}
    return FrontierConfig(**values)


def help_text() -> str:
    """What ``lightning-gp frontier --help`` prints (stored in :mod:`lightning_gp.cli.help_texts`)."""
    return short_help(build_parser(), usage=USAGE, examples=EXAMPLES, full_flag="lightning-gp frontier --help-full")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv in ([], ["-h"], ["--help"]):
        print(help_text())
        return
    parser = build_parser()
    if argv == ["--help-full"]:
        argv = ["--help"]
    namespace = parser.instantiate(parser.parse_args(argv))
    config = config_from(namespace)
    if namespace.check:
        datamodule, _ = check_frontier_config(config)
        jobs = frontier_jobs(config, int(datamodule.image_shape[0]))
        print(f"config ok: {len(jobs)} jobs ({sum(j.kind == 'audit' for j in jobs)} audits)")
        for gap in not_applicable(config, int(datamodule.image_shape[0])):
            print(f"  not run: {gap}")
        for job in jobs:
            print(f"  {job.kind:5s} {job.describe()}")
        return
    keep_freed_memory()  # this command's process runs the jobs itself with one worker
    result = frontier(
        config,
        Path(namespace.output_dir),
        workers=namespace.workers,
        backend=namespace.backend,
        ray_address=namespace.ray_address,
        title=namespace.title,
        report_only=namespace.report_only,
    )
    print(f"written: {namespace.output_dir}/frontier.{{csv,md,png}} and frontier_points.jsonl")
    if result.failed:
        raise SystemExit(f"{len(result.failed)} jobs failed (listed above and in frontier.md); rerun to retry them")
