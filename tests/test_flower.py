"""The Flower integration: a real federation runs the in-process simulation's algorithm, the server
receives exactly the defended update, per-client state survives in Context.state, bad input is loud."""

import copy
import importlib
import sys

import pytest
import torch
from helpers import ONE_RAY_WORKER, quiet_trainer

pytest.importorskip("flwr", reason="the Flower integration is optional: pip install 'lightning-gp[flower]'")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg

from lightning_gp import callbacks, defenses
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.defenses import count_sent
from lightning_gp.federated import FederatedSimulation
from lightning_gp.flower import (
    FederatedData,
    TappedStrategy,
    UpdateDefenseMod,
    lightning_client_app,
    lightning_server_app,
)
from lightning_gp.models import ImageClassifier, LeNetZhu
from lightning_gp.records import TappedGradient

pytestmark = pytest.mark.filterwarnings("ignore:Tip. In future versions of Ray:FutureWarning")

NUM_CLIENTS, ROUNDS, LOCAL_STEPS, BATCH, LOCAL_LR = 2, 3, 2, 4, 0.05


def client_module(context: Context | None = None) -> ImageClassifier:
    """The clients' LightningModule (its weights come from the server each round)."""
    return ImageClassifier(LeNetZhu(), lr=LOCAL_LR)


def initial_model() -> LeNetZhu:
    torch.manual_seed(0)
    return LeNetZhu()


def federated_data() -> FederatedData:
    return FederatedData(
        FashionMNISTSampleDataModule(), NUM_CLIENTS, local_batch_size=BATCH, local_steps=LOCAL_STEPS, seed=0
    )


def server_model() -> ImageClassifier:
    model = client_module()
    model.model.load_state_dict(initial_model().state_dict())
    return model


@pytest.fixture(autouse=True)
def task_identity(flower_process):
    """The tests that call the apps directly play the Flower process that builds the messages."""


def context(client: int, node: int = 11) -> Context:
    return Context(
        run_id=1,
        node_id=node,
        node_config={"partition-id": client, "num-partitions": NUM_CLIENTS},
        state=RecordDict(),
        run_config={},
    )


def train_message(weights: dict, server_round: int, node: int = 11) -> Message:
    content = RecordDict({"arrays": ArrayRecord(weights), "config": ConfigRecord({"server-round": server_round})})
    return Message(content, dst_node_id=node, message_type=MessageType.TRAIN)


def weights_of(reply: Message) -> dict[str, torch.Tensor]:
    return {n: a.clone() for n, a in reply.content["arrays"].to_torch_state_dict().items()}


# --------------------------------------------------------------------------- a real federation


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """2 clients x 3 rounds of FedAvg on Flower's simulation engine (ray), DGP then random pruning
    (both with error feedback; the latter draws from each client's random stream) as a client mod."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray: pip install 'lightning-gp[flower]'")
    from flwr.simulation import run_simulation

    data = federated_data()
    strategy = TappedStrategy(
        FedAvg(fraction_evaluate=0.0, min_train_nodes=NUM_CLIENTS, min_available_nodes=NUM_CLIENTS),
        server_model(),
        batches=data.batch,
        dirpath=str(tmp_path_factory.mktemp("flower_taps")),
    )
    mod = UpdateDefenseMod(defenses.DualGradientPruning(seed=1), defenses.RandomPruning(rate=0.5, seed=2))
    run_simulation(
        server_app=lightning_server_app(strategy, server_model(), num_rounds=ROUNDS),
        client_app=lightning_client_app(client_module, data, mods=[mod], trainer_kwargs={"accelerator": "cpu"}),
        num_supernodes=NUM_CLIENTS,
        backend_config=ONE_RAY_WORKER,
    )
    return strategy


@pytest.fixture(scope="module")
def simulated():
    """The in-process FederatedSimulation with the same seeds, clients, local training and defenses."""
    taps = [callbacks.GradientTap(clients=c, rounds=None) for c in range(NUM_CLIENTS)]
    sim = FederatedSimulation(
        initial_model(),
        datamodule=FashionMNISTSampleDataModule(),
        algorithm="fedavg",
        num_clients=NUM_CLIENTS,
        clients_per_round=NUM_CLIENTS,
        local_batch_size=BATCH,
        local_steps=LOCAL_STEPS,
        local_lr=LOCAL_LR,
        server_lr=1.0,
        weighting="num_samples",
        seed=0,
    )
    defense_callbacks = [callbacks.DualGradientPruning(seed=1), callbacks.RandomPruning(rate=0.5, seed=2)]
    quiet_trainer(max_steps=ROUNDS, callbacks=[*defense_callbacks, *taps]).fit(sim)
    return sim, {(r.round, r.client_id): r for tap in taps for r in tap.records}


@pytest.mark.simulation
def test_flower_global_model_after_three_rounds_equals_the_in_process_simulation(federation, simulated):
    sim, _ = simulated
    assert federation.result is not None
    final = federation.result.arrays.to_torch_state_dict()
    for name, expected in sim.module.state_dict().items():
        torch.testing.assert_close(final[f"model.{name}"], expected, rtol=0, atol=1e-5)
    moved = sum(float((final[f"model.{n}"] - p).abs().sum()) for n, p in initial_model().state_dict().items())
    assert moved > 1e-2  # the rounds changed the model (the comparison is not of two untouched copies)


@pytest.mark.simulation
def test_server_receives_exactly_the_defended_update_of_every_client_and_round(federation, simulated):
    _, shared = simulated
    assert sorted((r.round, r.client_id) for r in federation.records) == sorted(shared)
    for record in federation.records:
        expected = shared[(record.round, record.client_id)]
        for name, update in expected.gradients.items():
            received = record.gradients[f"model.{name}"]
            # pruned entries arrive as exact zeros (w - (w - 0) == w); sent ones to float precision
            assert torch.equal(received != 0, update != 0), (record.round, record.client_id, name)
            torch.testing.assert_close(received, update, rtol=0, atol=1e-5)
        if record.round == 0:  # no residuals yet: at most DGP's band, which random pruning thins
            for update in record.gradients.values():
                assert int((update != 0).sum()) <= count_sent(1 - 0.05 - 0.75, update.numel())
        assert any(bool(update.any()) for update in record.gradients.values())
        assert [d["name"] for d in record.meta["defenses"]] == ["DualGradientPruning", "RandomPruning"]
        assert record.meta["local_steps"] == LOCAL_STEPS and record.meta["local_batch_size"] == BATCH
        torch.testing.assert_close(record.inputs, expected.inputs)  # the audit batch is the client's data


@pytest.mark.simulation
def test_server_tap_files_load_as_tapped_gradients_and_traffic_is_counted(federation):
    record = federation.records[-1]
    loaded = TappedGradient.load(f"{federation.dirpath}/round{record.round}_client{record.client_id}.pt")
    assert loaded.gradients.keys() == record.gradients.keys() and loaded.meta["path"] == "flower"
    assert len(federation.traffic) == ROUNDS * NUM_CLIENTS
    for traffic in federation.traffic:  # Flower ships dense weights; the pruned update would encode smaller
        assert traffic.update_encoded_bytes < 0.5 * traffic.update_dense_bytes <= traffic.upload_bytes


# --------------------------------------------------------------------------- one client, no engine


def test_mod_sends_the_defended_update_and_the_tap_reads_it_back():
    data = federated_data()
    weights = server_model().state_dict()
    plain = lightning_client_app(client_module, data)(train_message(weights, 1), context(0))
    defended_app = lightning_client_app(
        client_module, data, mods=[UpdateDefenseMod(defenses.TopKPruning(rate=0.9, seed=0))]
    )
    reply = defended_app(train_message(weights, 1), context(0))
    names = list(client_module().model.state_dict())
    raw = {f"model.{n}": weights[f"model.{n}"] - weights_of(plain)[f"model.{n}"] for n in names}
    expected = defenses.TopKPruning(rate=0.9, seed=0)(raw, 0)
    for name, update in expected.items():
        torch.testing.assert_close(weights_of(reply)[name], weights[name] - update)
    strategy = TappedStrategy(FedAvg(), server_model())
    strategy.tap_replies(1, ArrayRecord(weights), [reply])
    (record,) = strategy.records
    assert record.round == 0 and record.client_id == 0
    for name, update in expected.items():
        assert torch.equal(record.gradients[name] != 0, update != 0)
        torch.testing.assert_close(record.gradients[name], update, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:.*val_dataloader")
def test_trainer_callback_state_survives_rounds_in_the_node_context():
    """A DGP callback inside the local Trainer keeps its error-feedback residual across rounds in
    Context.state: round 1 equals one callback object trained through both rounds."""
    data = federated_data()
    app = lightning_client_app(
        client_module, data, callbacks=lambda ctx: [callbacks.DualGradientPruning()], trainer_kwargs={}
    )
    node = context(1)
    weights = server_model().state_dict()
    round0 = weights_of(app(train_message(weights, 1), node))
    round1 = weights_of(app(train_message(round0, 2), node))

    kept = callbacks.DualGradientPruning()  # one object, state kept in memory
    module = client_module()
    module.load_state_dict(weights)
    quiet_trainer(max_epochs=1, callbacks=[kept]).fit(module, data.loader(1, 0))
    module.load_state_dict(round0)
    quiet_trainer(max_epochs=1, callbacks=[kept]).fit(module, data.loader(1, 1))
    for name, value in module.state_dict().items():
        torch.testing.assert_close(round1[name], value)
    fresh = lightning_client_app(client_module, data, callbacks=lambda ctx: [callbacks.DualGradientPruning()])
    forgetful = weights_of(fresh(train_message(round0, 2), context(1)))
    assert any(not torch.allclose(forgetful[n], round1[n]) for n in round1)  # the residual mattered


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "defense",
    [
        defenses.Soteria(),
        defenses.OptimalGradientNoise(),
        callbacks.Soteria(),
        callbacks.OptimalGradientPruning(),
    ],
    ids=["Soteria", "OptimalGradientNoise", "Soteria callback", "OptimalGradientPruning callback"],
)
def test_defense_that_needs_the_raw_batch_is_refused_as_an_update_mod(defense):
    with pytest.raises(ValueError, match="must run as a Trainer callback inside the client"):
        UpdateDefenseMod(defense)


def test_round_coordinating_defense_is_refused_as_an_update_mod():
    with pytest.raises(ValueError, match="coordinates the clients of a round"):
        UpdateDefenseMod(defenses.AlignedDualGradientPruning())


def secaggplus_set_up(node: Context, sampled: int) -> None:
    """Flower's own ``secaggplus_mod`` runs its setup stage on ``node``: a SecAgg+ round of ``sampled``
    clients, as the workflow's first message of a round announces it."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    setup = {Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: sampled, Key.SHARE_NUMBER: 3, Key.THRESHOLD: 2}
    setup |= {Key.CLIPPING_RANGE: 8.0, Key.TARGET_RANGE: 2**22, Key.MOD_RANGE: 2**32, Key.MAX_WEIGHT: 100.0}
    message = Message(
        RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(setup)}), dst_node_id=11, message_type=MessageType.TRAIN
    )
    secaggplus_mod(message, node, lambda msg, ctx: pytest.fail("the setup stage trains nothing"))


def test_a_distributed_mechanism_is_refused_behind_a_secaggplus_round_smaller_than_its_cohort():
    """Inside ``secaggplus_mod`` the update mod reads the round's sampled clients off the node's SecAgg+
    state: a cohort of 3 noise shares in a sum of 2 uploads would carry less than the central noise, and is
    refused before the client trains; a round of 3 or more defends as usual."""
    weights = server_model().state_dict()
    mod = UpdateDefenseMod(defenses.DistributedGaussianMechanism(2.0, 1.0, cohort_size=3, seed=0))
    app = lightning_client_app(client_module, federated_data(), mods=[mod])
    small = context(0)
    secaggplus_set_up(small, sampled=2)
    with pytest.raises(ValueError, match=r"cohort_size=3\) in rounds that aggregate 2 uploads"):
        app(train_message(weights, 1), small)
    enough = context(0)
    secaggplus_set_up(enough, sampled=3)
    reply = app(train_message(weights, 1), enough)
    assert not reply.has_error() and weights_of(reply).keys() == weights.keys()


def test_node_whose_client_id_changes_between_rounds_is_refused_by_the_client():
    app = lightning_client_app(client_module, federated_data(), mods=[UpdateDefenseMod(defenses.TopKPruning(rate=0.9))])
    node = context(0)
    app(train_message(server_model().state_dict(), 1), node)
    node.node_config["partition-id"] = 1
    with pytest.raises(ValueError, match="mismatched client ids between rounds: node 11 holds the defense state of"):
        app(train_message(server_model().state_dict(), 2), node)


def test_node_whose_client_id_changes_between_rounds_is_refused_by_the_server():
    weights = server_model().state_dict()
    app = lightning_client_app(client_module, federated_data())
    strategy = TappedStrategy(FedAvg(), server_model())
    strategy.tap_replies(1, ArrayRecord(weights), [app(train_message(weights, 1, node=5), context(0, node=5))])
    reply = app(train_message(weights, 2, node=5), context(1, node=5))
    with pytest.raises(ValueError, match="mismatched client ids between rounds: node 5 sent client 0's"):
        strategy.tap_replies(2, ArrayRecord(weights), [reply])


def test_missing_flower_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "flwr" or m.startswith(("flwr.", "lightning_gp.flower"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "flwr", None)  # import flwr -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'lightning-gp\[flower\]'"):
        importlib.import_module("lightning_gp.flower")


def test_federated_data_rejects_bad_arguments():
    with pytest.raises(ValueError, match="local_batch_size"):
        FederatedData(FashionMNISTSampleDataModule(), 2, local_batch_size=0)
    with pytest.raises(ValueError, match="client_id"):
        federated_data().loader(NUM_CLIENTS, 0)
    with pytest.raises(TypeError, match="loader"):
        lightning_client_app(client_module, copy.copy(object()))


@pytest.mark.simulation
def test_the_flower_tap_is_a_fedavg_update_the_fedavg_attack_reads(federation):
    """What the server taps from Flower says its local training, so the attack built for FedAvg
    simulates it and label recovery reads the update as a gradient (one epoch of local steps)."""
    from lightning_gp.attacks import FedAvgInversion, ServerView
    from lightning_gp.attacks.labels import as_gradient

    record = federation.records[0]
    view = ServerView.from_tap(record, server_model(), num_classes=10)
    schedule = FedAvgInversion().schedule(view)
    assert (schedule.images, schedule.batch_size, schedule.steps) == (BATCH * LOCAL_STEPS, BATCH, LOCAL_STEPS)
    assert schedule.lr == pytest.approx(LOCAL_LR)
    assert as_gradient(view).meta["read_from"] == "fedavg update"
