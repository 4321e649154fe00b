"""Long work shows progress and results are written where a user looks, also for short runs."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import torch
from helpers import quiet_trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.callbacks import CommunicationMeter, MagnitudePruning, ProgressPrinter


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(12, 1, 3, 4, generator=g), torch.randint(0, 3, (12,), generator=g)), batch_size=4
    )


def test_a_run_shorter_than_the_print_interval_still_prints_its_first_step_and_its_end(capsys):
    # Before: ProgressPrinter(every_n_steps=50) printed nothing during a 3-step run
    L.seed_everything(0)
    quiet_trainer(max_steps=3, limit_val_batches=0, callbacks=[ProgressPrinter()]).fit(Tiny(), loader())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split()[0:3] for line in lines] == [["[train]", "step", "1/3"], ["[end]", "step", "3/3"]]
    assert "train_loss" in lines[-1]


def test_the_communication_meter_records_a_run_shorter_than_the_logging_interval(tmp_path):
    # Before: with log_every_n_steps=50 a 3-step run logged no comm/ value at all
    L.seed_everything(0)
    logger = CSVLogger(tmp_path, name="run")
    meter = CommunicationMeter()
    trainer = quiet_trainer(
        max_steps=3, logger=logger, log_every_n_steps=50, callbacks=[MagnitudePruning(rate=0.5), meter]
    )
    trainer.fit(Tiny(), loader())
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    logged = [float(r["comm/run_upload_ratio"]) for r in rows if r.get("comm/run_upload_ratio")]
    assert logged and abs(logged[-1] - meter.upload_ratio) < 1e-6 and meter.upload_ratio < 1.0


def test_a_tap_without_dirpath_writes_its_records_to_the_run_s_log_directory(tmp_path):
    # Before: a config's GradientTap without dirpath kept its records in memory only: lost at exit
    from lightning_gp.callbacks import GradientTap
    from lightning_gp.records import TappedGradient

    L.seed_everything(0)
    logger = CSVLogger(tmp_path, name="run")
    tap = GradientTap(rounds=[1])
    quiet_trainer(max_steps=2, logger=logger, callbacks=[MagnitudePruning(rate=0.5), tap]).fit(Tiny(), loader())
    saved = Path(logger.log_dir) / "taps" / "round1_client0.pt"
    assert tap.record_dir == saved.parent and saved.is_file()
    assert torch.equal(TappedGradient.load(saved).gradients["net.1.weight"], tap.latest().gradients["net.1.weight"])
    no_logger = GradientTap(rounds=[1])
    quiet_trainer(max_steps=2, logger=False, callbacks=[no_logger]).fit(Tiny(), loader())
    assert no_logger.record_dir is None and len(no_logger.records) == 1  # in memory only


def test_a_model_built_for_other_images_fails_at_fit_start_naming_both_sides():
    # Before: LeNetZhu(in_channels=3) on the 1-channel sample failed deep inside a conv
    import pytest

    from lightning_gp.data import FashionMNISTSampleDataModule
    from lightning_gp.federated import FederatedSimulation
    from lightning_gp.models import ImageClassifier, LeNetZhu

    with pytest.raises(
        ValueError, match=r"LeNetZhu cannot take FashionMNISTSampleDataModule's images of shape \(1, 28, 28\)"
    ):
        quiet_trainer(max_steps=1).fit(ImageClassifier(LeNetZhu(in_channels=3)), FashionMNISTSampleDataModule())
    simulation = FederatedSimulation(
        LeNetZhu(num_classes=7), datamodule=FashionMNISTSampleDataModule(), num_clients=2, clients_per_round=2
    )
    with pytest.raises(
        ValueError, match=r"LeNetZhu predicts \(7,\) outputs per image, but FashionMNISTSampleDataModule has 10"
    ):
        quiet_trainer(max_steps=1).fit(simulation)
