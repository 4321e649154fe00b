"""Shared by the multi-process worker scripts: leave the process group before the interpreter exits."""

import torch.distributed as dist


def leave_process_group() -> None:
    """Barrier, then destroy the group: gloo's threads torn down at interpreter exit can abort a
    process that finished its work ("terminate called without an active exception", SIGABRT)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
