"""Run by tests/test_ddp_overlap.py: 2-process CPU DDP (gloo), layerwise defenses defended bucket by
bucket (the overlapped path) and with every bucket held (the whole-model path), same seeds.

DDP's buckets are capped at 1 KB so the small model spreads over several buckets. For each
defense setting and each path, every rank records per step the aggregate the optimizer received,
the shared gradient its tap saw, the path taken and the number of buckets, then the defenses'
client states and the final weights, into OUTDIR/rank{r}.pt.
"""

import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.callbacks import (
    DualGradientPruning,
    GaussianNoise,
    GradientQuantization,
    GradientTap,
    TopKPruning,
)

STEPS = 3
SETTINGS = {
    "topk_ef": lambda: [TopKPruning(rate=0.7, seed=1)],
    "gaussian": lambda: [GaussianNoise(scale=0.01, seed=2)],
    "dgp_then_stochastic_8bit": lambda: [
        DualGradientPruning(seed=3),
        GradientQuantization(bits=8, stochastic_rounding=True, seed=4),
    ],
}


class ThreeLayers(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Record(L.Callback):
    """Holds the buckets on request, and records what the optimizer and the hook saw each step."""

    def __init__(self, driver: L.Callback, hold: bool) -> None:
        self.driver, self.hold = driver, hold
        self.steps: list[dict] = []

    def on_fit_start(self, trainer, pl_module):
        if self.hold:  # after the driving defense registered the hook
            self.driver.runner.comm_hook.bucketwise = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        hook = self.driver.runner.comm_hook
        self.steps.append(
            {
                "aggregate": {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()},
                "bucketwise": hook.bucketwise,
                "buckets": hook.last_buckets,
            }
        )


def run(setting: str, hold: bool, data: TensorDataset) -> dict:
    L.seed_everything(11, verbose=False)
    defenses = SETTINGS[setting]()
    taps = [
        GradientTap(clients=0, rounds=None, record_data=False),
        GradientTap(clients=1, rounds=None, record_data=False),
    ]
    record = Record(defenses[0], hold)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(bucket_cap_mb=0.001),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*defenses, *taps, record],
    )
    model = ThreeLayers()
    trainer.fit(model, DataLoader(data, batch_size=4))
    rank = trainer.global_rank
    return {
        "steps": record.steps,
        "shared": [r.gradients for r in taps[rank].records],
        "states": [d.defense.client_state(rank) for d in defenses],
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def main(outdir: str) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2 * 4 * STEPS, 3, 4), torch.randint(0, 3, (2 * 4 * STEPS,)))
    results = {(setting, hold): run(setting, hold, data) for setting in SETTINGS for hold in (False, True)}
    rank = torch.distributed.get_rank()
    torch.save(results, f"{outdir}/rank{rank}.pt")


if __name__ == "__main__":
    from process_group import leave_process_group

    main(*sys.argv[1:])
    leave_process_group()
