"""Distributed DP behind secure aggregation on Flower, with the clients' model checks: Flower's
``secaggplus_mod`` (SecAgg+, Bell et al., CCS 2020) around ``ModelChecksMod`` around
``UpdateDefenseMod(DistributedGaussianMechanism)``, on Flower's simulation engine. The server-side
strategy never receives one client's update, only the unmasked aggregate of the round: the mean of the
clients' clipped, noised uploads, whose noise shares sum to the central noise. A server that sends one
client another model is caught by every client the next round; a model with another architecture is
refused."""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ONE_RAY_WORKER
from torch import nn

pytest.importorskip("flwr", reason="the Flower integration is optional: pip install 'lightning-gp[flower]'")
pytest.importorskip("ray", reason="Flower's simulation engine needs ray: pip install 'lightning-gp[flower]'")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

NODES, SIZE, ROUNDS = 3, 4096, 4
Z, C = 2.0, 1.0
#: the rounds in which the malicious server deviates: round 2 sends one client another model (model
#: inconsistency, as LOKI needs), round 4 sends every client a model with an extra block (an imprint)
INCONSISTENT, IMPRINT = 2, 4


class Public(nn.Module):
    """The public model: one flat weight vector (the clients' update is what the test controls)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(SIZE))


def client_update(client: int, server_round: int) -> np.ndarray:
    """What client ``client`` subtracts from the global weights in a round (distinct per client, norm > C)."""
    return np.random.default_rng([client, server_round]).uniform(-1, 1, SIZE).astype(np.float32)


def defense():
    from lightning_gp.defenses import DistributedGaussianMechanism

    return DistributedGaussianMechanism(noise_multiplier=Z, max_update_norm=C, cohort_size=NODES, seed=0)


@pytest.mark.simulation
def test_distributed_dp_behind_secaggplus_with_the_model_checks(tmp_path: Path) -> None:
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow
    from flwr.simulation import run_simulation

    from lightning_gp.federated import digest_bits
    from lightning_gp.flower import ModelChecksMod, RefusalLog, UpdateDefenseMod, secaggplus_workflow

    seen: dict[int, list[list[np.ndarray]]] = {}
    sent: dict[int, np.ndarray] = {}

    class MaliciousFedAvg(FedAvg):
        """FedAvg that records what it is handed and deviates in the rounds above."""

        def configure_fit(self, server_round, parameters, client_manager):
            instructions = super().configure_fit(server_round, parameters, client_manager)
            arrays = parameters_to_ndarrays(parameters)
            sent[server_round] = arrays[0]
            if server_round == INCONSISTENT:
                proxy, ins = instructions[0]
                other = [arrays[0] + np.float32(1e-3), *arrays[1:]]
                instructions[0] = (proxy, FitIns(ndarrays_to_parameters(other), ins.config))
            if server_round == IMPRINT:
                imprint = [*arrays, np.zeros((8, SIZE), dtype=np.float32)]
                instructions = [(p, FitIns(ndarrays_to_parameters(imprint), i.config)) for p, i in instructions]
            return instructions

        def aggregate_fit(self, server_round, results, failures):
            seen[server_round] = [parameters_to_ndarrays(fit.parameters) for _, fit in results]
            return super().aggregate_fit(server_round, results, failures)

    class Client(NumPyClient):
        def __init__(self, client: int) -> None:
            self.client = client

        def fit(self, parameters, config):
            return [parameters[0] - client_update(self.client, int(config["round"]))], 1, {}

    def client_fn(context: Context):
        return Client(int(context.node_config["partition-id"])).to_client()

    refusals = RefusalLog(tmp_path)  # the test's window into the clients

    server_app = ServerApp()

    @server_app.main()
    def main(grid, context):
        strategy = MaliciousFedAvg(
            fraction_evaluate=0.0,
            min_fit_clients=NODES,
            min_available_clients=NODES,
            initial_parameters=ndarrays_to_parameters([np.zeros(SIZE, dtype=np.float32)]),
            on_fit_config_fn=lambda server_round: {"round": server_round},
        )
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=ROUNDS), strategy=strategy)
        # max_weight = the clients' num_examples: its default 1000 would coarsen SecAgg+'s step 1000-fold
        DefaultWorkflow(fit_workflow=secaggplus_workflow(NODES, max_weight=1.0))(grid, legacy)

    mods = [secaggplus_mod, refusals, ModelChecksMod(Public()), UpdateDefenseMod(defense())]
    run_simulation(
        server_app=server_app,
        client_app=ClientApp(client_fn=client_fn, mods=mods),
        num_supernodes=NODES,
        backend_config=ONE_RAY_WORKER,
    )
    # round 1: the strategy is handed the one unmasked aggregate, NODES times, never a client's upload
    assert len(seen[1]) == NODES and all(np.array_equal(r[0], seen[1][0][0]) for r in seen[1])
    uploads = []
    for client in range(NODES):  # each client's upload as its mod made it: clipped, plus its noise share
        update = {"weight": torch.from_numpy(client_update(client, 1))}
        uploads.append(defense()(update, client)["weight"].numpy())
    received = sent[1] - seen[1][0][0]
    # SecAgg+ rounds each entry to its quantisation step (2 clipping_range / quantization_range = 16 / 2^22)
    np.testing.assert_allclose(received, np.mean(uploads, axis=0), atol=1e-4)
    assert all(np.abs(received - u).max() > 0.1 for u in uploads)
    # the shares sum to the central noise: the mean's noise has std z C / NODES (the clipped updates'
    # mean is known here); SIZE entries put the sample std within 2% of it with overwhelming probability
    clipped = [u * min(1.0, C / float(np.linalg.norm(u))) for u in (client_update(c, 1) for c in range(NODES))]
    noise = received - np.mean(clipped, axis=0)
    assert abs(float(noise.std()) / (Z * C / NODES) - 1) < 0.1
    # the digest bits were averaged with the update: every client received the initial model
    public = {"weight": torch.zeros(SIZE)}
    np.testing.assert_allclose(seen[1][0][1], digest_bits(public).numpy(), atol=1e-4)
    # round 2 went through (its model was inconsistent, which no client can see yet), round 3 did not:
    # every client read round 2's averaged digest and refused
    assert INCONSISTENT in seen and 3 not in seen
    refused = refusals.refusals(3)
    assert sorted(refused) == list(range(NODES)) and all(t.startswith("ModelInconsistency") for t in refused.values())
    # round 4: the imprint's extra block is refused by every client before it trains
    assert IMPRINT not in seen
    imprinted = refusals.refusals(IMPRINT)
    assert sorted(imprinted) == list(range(NODES)) and all(
        "architecture is not the public one" in t for t in imprinted.values()
    )
