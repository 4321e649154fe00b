"""Small real components the integration tests share (no mocks: real modules and data)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.defenses import Defense

if TYPE_CHECKING:
    from lightning_gp.audit.frontier_report import FrontierPoint

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def frontier_point(
    setting: str, stage: int, threat: str, verdict: str, pmm: float, grid: str | None = None
) -> FrontierPoint:
    """A frontier point at batch size 1 with made-up scores: every image leaks (PSNR 35 dB) when the
    verdict is "leaks", none (5 dB) otherwise; ``grid`` defaults to the setting's name."""
    from lightning_gp.audit.frontier_report import FrontierPoint  # the audit package only where needed

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
    """Run ``benchmarks/<script>`` with ``args`` in a fresh interpreter, output captured."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


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
