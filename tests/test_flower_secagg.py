"""Secure aggregation on Flower: with Flower's ``secaggplus_mod`` (SecAgg+, Bell et al., CCS 2020) the
server-side strategy never receives one client's update, only the unmasked aggregate of the round."""

import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower integration is optional: pip install 'lightning-gp[flower]'")
pytest.importorskip("ray", reason="Flower's simulation engine needs ray: pip install 'lightning-gp[flower]'")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

NODES, SIZE = 3, 6


def client_update(client: int) -> np.ndarray:
    """What client ``client`` adds to the global weights this round (distinct per client)."""
    return np.random.default_rng(client).uniform(-1, 1, SIZE).astype(np.float32)


def test_the_server_tap_sees_only_the_secaggplus_aggregate():
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.simulation import run_simulation

    seen: list[list[np.ndarray]] = []

    class TappedFedAvg(FedAvg):
        """The server's tap: every reply the strategy is handed, as it is handed."""

        def aggregate_fit(self, server_round, results, failures):
            seen.extend(parameters_to_ndarrays(fit.parameters) for _, fit in results)
            return super().aggregate_fit(server_round, results, failures)

    class Client(NumPyClient):
        def __init__(self, client: int) -> None:
            self.client = client

        def fit(self, parameters, config):
            return [parameters[0] + client_update(self.client)], 1, {}

    def client_fn(context: Context):
        return Client(int(context.node_config["partition-id"])).to_client()

    server_app = ServerApp()

    @server_app.main()
    def main(grid, context):
        strategy = TappedFedAvg(
            fraction_evaluate=0.0,
            min_fit_clients=NODES,
            min_available_clients=NODES,
            initial_parameters=ndarrays_to_parameters([np.zeros(SIZE, dtype=np.float32)]),
        )
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
        DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=NODES, reconstruction_threshold=2))(grid, legacy)

    run_simulation(
        server_app=server_app,
        client_app=ClientApp(client_fn=client_fn, mods=[secaggplus_mod]),
        num_supernodes=NODES,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": NODES, "include_dashboard": False},
        },
    )
    updates = [client_update(c) for c in range(NODES)]
    mean = np.mean(updates, axis=0)
    # SecAgg+ quantises each update with stochastic rounding before masking, so the unmasked sum is the
    # mean only up to that rounding: every reply is far closer to the mean than to any client's own update
    assert len(seen) == NODES
    for received in seen:
        to_mean = np.abs(received[0] - mean).max()
        assert all(to_mean < np.abs(received[0] - u).max() / 10 for u in updates)
    assert all(np.array_equal(received[0], seen[0][0]) for received in seen)  # one aggregate, handed N times
