"""Run by tests/test_ddp.py: 2-process CPU DDP (gloo) training with a defense in the comm hook.

Each rank writes what it tapped (its defended, shared gradient, its batch and weights) and the
gradient the optimizer received after the all-reduce to OUTDIR/rank{r}.pt.
"""

import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.callbacks import (
    AlignedDualGradientPruning,
    GradientTap,
    MagnitudePruning,
    OptimalGradientPruning,
    Soteria,
    TopKPruning,
)


class TinyNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
        self.loss_fn = nn.CrossEntropyLoss()  # the optimal defenses estimate with the module's own loss

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordAggregated(L.Callback):
    def __init__(self) -> None:
        self.aggregated = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.aggregated is None:
            self.aggregated = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}


class BranchyNet(TinyNet):
    """TinyNet with an extra head used only in the first step (every rank), so afterwards no rank
    uses it: DDP with find_unused_parameters=True then leaves its .grad None. ``poison_rank`` makes
    that rank's loss NaN."""

    def __init__(self, poison_rank: int | None = None) -> None:
        super().__init__()
        self.aux = nn.Linear(12, 3)
        self.poison_rank = poison_rank

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        if self.global_step == 0:
            logits = logits + self.aux(x.flatten(1))
        loss = self.loss_fn(logits, y)
        return loss * float("nan") if self.global_rank == self.poison_rank else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


class RecordEveryStep(L.Callback):
    """The gradient the optimizer steps with, every step (None where .grad is None)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append(
            {n: None if p.grad is None else p.grad.detach().clone() for n, p in pl_module.named_parameters()}
        )


def ddp_trainer(max_steps: int, callbacks: list, find_unused: bool = False) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(find_unused_parameters=find_unused),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def unused_parameters(outdir: str) -> None:
    """Two steps of Top-k with error feedback; the aux head is used in step 0 only."""
    L.seed_everything(7)
    data = TensorDataset(torch.randn(32, 3, 4), torch.randint(0, 3, (32,)))
    defense = TopKPruning(rate=0.8, seed=1)
    taps = [GradientTap(clients=0, rounds=None), GradientTap(clients=1, rounds=None)]
    record = RecordEveryStep()
    trainer = ddp_trainer(2, [defense, *taps, record], find_unused=True)
    model = BranchyNet()
    trainer.fit(model, DataLoader(data, batch_size=4))
    rank = trainer.global_rank
    torch.save(
        {
            "shared": [r.gradients for r in taps[rank].records],
            "batches": [r.batch for r in taps[rank].records],
            "weights": [r.model_state for r in taps[rank].records],
            "stepped": record.steps,
            "residual": defense.defense.client_state(rank),
        },
        f"{outdir}/rank{rank}.pt",
    )


def nan_on_one_rank(outdir: str) -> None:
    """Rank 1's loss is NaN: every rank must raise the same error."""
    L.seed_everything(7)
    data = TensorDataset(torch.randn(32, 3, 4), torch.randint(0, 3, (32,)))
    ddp_trainer(1, [MagnitudePruning(rate=0.7)]).fit(BranchyNet(poison_rank=1), DataLoader(data, batch_size=4))


def main(outdir: str, defense_name: str = "magnitude") -> None:
    if defense_name in ("unused", "nan"):
        {"unused": unused_parameters, "nan": nan_on_one_rank}[defense_name](outdir)
        return
    L.seed_everything(7)
    data = TensorDataset(torch.randn(32, 3, 4), torch.randint(0, 3, (32,)))
    taps = [GradientTap(clients=0), GradientTap(clients=1)]
    record = RecordAggregated()
    defense = {
        "magnitude": lambda: MagnitudePruning(rate=0.7),
        "adgp": lambda: AlignedDualGradientPruning(k=0.2, k1=0.05, seed=3),
        "optimal": lambda: OptimalGradientPruning(rate=0.6, probes=4, seed=5),
        "soteria": lambda: Soteria(rate=0.5, seed=5),
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
            "broadcasts": defense.runner.comm_hook.broadcasts,
        }
    torch.save({"tapped": tapped.__dict__, "aggregated": record.aggregated, **extra}, f"{outdir}/rank{rank}.pt")


if __name__ == "__main__":
    from process_group import leave_process_group

    main(*sys.argv[1:])
    leave_process_group()
