"""A worker of a long audit run ends with its parent: killing the frontier or the matrix (SIGKILL,
which runs no cleanup) leaves no worker holding a core for the rest of its job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_gp.audit.workers import PARENT_POLL_SECONDS

ROOT = Path(__file__).resolve().parents[1]

# a parent that starts one worker, reports its pid, gives it a job of ten minutes and waits on it
PARENT = textwrap.dedent(
    """
    import os, sys, time
    from lightning_gp.audit.workers import worker_pool
    if __name__ == "__main__":
        pool = worker_pool(1)
        print(pool.submit(os.getpid).result(), flush=True)
        pool.submit(time.sleep, 600)
        time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    worker = None
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        assert _alive(worker)
        parent.kill()
        parent.wait()
        # liveness, not speed: the worker polls every PARENT_POLL_SECONDS; 60 times that is a hang
        deadline = time.monotonic() + 60 * PARENT_POLL_SECONDS
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its killed parent"
    finally:
        parent.kill()
        if worker is not None and _alive(worker):  # a failed check leaves no orphan behind
            os.kill(worker, signal.SIGKILL)
