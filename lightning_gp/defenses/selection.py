"""O(n) selection of gradient entries by magnitude: thresholds, never a full sort.

Every selection goes through :func:`kth_largest`, the exact ``k``-th largest magnitude of a
layer. Small layers use ``torch.kthvalue``. Large layers first bracket the threshold with the
quantiles of a strided 1% sample (DGC's sampled threshold, Lin et al. 2018), check the bracket
by counting, and run ``kthvalue`` only on the entries inside it, so the cost is a few
elementwise passes over the layer. The result is exact either way: a bracket that misses falls
back to ``kthvalue`` over the whole layer.

Ties at the threshold are broken by position (lowest flat index first). The rule is the same
for every count, so the ``k`` largest always contain the ``j < k`` largest; that keeps DGP's
dropped top and kept band disjoint.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Layers with fewer entries take the exact kthvalue directly; the sampled bracket pays off above.
SAMPLED_THRESHOLD_MIN_NUMEL = 1 << 17
_SAMPLE_FRACTION = 0.01
_BRACKET_SIGMAS = 6.0


def count_for_rate(rate: float, numel: int) -> int:
    """The number of entries a fraction ``rate`` of ``numel`` stands for, rounded half up.

    The product is first rounded to 9 decimals so float error does not turn an exact half
    down (``0.7 * 45`` is 31.499999999999996 in binary floating point, 31.5 in decimal).
    """
    return min(numel, max(0, int(round(rate * numel, 9) + 0.5)))


def count_sent(rate: float, numel: int) -> int:
    """:func:`count_for_rate`, but at least one entry of a non-empty layer when ``rate > 0``.

    Pruning defenses with error feedback send at least one entry per layer, so no entry of a
    tiny layer accumulates forever; an empty layer sends nothing.
    """
    count = count_for_rate(rate, numel)
    return min(numel, max(1, count)) if rate > 0 else count


def magnitudes(values: Tensor) -> Tensor:
    """``|values|`` flattened, detached, in at least float32 (half precision ties too often)."""
    magnitude = values.detach().abs().flatten()
    if magnitude.dtype in (torch.float16, torch.bfloat16):
        magnitude = magnitude.float()
    return magnitude


def kth_largest(magnitude: Tensor, k: int) -> Tensor:
    """The exact ``k``-th largest entry of the 1-D tensor ``magnitude`` (``1 <= k <= n``), as a 0-d tensor."""
    n = magnitude.numel()
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] for a tensor of {n} entries, got {k}")
    if n >= SAMPLED_THRESHOLD_MIN_NUMEL:
        bracketed = _kth_largest_in_sampled_bracket(magnitude, k)
        if bracketed is not None:
            return bracketed
    return magnitude.kthvalue(n - k + 1).values


def _kth_largest_in_sampled_bracket(magnitude: Tensor, k: int) -> Tensor | None:
    n = magnitude.numel()
    stride = max(1, int(1 / _SAMPLE_FRACTION))
    sample = magnitude[::stride]
    m = sample.numel()
    # the sample rank of the threshold, widened by a few binomial standard deviations
    q = k / n
    centre = q * m
    margin = _BRACKET_SIGMAS * math.sqrt(m * q * (1 - q)) + 2
    high_rank = int(centre - margin)  # ranks counted from the top, 1-based
    low_rank = math.ceil(centre + margin)
    high = sample.kthvalue(m - high_rank + 1).values if high_rank >= 1 else None
    low = sample.kthvalue(m - low_rank + 1).values if low_rank <= m else None
    above = 0 if high is None else int(torch.count_nonzero(magnitude > high))
    if above >= k:
        return None
    if high is not None and low is not None:
        inside = magnitude[(magnitude <= high) & (magnitude >= low)]
    elif high is not None:
        inside = magnitude[magnitude <= high]
    elif low is not None:
        inside = magnitude[magnitude >= low]
    else:
        return None
    if above + inside.numel() < k:
        return None
    rank = k - above  # the threshold's rank from the top among the bracketed entries
    return inside.kthvalue(inside.numel() - rank + 1).values


def largest_entries_mask(scores: Tensor, k: int) -> Tensor:
    """Boolean mask of exactly ``k`` largest entries of the 1-D tensor ``scores``, ties by position."""
    n = scores.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] for a tensor of {n} entries, got {k}")
    if k == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    if k == n:
        return torch.ones_like(scores, dtype=torch.bool)
    return _mask_of_largest(scores, k)


def _mask_of_largest(magnitude: Tensor, k: int) -> Tensor:
    threshold = kth_largest(magnitude, k)
    mask = magnitude >= threshold
    if int(torch.count_nonzero(mask)) == k:
        return mask
    mask = magnitude > threshold
    missing = k - int(torch.count_nonzero(mask))
    tied = (magnitude == threshold).nonzero().flatten()[:missing]
    mask[tied] = True
    return mask


def largest_magnitude_mask(values: Tensor, k: int) -> Tensor:
    """Boolean mask (shape of ``values``) of exactly ``k`` entries with the largest ``|values|``.

    Among tied magnitudes the lowest positions are taken. Linear in the layer size.
    """
    return largest_entries_mask(magnitudes(values), k).view_as(values)


def magnitude_band_mask(values: Tensor, skip: int, keep: int) -> Tensor:
    """Boolean mask of the entries ranked ``skip .. skip + keep - 1`` by descending ``|values|``.

    The band is the ``skip + keep`` largest minus the ``skip`` largest; ties are broken by
    position in both, so the dropped top and the kept band never overlap.
    """
    n = values.numel()
    if skip < 0 or keep < 0 or skip + keep > n:
        raise ValueError(f"skip + keep must be within [0, {n}] for a tensor of {n} entries, got {skip} + {keep}")
    if keep == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    magnitude = magnitudes(values)
    if skip and skip + keep < n:
        top, bottom = kth_largest(magnitude, skip), kth_largest(magnitude, skip + keep)
        band = magnitude >= bottom
        if int(torch.count_nonzero(band)) == skip + keep:
            band &= magnitude < top
            if int(torch.count_nonzero(band)) == keep:
                return band.view_as(values)  # no ties at either threshold, the common case
    band = largest_entries_mask(magnitude, skip + keep)
    if skip:
        band &= ~_mask_of_largest(magnitude, skip)
    return band.view_as(values)
