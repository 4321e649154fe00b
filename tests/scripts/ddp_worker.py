"""Run by tests/test_ddp.py: 2-process CPU DDP (gloo) training with a defense in the comm hook.

Each rank writes what it tapped (its defended, shared gradient, its batch and weights) and the
gradient the optimizer received after the all-reduce to OUTDIR/rank{r}.pt.
"""

import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.callbacks import AlignedDualGradientPruning, GradientTap, MagnitudePruning, OptimalGradientPruning


class TinyNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordAggregated(L.Callback):
    def __init__(self) -> None:
        self.aggregated = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.aggregated is None:
            self.aggregated = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}


def main(outdir: str, defense_name: str = "magnitude") -> None:
    L.seed_everything(7)
    data = TensorDataset(torch.randn(32, 3, 4), torch.randint(0, 3, (32,)))
    taps = [GradientTap(client_id=0), GradientTap(client_id=1)]
    record = RecordAggregated()
    defense = {
        "magnitude": lambda: MagnitudePruning(rate=0.7),
        "adgp": lambda: AlignedDualGradientPruning(k=0.2, k1=0.05, seed=3),
        "optimal": lambda: OptimalGradientPruning(rate=0.6, num_probes=4, seed=5),
    }[defense_name]()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[defense, *taps, record],
    )
    trainer.fit(TinyNet(), DataLoader(data, batch_size=4))
    rank = trainer.global_rank
    tapped = taps[rank].latest()
    extra = {}
    if defense_name == "adgp":
        extra = {
            "mask": defense.defense.round_mask,
            "provider": defense.defense.mask_provider,
            "broadcasts": defense.comm_hook.broadcasts,
        }
    torch.save({"tapped": tapped.__dict__, "aggregated": record.aggregated, **extra}, f"{outdir}/rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
