"""Model inconsistency through secure aggregation (LOKI, Zhao et al., "LOKI: Large-scale Data
Reconstruction Attack against Federated Learning through Model Manipulation", IEEE S&P 2024).

Secure aggregation (Bonawitz et al., CCS 2017) shows the server only the sum of the clients'
updates. A malicious server defeats it by sending each client a *different* model of one
architecture: an imprint block (Robbing the Fed's, :class:`~lightning_gp.attacks.ImprintBlock`) of
``N x K`` units, of which client ``c``'s copy keeps only the ``K`` units of its own slice alive (the
other slices have zero weights and a bias no measurement reaches, so their ReLUs never fire and their
gradient rows stay exactly zero). Parameters of one name add up under aggregation, so the rows of
slice ``c`` in the sum carry client ``c``'s gradient alone (divided by ``N`` in a mean, which the
ratio of weight to bias rows cancels): Robbing the Fed's read-out per slice recovers every client's
images from the aggregate, as if there were no aggregation (LOKI's Sec. 4; its convolutional
scaling of the imprint to large inputs is not reproduced: the imprint here is fully connected).

The attack is the SoK's class G (an active, data-enhanced manipulator, Carletti et al. 2025). It is
visible to any client that compares its model with the others' (the digest of the received model in
the secure aggregate, and the replay of the public record:
:mod:`lightning_gp.federated.model_integrity`): the inconsistency is the attack.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.attacks.base import AttackNotApplicable, Reconstruction
from lightning_gp.attacks.registry import register_attack
from lightning_gp.attacks.robbing_the_fed import (
    SECRETS_KEY,
    ImprintBlock,
    ImprintedModel,
    RobbingTheFed,
    _imprint_gradients,
    bin_gradients,
    select_bins,
)
from lightning_gp.attacks.view import ServerView
from lightning_gp.validation import check_positive_int

#: What the secrets of one client's model say of its structure (read by :meth:`LOKI.reconstruct`).
STRUCTURE = "client_slices"
#: A bias no measurement of a valid input reaches: the unit of another client's slice never fires.
_SILENT_BIAS = -1e6


@register_attack(  # active: each client gets its own model; it attacks the secure aggregate
    "LOKI",
    order=9,
    build=lambda budget, seed, model: LOKI(num_bins=budget.rtf_bins, seed=seed),
)
class LOKI(RobbingTheFed):
    """Robbing the Fed's imprint, one slice of ``num_bins`` units per client, each client sent a model
    with only its own slice alive: the secure aggregate separates by slice (module docstring).

    Use: ``attack.client_models(model, clients, input_shape, mean, std, public_data=...)`` gives one
    ``(model, secrets)`` per client (the secrets are the same for every client); the clients train
    their own models; ``attack.reconstruct(view)`` on the aggregate of their updates (a view whose
    batch is every client's images, ``server_secrets`` the secrets) returns ``clients x B`` images, client
    by client. :meth:`modify_model` (one model for every client, as the audit's per-client view sends)
    is refused: without the inconsistency the attack is Robbing the Fed, which the audit runs already.

    Args: as :class:`~lightning_gp.attacks.RobbingTheFed`; ``num_bins`` is per client.
    """

    def modify_model(self, model: nn.Module, input_shape: Sequence[int], *args: Any, **kwargs: Any) -> Any:
        raise AttackNotApplicable(
            "LOKI sends each client its own model and attacks the secure aggregate of their updates "
            "(audit_setting(aggregate=True)); one model for every client is Robbing the Fed's attack"
        )

    def client_models(
        self,
        model: nn.Module,
        clients: int,
        input_shape: Sequence[int],
        mean: Sequence[float] = (0.0,),
        std: Sequence[float] = (1.0,),
        *,
        public_data: Tensor | None = None,
        measurement_stats: tuple[float, float] = (0.0, 1.0),
    ) -> list[tuple[ImprintedModel, dict[str, Any]]]:
        """One model per client, identical but for which slice of the imprint units is alive, and
        the server's secrets (the same for every client)."""
        check_positive_int(clients, "clients")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        block = self.imprint_block(input_shape, mean, std, public_data=public_data, measurement_stats=measurement_stats)
        template = next(model.parameters(), None)
        models = []
        for client in range(clients):
            imprint = _sliced(block, clients, client)
            if template is not None:
                imprint = imprint.to(device=template.device, dtype=template.dtype)
            models.append(ImprintedModel(imprint, copy.deepcopy(model)))
        secrets = {
            SECRETS_KEY: {
                "weight": "imprint.linear0.weight",
                "bias": "imprint.linear0.bias",
                "bins": block.bins,
                "input_shape": block.input_shape,
                "measurement": block.measurement,
                "structure": STRUCTURE,
                "clients": clients,
            }
        }
        return [(m, secrets) for m in models]

    def reconstruct(self, view: ServerView) -> Reconstruction:
        """Robbing the Fed's read-out (Sec. 3 of Fowl et al.) on each client's slice of the aggregate."""
        view, _ = self._prepare(view)
        secrets = view.server_secrets.get(SECRETS_KEY, {})
        if secrets.get("structure") != STRUCTURE:
            raise AttackNotApplicable("LOKI reads an aggregate of the client models it sent (client_models)")
        clients = int(secrets["clients"])
        if view.batch_size % clients:
            raise AttackNotApplicable(f"the aggregate's {view.batch_size} images do not split over {clients} clients")
        weight_grad, bias_grad = _imprint_gradients(view)
        per_client, slots = view.batch_size // clients, self.num_bins
        low, high = view.data_bounds()
        images, chosen_bins = [], []
        for client in range(clients):
            rows = slice(client * slots, (client + 1) * slots)
            weight_diff, bias_diff = bin_gradients(weight_grad[rows].double(), bias_grad[rows].double())
            chosen = select_bins(bias_diff, per_client, self.rel_threshold)
            found = (weight_diff[chosen] / bias_diff[chosen, None]).to(weight_grad.dtype)
            found = found.reshape(-1, *view.input_shape)
            found = torch.max(torch.min(found, high.to(found.dtype)), low.to(found.dtype))
            missing = per_client - found.shape[0]  # collisions: the rest are zeros (the data mean)
            images.append(torch.cat([found, found.new_zeros(missing, *view.input_shape)]))
            chosen_bins.append(chosen.tolist())
        return Reconstruction(
            images=torch.cat(images).detach(),
            labels=None,
            attack="LOKI",
            meta={"clients": clients, "bins": chosen_bins, "num_recovered": sum(len(c) for c in chosen_bins)},
        )


def _sliced(block: ImprintBlock, clients: int, client: int) -> ImprintBlock:
    """``block`` widened to ``clients`` slices of its units, only slice ``client`` alive."""
    units, dim = block.num_bins, math.prod(block.input_shape)
    out = copy.deepcopy(block)
    first, second = nn.Linear(dim, clients * units), nn.Linear(clients * units, dim)
    with torch.no_grad():
        first.weight.zero_()
        first.bias.fill_(_SILENT_BIAS)
        mine = slice(client * units, (client + 1) * units)
        first.weight[mine] = block.linear0.weight
        first.bias[mine] = block.linear0.bias
        second.weight.copy_(block.linear1.weight.repeat(1, clients))  # a dead unit's column adds nothing
        second.bias.copy_(block.linear1.bias)
    out.linear0, out.linear1, out.num_bins = first, second, clients * units
    return out
