"""The privacy-utility frontier, our published run (issue 26).

Runs ``configs/frontier.yaml`` (``--quick``: ``configs/frontier_quick.yaml``, CI-sized) through
``lightning_gp.audit.frontier``: every defense family over its strength grid, at client batch sizes
1 and 8, at initialisation and after training, each point attacked by every published, adaptive and
active attack (worst case per threat model), each setting trained for PMM, time and upload bytes.
The full run reads the full Fashion-MNIST when installed (``FashionMNISTDataModule``), else the
built-in sample (``--sample`` forces it); the quick run always uses the sample.

Writes ``benchmarks/results/frontier[_quick].{csv,md,png}`` and ``frontier[_quick]_points.jsonl``
(each job as it finishes: rerun the same command to resume an interrupted run). ``--workers`` runs
jobs in parallel processes (``--backend ray`` on a Ray cluster).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from _common import RESULTS_DIR, fashion_mnist_datasets

from lightning_gp.audit import FrontierConfig, LeakRule, frontier
from lightning_gp.cli.frontier import build_parser, config_from

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def load_config(path: Path) -> FrontierConfig:
    """A :class:`FrontierConfig` from a YAML, read as ``lightning-gp frontier --config`` reads it."""
    parser = build_parser()
    return config_from(parser.instantiate(parser.parse_args(["--config", str(path)])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="configs/frontier_quick.yaml: the sample, tiny budgets")
    parser.add_argument("--sample", action="store_true", help="the built-in sample even if the full set is installed")
    parser.add_argument("--config", type=Path, default=None, help="another frontier YAML")
    parser.add_argument("--workers", type=int, default=2, help="jobs in parallel (one torch thread each)")
    parser.add_argument("--backend", default="local", choices=("local", "ray"))
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--report-only", action="store_true", help="report the jobs already finished (e.g. while a run goes on)"
    )
    args = parser.parse_args()
    name = "frontier_quick" if args.quick else "frontier"
    config = load_config(args.config or CONFIGS / f"{name}.yaml")
    data = "sample"
    if not args.quick and not args.sample and "fashion-mnist" in fashion_mnist_datasets(full=True):
        data = "fashion-mnist"
    else:
        datamodule = {"class_path": "lightning_gp.data.FashionMNISTSampleDataModule", "init_args": {"batch_size": 500}}
        config = dataclasses.replace(config, datamodule=datamodule)
    budget = config.budget
    context = (
        f"{config.model['class_path'].rsplit('.', 1)[1]} on {data}; {len(config.grids)} grids; batch sizes "
        f"{config.batch_sizes}; stages (audited rounds) {config.stages}; {config.images} attacked images per point "
        f"(ceil(images / B) clients of B images, drawn with seed {config.seed}); published attacks "
        f"{config.attacks or 'all'} plus each setting's adaptive attacks; IG/adaptive Adam {budget.ig_iterations} "
        f"iterations, L-BFGS {budget.lbfgs_iterations}, Robbing the Fed {budget.rtf_bins} bins; LPIPS "
        f"{'on' if config.lpips else 'off'}. PMM: test accuracy after "
        f"{config.train_rounds} FedSGD rounds ({config.num_clients} clients of B images) over the undefended run's at "
        f"the same B; time: that training's wall time over the undefended reference's (same runner), trained for the "
        f"same rounds just before and after it in the same worker; upload: bytes per client-round over "
        f"the dense gradient. Leak rule: {LeakRule().describe()}."
        + (" QUICK RUN: budgets far too small for conclusions." if args.quick else ""),
    )
    start = time.perf_counter()
    result = frontier(
        config,
        args.output_dir,
        workers=args.workers,
        backend=args.backend,
        name=name,
        title=f"Privacy-utility frontier ({'quick, ' if args.quick else ''}{data})",
        context=context,
        report_only=args.report_only,
    )
    seconds = time.perf_counter() - start
    print(f"{len(result.ran)} jobs ran in {seconds:.0f} s with {args.workers} workers")
    print("\n".join(str(p) for p in result.files))
    if result.failed:
        raise SystemExit(f"{len(result.failed)} jobs failed (listed above and in {name}.md); rerun to retry them")


if __name__ == "__main__":
    main()
