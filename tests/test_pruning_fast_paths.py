"""The radix-histogram selection and the fused pruning transform against a full stable sort.

The reference ranks a layer by one stable sort of the exact magnitudes (descending, ties by
position) and shares ``P * mask`` with residual ``P - shared``; the fast paths must give the same
masks and the same bits, on both sides of the histogram size threshold, with heavy ties, exact
zeros, tiny layers, rates 0 and 1, and every floating dtype.
"""

from __future__ import annotations

import pytest
import torch

from lightning_gp.defenses import (
    AlignedDualGradientPruning,
    DualGradientPruning,
    MagnitudePruning,
    TopKPruning,
    count_for_rate,
    count_sent,
    kth_largest,
    largest_entries_mask,
    largest_magnitude_mask,
    magnitude_band_mask,
)
from lightning_gp.defenses.selection import HISTOGRAM_MIN_NUMEL

LARGE = 3 * HISTOGRAM_MIN_NUMEL + 77
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def reference_order(values: torch.Tensor) -> torch.Tensor:
    exact = values.detach().flatten().abs()
    exact = exact.double() if exact.dtype == torch.float64 else exact.float()
    return exact.sort(descending=True, stable=True).indices


def reference_band(values: torch.Tensor, skip: int, keep: int) -> torch.Tensor:
    mask = torch.zeros(values.numel(), dtype=torch.bool)
    mask[reference_order(values)[skip : skip + keep]] = True
    return mask.view(values.shape)


def layer(kind: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        values = torch.randn(n, generator=gen, dtype=torch.float64)
    elif kind == "ties":  # a few distinct magnitudes, both signs, many exact zeros
        values = torch.randint(-3, 4, (n,), generator=gen).double() * 0.5
    elif kind == "zeros":  # mostly exact zeros: a cut inside one huge tied bucket
        values = torch.randn(n, generator=gen, dtype=torch.float64) * (torch.rand(n, generator=gen) < 0.1)
    else:  # "close": float64 values that round to the same float32, so only exact order separates them
        values = 1.0 + torch.randperm(n, generator=gen).double() * 1e-13
    return values.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# "close" only in float64: no other dtype holds values closer than float32 can tell apart
KINDS_AND_DTYPES = [(k, d) for k in ("gaussian", "ties", "zeros") for d in DTYPES] + [("close", torch.float64)]


@pytest.mark.parametrize(("kind", "dtype"), KINDS_AND_DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 50, LARGE])
def test_top_and_band_masks_equal_a_stable_sort(kind, n, dtype):
    values = layer(kind, n, dtype, seed=n)
    counts = sorted({0, 1, n // 20, n // 4, n // 2, n - 1, n} & set(range(n + 1)))
    for k in counts:
        assert torch.equal(largest_magnitude_mask(values, k), reference_band(values, 0, k)), k
    for skip in counts:
        for keep in {0, min(1, n - skip), (n - skip) // 3, n - skip}:
            assert torch.equal(magnitude_band_mask(values, skip, keep), reference_band(values, skip, keep)), (
                skip,
                keep,
            )


@pytest.mark.parametrize("kind", ["gaussian", "ties"])
def test_kth_largest_and_signed_scores_equal_a_stable_sort(kind):
    values = layer(kind, LARGE, torch.float32, seed=3)
    ranked = values.abs().sort(descending=True).values
    for k in (1, 77, LARGE // 3, LARGE):
        assert kth_largest(values.abs(), k) == ranked[k - 1]
    signed = values - 0.25  # negative scores take the kthvalue path
    for k in (0, 5, LARGE // 2, LARGE):
        expected = torch.zeros(LARGE, dtype=torch.bool)
        expected[signed.sort(descending=True, stable=True).indices[:k]] = True
        assert torch.equal(largest_entries_mask(signed, k), expected)
        assert torch.equal(largest_entries_mask(values.abs(), k), reference_band(values, 0, k))


def reference_defense(make, kind: str, layers: dict[str, torch.Tensor], steps: int):
    """Run ``steps`` rounds of the reference rule; yield (shared, residual) per step."""
    residual = {n: torch.zeros_like(v) for n, v in layers.items()}
    for step in range(steps):
        shared = {}
        for name, g in layers.items():
            p = residual[name] + g * (step + 1)
            n = p.numel()
            if kind == "topk":
                mask = reference_band(p, 0, count_sent(1.0 - make.rate, n))
            elif kind == "magnitude":
                mask = reference_band(p, 0, n - count_for_rate(make.rate, n))
            else:
                top = min(count_for_rate(make.k1, n), max(n - 1, 0))
                if kind == "dgp":
                    mask = reference_band(p, top, min(count_sent(1 - make.k1 - make.k2, n), n - top))
                else:  # ADGP without a round mask: its own top-2k, minus its top-k1, k largest
                    allowed = count_sent(2 * make.k, n) - top
                    mask = reference_band(p, top, min(count_sent(make.k, n), allowed))
            shared[name] = p * mask
            residual[name] = p - shared[name]
        yield shared, residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("kind", "make"),
    [
        ("topk", lambda: TopKPruning(rate=0.8, seed=0)),
        ("topk", lambda: TopKPruning(rate=1.0, seed=0)),
        ("topk", lambda: TopKPruning(rate=0.0, seed=0)),
        ("magnitude", lambda: MagnitudePruning(0.8, error_feedback=True, seed=0)),
        ("magnitude", lambda: MagnitudePruning(0.0, error_feedback=True, seed=0)),
        ("magnitude", lambda: MagnitudePruning(1.0, error_feedback=True, seed=0)),
        ("dgp", lambda: DualGradientPruning(seed=0)),
        ("dgp", lambda: DualGradientPruning(k1=0.0, k2=0.0, seed=0)),
        ("adgp", lambda: AlignedDualGradientPruning(seed=0)),
    ],
)
def test_defenses_share_the_reference_bits_and_keep_the_reference_residual(kind, make, dtype):
    layers = {
        "tiny": layer("gaussian", 1, dtype, 1),
        "pair": layer("ties", 2, dtype, 2),
        "three": layer("ties", 3, dtype, 3),
        "conv": layer("ties", 300, dtype, 4).view(3, 10, 10),
        "big": layer("gaussian", LARGE, dtype, 5),
        "sparse": layer("zeros", LARGE, dtype, 6),
    }
    defense, reference = make(), make()
    for step, (shared_ref, residual_ref) in enumerate(reference_defense(reference, kind, layers, steps=3)):
        shared = defense({n: g * (step + 1) for n, g in layers.items()}, 0)
        residual = defense.client_state(0)
        for name in layers:
            assert shared[name].dtype == dtype and shared[name].shape == layers[name].shape
            assert torch.equal(bits(shared[name]), bits(shared_ref[name])), (step, name)
            assert torch.equal(bits(residual[name]), bits(residual_ref[name])), (step, name)


def test_select_returns_independent_bool_masks_equal_to_the_applied_ones():
    defense = DualGradientPruning(error_feedback=False, seed=0)
    layers = {"a": layer("gaussian", LARGE, torch.float32, 7), "b": layer("ties", LARGE, torch.float32, 8)}
    masks = defense.select(layers, torch.Generator())
    shared = defense(layers)
    for name, values in layers.items():
        assert masks[name].dtype == torch.bool and masks[name].shape == values.shape
        assert torch.equal(shared[name] != 0, masks[name] & (values != 0))
        assert torch.equal(masks[name], reference_band(values, count_for_rate(0.05, LARGE), count_sent(0.2, LARGE)))


def reference_adgp_within(location: torch.Tensor, p: torch.Tensor, k: float, k1: float) -> torch.Tensor:
    n = p.numel()
    own_top = reference_band(p, 0, min(count_for_rate(k1, n), max(n - 1, 0))).flatten()
    allowed = location.flatten() & ~own_top
    count = min(count_sent(k, n), int(allowed.sum()))
    exact = p.flatten().abs().double()
    scores = torch.where(allowed, exact, torch.tensor(-1.0, dtype=torch.float64))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[scores.sort(descending=True, stable=True).indices[:count]] = True
    return mask.view(p.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gaussian", "ties", "zeros"])
def test_adgp_inside_a_foreign_round_mask_equals_the_reference(kind, dtype):
    # "zeros": fewer positive allowed magnitudes than the count sent, so the cut reaches the
    # allowed zeros, which must still rank above the disallowed positions (by position)
    gen = torch.Generator().manual_seed(9)
    for n in (3, 60, LARGE):
        adgp = AlignedDualGradientPruning(k=0.2, k1=0.05, error_feedback=False, seed=0)
        values = layer(kind, n, dtype, seed=n + 1)
        location = torch.rand(n, generator=gen) < 0.4
        adgp.round_mask = {"w": location}
        shared = adgp({"w": values})["w"]
        expected = reference_adgp_within(location, values, 0.2, 0.05)
        assert torch.equal(bits(shared), bits(values * expected)), n


def test_a_cut_inside_a_huge_bucket_of_exact_zeros_takes_the_lowest_positions():
    n = 70_001  # the zero bucket is large enough to be recognised as one tied value
    values = torch.zeros(n)
    values[torch.randperm(n, generator=torch.Generator().manual_seed(10))[:500]] = 1.0 + torch.rand(500)
    for k in (499, 500, 501, 40_000, n - 1):
        assert torch.equal(largest_magnitude_mask(values, k), reference_band(values, 0, k)), k
    assert torch.equal(magnitude_band_mask(values, 300, 30_000), reference_band(values, 300, 30_000))
