"""The ClientApp: one round of local training in a Lightning Trainer, then DGP on the update.

Gradient-level defenses (Soteria, the optimal defenses, ...) would go in ``callbacks``: they need the
client's batch, so they run inside the local Trainer. DGP defends the FedAvg update as a Flower mod,
with each client's error-feedback residual kept in the node's Context.state between rounds.
"""

from lgp_flower_example.task import client_data, model
from lightning_gp.defenses import DualGradientPruning
from lightning_gp.flower import UpdateDefenseMod, lightning_client_app

app = lightning_client_app(
    model,
    client_data,
    mods=[UpdateDefenseMod(DualGradientPruning(k1=0.05, k2=0.75, seed=0))],
    trainer_kwargs={"accelerator": "cpu"},
)
