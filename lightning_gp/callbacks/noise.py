"""Noise and quantization defense callbacks (the baselines of the optimal-defenses paper)."""

from __future__ import annotations

from lightning_gp.callbacks.base import GradientDefense
from lightning_gp.defenses import noise, quantization


class GaussianNoise(GradientDefense):
    """Add ``N(0, scale^2)`` to every coordinate of the shared gradient; with ``clip``, clip each
    coordinate to ``[-clip, clip]`` first. No formal DP guarantee (see :class:`DPSGD`).
    See :class:`lightning_gp.defenses.GaussianNoise`."""

    def __init__(
        self, scale: float = 0.01, clip: float | None = None, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(noise.GaussianNoise(scale, clip=clip, seed=seed, nonfinite=nonfinite))


class LaplaceNoise(GradientDefense):
    """Add Laplace noise of scale ``b = scale`` to every coordinate. See :class:`lightning_gp.defenses.LaplaceNoise`."""

    def __init__(self, scale: float = 0.01, seed: int | None = None, nonfinite: str = "error") -> None:
        super().__init__(noise.LaplaceNoise(scale, seed=seed, nonfinite=nonfinite))


class GradientQuantization(GradientDefense):
    """Quantize every layer to ``bits``-bit symmetric integers times a per-layer scale.
    See :class:`lightning_gp.defenses.GradientQuantization`."""

    def __init__(
        self, bits: int = 8, stochastic_rounding: bool = False, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(
            quantization.GradientQuantization(
                bits, stochastic_rounding=stochastic_rounding, seed=seed, nonfinite=nonfinite
            )
        )
