"""What a defense setting costs: train it for some rounds, then test accuracy and bytes uploaded."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.quiet import internal_trainer, quiet_lightning
from lightning_gp.defenses import DistributedGaussianMechanism as Distributed
from lightning_gp.federated import ClientLevelDP
from lightning_gp.validation import check_positive_int


@dataclass
class TrainingResult:
    """What a setting cost: accuracy after the run and the bytes each client uploaded per round."""

    setting: str
    rounds: int
    test_acc: float
    upload_bytes_per_client_round: float
    dense_bytes_per_client_round: float
    train_seconds: float

    @property
    def upload_ratio(self) -> float:
        return self.upload_bytes_per_client_round / self.dense_bytes_per_client_round


def simulated_cohort(defenses: Sequence[Callback], clients: int) -> int:
    """The secure aggregate a simulation of ``clients`` clients of a round stands for: the largest
    ``cohort_size`` among ``defenses`` (a distributed mechanism's clients add their shares of one
    central noise), at least ``clients``; each simulated upload is then the deployment's own
    (:class:`~lightning_gp.federated.FederatedSimulation`'s ``cohort_size``)."""
    inner = [getattr(cb, "defense", None) for cb in defenses]
    return max([clients, *(d.cohort_size for d in inner if isinstance(d, Distributed))])


def trainer_runner(
    setting: DefenseSetting, model: nn.Module, datamodule: L.LightningDataModule, batch_size: int
) -> tuple[L.LightningModule, L.LightningDataModule]:
    """The plain-Trainer runner's module (a copy of ``model``, trained with the setting's server
    optimizer) and data (``batch_size`` images per step): one step is the round of FedSGD clients
    whose images it holds."""
    from lightning_gp.models import ImageClassifier

    module = ImageClassifier(copy.deepcopy(model), lr=setting.server_lr, optimizer=setting.server_optimizer)
    data: Any = copy.copy(datamodule)
    data.batch_size = batch_size
    return module, data


def train_setting(
    setting: DefenseSetting,
    model: nn.Module,
    datamodule: L.LightningDataModule,
    *,
    rounds: int,
    num_clients: int = 10,
    local_batch_size: int = 8,
    seed: int = 0,
    callbacks: Sequence[Callback] = (),
    client_dp: ClientLevelDP | None = None,
) -> TrainingResult:
    """Train ``model`` under ``setting`` for ``rounds`` rounds (``num_clients`` clients of
    ``local_batch_size`` images each per round) and test it; ``client_dp``: DP-FedAvg on top
    (:class:`~lightning_gp.federated.ClientLevelDP`, simulation runner only).

    The simulation runner is :class:`~lightning_gp.federated.FederatedSimulation` with every client
    in every round; the plain-Trainer runner (DP-SGD) trains one batch of ``num_clients *
    local_batch_size`` images per step with the server's optimizer, the same images per step as the
    simulation's FedSGD round. A setting with FedAvg's local training
    (:attr:`~lightning_gp.audit.DefenseSetting.local_training`) trains each client ``local_epochs *
    local_batch_size / setting.local_batch_size`` local steps of ``setting.local_batch_size`` images a
    round (its ``local_epochs`` epochs' worth of steps over a batch of ``local_batch_size`` images, each
    step on images drawn afresh from the client's shard). Bytes are counted by a
    :class:`~lightning_gp.callbacks.CommunicationMeter`.
    """
    from lightning_gp.callbacks import CommunicationMeter
    from lightning_gp.federated import FederatedSimulation

    check_positive_int(rounds, "rounds")
    L.seed_everything(seed, verbose=False)
    model = setting.server_model(model)
    meter = CommunicationMeter()
    defenses = [copy.deepcopy(cb) for cb in setting.callbacks]
    module: L.LightningModule
    fit_kwargs: dict[str, Any] = {}
    if setting.runner == "trainer":
        if client_dp is not None:
            raise ValueError(f"client_dp needs the simulation runner; {setting.name} trains on a plain Trainer")
        module, fit_kwargs["datamodule"] = trainer_runner(setting, model, datamodule, num_clients * local_batch_size)
    else:
        client_model = setting.wrap(copy.deepcopy(model)) if setting.wrap is not None else copy.deepcopy(model)
        step_batch = (setting.local_batch_size or local_batch_size) if setting.local_training else local_batch_size
        if local_batch_size % step_batch:
            raise ValueError(
                f"{setting.name}: its local_batch_size={step_batch} must divide local_batch_size={local_batch_size}"
            )
        module = FederatedSimulation(
            client_model,
            datamodule=datamodule,
            num_clients=num_clients,
            clients_per_round=num_clients,
            cohort_size=simulated_cohort(defenses, num_clients),
            local_batch_size=step_batch,
            local_steps=setting.local_epochs * (local_batch_size // step_batch) if setting.local_training else 1,
            algorithm=setting.algorithm,
            local_lr=setting.local_lr,
            server_optimizer=setting.server_optimizer,
            server_lr=setting.server_lr,
            seed=seed,
            client_dp=client_dp,
        )
    with quiet_lightning():
        trainer = internal_trainer(max_steps=rounds, callbacks=[*defenses, meter, *callbacks], num_sanity_val_steps=0)
        start = time.perf_counter()
        trainer.fit(module, **fit_kwargs)
        seconds = time.perf_counter() - start
        test = trainer.test(module, verbose=False, **fit_kwargs)[0]
    uploads = max(1, meter.uploads)
    return TrainingResult(
        setting.name,
        rounds,
        float(test["test_acc"]),
        meter.total_upload_bytes / uploads,
        meter.total_dense_bytes / uploads,
        seconds,
    )
