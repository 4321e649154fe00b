"""Federated learning in one process: client partitions, per-round sampling, FedSGD/FedAvg, DP-FedAvg, and
the clients' checks that make a malicious server's model manipulation visible
(:mod:`~lightning_gp.federated.model_integrity`)."""

from lightning_gp.federated.aggregation import weighted_mean
from lightning_gp.federated.client_dp import AMPLIFICATION, ClientLevelDP, clip_update, update_norm
from lightning_gp.federated.client_updates import client_gradients, client_local_updates, updates_running_stats
from lightning_gp.federated.many_clients import (
    ManyClientsRound,
    ManyClientsRun,
    accuracy_on_test_split,
    fedsgd_many_clients,
    train_many_clients,
)
from lightning_gp.federated.model_integrity import (
    DIGEST_BITS,
    ModelProvenance,
    ModelRejected,
    check_architecture,
    consistent_digest_mean,
    consistent_digest_sum,
    digest_bits,
    model_digest,
)
from lightning_gp.federated.partition import (
    dirichlet_partition,
    iid_partition,
    label_histogram,
    partition,
    shard_partition,
)
from lightning_gp.federated.rounds import ClientRounds, RoundLoader, RoundSampler
from lightning_gp.federated.simulation import FederatedSimulation

__all__ = [
    "AMPLIFICATION",
    "DIGEST_BITS",
    "ClientLevelDP",
    "ClientRounds",
    "FederatedSimulation",
    "ManyClientsRound",
    "ManyClientsRun",
    "ModelProvenance",
    "ModelRejected",
    "RoundLoader",
    "RoundSampler",
    "accuracy_on_test_split",
    "check_architecture",
    "client_gradients",
    "client_local_updates",
    "clip_update",
    "consistent_digest_mean",
    "consistent_digest_sum",
    "digest_bits",
    "dirichlet_partition",
    "fedsgd_many_clients",
    "iid_partition",
    "label_histogram",
    "model_digest",
    "partition",
    "shard_partition",
    "train_many_clients",
    "update_norm",
    "updates_running_stats",
    "weighted_mean",
]
