"""Exact selection of gradient entries by magnitude in a few elementwise passes, never a full sort.

Every selection ranks a layer's entries in one total order: descending magnitude, ties broken by
position (lowest flat index first). The rule is the same for every count, so the ``k`` largest
always contain the ``j < k`` largest; that keeps DGP's dropped top and kept band disjoint.

:class:`MagnitudeRanks` finds any number of ranks of a layer from one radix histogram (a radix
select, as in GPU top-k kernels): the top 16 bits of a non-negative float32 order it like its
value, so one ``bincount`` of these int16 keys says, for every rank at once, which bucket holds
it and how many entries lie above that bucket. Only the entries of those few buckets are
gathered and selected exactly (``kthvalue``, then ties by position); a mask is then one
comparison of the keys (two for a band) plus a fix-up of the gathered positions. Ranks among
the entries of a location mask (ADGP with another client's mask) come from the same histogram
pass, over the key plus a location bit. Layers below :data:`HISTOGRAM_MIN_NUMEL` entries are
ranked by one stable sort. Both paths give exactly the set a full stable sort would.

Every op writes a tensor of its own dtype (comparisons of int16 keys into int16 flags, copied
into a float mask): an ``out=`` of another dtype makes PyTorch allocate a temporary, and on CPU
fresh layer-sized memory costs page faults, often more than the arithmetic.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

# Layers with fewer entries are ranked by one stable sort; the radix histogram pays off above.
HISTOGRAM_MIN_NUMEL = 4096
# float32 bits >> 16: sign (0), 8 exponent bits and 7 mantissa bits, buckets 1/128 of an octave wide
_KEY_SHIFT = 16
# with a location: one mantissa bit less (keys of finite magnitudes < 1 << 14), so the key plus
# the location bit still fits a non-negative int16
_LOCATED_KEY_SHIFT = 17
_LOCATED = 1 << 14


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


class Workspace:
    """Flat scratch tensors reused across layers and steps.

    On CPU a fresh model-sized allocation costs page faults, often more than the arithmetic
    on it; a defense keeps one workspace, sized by its largest layer.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}

    def get(self, slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-D tensor of ``numel`` entries (uninitialised), valid until ``slot`` is asked for again."""
        key = (slot, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel]


class Cut(NamedTuple):
    """The ``j`` largest ranked entries of a layer: those whose key is ``> above`` (none when
    ``above`` is None) plus the positions ``chosen``; ``value`` is the ``j``-th largest
    magnitude (exact, in the layer's precision)."""

    above: int | None
    chosen: Tensor
    value: Tensor | None


def _keys(flat: Tensor, workspace: Workspace, shift: int = _KEY_SHIFT) -> Tensor:
    """The int16 bucket key of every entry: the top ``32 - shift`` bits of its float32 magnitude.

    A float32 layer is keyed from its own bits (shift, then clear the sign), so its magnitudes
    are never written out; other dtypes go through a float32 magnitude (exact for
    float16/bfloat16, rounded for float64: rounding is monotone, so buckets stay intervals and
    the order inside a bucket uses the exact values).
    """
    n = flat.numel()
    key = workspace.get("key", n, torch.int16, flat.device)
    if flat.dtype == torch.float32 and flat.is_contiguous() and sys.byteorder == "little":
        # the high half-word of every float32 (a strided int16 view: no copy) holds sign, exponent
        # and the top 7 mantissa bits: the key is one masking pass (plus a shift with a location)
        high = flat.view(torch.int16)[1::2]
        if shift == _KEY_SHIFT:
            return torch.bitwise_and(high, 0x7FFF, out=key)  # clear the sign
        return torch.bitwise_and(high, 0x7FFF & ~((1 << (shift - 16)) - 1), out=key).bitwise_right_shift_(shift - 16)
    if flat.dtype == torch.float32:
        bits = flat.view(torch.int32)
    else:
        magnitude = workspace.get("magnitude", n, torch.float32, flat.device)
        magnitude.copy_(flat.abs())
        bits = magnitude.view(torch.int32)
    # every op writes its own dtype: an out= of another dtype costs a temporary (page faults)
    shifted = torch.bitwise_right_shift(bits, shift, out=workspace.get("shifted", n, torch.int32, flat.device))
    return key.copy_(shifted).bitwise_and_((1 << (31 - shift)) - 1)  # clear the sign


def location_bits(mask: Tensor) -> Tensor:
    """A location mask (any shape, bool or 0/1) as the flat int16 tensor
    :meth:`MagnitudeRanks.with_location` takes; convert once, reuse for every layer call."""
    return mask.reshape(-1).to(torch.int16) * _LOCATED


class MagnitudeRanks:
    """The ranks of a layer's entries by descending ``|values|``, ties by position.

    Build once per layer, then ask :meth:`cuts` for any ranks; :meth:`fill_top` and
    :meth:`fill_band` write masks. ``values`` must be finite. With a ``workspace``, the keys
    and scratch flags live in its slots. :meth:`with_location` ranks the entries of a location
    mask among themselves, from the same histogram pass as all entries.
    """

    values: Tensor
    numel: int  # entries ranked (all, or the located ones)
    _key: Tensor | None  # per-entry bucket keys (None: ranked by one stable sort)
    _base: int  # the key of bucket 0 of the ranked entries; entries keyed below are not ranked
    _order: Tensor | None  # sorted path: the ranked positions in rank order
    _located: Tensor | None  # with_location: the location bits (to count located entries of a cut)

    def __init__(self, values: Tensor, workspace: Workspace | None = None) -> None:
        flat = values.detach().reshape(-1)
        workspace = workspace if workspace is not None else Workspace()
        if flat.numel() < HISTOGRAM_MIN_NUMEL:
            self._sorted(flat, workspace, None)
        else:
            key = _keys(flat, workspace)
            self._histogram(flat, workspace, key, torch.bincount(key), 0, None)

    @classmethod
    def with_location(
        cls, values: Tensor, located: Tensor, workspace: Workspace | None = None
    ) -> tuple[MagnitudeRanks, MagnitudeRanks]:
        """``(ranks of all entries, ranks of the located entries)`` from one histogram pass.

        ``located`` comes from :func:`location_bits`. The located entries keep the layer's
        order restricted to them, so the located entries among the ``j`` largest of the layer
        are the first ones of the located order (:meth:`count_located`).
        """
        flat = values.detach().reshape(-1)
        workspace = workspace if workspace is not None else Workspace()
        everything, inside = cls.__new__(cls), cls.__new__(cls)
        if flat.numel() < HISTOGRAM_MIN_NUMEL:
            everything._sorted(flat, workspace, None)
            inside._sorted(flat, workspace, located, everything._order)
            return everything, inside
        key = _keys(flat, workspace, _LOCATED_KEY_SHIFT)
        # one histogram over key + location bit: its halves count the located and the other entries
        combined = torch.add(key, located, out=workspace.get("located_key", flat.numel(), torch.int16, flat.device))
        counts = torch.bincount(combined, minlength=2 * _LOCATED)
        everything._histogram(flat, workspace, key, counts[:_LOCATED] + counts[_LOCATED:], 0, None)
        inside._histogram(flat, workspace, combined, counts[_LOCATED:], _LOCATED, located)
        return everything, inside

    def _sorted(self, flat: Tensor, workspace: Workspace, located: Tensor | None, order: Tensor | None = None) -> None:
        self.values, self._workspace, self._key, self._base, self._located = flat, workspace, None, 0, located
        if order is None:
            order = self._exact(None).sort(descending=True, stable=True).indices
        self._order = order if located is None else order[located[order] != 0]
        self.numel = self._order.numel()

    def _histogram(
        self, flat: Tensor, workspace: Workspace, key: Tensor, counts: Tensor, base: int, located: Tensor | None
    ) -> None:
        self.values, self._workspace, self._key, self._base, self._located = flat, workspace, key, base, located
        self._order = None
        present = counts.nonzero()
        top = int(present[-1]) if present.numel() else 0
        self._top_key = base + top
        self._at_or_above = counts[: top + 1].flip(0).cumsum(0)  # [i]: ranked entries with key >= top_key - i
        self.numel = int(self._at_or_above[-1])

    def _exact(self, positions: Tensor | None) -> Tensor:
        """Exact magnitudes (float64 for float64 layers, else float32) at ``positions`` (all if None)."""
        picked = (self.values if positions is None else self.values[positions]).abs()
        return picked if picked.dtype in (torch.float32, torch.float64) else picked.float()

    def cuts(self, ranks: Sequence[int]) -> dict[int, Cut]:
        """The cut of the ``j`` largest ranked entries for every ``j`` in ``ranks`` (``0 <= j <= numel``)."""
        n = self.numel
        for j in ranks:
            if not 0 <= j <= n:
                raise ValueError(f"k must be in [0, {n}] for a tensor of {n} entries, got {j}")
        empty = torch.empty(0, dtype=torch.long, device=self.values.device)
        result: dict[int, Cut] = {}
        if 0 in ranks:
            result[0] = Cut(None, empty, None)
        if self._order is not None:
            exact = self._exact(None)
            for j in {j for j in ranks if j > 0}:
                result[j] = Cut(None, self._order[:j], exact[self._order[j - 1]])
            return result
        assert self._key is not None
        if n in ranks and n > 0:  # every ranked entry: all keys from the base up
            everything = self._exact(None) if self._located is None else self._exact(self._key >= self._base)
            result[n] = Cut(self._base - 1, empty, everything.min())
        inner = sorted({j for j in ranks if 0 < j < n})
        if not inner:
            return result
        wanted = torch.tensor(inner, dtype=self._at_or_above.dtype, device=self._at_or_above.device)
        index = torch.searchsorted(self._at_or_above, wanted)
        above = torch.where(index > 0, self._at_or_above[(index - 1).clamp(min=0)], 0)
        buckets = [self._top_key - i for i in index.tolist()]
        remaining = [j - a for j, a in zip(inner, above.tolist())]
        distinct = sorted(set(buckets))
        # the gathered entries' flags (0/1 in the key dtype: comparisons into it are vectorised,
        # into bool they are not), padded to whole blocks for _positions
        n_all, key = self.values.numel(), self._key
        per_block = _PAD_BYTES // key.element_size()
        gather = self._workspace.get("gather", -(-n_all // per_block) * per_block, key.dtype, key.device)
        gather[n_all:] = 0
        torch.eq(key, distinct[0], out=gather[:n_all])
        if len(distinct) > 1:
            scratch = self._workspace.get("key_scratch", n_all, key.dtype, key.device)
            for bucket in distinct[1:]:
                gather[:n_all].bitwise_or_(torch.eq(key, bucket, out=scratch))
        positions = _positions(gather)
        keys = key[positions] if len(distinct) > 1 else None
        gathered: dict[int, tuple[Tensor, Tensor]] = {}
        for bucket in distinct:
            in_bucket = positions if keys is None else positions[keys == bucket]
            gathered[bucket] = (in_bucket, self._exact(in_bucket))
        for j, bucket, r in zip(inner, buckets, remaining):
            result[j] = Cut(bucket, *_largest_of_bucket(*gathered[bucket], r))
        return result

    def count_located(self, cut: Cut) -> int:
        """How many located entries lie in ``cut``, a cut of the ranks of all entries (for the
        ranks :meth:`with_location` returns second)."""
        if self._located is None:
            raise ValueError("count_located needs the located ranks of MagnitudeRanks.with_location")
        count = int((self._located[cut.chosen] != 0).sum()) if cut.chosen.numel() else 0
        if cut.above is not None and self._order is None:
            index = self._top_key - (self._base + cut.above + 1)  # located keys above the cut's bucket
            if index >= 0:
                count += int(self._at_or_above[min(index, self._at_or_above.numel() - 1)])
        return count

    def fill_top(self, out: Tensor, cut: Cut) -> Tensor:
        """Write the 0/1 (or bool) mask of ``cut``'s entries into the flat ``out``."""
        if cut.above is None:
            out.zero_()
        else:
            assert self._key is not None
            self._into(out, torch.gt(self._key, cut.above, out=self._flags(out)))
        out[cut.chosen] = 1
        return out

    def _flags(self, out: Tensor) -> Tensor:
        """Where a comparison of the keys writes: ``out`` if bool or of the key dtype, else a
        scratch of the key dtype (into another dtype the comparison would make a temporary)."""
        assert self._key is not None
        if out.dtype in (torch.bool, self._key.dtype):
            return out
        return self._workspace.get("key_scratch", self._key.numel(), self._key.dtype, self._key.device)

    @staticmethod
    def _into(out: Tensor, flags: Tensor) -> None:
        if flags is not out:
            out.copy_(flags)

    def fill_band(self, out: Tensor, skip: Cut, stop: Cut) -> Tensor:
        """Write the mask of the entries in ``stop`` but not in ``skip`` (ranks ``j_skip .. j_stop - 1``)."""
        if skip.above is None or stop.above is None:
            self.fill_top(out, stop)
        elif stop.above >= skip.above:  # one bucket holds both cuts: the band is stop's chosen minus skip's
            out.zero_()
            out[stop.chosen] = 1
        else:  # keys in (stop.above, skip.above] in two vectorised passes: clamp, then compare
            assert self._key is not None
            bounded = self._workspace.get("key_scratch", self._key.numel(), self._key.dtype, self._key.device)
            torch.clamp(self._key, stop.above + 1, skip.above, out=bounded)
            self._into(out, torch.eq(self._key, bounded, out=bounded if out.dtype != torch.bool else out))
            out[stop.chosen] = 1
        out[skip.chosen] = 0
        return out


def _largest_of_bucket(positions: Tensor, exact: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """The ``r`` largest of one bucket's entries (``positions`` ascending, their exact
    magnitudes), ties by position, and the ``r``-th largest value: a selection, not a sort
    (a stable sort of a bucket costs ten times as much)."""
    value = exact.kthvalue(exact.numel() - r + 1).values
    tied = exact == value
    # the entries above the value, and the lowest positions among those equal to it
    keep = (exact > value) | (tied & (tied.cumsum(0) <= r - int((exact > value).sum())))
    return positions[keep], value


# _positions sums blocks of this many words first, and scans only the words of non-empty blocks
_BLOCK_WORDS = 16
# gather flags are padded to whole blocks of 8-byte words
_PAD_BYTES = 8 * _BLOCK_WORDS


def _positions(flags: Tensor) -> Tensor:
    """Ascending positions of the nonzero entries of a 1-D tensor of 0/1 flags of whole
    :data:`_PAD_BYTES` blocks, when few are nonzero: a sum per block of words, a scan of the
    words of the non-empty blocks, then of the entries of the words that hold one."""
    per_word = 8 // flags.element_size()
    blocks = flags.view(torch.int64).view(-1, _BLOCK_WORDS)
    busy = blocks.sum(1).nonzero().squeeze(1)  # words of 0/1 flags are non-negative: a zero sum is an empty block
    inner = blocks[busy].nonzero()
    words = busy[inner[:, 0]] * _BLOCK_WORDS + inner[:, 1]
    candidates = (words.unsqueeze(1) * per_word + torch.arange(per_word, device=flags.device)).flatten()
    return candidates[flags[candidates] != 0]


def kth_largest(magnitude: Tensor, k: int) -> Tensor:
    """The exact ``k``-th largest entry of the 1-D tensor ``magnitude`` (``1 <= k <= n``), as a 0-d tensor."""
    n = magnitude.numel()
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] for a tensor of {n} entries, got {k}")
    if bool(magnitude.min() >= 0):
        value = MagnitudeRanks(magnitude).cuts([k])[k].value
        assert value is not None
        return value.to(magnitude.dtype)
    return magnitude.kthvalue(n - k + 1).values


def largest_entries_mask(scores: Tensor, k: int) -> Tensor:
    """Boolean mask of exactly ``k`` largest entries of the 1-D tensor ``scores``, ties by position."""
    n = scores.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] for a tensor of {n} entries, got {k}")
    if k == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    if k == n:
        return torch.ones_like(scores, dtype=torch.bool)
    if bool(scores.min() >= 0):  # non-negative scores are their own magnitudes
        ranks = MagnitudeRanks(scores)
        return ranks.fill_top(torch.empty(n, dtype=torch.bool, device=scores.device), ranks.cuts([k])[k])
    # signed scores: the exact threshold, then the lowest tied positions
    threshold = scores.kthvalue(n - k + 1).values
    mask = scores > threshold
    tied = (scores == threshold).nonzero().flatten()[: k - int(torch.count_nonzero(mask))]
    mask[tied] = True
    return mask


def largest_magnitude_mask(values: Tensor, k: int) -> Tensor:
    """Boolean mask (shape of ``values``) of exactly ``k`` entries with the largest ``|values|``.

    Among tied magnitudes the lowest positions are taken. Linear in the layer size.
    """
    out = torch.empty(values.numel(), dtype=torch.bool, device=values.device)
    return largest_magnitude_mask_into(values, k, out).view(values.shape)


def largest_magnitude_mask_into(values: Tensor, k: int, out: Tensor, workspace: Workspace | None = None) -> Tensor:
    """:func:`largest_magnitude_mask` written into the flat ``out`` (bool or 0/1 in a float dtype)."""
    n = values.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] for a tensor of {n} entries, got {k}")
    if k in (0, n):  # nothing to rank
        return out.fill_(k == n)
    ranks = MagnitudeRanks(values, workspace)
    return ranks.fill_top(out, ranks.cuts([k])[k])


def magnitude_band_mask(values: Tensor, skip: int, keep: int) -> Tensor:
    """Boolean mask of the entries ranked ``skip .. skip + keep - 1`` by descending ``|values|``.

    The band is the ``skip + keep`` largest minus the ``skip`` largest; ties are broken by
    position in both, so the dropped top and the kept band never overlap.
    """
    out = torch.empty(values.numel(), dtype=torch.bool, device=values.device)
    return magnitude_band_mask_into(values, skip, keep, out).view(values.shape)


def magnitude_band_mask_into(
    values: Tensor, skip: int, keep: int, out: Tensor, workspace: Workspace | None = None
) -> Tensor:
    """:func:`magnitude_band_mask` written into the flat ``out`` (bool or 0/1 in a float dtype):
    both ranks from one histogram pass."""
    n = values.numel()
    if skip < 0 or keep < 0 or skip + keep > n:
        raise ValueError(f"skip + keep must be within [0, {n}] for a tensor of {n} entries, got {skip} + {keep}")
    if skip == 0 or keep == 0:
        return largest_magnitude_mask_into(values, keep, out, workspace)
    ranks = MagnitudeRanks(values, workspace)
    cuts = ranks.cuts([skip, skip + keep])
    return ranks.fill_band(out, cuts[skip], cuts[skip + keep])
