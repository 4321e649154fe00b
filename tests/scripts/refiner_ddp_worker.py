"""Run by tests/test_refiner.py: 2-process CPU DDP (gloo), each rank refines its own batch.

Each rank writes what it tapped (the shared gradient), Refiner's own upload and raw gradient, the
gradient the optimizer stepped with after the all-reduce, and rank 0 the checkpoint, to OUTDIR.
"""

import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.callbacks import GradientTap
from lightning_gp.refiner import IndexedDataset, RefinerModule
from lightning_gp.refiner.evaluator import EvaluationNetwork


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 6 * 6, 4))


def tiny_evaluator() -> nn.Module:
    torch.manual_seed(11)
    return EvaluationNetwork(in_channels=1, width=1 / 32).eval()


class RecordAggregated(L.Callback):
    def __init__(self) -> None:
        self.aggregated = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.aggregated is None:
            self.aggregated = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}


def main(outdir: str) -> None:
    L.seed_everything(7)
    data = TensorDataset(torch.rand(16, 1, 6, 6), torch.randint(0, 4, (16,)))
    module = RefinerModule(
        tiny_model(),
        loss_fn=nn.CrossEntropyLoss(),
        mean=0.0,
        std=1.0,
        evaluator=tiny_evaluator(),
        eps=0.05,
        warm_start=True,
        seed=3,
    )
    taps = [GradientTap(clients=0), GradientTap(clients=1)]
    record = RecordAggregated()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*taps, record],
    )
    trainer.fit(module, DataLoader(IndexedDataset(data), batch_size=4))
    rank = trainer.global_rank
    refined = module.last_refined
    assert refined is not None
    torch.save(
        {
            "shared": taps[rank].latest().gradients,
            "upload": refined.upload,
            "raw": refined.raw,
            "aggregated": record.aggregated,
            "cached": sorted(module.cache[rank]),
        },
        f"{outdir}/rank{rank}.pt",
    )
    trainer.save_checkpoint(f"{outdir}/refiner.ckpt")


if __name__ == "__main__":
    from process_group import leave_process_group

    main(sys.argv[1])
    leave_process_group()
