"""Uniform gradient quantization (a compression baseline that is also a defense)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_gp.defenses.base import Defense, Gradients
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

    def __init__(
        self, bits: int = 8, *, stochastic_rounding: bool = False, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        self.bits = check_int(bits, "bits", low=1, high=16)
        self.stochastic_rounding = check_bool(stochastic_rounding, "stochastic_rounding")

    def config(self) -> dict[str, Any]:
        return {"bits": self.bits, "stochastic_rounding": self.stochastic_rounding}

    def transform(
        self, gradients: Gradients, state: Gradients, generator: torch.Generator
    ) -> tuple[Gradients, Gradients]:
        levels = max(1, 2 ** (self.bits - 1) - 1)
        shared = {}
        for n, g in gradients.items():
            if g.numel() == 0:
                shared[n] = g.clone()
                continue
            bound = g.abs().max()
            if bound == 0:
                shared[n] = g.clone()
                continue
            if self.bits == 1:
                shared[n] = g.sign() * bound
                continue
            position = g * (levels / bound)  # in [-levels, levels]
            if self.stochastic_rounding:
                low = position.floor()
                up = torch.rand(g.shape, generator=generator, device=g.device, dtype=g.dtype) < position - low
                level = low + up
            else:
                level = position.round()
            shared[n] = level.clamp(-levels, levels) * (bound / levels)
        return shared, state
