"""The contract every defense implements: a transform of one client's named gradients.

A defense maps the named per-layer gradients of one client to the gradients that client shares.
It may keep per-client state (error-feedback residuals, masks) and draw randomness; both live in
the defense, keyed by client id, are created lazily on the client's first round, and travel
through ``state_dict``/``load_state_dict`` so a run resumes with every client's state intact.
Defenses import nothing from Lightning: the callbacks in :mod:`lightning_gp.callbacks` adapt them.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_gp.defenses.validation import (
    NONFINITE_POLICIES,
    NonFiniteGradientError,
    check_choice,
    check_client_id,
    check_gradients,
    layer_norms,
    nonfinite_layers,
    whole_norm,
)
from lightning_gp.named_tensors import write_into
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_int, check_positive_int

Gradients = dict[str, Tensor]
Share = Callable[[int, dict[str, Tensor]], dict[str, Tensor]]


def share_in_process(source_client: int, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The ``share`` of a single process: every client is here, so nothing moves."""
    return tensors


@dataclass(frozen=True)
class DefenseCall:
    """What :meth:`Defense.transform` gets for one call besides the gradient and the client's state.

    Attributes:
        client_id: the client defended.
        generator: the client's random stream (seeded by the defense's seed and the client id).
        out: where the caller wants the shared gradient written (see :meth:`output`), or ``None``.
        statistic: what :meth:`Defense.prepare` made of the call's data-dependent inputs (a
            sensitivity, feature scores, a noise scale); ``None`` for defenses that take none.
        update_norm: the L2 norm of the whole gradient the transform gets (every layer together,
            as :func:`~lightning_gp.defenses.clipping.update_norm`), which the finite check
            computed on the way; ``None`` where it did not (a layer was zeroed, or another caller).
    """

    client_id: int
    generator: torch.Generator
    out: Mapping[str, Tensor] | None = None
    statistic: Any = None
    update_norm: float | None = None

    def output(self, name: str, like: Tensor) -> Tensor:
        """Where :meth:`Defense.transform` may write layer ``name``'s shared gradient: the caller's
        ``out`` tensor, else a fresh tensor like ``like`` (see :meth:`Defense.transform` on aliasing)."""
        if self.out is not None:
            return self.out[name]
        return torch.empty_like(like)


class Defense(ABC):
    """Base class of gradient defenses (pure tensor code, explicit per-client state).

    Subclasses implement :meth:`transform` and, when they keep state, :meth:`init_client_state`;
    a data-dependent defense also implements :meth:`prepare` (what it needs besides the gradient,
    e.g. ``sensitivity=``). Calling the defense validates the input, applies the non-finite policy,
    fetches (or creates) the client's state and random generator, runs :meth:`transform` with a
    :class:`DefenseCall` and stores the new state.

    Args:
        seed: seeds the per-client generators (client ``c`` draws from a stream seeded by
            ``(seed, c)``, so results do not depend on the order clients are processed). ``None``
            draws the seed from torch's global generator, so ``lightning.seed_everything`` fixes it.
        nonfinite: what to do with NaN/inf gradients: ``"error"`` raises
            :class:`NonFiniteGradientError`; ``"zero"`` replaces them with 0 and warns.
    """

    #: The defense is layer-separable: its output and new state for a layer depend only on that
    #: layer's gradient, that layer's own state (state is keyed by layer name, or empty) and the
    #: client's random stream drawn layer after layer, and :meth:`begin_round` shares nothing. Then
    #: defending the layers in consecutive parts, in order (:meth:`defend_layers`, e.g. one DDP
    #: bucket at a time), gives bit for bit what defending them at once gives. False by default:
    #: global thresholds, sensitivity estimates and cross-client masks need the whole model.
    layerwise: ClassVar[bool] = False
    #: :meth:`prepare` takes ``weights=``, the current weights of the layers shared, named like the
    #: gradient (Outpost scales its noise by them); the callbacks pass the model's.
    reads_weights: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.layerwise and cls.begin_round is not Defense.begin_round:
            raise TypeError(
                f"{cls.__name__} declares layerwise = True but overrides begin_round: a defense that prepares "
                "its rounds across clients needs the whole model and cannot be layerwise"
            )

    def __init__(self, *, seed: int | None = None, nonfinite: str = "error") -> None:
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        self.seed = check_int(seed, "seed", low=0)
        self.nonfinite = check_choice(nonfinite, "nonfinite", NONFINITE_POLICIES)
        self.num_clients: int | None = None
        self._states: dict[int, Gradients] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._pending_generator_states: dict[int, Tensor] = {}
        self._layer_shapes: dict[str, torch.Size] | None = None
        self._restored_num_clients: int | None = None

    # ---------------------------------------------------------------- subclass API
    @abstractmethod
    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        """Return ``(shared_gradients, new_state)`` for one client.

        Must not modify ``gradients``. May update the tensors of ``state`` in place (the defense
        owns them; :meth:`state_dict` returns copies), but only once nothing can fail any more.
        Draws its randomness from ``call.generator``. May write a layer's shared gradient into
        ``call.output(name, like)`` (and return it), but only once it has read that layer's
        gradient for the last time: the caller's ``out`` may be the gradient itself.
        """

    def prepare(self, gradients: Mapping[str, Tensor], **inputs: Any) -> Any:
        """Check and convert what a call passes besides the gradient (``defense(g, c, **inputs)``) into
        the ``call.statistic`` :meth:`transform` reads. Default: a defense that takes nothing else
        refuses any input. Data-dependent defenses override it with their keyword arguments."""
        if inputs:
            raise TypeError(
                f"{type(self).__name__} defends from the gradient alone; it takes no {', '.join(sorted(inputs))}"
            )
        return None

    def init_client_state(self, gradients: Gradients) -> Gradients:
        """The state of a client seen for the first time (empty for stateless defenses)."""
        return {}

    def config(self) -> dict[str, Any]:
        """The hyperparameters that define the defense (checked when a checkpoint is restored)."""
        return {}

    def begin_round(
        self, round: int, clients: Sequence[int], local_gradients: Mapping[int, Gradients], share: Share
    ) -> None:
        """Called once per round, before any client of the round is defended (default: nothing).

        For defenses that coordinate clients (e.g. ADGP's shared location mask).

        Args:
            round: the round index (the optimizer step).
            clients: every client taking part in the round, in every process.
            local_gradients: the gradients of the participating clients this process holds, as
                this defense then receives them: the raw gradients, or, after other defenses in a
                pipeline, the gradients as those defenses rewrote them.
            share: ``share(source_client, tensors)`` returns ``source_client``'s tensors in every
                process (a broadcast under DDP); other processes pass same-shaped placeholders.
        """
        return  # most defenses treat clients independently

    # ---------------------------------------------------------------- public API
    def __call__(
        self,
        gradients: Mapping[str, Tensor],
        client_id: int = 0,
        *,
        out: Mapping[str, Tensor] | None = None,
        **inputs: Any,
    ) -> Gradients:
        """Defend one client's gradient: the shared gradient, by layer name.

        ``inputs`` are what a data-dependent defense needs besides the gradient (its
        :meth:`prepare` names them, e.g. ``sensitivity=``); others take none.

        With ``out`` (tensors shaped, typed and placed like the gradients, e.g. the parameters'
        ``.grad``, or ``gradients`` itself to defend in place) the shared gradient is written into
        them and they are returned: no fresh model-sized memory, whose page faults on CPU cost a
        pruning defense over a quarter of its time (ResNet18). ``gradients`` is then overwritten where
        ``out`` aliases it, also when the defense fails part way.
        """
        statistic = self.prepare(gradients, **inputs)
        return self._defend(gradients, client_id, part=False, out=out, statistic=statistic)

    def defend_layers(
        self, gradients: Mapping[str, Tensor], client_id: int = 0, *, out: Mapping[str, Tensor] | None = None
    ) -> Gradients:
        """Defend some of a client's layers, e.g. one DDP bucket (only for :attr:`layerwise` defenses).

        The layers must be among those declared (:meth:`check_layer_shapes`, which a Trainer does
        at fit start); only their state is read and replaced. Called part after part, in the order
        the whole gradient would list its layers, this gives bit for bit what one call with all
        layers gives, state and random stream included. ``out`` as in :meth:`__call__`.
        """
        if not self.layerwise:
            raise TypeError(
                f"{type(self).__name__} is not layerwise (it needs the whole model's gradient at once); "
                "call it with every layer"
            )
        return self._defend(gradients, client_id, part=True, out=out)

    def _defend(
        self,
        gradients: Mapping[str, Tensor],
        client_id: int,
        *,
        part: bool,
        out: Mapping[str, Tensor] | None = None,
        statistic: Any = None,
    ) -> Gradients:
        check_gradients(gradients)
        if out is not None:
            check_out(out, gradients)
        client_id = check_client_id(client_id, self.num_clients)
        gradients, norm = self._apply_nonfinite_policy(dict(gradients), client_id)
        shapes = {n: g.shape for n, g in gradients.items()}
        if part:
            self._check_part_shapes(shapes, client_id)
        else:
            self._check_layer_shapes(shapes, f"the gradients of client {client_id}")
        stored = self._states.get(client_id)
        if not part:
            state = self.init_client_state(gradients) if stored is None else _aligned(stored, gradients)
        else:
            # a layerwise defense's state is keyed by layer: take this part's, create what is missing
            stored = {} if stored is None else stored
            state = {n: stored[n] for n in gradients if n in stored}
            new_layers = {n: g for n, g in gradients.items() if n not in stored}
            if new_layers:
                state.update(self.init_client_state(new_layers))
            state = _aligned(state, gradients)
        generator = self._generator(client_id, next(iter(gradients.values())).device)
        shared, new_state = self.transform(gradients, state, DefenseCall(client_id, generator, out, statistic, norm))
        if shared.keys() != gradients.keys():
            raise RuntimeError(f"{type(self).__name__}.transform changed the set of layers")
        written = {} if out is None else out  # out's tensors were checked against the gradient's
        changed = [
            n
            for n, g in gradients.items()
            if shared[n] is not written.get(n) and (shared[n].dtype, shared[n].device) != (g.dtype, g.device)
        ]
        if changed:
            raise RuntimeError(f"{type(self).__name__}.transform changed the dtype or device of {changed}")
        self._states[client_id] = {**stored, **new_state} if part and stored is not None else new_state
        # a transform that did not write into out is copied there
        return shared if out is None else write_into(out, shared)

    def check_cohort(self, cohort_size: int) -> None:
        """Refuse a run whose rounds aggregate ``cohort_size`` uploads where this defense's guarantee
        needs more (:class:`~lightning_gp.defenses.DistributedGaussianMechanism`); any number is fine
        for a defense of the upload alone."""
        check_positive_int(cohort_size, "cohort_size")

    def set_num_clients(self, num_clients: int | None) -> None:
        """Declare how many clients the run has; later calls reject ids outside ``0..n-1``."""
        if num_clients is not None:
            check_positive_int(num_clients, "num_clients")
        restored = self._restored_num_clients
        if restored is not None and num_clients is not None and restored != num_clients:
            raise ValueError(
                f"{type(self).__name__} was restored with state for a run of {restored} clients, but this run has "
                f"{num_clients}; resume with the same number of clients"
            )
        known = [c for c in self._states if num_clients is not None and c >= num_clients]
        if known:
            raise ValueError(f"this defense holds state for client ids {known}, but the run has {num_clients} clients")
        self.num_clients = num_clients

    def client_state(self, client_id: int) -> Gradients:
        """A copy of the stored state of one client (a KeyError if that client has not been seen)."""
        client_id = check_client_id(client_id, self.num_clients)
        if client_id not in self._states:
            raise KeyError(f"no state for client {client_id}: it has not shared a gradient yet")
        return {name: tensor.clone() for name, tensor in self._states[client_id].items()}

    @property
    def clients(self) -> list[int]:
        return sorted(self._states)

    def reset(self) -> None:
        """Forget every client's state and generator."""
        self._states.clear()
        self._generators.clear()
        self._pending_generator_states.clear()
        self._layer_shapes = None

    def check_layer_shapes(self, shapes: Mapping[str, torch.Size]) -> None:
        """Raise if stored state was made for other layers than ``shapes`` (e.g. after a resume)."""
        self._check_layer_shapes({n: torch.Size(s) for n, s in shapes.items()}, "the model")

    def state_dict(self) -> dict[str, Any]:
        generators = dict(self._pending_generator_states)
        generators.update({c: g.get_state() for c, g in self._generators.items()})
        return {
            "defense": type(self).__qualname__,
            "config": self.config(),
            "seed": self.seed,
            "num_clients": self.num_clients,
            "layer_shapes": None if self._layer_shapes is None else {n: list(s) for n, s in self._layer_shapes.items()},
            # copies: transforms may update a client's state tensors in place
            "client_states": {c: {n: t.clone() for n, t in s.items()} for c, s in self._states.items()},
            "generator_states": generators,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        expected = {"defense", "config", "seed", "num_clients", "layer_shapes", "client_states", "generator_states"}
        missing = expected - set(state_dict)
        if missing:
            raise ValueError(f"not a {type(self).__name__} state dict: missing keys {sorted(missing)}")
        if state_dict["defense"] != type(self).__qualname__ or state_dict["config"] != self.config():
            raise ValueError(
                f"the checkpoint holds the state of {state_dict['defense']}({_fmt(state_dict['config'])}), "
                f"but this defense is {self!r}; restore it into an identically configured defense"
            )
        saved_clients = state_dict["num_clients"]
        if saved_clients is not None and self.num_clients is not None and saved_clients != self.num_clients:
            raise ValueError(
                f"the checkpoint holds defense state for a run of {saved_clients} clients, "
                f"but this run has {self.num_clients}"
            )
        num_clients = self.num_clients if self.num_clients is not None else saved_clients
        outside = sorted(
            int(c) for c in state_dict["client_states"] if num_clients is not None and int(c) >= num_clients
        )
        if outside:
            raise ValueError(
                f"the checkpoint holds state for client ids {outside}, but this run has {num_clients} clients"
            )
        self.reset()
        self._restored_num_clients = saved_clients
        self.seed = int(state_dict["seed"])
        self.num_clients = self.num_clients if self.num_clients is not None else saved_clients
        shapes = state_dict["layer_shapes"]
        self._layer_shapes = None if shapes is None else {n: torch.Size(s) for n, s in shapes.items()}
        self._states = {int(c): {n: t.clone() for n, t in s.items()} for c, s in state_dict["client_states"].items()}
        self._pending_generator_states = {int(c): s for c, s in state_dict["generator_states"].items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_fmt(self.config())})"

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the defense lacks. Lightning reads a callback's state_key
        # and hooks; say what to use instead of failing with a bare AttributeError deep inside it.
        if name == "state_key" or name in ("setup", "teardown") or name.startswith("on_"):
            raise TypeError(
                f"lightning_gp.defenses.{type(self).__name__} is a pure gradient transform, not a Lightning "
                f"callback: pass lightning_gp.callbacks.{type(self).__name__}(...) to Trainer(callbacks=[...]) "
                "(or wrap any transform as lightning_gp.callbacks.GradientDefense(transform))"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---------------------------------------------------------------- internals
    def _generator(self, client_id: int, device: torch.device) -> torch.Generator:
        generator = self._generators.get(client_id)
        if generator is not None and generator.device.type == device.type:
            return generator
        pending = self._pending_generator_states.pop(client_id, None)
        if pending is None:
            generator = seeded_generator(self.seed, client_id, device=device)
        else:
            generator = torch.Generator(device=device)
            try:
                generator.set_state(pending)
            except RuntimeError as err:
                raise RuntimeError(
                    f"cannot restore client {client_id}'s random state on {device}: it was saved on "
                    "another device type; resume on the device the checkpoint was written on"
                ) from err
        self._generators[client_id] = generator
        return generator

    def _apply_nonfinite_policy(self, gradients: Gradients, client_id: int) -> tuple[Gradients, float | None]:
        """The gradients the transform gets and their whole L2 norm (``None`` once a layer was zeroed):
        the norm is the check's own pass (a finite norm means every entry is finite), kept for the
        transforms that clip (:attr:`DefenseCall.update_norm`)."""
        norms = layer_norms(gradients)
        norm = whole_norm(norms)
        bad = [] if math.isfinite(norm) else nonfinite_layers(gradients, norms)
        if not bad:
            return gradients, norm
        if self.nonfinite == "error":
            raise NonFiniteGradientError(
                f"client {client_id}'s gradient holds NaN or inf in {bad}; fix the training "
                f"(learning rate, loss scaling) or pass nonfinite='zero' to {type(self).__name__}"
            )
        warnings.warn(
            f"{type(self).__name__}: client {client_id}'s gradient holds NaN or inf in {bad}; "
            "those entries are replaced by 0 (nonfinite='zero')",
            RuntimeWarning,
            stacklevel=3,
        )
        zeroed = {
            n: torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) if n in bad else g for n, g in gradients.items()
        }
        return zeroed, None

    def _check_part_shapes(self, shapes: dict[str, torch.Size], client_id: int) -> None:
        known = self._layer_shapes
        if known is None:
            raise RuntimeError(
                f"{type(self).__name__}.defend_layers needs the model's layers declared first "
                "(check_layer_shapes; a Trainer does this at fit start)"
            )
        wrong = [f"{n}: {tuple(s)}" for n, s in shapes.items() if known.get(n) != s]
        if wrong:
            raise ValueError(
                f"{type(self).__name__}: layers {wrong} of client {client_id}'s gradient are not layers of the "
                "declared model (or have another shape)"
            )

    def _check_layer_shapes(self, shapes: dict[str, torch.Size], where: str) -> None:
        if self._layer_shapes is None:
            self._layer_shapes = shapes
            return
        if shapes == self._layer_shapes:
            return
        missing = [n for n in self._layer_shapes if n not in shapes]
        extra = [n for n in shapes if n not in self._layer_shapes]
        changed = [
            f"{n}: {tuple(self._layer_shapes[n])} -> {tuple(s)}"
            for n, s in shapes.items()
            if n in self._layer_shapes and s != self._layer_shapes[n]
        ]
        raise ValueError(
            f"{type(self).__name__} holds state for other layers than {where} "
            f"(missing: {missing}, unexpected: {extra}, shape changes: {changed}); "
            "was the checkpoint written for another model?"
        )


def check_out(out: Mapping[str, Tensor], gradients: Mapping[str, Tensor]) -> None:
    """``out`` names exactly the gradient's layers, each a tensor of its layer's shape, dtype and device."""
    if not isinstance(out, Mapping):
        raise TypeError(f"out must be a mapping of layer name to tensor, got {type(out).__name__}")
    if out.keys() != gradients.keys():
        missing, extra = sorted(set(gradients) - set(out)), sorted(set(out) - set(gradients))
        raise ValueError(f"out must name the gradient's layers: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, g in gradients.items():
        target = out[name]
        if not isinstance(target, Tensor) or (target.shape, target.dtype, target.device) != (
            g.shape,
            g.dtype,
            g.device,
        ):
            got = (
                f"{tuple(target.shape)} {target.dtype} on {target.device}"
                if isinstance(target, Tensor)
                else type(target).__name__
            )
            raise ValueError(
                f"out[{name!r}] must be a tensor of the gradient's shape {tuple(g.shape)}, dtype {g.dtype} and "
                f"device {g.device}; got {got}"
            )


def _aligned(state: Gradients, gradients: Mapping[str, Tensor]) -> Gradients:
    """A client's state on the device and in the dtype of its gradient (e.g. restored from a
    checkpoint written on another device or in another precision), so what it shares keeps the
    gradient's dtype."""
    aligned = {}
    for name, tensor in state.items():
        like = gradients.get(name)
        same = like is None or (tensor.dtype == like.dtype and tensor.device == like.device)
        aligned[name] = tensor if same else tensor.to(device=like.device, dtype=like.dtype)  # type: ignore[union-attr]
    return aligned


def _fmt(config: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())
