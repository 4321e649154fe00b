"""The clients' model checks as a Flower client mod: the digest of the received model inside the secure
aggregate, and the refusal of a model whose architecture is not the public one.

:class:`ModelChecksMod` is :mod:`lightning_gp.federated.model_integrity` on Flower (docs/guide/bounds.md,
"the digest in the aggregate"; Carletti et al., USENIX Security 2025, classes E-H of the active server).
Listed inside Flower's ``secaggplus_mod`` (SecAgg+, Bell et al., CCS 2020) and outside the update
defenses, ``ClientApp(mods=[secaggplus_mod, ModelChecksMod(model), UpdateDefenseMod(...)])``, on each
train message it:

1. refuses (raises :class:`~lightning_gp.federated.ModelRejected`, which Flower returns to the server as
   the client's error) a model whose entries, shapes or dtypes are not the public model's: Robbing the
   Fed's and LOKI's imprint blocks never reach the client's training;
2. appends the 256 bits of the received model's SHA-256 digest
   (:func:`~lightning_gp.federated.digest_bits`) to its reply as one more array, so SecAgg+ aggregates
   it with the update and the server's FedAvg averages it into the next global model;
3. next round, reads that averaged digest back from the model it receives (the last array, which it
   strips before the client app sees the model) and checks it against the bits it sent
   (:func:`~lightning_gp.federated.consistent_digest_mean`): if any client of the previous round
   received another model (LOKI's per-client models, Fishing's per-client variants), the check fails
   and the client refuses the round (:class:`ModelInconsistency`).

What it cannot do, as the checks themselves (docs/guide/bounds.md): it detects a round of model
inconsistency after the server has that round's aggregate; it reads the averaged digest from the server,
so a server that tells each client its own average (equivocation) defeats it unless the clients compare
what they received; a client checks only a round it took part in (``metadata.group_id``, Flower's server
round, tells them apart); it refuses the round and does not remember it (Flower keeps no
``Context.state`` from a ClientApp that raises): acting on a refusal is the deployment's
(:class:`RefusalLog` writes each one down). On Flower's FedAvg the aggregate reaches the clients only as
the next model, so the value replay of the public record (:class:`~lightning_gp.federated.ModelProvenance`) has no aggregate
of its own to replay and is not run here: a same-architecture model (Fishing's rewritten last layer) sent
identically to every client passes this mod.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.server.workflow import SecAggPlusWorkflow
from torch import Tensor, nn

from lightning_gp.federated.model_integrity import (
    DIGEST_BITS,
    ModelRejected,
    check_architecture,
    consistent_digest_mean,
    digest_bits,
)
from lightning_gp.flower import protocol
from lightning_gp.flower.state import client_record, partition_id
from lightning_gp.validation import check_nonnegative, check_positive

#: the node's Context.state record of the model checks
STATE_RECORD = "lightning_gp.model_checks"
#: the name of the digest entry in a reply whose arrays are named (Flower's message API); a reply of
#: the legacy API names its arrays by position, and the digest is the next one
DIGEST_KEY = "lightning_gp.model-digest"
_OWN_BITS, _ROUND = "own-digest-bits", "round"


class ModelInconsistency(ModelRejected):
    """The averaged digest of the previous round says not every client received the same model."""


class ModelChecksMod:
    """A Flower client mod that refuses models of another architecture and puts the received model's
    digest into the secure aggregate (module docstring: what it stops and what it cannot).

    Args:
        public_model: the public model (its state dict's entries, in order, with their shapes and
            dtypes, are the architecture every model the server sends must have; the legacy API's
            positional arrays are read in this order).
        atol: how far an averaged digest position may stand from the client's own bit
            (:func:`~lightning_gp.federated.consistent_digest_mean`; below the smallest client's
            share of the round's weighting, above SecAgg+'s quantisation step).
        client_id: the client id of a node from its ``Context`` (default ``node_config["partition-id"]``).
    """

    def __init__(
        self, public_model: nn.Module, *, atol: float = 1e-4, client_id: Callable[[Context], int] = partition_id
    ) -> None:
        if not isinstance(public_model, nn.Module):
            raise TypeError(f"public_model must be an nn.Module, got {type(public_model).__name__}")
        self.architecture = {n: t.detach().cpu() for n, t in public_model.state_dict().items()}
        if not self.architecture:
            raise ValueError("public_model has no state: there is no architecture to check models against")
        self.atol = check_nonnegative(atol, "atol")
        self.client_id = client_id

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        kind = msg.metadata.message_type.split(".")[0]
        if kind not in (MessageType.TRAIN, MessageType.EVALUATE):
            return call_next(msg, context)
        key, arrays = _single_array_record(msg, "the message")
        keys, model, digest_mean = self._split(arrays)
        msg.content[key] = ArrayRecord({k: Array(v.numpy()) for k, v in zip(keys, model.values())})
        if kind != MessageType.TRAIN:
            return call_next(msg, context)
        record = client_record(context, STATE_RECORD, self.client_id(context))
        current = _server_round(msg)
        self._check_previous_round(record, digest_mean, current)
        own = digest_bits(model)
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        reply_key, returned = _single_array_record(reply, "the ClientApp's reply")
        entries = dict(returned.items())
        positional = all(k.isdigit() for k in entries)
        entries[str(len(entries)) if positional else DIGEST_KEY] = Array(own.numpy())
        reply.content[reply_key] = ArrayRecord(entries)
        record[_OWN_BITS] = own.numpy().astype(np.uint8).tobytes()
        record[_ROUND] = -1 if current is None else current
        return reply

    def _split(self, arrays: ArrayRecord) -> tuple[list[str], dict[str, Tensor], Tensor | None]:
        """The model's array keys, the model as a state dict under the public names (checked against the
        public architecture, floating arrays in the public model's precision) and the averaged digest, if
        any."""
        entries = dict(arrays.items())
        count = len(self.architecture)
        if all(k.isdigit() for k in entries) and len(entries) not in (count, count + 1):
            raise ModelRejected(
                f"the model's architecture is not the public one: {len(entries)} arrays, the public model has "
                f"{count} (and the averaged digest after a round)"
            )
        digest_mean = None
        if len(entries) == count + 1:
            last = list(entries)[-1]
            digest = torch.from_numpy(entries.pop(last).numpy().copy())
            if digest.shape != (DIGEST_BITS,):
                raise ModelRejected(
                    f"the model carries an extra entry {last!r} of shape {tuple(digest.shape)}, not the "
                    f"({DIGEST_BITS},) averaged digest: its architecture is not the public one"
                )
            digest_mean = digest
        named = self._named(entries)
        check_architecture(self.architecture, named)
        return list(entries), named, digest_mean

    def _named(self, entries: dict[str, Array]) -> dict[str, Tensor]:
        """The arrays as a state dict under the public model's names (positional arrays in order). A
        floating array comes in the public entry's precision: SecAgg+ dequantises the aggregate to
        float64, so the next global model arrives in float64 whatever the clients sent."""
        keys = list(entries)
        values = [torch.from_numpy(entries[k].numpy().copy()) for k in keys]
        if all(k.isdigit() for k in keys) and len(keys) == len(self.architecture):
            keys = list(self.architecture)
        named = dict(zip(keys, values))
        for name, want in self.architecture.items():
            have = named.get(name)
            if have is not None and have.dtype != want.dtype and have.is_floating_point() and want.is_floating_point():
                named[name] = have.to(want.dtype)
        return named

    def _check_previous_round(self, record: ConfigRecord, digest_mean: Tensor | None, current: int | None) -> None:
        raw = record.get(_OWN_BITS)
        if raw is None:
            return  # the client's first round: it sent no digest yet
        previous = int(cast(int, record[_ROUND]))
        if current is not None and previous >= 0 and previous != current - 1:
            return  # it sat out the previous round: the average is of other clients' digests
        if digest_mean is None:
            raise ModelInconsistency(
                "the model carries no averaged digest of the previous round, in which this client sent its "
                "digest into the secure aggregate: the server dropped it"
            )
        own = torch.from_numpy(np.frombuffer(cast(bytes, raw), dtype=np.uint8).astype(np.float32))
        if not consistent_digest_mean(digest_mean, own, atol=self.atol):
            worst = float((digest_mean.double() - own.double()).abs().max())
            raise ModelInconsistency(
                "the previous round's averaged model digest differs from the digest of the model this client "
                f"received (largest gap {worst:.3g} > atol {self.atol}): not every client received the same model"
            )


class RefusalLog:
    """A client mod, listed just outside :class:`ModelChecksMod`, that writes each refusal of the checks
    (:class:`~lightning_gp.federated.ModelRejected`, :class:`ModelInconsistency` included) to
    ``directory/round{r}_client{c}.txt`` and lets it propagate: the clients' record of which rounds they
    refused and why (the server gets only Flower's error reply). :meth:`refusals` reads it back."""

    def __init__(self, directory: str | Path, *, client_id: Callable[[Context], int] = partition_id) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.client_id = client_id

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        try:
            return call_next(msg, context)
        except ModelRejected as err:
            path = self.directory / f"round{msg.metadata.group_id}_client{self.client_id(context)}.txt"
            path.write_text(f"{type(err).__name__}: {err}")
            raise

    def refusals(self, server_round: int) -> dict[int, str]:
        """Client id -> ``"<exception class>: <reason>"`` of every client that refused ``server_round``."""
        found = self.directory.glob(f"round{server_round}_client*.txt")
        return {int(p.stem.rsplit("client", 1)[1]): p.read_text() for p in sorted(found)}


def secaggplus_workflow(clients: int, max_weight: float) -> SecAggPlusWorkflow:
    """Flower's SecAgg+ workflow for rounds of ``clients`` clients: an odd number of shares (at most 5) and
    a majority of them to reconstruct. ``max_weight``: the clients' ``num_examples``. SecAgg+ scales each
    upload by ``num_examples / max_weight`` before it quantises, so a larger one coarsens the rounding
    (its default 1000 rounds one-example uploads to 3.8e-3, above :class:`ModelChecksMod`'s tolerance)."""
    if isinstance(clients, bool) or not isinstance(clients, int) or clients < 3:
        raise ValueError(f"clients must be an int of at least 3 (SecAgg+ needs 3 shares), got {clients!r}")
    shares = min(clients - (clients + 1) % 2, 5)
    return SecAggPlusWorkflow(
        num_shares=shares,
        reconstruction_threshold=shares // 2 + 1,
        max_weight=check_positive(max_weight, "max_weight"),
    )


def _server_round(msg: Message) -> int | None:
    group = msg.metadata.group_id
    return int(group) if group.isdigit() else None


def _single_array_record(msg: Message, where: str) -> tuple[str, ArrayRecord]:
    return protocol.single_array_record(msg, where, "ModelChecksMod")
