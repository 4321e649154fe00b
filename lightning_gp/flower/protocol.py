"""What a lightning-gp client adds to its Flower reply, beside the arrays and metrics.

A train reply carries one ``ArrayRecord`` (the client's weights, Flower's convention, so Flower's
own mods such as ``fixedclipping_mod`` work on it), one ``MetricRecord`` (``num-examples`` for
FedAvg's weighting) and a ``ConfigRecord`` named :data:`REPLY_RECORD` that tells the server which
client sent it and what it did. FedAvg ignores config records, so other strategies are unaffected.
"""

from __future__ import annotations

import json
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

#: the reply's config record written by the client app and the update-defense mod
REPLY_RECORD = "lightning_gp"
CLIENT_ID = "client-id"
#: names of the arrays that are trainable parameters (the update defenses rewrite only these)
PARAMETERS = "parameters"
#: JSON list of ``{"name", "config"}`` of the update-level defenses, in the order they ran
DEFENSES = "defenses"
LOCAL_STEPS = "local-steps"
LOCAL_BATCH_SIZE = "local-batch-size"
LOCAL_LR = "local-lr"


def reply_record(content: RecordDict, *, create: bool = False) -> ConfigRecord | None:
    """The reply's :data:`REPLY_RECORD` (``None`` if absent, unless ``create``)."""
    record = content.config_records.get(REPLY_RECORD)
    if record is None and create:
        record = ConfigRecord()
        content[REPLY_RECORD] = record
    return record


def described_defenses(record: ConfigRecord | None) -> list[dict[str, Any]]:
    """The update-level defenses a reply says it went through (empty if none)."""
    if record is None or DEFENSES not in record:
        return []
    described: list[dict[str, Any]] = json.loads(str(record[DEFENSES]))
    return described


def single_array_record(msg: Message, where: str, reader: str) -> tuple[str, ArrayRecord]:
    """The one ``ArrayRecord`` (the model) of ``msg`` and its key; a clear error naming ``reader`` (the mod
    that needs it) and ``where`` otherwise."""
    records = msg.content.array_records
    if len(records) != 1:
        raise ValueError(f"{reader} expects exactly one ArrayRecord (the model) in {where}, found {len(records)}")
    return next(iter(records.items()))
