"""Per-client state that must outlive a round: kept in Flower's ``Context.state``.

Flower rebuilds client objects every round (and in the simulation engine a node may run in a
different worker process each round), so a defense's error-feedback residuals and random
streams cannot live in the defense object. They live in the node's ``Context.state``, the
record Flower keeps for each node across rounds; we store each stateful object's own
``state_dict()`` there (the same dict a Lightning checkpoint holds) and restore it with
``load_state_dict()`` before the object is used again. ``Context.state`` never leaves the node.
"""

from __future__ import annotations

import io
from typing import Any, cast

import torch
from flwr.app import ConfigRecord, Context

#: key of the client id in every state record (to detect a node that changes identity)
CLIENT_ID_KEY = "client-id"


def client_record(context: Context, name: str, client_id: int) -> ConfigRecord:
    """The node's state record ``name``, created on the client's first round.

    Raises if the record was written for another client: the state of one client must never be
    applied to another's update (a node whose ``partition-id`` changed between rounds, or a
    ``client_id`` function that is not stable).
    """
    record = context.state.config_records.get(name)
    if record is None:
        record = ConfigRecord({CLIENT_ID_KEY: int(client_id)})
        context.state[name] = record
        return record
    stored = int(cast(int, record[CLIENT_ID_KEY]))  # always written as an int
    if stored != client_id:
        raise ValueError(
            f"mismatched client ids between rounds: node {context.node_id} holds the defense state of client {stored} "
            f"but now runs as client {client_id}. The client id (node_config['partition-id'] by default) must stay "
            "the same for a node across rounds, or error-feedback residuals and random streams would move between "
            "clients"
        )
    return record


def save_state(record: ConfigRecord, key: str, state_dict: dict[str, Any]) -> None:
    """Store ``state_dict`` (tensors and plain containers) under ``key`` as serialized bytes."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    record[key] = buffer.getvalue()


def load_state(record: ConfigRecord, key: str) -> dict[str, Any] | None:
    """The state dict stored under ``key`` (``None`` before the first save), loaded without
    unpickling code (``weights_only=True``)."""
    data = record.get(key)
    if data is None:
        return None
    if not isinstance(data, bytes):
        raise TypeError(f"Context.state holds a {type(data).__name__} under {key!r}, not a saved state dict")
    state: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return state


def partition_id(context: Context) -> int:
    """The client id of a node: ``node_config["partition-id"]`` (the simulation engine sets it; a
    SuperNode gets it from ``--node-config "partition-id=0 num-partitions=2"``)."""
    value = context.node_config.get("partition-id")
    if value is None:
        raise ValueError(
            f"node {context.node_id} has no 'partition-id' in its node_config, so it has no client id: start the "
            'SuperNode with --node-config "partition-id=<i> num-partitions=<n>" or pass client_id=<function of the '
            "Context> to the client app and the mod"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"node_config['partition-id'] must be a non-negative int, got {value!r}")
    return int(value)
