"""Upload size of one layer under the cheapest of dense / values+bitmap / values+int32-index encodings."""

from __future__ import annotations

import pytest
import torch

from lightning_gp.callbacks.communication import dense_nbytes, encoded_nbytes


def with_nonzeros(n: int, k: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.zeros(n, dtype=dtype)
    t[torch.randperm(n, generator=g)[:k]] = torch.rand(k, generator=g).to(dtype) + 1.0  # nonzero values
    assert int(torch.count_nonzero(t)) == k
    return t


@pytest.mark.parametrize(
    "dtype, size", [(torch.float32, 4), (torch.float16, 2), (torch.float64, 8), (torch.bfloat16, 2)]
)
def test_dense_nbytes_is_numel_times_element_size(dtype, size):
    assert dense_nbytes(torch.ones(3, 5, dtype=dtype)) == 15 * size


def test_a_dense_tensor_costs_its_dense_bytes():
    t = torch.randn(10, 100) + 10.0  # no zeros
    assert encoded_nbytes(t) == dense_nbytes(t) == 4000


def test_twenty_percent_nonzeros_cost_values_plus_bitmap():
    t = with_nonzeros(1000, 200)
    assert encoded_nbytes(t) == 200 * 4 + 125


def test_a_very_sparse_tensor_costs_values_plus_int32_indices():
    t = with_nonzeros(10_000, 3)
    assert encoded_nbytes(t) == 3 * 4 + 3 * 4


def test_an_all_zero_tensor_costs_nothing():
    assert encoded_nbytes(torch.zeros(1000)) == 0
    assert encoded_nbytes(torch.zeros(7, 3, 3, dtype=torch.float16)) == 0


def test_float16_values_cost_two_bytes_each():
    assert encoded_nbytes(with_nonzeros(1000, 200, torch.float16)) == 200 * 2 + 125
    assert encoded_nbytes(with_nonzeros(10_000, 3, torch.float16)) == 3 * 2 + 3 * 4
    assert encoded_nbytes(torch.ones(100, dtype=torch.float16)) == 200


def test_bitmap_rounds_up_to_whole_bytes():
    t = with_nonzeros(1001, 200)
    assert encoded_nbytes(t) == 200 * 4 + 126


def test_encoding_picks_the_cheapest_around_the_crossovers():
    n = 1000  # bitmap 125 bytes; values+index cheaper while 4k < 125, dense cheaper once 4k + 125 > 4000
    assert encoded_nbytes(with_nonzeros(n, 31)) == 31 * 4 + 31 * 4  # 248 < 124 + 125
    assert encoded_nbytes(with_nonzeros(n, 32)) == 32 * 4 + 125  # 253 < 256
    assert encoded_nbytes(with_nonzeros(n, 968)) == 968 * 4 + 125  # 3997 < 4000
    assert encoded_nbytes(with_nonzeros(n, 969)) == 4000  # 4001 > 4000


def test_multidimensional_layers_are_counted_over_all_entries():
    t = with_nonzeros(1000, 200).view(10, 10, 10)
    assert encoded_nbytes(t) == 200 * 4 + 125


def test_encoded_size_never_exceeds_dense_size():
    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 9, 64, 333):
        for k in range(0, n + 1, max(1, n // 7)):
            t = with_nonzeros(n, k, seed=int(torch.randint(0, 1000, (), generator=g)))
            assert 0 <= encoded_nbytes(t) <= dense_nbytes(t)
