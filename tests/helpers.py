"""Small real components the integration tests share (no mocks: real modules and data)."""

from __future__ import annotations

import logging
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.defenses import Defense

if TYPE_CHECKING:
    from lightning_gp.frontier.report import FrontierPoint

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: The ``backend_config`` of the tests' Flower simulations: one Ray worker runs the nodes one after
#: another (a Ray worker per node imports torch again and competes with the suite's other pytest
#: worker for the cores).
ONE_RAY_WORKER = {
    "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
    "init_args": {"num_cpus": 1, "include_dashboard": False},
}


def frontier_point(
    setting: str, stage: int, threat: str, verdict: str, pmm: float, grid: str | None = None
) -> FrontierPoint:
    """A frontier point at batch size 1 with made-up scores: every image leaks (PSNR 35 dB) when the
    verdict is "leaks", none (5 dB) otherwise; ``grid`` defaults to the setting's name."""
    from lightning_gp.frontier.report import FrontierPoint  # the audit package only where needed

    leaked = 1.0 if verdict == "leaks" else 0.0
    return FrontierPoint(
        grid=grid or setting, family=grid or setting, knob="k", value=1, index=0, setting=setting, batch_size=1,
        stage=stage, threat=threat, verdict=verdict, leak_fraction=leaked, worst_psnr=30.0 * leaked + 5.0,
        worst_ssim=0.1, worst_lpips=None, reason="", strongest="", rero_eta=None, test_acc=pmm, pmm=pmm,
        cost_ratio=1.0, upload_bytes=1.0, upload_ratio=1.0, audit_seconds=0.0,
    )  # fmt: skip


def run_benchmark(
    script: str, *args: str, cwd: Path = BENCHMARKS, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<script>`` with ``args`` (:func:`run_script`), output captured."""
    return run_script(BENCHMARKS / script, *args, cwd=cwd, timeout=timeout)


def run_script(
    path: Path, *args: str, cwd: Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run the Python script ``path`` with ``args`` as ``__main__`` in a process of its own, output
    captured, as ``subprocess.run([sys.executable, path, *args], capture_output=True, text=True)``.

    The process is forked from the test's, so it starts with torch and Lightning imported (a fresh
    interpreter spends several seconds on that, which made the benchmark and DDP tests the suite's
    slowest); it runs the script from its first line, in ``cwd``, with its own argv, output and exit
    status, and the processes it launches (a DDP rank, a worker) are fresh interpreters. Where
    ``os.fork`` is missing, a fresh interpreter runs it."""
    command = [sys.executable, str(path), *args]
    if not hasattr(os, "fork"):
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    with tempfile.TemporaryDirectory() as scratch:
        out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest
            code = 1
            try:
                code = _run_script(command[1:], Path.cwd() if cwd is None else cwd, out, err)
            finally:
                os._exit(code)
        status = _wait(pid, timeout, command)
        return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(status), out.read_text(), err.read_text())


def _run_script(argv: Sequence[str], cwd: Path, out: Path, err: Path) -> int:
    """In the forked child: point fds 1 and 2 (and every Python-level stream and logging handler on
    them) at ``out``/``err``, then run ``argv[0]`` as ``__main__`` as ``python argv...`` would."""
    old_streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for handler in (h for logger in loggers for h in logger.handlers if isinstance(h, logging.StreamHandler)):
        if handler.stream in old_streams:  # a handler made before the fork writes where this run's output goes
            handler.setStream(sys.stderr if handler.stream in old_streams[1::2] else sys.stdout)
    os.chdir(cwd)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).parent))
    try:
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


def _wait(pid: int, timeout: float, command: list[str]) -> int:
    """The wait status of child ``pid``; past ``timeout`` seconds it is killed and the call raises
    :class:`subprocess.TimeoutExpired`, as ``subprocess.run`` would."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired(command, timeout)
        time.sleep(0.02)


class LabelledTensorDataset(TensorDataset):
    @property
    def targets(self) -> torch.Tensor:
        return self.tensors[1]


class RandomImages(L.LightningDataModule):
    """Seeded random images with labels, the datamodule protocol the simulation expects."""

    def __init__(
        self, n_train: int = 240, n_val: int = 40, shape: tuple[int, ...] = (1, 12, 12), classes: int = 4
    ) -> None:
        super().__init__()
        self.n_train, self.n_val, self.shape, self.classes = n_train, n_val, shape, classes

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(123)
        self.train_dataset = LabelledTensorDataset(
            torch.randn(self.n_train, *self.shape, generator=g),
            torch.randint(0, self.classes, (self.n_train,), generator=g),
        )
        self.val_dataset = LabelledTensorDataset(
            torch.randn(self.n_val, *self.shape, generator=g),
            torch.randint(0, self.classes, (self.n_val,), generator=g),
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_dataset, batch_size=20)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.val_dataset, batch_size=20)


def small_cnn(classes: int = 4) -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 5 * 5, classes))


class AddConstant(Defense):
    """A deterministic, non-commuting companion for MagnitudePruning in ordering tests."""

    def __init__(self, value: float) -> None:
        super().__init__(seed=0)
        self.value = value

    def config(self) -> dict:
        return {"value": self.value}

    def transform(self, gradients, state, call):
        return {n: g + self.value for n, g in gradients.items()}, state


class CountingDefense(Defense):
    """Identity that counts its calls (to prove when a path applies defenses)."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.calls = 0

    def transform(self, gradients, state, call):
        self.calls += 1
        return dict(gradients), state


class GaussianJitter(Defense):
    """Adds noise from the client's generator: exercises seeded, checkpointed randomness."""

    def __init__(self, std: float = 0.01, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.std = std

    def config(self) -> dict:
        return {"std": self.std}

    def transform(self, gradients, state, call):
        return {
            n: g + self.std * torch.randn(g.shape, generator=call.generator, device=g.device, dtype=g.dtype)
            for n, g in gradients.items()
        }, state


def quiet_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def softmax_share_sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """PriPrune's Eq. 18 as written: a hard Gumbel-softmax sample over ``[not share, share]`` with
    log-probabilities ``[log alpha, log(1 - alpha)]``, straight-through; the share entry. The
    reference the library's sampler (a comparison and a sigmoid) is checked against."""
    log_probs = torch.stack([F.logsigmoid(logits), F.logsigmoid(-logits)], dim=-1)
    uniform = torch.rand(log_probs.shape, generator=generator, dtype=log_probs.dtype)
    finfo = torch.finfo(log_probs.dtype)
    gumbel = -torch.log(-torch.log(uniform.clamp(finfo.tiny, 1.0 - finfo.eps)))
    soft = ((log_probs + gumbel) / temperature).softmax(dim=-1)
    hard = F.one_hot(soft.argmax(dim=-1), 2).to(soft.dtype)
    return (hard + (soft - soft.detach()))[..., 1]


def assert_rows_are_their_own_problems(
    stacked: Callable[[torch.Tensor], torch.Tensor],
    alone: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    points: torch.Tensor,
) -> None:
    """Row ``k`` of a vmapped objective ``stacked`` (``points [K, ...] -> [K]``) is problem ``k``'s own
    objective ``alone[k]`` at ``points[k]``: values and gradients to float32 precision (sums over a
    model's ~1e5 parameters taken in another order: relative errors ~1e-6, far inside these bounds).
    Checked at shared points, not along two optimisations: float32 trajectories part by CPU-dependent
    amounts wherever signed or clipped steps meet an entry within rounding of zero."""
    x = points.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        values = stacked(x)
        (grads,) = torch.autograd.grad(values.sum(), [x])
        singles, single_grads = [], []
        for objective, point in zip(alone, points.detach().clone()):
            point.requires_grad_(True)
            value = objective(point)
            singles.append(value.detach())
            single_grads.append(torch.autograd.grad(value, [point])[0])
    torch.testing.assert_close(values.detach(), torch.stack(singles), rtol=1e-4, atol=0.0)
    expected = torch.stack(single_grads)
    torch.testing.assert_close(grads, expected, rtol=1e-3, atol=1e-4 * float(expected.abs().max()))
