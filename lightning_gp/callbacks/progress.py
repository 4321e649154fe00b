"""Plain-line progress for long runs (readable in logs and CI, unlike a redrawn bar)."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class ProgressPrinter(Callback):
    """Print one line after the first optimizer step, every ``every_n_steps`` steps, after each
    validation, and when training ends (so a run shorter than the interval still shows its progress).

    Args:
        every_n_steps: print interval in optimizer steps (rounds in a federated simulation).
        metrics: logged metrics to show, when present.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        metrics: tuple[str, ...] = ("train_loss", "val_loss", "val_acc", "dp_epsilon"),
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.metrics = metrics
        self._start = 0.0
        self._printed_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if (step == 1 or step % self.every_n_steps == 0) and trainer.is_global_zero:
            self._print(trainer, "train")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self._printed_step != trainer.global_step:
            self._print(trainer, "end")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.is_global_zero and trainer.state.fn == "fit":
            self._print(trainer, "val")

    def _print(self, trainer: pl.Trainer, what: str) -> None:
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else "?"
        # train lines show training metrics only; validation lines show everything
        names = [n for n in self.metrics if what != "train" or not n.startswith("val_")]
        shown = " ".join(
            f"{n} {float(trainer.callback_metrics[n]):.4f}" for n in names if n in trainer.callback_metrics
        )
        elapsed = time.perf_counter() - self._start
        self._printed_step = trainer.global_step
        print(
            f"[{what}] step {trainer.global_step}/{total} epoch {trainer.current_epoch} {shown} ({elapsed:.1f}s)",
            flush=True,
        )
