"""Pruning defenses: which entries of each layer's gradient a client shares.

Magnitude pruning (DLG, Zhu et al. 2019, Sec. 5), Top-k with error feedback (DGC, Lin et al.
2018), random pruning, and dual gradient pruning (DGP, Alg. 1-2 of the DGP paper).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_gp.defenses.base import DefenseCall, Gradients, Share
from lightning_gp.defenses.selection import (
    MagnitudeRanks,
    Workspace,
    count_for_rate,
    count_sent,
    largest_magnitude_mask,
    largest_magnitude_mask_into,
    location_bits,
    magnitude_band_mask_into,
)
from lightning_gp.defenses.sparsification import SparsifyingDefense
from lightning_gp.validation import check_nonnegative, check_rate


class _LayerwisePruning(SparsifyingDefense):
    """A pruning defense whose mask of a layer depends on that layer alone: each mask is built
    as 0/1 float32 in a workspace reused across layers and steps, and applied at once."""

    mask_reads_gradient_alone = True

    def __init__(self, *, error_feedback: bool, seed: int | None, nonfinite: str) -> None:
        super().__init__(error_feedback=error_feedback, seed=seed, nonfinite=nonfinite)
        self._workspace = Workspace()

    @abstractmethod
    def layer_mask(self, name: str, values: Tensor, out: Tensor) -> Tensor:
        """Write the keep-mask of one layer into the flat float32 ``out`` and return it."""

    def layer_masks(self, values: Mapping[str, Tensor], generator: torch.Generator) -> Iterator[tuple[str, Tensor]]:
        for name, v in values.items():
            yield name, self.layer_mask(name, v, self._mask_buffer(v))

    def select(self, values: Mapping[str, Tensor], generator: torch.Generator) -> dict[str, Tensor]:
        return {n: mask.to(torch.bool).view(values[n].shape) for n, mask in self.layer_masks(values, generator)}

    def transform(self, gradients: Gradients, state: Gradients, call: DefenseCall) -> tuple[Gradients, Gradients]:
        """:meth:`SparsifyingDefense.transform` one layer at a time: ``P = g + e``, its mask, the
        share and the residual, while the layer is still in cache (the same bits as accumulating
        every layer first: each layer's mask depends on that layer alone)."""
        self.check_inputs(gradients)
        shared = {}
        for name, g in gradients.items():
            v = state[name].add_(g) if self.error_feedback else g
            shared[name] = self.share_layer(v, self.layer_mask(name, v, self._mask_buffer(v)), call.output(name, v))
        return shared, ({n: state[n] for n in gradients} if self.error_feedback else {})

    def _mask_buffer(self, values: Tensor) -> Tensor:
        return self._workspace.get("mask", values.numel(), torch.float32, values.device)


class MagnitudePruning(_LayerwisePruning):
    """Zero the ``rate`` fraction of smallest-magnitude entries of every layer.

    Exactly ``round(rate * n)`` entries of an ``n``-entry layer are zeroed (half rounds up), so a
    size-1 bias is zeroed when ``rate >= 0.5``. DLG (Zhu et al. 2019, Fig. 7) reports that
    pruning above ~20% starts to hamper its attack; this is the defense the DGP paper shows to
    still leak, because it sends exactly the largest entries.

    Args:
        rate: fraction of each layer's entries to zero, in [0, 1].
        error_feedback: keep the pruned remainder per client and add it to the next gradient.
    """

    layerwise = True  # each layer's mask and residual from that layer alone

    def __init__(
        self, rate: float = 0.8, *, error_feedback: bool = False, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(error_feedback=error_feedback, seed=seed, nonfinite=nonfinite)
        self.rate = check_rate(rate, "rate")

    def config(self) -> dict[str, Any]:
        return {"rate": self.rate, "error_feedback": self.error_feedback}

    def layer_mask(self, name: str, values: Tensor, out: Tensor) -> Tensor:
        n = values.numel()
        return largest_magnitude_mask_into(values, n - count_for_rate(self.rate, n), out, self._workspace)


class TopKPruning(_LayerwisePruning):
    """Zero the ``rate`` fraction of smallest-magnitude entries of every layer and share the rest,
    the largest ``1 - rate`` (Top-k of DGC, Lin et al. 2018), with per-client error feedback.

    ``max(1, round((1 - rate) n))`` entries of an ``n``-entry layer are sent (at least one, so no
    entry accumulates forever); with error feedback (on by default, as in DGC) the rest is carried
    to the client's next round. ``rate = 1`` sends nothing. Without error feedback it differs from
    :class:`MagnitudePruning` only on tiny layers (which send one entry here).

    Args:
        rate: fraction of each layer's entries zeroed, in [0, 1] (DGC's ``k`` is ``1 - rate``).
        error_feedback: keep the pruned remainder per client and add it to the next gradient.
    """

    layerwise = True  # each layer's mask and residual from that layer alone

    def __init__(
        self, rate: float = 0.8, *, error_feedback: bool = True, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(error_feedback=error_feedback, seed=seed, nonfinite=nonfinite)
        self.rate = check_rate(rate, "rate")

    def config(self) -> dict[str, Any]:
        return {"rate": self.rate, "error_feedback": self.error_feedback}

    def layer_mask(self, name: str, values: Tensor, out: Tensor) -> Tensor:
        return largest_magnitude_mask_into(values, count_sent(1.0 - self.rate, values.numel()), out, self._workspace)


class RandomPruning(SparsifyingDefense):
    """Zero a uniformly random ``rate`` fraction of every layer (from the client's seeded stream)."""

    layerwise = True  # one permutation per layer, drawn in layer order

    def __init__(
        self, rate: float = 0.8, *, error_feedback: bool = True, seed: int | None = None, nonfinite: str = "error"
    ) -> None:
        super().__init__(error_feedback=error_feedback, seed=seed, nonfinite=nonfinite)
        self.rate = check_rate(rate, "rate")

    def config(self) -> dict[str, Any]:
        return {"rate": self.rate, "error_feedback": self.error_feedback}

    def select(self, values: Mapping[str, Tensor], generator: torch.Generator) -> dict[str, Tensor]:
        masks = {}
        for name, v in values.items():
            n = v.numel()
            mask = torch.ones(n, dtype=torch.bool, device=v.device)
            mask[torch.randperm(n, generator=generator, device=v.device)[: count_for_rate(self.rate, n)]] = False
            masks[name] = mask.view_as(v)
        return masks


class DualGradientPruning(_LayerwisePruning):
    """Dual gradient pruning (DGP paper, Alg. 1): per layer, drop the top-``k1`` and the
    bottom-``k2`` fractions by magnitude and share the band in between; with error feedback
    (Alg. 2, on by default) ``P = g + e``, ``shared = DGP(P)``, ``e' = P - shared``.

    Of an ``n``-entry layer, the ``round(k1 n)`` largest entries are dropped and the next
    ``max(1, round((1 - k1 - k2) n))`` are sent; the rest is the bottom. Every layer sends at
    least one entry, so a size-1 bias is always sent: with error feedback an entry that is never
    sent would grow without bound. Defaults are the paper's: ``k1 = 5%``, ``k2 = 75%``, a send
    rate of 20% and ``p = k1 / k2 = 1/15``.
    """

    layerwise = True  # the top-k1 and bottom-k2 cuts are per layer (Alg. 1)

    def __init__(
        self,
        k1: float = 0.05,
        k2: float = 0.75,
        *,
        error_feedback: bool = True,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        super().__init__(error_feedback=error_feedback, seed=seed, nonfinite=nonfinite)
        self.k1 = check_rate(k1, "k1")
        self.k2 = check_rate(k2, "k2")
        if self.k1 + self.k2 >= 1:
            raise ValueError(f"k1 + k2 must be < 1 so something is sent, got k1={k1} + k2={k2} = {k1 + k2}")

    @classmethod
    def from_send_rate(cls, send_rate: float = 0.2, p: float = 1 / 15, **kwargs: Any) -> DualGradientPruning:
        """Build from the fraction sent, ``1 - k1 - k2``, and the paper's ``p = k1 / k2``."""
        send_rate = check_rate(send_rate, "send_rate")
        if send_rate == 0:
            raise ValueError("send_rate must be > 0 so something is sent")
        p = check_nonnegative(p, "p")  # k1 / k2
        k2 = (1 - send_rate) / (1 + p)
        return cls(k1=p * k2, k2=k2, **kwargs)

    def config(self) -> dict[str, Any]:
        return {"k1": self.k1, "k2": self.k2, "error_feedback": self.error_feedback}

    def layer_mask(self, name: str, values: Tensor, out: Tensor) -> Tensor:
        n = values.numel()
        top = min(count_for_rate(self.k1, n), max(n - 1, 0))  # never the whole layer
        keep = min(count_sent(1 - self.k1 - self.k2, n), n - top)
        return magnitude_band_mask_into(values, top, keep, out, self._workspace)


class AlignedDualGradientPruning(_LayerwisePruning):
    """Aligned dual gradient pruning (ADGP paper, Alg. 1-2).

    Each round one participating client, drawn from ``(seed, round)``, provides the location
    mask ``I``: the top-``2k`` positions of each layer of its error-compensated gradient. Every
    client then drops its own top-``k1`` positions and sends the ``k`` largest remaining entries
    that lie in ``I``; with error feedback (on by default) the rest is carried over. All uploads
    of a round lie in ``I``, so clients download only those positions. The ADGP paper writes
    ``p = k2 / k1`` (the inverse of DGP's ``p``); the defaults ``k = 20%``, ``k1 = 5%`` match DGP's.

    Within a Trainer the mask is set by :meth:`begin_round` (the simulation passes every client;
    under DDP the chosen rank broadcasts it). Called on its own, a client with no round mask
    uses its own top-``2k`` positions, i.e. it is its round's provider.
    """

    mask_reads_gradient_alone = False  # the round's location mask is another client's

    def __init__(
        self,
        k: float = 0.2,
        k1: float = 0.05,
        *,
        error_feedback: bool = True,
        seed: int | None = None,
        nonfinite: str = "error",
    ) -> None:
        super().__init__(error_feedback=error_feedback, seed=seed, nonfinite=nonfinite)
        self.k = check_rate(k, "k")
        self.k1 = check_rate(k1, "k1")
        if self.k1 >= self.k:
            raise ValueError(f"ADGP needs k1 < k (the mask holds the top 2k positions), got k1={k1}, k={k}")
        if 2 * self.k > 1:
            raise ValueError(f"ADGP's mask holds the top 2k positions, so k must be <= 0.5, got k={k}")
        self.round_mask: dict[str, Tensor] | None = None
        self.mask_round: int | None = None
        self.mask_provider: int | None = None
        # the round mask as flat location bits (selection.location_bits), converted once per round
        self._location_bits: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None

    def config(self) -> dict[str, Any]:
        return {"k": self.k, "k1": self.k1, "error_feedback": self.error_feedback}

    def provider(self, round: int, clients: Sequence[int]) -> int:
        """The client that provides round ``round``'s mask (the same draw in every process)."""
        if not clients:
            raise ValueError("a round needs at least one client")
        index = np.random.default_rng([self.seed, round]).integers(len(clients))
        return sorted(clients)[int(index)]

    def location_mask(self, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The top-``2k`` positions of each layer (what the provider broadcasts)."""
        return {n: largest_magnitude_mask(v, count_sent(2 * self.k, v.numel())) for n, v in values.items()}

    def begin_round(
        self, round: int, clients: Sequence[int], local_gradients: Mapping[int, Gradients], share: Share
    ) -> None:
        provider = self.provider(round, clients)
        template = next(iter(local_gradients.values()))
        if provider in local_gradients:
            gradients = local_gradients[provider]
            residual = self._states.get(provider, {}) if self.error_feedback else {}
            compensated = {n: g + residual[n] if n in residual else g for n, g in gradients.items()}
            mask = self.location_mask(compensated)
        else:
            mask = {n: torch.zeros_like(g, dtype=torch.bool) for n, g in template.items()}
        self.round_mask = share(provider, mask)
        self.mask_round, self.mask_provider = round, provider

    def check_inputs(self, gradients: Gradients) -> None:
        if self.round_mask is not None:
            self._check_mask(self.round_mask, gradients)

    @staticmethod
    def _check_mask(mask: Mapping[str, Tensor], values: Mapping[str, Tensor]) -> None:
        if mask.keys() != values.keys() or any(mask[n].shape != v.shape for n, v in values.items()):
            raise ValueError(
                "the ADGP location mask does not match the gradient's layers or shapes; the provider and the "
                "clients must share one model"
            )

    def layer_masks(self, values: Mapping[str, Tensor], generator: torch.Generator) -> Iterator[tuple[str, Tensor]]:
        if self.round_mask is not None:
            self._check_mask(self.round_mask, values)
        return super().layer_masks(values, generator)

    def layer_mask(self, name: str, values: Tensor, out: Tensor) -> Tensor:
        n = values.numel()
        own_top = min(count_for_rate(self.k1, n), max(n - 1, 0))
        if self.round_mask is None:
            # the client's own top-2k mask: the allowed positions are ranks own_top .. 2k - 1, and
            # the k largest of them are the next ranks, a DGP band
            allowed = count_sent(2 * self.k, n) - own_top
            return magnitude_band_mask_into(values, own_top, min(count_sent(self.k, n), allowed), out, self._workspace)
        return self._mask_within(self._location(name), values, own_top, out)

    def _location(self, name: str) -> Tensor:
        assert self.round_mask is not None
        if self._location_bits is None or self._location_bits[0] is not self.round_mask:
            self._location_bits = (self.round_mask, {})
        converted = self._location_bits[1]
        if name not in converted:
            converted[name] = location_bits(self.round_mask[name])
        return converted[name]

    def _mask_within(self, location: Tensor, values: Tensor, own_top: int, out: Tensor) -> Tensor:
        """The ``k`` largest magnitudes among the positions of ``location`` outside the own top-``k1``.

        Ranked among the located entries alone (one histogram with the ranks of all entries),
        the own top-``k1`` takes the first ``taken`` located ranks, so the entries sent are the
        band of located ranks ``taken .. taken + count - 1``.
        """
        everything, located = MagnitudeRanks.with_location(values, location, self._workspace)
        taken = located.count_located(everything.cuts([own_top])[own_top])
        count = min(count_sent(self.k, values.numel()), located.numel - taken)
        cuts = located.cuts([taken, taken + count])
        return located.fill_band(out, cuts[taken], cuts[taken + count])
