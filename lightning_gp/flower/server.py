"""The server side: a strategy wrapper that taps what each client sent and counts the bytes.

:class:`TappedStrategy` wraps any Flower message-API strategy (``FedAvg``, ``FedAvgM``, ...): it
passes every call through, and before the wrapped strategy aggregates a round it records each
client's update ``w_global - w_received`` (the FedAvg update exactly as the server received it,
after every client-side defense) as a :class:`~lightning_gp.records.TappedGradient`, the record
``lightning-gp attack --tap_files`` and the audits read, and counts what went over the wire.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result, Strategy
from torch import Tensor, nn

from lightning_gp.callbacks.communication import dense_nbytes, encoded_nbytes
from lightning_gp.callbacks.tap import tapped_record
from lightning_gp.flower import protocol
from lightning_gp.functional import trainable_parameters
from lightning_gp.records import TappedGradient
from lightning_gp.validation import check_choice, check_int, check_positive_int


@dataclass(frozen=True)
class ClientTraffic:
    """Bytes one client moved in one round.

    Attributes:
        download_bytes: the global model's arrays as sent to the client (Flower's serialisation).
        upload_bytes: the client's reply arrays as received (Flower's serialisation: dense).
        update_dense_bytes: the update ``w_global - w_received`` as dense tensors.
        update_encoded_bytes: the update under the cheapest per-layer sparse encoding
            (:func:`~lightning_gp.callbacks.encoded_nbytes`): what a pruned update could cost on a
            wire that sends updates instead of weights.
    """

    round: int
    client_id: int
    node_id: int
    download_bytes: int
    upload_bytes: int
    update_dense_bytes: int
    update_encoded_bytes: int


class TappedStrategy(Strategy):
    """Wrap a Flower strategy to tap every client's update and count bytes.

    Clients identify themselves in their reply (:func:`~lightning_gp.flower.lightning_client_app`
    and :class:`~lightning_gp.flower.UpdateDefenseMod` write the client id); a node that reports
    another client id than in an earlier round, or two nodes with one id, are errors.

    Args:
        strategy: the strategy that samples, aggregates and steps (e.g. ``FedAvg``).
        model: a module of the clients' class: its trainable parameter names select the update's
            layers, and the tap records it with the round's global weights (a copy is used).
        clients: client ids to tap (``None``: all).
        rounds: 0-based rounds to tap (``None``: all); Flower's server round ``r`` is round ``r - 1``.
        dirpath: if set, each record is written to ``dirpath/round{r}_client{c}.pt``.
        batches: ``batches(client_id, round)`` gives the client's data of the round to keep with
            the record, for scoring reconstructions in an audit (e.g. :meth:`FederatedData.batch`);
            a real server has no client data: leave it ``None`` there (attacks then need the batch
            size from elsewhere).
        on_client_error: ``"raise"`` (default) stops the run when a client replies with an error
            (a refused defense, a client id mismatch); ``"skip"`` leaves it out of the round, as
            Flower's strategies do.
    """

    def __init__(
        self,
        strategy: Strategy,
        model: nn.Module,
        *,
        clients: Sequence[int] | None = None,
        rounds: Sequence[int] | None = None,
        dirpath: str | None = None,
        batches: Callable[[int, int], Any] | None = None,
        on_client_error: str = "raise",
    ) -> None:
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a flwr.serverapp.strategy.Strategy, got {type(strategy).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.strategy = strategy
        self.model = copy.deepcopy(model)
        self.parameter_names = list(trainable_parameters(self.model))
        self.clients = None if clients is None else {check_int(c, "clients", low=0) for c in clients}
        self.rounds = None if rounds is None else {check_int(r, "rounds", low=0) for r in rounds}
        self.dirpath = dirpath
        self.batches = batches
        self.on_client_error = check_choice(on_client_error, "on_client_error", ("raise", "skip"))
        self.records: list[TappedGradient] = []
        self.traffic: list[ClientTraffic] = []
        self.result: Result | None = None
        self._node_clients: dict[int, int] = {}
        self._global: dict[int, ArrayRecord] = {}

    # ---------------------------------------------------------------- Strategy, delegated
    def summary(self) -> None:
        self.strategy.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._global = {server_round: arrays}  # the model this round's updates are relative to
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        if server_round not in self._global:
            raise RuntimeError(f"aggregate_train(server_round={server_round}) before configure_train of that round")
        failed = [m for m in replies if m.has_error()]
        if failed and self.on_client_error == "raise":
            reasons = "; ".join(f"node {m.metadata.src_node_id}: {m.error.reason}" for m in failed)
            raise RuntimeError(f"{len(failed)} client(s) failed in server round {server_round}: {reasons}")
        self.tap_replies(server_round, self._global[server_round], [m for m in replies if not m.has_error()])
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        """Run the federation (``Strategy.start``); the result is also kept as :attr:`result`."""
        self.result = super().start(grid, initial_arrays, *args, **kwargs)
        return self.result

    # ---------------------------------------------------------------- the tap
    def tap_replies(self, server_round: int, sent: ArrayRecord, replies: Sequence[Message]) -> None:
        """Record and count every reply of server round ``server_round`` against the global model
        ``sent`` that round (what :meth:`aggregate_train` does before the wrapped strategy aggregates)."""
        round_idx = server_round - 1
        global_weights = {name: torch.from_numpy(array.numpy()) for name, array in sent.items()}
        missing = [n for n in self.parameter_names if n not in global_weights]
        if missing:
            raise ValueError(
                f"the global model lacks the parameters {missing[:5]} of {type(self.model).__name__}: "
                "pass TappedStrategy the model class the clients train"
            )
        self.model.load_state_dict(global_weights)
        seen: dict[int, int] = {}
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            info = protocol.reply_record(reply.content)
            client = self._client_id(node, info, seen)
            received = single_array_record(reply.content.array_records)
            update = {n: global_weights[n] - torch.from_numpy(received[n].numpy()) for n in self.parameter_names}
            self.traffic.append(
                ClientTraffic(
                    round=round_idx,
                    client_id=client,
                    node_id=node,
                    download_bytes=sent.count_bytes(),
                    upload_bytes=received.count_bytes(),
                    update_dense_bytes=sum(dense_nbytes(u) for u in update.values()),
                    update_encoded_bytes=sum(encoded_nbytes(u) for u in update.values()),
                )
            )
            if (self.clients is None or client in self.clients) and (self.rounds is None or round_idx in self.rounds):
                self._record(update, client, round_idx, node, info, reply)

    def _client_id(self, node: int, info: ConfigRecord | None, seen: dict[int, int]) -> int:
        if info is None or protocol.CLIENT_ID not in info:
            raise ValueError(
                f"node {node}'s reply does not say which client sent it: build the ClientApp with "
                "lightning_client_app(...) or add UpdateDefenseMod to its mods"
            )
        client = int(cast(int, info[protocol.CLIENT_ID]))
        known = self._node_clients.setdefault(node, client)
        if known != client:
            raise ValueError(
                f"mismatched client ids between rounds: node {node} sent client {known}'s updates before and now "
                f"reports client {client}"
            )
        if client in seen:
            raise ValueError(f"nodes {seen[client]} and {node} both report client id {client} in one round")
        seen[client] = node
        return client

    def _record(
        self,
        update: dict[str, Tensor],
        client: int,
        round_idx: int,
        node: int,
        info: ConfigRecord | None,
        reply: Message,
    ) -> None:
        meta: dict[str, Any] = {
            "path": "flower",
            "algorithm": "fedavg",
            "server_round": round_idx + 1,
            "node_id": node,
            "defenses": protocol.described_defenses(info),
        }
        for key, name in (
            (protocol.LOCAL_STEPS, "local_steps"),
            (protocol.LOCAL_BATCH_SIZE, "local_batch_size"),
            (protocol.LOCAL_LR, "local_lr"),
        ):
            if info is not None and key in info:
                meta[name] = info[key]
        metrics = reply.content.metric_records
        if metrics:
            num_examples = next(iter(metrics.values())).get("num-examples")
            if num_examples is not None:
                meta["num_examples"] = num_examples
        batch = None if self.batches is None else self.batches(client, round_idx)
        record = tapped_record(update, client_id=client, round=round_idx, model=self.model, batch=batch, meta=meta)
        self.records.append(record)
        if self.dirpath is not None:
            record.save(Path(self.dirpath) / f"round{round_idx}_client{client}.pt")

    # ---------------------------------------------------------------- totals
    @property
    def total_upload_bytes(self) -> int:
        return sum(t.upload_bytes for t in self.traffic)

    @property
    def total_download_bytes(self) -> int:
        return sum(t.download_bytes for t in self.traffic)

    @property
    def total_update_encoded_bytes(self) -> int:
        return sum(t.update_encoded_bytes for t in self.traffic)


def lightning_server_app(
    strategy: Strategy,
    model: nn.Module,
    *,
    num_rounds: int | None = None,
    train_config: Mapping[str, Any] | None = None,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
) -> ServerApp:
    """A ``ServerApp`` that runs ``strategy`` for ``num_rounds`` rounds from ``model``'s weights
    (its whole ``state_dict``: the clients load it into their module). ``num_rounds=None`` reads
    the run config's ``num-server-rounds`` (Flower's app template key; ``flwr run --run-config``)."""
    if num_rounds is not None:
        check_positive_int(num_rounds, "num_rounds")
    initial = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        rounds = num_rounds
        if rounds is None:
            if "num-server-rounds" not in context.run_config:
                raise ValueError("pass num_rounds=..., or set num-server-rounds in [tool.flwr.app.config]")
            rounds = check_positive_int(int(cast(int, context.run_config["num-server-rounds"])), "num-server-rounds")
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(initial),
            num_rounds=rounds,
            train_config=ConfigRecord(dict(train_config or {})),
            evaluate_fn=evaluate_fn,
        )

    return app


def single_array_record(records: Mapping[str, ArrayRecord]) -> ArrayRecord:
    if len(records) != 1:
        raise ValueError(f"a train reply must carry exactly one ArrayRecord (the client's model), found {len(records)}")
    return next(iter(records.values()))
