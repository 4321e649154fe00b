"""FedSGD with thousands of clients per round, each defending its own gradient, without Lightning.

:class:`~lightning_gp.federated.FederatedSimulation` runs every client step through a ``Trainer``,
its data loader and the defense pipeline; that is the reference, and far too slow for 1000-10000
clients per round. :func:`fedsgd_many_clients` trains the same FedSGD (McMahan et al., AISTATS 2017,
Algorithm "FederatedSGD": every sampled client shares the gradient of its mean loss on one local
batch, the server averages the shared gradients and steps its optimizer) with the same clients, the
same local batches, the same per-client defense streams and the same server optimizer, so a run
here is a run of the simulation, only faster: the clients' gradients come from ``torch.func``
(:func:`~lightning_gp.federated.client_updates.client_gradients`, ``vmap`` over clients), chunk
by chunk, and each chunk's shared gradients are summed before the next is computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_gp.defenses.base import Defense, Gradients, share_in_process
from lightning_gp.federated.client_updates import client_gradients, trainable_parameters, updates_running_stats
from lightning_gp.federated.partition import iid_partition
from lightning_gp.federated.rounds import ClientRounds
from lightning_gp.validation import (
    check_choice,
    check_int,
    check_model_fits_data,
    check_positive,
    check_positive_int,
)

__all__ = ["ManyClientsRound", "ManyClientsRun", "accuracy_on_test_split", "fedsgd_many_clients"]


@dataclass(frozen=True)
class ManyClientsRound:
    """One finished round: its index, the clients' mean training loss, and its wall time in seconds."""

    round: int
    loss: float
    seconds: float


@dataclass
class ManyClientsRun:
    """What :func:`fedsgd_many_clients` did: one :class:`ManyClientsRound` per round, in order."""

    clients_per_round: int
    client_batch_size: int
    rounds: list[ManyClientsRound] = field(default_factory=list)

    @property
    def seconds_per_round(self) -> float:
        """The mean wall time of a round."""
        return sum(r.seconds for r in self.rounds) / max(1, len(self.rounds))


def fedsgd_many_clients(
    model: nn.Module,
    datamodule: Any,
    *,
    defense: Defense | None = None,
    clients_per_round: int,
    client_batch_size: int = 1,
    rounds: int,
    num_clients: int | None = None,
    server_optimizer: Literal["sgd", "adam"] = "adam",
    server_lr: float = 1e-3,
    loss_fn: nn.Module | None = None,
    seed: int = 0,
    chunk_size: int = 1000,
    progress: Callable[[ManyClientsRound], None] | None = None,
) -> ManyClientsRun:
    """Train ``model`` in place with FedSGD, ``clients_per_round`` clients a round, each defending its gradient.

    The same run as ``FederatedSimulation(model, datamodule, algorithm="fedsgd",
    num_clients=num_clients, clients_per_round=clients_per_round, local_batch_size=client_batch_size,
    server_optimizer=server_optimizer, server_lr=server_lr, seed=seed)`` under a ``Trainer`` with the
    defense's callback and ``max_steps=rounds``: the clients split the training set IID (seeded by
    ``seed``); round ``r`` samples its clients and each client's ``client_batch_size`` images with
    :class:`~lightning_gp.federated.ClientRounds`; a client's gradient is that of its mean loss on
    them; ``defense(gradient, client_id)`` rewrites it, the client's random stream keyed by
    ``(defense.seed, client_id)`` and continued from round to round, clients in ascending order, as
    the pipeline calls a pure defense; the server averages the shared gradients uniformly and steps
    its optimizer. The defaults (Adam at 1e-3, every client in every round) are those
    :func:`~lightning_gp.audit.train_setting` trains a FedSGD setting with.

    Args:
        model: the client model, an ``nn.Module`` without BatchNorm running statistics in training
            mode (``vmap`` cannot update them); trained in place.
        datamodule: its ``train_dataset`` (after ``setup("fit")``) is split among the clients.
        defense: a pure :class:`~lightning_gp.defenses.Defense` that defends from the gradient
            alone (or, like Outpost, also from the current weights, which it is given); ``None``
            trains undefended. Its per-client state and streams live on in the object. A defense
            that prepares its rounds across clients (ADGP) is given every client's gradient first,
            so the round is held in memory whole. Data-dependent defenses (Soteria, the optimal
            defenses, GradDefense) need their Lightning adapter's statistics and are refused.
        clients_per_round: clients sampled each round; ``num_clients``: clients in all (default:
            ``clients_per_round``, every client in every round).
        client_batch_size: images per client per round (with replacement from a client that holds fewer).
        rounds: FedSGD rounds.
        server_optimizer, server_lr: how the server applies the mean shared gradient.
        loss_fn: the client loss (mean over its batch); default ``model.loss_fn``, else cross-entropy.
        seed: seeds the partition and every round's sampling.
        chunk_size: clients whose gradients are computed (and held) at once.
        progress: called with each finished :class:`ManyClientsRound`.

    Returns:
        A :class:`ManyClientsRun` with each round's mean client loss and wall time.
    """
    num_clients = _check_arguments(
        model, datamodule, defense, clients_per_round, client_batch_size, rounds, num_clients, chunk_size
    )
    check_int(seed, "seed", low=0)
    loss_fn = loss_fn if loss_fn is not None else getattr(model, "loss_fn", None) or nn.CrossEntropyLoss()
    params = trainable_parameters(model)
    optimizer = _server_optimizer(list(params.values()), server_optimizer, server_lr)
    device = next(iter(params.values())).device
    dataset, inputs, targets = _training_data(datamodule, device)
    split = iid_partition(len(inputs), num_clients, seed)
    sampler = ClientRounds(dataset, split, clients_per_round, client_batch_size, local_steps=1, seed=seed)
    if defense is not None:  # as the defense's callback binds it at fit start
        defense.set_num_clients(num_clients)
        defense.check_layer_shapes({n: p.shape for n, p in params.items()})
    run = ManyClientsRun(clients_per_round, client_batch_size)
    model.train()
    for round_idx in range(rounds):
        start = time.perf_counter()
        clients = sampler.sample_clients(round_idx).tolist()
        local = torch.stack([sampler.sample_local_indices(round_idx, c) for c in clients]).to(device)
        mean, loss = _round_mean(model, loss_fn, defense, round_idx, clients, inputs[local], targets[local], chunk_size)
        _server_step(optimizer, params, mean)
        report = ManyClientsRound(round_idx, loss, time.perf_counter() - start)
        run.rounds.append(report)
        if progress is not None:
            progress(report)
    return run


def _check_arguments(
    model: nn.Module,
    datamodule: Any,
    defense: Defense | None,
    clients_per_round: int,
    client_batch_size: int,
    rounds: int,
    num_clients: int | None,
    chunk_size: int,
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
    num_clients = clients_per_round if num_clients is None else check_positive_int(num_clients, "num_clients")
    if clients_per_round > num_clients:
        raise ValueError(f"clients_per_round ({clients_per_round}) cannot exceed num_clients ({num_clients})")
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
    loss_fn: Any,
    defense: Defense | None,
    round_idx: int,
    clients: list[int],
    inputs: Tensor,
    targets: Tensor,
    chunk_size: int,
) -> tuple[Gradients, float]:
    """The mean of the clients' shared gradients in one round, and their mean loss.

    ``inputs``: ``[C, B, ...]`` (client ``clients[i]``'s batch at ``i``). Chunks of ``chunk_size``
    clients are differentiated at once and defended client by client into one buffer, whose sum
    joins the round's total; a defense that prepares its rounds sees every gradient first.
    """
    if defense is not None and type(defense).begin_round is not Defense.begin_round:
        chunk_size = len(clients)  # begin_round needs the whole round
    total: Gradients | None = None
    loss_sum = 0.0
    for lo in range(0, len(clients), chunk_size):
        hi = min(lo + chunk_size, len(clients))
        grads, losses = client_gradients(model, loss_fn, inputs[lo:hi], targets[lo:hi], vectorize=True)
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
