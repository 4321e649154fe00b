"""FedSGD and FedAvg with thousands of clients per round, each defending its own update, without Lightning.

:class:`~lightning_gp.federated.FederatedSimulation` runs every client step through a ``Trainer``,
its data loader and the defense pipeline; that is the reference, and far too slow for 1000-10000
clients per round. :func:`train_many_clients` trains the same FedSGD (McMahan et al., AISTATS 2017,
Algorithm "FederatedSGD": every sampled client shares the gradient of its mean loss on one local
batch, the server averages the shared gradients and steps its optimizer) or FedAvg (the same paper's
"FederatedAveraging": every sampled client runs ``local_steps`` SGD steps from the global weights and
shares ``w_global - w_local``) with the same clients, the same local batches, the same per-client
defense streams and the same server optimizer, so a run here is a run of the simulation, only
faster: the clients' updates come from ``torch.func``
(:func:`~lightning_gp.federated.client_updates.client_gradients` and
:func:`~lightning_gp.federated.client_updates.client_local_updates`, ``vmap`` over clients), chunk
by chunk, and each chunk's shared updates are summed before the next is computed.

A FedAvg client draws ``local_steps`` batches a round and, ``local_epochs`` times, takes one SGD step
on each in the order drawn. ``local_epochs=E`` with one batch (``local_steps=1``) is the client the
audit attacks under FedAvg (:meth:`~lightning_gp.audit.DefenseSetting.with_client_training`: ``E``
epochs over its ``B`` images in one local batch), which ``FederatedSimulation`` has no argument for;
``local_steps=S`` with one epoch is the simulation's (and ``train_setting``'s) FedAvg: ``S`` steps,
each on images drawn afresh.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_gp.defenses.base import Defense, Gradients, share_in_process
from lightning_gp.federated.client_updates import (
    client_gradients,
    client_local_updates,
    trainable_parameters,
    updates_running_stats,
)
from lightning_gp.federated.partition import iid_partition
from lightning_gp.federated.rounds import ClientRounds
from lightning_gp.validation import (
    check_choice,
    check_int,
    check_model_fits_data,
    check_positive,
    check_positive_int,
)

__all__ = [
    "ManyClientsRound",
    "ManyClientsRun",
    "accuracy_on_test_split",
    "fedsgd_many_clients",
    "train_many_clients",
]


@dataclass(frozen=True)
class ManyClientsRound:
    """One finished round: its index, the clients' mean training loss, and its wall time in seconds."""

    round: int
    loss: float
    seconds: float


@dataclass
class ManyClientsRun:
    """What :func:`train_many_clients` did: one :class:`ManyClientsRound` per round, in order."""

    clients_per_round: int
    client_batch_size: int
    rounds: list[ManyClientsRound] = field(default_factory=list)

    @property
    def seconds_per_round(self) -> float:
        """The mean wall time of a round."""
        return sum(r.seconds for r in self.rounds) / max(1, len(self.rounds))


def train_many_clients(
    model: nn.Module,
    datamodule: Any,
    *,
    defense: Defense | None = None,
    clients_per_round: int,
    client_batch_size: int = 1,
    rounds: int,
    num_clients: int | None = None,
    algorithm: Literal["fedsgd", "fedavg"] = "fedsgd",
    local_steps: int = 1,
    local_epochs: int = 1,
    local_lr: float = 0.1,
    server_optimizer: Literal["sgd", "adam"] = "adam",
    server_lr: float = 1e-3,
    loss_fn: nn.Module | None = None,
    seed: int = 0,
    chunk_size: int = 1000,
    progress: Callable[[ManyClientsRound], None] | None = None,
) -> ManyClientsRun:
    """Train ``model`` in place with FedSGD or FedAvg, ``clients_per_round`` clients a round, each
    defending its update.

    The same run as ``FederatedSimulation`` with the same arguments (``local_batch_size=client_batch_size``)
    under a ``Trainer`` with the defense's callback and ``max_steps=rounds``: an IID split seeded by
    ``seed``; each round's clients and their ``local_steps`` batches of ``client_batch_size`` images from
    :class:`~lightning_gp.federated.ClientRounds`; a FedSGD client shares the gradient of its mean loss
    on its batch, a FedAvg client takes one SGD step at ``local_lr`` on each of its batches in turn and
    shares ``w_global - w_local``; ``defense(update, client_id)`` rewrites it with the client's stream
    (keyed by ``(defense.seed, client_id)``, continued from round to round, clients in ascending order,
    as the pipeline calls a pure defense); the server steps its optimizer on the uniform mean. The
    defaults are :func:`~lightning_gp.audit.train_setting`'s (Adam at 1e-3, every client every round).

    Args:
        model: the client model, an ``nn.Module`` without BatchNorm running statistics in training
            mode (``vmap`` cannot update them); trained in place.
        datamodule: its ``train_dataset`` (after ``setup("fit")``) is split among the clients.
        defense: a pure :class:`~lightning_gp.defenses.Defense` that defends from the update alone
            (or, like Outpost, with the current weights); ``None``: undefended. Its state lives on in
            the object. One that prepares its rounds (ADGP) sees every client's update first; those
            needing their Lightning adapter's statistics (Soteria, the optimal defenses) are refused.
        clients_per_round: clients sampled each round; ``num_clients``: clients in all (default:
            ``clients_per_round``, every client in every round).
        client_batch_size: images per client per local batch (with replacement from a client that holds fewer).
        rounds: rounds of training.
        algorithm: ``"fedsgd"`` or ``"fedavg"``; ``local_steps``, ``local_epochs``: FedAvg's local
            batches per client per round and its passes over them (module docstring); ``local_lr``.
        server_optimizer, server_lr: how the server applies the mean shared gradient.
        loss_fn: the client loss (mean over its batch); default ``model.loss_fn``, else cross-entropy.
        seed: seeds the partition and every round's sampling.
        chunk_size: clients whose gradients are computed (and held) at once.
        progress: called with each finished :class:`ManyClientsRound` (each round's mean client loss
            and wall time, all of them in the returned :class:`ManyClientsRun`).
    """
    num_clients = _check_arguments(
        model, datamodule, defense, clients_per_round, client_batch_size, rounds, num_clients, chunk_size, seed
    )
    _check_local_training(algorithm, local_steps, local_epochs, local_lr)
    loss_fn = loss_fn if loss_fn is not None else getattr(model, "loss_fn", None) or nn.CrossEntropyLoss()
    params = trainable_parameters(model)
    optimizer = _server_optimizer(list(params.values()), server_optimizer, server_lr)
    dataset, inputs, targets = _training_data(datamodule, next(iter(params.values())).device)
    split = iid_partition(len(inputs), num_clients, seed)
    sampler = ClientRounds(dataset, split, clients_per_round, client_batch_size, local_steps=local_steps, seed=seed)
    if defense is not None:  # as the defense's callback binds it at fit start
        defense.set_num_clients(num_clients)
        defense.check_layer_shapes({n: p.shape for n, p in params.items()})
    run = ManyClientsRun(clients_per_round, client_batch_size)
    updates = _client_updates(model, loss_fn, algorithm, local_epochs, local_lr)
    model.train()
    for round_idx in range(rounds):
        start = time.perf_counter()
        clients, local = _round_indices(sampler, round_idx, inputs.device)
        mean, loss = _round_mean(model, updates, defense, round_idx, clients, inputs[local], targets[local], chunk_size)
        _server_step(optimizer, params, mean)
        report = ManyClientsRound(round_idx, loss, time.perf_counter() - start)
        run.rounds.append(report)
        if progress is not None:
            progress(report)
    return run


def _round_indices(sampler: ClientRounds, round_idx: int, device: torch.device) -> tuple[list[int], Tensor]:
    """Round ``round_idx``'s clients and their images' indices, ``[C, local_steps, local_batch_size]``."""
    clients = sampler.sample_clients(round_idx).tolist()
    local = torch.stack([sampler.sample_local_indices(round_idx, c) for c in clients]).to(device)
    return clients, local.reshape(len(clients), sampler.local_steps, sampler.local_batch_size)


def fedsgd_many_clients(model: nn.Module, datamodule: Any, **kwargs: Any) -> ManyClientsRun:
    """Deprecated: :func:`train_many_clients` (FedSGD is its default ``algorithm``)."""
    warnings.warn(
        "fedsgd_many_clients is deprecated; use train_many_clients (algorithm='fedsgd' is its default)",
        DeprecationWarning,
        stacklevel=2,
    )
    return train_many_clients(model, datamodule, **kwargs)


def _check_local_training(algorithm: str, local_steps: int, local_epochs: int, local_lr: float) -> None:
    """Refuse, naming the argument, local training the run cannot take: an unknown algorithm, counts
    below 1, a rate that is not positive, and local steps or epochs beyond one under FedSGD."""
    check_choice(algorithm, "algorithm", ("fedsgd", "fedavg"))
    check_positive_int(local_steps, "local_steps")
    check_positive_int(local_epochs, "local_epochs")
    check_positive(local_lr, "local_lr")
    if algorithm == "fedsgd" and local_steps != 1:
        raise ValueError("local_steps > 1 needs algorithm='fedavg' (a FedSGD client shares one gradient)")
    if algorithm == "fedsgd" and local_epochs != 1:
        raise ValueError("local_epochs > 1 needs algorithm='fedavg' (a FedSGD client shares one gradient)")


#: A chunk's clients' shared updates before the defense: ``(inputs [C, S, B, ...], targets [C, S, B]) ->
#: (updates [C, ...] per layer, losses [C])``.
ClientUpdates = Callable[[Tensor, Tensor], tuple[Gradients, Tensor]]


def _client_updates(
    model: nn.Module, loss_fn: Any, algorithm: str, local_epochs: int, local_lr: float
) -> ClientUpdates:
    """What a chunk of clients shares before its defense: FedSGD's gradient of the one local batch,
    or FedAvg's ``w_global - w_local`` after ``local_epochs`` passes of a local SGD step on each local batch."""
    if algorithm == "fedsgd":
        return lambda x, y: client_gradients(model, loss_fn, x[:, 0], y[:, 0], vectorize=True)

    def local_training(x: Tensor, y: Tensor) -> tuple[Gradients, Tensor]:
        epochs_x, epochs_y = torch.cat([x] * local_epochs, dim=1), torch.cat([y] * local_epochs, dim=1)
        deltas, losses, _ = client_local_updates(model, loss_fn, epochs_x, epochs_y, lr=local_lr, vectorize=True)
        return deltas, losses

    return local_training


def _check_arguments(
    model: nn.Module,
    datamodule: Any,
    defense: Defense | None,
    clients_per_round: int,
    client_batch_size: int,
    rounds: int,
    num_clients: int | None,
    chunk_size: int,
    seed: int,
) -> int:
    """Refuse, naming the argument, what the run cannot take; return the number of clients."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if updates_running_stats(model):
        raise ValueError("model updates BatchNorm running statistics, which vmap over clients cannot; use GroupNorm")
    if defense is not None and not isinstance(defense, Defense):
        raise TypeError(
            f"defense must be a pure lightning_gp.defenses.Defense (a callback's .defense), got {type(defense).__name__}"
        )
    if defense is not None and type(defense).prepare is not Defense.prepare and not defense.reads_weights:
        raise ValueError(
            f"defense: {type(defense).__name__} defends from a statistic of the client's batch that its Lightning "
            "adapter computes; run it in FederatedSimulation"
        )
    check_positive_int(clients_per_round, "clients_per_round")
    check_positive_int(client_batch_size, "client_batch_size")
    check_positive_int(rounds, "rounds")
    check_positive_int(chunk_size, "chunk_size")
    check_int(seed, "seed", low=0)
    num_clients = clients_per_round if num_clients is None else check_positive_int(num_clients, "num_clients")
    if clients_per_round > num_clients:
        raise ValueError(f"clients_per_round ({clients_per_round}) cannot exceed num_clients ({num_clients})")
    if defense is not None:
        defense.check_cohort(clients_per_round)
    check_model_fits_data(model, datamodule)
    return num_clients


def _server_optimizer(params: list[Tensor], name: str, lr: float) -> torch.optim.Optimizer:
    """The server's optimizer, as :class:`~lightning_gp.federated.FederatedSimulation` builds it."""
    name = check_choice(name, "server_optimizer", ("sgd", "adam"))
    lr = check_positive(lr, "server_lr")
    return torch.optim.Adam(params, lr=lr) if name == "adam" else torch.optim.SGD(params, lr=lr)


def _training_data(datamodule: Any, device: torch.device) -> tuple[Dataset, Tensor, Tensor]:
    """``datamodule``'s ``train_dataset``, and every item of it as one tensor of inputs and one of
    targets on ``device`` (read once, item by item, as the simulation's loader reads them)."""
    datamodule.setup("fit")
    dataset: Dataset | None = getattr(datamodule, "train_dataset", None)
    if dataset is None:
        raise ValueError(f"datamodule: {type(datamodule).__name__} has no train_dataset after setup('fit')")
    items = [dataset[i] for i in range(len(dataset))]  # type: ignore[arg-type]
    inputs = torch.stack([torch.as_tensor(x) for x, _ in items])
    targets = torch.stack([torch.as_tensor(y) for _, y in items])
    return dataset, inputs.to(device), targets.to(device)


def _round_mean(
    model: nn.Module,
    updates: ClientUpdates,
    defense: Defense | None,
    round_idx: int,
    clients: list[int],
    inputs: Tensor,
    targets: Tensor,
    chunk_size: int,
) -> tuple[Gradients, float]:
    """The mean of the clients' shared updates in one round, and their mean loss.

    ``inputs``: ``[C, S, B, ...]`` (client ``clients[i]``'s local batches at ``i``). Chunks of ``chunk_size``
    clients are trained at once and defended client by client into one buffer, whose sum
    joins the round's total; a defense that prepares its rounds sees every gradient first.
    """
    if defense is not None and type(defense).begin_round is not Defense.begin_round:
        chunk_size = len(clients)  # begin_round needs the whole round
    total: Gradients | None = None
    loss_sum = 0.0
    for lo in range(0, len(clients), chunk_size):
        hi = min(lo + chunk_size, len(clients))
        grads, losses = updates(inputs[lo:hi], targets[lo:hi])
        loss_sum += float(losses.sum())
        shared = grads if defense is None else _defend_chunk(model, defense, round_idx, clients[lo:hi], grads)
        chunk_sum = {n: g.sum(0) for n, g in shared.items()}
        total = chunk_sum if total is None else {n: total[n] + chunk_sum[n] for n in total}
    assert total is not None
    return {n: t / len(clients) for n, t in total.items()}, loss_sum / len(clients)


def _defend_chunk(
    model: nn.Module, defense: Defense, round_idx: int, clients: list[int], grads: Gradients
) -> Gradients:
    """Each client's gradient of ``grads`` (``[C, ...]`` per layer) through ``defense``, written into
    a fresh ``[C, ...]`` buffer through the defense's ``out``."""
    local = {c: {n: g[i] for n, g in grads.items()} for i, c in enumerate(clients)}
    if type(defense).begin_round is not Defense.begin_round:
        defense.begin_round(round_idx, clients, local, share_in_process)
    inputs: dict[str, Any] = {}
    if defense.reads_weights:
        params = dict(model.named_parameters())
        inputs["weights"] = {n: params[n].detach() for n in grads}
    shared = {n: torch.empty_like(g) for n, g in grads.items()}
    for i, client in enumerate(clients):
        defense(local[client], client, out={n: s[i] for n, s in shared.items()}, **inputs)
    return shared


@torch.no_grad()
def _server_step(optimizer: torch.optim.Optimizer, params: dict[str, Tensor], mean: Gradients) -> None:
    """The server applies the mean shared gradient with its optimizer (``FederatedSimulation._server_step``)."""
    optimizer.zero_grad(set_to_none=True)
    for name, param in params.items():
        param.grad = mean[name].to(param.dtype)
    optimizer.step()


@torch.no_grad()
def accuracy_on_test_split(model: nn.Module, datamodule: Any) -> float:
    """The fraction of ``datamodule``'s test split ``model`` (in eval mode) classifies right."""
    datamodule.setup("test")
    loader: DataLoader = datamodule.test_dataloader()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = total = 0
    try:
        for batch in loader:
            x, y = batch[0].to(device), batch[1].to(device)
            correct += int((model(x).argmax(-1) == y).sum())
            total += len(y)
    finally:
        model.train(was_training)
    if total == 0:
        raise ValueError(f"datamodule: {type(datamodule).__name__}'s test split is empty")
    return correct / total
