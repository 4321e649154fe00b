"""Client-level DP (DP-FedAvg) on Flower: every update the server aggregates is clipped to C, the
noise on the aggregate has std z C / N, epsilon per round is ClientLevelDP's, the budget stops the run."""

import math

import numpy as np
import pytest
import torch
from helpers import ONE_RAY_WORKER

pytest.importorskip("flwr", reason="the Flower integration is optional: pip install 'lightning-gp[flower]'")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp.strategy import FedAvg, FedAvgM
from torch import nn

from lightning_gp.federated import ClientLevelDP
from lightning_gp.federated.client_dp import update_norm
from lightning_gp.flower import ClientLevelDPStrategy, TappedStrategy, lightning_server_app, protocol
from lightning_gp.flower.client_dp import EPSILON_METRIC

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

NODES, ROUNDS, Z, C, UPDATE_NORM = 3, 5, 1.0, 1.0, 5.0


def server_model() -> nn.Module:
    """20,100 weights: the noise's sample std is within 5 / sqrt(2 n) = 2.5 % of its std."""
    torch.manual_seed(0)
    return nn.Linear(200, 100)


def client_app(clipping: str) -> ClientApp:
    """Each client adds a seeded update of norm 5 > C to the global weights (so clipping must bite)."""
    app = ClientApp(mods=[fixedclipping_mod] if clipping == "client" else [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        client = int(context.node_config["partition-id"])
        rng = np.random.default_rng(1000 * client + int(msg.content["config"].get("round", 0)))
        received = msg.content["arrays"].to_numpy_ndarrays()
        updates = [rng.normal(size=a.shape) for a in received]
        scale = UPDATE_NORM / math.sqrt(sum(float((u**2).sum()) for u in updates))
        local = {
            n: Array((a + scale * u).astype(np.float32)) for n, a, u in zip(msg.content["arrays"], received, updates)
        }
        content = RecordDict({"arrays": ArrayRecord(local), "metrics": MetricRecord({"num-examples": 1})})
        content[protocol.REPLY_RECORD] = ConfigRecord({protocol.CLIENT_ID: client})  # for TappedStrategy
        return Message(content, reply_to=msg)

    return app


class RecordingFedAvg(FedAvg):
    """FedAvg that keeps what it was handed: each round's global model and the replies it averages."""

    def __init__(self) -> None:
        super().__init__(fraction_evaluate=0.0, min_train_nodes=NODES, min_available_nodes=NODES)
        self.sent: dict[int, dict[str, np.ndarray]] = {}
        self.averaged: dict[int, list[dict[str, np.ndarray]]] = {}
        self.aggregate_train = self.recording_aggregate_train  # an instance spy: the class keeps FedAvg's

    def configure_train(self, server_round, arrays, config, grid):
        config["round"] = server_round
        self.sent[server_round] = {n: a.numpy().copy() for n, a in arrays.items()}
        return super().configure_train(server_round, arrays, config, grid)

    def recording_aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.averaged[server_round] = [{n: a.numpy().copy() for n, a in m.content["arrays"].items()} for m in replies]
        return FedAvg.aggregate_train(self, server_round, replies)


def budget_between(rounds: int) -> float:
    """An epsilon budget that the accounting puts between ``rounds`` and ``rounds + 1`` rounds."""
    dp = ClientLevelDP(Z, C)
    return (dp.epsilon(rounds, 1.0) + dp.epsilon(rounds + 1, 1.0)) / 2


@pytest.fixture(scope="module", params=["client", "server, tapped"])
def run(request):
    """3 nodes, 5 rounds asked, a budget that allows 3, with client- or server-side clipping; "tapped":
    TappedStrategy outside (it calls ``start``, so the budget stop is the DP strategy's no-op rounds)."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray: pip install 'lightning-gp[flower]'")
    from flwr.simulation import run_simulation

    inner = RecordingFedAvg()
    dp = ClientLevelDP(Z, C, stop_at_epsilon=budget_between(3))
    clipping = request.param.split(",")[0]
    strategy = ClientLevelDPStrategy(inner, dp, clients_per_round=NODES, clipping=clipping)
    outer = TappedStrategy(strategy, server_model()) if "tapped" in request.param else strategy
    run_simulation(
        server_app=lightning_server_app(outer, server_model(), num_rounds=ROUNDS),
        client_app=client_app(clipping),
        num_supernodes=NODES,
        backend_config=ONE_RAY_WORKER,
    )
    return strategy, inner, outer


@pytest.mark.simulation
def test_budget_stop_ends_the_run_after_the_last_round_within_epsilon(run):
    strategy, inner, outer = run
    assert sorted(inner.sent) == [1, 2, 3]
    assert sorted(outer.result.train_metrics_clientapp) == [1, 2, 3]
    assert strategy.stopped_after == 3
    assert strategy.epsilons[3] <= strategy.dp.stop_at_epsilon < strategy.dp.epsilon(4, 1.0)


@pytest.mark.simulation
def test_epsilon_per_round_equals_client_level_dp_at_q_1(run):
    strategy, _, outer = run
    reference = ClientLevelDP(Z, C)
    for r in (1, 2, 3):
        assert strategy.epsilons[r] == pytest.approx(reference.epsilon(r, 1.0), rel=1e-12)
        assert outer.result.train_metrics_clientapp[r][EPSILON_METRIC] == pytest.approx(strategy.epsilons[r])
    assert strategy.epsilons[1] < strategy.epsilons[2] < strategy.epsilons[3]


@pytest.mark.simulation
def test_every_update_the_strategy_aggregates_has_norm_at_most_c(run):
    _, inner, outer = run
    for r, replies in inner.averaged.items():
        assert len(replies) == NODES
        for received in replies:
            update = {n: torch.from_numpy(received[n] - inner.sent[r][n]).double() for n in received}
            # clipped from norm 5 onto the ball: at C up to float32 rounding of the weights (|w| <= 1)
            assert update_norm(update) == pytest.approx(C, abs=1e-4)
    if isinstance(outer, TappedStrategy):  # the server's own tap sees each raw update: the server clips later
        assert len(outer.records) == 3 * NODES
        assert all(update_norm(r.gradients) == pytest.approx(UPDATE_NORM, rel=1e-4) for r in outer.records)


@pytest.mark.simulation
def test_noise_on_the_aggregate_has_std_z_c_over_n(run):
    _, inner, outer = run
    final = {n: a.numpy() for n, a in outer.result.arrays.items()}
    for r, replies in inner.averaged.items():
        released = inner.sent.get(r + 1, final)
        noise = np.concatenate(
            [(released[n].astype(np.float64) - np.mean([x[n] for x in replies], axis=0)).ravel() for n in released]
        )
        n, std = noise.size, Z * C / NODES
        # the sample std of n Gaussians has relative standard error 1 / sqrt(2 n); the mean, std / sqrt(n)
        assert abs(noise.std() / std - 1) < 5 / math.sqrt(2 * n)
        assert abs(noise.mean()) < 5 * std / math.sqrt(n)


def test_a_budget_below_one_round_runs_no_round():
    dp = ClientLevelDP(Z, C, stop_at_epsilon=budget_between(0) / 10)
    strategy = ClientLevelDPStrategy(RecordingFedAvg(), dp, clients_per_round=NODES)
    assert strategy.budget_rounds(ROUNDS) == 0
    assert ClientLevelDPStrategy(RecordingFedAvg(), ClientLevelDP(Z, C), NODES).budget_rounds(ROUNDS) == ROUNDS


def test_bad_input_names_the_argument():
    dp = ClientLevelDP(Z, C)
    with pytest.raises(ValueError, match="clients_per_round"):
        ClientLevelDPStrategy(FedAvg(), dp, clients_per_round=0)
    with pytest.raises(ValueError, match="clipping"):
        ClientLevelDPStrategy(FedAvg(), dp, clients_per_round=2, clipping="local")
    with pytest.raises(TypeError, match="dp must be"):
        ClientLevelDPStrategy(FedAvg(), {"noise_multiplier": 1.0}, clients_per_round=2)
    with pytest.raises(TypeError, match="strategy must be"):
        ClientLevelDPStrategy(FedAvgM(), dp, clients_per_round=2)
    with pytest.raises(ValueError, match="num_clients"):
        ClientLevelDPStrategy(FedAvg(), ClientLevelDP(Z, C, amplification="poisson"), clients_per_round=2)
    with pytest.raises(ValueError, match="num_clients"):
        ClientLevelDPStrategy(FedAvg(), ClientLevelDP(Z, C, amplification="poisson"), 4, num_clients=2)
    with pytest.raises(ValueError, match="num_rounds"):
        ClientLevelDPStrategy(FedAvg(), dp, clients_per_round=2).budget_rounds(0)


def reply(sent: ArrayRecord, update_norm_: float, weight: int = 1, node: int = 7) -> Message:
    """A train reply whose update ``received - sent`` has norm ``update_norm_`` along every weight."""
    arrays = {n: a.numpy() for n, a in sent.items()}
    size = sum(a.size for a in arrays.values())
    received = {n: Array((a + update_norm_ / math.sqrt(size)).astype(np.float32)) for n, a in arrays.items()}
    incoming = Message(RecordDict({"arrays": sent}), dst_node_id=node, message_type=MessageType.TRAIN)
    return Message(
        RecordDict({"arrays": ArrayRecord(received), "metrics": MetricRecord({"num-examples": weight})}),
        reply_to=incoming,
    )


def test_server_refuses_unclipped_unequal_or_missing_updates_with_client_side_clipping(flower_process):
    sent = ArrayRecord({n: Array(t.detach().numpy()) for n, t in server_model().state_dict().items()})
    strategy = ClientLevelDPStrategy(FedAvg(), ClientLevelDP(Z, C), clients_per_round=2)
    strategy.check_replies(1, sent, [reply(sent, C), reply(sent, C / 2)])  # within C: accepted
    with pytest.raises(ValueError, match="fixedclipping_mod"):
        strategy.check_replies(1, sent, [reply(sent, C), reply(sent, 1.01 * C)])
    with pytest.raises(ValueError, match="equal weights"):
        strategy.check_replies(1, sent, [reply(sent, C), reply(sent, C, weight=2)])
    with pytest.raises(ValueError, match="clients_per_round=2"):
        strategy.check_replies(1, sent, [reply(sent, C)])
    server_side = ClientLevelDPStrategy(FedAvg(), ClientLevelDP(Z, C), clients_per_round=2, clipping="server")
    server_side.check_replies(1, sent, [reply(sent, 10 * C), reply(sent, C)])  # the server clips them itself


@pytest.mark.filterwarnings("ignore:.*val_dataloader")
def test_lightning_client_app_with_fixedclipping_mod_sends_an_update_the_dp_server_accepts(flower_process):
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

    from lightning_gp.data import FashionMNISTSampleDataModule
    from lightning_gp.flower import FederatedData, lightning_client_app
    from lightning_gp.models import ImageClassifier, LeNetZhu

    def module(context=None):
        return ImageClassifier(LeNetZhu(), lr=0.05)

    torch.manual_seed(0)
    sent = ArrayRecord(module().state_dict())
    data = FederatedData(FashionMNISTSampleDataModule(), 2, local_batch_size=4, local_steps=2, seed=0)
    node = Context(run_id=1, node_id=11, node_config={"partition-id": 0}, state=RecordDict(), run_config={})

    def train(app, clip: float) -> Message:
        config = ConfigRecord({"server-round": 1, KEY_CLIPPING_NORM: clip})
        return app(
            Message(RecordDict({"arrays": sent, "config": config}), dst_node_id=11, message_type=MessageType.TRAIN),
            node,
        )

    plain = lightning_client_app(module, data, trainer_kwargs={"accelerator": "cpu"})
    raw = _update_of(sent, train(plain, 1.0))
    clip = raw / 2  # half the update's own norm: clipping must bite
    strategy = ClientLevelDPStrategy(FedAvg(), ClientLevelDP(Z, clip), clients_per_round=1)
    with pytest.raises(ValueError, match="fixedclipping_mod"):
        strategy.check_replies(1, sent, [train(plain, clip)])
    clipped = train(
        lightning_client_app(module, data, mods=[fixedclipping_mod], trainer_kwargs={"accelerator": "cpu"}), clip
    )
    strategy.check_replies(1, sent, [clipped])
    assert _update_of(sent, clipped) == pytest.approx(clip, rel=1e-4)


def _update_of(sent: ArrayRecord, reply: Message) -> float:
    received = reply.content["arrays"]
    return update_norm({n: torch.from_numpy(received[n].numpy() - a.numpy()).double() for n, a in sent.items()})


def test_budget_rounds_is_the_last_round_count_within_the_budget():
    dp = ClientLevelDP(2.0, C, stop_at_epsilon=5.0)
    strategy = ClientLevelDPStrategy(FedAvg(), dp, clients_per_round=NODES)
    rounds = strategy.budget_rounds(40)
    assert 0 < rounds < 40
    assert dp.epsilon(rounds, 1.0) <= 5.0 < dp.epsilon(rounds + 1, 1.0)
