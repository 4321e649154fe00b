"""Update-level defenses as a Flower client mod (docs/architecture.md, "Flow 1"; here on Flower).

The FedAvg update a client shares is ``w_global - w_local`` after its local training. Pruning,
quantisation and noise of that update are pure transforms of it, so they run as a Flower mod
around the ClientApp: the mod sees the global weights in the incoming message and the local
weights in the reply, defends the update with the client's own state, and replaces the reply's
weights by ``w_global - defended_update``. The reply keeps Flower's weights convention, so the
mod composes with Flower's own mods (``fixedclipping_mod``, ``secaggplus_mod``, ...): mods listed
earlier in ``ClientApp(mods=[...])`` wrap later ones, so a mod listed before this one sees the
defended weights.

Defenses that need the client's raw batch or model (Soteria, the optimal defenses, GradDefense's
sensitivity, Outpost's weight spread) are gradient-level: they run as Trainer callbacks inside the
client's local training instead (:func:`~lightning_gp.flower.lightning_client_app`'s ``callbacks``).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE, Key
from torch import Tensor

from lightning_gp.callbacks.base import GradientDefense
from lightning_gp.defenses.base import Defense
from lightning_gp.flower import protocol
from lightning_gp.flower.state import client_record, load_state, partition_id, save_state

#: the node's Context.state record of the update-level defenses
STATE_RECORD = "lightning_gp.update_defenses"


def update_level_defense(defense: Defense | GradientDefense) -> Defense:
    """The pure defense of ``defense`` if it can run on a FedAvg update alone; a clear error otherwise."""
    if isinstance(defense, GradientDefense):
        if defense.reads_client_data:
            raise ValueError(
                f"{type(defense).__name__} reads the client's raw batch to defend a gradient, which an update-level "
                "mod never sees: it must run as a Trainer callback inside the client "
                "(lightning_client_app(..., callbacks=lambda context: [...]))"
            )
        defense = defense.defense
    if not isinstance(defense, Defense):
        raise TypeError(
            f"update defenses must be lightning_gp.defenses.Defense objects (or their callbacks), got "
            f"{type(defense).__name__}"
        )
    extra = [] if type(defense).prepare is Defense.prepare else list(inspect.signature(defense.prepare).parameters)[1:]
    if extra:
        raise ValueError(
            f"{type(defense).__name__} needs {', '.join(extra)} computed from the client's batch or model besides the "
            "update, which an update-level mod does not have: it must run as a Trainer callback inside the client "
            f"(lightning_gp.callbacks.{type(defense).__name__} in lightning_client_app(..., callbacks=...))"
        )
    if type(defense).begin_round is not Defense.begin_round:
        raise ValueError(
            f"{type(defense).__name__} coordinates the clients of a round (begin_round), which independent Flower "
            "clients cannot do in a mod; use a per-client defense (e.g. DualGradientPruning)"
        )
    return defense


class UpdateDefenseMod:
    """A Flower client mod that defends the FedAvg update ``w_global - w_local`` before it leaves.

    ``ClientApp(mods=[UpdateDefenseMod(DualGradientPruning(seed=0))])``: the defenses run in the
    order given, each with this client's state, restored from and saved to the node's
    ``Context.state`` every round (error-feedback residuals, random streams). Client ``c`` draws
    from the stream ``(seed, c)``, as in :class:`~lightning_gp.federated.FederatedSimulation`, so
    give the defenses an explicit ``seed``. Only trainable parameters are defended (the names the
    client app lists in its reply; without that list, every floating-point array); buffers pass
    through. Train messages only; evaluate and query messages pass through untouched. Inside Flower's
    ``secaggplus_mod``, each defense is checked against the clients the round's secure sum takes
    (:meth:`~lightning_gp.defenses.Defense.check_cohort` with :func:`secure_aggregation_size`): a
    :class:`~lightning_gp.defenses.DistributedGaussianMechanism` whose ``cohort_size`` exceeds them is
    refused before the client trains.

    Args:
        defenses: :class:`~lightning_gp.defenses.Defense` objects or their callbacks (pruning,
            quantisation, noise). Data-dependent defenses are refused (see the module docstring).
        client_id: the client id of a node from its ``Context`` (default:
            ``node_config["partition-id"]``); it must stay the same for a node across rounds.
    """

    def __init__(
        self, *defenses: Defense | GradientDefense, client_id: Callable[[Context], int] = partition_id
    ) -> None:
        if not defenses:
            raise ValueError("UpdateDefenseMod needs at least one defense")
        self.defenses = [update_level_defense(d) for d in defenses]
        self.client_id = client_id

    def describe(self) -> list[dict[str, Any]]:
        """Each defense's class name and configuration, as recorded in the reply and the tap."""
        return [{"name": type(d).__name__, "config": d.config()} for d in self.defenses]

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:
            return call_next(msg, context)
        cohort = secure_aggregation_size(context)
        if cohort is not None:  # e.g. a distributed mechanism's noise shares need this many uploads in the sum
            for defense in self.defenses:
                defense.check_cohort(cohort)
        client = self.client_id(context)
        record = client_record(context, STATE_RECORD, client)  # refuses a node that changed client id
        sent = _single_array_record(msg, "the train message")[1]
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        key, returned = _single_array_record(reply, "the ClientApp's reply")
        if list(returned.keys()) != list(sent.keys()):
            raise ValueError(
                "the ClientApp's reply names other arrays than the global model it received "
                f"(sent {list(sent.keys())[:5]}..., returned {list(returned.keys())[:5]}...)"
            )
        info = protocol.reply_record(reply.content, create=True)
        assert info is not None
        names = _defended_names(info, returned)
        global_weights = {n: torch.from_numpy(sent[n].numpy()) for n in names}
        update = {n: global_weights[n] - torch.from_numpy(returned[n].numpy()) for n in names}
        for i, defense in enumerate(self.defenses):
            update = _defend(defense, update, client, record, f"{i}.{type(defense).__name__}")
        defended = {n: Array(np.asarray((global_weights[n] - update[n]).numpy())) for n in names}
        reply.content[key] = ArrayRecord({n: defended.get(n, array) for n, array in returned.items()})
        info[protocol.CLIENT_ID] = client
        info[protocol.DEFENSES] = json.dumps(protocol.described_defenses(info) + self.describe())
        return reply


def secure_aggregation_size(context: Context) -> int | None:
    """The clients whose uploads this round's SecAgg+ sum takes (its setup stage's ``sample_num``), read
    from the state Flower's ``secaggplus_mod`` keeps in the node's ``Context``; ``None`` where no SecAgg+
    mod runs around this one. Clients that drop out after the setup leave fewer uploads in the sum: the
    sampled number is the most it can hold."""
    state = context.state.config_records.get(RECORD_KEY_STATE)
    sampled = None if state is None else state.get(Key.SAMPLE_NUMBER)
    return int(sampled) if isinstance(sampled, int) and sampled > 0 else None


def _defend(defense: Defense, update: dict[str, Tensor], client: int, record: Any, key: str) -> dict[str, Tensor]:
    """``defense(update, client)`` with the client's state restored from the node's record, then saved."""
    saved = load_state(record, key)
    defense.reset()
    if saved is not None:
        defense.load_state_dict(saved)
    defended = defense(update, client)
    save_state(record, key, defense.state_dict())
    defense.reset()  # the object may serve another node next; its state lives in that node's record
    return defended


def _single_array_record(msg: Message, where: str) -> tuple[str, ArrayRecord]:
    return protocol.single_array_record(msg, where, "UpdateDefenseMod")


def _defended_names(info: Any, arrays: ArrayRecord) -> Sequence[str]:
    """The trainable parameters the client app listed, else every floating-point array."""
    if protocol.PARAMETERS in info:
        names = [str(n) for n in info[protocol.PARAMETERS]]
        missing = [n for n in names if n not in arrays]
        if missing:
            raise ValueError(f"the reply lists parameters {missing[:5]} that its ArrayRecord does not hold")
        return names
    # the legacy API's arrays carry no dtype of their own (an .npy payload): read it from the array there
    return [n for n, a in arrays.items() if (np.dtype(a.dtype) if a.dtype else a.numpy().dtype).kind == "f"]
