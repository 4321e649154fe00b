"""Run by tests/test_ddp.py: two gloo processes call the comm hook's round check with given rounds.

Usage: round_check.py OUTDIR ROUND_OF_RANK0 ROUND_OF_RANK1; each rank writes "ok" or the error
message to OUTDIR/rank{r}.txt.
"""

import os
import sys
from types import SimpleNamespace

import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_gp.callbacks.ddp import DefendedAllReduce


def run(rank: int, outdir: str, rounds: list[int]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'store')}", rank=rank, world_size=2)
    try:
        DefendedAllReduce._check_same_round(SimpleNamespace(process_group=None), rounds[rank])
        message = "ok"
    except RuntimeError as err:
        message = str(err)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as handle:
        handle.write(message)


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], [int(sys.argv[2]), int(sys.argv[3])]), nprocs=2)
