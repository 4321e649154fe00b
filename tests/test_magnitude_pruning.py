"""MagnitudePruning: exact kept sets, the rounding rule, ties, per-layer pruning, error feedback, dtypes."""

from __future__ import annotations

import pytest
import torch

from lightning_gp.defenses import MagnitudePruning, count_for_rate, largest_magnitude_mask


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def prune(rate: float, values, **kwargs) -> torch.Tensor:
    return MagnitudePruning(rate, **kwargs)({"w": torch.as_tensor(values, dtype=torch.float32)})["w"]


# ------------------------------------------------------------------ exact kept sets


def test_rate_half_keeps_the_two_largest_magnitudes():
    out = prune(0.5, [1.0, -3.0, 2.0, 0.5])
    assert torch.equal(out, torch.tensor([0.0, -3.0, 2.0, 0.0]))


def test_rate_zero_keeps_everything():
    values = torch.tensor([1.0, -3.0, 2.0, 0.5, 0.0, -1e-9])
    assert torch.equal(prune(0.0, values), values)


def test_rate_one_zeros_everything():
    assert torch.equal(prune(1.0, [1.0, -3.0, 2.0, 0.5]), torch.zeros(4))


def test_kept_entries_keep_their_value_and_sign():
    values = torch.randn(100)
    out = prune(0.7, values)
    kept = out != 0
    assert kept.sum() == 30
    assert torch.equal(out[kept], values[kept])
    assert values[kept].abs().min() >= values[~kept].abs().max()


@pytest.mark.parametrize(
    "rate, n, zeroed",
    [
        (0.375, 4, 2),  # 1.5 -> 2 (half up)
        (0.374, 4, 1),  # 1.496 -> 1
        (0.125, 4, 1),  # 0.5 -> 1
        (0.12, 4, 0),  # 0.48 -> 0
        (0.25, 10, 3),  # 2.5 -> 3
        (0.5, 1, 1),  # size-1 bias zeroed at rate 0.5
        (0.49, 1, 0),  # ... and kept below
        (0.9, 1, 1),
        (0.3, 7, 2),  # 2.1 -> 2
    ],
)
def test_zeroed_count_is_rate_times_n_rounded_half_up(rate, n, zeroed):
    values = torch.arange(1, n + 1, dtype=torch.float32)
    out = prune(rate, values)
    assert int((out == 0).sum()) == zeroed
    # the zeroed entries are the smallest ones
    assert torch.equal(out[zeroed:], values[zeroed:])


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.75])
def test_ties_still_zero_exactly_round_rate_times_n_entries(rate):
    n = 20
    for values in (torch.full((n,), 2.5), torch.tensor([1.0, -1.0] * (n // 2))):
        out = prune(rate, values)
        assert int((out == 0).sum()) == count_for_rate(rate, n)
        assert torch.equal(out[out != 0].abs(), values[out != 0].abs())


def test_partial_ties_at_the_threshold_still_give_an_exact_count():
    values = torch.tensor([5.0, 1.0, 1.0, 1.0, 1.0, 0.1])
    out = prune(0.5, values)  # zero 3: the 0.1 and two of the four 1.0s
    assert int((out == 0).sum()) == 3
    assert out[0] == 5.0 and out[5] == 0.0
    assert int((out[1:5] != 0).sum()) == 2


def test_multidim_layers_are_pruned_per_layer_not_globally():
    g = torch.Generator().manual_seed(1)
    tiny_conv = 1e-6 * torch.randn(4, 3, 3, 3, generator=g)
    big_fc = 1e3 * torch.randn(10, 8, generator=g)
    out = MagnitudePruning(0.5)({"conv.weight": tiny_conv, "fc.weight": big_fc})
    assert out["conv.weight"].shape == (4, 3, 3, 3)
    for name, values in (("conv.weight", tiny_conv), ("fc.weight", big_fc)):
        kept = out[name] != 0
        assert int(kept.sum()) == values.numel() // 2, name
        assert values[kept].abs().min() >= values[~kept].abs().max(), name
        assert torch.equal(out[name][kept], values[kept]), name


def test_a_layer_pruned_alone_gives_the_same_mask_as_inside_a_model():
    g = torch.Generator().manual_seed(2)
    layers = {"a": torch.randn(5, 5, generator=g), "b": 100 * torch.randn(7, generator=g)}
    together = MagnitudePruning(0.4)(layers)
    for name, values in layers.items():
        assert torch.equal(MagnitudePruning(0.4)({name: values})[name], together[name])


# ------------------------------------------------------------------ error feedback


def test_error_feedback_sends_the_largest_of_gradient_plus_residual():
    d = MagnitudePruning(0.75, error_feedback=True)  # keep 1 of 4
    first = d({"w": torch.tensor([3.0, 2.0, 0.0, 0.0])})["w"]
    assert torch.equal(first, torch.tensor([3.0, 0.0, 0.0, 0.0]))
    assert torch.equal(d.client_state(0)["w"], torch.tensor([0.0, 2.0, 0.0, 0.0]))
    second = d({"w": torch.tensor([1.5, 1.0, 0.0, 0.0])})["w"]
    # P = [1.5, 3.0, 0, 0]: the accumulated entry wins although the raw gradient ranks it second
    assert torch.equal(second, torch.tensor([0.0, 3.0, 0.0, 0.0]))
    assert torch.equal(d.client_state(0)["w"], torch.tensor([1.5, 0.0, 0.0, 0.0]))
    without = MagnitudePruning(0.75)
    without({"w": torch.tensor([3.0, 2.0, 0.0, 0.0])})
    assert torch.equal(without({"w": torch.tensor([1.5, 1.0, 0.0, 0.0])})["w"], torch.tensor([1.5, 0.0, 0.0, 0.0]))


def test_error_feedback_residual_is_what_was_not_sent():
    d = MagnitudePruning(0.6, error_feedback=True)
    g = torch.Generator().manual_seed(3)
    residual = {
        "conv.weight": torch.zeros(2, 3, 3, 3, dtype=torch.float64),
        "fc.bias": torch.zeros(5, dtype=torch.float64),
    }
    raw_sum = {n: torch.zeros_like(t) for n, t in residual.items()}
    sent_sum = {n: torch.zeros_like(t) for n, t in residual.items()}
    for _ in range(6):
        grads = {n: torch.randn(t.shape, generator=g, dtype=torch.float64) for n, t in residual.items()}
        sent = d(grads)
        for n in grads:
            compensated = grads[n] + residual[n]
            kept = sent[n] != 0
            assert int(kept.sum()) == compensated.numel() - count_for_rate(0.6, compensated.numel())
            assert torch.equal(sent[n][kept], compensated[kept])
            assert compensated[kept].abs().min() >= compensated[~kept].abs().max()
            residual[n] = d.client_state(0)[n]
            assert torch.allclose(residual[n], compensated - sent[n], atol=0, rtol=0)
            raw_sum[n] += grads[n]
            sent_sum[n] += sent[n]
    for n in raw_sum:
        torch.testing.assert_close(sent_sum[n] + d.client_state(0)[n], raw_sum[n], atol=1e-12, rtol=0)


def test_without_error_feedback_no_residual_is_kept():
    d = MagnitudePruning(0.5)
    d({"w": torch.tensor([4.0, 3.0, 2.0, 1.0])})
    assert d.client_state(0) == {}
    assert torch.equal(d({"w": torch.tensor([1.0, 1.5, 0.0, 0.0])})["w"], torch.tensor([1.0, 1.5, 0.0, 0.0]))


def test_rate_zero_with_error_feedback_leaves_a_zero_residual():
    d = MagnitudePruning(0.0, error_feedback=True)
    values = torch.randn(3, 4)
    assert torch.equal(d({"w": values})["w"], values)
    assert torch.equal(d.client_state(0)["w"], torch.zeros(3, 4))


def test_rate_one_with_error_feedback_accumulates_everything():
    d = MagnitudePruning(1.0, error_feedback=True)
    total = torch.zeros(5)
    for _ in range(3):
        g = torch.randn(5)
        total += g
        assert torch.equal(d({"w": g})["w"], torch.zeros(5))
    torch.testing.assert_close(d.client_state(0)["w"], total)


def test_error_feedback_argument_must_be_bool():
    with pytest.raises(TypeError, match="error_feedback"):
        MagnitudePruning(0.5, error_feedback=1)


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtype_is_preserved_in_output_and_residual(dtype):
    d = MagnitudePruning(0.5, error_feedback=True)
    values = torch.tensor([1.0, -3.0, 2.0, 0.5], dtype=dtype)
    out = d({"w": values})["w"]
    assert out.dtype == dtype
    assert torch.equal(out, torch.tensor([0.0, -3.0, 2.0, 0.0], dtype=dtype))
    assert d.client_state(0)["w"].dtype == dtype
    assert torch.equal(d.client_state(0)["w"], torch.tensor([1.0, 0.0, 0.0, 0.5], dtype=dtype))


def test_float16_ranking_is_exact_for_close_values():
    values = torch.tensor([1.0, 1.0009765625, 0.9990234375, -1.001953125], dtype=torch.float16)
    out = prune(0.5, values.float()).to(torch.float16)
    native = MagnitudePruning(0.5)({"w": values})["w"]
    assert torch.equal(native, out)
    assert torch.equal(native != 0, torch.tensor([False, True, False, True]))


# ------------------------------------------------------------------ selection helpers


def test_largest_magnitude_mask_k_zero_is_all_false_and_k_n_all_true():
    values = torch.randn(3, 4)
    none = largest_magnitude_mask(values, 0)
    every = largest_magnitude_mask(values, 12)
    assert none.dtype == torch.bool and none.shape == (3, 4) and not none.any()
    assert every.dtype == torch.bool and every.shape == (3, 4) and every.all()


@pytest.mark.parametrize("k", [-1, 13, 100])
def test_largest_magnitude_mask_rejects_k_outside_0_n(k):
    with pytest.raises(ValueError, match="k must be in \\[0, 12\\]"):
        largest_magnitude_mask(torch.randn(3, 4), k)


@pytest.mark.parametrize("k", [1, 2, 5, 8, 9])  # both the small-k and the large-k branch
def test_largest_magnitude_mask_selects_the_k_largest_magnitudes(k):
    values = torch.tensor([0.1, -9.0, 3.0, -0.5, 7.0, 2.0, -4.0, 0.0, 6.0, -1.0]).view(2, 5)
    order = values.abs().flatten().argsort(descending=True)
    expected = torch.zeros(10, dtype=torch.bool)
    expected[order[:k]] = True
    mask = largest_magnitude_mask(values, k)
    assert mask.shape == (2, 5)
    assert torch.equal(mask.flatten(), expected)


def test_largest_magnitude_mask_takes_exactly_k_among_ties():
    for k in range(9):
        assert int(largest_magnitude_mask(torch.ones(8), k).sum()) == k


@pytest.mark.parametrize(
    "rate, numel, expected",
    [
        (0.0, 10, 0),
        (1.0, 10, 10),
        (0.5, 1, 1),
        (0.49, 1, 0),
        (0.375, 4, 2),
        (0.125, 4, 1),
        (0.1, 4, 0),
        (0.25, 2, 1),
        (0.5, 0, 0),
        (1.0, 0, 0),
        (0.999, 3, 3),
        (0.001, 3, 0),
        (0.25, 1_000_000, 250_000),
    ],
)
def test_count_for_rate_rounds_half_up_within_bounds(rate, numel, expected):
    assert count_for_rate(rate, numel) == expected


@pytest.mark.parametrize("rate, numel, expected", [(0.7, 45, 32), (0.29, 50, 15), (0.58, 25, 15), (0.145, 100, 15)])
def test_count_for_rate_rounds_decimal_half_up_despite_float_error(rate, numel, expected):
    assert count_for_rate(rate, numel) == expected


def test_state_dict_and_client_state_are_copies_that_later_calls_do_not_change():
    d = MagnitudePruning(0.5, error_feedback=True)
    d({"w": torch.randn(8)}, 0)
    saved, view = d.state_dict(), d.client_state(0)
    kept = view["w"].clone()
    d({"w": torch.randn(8)}, 0)
    assert torch.equal(saved["client_states"][0]["w"], kept)
    assert torch.equal(view["w"], kept)
