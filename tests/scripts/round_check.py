"""Run by tests/test_ddp.py: two gloo processes exercise the comm hook's cross-rank agreements.

Usage: round_check.py OUTDIR. Each rank writes a JSON file OUTDIR/rank{r}.json with, per case,
"ok" or the error it raised:

* ``same_round`` / ``different_rounds``: the round check with rounds (3, 3) and (3, 4);
* ``one_rank_fails``: rank 1's pipeline failed (a NaN gradient), rank 0's did not;
* ``no_rank_fails``: neither failed.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_gp.defenses import NonFiniteGradientError
from lightning_gp.pipeline.ddp import DefendedAllReduce


def outcome(call) -> str:
    try:
        call()
        return "ok"
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}"


def run(rank: int, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'store')}", rank=rank, world_size=2)
    hook = SimpleNamespace(process_group=None, trainer=SimpleNamespace(global_step=5))
    nan = NonFiniteGradientError("client 1's gradient holds NaN or inf in ['fc.weight']")
    try:
        results = {
            "same_round": outcome(lambda: DefendedAllReduce._check_same_round(hook, 3)),
            "different_rounds": outcome(lambda: DefendedAllReduce._check_same_round(hook, [3, 4][rank])),
            "one_rank_fails": outcome(lambda: DefendedAllReduce._agree_on_failure(hook, nan if rank == 1 else None)),
            "no_rank_fails": outcome(lambda: DefendedAllReduce._agree_on_failure(hook, None)),
        }
    finally:
        dist.destroy_process_group()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=2)
