"""Worker processes for long audit runs (the frontier, the matrix) that end with their parent.

A spawned worker of a plain :class:`~concurrent.futures.ProcessPoolExecutor` outlives a parent
killed by a signal (``kill``, ``pkill -f``, an out-of-memory kill): it finishes the audit it holds,
which can take an hour, on cores the user believes free. Each worker of :func:`worker_pool` watches
its parent and exits as soon as it is gone. A parent interrupted by an exception (SIGINT's
``KeyboardInterrupt`` above all, sent to the parent alone as a scheduler or a wrapper does) would
instead wait for its running jobs, in ``shutdown`` and again at interpreter exit: a
:class:`WorkerPool` left by an exception terminates its workers instead. While a ``with`` block holds
the pool, SIGTERM and SIGHUP (a scheduler's stop, a closed terminal) raise ``SystemExit(128 +
signal)`` in the parent, where they would otherwise kill it outright: the block is left by that
exception, so the workers end at once and the interpreter exits as usual, its multiprocessing
semaphores released (a parent killed outright left them for the resource tracker, which warned of
"leaked semaphore objects").

A worker also keeps the memory it frees for its next allocations (:func:`keep_freed_memory`, on
glibc): by default glibc's malloc maps every block above a threshold of at most 32 MiB afresh and
returns the top of its heap to the system after each large free, so a job whose steps allocate and
free large transient tensors (Soteria's forward-mode Jacobian of a batch: about 60 MiB a layer) pays
a page fault for every 4 KiB of them at every step.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import platform
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from types import FrameType, TracebackType
from typing import Any

#: Seconds between a worker's checks that its parent is alive.
PARENT_POLL_SECONDS = 1.0

#: glibc malloc in a worker (bytes): blocks up to ``WORKER_MMAP_THRESHOLD`` come from the heap, which
#: keeps up to ``WORKER_TRIM_THRESHOLD`` of freed memory at its top instead of returning it to the system.
WORKER_MMAP_THRESHOLD = 256 * 2**20
WORKER_TRIM_THRESHOLD = 512 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)

#: Signals that end a parent holding a pool by ``SystemExit`` (where their handler is the default).
EXIT_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class WorkerPool(ProcessPoolExecutor):
    """A process pool whose workers end with their parent (:func:`exit_with_parent`) and which a
    ``with`` block left by an exception (``KeyboardInterrupt`` included) terminates at once, running
    jobs and all, instead of waiting for them. Inside the block, SIGTERM and SIGHUP with their default
    handlers raise ``SystemExit(128 + signal)`` (module docstring); the handlers are restored after it."""

    _replaced: dict[int, Any]

    def __enter__(self) -> WorkerPool:
        self._replaced = {}
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for sig in EXIT_SIGNALS:
                if signal.getsignal(sig) is signal.SIG_DFL:
                    self._replaced[sig] = signal.signal(sig, _exit_on_signal)
        return self

    def terminate_workers(self) -> None:
        """Cancel the queued jobs and terminate every worker (SIGTERM), as Python 3.14's method of
        the same name does, then kill (SIGKILL) those still running a second later: a worker inside
        ``Trainer.fit`` has Lightning's SIGTERM handler, which only notes the signal. The pool is shut
        down afterwards; pending futures fail."""
        processes = list((self._processes or {}).values())  # shutdown() forgets them
        self.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + PARENT_POLL_SECONDS
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=PARENT_POLL_SECONDS)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> bool | None:
        try:
            if exc_type is not None:
                self.terminate_workers()
                return False
            return super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            for sig, handler in getattr(self, "_replaced", {}).items():
                signal.signal(sig, handler)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    print(f"worker_pool: {signal.Signals(signum).name}: stopping the workers", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def worker_pool(workers: int) -> WorkerPool:
    """``workers`` spawned processes (a fresh interpreter each: no forked torch threads or CUDA
    state) that exit within :data:`PARENT_POLL_SECONDS` of the process that made them dying, and
    at once when the ``with`` block holding the pool is left by an exception; each keeps the memory it
    frees (:func:`start_worker`)."""
    return WorkerPool(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=start_worker,
        initargs=(os.getpid(),),
    )


def start_worker(parent: int) -> None:
    """A pool worker's set-up: it ends with ``parent`` (:func:`exit_with_parent`) and keeps the memory it
    frees (:func:`keep_freed_memory`)."""
    exit_with_parent(parent)
    keep_freed_memory()


def keep_freed_memory(mmap_threshold: int = WORKER_MMAP_THRESHOLD, trim_threshold: int = WORKER_TRIM_THRESHOLD) -> bool:
    """Make glibc's malloc in this process serve blocks up to ``mmap_threshold`` bytes from its heap and
    keep up to ``trim_threshold`` bytes of freed memory at the heap's top (``mallopt``): a process that
    allocates and frees the same large transient tensors step after step then reuses their pages
    instead of faulting fresh ones in (the module docstring). The process may hold that much more
    memory than it uses, and a few freed blocks besides (an aligned block leaves a hole slightly smaller
    than the next request of its size, so the heap grows by some before freed blocks fit). Returns whether the settings were made: not off glibc, and not where the
    environment already sets glibc's thresholds (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``
    or ``GLIBC_TUNABLES``), which are left as the user set them."""
    for value, name in ((mmap_threshold, "mmap_threshold"), (trim_threshold, "trim_threshold")):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise ValueError(f"{name} must be a number of bytes in [0, 2**31), got {value!r}")
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if platform.libc_ver()[0] != "glibc" or any(
        os.environ.get(f"MALLOC_{name.upper()}_") is not None or f"glibc.malloc.{name}" in tunables
        for name in ("mmap_threshold", "trim_threshold")
    ):
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def exit_with_parent(parent: int) -> None:
    """Start a daemon thread that ends this process once its parent is no longer ``parent`` (a dead
    parent's children are adopted by another process; the check is POSIX's, so on Windows the
    worker keeps the default behaviour)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)  # no cleanup: the results of a dead parent have nowhere to go

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
