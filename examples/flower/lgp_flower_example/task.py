"""What both sides share: the model and each client's data."""

from functools import cache

from flwr.app import Context

from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.flower import FederatedData
from lightning_gp.models import ImageClassifier, LeNetZhu


def model(context: Context) -> ImageClassifier:
    """The clients' LightningModule; its SGD learning rate is the local one."""
    return ImageClassifier(LeNetZhu(), lr=float(context.run_config["local-lr"]))


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
    config = context.run_config
    return _data(num_clients, int(config["local-batch-size"]), int(config["local-steps"]), int(config["seed"]))
