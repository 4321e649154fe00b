"""Flower integration: defend and audit real federated deployments with the same defense objects.

* :func:`lightning_client_app`: a ``ClientApp`` that trains a user's LightningModule for one round
  in a ``Trainer`` (gradient-level defense callbacks inside it);
* :class:`UpdateDefenseMod`: update-level defenses (pruning, quantisation, noise of the FedAvg
  update) as a Flower client mod;
* :class:`ModelChecksMod`: the clients' model checks (the received model's digest in the secure
  aggregate, the public architecture) as a Flower client mod, inside ``secaggplus_mod``
  (:func:`secaggplus_workflow` on the server), :class:`RefusalLog` to write the refusals down;
* :class:`TappedStrategy`: wraps a server strategy, taps every client's update for the attacks and
  audits (:class:`~lightning_gp.records.TappedGradient`) and counts bytes;
* :class:`ClientLevelDPStrategy`: client-level DP (DP-FedAvg) with Flower's fixed-clipping
  wrappers, epsilon per round and a budget stop;
* :class:`FederatedData`: each client's data per round exactly as the in-process
  :class:`~lightning_gp.federated.FederatedSimulation` draws it.

Per-client state lives in Flower's ``Context.state`` (:mod:`lightning_gp.flower.state`). Needs the
optional extra: ``pip install "lightning-gp[flower]"``.
"""

try:
    import flwr  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lightning_gp.flower needs Flower, which is not installed: pip install 'lightning-gp[flower]'"
    ) from err

from lightning_gp.flower.client import ClientData, FederatedData, lightning_client_app
from lightning_gp.flower.client_dp import ClientLevelDPStrategy
from lightning_gp.flower.model_checks import ModelChecksMod, ModelInconsistency, RefusalLog, secaggplus_workflow
from lightning_gp.flower.mods import UpdateDefenseMod, update_level_defense
from lightning_gp.flower.server import ClientTraffic, TappedStrategy, lightning_server_app
from lightning_gp.flower.state import partition_id

__all__ = [
    "ClientData",
    "ClientLevelDPStrategy",
    "ClientTraffic",
    "FederatedData",
    "ModelChecksMod",
    "ModelInconsistency",
    "RefusalLog",
    "TappedStrategy",
    "UpdateDefenseMod",
    "lightning_client_app",
    "lightning_server_app",
    "partition_id",
    "secaggplus_workflow",
    "update_level_defense",
]
