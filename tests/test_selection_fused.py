"""The fused selection paths against plain references: ranks among a location mask from one
histogram (ADGP with another client's round mask), the layer-by-layer pruning transform, and
workspace buffers reused from step to step."""

from __future__ import annotations

import pytest
import torch
from test_pruning_fast_paths import layer

from lightning_gp.defenses import AlignedDualGradientPruning, DualGradientPruning, TopKPruning
from lightning_gp.defenses.base import DefenseCall
from lightning_gp.defenses.selection import HISTOGRAM_MIN_NUMEL, MagnitudeRanks, Workspace, location_bits
from lightning_gp.defenses.sparsification import SparsifyingDefense

LARGE = 3 * HISTOGRAM_MIN_NUMEL + 77


def located_order(values: torch.Tensor, location: torch.Tensor) -> torch.Tensor:
    """The located positions in rank order: a full stable sort by magnitude, then the located ones."""
    exact = values.abs().double() if values.dtype == torch.float64 else values.abs().float()
    order = exact.sort(descending=True, stable=True).indices
    return order[location[order]]


def positions_mask(n: int, positions: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[positions] = True
    return mask


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [("gaussian", torch.float32), ("ties", torch.float32), ("ties", torch.bfloat16), ("close", torch.float64)],
)
@pytest.mark.parametrize("n", [50, LARGE])
def test_ranks_within_a_location_equal_a_stable_sort_restricted_to_it(kind, dtype, n):
    values = layer(kind, n, dtype, seed=n)
    location = torch.rand(n, generator=torch.Generator().manual_seed(n + 1)) < 0.4
    everything, located = MagnitudeRanks.with_location(values, location_bits(location), Workspace())
    reference = located_order(values, location)
    assert located.numel == int(location.sum())
    size = located.numel
    counts = sorted({0, 1, size // 7, size // 2, size - 1, size})
    cuts = located.cuts(counts)
    for j in counts:
        expected = positions_mask(n, reference[:j])
        for dtype_out in (torch.bool, torch.float32):
            out = torch.empty(n, dtype=dtype_out)
            assert torch.equal(located.fill_top(out, cuts[j]).bool(), expected), (j, dtype_out)
    for skip in counts:
        for stop in (skip, min(size, skip + size // 3), size):
            out = torch.empty(n, dtype=torch.float32)
            band = located.fill_band(out, cuts[skip], located.cuts([stop])[stop]).bool()
            assert torch.equal(band, positions_mask(n, reference[skip:stop])), (skip, stop)
    # the located entries among the j largest of the layer are the first of the located order
    whole = located_order(values, torch.ones(n, dtype=torch.bool))
    for j in sorted({0, 1, n // 20, n // 3, n - 1, n}):
        in_top = int(location[whole[:j]].sum())
        assert located.count_located(everything.cuts([j])[j]) == in_top, j


def test_a_location_with_no_entries_ranks_nothing():
    values = layer("gaussian", LARGE, torch.float32, seed=1)
    _, located = MagnitudeRanks.with_location(values, location_bits(torch.zeros(LARGE, dtype=torch.bool)))
    assert located.numel == 0
    out = torch.ones(LARGE)
    assert not located.fill_top(out, located.cuts([0])[0]).any()


@pytest.mark.parametrize(
    "make",
    [
        lambda: TopKPruning(rate=0.8, seed=0),
        lambda: DualGradientPruning(seed=0),
        lambda: AlignedDualGradientPruning(seed=0),
        lambda: DualGradientPruning(error_feedback=False, seed=0),
    ],
)
def test_layer_by_layer_transform_gives_the_bits_of_accumulating_the_whole_model_first(make):
    layers = {
        "conv": layer("gaussian", 5 * LARGE, torch.float32, 2).view(5, -1),
        "bias": layer("ties", 300, torch.float32, 3),
        "double": layer("gaussian", LARGE, torch.float64, 4),
    }
    fused, whole = make(), make()
    state_fused = fused.init_client_state(layers)
    state_whole = whole.init_client_state(layers)
    for step in range(3):
        gradients = {n: g * (step + 1) for n, g in layers.items()}
        shared_fused, state_fused = fused.transform(gradients, state_fused, DefenseCall(0, torch.Generator()))
        shared_whole, state_whole = SparsifyingDefense.transform(
            whole, gradients, state_whole, DefenseCall(0, torch.Generator())
        )
        for name in layers:
            assert torch.equal(shared_fused[name], shared_whole[name]), (step, name)
            assert torch.equal(shared_fused[name].signbit(), shared_whole[name].signbit()), (step, name)
        assert state_fused.keys() == state_whole.keys()
        for name in state_fused:
            assert torch.equal(state_fused[name], state_whole[name]), (step, name)


def test_workspace_buffers_are_reused_from_step_to_step():
    gradients = {"w": layer("gaussian", LARGE, torch.float32, 5), "b": layer("ties", 100, torch.float32, 6)}
    other = {n: layer("gaussian", g.numel(), torch.float32, 7).view_as(g) for n, g in gradients.items()}
    foreign = AlignedDualGradientPruning(seed=0)
    provider = next(r for r in range(100) if foreign.provider(r, [0, 1]) == 1)
    foreign.begin_round(provider, [0, 1], {1: other}, lambda source, tensors: tensors)
    for defense in (DualGradientPruning(seed=0), foreign):
        defense(gradients, 0)
        before = {slot: buffer.data_ptr() for slot, buffer in defense._workspace._buffers.items()}
        defense({n: 2 * g for n, g in gradients.items()}, 0)
        after = {slot: buffer.data_ptr() for slot, buffer in defense._workspace._buffers.items()}
        assert before == after and before
