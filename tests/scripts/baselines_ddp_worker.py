"""Run by tests/test_graddefense.py: 2-process CPU DDP (gloo) with GradDefense then Outpost in the comm hook.

Each rank writes what it tapped (the shared gradient after both defenses, its batch and weights),
the root set and the Outpost step counter to OUTDIR/rank{r}.pt.
"""

import sys

import lightning as L
import torch
from ddp_worker import TinyNet
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.callbacks import GradDefense, GradientTap, Outpost


def main(outdir: str) -> None:
    L.seed_everything(7)
    data = TensorDataset(torch.randn(32, 3, 4), torch.randint(0, 3, (32,)))
    root = (torch.randn(6, 3, 4), torch.tensor([0, 1, 2, 0, 1, 2]))
    taps = [GradientTap(clients=0), GradientTap(clients=1)]
    outpost = Outpost(beta=0.0, seed=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[GradDefense(root_data=root, scale=0.05, q=None, seed=1), outpost, *taps],
    )
    trainer.fit(TinyNet(), DataLoader(data, batch_size=4))
    rank = trainer.global_rank
    torch.save(
        {"tapped": taps[rank].latest().__dict__, "root": root, "step": outpost.defense.client_state(rank)["#step"]},
        f"{outdir}/rank{rank}.pt",
    )


if __name__ == "__main__":
    from process_group import leave_process_group

    main(*sys.argv[1:])
    leave_process_group()
