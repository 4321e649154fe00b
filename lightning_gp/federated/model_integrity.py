"""Client-side checks that make a malicious server's model manipulation visible (the active attacks of
the SoK's classes E-H, Carletti et al., USENIX Security 2025): with them the active case reduces to the
passive one, for the attacks each check stops and under the assumption each check states.

**1. Model consistency through the secure aggregate** (:func:`digest_bits`, :func:`consistent_digest_sum`).
Every client appends the 256 bits of the SHA-256 digest of the model it received (:func:`model_digest`:
every entry of its state dict, names, dtypes and shapes included) to the vector it sends into secure
aggregation (Bonawitz et al., CCS 2017). Summed over ``K`` clients each bit position is ``K`` or ``0``
exactly when every client received the same model; a client checks that the sum is ``K`` times its own
bits. Model inconsistency is what LOKI (Zhao et al., S&P 2024: each client its own slice of imprint
units, :class:`~lightning_gp.attacks.LOKI`) and the per-client variants of Fishing (Wen et al., ICML
2022) need to separate one client inside the sum; a differing model flips about half of the 256 bits,
so every client sees it.

- *What it stops:* a round in which some clients received another model than the rest, once the
  clients act on it (leave, report the server).
- *What it cannot stop:* the round itself. The sum is the server's to compute, so the check runs after
  the server holds the aggregate that LOKI reads: it detects, it does not prevent. A server that can
  tell each client its own sum (equivocation: it knows each digest, it chose each model) defeats it;
  the check needs the sum on a channel every client reads alike (a public log, or clients comparing it).
  A model sent identically to every client (Robbing the Fed, Fishing's class or feature fishing with
  one model) passes it: check 2 is for those.

**2. Model provenance** (:class:`ModelProvenance`). A client accepts a model only if it is the public
initial model advanced by the server's public update rule over the public aggregates of the rounds
since (FedSGD and FedAvg alike: the server's optimizer step on the aggregate, replayed by the client),
architecture included.

- *What it stops:* any model the aggregates do not explain, in every round, the first included when
  the initial model is public (e.g. a published seed): Robbing the Fed's and LOKI's imprint blocks
  (another architecture), Fishing's rewritten last-layer weights, SEER's trained decoder; LOKI's
  per-client models too (at most one of them can be the replayed model).
- *What it cannot stop:* what enters through the aggregate itself. Clients the server controls (Sybils)
  can submit updates that move the model wherever their share of the mean allows; clipping each update
  bounds that move, it does not rule it out. It also needs the aggregates on a channel every client
  reads alike, as check 1.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gp.validation import check_nonnegative, check_positive_int

#: Bits of the digest each client appends to its securely aggregated vector (SHA-256).
DIGEST_BITS = 256

ServerOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ModelRejected(ValueError):
    """A client refuses the model it received: it is not the model the public record explains."""


def _state(model: nn.Module | Mapping[str, Tensor], argument: str) -> dict[str, Tensor]:
    if isinstance(model, nn.Module):
        return dict(model.state_dict())
    if isinstance(model, Mapping) and all(isinstance(v, Tensor) for v in model.values()):
        return dict(model)
    raise TypeError(f"{argument} must be an nn.Module or a mapping of names to tensors, got {type(model).__name__}")


def model_digest(model: nn.Module | Mapping[str, Tensor]) -> bytes:
    """The SHA-256 digest of a model's state (every entry in state-dict order: its name, dtype, shape
    and bytes): equal for equal models, different for any other architecture or any changed value."""
    digest = hashlib.sha256()
    for name, tensor in _state(model, "model").items():
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.digest()


def digest_bits(model: nn.Module | Mapping[str, Tensor]) -> Tensor:
    """``[DIGEST_BITS]`` float32 zeros and ones: :func:`model_digest` as the entries a client appends to
    its securely aggregated vector (exact under summation in float32 for up to 2^24 clients)."""
    raw = torch.frombuffer(bytearray(model_digest(model)), dtype=torch.uint8).to(torch.int64)
    shifts = torch.arange(7, -1, -1, dtype=torch.int64)
    return ((raw[:, None] >> shifts) & 1).reshape(-1).to(torch.float32)


def consistent_digest_sum(digest_sum: Tensor, clients: int, own: Tensor) -> bool:
    """Whether the secure aggregate's digest entries ``digest_sum`` (the sum of ``clients`` clients'
    :func:`digest_bits`) say every client received the model whose bits are ``own``: each position is
    ``clients`` where ``own`` is 1 and 0 where it is 0. A bit of ``K`` values in {0, 1} sums to ``K``
    only if all are 1 and to 0 only if all are 0, so one client with another model breaks it at every
    position where its bits differ."""
    clients = check_positive_int(clients, "clients")
    _check_digest_pair(digest_sum, own, "digest_sum")
    return bool(torch.equal(digest_sum.to(torch.float64), clients * own.to(torch.float64)))


def consistent_digest_mean(digest_mean: Tensor, own: Tensor, *, atol: float = 1e-4) -> bool:
    """Whether a weighted mean of clients' :func:`digest_bits` (FedAvg's aggregate of the digest entries,
    e.g. behind Flower's SecAgg+) says every client of the round received the model whose bits are
    ``own``: each position within ``atol`` of ``own``'s bit. One client with another model moves every
    position where its bits differ by its weight's share of the round (``1 / K`` for ``K`` equally
    weighted clients), so ``atol`` must stay below the smallest client's share and above the
    aggregation's rounding. SecAgg+ (Flower's ``SecAggPlusWorkflow``) scales each upload by
    ``num_examples / max_weight`` and rounds it to steps of ``2 clipping_range / quantization_range``,
    so the mean is off by up to ``2 clipping_range max_weight / (quantization_range num_examples)``:
    ``3.8e-6`` with ``max_weight`` equal to the clients' ``num_examples``, but ``3.8e-3`` at its default
    ``max_weight = 1000`` with one example each. The default ``1e-4`` serves rounds of up to 5,000
    equally weighted clients with ``max_weight`` set to their ``num_examples``."""
    atol = check_nonnegative(atol, "atol")
    _check_digest_pair(digest_mean, own, "digest_mean")
    gap = (digest_mean.to(torch.float64) - own.to(torch.float64)).abs()
    return bool((gap <= atol).all())


def _check_digest_pair(combined: Tensor, own: Tensor, name: str) -> None:
    for argument, value in ((name, combined), ("own", own)):
        if not isinstance(value, Tensor) or value.shape != (DIGEST_BITS,):
            raise ValueError(
                f"{argument} must be a tensor of shape ({DIGEST_BITS},), got {getattr(value, 'shape', value)}"
            )
    if not bool(((own == 0) | (own == 1)).all()):
        raise ValueError("own must hold the bits of digest_bits (zeros and ones)")
    if not bool(torch.isfinite(combined).all()):
        raise ValueError(f"{name} holds NaN or inf: it is not a combination of digest bits")


def check_architecture(expected: Mapping[str, Tensor], received: Mapping[str, Tensor]) -> None:
    """Refuse ``received`` unless it has ``expected``'s entries in order with their shapes and dtypes:
    raises :class:`ModelRejected` saying what differs (an imprint block, a changed layer)."""
    if list(received) != list(expected):
        extra, missing = sorted(set(received) - set(expected)), sorted(set(expected) - set(received))
        raise ModelRejected(
            f"the model's architecture is not the public one: {len(extra)} extra entries {extra[:3]}, "
            f"{len(missing)} missing {missing[:3]}" + ("" if extra or missing else " (another order)")
        )
    for name, want in expected.items():
        have = received[name]
        if have.shape != want.shape or have.dtype != want.dtype:
            raise ModelRejected(
                f"{name}: {tuple(have.shape)} {have.dtype}, the public model has {tuple(want.shape)} {want.dtype}"
            )


class ModelProvenance:
    """A client's replay of the server's public model updates: the model it may accept next.

    Args:
        initial: the public initial model (e.g. built from a published seed), or the last model this
            client accepted.
        server_optimizer: the server's public update rule, ``parameters -> optimizer`` (default: SGD at
            lr 1.0, FedAvg's; FedSGD's server is SGD at its ``server_lr``). The client steps it on each
            round's public aggregate as the server does.
        atol: how far an entry may stand from the replay (default 0: exactly the replay; a server on other
            hardware may need a few ulps).

    Use: :meth:`advance` with each round's public aggregate (``{name: tensor}`` of the trainable
    parameters, the server's ``grad``) and the buffers the server sets (BatchNorm's statistics);
    :meth:`check` on each model received, which raises :class:`ModelRejected` naming the first entry
    that differs.
    """

    def __init__(
        self,
        initial: nn.Module | Mapping[str, Tensor],
        server_optimizer: ServerOptimizer | None = None,
        *,
        atol: float = 0.0,
    ) -> None:
        if not isinstance(initial, nn.Module):
            raise TypeError(f"initial must be an nn.Module (the public model), got {type(initial).__name__}")
        self.atol = check_nonnegative(atol, "atol")
        self._model = _detached_copy(initial)
        params = [p for p in self._model.parameters() if p.requires_grad]
        make = server_optimizer or (lambda ps: torch.optim.SGD(ps, lr=1.0))
        self._optimizer = make(params)
        if not isinstance(self._optimizer, torch.optim.Optimizer):
            raise TypeError(f"server_optimizer must return a torch optimizer, got {type(self._optimizer).__name__}")
        self.rounds = 0

    @property
    def expected_state(self) -> dict[str, Tensor]:
        """The state the next model must have."""
        return {n: t.detach().clone() for n, t in self._model.state_dict().items()}

    def advance(self, aggregate: Mapping[str, Tensor], buffers: Mapping[str, Tensor] | None = None) -> None:
        """Replay the server's step on one round's public ``aggregate``; ``buffers``: the round's public
        values of the model's buffers that the server sets rather than steps (BatchNorm's running
        statistics, averaged over the clients under FedAvg), each named as in the state dict."""
        named = {n: p for n, p in self._model.named_parameters() if p.requires_grad}
        own = dict(self._model.named_buffers())
        for name, value in (buffers or {}).items():
            if name not in own or not isinstance(value, Tensor) or value.shape != own[name].shape:
                raise ValueError(f"buffers[{name!r}] must be a tensor shaped like the model's buffer of that name")
        if not isinstance(aggregate, Mapping) or set(aggregate) != set(named):
            got = sorted(aggregate) if isinstance(aggregate, Mapping) else type(aggregate).__name__
            raise ValueError(f"aggregate must hold one tensor per trainable parameter {sorted(named)}, got {got}")
        for name, param in named.items():  # all checked before any is applied
            value = aggregate[name]
            if not isinstance(value, Tensor) or value.shape != param.shape:
                raise ValueError(f"aggregate[{name!r}] must be a tensor of shape {tuple(param.shape)}")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"aggregate[{name!r}] holds NaN or inf")
        for name, param in named.items():
            param.grad = aggregate[name].detach().to(device=param.device, dtype=param.dtype).clone()
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, value in (buffers or {}).items():
                own[name].copy_(value)
        self.rounds += 1

    def check(self, received: nn.Module | Mapping[str, Tensor]) -> None:
        """Refuse ``received`` unless it is the replayed model (same entries, shapes, dtypes; values
        within ``atol``): raises :class:`ModelRejected` saying what differs."""
        expected, got = self.expected_state, _state(received, "received")
        check_architecture(expected, got)
        for name, want in expected.items():
            have = got[name].detach().to(want.device)
            gap = (have.to(torch.float64) - want.to(torch.float64)).abs()
            if gap.numel() and not bool((gap <= self.atol).all()):
                raise ModelRejected(
                    f"{name}: {int((gap > self.atol).sum())} entries differ from the public model advanced by the "
                    f"public aggregates of {self.rounds} round(s) (largest gap {float(gap.max()):.3g}, atol {self.atol})"
                )


def _detached_copy(model: nn.Module) -> nn.Module:
    copied: Any = copy.deepcopy(model)
    for param in copied.parameters():
        param.grad = None
    return copied
