"""Isotropic gradient noise (the baselines of the optimal-defenses paper and of DP-SGD)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_gp.defenses.base import Defense, DefenseCall, Gradients
from lightning_gp.validation import check_nonnegative


def clip_coordinates(gradients: Gradients, clip: float) -> Gradients:
    """Clip every coordinate to ``[-clip, clip]`` (Eq. 9 of the optimal-defenses paper)."""
    return {n: g.clamp(-clip, clip) for n, g in gradients.items()}


def standard_normal_like(value: Tensor, generator: torch.Generator) -> Tensor:
    return torch.randn(value.shape, generator=generator, device=value.device, dtype=value.dtype)


class GaussianNoise(Defense):
    """Add ``N(0, scale^2)`` to every gradient coordinate (Zhu et al. 2019's noise defense).

    With ``clip`` every coordinate is first clipped to ``[-clip, clip]``: the isotropic DP-SGD
    the optimal-defenses paper compares its clipped optimal noise with (Eq. 9-10, ``Sigma = scale^2 I``).
    This is not DP-SGD with a privacy guarantee (no per-sample clipping, no accountant): use
    :class:`~lightning_gp.callbacks.DPSGD` for that.
    """

    layerwise = True  # per-coordinate clip and noise, drawn in layer order

    def __init__(
        self, scale: float = 0.01, *, clip: float | None = None, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        self.scale = check_nonnegative(scale, "scale")
        self.clip = None if clip is None else check_nonnegative(clip, "clip", strict=True)

    def config(self) -> dict[str, Any]:
        return {"scale": self.scale, "clip": self.clip}

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        values = clip_coordinates(gradients, self.clip) if self.clip is not None else gradients
        return {n: v + self.scale * standard_normal_like(v, call.generator) for n, v in values.items()}, state


class LaplaceNoise(Defense):
    """Add Laplace noise of scale ``b = scale`` (density ``exp(-|z| / b) / 2b``, std ``sqrt(2) b``) to every coordinate."""

    layerwise = True  # per-coordinate noise, drawn in layer order

    def __init__(self, scale: float = 0.01, *, seed: int | None = None, nonfinite: str = "error") -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        self.scale = check_nonnegative(scale, "scale")

    def config(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        shared = {}
        for n, g in gradients.items():
            # the difference of two Exp(1) draws is Laplace(0, 1)
            uniform = torch.rand((2, *g.shape), generator=call.generator, device=g.device, dtype=g.dtype)
            exponential = -torch.log1p(-uniform)
            shared[n] = g + self.scale * (exponential[0] - exponential[1])
        return shared, state
