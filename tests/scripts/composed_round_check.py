"""Run by tests/test_composed_begin_round.py: two gloo processes, the DDP hook's held path with
``[GaussianNoise, AlignedDualGradientPruning]`` (ADGP prepared from each rank's noised gradient).

Usage: composed_round_check.py OUTDIR. Each rank writes OUTDIR/rank{r}.pt with:

* ``raw``, ``mask``, ``provider``, ``aggregate``: a round where both ranks defend their gradient;
* ``nan``: the error raised when rank 1's gradient holds a NaN, which the noise stage refuses
  before ADGP's mask is broadcast (every rank must raise the same error instead of waiting).
"""

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_gp.callbacks import AlignedDualGradientPruning, GaussianNoise
from lightning_gp.pipeline import SharedGradientPipeline
from lightning_gp.pipeline.ddp import DefendedAllReduce
from lightning_gp.pipeline.stages import ClientSetup

SCALE = 5.0


class WholeModelBucket:
    """A GradBucket holding every parameter of ``module``: gradients are views into one flat buffer."""

    def __init__(self, module: nn.Module, buffer: torch.Tensor) -> None:
        self.params, self.flat = list(module.parameters()), buffer

    def parameters(self) -> list[nn.Parameter]:
        return self.params

    def gradients(self) -> list[torch.Tensor]:
        views, start = [], 0
        for p in self.params:
            views.append(self.flat[start : start + p.numel()].view(p.shape))
            start += p.numel()
        return views

    def buffer(self) -> torch.Tensor:
        return self.flat

    def is_last(self) -> bool:
        return True


def held_round(rank: int, module: nn.Module, buffer: torch.Tensor) -> tuple[torch.Tensor, AlignedDualGradientPruning]:
    adgp = AlignedDualGradientPruning(k=0.25, k1=0.1, error_feedback=False, seed=1)
    stages = [GaussianNoise(scale=SCALE, seed=3), adgp]
    for stage in stages:
        stage.bind(ClientSetup(2, module, {n: p.shape for n, p in module.named_parameters()}, cohort_size=2))
    pipeline = SharedGradientPipeline(stages, [])
    trainer = SimpleNamespace(global_rank=rank, global_step=0, world_size=2)
    hook = DefendedAllReduce(trainer, module, pipeline, None)
    assert not hook.bucketwise
    return hook.on_bucket(WholeModelBucket(module, buffer)).wait(), adgp


def run(rank: int, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'store')}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        module = nn.Linear(8, 4)  # the same model on both ranks
        buffer = torch.randn(36, generator=torch.Generator().manual_seed(10 + rank))
        raw = buffer.clone()
        aggregate, adgp = held_round(rank, module, buffer)
        result = {
            "raw": raw,
            "mask": adgp.defense.round_mask,
            "provider": adgp.defense.mask_provider,
            "aggregate": aggregate.clone(),
        }
        poisoned = torch.randn(36, generator=torch.Generator().manual_seed(20 + rank))
        if rank == 1:
            poisoned[3] = float("nan")
        try:
            held_round(rank, module, poisoned)
            result["nan"] = "ok"
        except RuntimeError as err:
            result["nan"] = f"{type(err).__name__}: {err}"
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=2)
