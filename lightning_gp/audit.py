"""Privacy audit: attack the gradients clients really shared in a FedSGD round, and score them.

client batch -> defenses -> **shared gradient** (tapped) -> ServerView -> attack -> report

The round is run by :class:`~lightning_gp.federated.FederatedSimulation` with the given defense
callbacks, so the attacked gradient is exactly what the defenses let out. An active attack
(one with ``modify_model``, e.g. Robbing the Fed) plays the malicious server: it replaces the
model sent to the clients before the round and keeps its secrets for the attack.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_gp.attacks import GradientAttack, Reconstruction, ServerView
from lightning_gp.callbacks import GradientTap
from lightning_gp.federated import FederatedSimulation
from lightning_gp.metrics import ReconstructionReport, reconstruction_report
from lightning_gp.records import TappedGradient


@dataclass
class AttackResult:
    """One client's round: what it shared, what the attack rebuilt, and the scores."""

    record: TappedGradient
    view: ServerView
    reconstruction: Reconstruction
    report: ReconstructionReport
    seconds: float


def _public_batch(datamodule: L.LightningDataModule, size: int = 1000) -> Tensor:
    """Images a server may hold (the test split, never the clients' training data)."""
    datamodule.setup("test")
    dataset = datamodule.test_dataset
    return torch.stack([dataset[i][0] for i in range(min(size, len(dataset)))])


def tap_fedsgd_round(
    model: nn.Module,
    datamodule: L.LightningDataModule,
    *,
    defenses: Sequence[Callback] = (),
    attack: GradientAttack | None = None,
    round: int = 0,
    clients: Sequence[int] = (0,),
    num_clients: int = 10,
    local_batch_size: int = 1,
    seed: int = 0,
) -> tuple[list[TappedGradient], nn.Module, dict[str, Any]]:
    """Run FedSGD through ``round`` and return the shared gradients of ``clients`` in that round.

    Every client takes part in every round. Returns the records, the model the server sent
    (modified if ``attack`` is active) and the server's secrets for the attack.
    """
    if round < 0:
        raise ValueError(f"round must be >= 0, got {round}")
    if not clients or any(not 0 <= c < num_clients for c in clients):
        raise ValueError(f"clients must be ids in [0, {num_clients}), got {list(clients)}")
    L.seed_everything(seed, verbose=False)
    datamodule.setup("fit")
    secrets: dict[str, Any] = {}
    if hasattr(attack, "modify_model"):
        model, secrets = attack.modify_model(
            model, datamodule.image_shape, datamodule.mean, datamodule.std, public_data=_public_batch(datamodule)
        )
    simulation = FederatedSimulation(
        model,
        datamodule=datamodule,
        num_clients=num_clients,
        clients_per_round=num_clients,
        local_batch_size=local_batch_size,
        server_optimizer="adam",
        server_lr=1e-3,
        seed=seed,
    )
    taps = [GradientTap(client_id=c, rounds=[round]) for c in clients]
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=round + 1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*defenses, *taps],
    )
    trainer.fit(simulation)
    return [tap.latest() for tap in taps], model, secrets


def attack_record(
    record: TappedGradient,
    model: nn.Module,
    attack: GradientAttack,
    *,
    num_classes: int,
    mean: Sequence[float],
    std: Sequence[float],
    server_secrets: dict[str, Any] | None = None,
    labels_known: bool = False,
    lpips: bool = True,
) -> AttackResult:
    """Attack one tapped gradient from the server's view and score it against the client's batch."""
    view = ServerView.from_tap(
        record,
        copy.deepcopy(model),
        num_classes=num_classes,
        mean=tuple(mean),
        std=tuple(std),
        labels_known=labels_known,
        server_secrets=server_secrets,
    )
    start = time.perf_counter()
    reconstruction = attack.reconstruct(view)
    seconds = time.perf_counter() - start
    report = reconstruction_report(reconstruction, record.inputs, view, true_labels=record.targets, lpips=lpips)
    return AttackResult(record, view, reconstruction, report, seconds)


def mean_scores(results: Sequence[AttackResult]) -> dict[str, float | None]:
    """Per-image scores averaged over several clients' reports (PSNR of exact copies is inf)."""
    rows = [row for result in results for row in result.report.rows]
    means: dict[str, float | None] = {}
    for metric in ("mse", "psnr", "ssim", "lpips", "nmi"):
        values = [getattr(row, metric) for row in rows]
        means[metric] = (
            None if any(v is None for v in values) else float(torch.tensor(values, dtype=torch.float64).mean())
        )
    accuracies = [r.report.label_accuracy for r in results if r.report.label_accuracy is not None]
    means["label_accuracy"] = sum(accuracies) / len(accuracies) if accuracies else None
    return means
