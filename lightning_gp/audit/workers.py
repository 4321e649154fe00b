"""Worker processes for long audit runs (the frontier, the matrix) that end with their parent.

A spawned worker of a plain :class:`~concurrent.futures.ProcessPoolExecutor` outlives a parent
killed by a signal (``kill``, ``pkill -f``, an out-of-memory kill): it finishes the audit it holds,
which can take an hour, on cores the user believes free. Each worker of :func:`worker_pool` watches
its parent and exits as soon as it is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor

#: Seconds between a worker's checks that its parent is alive.
PARENT_POLL_SECONDS = 1.0


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """``workers`` spawned processes (a fresh interpreter each: no forked torch threads or CUDA
    state) that exit within :data:`PARENT_POLL_SECONDS` of the process that made them dying."""
    return ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=exit_with_parent,
        initargs=(os.getpid(),),
    )


def exit_with_parent(parent: int) -> None:
    """Start a daemon thread that ends this process once its parent is no longer ``parent`` (a dead
    parent's children are adopted by another process; the check is POSIX's, so on Windows the
    worker keeps the default behaviour)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)  # no cleanup: the results of a dead parent have nowhere to go

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
