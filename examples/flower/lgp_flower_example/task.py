"""What both sides share: the run's settings, the model and each client's data."""

from functools import cache
from pathlib import Path
from typing import Any

import tomllib
from flwr.app import Context

from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.flower import FederatedData
from lightning_gp.models import ImageClassifier, LeNetZhu


@cache
def default_settings() -> dict[str, Any]:
    """The app's `[tool.flwr.app.config]` in pyproject.toml."""
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as handle:
        return dict(tomllib.load(handle)["tool"]["flwr"]["app"]["config"])


def settings(context: Context) -> dict[str, Any]:
    """The run's settings: ``flwr run``'s run config (pyproject defaults and ``--run-config``), or the
    pyproject's defaults when the apps run in ``run.py``'s simulation, which passes no run config."""
    return {**default_settings(), **dict(context.run_config)}


def model(context: Context) -> ImageClassifier:
    """The clients' LightningModule; its SGD learning rate is the local one."""
    return ImageClassifier(LeNetZhu(), lr=float(settings(context)["local-lr"]))


@cache
def _data(num_clients: int, local_batch_size: int, local_steps: int, seed: int) -> FederatedData:
    return FederatedData(
        FashionMNISTSampleDataModule(),
        num_clients,
        local_batch_size=local_batch_size,
        local_steps=local_steps,
        seed=seed,
    )


def client_data(context: Context) -> FederatedData:
    """Each node's share of the sample (its partition-id of num-partitions), as the in-process
    FederatedSimulation would split it. A real node would read its own files here."""
    return audit_data(context, int(context.node_config["num-partitions"]))


def audit_data(context: Context, num_clients: int) -> FederatedData:
    """The same split, for the server of this audit to score reconstructions against (a real
    server never holds the clients' data)."""
    config = settings(context)
    return _data(num_clients, int(config["local-batch-size"]), int(config["local-steps"]), int(config["seed"]))
