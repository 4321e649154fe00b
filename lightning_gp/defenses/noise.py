"""Isotropic gradient noise (the baselines of the optimal-defenses paper and of DP-SGD) and the client-side
Gaussian mechanism on a whole update (local DP of the client's update)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_gp.defenses.base import Defense, DefenseCall, Gradients
from lightning_gp.defenses.clipping import update_norm
from lightning_gp.validation import check_nonnegative, check_positive, check_positive_int


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


class LocalGaussianMechanism(Defense):
    """Clip the client's whole shared gradient to L2 norm ``C = max_update_norm`` (every layer together),
    then add ``N(0, (z C)^2)`` to every coordinate, ``z = noise_multiplier``, before it leaves the client.

    The Gaussian mechanism (Dwork & Roth 2014, Thm. A.1; Abadi et al. 2016, the noise scaled to the
    clipping norm) on the client's update, clipped as a whole as in DP-FedAvg (McMahan et al. 2018,
    Alg. 1 ``ClipFn``, :func:`~lightning_gp.defenses.clip_update`): every upload is a release of its
    own, so the guarantee holds against the server itself (local DP of the update). Replacing one image,
    or the whole client batch, moves the clipped update by at most ``2 C``: noise multiplier ``z / 2``
    per round under replace-one (:func:`~lightning_gp.audit.bounds.defense_mechanism`).

    How it differs from its neighbours:

    - :class:`~lightning_gp.federated.ClientLevelDP` (DP-FedAvg) clips the same way but the *server*
      adds one noise ``N(0, (z C)^2)`` to the *sum* of the round's clipped updates: the server sees each
      update in the clear (trusted server, or secure aggregation). Here each client adds its own, so the
      mean of ``K`` uploads carries noise of std ``z C / sqrt(K)``: the lever is many clients per round.
    - DP-SGD (:class:`~lightning_gp.callbacks.DPSGD`) clips *each example's* gradient and adds one noise
      to their sum (sensitivity ``C`` per example); here the batch gradient is clipped once, whatever
      the batch size, so the record protected is the client's whole batch as well as each image in it.

    Args:
        noise_multiplier: ``z``, the noise std over ``max_update_norm`` (``0``: clipping alone).
        max_update_norm: ``C``, the L2 bound of the client's whole shared gradient.
        seed, nonfinite: as :class:`~lightning_gp.defenses.Defense` (client ``c`` draws its noise from
            the stream ``(seed, c)``). Not a cryptographically secure source.
    """

    # layerwise stays False: the clip reads the norm of every layer at once

    def __init__(
        self,
        noise_multiplier: float = 0.5,
        max_update_norm: float = 1.0,
        *,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)
        self.noise_multiplier = check_nonnegative(noise_multiplier, "noise_multiplier")
        self.max_update_norm = check_positive(max_update_norm, "max_update_norm")
        self._noise_cache: tuple[tuple[Any, ...], Tensor, list[Tensor]] | None = None

    @property
    def noise_std(self) -> float:
        """The per-coordinate noise std ``z C``."""
        return self.noise_multiplier * self.max_update_norm

    def config(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "max_update_norm": self.max_update_norm}

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        # fused over the layers (one draw for the whole update, a few kernel lists per step): on a small
        # model the per-layer Python calls cost more than the arithmetic
        names, values = list(gradients), list(gradients.values())
        norm = update_norm(gradients) if call.update_norm is None else call.update_norm
        factor = min(1.0, self.max_update_norm / norm) if norm > 0 else 1.0
        # z C n + factor g, built in the noise's own buffer (its per-layer views), then where the caller wants it
        noise, shared = self._noise_buffer(values, reuse=call.out is not None)
        noise.normal_(generator=call.generator).mul_(self.noise_std)  # the stream torch.randn would draw
        torch._foreach_add_(shared, values, alpha=factor)
        if call.out is not None:  # the caller's tensors (they may be the gradients themselves: read above)
            out = [call.out[n] for n in names]
            torch._foreach_copy_(out, shared)
            shared = out
        return dict(zip(names, shared)), state

    def _noise_buffer(self, values: list[Tensor], *, reuse: bool) -> tuple[Tensor, list[Tensor]]:
        """A flat buffer for the whole update's noise and its per-layer views. With ``reuse`` (the caller
        copies the result out at once) the same buffer and views serve every call on the same layers:
        on a small model making them costs as much as filling them."""
        first = values[0]
        key = (tuple(v.shape for v in values), first.dtype, first.device)
        if reuse and self._noise_cache is not None and self._noise_cache[0] == key:
            return self._noise_cache[1], self._noise_cache[2]
        sizes = [v.numel() for v in values]
        flat = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
        views = [d.view(v.shape) for d, v in zip(flat.split(sizes), values)]
        if reuse:
            self._noise_cache = (key, flat, views)
        return flat, views


class DistributedGaussianMechanism(LocalGaussianMechanism):
    """:class:`LocalGaussianMechanism` with each client's share of one central noise: the update clipped
    to L2 norm ``C`` as a whole, then ``N(0, (z C)^2 / K)`` per coordinate, ``K = cohort_size`` the
    clients of a round. Behind secure aggregation (Bonawitz et al., CCS 2017), where the server sees
    only the sum, the sum of ``K`` uploads carries ``N(0, (z C)^2)``: DP-FedAvg's central noise
    (McMahan et al. 2018) without a trusted server (distributed DP: the noise is split among the
    clients, as in Kairouz et al., ICML 2021, here in the continuous Gaussian form, not their discrete
    one).

    The guarantee is the sum's: noise multiplier ``z`` on the aggregate of ``K`` clients (replace-one:
    ``z / 2``), :func:`~lightning_gp.audit.setting_bound` with ``aggregate_of``. A server that sees one
    upload (no secure aggregation, or every other client colluding with it) sees noise ``z C / sqrt(K)``
    only, the per-client view's much weaker bound; fewer than ``K`` clients in a round (dropouts) leave
    the sum less noise than ``z C``.

    Args:
        noise_multiplier: ``z``, the central noise std over ``max_update_norm`` on the sum of ``K``.
        max_update_norm: ``C``.
        cohort_size: ``K``, the clients whose uploads the secure aggregate sums each round.
        seed, nonfinite: as :class:`LocalGaussianMechanism`.
    """

    def __init__(
        self,
        noise_multiplier: float = 1.0,
        max_update_norm: float = 1.0,
        cohort_size: int = 1000,
        *,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        super().__init__(noise_multiplier, max_update_norm, seed=seed, nonfinite=nonfinite)
        self.cohort_size = check_positive_int(cohort_size, "cohort_size")

    @property
    def noise_std(self) -> float:
        """The per-coordinate noise std of one client's upload, ``z C / sqrt(K)``."""
        return self.noise_multiplier * self.max_update_norm / math.sqrt(self.cohort_size)

    def check_cohort(self, cohort_size: int) -> None:
        """Refuse rounds that aggregate fewer than ``self.cohort_size`` uploads: their sum would carry
        less noise than the central ``z C`` the guarantee states (more uploads only add noise)."""
        super().check_cohort(cohort_size)
        if cohort_size < self.cohort_size:
            carried = self.noise_std * math.sqrt(cohort_size)
            raise ValueError(
                f"DistributedGaussianMechanism(cohort_size={self.cohort_size}) in rounds that aggregate {cohort_size} "
                f"uploads (clients_per_round): their sum carries noise std {carried:.4g}, not the central "
                f"z C = {self.noise_multiplier * self.max_update_norm:.4g} its guarantee states. Set cohort_size to "
                "the clients whose uploads each secure aggregate sums (at most clients_per_round)"
            )

    def absent_noise_std(self, present: int) -> float:
        """The per-coordinate std of the summed noise shares of the cohort's other ``K - present``
        clients: what the secure sum carries beyond ``present`` clients' uploads when those others are
        honest (their shares stay secret, whatever else the server knows of them)."""
        present = check_positive_int(present, "present")
        return self.noise_std * math.sqrt(max(self.cohort_size - present, 0))

    def config(self) -> dict[str, Any]:
        return {**super().config(), "cohort_size": self.cohort_size}
