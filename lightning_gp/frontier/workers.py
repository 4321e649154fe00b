"""Worker processes for long audit runs (the frontier, the matrix) that end with their parent.

A spawned worker of a plain :class:`~concurrent.futures.ProcessPoolExecutor` outlives a parent
killed by a signal (``kill``, ``pkill -f``, an out-of-memory kill): it finishes the audit it holds,
which can take an hour, on cores the user believes free. Each worker of :func:`worker_pool` watches
its parent and exits as soon as it is gone. A parent interrupted by an exception (SIGINT's
``KeyboardInterrupt`` above all, sent to the parent alone as a scheduler or a wrapper does) would
instead wait for its running jobs, in ``shutdown`` and again at interpreter exit: a
:class:`WorkerPool` left by an exception terminates its workers instead.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from types import TracebackType

#: Seconds between a worker's checks that its parent is alive.
PARENT_POLL_SECONDS = 1.0


class WorkerPool(ProcessPoolExecutor):
    """A process pool whose workers end with their parent (:func:`exit_with_parent`) and which a
    ``with`` block left by an exception (``KeyboardInterrupt`` included) terminates at once, running
    jobs and all, instead of waiting for them."""

    def terminate_workers(self) -> None:
        """Cancel the queued jobs and terminate every worker (SIGTERM), as Python 3.14's method of
        the same name does. The pool is shut down afterwards; pending futures fail."""
        processes = list((self._processes or {}).values())  # shutdown() forgets them
        self.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=PARENT_POLL_SECONDS)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> bool | None:
        if exc_type is not None:
            self.terminate_workers()
            return False
        return super().__exit__(exc_type, exc_val, exc_tb)


def worker_pool(workers: int) -> WorkerPool:
    """``workers`` spawned processes (a fresh interpreter each: no forked torch threads or CUDA
    state) that exit within :data:`PARENT_POLL_SECONDS` of the process that made them dying, and
    at once when the ``with`` block holding the pool is left by an exception."""
    return WorkerPool(
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
