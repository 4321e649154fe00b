"""Client-level DP (DP-FedAvg) on Flower, accounted per round with a budget stop.

McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models" (ICLR
2018), Alg. 1, fixed-denominator estimator (Eq. 2-3), exactly as
:class:`~lightning_gp.federated.ClientLevelDP` runs it in the in-process simulation: each client's
whole update ``w_local - w_global`` is clipped to L2 norm ``C``, the server adds
``N(0, (z C / N)^2)`` to the mean of the ``N`` clipped updates of the round.

The mechanism is Flower's own: :class:`flwr.serverapp.strategy.DifferentialPrivacyClientSideFixedClipping`
(clients clip with :func:`flwr.clientapp.mod.fixedclipping_mod`; the server never sees an unclipped
update) or :class:`~flwr.serverapp.strategy.DifferentialPrivacyServerSideFixedClipping` (the server
clips: it sees the raw updates, the released model does not). Both clip every array of the reply
(buffers too) and add NumPy's unseeded ``N(0, (z C / N)^2)`` to every aggregated array, so
``dp.seed`` is not used here (nor ``dp.kappa``: no ReRo eta is logged on Flower yet).

The accounting is ours (:meth:`ClientLevelDP.epsilon`, dp_accounting's PLD): Flower draws exactly
``clients_per_round`` clients, so every round is charged in full (``q = 1``) unless the
``ClientLevelDP`` asks for ``amplification="poisson"`` (then ``q = clients_per_round / num_clients``,
an approximation for a fixed-size draw). Round ``r`` is charged as released once it is configured.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    Result,
    Strategy,
)

from lightning_gp.federated.client_dp import ClientLevelDP
from lightning_gp.flower.server import single_array_record
from lightning_gp.validation import check_choice, check_int, check_positive_int

CLIPPING = ("client", "server")
#: the key of the cumulative epsilon in each round's aggregated train MetricRecord
EPSILON_METRIC = "dp-epsilon"


class ClientLevelDPStrategy(Strategy):
    """DP-FedAvg around a Flower ``FedAvg``: Flower's fixed-clipping DP wrapper for the mechanism,
    :class:`~lightning_gp.federated.ClientLevelDP` for the accounting (module docstring).

    After every round it logs the cumulative epsilon at ``dp.delta``, keeps it in :attr:`epsilons`
    and adds it to the round's train metrics as :data:`EPSILON_METRIC`. With ``dp.stop_at_epsilon``
    the run ends cleanly after the last round within the budget (:meth:`budget_rounds`); the
    :class:`~flwr.serverapp.strategy.Result` is kept as :attr:`result`.

    Args:
        strategy: a ``FedAvg`` (its own ``aggregate_train``): the sensitivity ``C / N`` holds only
            for the uniform mean of the round's updates, so the clients' weights must be equal.
        dp: noise multiplier ``z``, clip norm ``C``, delta, budget and amplification.
        clients_per_round: ``N``, the number of clients the strategy draws each round (its
            ``fraction_train`` times the nodes, or ``min_train_nodes``); a round with another
            number of updates is an error, as the noise was scaled for ``N``.
        clipping: ``"client"`` (clients need ``fixedclipping_mod`` as their last update mod) or
            ``"server"``.
        num_clients: the population, needed only for ``amplification="poisson"``.
    """

    def __init__(
        self,
        strategy: Strategy,
        dp: ClientLevelDP,
        clients_per_round: int,
        *,
        clipping: str = "client",
        num_clients: int | None = None,
    ) -> None:
        if not isinstance(strategy, FedAvg) or type(strategy).aggregate_train is not FedAvg.aggregate_train:
            raise TypeError(
                f"strategy must be a flwr.serverapp.strategy.FedAvg using FedAvg.aggregate_train (DP-FedAvg's "
                f"sensitivity C / N holds for the uniform mean only), got {type(strategy).__name__}"
            )
        if not isinstance(dp, ClientLevelDP):
            raise TypeError(f"dp must be a lightning_gp.federated.ClientLevelDP, got {type(dp).__name__}")
        self.dp = dp
        self.clients_per_round = check_positive_int(clients_per_round, "clients_per_round")
        self.clipping = check_choice(clipping, "clipping", CLIPPING)
        if dp.amplification == "poisson":
            if num_clients is None:
                raise ValueError(
                    "num_clients is needed for amplification='poisson' (q = clients_per_round / num_clients)"
                )
            check_int(num_clients, "num_clients", low=self.clients_per_round)
        self.sample_rate = dp.sample_rate(self.clients_per_round, num_clients or self.clients_per_round)
        wrapper = (
            DifferentialPrivacyClientSideFixedClipping
            if clipping == "client"
            else DifferentialPrivacyServerSideFixedClipping
        )
        self.strategy = strategy
        self.flower = wrapper(strategy, dp.noise_multiplier, dp.max_update_norm, self.clients_per_round)
        self.epsilons: dict[int, float] = {}
        self._sent: dict[int, ArrayRecord] = {}
        self._epsilon: dict[int, float] = {}
        #: the last round released before the budget stopped the run (``None``: not stopped)
        self.stopped_after: int | None = None
        self.result: Result | None = None

    def budget_rounds(self, num_rounds: int) -> int:
        """The most rounds, up to ``num_rounds``, whose cumulative epsilon stays within
        ``dp.stop_at_epsilon`` (``num_rounds`` without a budget; epsilon grows with the rounds)."""
        check_positive_int(num_rounds, "num_rounds")
        low, high = 0, num_rounds  # bisection: low rounds are allowed; at most log2(num_rounds) PLDs
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if self._allows(middle) else (low, middle - 1)
        return low

    def epsilon_after(self, rounds: int) -> float:
        """:meth:`ClientLevelDP.epsilon` of ``rounds`` rounds at this strategy's ``q`` (computed once
        per ``rounds``: a PLD of ``T`` rounds takes about a second)."""
        if rounds not in self._epsilon:
            self._epsilon[rounds] = self.dp.epsilon(rounds, self.sample_rate)
        return self._epsilon[rounds]

    def _allows(self, rounds: int) -> bool:
        return self.dp.stop_at_epsilon is None or self.epsilon_after(rounds) <= self.dp.stop_at_epsilon

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, *args: Any, **kwargs: Any) -> Result:
        """``Strategy.start`` for at most :meth:`budget_rounds` rounds (none: the initial arrays)."""
        rounds = self.budget_rounds(num_rounds)
        if rounds < num_rounds:
            self.stopped_after = rounds
            log(
                INFO,
                "DP-FedAvg budget: %d of %d round(s) stay within epsilon %g at delta %g; stopping after round %d",
                rounds,
                num_rounds,
                self.dp.stop_at_epsilon,
                self.dp.delta,
                rounds,
            )
        self.result = (
            Result(arrays=initial_arrays)
            if rounds == 0
            else super().start(grid, initial_arrays, rounds, *args, **kwargs)
        )
        return self.result

    def summary(self) -> None:
        log(INFO, "\t├──> %r, %d client(s) per round, %s-side clipping", self.dp, self.clients_per_round, self.clipping)
        self.flower.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's train messages, or none once the round would pass the budget (so
        the run also stops cleanly when another wrapper, e.g. ``TappedStrategy``, calls ``start``:
        the remaining rounds send nothing and release nothing)."""
        stopped = self.stopped_after is not None and server_round > self.stopped_after
        if stopped or not self._allows(server_round):
            if not stopped:
                self.stopped_after = server_round - 1
                log(
                    INFO,
                    "DP-FedAvg budget: round %d would pass epsilon %g; no more rounds",
                    server_round,
                    self.dp.stop_at_epsilon,
                )
            return []
        self._sent = {server_round: arrays}
        return self.flower.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        if self.stopped_after is not None and server_round > self.stopped_after:
            return None, None
        if server_round not in self._sent:
            raise RuntimeError(f"aggregate_train(server_round={server_round}) before configure_train of that round")
        self.check_replies(server_round, self._sent[server_round], replies)
        arrays, metrics = self.flower.aggregate_train(server_round, replies)
        epsilon = self.epsilon_after(server_round)
        self.epsilons[server_round] = epsilon
        log(INFO, "DP-FedAvg: epsilon %.4f at delta %g after %d round(s)", epsilon, self.dp.delta, server_round)
        metrics = MetricRecord() if metrics is None else metrics
        metrics[EPSILON_METRIC] = epsilon
        return arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.flower.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.flower.aggregate_evaluate(server_round, replies)

    def check_replies(self, server_round: int, sent: ArrayRecord, replies: list[Message]) -> None:
        """``N`` replies of equal weight (the noise ``z C / N`` protects exactly that uniform mean);
        with client-side clipping, each update ``w_received - sent`` within ``C`` (a client without
        ``fixedclipping_mod`` is an error, not a silently unclipped update)."""
        ok = [m for m in replies if not m.has_error()]
        if len(ok) != self.clients_per_round:
            raise ValueError(
                f"server round {server_round}: {len(ok)} update(s) arrived, the noise is scaled for "
                f"clients_per_round={self.clients_per_round}"
            )
        key = self.strategy.weighted_by_key
        weights = {next(iter(m.content.metric_records.values())).get(key) for m in ok if m.content.metric_records}
        if len(weights) > 1:
            raise ValueError(
                f"server round {server_round}: the clients' '{key}' differ ({sorted(map(str, weights))}); DP-FedAvg's "
                "sensitivity C / N needs equal weights"
            )
        if self.clipping == "client":
            for reply in ok:
                norm, received_norm = _update_norm(sent, single_array_record(reply.content.array_records))
                # float32 rounding: the mod subtracts and adds back in float32, each off by <= 2^-24 |w| per weight
                if norm > self.dp.max_update_norm * (1 + 1e-5) + 2**-21 * received_norm:
                    raise ValueError(
                        f"server round {server_round}: node {reply.metadata.src_node_id} sent an update of norm "
                        f"{norm:.6g} > max_update_norm={self.dp.max_update_norm:g}: add flwr.clientapp.mod."
                        "fixedclipping_mod as the client's last update mod, or use clipping='server'"
                    )


def _update_norm(sent: ArrayRecord, received: ArrayRecord) -> tuple[float, float]:
    """``||received - sent||_2`` over every array (what Flower's fixed clipping bounds) and
    ``||received||_2``, in float64."""
    total, weights = 0.0, 0.0
    for name, array in sent.items():
        got = received[name].numpy().astype(np.float64)
        total += float(np.square(got - array.numpy().astype(np.float64)).sum())
        weights += float(np.square(got).sum())
    return math.sqrt(total), math.sqrt(weights)
