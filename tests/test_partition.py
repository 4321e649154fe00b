"""Client partitions: IID, Dirichlet label skew, label shards, and the dispatcher."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_gp.federated import dirichlet_partition, iid_partition, label_histogram, partition, shard_partition
from lightning_gp.federated.partition import PARTITION_SCHEMES


def balanced_labels(num_classes: int, per_class: int, *, shuffled: bool = False, seed: int = 0) -> np.ndarray:
    labels = np.repeat(np.arange(num_classes), per_class)
    if shuffled:
        labels = np.random.default_rng(seed).permutation(labels)
    return labels


def assert_disjoint_cover(parts: list[torch.Tensor], num_samples: int) -> None:
    assert all(p.dtype == torch.int64 and p.ndim == 1 for p in parts)
    everything = torch.cat(parts)
    assert len(everything) == num_samples
    assert torch.equal(everything.sort().values, torch.arange(num_samples))


def same_parts(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ iid


@pytest.mark.parametrize("num_samples, num_clients", [(100, 7), (10, 10), (11, 3), (1000, 1)])
def test_iid_partition_is_a_disjoint_cover_with_sizes_within_one(num_samples, num_clients):
    parts = iid_partition(num_samples, num_clients, seed=3)
    assert len(parts) == num_clients
    assert_disjoint_cover(parts, num_samples)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_iid_partition_is_deterministic_under_seed_and_seed_dependent():
    assert same_parts(iid_partition(200, 5, seed=1), iid_partition(200, 5, seed=1))
    assert not same_parts(iid_partition(200, 5, seed=1), iid_partition(200, 5, seed=2))


def test_iid_partition_shuffles_rather_than_cutting_contiguous_blocks():
    parts = iid_partition(1000, 4, seed=0)
    # contiguous blocks would put 0..249 in part 0; a shuffle spreads every part over the range
    for p in parts:
        assert p.min() < 100 and p.max() > 900
        assert torch.equal(p, p.sort().values)  # each part is returned sorted


@pytest.mark.parametrize("num_clients", [0, -1, 2.0, True, "3"])
def test_iid_partition_rejects_bad_num_clients(num_clients):
    with pytest.raises(ValueError, match="num_clients"):
        iid_partition(10, num_clients)


def test_more_clients_than_samples_is_a_value_error():
    with pytest.raises(ValueError, match="fewer samples than clients"):
        iid_partition(5, 6)
    with pytest.raises(ValueError, match="fewer samples than clients"):
        dirichlet_partition(balanced_labels(2, 2), 5, alpha=1.0)
    with pytest.raises(ValueError, match="fewer samples than clients"):
        partition("iid", 11, num_samples=10)


# ------------------------------------------------------------------ dirichlet


def majority_fraction(parts: list[torch.Tensor], labels: np.ndarray, num_classes: int) -> float:
    hist = label_histogram(parts, labels, num_classes).double()
    return float((hist.max(1).values / hist.sum(1)).mean())


def test_dirichlet_partition_is_a_disjoint_cover_respecting_min_size():
    labels = balanced_labels(10, 100, shuffled=True)
    parts = dirichlet_partition(labels, 10, alpha=1.0, seed=4, min_size=40)
    assert len(parts) == 10
    assert_disjoint_cover(parts, len(labels))
    assert min(len(p) for p in parts) >= 40


def test_dirichlet_small_alpha_skews_labels_far_more_than_large_alpha():
    labels = balanced_labels(10, 100, shuffled=True)
    skewed = majority_fraction(dirichlet_partition(labels, 10, alpha=0.1, seed=0), labels, 10)
    near_iid = majority_fraction(dirichlet_partition(labels, 10, alpha=100.0, seed=0), labels, 10)
    assert near_iid < 0.25  # close to the 1/10 of a balanced client
    assert skewed > 0.5
    assert skewed > near_iid + 0.3


def test_dirichlet_partition_is_deterministic_under_seed_and_accepts_tensor_targets():
    labels = balanced_labels(5, 40, shuffled=True)
    a = dirichlet_partition(labels, 4, alpha=0.5, seed=9)
    b = dirichlet_partition(torch.from_numpy(labels), 4, alpha=0.5, seed=9)
    assert same_parts(a, b)
    assert not same_parts(a, dirichlet_partition(labels, 4, alpha=0.5, seed=10))


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan")])
def test_dirichlet_alpha_must_be_positive(alpha):
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition(balanced_labels(3, 10), 3, alpha=alpha)


def test_dirichlet_impossible_min_size_is_a_value_error_with_a_clear_message():
    labels = balanced_labels(10, 10)  # 100 samples: 10 clients cannot all hold 11
    with pytest.raises(ValueError, match=r"10 clients >= 11 samples"):
        dirichlet_partition(labels, 10, alpha=1.0, min_size=11)


@pytest.mark.parametrize("targets", [np.zeros(10, dtype=np.float32), np.zeros((5, 2), dtype=np.int64)])
def test_label_schemes_need_1d_integer_targets(targets):
    with pytest.raises(ValueError, match="targets must be a 1-D integer array"):
        dirichlet_partition(targets, 2, alpha=1.0)
    with pytest.raises(ValueError, match="targets must be a 1-D integer array"):
        shard_partition(targets, 2)


# ------------------------------------------------------------------ shards


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("shards_per_client", [1, 2, 3])
def test_shard_partition_gives_each_client_at_most_shards_per_client_labels(shuffled, shards_per_client):
    num_clients = 10
    # 10 classes of 60: 60 is a multiple of every shard size below, so no shard straddles two classes
    labels = balanced_labels(10, 60, shuffled=shuffled, seed=1)
    parts = shard_partition(labels, num_clients, shards_per_client, seed=2)
    assert_disjoint_cover(parts, len(labels))
    hist = label_histogram(parts, labels, 10)
    assert ((hist > 0).sum(1) <= shards_per_client).all()
    assert all(len(p) == 600 // num_clients for p in parts)


def test_shard_partition_two_shards_gives_most_clients_exactly_two_classes():
    labels = balanced_labels(10, 20)
    parts = shard_partition(labels, 10, 2, seed=0)
    classes_per_client = (label_histogram(parts, labels, 10) > 0).sum(1)
    assert classes_per_client.max() == 2
    assert (classes_per_client == 2).sum() >= 5  # both shards of a class going to one client is the rare case


def test_shard_partition_is_deterministic_under_seed():
    labels = balanced_labels(10, 20, shuffled=True)
    assert same_parts(shard_partition(labels, 5, 2, seed=1), shard_partition(labels, 5, 2, seed=1))
    assert not same_parts(shard_partition(labels, 5, 2, seed=1), shard_partition(labels, 5, 2, seed=2))


def test_shard_partition_with_more_shards_than_samples_is_a_value_error():
    with pytest.raises(ValueError, match="cannot fill 12 shards"):
        shard_partition(balanced_labels(2, 5), 4, shards_per_client=3)


@pytest.mark.parametrize("shards_per_client", [0, -1, 1.5, True])
def test_shard_partition_rejects_bad_shards_per_client(shards_per_client):
    with pytest.raises(ValueError, match="shards_per_client"):
        shard_partition(balanced_labels(2, 10), 2, shards_per_client)


# ------------------------------------------------------------------ dispatcher and histogram


def test_partition_unknown_scheme_lists_the_schemes():
    with pytest.raises(ValueError) as info:
        partition("pathological", 3, num_samples=30)
    for scheme in PARTITION_SCHEMES:
        assert scheme in str(info.value)
    assert "pathological" in str(info.value)


@pytest.mark.parametrize("scheme", ["dirichlet", "shards"])
def test_label_schemes_without_targets_are_a_value_error(scheme):
    with pytest.raises(ValueError, match="targets"):
        partition(scheme, 3, num_samples=30)


def test_iid_without_num_samples_or_targets_is_a_value_error():
    with pytest.raises(ValueError, match="num_samples"):
        partition("iid", 3)


def test_partition_dispatches_to_each_scheme_with_its_arguments():
    labels = balanced_labels(4, 25, shuffled=True)
    assert same_parts(partition("iid", 3, num_samples=100, seed=5), iid_partition(100, 3, seed=5))
    assert same_parts(partition("iid", 3, targets=labels, seed=5), iid_partition(100, 3, seed=5))
    assert same_parts(
        partition("dirichlet", 3, targets=labels, dirichlet_alpha=0.3, seed=5),
        dirichlet_partition(labels, 3, alpha=0.3, seed=5),
    )
    assert same_parts(
        partition("shards", 5, targets=labels, shards_per_client=3, seed=5),
        shard_partition(labels, 5, shards_per_client=3, seed=5),
    )


def test_label_histogram_counts_samples_per_client_and_class():
    labels = np.array([0, 1, 1, 2, 2, 2])
    parts = [torch.tensor([0, 3]), torch.tensor([1, 2, 4, 5])]
    hist = label_histogram(parts, labels, num_classes=4)
    assert torch.equal(hist, torch.tensor([[1, 0, 1, 0], [0, 2, 2, 0]]))
