"""Run the example's ServerApp and ClientApps on Flower's simulation engine, in this process.

``make flower-example`` (from the repository root) runs this file. Unlike ``flwr run .``, which
hands the run to a background SuperLink and returns at once, this waits for the run to end and
exits non-zero, with the error, when it fails or when the server's tap did not receive every
client's update of every round. The settings are the ``[tool.flwr.app.config]`` of pyproject.toml.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the example package, from a checkout

from flwr.simulation import run_simulation
from lgp_flower_example import client_app, server_app
from lgp_flower_example.task import default_settings


def main() -> int:
    config = default_settings()
    clients, rounds = int(config["num-clients"]), int(config["num-server-rounds"])
    tap_dir = Path(str(config["tap-dir"])).expanduser()
    before = set(tap_dir.glob("round*_client*.pt")) if tap_dir.exists() else set()
    started = tempfile.TemporaryDirectory()  # ray writes its session files here, not into the checkout
    print(f"Flower simulation: {clients} clients x {rounds} rounds of FedAvg with DGP; taps in {tap_dir}", flush=True)
    run_simulation(
        server_app=server_app.app,
        client_app=client_app.app,
        num_supernodes=clients,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": clients, "include_dashboard": False, "_temp_dir": started.name},
        },
    )
    written = {tap_dir / f"round{r}_client{c}.pt" for r in range(rounds) for c in range(clients)}
    missing = sorted(str(p) for p in written if not p.is_file())
    if missing:
        print(f"error: the run ended without every client's update: missing {missing}", file=sys.stderr)
        return 1
    fresh = len(written - before)
    print(f"ok: {len(written)} tapped updates in {tap_dir} ({fresh} new); attack one with the command in README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
