"""O(n) selection of gradient entries by magnitude (``torch.topk``, never a full sort)."""

from __future__ import annotations

import torch
from torch import Tensor


def count_for_rate(rate: float, numel: int) -> int:
    """The number of entries a fraction ``rate`` of ``numel`` stands for, rounded half up.

    The product is first rounded to 9 decimals so float error does not turn an exact half
    down (``0.7 * 45`` is 31.499999999999996 in binary floating point, 31.5 in decimal).
    """
    return min(numel, max(0, int(round(rate * numel, 9) + 0.5)))


def largest_magnitude_mask(values: Tensor, k: int) -> Tensor:
    """Boolean mask (shape of ``values``) of exactly ``k`` entries with the largest ``|values|``.

    Among tied magnitudes, which entries are taken is decided by ``torch.topk``. Runs ``topk`` on
    the smaller side (``k`` or ``n - k`` entries), so the cost is linear in ``n`` for small sides.
    """
    n = values.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] for a tensor of {n} entries, got {k}")
    if k == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    if k == n:
        return torch.ones_like(values, dtype=torch.bool)
    magnitude = values.detach().abs().flatten()
    if magnitude.dtype in (torch.float16, torch.bfloat16):
        magnitude = magnitude.float()
    mask = torch.zeros(n, dtype=torch.bool, device=values.device)
    if k <= n - k:
        mask[magnitude.topk(k, largest=True, sorted=False).indices] = True
    else:
        mask.fill_(True)
        mask[magnitude.topk(n - k, largest=False, sorted=False).indices] = False
    return mask.view_as(values)


def magnitude_band_mask(values: Tensor, skip: int, keep: int) -> Tensor:
    """Boolean mask of the entries ranked ``skip .. skip + keep - 1`` by descending ``|values|``.

    One ``topk`` of size ``skip + keep`` (sorted) decides both ends, so the dropped top and the
    kept band never overlap, even among tied magnitudes; only that prefix is sorted.
    """
    n = values.numel()
    if skip < 0 or keep < 0 or skip + keep > n:
        raise ValueError(f"skip + keep must be within [0, {n}] for a tensor of {n} entries, got {skip} + {keep}")
    mask = torch.zeros(n, dtype=torch.bool, device=values.device)
    if keep == 0:
        return mask.view_as(values)
    magnitude = values.detach().abs().flatten()
    if magnitude.dtype in (torch.float16, torch.bfloat16):
        magnitude = magnitude.float()
    ranked = magnitude.topk(skip + keep, largest=True, sorted=True).indices
    mask[ranked[skip:]] = True
    return mask.view_as(values)
