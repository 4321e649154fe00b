"""Base pruning schemes of pruned federated learning (PriPrune, Sec. 3 Eq. 1 and Sec. 4.2.3, Table 1).

A base scheme decides the server's mask ``m_base`` over the prunable weights (the weights of
``nn.Conv*`` and ``nn.Linear`` layers; biases and normalisation parameters are never pruned):
every prunable layer keeps its ``n - round(rate * n)`` highest-scoring entries (ties by
position, :func:`~lightning_gp.defenses.selection.largest_entries_mask`), so every layer is
pruned at the base rate. The schemes differ only in the score:

* ``random``: uniform scores from a seeded stream (a fixed random mask);
* ``magnitude``: ``|w|`` (PruneFL-style: the server re-ranks every ``update_every`` rounds, see
  :class:`~lightning_gp.priprune.PrunedFedAvgModule`);
* ``snip``: connection sensitivity ``|w * dL/dw|`` on a calibration batch (Lee et al., ICLR 2019);
* ``synflow``: iterative synaptic flow ``|w * dR/dw|`` with ``R = 1^T f(1; |w|)``, data-free,
  pruned over ``iterations`` steps on the exponential schedule (Tanaka et al., NeurIPS 2020).

SNIP and SynFlow prune once at the server (Table 1); magnitude re-ranks periodically; new
schemes subclass :class:`BasePruningScheme` and register with :func:`register_scheme`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_gp.defenses.selection import count_for_rate, largest_entries_mask
from lightning_gp.functional import LossFn
from lightning_gp.seeding import seeded_generator
from lightning_gp.validation import check_int, check_positive_int, check_rate

PRUNABLE_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)

Masks = dict[str, Tensor]


def prunable_weights(model: nn.Module) -> dict[str, Tensor]:
    """The trainable weights of ``model``'s ``nn.Conv*`` and ``nn.Linear`` layers, by parameter name."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, PRUNABLE_LAYERS) and module.weight.requires_grad:
            found[f"{name}.weight" if name else "weight"] = module.weight
    return found


@dataclass
class PruningContext:
    """What a scheme may use besides the weights: the seed and round, and the server's data.

    ``calibration``: a batch ``(inputs, targets)`` the server holds (SNIP); ``input_shape``:
    the shape of one input (SynFlow's all-ones input); ``loss_fn``: the training loss.
    """

    seed: int = 0
    round: int = 0
    calibration: tuple[Tensor, Tensor] | None = None
    input_shape: tuple[int, ...] | None = None
    loss_fn: LossFn | None = None


class BasePruningScheme(ABC):
    """A base pruning scheme: scores per prunable weight, highest kept, ``rate`` of each layer pruned.

    Args:
        rate: the base pruning rate, the fraction of every prunable layer set to zero (the
            paper's default 0.3).
        update_every: re-rank every this many rounds (``None``: prune once, at round 0).
    """

    name: ClassVar[str]

    def __init__(self, rate: float = 0.3, update_every: int | None = None) -> None:
        self.rate = check_rate(rate, "rate")
        self.update_every = None if update_every is None else check_positive_int(update_every, "update_every")

    @abstractmethod
    def scores(self, model: nn.Module, weights: Mapping[str, Tensor], context: PruningContext) -> dict[str, Tensor]:
        """Per-entry importance of every weight in ``weights`` (higher is kept)."""

    def masks(self, model: nn.Module, weights: Mapping[str, Tensor], context: PruningContext) -> Masks:
        """The boolean keep-masks (``True`` = kept) of ``weights`` at :attr:`rate`."""
        scores = self.scores(model, weights, context)
        return {n: keep_top(scores[n], self.rate) for n in weights}

    def updates_at(self, round: int) -> bool:
        """Whether the server re-ranks at the start of ``round`` (never at round 0: that is the first mask)."""
        return self.update_every is not None and round > 0 and round % self.update_every == 0

    def config(self) -> dict[str, Any]:
        return {"rate": self.rate, "update_every": self.update_every}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


def keep_top(scores: Tensor, rate: float) -> Tensor:
    """Keep-mask of the ``n - round(rate * n)`` highest ``scores`` (ties by position), shaped like ``scores``."""
    flat = scores.detach().flatten()
    keep = flat.numel() - count_for_rate(rate, flat.numel())
    return largest_entries_mask(flat, keep).view_as(scores)


BASE_SCHEMES: dict[str, type[BasePruningScheme]] = {}


def register_scheme(name: str) -> Callable[[type[BasePruningScheme]], type[BasePruningScheme]]:
    """Class decorator: make a :class:`BasePruningScheme` available by ``name`` (``base_scheme=name``)."""

    def register(cls: type[BasePruningScheme]) -> type[BasePruningScheme]:
        if name in BASE_SCHEMES:
            raise ValueError(f"a base pruning scheme named {name!r} is already registered ({BASE_SCHEMES[name]})")
        cls.name = name
        BASE_SCHEMES[name] = cls
        return cls

    return register


def make_scheme(
    base_scheme: str | BasePruningScheme, rate: float | None = None, update_every: int | None = None
) -> BasePruningScheme:
    """A scheme from its registered name (with ``rate``, default 0.3, and ``update_every``), or the instance given."""
    if isinstance(base_scheme, BasePruningScheme):
        if rate is not None or update_every is not None:
            raise ValueError(
                "base_rate and mask_update_every configure a scheme given by name; pass them to the "
                f"{type(base_scheme).__name__} instance given as base_scheme instead"
            )
        return base_scheme
    if base_scheme not in BASE_SCHEMES:
        raise ValueError(f"base_scheme must be one of {', '.join(map(repr, BASE_SCHEMES))}, got {base_scheme!r}")
    cls = BASE_SCHEMES[base_scheme]
    kwargs: dict[str, Any] = {"rate": 0.3 if rate is None else check_rate(rate, "base_rate")}
    if update_every is not None:
        kwargs["update_every"] = None if update_every == 0 else update_every
    return cls(**kwargs)


@register_scheme("random")
class RandomScheme(BasePruningScheme):
    """Uniformly random scores from the stream ``(seed, round)``: a random mask at the base rate."""

    def scores(self, model: nn.Module, weights: Mapping[str, Tensor], context: PruningContext) -> dict[str, Tensor]:
        generator = seeded_generator(context.seed, context.round, 0x5EED)
        return {n: torch.rand(w.shape, generator=generator).to(w.device) for n, w in weights.items()}


@register_scheme("magnitude")
class MagnitudeScheme(BasePruningScheme):
    """``|w|``: the smallest weights of each layer are pruned, re-ranked every ``update_every`` rounds
    (default 50, PruneFL's periodic reconfiguration; ``None``: once)."""

    def __init__(self, rate: float = 0.3, update_every: int | None = 50) -> None:
        super().__init__(rate, update_every)

    def scores(self, model: nn.Module, weights: Mapping[str, Tensor], context: PruningContext) -> dict[str, Tensor]:
        return {n: w.detach().abs() for n, w in weights.items()}


@register_scheme("snip")
class SNIPScheme(BasePruningScheme):
    """SNIP's connection sensitivity ``|w * dL/dw|`` on the server's calibration batch (Lee et al. 2019, Eq. 6)."""

    def scores(self, model: nn.Module, weights: Mapping[str, Tensor], context: PruningContext) -> dict[str, Tensor]:
        if context.calibration is None or context.loss_fn is None:
            raise ValueError(
                "base_scheme='snip' scores weights on a calibration batch the server holds; none was given "
                "(FederatedSimulation supplies one from the training set at setup)"
            )
        inputs, targets = context.calibration
        params = {n: w.detach().requires_grad_(True) for n, w in weights.items()}
        with torch.enable_grad():
            loss = context.loss_fn(functional_call(model, params, (inputs,)), targets)
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        return {
            n: (w.detach() * (torch.zeros_like(w) if g is None else g)).abs()
            for (n, w), g in zip(weights.items(), grads)
        }


@register_scheme("synflow")
class SynFlowScheme(BasePruningScheme):
    """Iterative SynFlow (Tanaka et al. 2020, Alg. 1), data-free, per layer.

    ``iterations`` rounds of scoring ``|w * dR/dw|``, ``R = sum f(1; |w| * m)`` in float64 with
    the model in eval mode, each pruning to keep ``(1 - rate) ** (k / iterations)`` of every layer;
    entries pruned earlier stay pruned.
    """

    def __init__(self, rate: float = 0.3, update_every: int | None = None, iterations: int = 100) -> None:
        super().__init__(rate, update_every)
        self.iterations = check_int(iterations, "iterations", low=1)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "iterations": self.iterations}

    def scores(self, model: nn.Module, weights: Mapping[str, Tensor], context: PruningContext) -> dict[str, Tensor]:
        return self._flow(
            model, weights, {n: torch.ones_like(w, dtype=torch.bool) for n, w in weights.items()}, context
        )

    def _flow(
        self, model: nn.Module, weights: Mapping[str, Tensor], keep: Masks, context: PruningContext
    ) -> dict[str, Tensor]:
        if context.input_shape is None:
            raise ValueError("base_scheme='synflow' needs the shape of one input (FederatedSimulation supplies it)")
        state = {n: t.detach().double() for n, t in model.state_dict().items() if t.is_floating_point()}
        params = {n: p.detach().double().abs() for n, p in model.named_parameters()}
        linear = {n: (weights[n].detach().double().abs() * keep[n]).requires_grad_(True) for n in weights}
        device = next(iter(weights.values())).device
        ones = torch.ones((1, *context.input_shape), dtype=torch.float64, device=device)
        modes = {m: m.training for m in model.modules()}
        model.eval()
        try:
            with torch.enable_grad():
                flow = functional_call(model, {**state, **params, **linear}, (ones,)).sum()
                grads = torch.autograd.grad(flow, list(linear.values()), allow_unused=True)
        finally:
            for module, training in modes.items():
                module.training = training
        return {
            n: (w * (torch.zeros_like(w) if g is None else g)).abs().float() for (n, w), g in zip(linear.items(), grads)
        }

    def masks(self, model: nn.Module, weights: Mapping[str, Tensor], context: PruningContext) -> Masks:
        keep = {n: torch.ones_like(w, dtype=torch.bool) for n, w in weights.items()}
        for k in range(1, self.iterations + 1):
            # the last step prunes exactly ``rate`` (the same count as the other schemes)
            rate = self.rate if k == self.iterations else 1 - (1 - self.rate) ** (k / self.iterations)
            scores = self._flow(model, weights, keep, context)
            # pruned entries score below every kept one, so they stay pruned
            keep = {n: keep_top(torch.where(keep[n], scores[n], -1.0), rate) for n in weights}
        return keep
