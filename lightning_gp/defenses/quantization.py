"""Uniform gradient quantization (a compression baseline that is also a defense)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_gp.defenses.base import Defense, DefenseCall, Gradients
from lightning_gp.validation import check_bool, check_int


class GradientQuantization(Defense):
    """Symmetric uniform quantization of each layer to ``bits``-bit signed integers times a scale.

    With ``m = max|g|`` of the layer and ``L = 2**(bits - 1) - 1``, every entry becomes
    ``round(g / m * L) * m / L``, the usual symmetric integer quantization (``int8`` with scale
    ``m / 127`` at 8 bits); zero stays zero, so sparsity survives. ``bits=1`` sends
    ``sign(g) * m``. Rounding is to the nearest level, or unbiased stochastic rounding with
    ``stochastic_rounding=True`` (QSGD, Alistarh et al. 2017), drawn from the client's generator.
    Each upload then costs ``bits`` per entry plus one float per layer.
    """

    layerwise = True  # one scale per layer; stochastic rounding drawn in layer order

    def __init__(
        self, bits: int = 8, *, stochastic_rounding: bool = False, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        self.bits = check_int(bits, "bits", low=1, high=16)
        self.stochastic_rounding = check_bool(stochastic_rounding, "stochastic_rounding")

    def config(self) -> dict[str, Any]:
        return {"bits": self.bits, "stochastic_rounding": self.stochastic_rounding}

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        generator_or_none = call.generator if self.stochastic_rounding else None
        return {n: quantize(g, self.bits, generator_or_none) for n, g in gradients.items()}, state


def quantize(values: Tensor, bits: int, generator: torch.Generator | None = None) -> Tensor:
    """:class:`GradientQuantization` of one layer: ``round(g / m * L) * m / L`` with ``m = max|g|`` and
    ``L = 2**(bits - 1) - 1`` (``sign(g) * m`` at one bit); stochastic rounding when a ``generator``
    is given. A zero (or empty) layer is returned as a copy."""
    if values.numel() == 0:
        return values.clone()
    bound = values.abs().max()
    if bound == 0:
        return values.clone()
    if bits == 1:
        return values.sign() * bound
    levels = 2 ** (bits - 1) - 1
    position = values * (levels / bound)  # in [-levels, levels]
    if generator is not None:
        low = position.floor()
        up = torch.rand(values.shape, generator=generator, device=values.device, dtype=values.dtype) < position - low
        level = low + up
    else:
        level = position.round()
    return level.clamp(-levels, levels) * (bound / levels)
