"""The ServerApp: FedAvg wrapped in a tap that saves what every client sent and counts the bytes."""

from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from lgp_flower_example.task import audit_data, model, settings
from lightning_gp.flower import TappedStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = settings(context)
    torch.manual_seed(int(config["seed"]))
    initial = model(context)
    tap_dir = Path(str(config["tap-dir"])).expanduser()
    num_clients = int(config["num-clients"])
    strategy = TappedStrategy(
        FedAvg(fraction_evaluate=0.0, min_train_nodes=num_clients, min_available_nodes=num_clients),
        initial,
        dirpath=str(tap_dir),
        # an audit: keep each client's batch with its record so attacks can be scored
        batches=audit_data(context, num_clients).batch,
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(initial.state_dict()),
        num_rounds=int(config["num-server-rounds"]),
    )
    upload, encoded = strategy.total_upload_bytes, strategy.total_update_encoded_bytes
    print(f"tapped {len(strategy.records)} client updates into {tap_dir}")
    print(f"uploaded {upload} bytes of weights; the pruned updates would encode in {encoded} bytes")
