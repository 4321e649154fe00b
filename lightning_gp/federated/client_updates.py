"""Each sampled client's gradient (FedSGD) or local update (FedAvg), batched over clients.

The vectorized path evaluates all clients at once with ``torch.func`` (``functional_call`` +
``grad`` + ``vmap`` over the client dimension). BatchNorm running statistics cannot be updated
under ``vmap``, so models that track them use the loop path: one ordinary autograd pass per
client. Both paths compute the same per-client quantities.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.func import grad_and_value, vmap

from lightning_gp.functional import LossFn, frozen_state, functional_loss, trainable_parameters, updates_running_stats

__all__ = [
    "ClientGradientProvider",
    "ClientUpdateProvider",
    "client_gradients",
    "client_local_updates",
    "trainable_parameters",
    "updates_running_stats",
]


@runtime_checkable
class ClientGradientProvider(Protocol):
    """A client model that computes its own FedSGD gradient (e.g. :class:`~lightning_gp.refiner.RefinerModule`
    shares the projected gradient of robust data instead of the raw batch's).

    The simulation calls :meth:`prepare_clients` once at setup and :meth:`client_gradient` per
    client and round (no vmap: the client step is the provider's own).
    """

    def prepare_clients(self, datamodule: Any) -> None: ...

    def client_gradient(
        self, inputs: Tensor, targets: Tensor, *, client_id: int, round: int, sample_ids: Tensor | None = None
    ) -> tuple[dict[str, Tensor], Tensor]: ...


@runtime_checkable
class ClientUpdateProvider(Protocol):
    """A client model that runs its own FedAvg client step and owns per-client state (e.g.
    :class:`~lightning_gp.priprune.PriPruneModule`: pruned local training, a defense mask per client,
    withheld weights kept on the client).

    A client shares weights ``w_shared``; :meth:`client_update` returns them as the pseudo-gradient
    ``w_global - w_shared`` (named like the module's trainable parameters), so the server's SGD at
    lr 1 on the aggregate is FedAvg. Per round the simulation calls :meth:`begin_round` (server side,
    before any client: e.g. a new pruning mask applied to the global weights), :meth:`client_update`
    per client (inputs ``[S, B, ...]``, targets ``[S, B]``), and :meth:`aggregate_updates` on the
    shared (post-defense) pseudo-gradients instead of the plain weighted mean. :meth:`prepare_clients`
    runs once at setup.
    """

    def prepare_clients(self, datamodule: Any, *, num_clients: int) -> None: ...

    def begin_round(self, round: int) -> None: ...

    def client_update(
        self,
        inputs: Tensor,
        targets: Tensor,
        *,
        client_id: int,
        round: int,
        lr: float,
        sample_ids: Tensor | None = None,
    ) -> tuple[dict[str, Tensor], Tensor]: ...

    def aggregate_updates(
        self, updates: Sequence[Mapping[str, Tensor]], weights: Sequence[float] | None
    ) -> dict[str, Tensor]: ...


def client_gradients(
    module: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    *,
    vectorize: bool,
    chunk_size: int | None = None,
) -> tuple[dict[str, Tensor], Tensor]:
    """FedSGD: the gradient of every client's loss on its own batch.

    Args:
        inputs: ``[C, B, ...]``, one local batch per client; ``targets``: ``[C, B, ...]``.
    Returns:
        ``({name: [C, *param.shape]}, losses [C])`` for the trainable parameters.

    On the loop path (BatchNorm models) each client's forward pass runs on ``module`` in
    training mode, so its running statistics absorb every client's batch in turn, as if the
    server had seen those batches in sequence; FedAvg instead averages the clients' statistics.
    """
    params = {n: p.detach() for n, p in trainable_parameters(module).items()}
    if vectorize:
        step = grad_and_value(functional_loss(module, loss_fn, frozen_state(module)))
        grads, losses = vmap(step, in_dims=(None, 0, 0), randomness="different", chunk_size=chunk_size)(
            params, inputs, targets
        )
        return grads, losses.detach()
    live = trainable_parameters(module)
    per_client, losses = [], []
    for x, y in zip(inputs, targets):
        with torch.enable_grad():
            loss = loss_fn(module(x), y)
            grads = torch.autograd.grad(loss, list(live.values()), allow_unused=True)
        per_client.append([torch.zeros_like(p) if g is None else g for p, g in zip(live.values(), grads)])
        losses.append(loss.detach())
    stacked = {n: torch.stack([client[i] for client in per_client]) for i, n in enumerate(live)}
    return stacked, torch.stack(losses)


def client_local_updates(
    module: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    *,
    lr: float,
    vectorize: bool,
    chunk_size: int | None = None,
) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor] | None]:
    """FedAvg: every client runs ``S`` SGD steps from the global weights on its own batches.

    Args:
        inputs: ``[C, S, B, ...]``; ``targets``: ``[C, S, B, ...]``.
    Returns:
        ``(pseudo_gradients, losses, buffers)``: ``pseudo_gradients[name]`` is
        ``[C, *shape]`` holding ``w_global - w_local`` (what the client shares: applying it with
        SGD at lr 1 is McMahan et al.'s FedAvg), ``losses`` is ``[C]`` (mean over local steps),
        and ``buffers`` the clients' mean BatchNorm statistics (loop path; ``None`` otherwise).
    """
    start = {n: p.detach() for n, p in trainable_parameters(module).items()}
    if vectorize:
        step = grad_and_value(functional_loss(module, loss_fn, frozen_state(module)))

        def local_training(params: dict[str, Tensor], xs: Tensor, ys: Tensor) -> tuple[dict[str, Tensor], Tensor]:
            current, total = params, torch.zeros((), device=xs.device)
            for s in range(xs.shape[0]):
                grads, loss = step(current, xs[s], ys[s])
                current = {n: current[n] - lr * grads[n] for n in current}
                total = total + loss
            return {n: params[n] - current[n] for n in params}, total / xs.shape[0]

        deltas, losses = vmap(local_training, in_dims=(None, 0, 0), randomness="different", chunk_size=chunk_size)(
            start, inputs, targets
        )
        return deltas, losses.detach(), None
    per_client: list[dict[str, Tensor]] = []
    client_losses: list[Tensor] = []
    buffers: list[dict[str, Tensor]] = []
    for xs, ys in zip(inputs, targets):
        local = copy.deepcopy(module)
        live = trainable_parameters(local)
        total = torch.zeros((), device=xs.device)
        for x, y in zip(xs, ys):
            with torch.enable_grad():
                loss = loss_fn(local(x), y)
                grads = torch.autograd.grad(loss, list(live.values()), allow_unused=True)
            with torch.no_grad():
                for p, g in zip(live.values(), grads):
                    if g is not None:
                        p.sub_(lr * g)
            total = total + loss.detach()
        per_client.append({n: start[n] - p.detach() for n, p in live.items()})
        client_losses.append(total / xs.shape[0])
        buffers.append(dict(local.named_buffers()))
    stacked = {n: torch.stack([client[n] for client in per_client]) for n in start}
    return stacked, torch.stack(client_losses), _mean_buffers(buffers)


def _mean_buffers(buffers: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    mean = {}
    for name in buffers[0]:
        stacked = torch.stack([b[name] for b in buffers])
        mean[name] = stacked.float().mean(0).to(stacked.dtype) if stacked.is_floating_point() else stacked.max(0).values
    return mean
