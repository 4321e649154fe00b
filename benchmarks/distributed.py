"""Defenses under DDP, one rank = one client (issue 14): step time, the defense's share, bytes, scaling.

Each rank trains a ResNet18 (CIFAR stem, 3x32x32, batch 32 per rank, as ``benchmarks/pruning.py``)
on synthetic data under Lightning DDP, undefended and with each defense in the communication
hook, and reports per configuration:

* ``step_ms``: the median optimizer step (forward, backward with the hook and the all-reduce,
  optimizer step), the slowest rank's median; ``added_pct``: its increase over the undefended
  step of the same world size (DDP's own all-reduce, no hook);
* ``defense_ms`` / ``defense_share``: time inside the defenses per step, and its share of the step;
* ``path``: ``ddp`` (undefended, DDP's built-in all-reduce), ``bucketwise`` (layerwise defenses
  defend each bucket as it arrives and all-reduce it asynchronously, overlapping the backward
  pass) or ``held`` (every bucket held until the last, the whole gradient defended once: what
  ADGP's shared mask needs; layerwise defenses are run both ways for the comparison);
* ``upload_MB``: what a rank's shared gradient costs under the sparse per-layer encoding of
  :class:`~lightning_gp.callbacks.CommunicationMeter` (values + bitmap or positions);
  ``allreduce_MB``: the dense bucket payload each rank all-reduces per step (DDP sums dense
  buckets whatever the defense zeroes; a ring all-reduce puts ``2 (N-1)/N`` of it on each rank's wire);
* ``speedup`` / ``efficiency``: throughput (images per second over all ranks) against one device.

Launch (results in benchmarks/results/distributed.{csv,md}):

    # CPU, Lightning spawns the ranks (gloo, one thread each); scaling 1 -> 2 processes
    python benchmarks/distributed.py --accelerator cpu --devices 2
    # one node's GPUs (NCCL), scaling 1, 2, 4, 8
    python benchmarks/distributed.py --accelerator gpu --devices 8
    # torchrun, one node or several (run the same command on every node, --node_rank 0..M-1):
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank 0 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        benchmarks/distributed.py --accelerator gpu --devices 8 --num_nodes 2
    # SLURM (Lightning reads the SLURM environment; one task per GPU):
    srun --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 \\
        python benchmarks/distributed.py --accelerator gpu --devices 8 --num_nodes 2

Launched by Lightning, the script runs one launch per world size (``--sizes``, default 1, 2, 4,
... up to ``--devices``) and reports the scaling. Under torchrun or SLURM it measures the world
size it was started with; rows of other world sizes already in the CSV (same accelerator, model
and batch) are kept, so a one-process launch before a large one gives the scaling rows.
``--quick``: a width-8 ResNet18 on 16x16 images, batch 8, 1 warm-up and 2 timed steps (CI size).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import RESULTS_DIR, write_results

if TYPE_CHECKING:
    import torch

    from lightning_gp.pipeline import StageCall


DEFENSE_NAMES = ("undefended", "Top-k 20%", "DGP (5%, 75%)", "ADGP (20%, 5%)", "Gaussian noise 0.01")


def _defenses() -> dict[str, tuple[Callable[[], list[Any]], tuple[str, ...]]]:
    """name -> (the defense callbacks, the ways to run them); ADGP's shared mask needs the whole model."""
    from lightning_gp import callbacks

    return {
        "undefended": (list, ("ddp",)),
        "Top-k 20%": (lambda: [callbacks.TopKPruning(rate=0.8, seed=1)], ("bucketwise", "held")),
        "DGP (5%, 75%)": (lambda: [callbacks.DualGradientPruning(k1=0.05, k2=0.75, seed=2)], ("bucketwise", "held")),
        "ADGP (20%, 5%)": (lambda: [callbacks.AlignedDualGradientPruning(k=0.2, k1=0.05, seed=3)], ("held",)),
        "Gaussian noise 0.01": (lambda: [callbacks.GaussianNoise(scale=0.01, seed=4)], ("bucketwise", "held")),
    }


def available_devices(accelerator: str) -> int:
    """Devices of this machine: its GPUs, or the CPU cores this process may run on."""
    if accelerator == "gpu":
        import torch

        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def launched_externally() -> bool:
    """Started by torchrun or inside a SLURM job step, rather than by Lightning's own launcher.

    The environment variables Lightning's TorchElasticEnvironment and SLURMEnvironment detect, read
    without importing torch, so bad arguments are refused at once.
    """
    slurm = "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    return "TORCHELASTIC_RUN_ID" in os.environ or slurm


def default_sizes(devices: int) -> list[int]:
    sizes, n = [], 1
    while n < devices:
        sizes.append(n)
        n *= 2
    return [*sizes, devices]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs per node")
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--sizes", type=int, nargs="+", help="world sizes to measure (default 1, 2, 4, .., devices)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank and step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (DDP rebuilds its buckets)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU process")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size (its default: 25)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="run every configuration this often, interleaved; keep the fastest"
    )
    parser.add_argument("--defenses", nargs="+", help="a subset of: " + ", ".join(DEFENSE_NAMES).replace("%", "%%"))
    parser.add_argument("--quick", action="store_true", help="tiny CI-size run")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--worker-result", type=Path, help=argparse.SUPPRESS)  # internal: one world size
    args = parser.parse_args(argv)
    if args.bucket_cap_mb <= 0:
        parser.error("--bucket-cap-mb must be > 0")
    for name in ("devices", "num_nodes", "batch_size", "steps", "threads", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-') if name != 'num_nodes' else name} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    unknown = sorted(set(args.defenses or []) - set(DEFENSE_NAMES))
    if unknown:
        parser.error(f"--defenses: unknown {unknown}; choose from {list(DEFENSE_NAMES)}")
    have = available_devices(args.accelerator)
    if args.accelerator == "gpu" and have == 0:
        parser.error("--accelerator gpu: this machine has no CUDA GPU (torch.cuda.device_count() is 0)")
    if args.devices > have:
        what = "GPUs this machine has" if args.accelerator == "gpu" else "CPU cores this process may use"
        parser.error(f"--devices {args.devices} is more than the {have} {what}")
    if args.sizes is not None and any(n < 1 or n > args.devices for n in args.sizes):
        parser.error(f"--sizes must lie in 1..--devices ({args.devices}), got {args.sizes}")
    if args.num_nodes > 1 and args.worker_result is None and not launched_externally():
        parser.error(
            f"--num_nodes {args.num_nodes} needs a multi-node launch: start the script with torchrun or srun on "
            "every node (see the commands in --help)"
        )
    if args.quick:
        args.batch_size, args.steps, args.warmup = min(args.batch_size, 8), min(args.steps, 2), min(args.warmup, 1)
    return args


# ------------------------------------------------------------------------------------------ worker
def make_model(quick: bool) -> tuple[Any, tuple[int, ...]]:
    from lightning_gp.models import ImageClassifier, ResNet18

    if quick:
        return ImageClassifier(ResNet18(image_size=16, width=8), lr=0.01), (3, 16, 16)
    return ImageClassifier(ResNet18(), lr=0.01), (3, 32, 32)


class Timed:
    """Wraps a defense callback's ``defend``/``defend_layers`` to add up the time spent in them."""

    def __init__(self, stage: Any, synchronize: Callable[[], None]) -> None:
        self.seconds = 0.0
        for name in ("defend", "defend_layers"):
            setattr(stage, name, self._timed(getattr(stage, name), synchronize))

    def _timed(self, method: Callable[..., Any], synchronize: Callable[[], None]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            synchronize()
            start = time.perf_counter()
            out = method(*args, **kwargs)
            synchronize()
            self.seconds += time.perf_counter() - start
            return out

        return timed


def measure_world(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """Every configuration at the world size this process group has; the rows on global rank 0."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gp.callbacks import SharedGradientObserver
    from lightning_gp.callbacks.communication import encoded_nbytes

    torch.set_num_threads(args.threads)
    gpu = args.accelerator == "gpu"
    synchronize = torch.cuda.synchronize if gpu else (lambda: None)

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.defense_seconds: list[float] = []
            self.timed: list[Timed] = []
            self.hold = False
            self.driver: Any = None
            self.buckets = 0

        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if self.driver is not None and self.hold:
                self.driver.runner.comm_hook.bucketwise = False  # the comparison: hold every bucket

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            synchronize()
            self._start, self._defense = time.perf_counter(), sum(t.seconds for t in self.timed)

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            synchronize()
            if trainer.global_step > args_warmup:  # global_step already counts this step
                self.seconds.append(time.perf_counter() - self._start)
                self.defense_seconds.append(sum(t.seconds for t in self.timed) - self._defense)
            if self.driver is not None:
                self.buckets = self.driver.runner.comm_hook.last_buckets

    class LastShared(SharedGradientObserver):
        """Keeps a reference to the last shared gradient (no copy: the timed steps pay nothing)."""

        def __init__(self) -> None:
            self.gradients: Mapping[str, torch.Tensor] = {}

        def observe(self, gradients: Mapping[str, torch.Tensor], call: StageCall) -> None:
            self.gradients = gradients

    args_warmup = args.warmup
    chosen = args.defenses or list(DEFENSE_NAMES)
    assert set(_defenses()) == set(DEFENSE_NAMES)
    rows: list[dict[str, Any]] = []
    configurations = [(n, path) for n, (_, paths) in _defenses().items() if n in chosen for path in paths]
    for repeat, (name, path) in [(r, c) for r in range(args.repeats) for c in configurations]:
        make = _defenses()[name][0]
        L.seed_everything(0, verbose=False)
        model, shape = make_model(args.quick)
        defense_callbacks = make()
        timer, last = StepTimer(), LastShared()
        timer.timed = [Timed(stage, synchronize) for stage in defense_callbacks]
        timer.driver, timer.hold = (defense_callbacks[0] if defense_callbacks else None), path == "held"
        extra = [last] if defense_callbacks else []
        world = args.devices * args.num_nodes
        per_rank = args.warmup + args.steps
        data = TensorDataset(
            torch.randn(world * per_rank * args.batch_size, *shape),
            torch.randint(0, 10, (world * per_rank * args.batch_size,)),
        )
        trainer = L.Trainer(
            accelerator=args.accelerator,
            devices=args.devices,
            num_nodes=args.num_nodes,
            strategy=DDPStrategy(bucket_cap_mb=args.bucket_cap_mb),
            max_steps=per_rank,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[*defense_callbacks, *extra, timer],
        )
        trainer.fit(model, DataLoader(data, batch_size=args.batch_size))
        if defense_callbacks:
            assert timer.driver.runner.comm_hook.bucketwise == (path == "bucketwise")
        params = [p for p in model.parameters() if p.requires_grad]
        mine = {
            "step_s": statistics.median(timer.seconds),
            "defense_s": statistics.mean(timer.defense_seconds),
            "upload_bytes": sum(encoded_nbytes(g) for g in last.gradients.values())
            if last.gradients
            else sum(p.numel() * p.element_size() for p in params),
        }
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if trainer.global_rank != 0:
            continue
        step_s = max(r["step_s"] for r in everyone)
        defense_s = statistics.mean(r["defense_s"] for r in everyone)
        rows.append(
            {
                "accelerator": args.accelerator,
                "model": "ResNet18 w8 16px" if args.quick else "ResNet18",
                "batch": args.batch_size,
                "world_size": dist.get_world_size(),
                "nodes": args.num_nodes,
                "defense": name,
                "path": path,
                "buckets": timer.buckets if defense_callbacks else "",
                "step_ms": 1e3 * step_s,
                "defense_ms": 1e3 * defense_s,
                "defense_share": defense_s / step_s,
                "upload_MB": statistics.mean(r["upload_bytes"] for r in everyone) / 1e6,
                "allreduce_MB": sum(p.numel() * p.element_size() for p in params) / 1e6,
            }
        )
        print(
            f"world {rows[-1]['world_size']} {name} [{path}] (repeat {repeat}): step {1e3 * step_s:.1f} ms, "
            f"defense {1e3 * defense_s:.1f} ms",
            flush=True,
        )
    rank = dist.get_rank()
    # leave the group before the interpreter exits: gloo's threads torn down at exit can abort the
    # process ("terminate called without an active exception", SIGABRT) after a successful run
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    fastest: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:  # repeats: the fastest run of each configuration (the least disturbed by other load)
        key = (row["defense"], row["path"])
        if key not in fastest or row["step_ms"] < fastest[key]["step_ms"]:
            fastest[key] = row
    return list(fastest.values())


# ------------------------------------------------------------------------------------------ report
def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``added_pct`` against the undefended step of the same world size; throughput and scaling
    against world size 1 of the same configuration."""
    undefended = {r["world_size"]: r["step_ms"] for r in rows if r["path"] == "ddp"}
    single = {(r["defense"], r["path"]): r for r in rows if r["world_size"] == 1}
    out = []
    for row in rows:
        row = dict(row)
        base = undefended.get(row["world_size"])
        row["added_pct"] = 100 * (row["step_ms"] / base - 1) if base else float("nan")
        row["images_per_s"] = row["world_size"] * row["batch"] / (row["step_ms"] / 1e3)
        one = single.get((row["defense"], row["path"]))
        speedup = row["images_per_s"] / (one["batch"] / (one["step_ms"] / 1e3)) if one else float("nan")
        row["speedup"] = speedup
        row["efficiency"] = speedup / row["world_size"]
        out.append(row)
    return out


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> Path:
    rows = add_ratios(sorted(rows, key=lambda r: r["world_size"]))
    threads = f", {args.threads} thread(s) per process" if args.accelerator == "cpu" else ""
    backend = "NCCL" if args.accelerator == "gpu" else "gloo"
    preamble = (
        f"Lightning DDP ({backend}), one rank = one client, synthetic data{threads}; median of "
        f"{args.steps} steps after {args.warmup} warm-up steps, the slowest rank. added_pct: step time over the "
        "undefended DDP step of the same world size. defense_share: time inside the defenses / step time. "
        "path bucketwise: defended and all-reduced bucket by bucket (overlapping the backward pass); held: every "
        "bucket held, whole gradient defended once. upload_MB: the shared gradient under the sparse per-layer "
        "encoding of CommunicationMeter; allreduce_MB: the dense payload DDP all-reduces per rank and step. "
        "speedup/efficiency: images per second against the same configuration on one device. Timings on a "
        "shared machine are noisy: compare ratios within one run."
    )
    return write_results("distributed", rows, preamble, args.output_dir)


def read_rows(path: Path) -> list[dict[str, Any]]:
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    numeric = ("batch", "world_size", "nodes", "step_ms", "defense_ms", "defense_share", "upload_MB", "allreduce_MB")
    for row in rows:
        for key in numeric:
            row[key] = float(row[key]) if "." in row[key] or "e" in row[key] else int(row[key])
    return rows


def merged_with_earlier(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rows of other world sizes from an earlier external launch of the same setting, then these."""
    path = args.output_dir / "distributed.csv"
    if not path.exists() or not rows:
        return rows
    same = {(r["accelerator"], r["model"], r["batch"]) for r in rows}
    sizes = {r["world_size"] for r in rows}
    keep = [r for r in read_rows(path) if (r["accelerator"], r["model"], r["batch"]) in same]
    keep = [{k: v for k, v in r.items() if k in rows[0]} for r in keep if r["world_size"] not in sizes]
    return keep + rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if args.worker_result is not None or launched_externally():
        rows = measure_world(args)
        if rows is None:
            return
        if args.worker_result is not None:
            args.worker_result.write_text(json.dumps(rows))
        else:
            report(merged_with_earlier(rows, args), args)
        return
    print(
        f"torch {torch.__version__}, {args.accelerator}, sizes {args.sizes or default_sizes(args.devices)}", flush=True
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes or default_sizes(args.devices):
            result = Path(tmp) / f"world{size}.json"
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                *sys_args(args, size),
                "--worker-result",
                str(result),
            ]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.accelerator == "cpu" else None
            subprocess.run(command, check=True, env=env)
            rows += json.loads(result.read_text())
    report(rows, args)


def sys_args(args: argparse.Namespace, devices: int) -> list[str]:
    """The command line of one world size's launch."""
    out = ["--accelerator", args.accelerator, "--devices", str(devices), "--batch-size", str(args.batch_size)]
    out += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    out += ["--output-dir", str(args.output_dir), "--bucket-cap-mb", str(args.bucket_cap_mb)]
    out += ["--repeats", str(args.repeats)]
    if args.defenses:
        out += ["--defenses", *args.defenses]
    return [*out, "--quick"] if args.quick else out


if __name__ == "__main__":
    main()
