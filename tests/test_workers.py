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

from lightning_gp.frontier.workers import EXIT_SIGNALS, PARENT_POLL_SECONDS, keep_freed_memory, worker_pool

ROOT = Path(__file__).resolve().parents[1]

# a parent that starts one worker, reports its pid, gives it a job of ten minutes and waits on it
PARENT = textwrap.dedent(
    """
    import os, sys, time
    from lightning_gp.frontier.workers import worker_pool
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


# 10 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
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


# a parent that runs two long jobs through the frontier's own executor and reports both workers' pids
FRONTIER_PARENT = textwrap.dedent(
    """
    import os, signal, sys, time
    # started as a shell starts a command in the foreground: an ignored SIGINT is inherited, and
    # Python then installs no KeyboardInterrupt handler (a test process whose earlier tests ignored
    # SIGINT, as a Ray or Flower run can leave it, would otherwise hand that on)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from lightning_gp.frontier import run
    def slow_job(job, config):
        print(os.getpid(), flush=True)
        time.sleep(600)
    if __name__ == "__main__":
        run.run_job = slow_job  # the executor submits run.run_job; the workers import this module's slow_job
        for _ in run._execute_processes(["a", "b"], None, workers=2):
            pass
    """
)


def _signal_the_frontier_parent(tmp_path: Path, sig: signal.Signals) -> tuple[int | None, str]:
    """Start :data:`FRONTIER_PARENT`, send ``sig`` to the parent alone once both workers run, and
    return its exit status and stderr after checking that both workers ended."""
    script = tmp_path / "frontier_parent.py"
    script.write_text(FRONTIER_PARENT)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    workers: list[int] = []
    try:
        assert parent.stdout is not None
        workers = [int(parent.stdout.readline()) for _ in range(2)]
        assert all(_alive(w) for w in workers)
        parent.send_signal(sig)  # to the parent only, as `kill -INT <pid>` does
        # liveness, not speed: a parent that waits on its running jobs would sit here for ten minutes
        parent.wait(timeout=60 * PARENT_POLL_SECONDS)
        deadline = time.monotonic() + 60 * PARENT_POLL_SECONDS
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), "a worker outlived its signalled parent"
        # the resource tracker writes its warnings as it ends, after the parent: read to the end
        return parent.returncode, parent.stderr.read() if parent.stderr else ""
    finally:
        parent.kill()
        for worker in workers:
            if _alive(worker):
                os.kill(worker, signal.SIGKILL)


# 11 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigint_to_the_frontier_parent_alone_ends_it_and_its_workers(tmp_path: Path) -> None:
    _, stderr = _signal_the_frontier_parent(tmp_path, signal.SIGINT)
    assert "KeyboardInterrupt" in stderr


# 11 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_the_frontier_parent_ends_it_cleanly_with_its_workers(tmp_path: Path) -> None:
    returncode, stderr = _signal_the_frontier_parent(tmp_path, signal.SIGTERM)
    assert returncode == 128 + signal.SIGTERM, stderr  # SystemExit, not a kill: exit handlers ran
    assert "leaked semaphore" not in stderr, stderr


def test_a_held_pool_turns_default_exit_signals_into_system_exit_and_restores_them() -> None:
    def own(signum, frame):  # a handler the user installed is theirs: left alone
        pass

    previous = {sig: signal.getsignal(sig) for sig in EXIT_SIGNALS}
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, own)
        with worker_pool(1):  # no job submitted: no process starts
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, own)
            if hasattr(signal, "SIGHUP"):
                assert signal.getsignal(signal.SIGHUP) is own
            with pytest.raises(SystemExit) as stop:
                signal.raise_signal(signal.SIGTERM)
            assert stop.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        if hasattr(signal, "SIGHUP"):
            assert signal.getsignal(signal.SIGHUP) is own
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# 4-7 s (a spawned worker starts and imports the package)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_terminating_the_pool_kills_a_worker_that_ignores_sigterm() -> None:
    # a worker inside Trainer.fit has Lightning's SIGTERM handler, which only notes the signal
    pool = worker_pool(1)
    pool.submit(signal.signal, signal.SIGTERM, signal.SIG_IGN).result()
    worker = pool.submit(os.getpid).result()
    try:
        pool.submit(time.sleep, 600)
        pool.terminate_workers()
        assert not _alive(worker), "a worker that ignores SIGTERM outlived terminate_workers"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


BLOCK_BYTES = 64 * 2**20  # above glibc's largest dynamic mmap threshold (32 MiB): mapped afresh by default
PAGE_BYTES = 4096
STEPS, SETTLED = 20, 5

# measured in a fresh process (a plain one, or a pool's worker) from this source
REUSED_BLOCK = textwrap.dedent(
    f"""
    import resource, torch

    def faults_of_a_reused_block():
        # a step writes a fresh block of BLOCK_BYTES and frees it; the minor page faults of the last
        # SETTLED of STEPS steps (a heap that keeps freed memory needs a few steps before blocks fit)
        faults = []
        for _ in range({STEPS}):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            torch.empty({BLOCK_BYTES} // 4).fill_(1.0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return sum(faults[-{SETTLED}:])
    """
)


def _call_from_source(source: str, name: str) -> object:
    scope: dict = {}
    exec(source, scope)
    return scope[name]()


_GLIBC_SET = any(name.startswith("MALLOC_") or name == "GLIBC_TUNABLES" for name in os.environ)


# 5-8 s (a spawned worker starts and imports the package, beside a plain process)
@pytest.mark.skipif(not sys.platform.startswith("linux") or _GLIBC_SET, reason="glibc's malloc as it comes")
def test_a_worker_reuses_the_memory_it_frees_where_a_plain_process_faults_it_in_again() -> None:
    pages = SETTLED * BLOCK_BYTES // PAGE_BYTES
    script = REUSED_BLOCK + "print(faults_of_a_reused_block())"
    plain = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with worker_pool(1) as pool:
        faults = pool.submit(_call_from_source, REUSED_BLOCK, "faults_of_a_reused_block").result()
    out, err = plain.communicate()
    assert plain.returncode == 0, err
    assert int(out) > 0.9 * pages  # the control: glibc maps every block afresh, a fault per page
    assert faults < 0.01 * pages, f"a worker faulted in {faults} of its last {SETTLED} blocks' {pages} pages"


@pytest.mark.parametrize(
    "variable", ["MALLOC_TRIM_THRESHOLD_=67108864", "GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432"]
)
def test_keep_freed_memory_leaves_glibc_settings_from_the_environment_alone(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, value = variable.split("=", 1)
    monkeypatch.setenv(name, value)
    assert keep_freed_memory() is False


@pytest.mark.parametrize("bad", [-1, 2**31, 1.5, True, "64"])
def test_keep_freed_memory_names_a_threshold_that_is_not_a_byte_count(bad: object) -> None:
    with pytest.raises(ValueError, match="mmap_threshold must be a number of bytes"):
        keep_freed_memory(mmap_threshold=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trim_threshold must be a number of bytes"):
        keep_freed_memory(trim_threshold=bad)  # type: ignore[arg-type]
