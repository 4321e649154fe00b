"""Noise and quantization defense callbacks (the baselines of the optimal-defenses paper)."""

from __future__ import annotations

from lightning_gp.callbacks.base import GradientDefense
from lightning_gp.defenses import noise, quantization


class GaussianNoise(GradientDefense, defense=noise.GaussianNoise):
    """Add ``N(0, scale^2)`` to every coordinate of the shared gradient; with ``clip``, clip each
    coordinate to ``[-clip, clip]`` first. No formal DP guarantee (see :class:`DPSGD`).
    See :class:`lightning_gp.defenses.GaussianNoise`."""


class LaplaceNoise(GradientDefense, defense=noise.LaplaceNoise):
    """Add Laplace noise of scale ``b = scale`` to every coordinate. See :class:`lightning_gp.defenses.LaplaceNoise`."""


class LocalGaussianMechanism(GradientDefense, defense=noise.LocalGaussianMechanism):
    """Clip the client's whole shared gradient to L2 norm ``max_update_norm`` and add
    ``N(0, (noise_multiplier * max_update_norm)^2)`` to every coordinate before it leaves the client
    (local DP of the update). See :class:`lightning_gp.defenses.LocalGaussianMechanism`."""


class DistributedGaussianMechanism(GradientDefense, defense=noise.DistributedGaussianMechanism):
    """Clip the client's whole shared gradient to L2 norm ``max_update_norm`` and add its share of one
    central noise, ``N(0, (noise_multiplier * max_update_norm)^2 / cohort_size)`` per coordinate: behind
    secure aggregation the sum of ``cohort_size`` uploads carries DP-FedAvg's central noise.
    See :class:`lightning_gp.defenses.DistributedGaussianMechanism`."""


class GradientQuantization(GradientDefense, defense=quantization.GradientQuantization):
    """Quantize every layer to ``bits``-bit symmetric integers times a per-layer scale.
    See :class:`lightning_gp.defenses.GradientQuantization`."""
