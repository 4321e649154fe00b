"""Per-round client data (``ClientRounds``, ``RoundSampler``) and server aggregation (``weighted_mean``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.federated import ClientRounds, RoundSampler, iid_partition, weighted_mean

NUM_SAMPLES = 120


def indexed_dataset(n: int = NUM_SAMPLES) -> TensorDataset:
    """Sample i has inputs [i, -i] and label i % 7, so every drawn sample reveals its index."""
    idx = torch.arange(n, dtype=torch.float32)
    return TensorDataset(torch.stack([idx, -idx], dim=1), torch.arange(n) % 7)


def make_rounds(**overrides) -> ClientRounds:
    kwargs = dict(
        dataset=indexed_dataset(),
        client_indices=iid_partition(NUM_SAMPLES, 6, seed=0),
        clients_per_round=3,
        local_batch_size=4,
        local_steps=2,
        seed=1,
    )
    kwargs.update(overrides)
    return ClientRounds(**kwargs)


def assert_items_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert a["round"] == b["round"]
    for key in ("client_ids", "inputs", "targets"):
        assert torch.equal(a[key], b[key]), key


# ------------------------------------------------------------------ ClientRounds


def test_round_item_has_documented_keys_and_shapes():
    item = make_rounds()[4]
    assert item["round"] == 4
    assert item["client_ids"].dtype == torch.int64 and item["client_ids"].shape == (3,)
    assert item["inputs"].shape == (3, 2, 4, 2)
    assert item["targets"].shape == (3, 2, 4)


def test_round_item_is_a_pure_function_of_seed_and_round():
    rounds = make_rounds()
    first = rounds[17]
    rounds[3], rounds[99]  # touching other rounds in between changes nothing
    assert_items_equal(rounds[17], first)
    assert_items_equal(make_rounds()[17], first)


def test_different_rounds_and_seeds_draw_different_data():
    rounds = make_rounds()
    assert not torch.equal(rounds[0]["inputs"], rounds[1]["inputs"])
    assert not torch.equal(make_rounds(seed=2)[0]["inputs"], rounds[0]["inputs"])


def test_sampled_clients_are_distinct_ascending_and_counted():
    rounds = make_rounds()
    seen = set()
    for r in range(40):
        ids = rounds.sample_clients(r)
        assert len(ids) == 3
        assert len(set(ids.tolist())) == 3
        assert torch.equal(ids, ids.sort().values)
        assert ((ids >= 0) & (ids < 6)).all()
        seen.update(ids.tolist())
    assert seen == set(range(6))  # every client is drawn eventually


def test_each_client_draws_only_from_its_own_partition_without_replacement():
    rounds = make_rounds()
    parts = rounds.client_indices
    for r in range(10):
        item = rounds[r]
        for i, client in enumerate(item["client_ids"].tolist()):
            drawn = item["inputs"][i, ..., 0].flatten().long()
            assert set(drawn.tolist()) <= set(parts[client].tolist())
            assert len(set(drawn.tolist())) == drawn.numel() == 8  # S * B distinct samples
            assert torch.equal(item["inputs"][i, ..., 1].flatten(), -drawn.float())
            assert torch.equal(item["targets"][i].flatten(), drawn % 7)  # labels travel with their inputs


def test_batches_are_laid_out_step_major_from_the_drawn_indices():
    rounds = make_rounds()
    item = rounds[5]
    for i, client in enumerate(item["client_ids"].tolist()):
        expected = rounds.sample_local_indices(5, client).view(2, 4)
        assert torch.equal(item["inputs"][i, :, :, 0].long(), expected)


def test_client_with_fewer_than_s_times_b_samples_draws_with_replacement_from_its_own_partition():
    small = torch.tensor([3, 50, 77])
    rest = torch.tensor([i for i in range(NUM_SAMPLES) if i not in (3, 50, 77)])
    rounds = make_rounds(client_indices=[small, rest], clients_per_round=2, local_batch_size=4, local_steps=2)
    used = set()
    for r in range(6):
        item = rounds[r]
        assert item["client_ids"].tolist() == [0, 1]
        drawn = item["inputs"][0, ..., 0].flatten().long()
        assert drawn.numel() == 8
        assert set(drawn.tolist()) <= {3, 50, 77}
        used.update(drawn.tolist())
        other = item["inputs"][1, ..., 0].flatten().long()
        assert not set(other.tolist()) & {3, 50, 77}
    assert used == {3, 50, 77}


def test_client_with_exactly_s_times_b_samples_uses_each_once():
    parts = [torch.arange(8), torch.arange(8, NUM_SAMPLES)]
    item = make_rounds(client_indices=parts, clients_per_round=2)[0]
    assert sorted(item["inputs"][0, ..., 0].flatten().long().tolist()) == list(range(8))


def test_a_clients_local_data_does_not_depend_on_clients_per_round():
    a = make_rounds(clients_per_round=2)
    b = make_rounds(clients_per_round=6)
    for client in range(6):
        assert torch.equal(a.sample_local_indices(8, client), b.sample_local_indices(8, client))


def test_clients_of_equal_size_draw_independent_positions():
    rounds = make_rounds()  # iid: 6 clients of 20 samples each
    for r in range(3):
        positions = []
        for client in range(6):
            owned = rounds.client_indices[client]
            drawn = rounds.sample_local_indices(r, client)
            positions.append(torch.searchsorted(owned, drawn))  # where in its own partition each draw sits
        assert len({tuple(p.tolist()) for p in positions}) == 6


def test_all_clients_per_round_samples_everyone():
    rounds = make_rounds(clients_per_round=6)
    assert rounds[0]["client_ids"].tolist() == list(range(6))


@pytest.mark.parametrize(
    "overrides, name",
    [
        ({"clients_per_round": 0}, "clients_per_round"),
        ({"clients_per_round": 7}, "clients_per_round"),
        ({"local_batch_size": 0}, "local_batch_size"),
        ({"local_steps": 0}, "local_steps"),
        (
            {"client_indices": [torch.arange(5), torch.tensor([], dtype=torch.long)], "clients_per_round": 1},
            r"clients \[1\]",
        ),
    ],
)
def test_bad_client_rounds_arguments_are_value_errors_naming_them(overrides, name):
    with pytest.raises(ValueError, match=name):
        make_rounds(**overrides)


# ------------------------------------------------------------------ RoundSampler


def test_round_sampler_starts_at_first_round_evaluated_at_iteration_time():
    step = {"value": 0}
    sampler = RoundSampler(lambda: step["value"], 3)
    step["value"] = 7  # changed after construction
    assert list(sampler) == [7, 8, 9]
    step["value"] = 10
    assert list(sampler) == [10, 11, 12]
    assert len(sampler) == 3


def test_round_sampler_drives_a_dataloader_over_client_rounds():
    rounds = make_rounds()
    step = {"value": 4}
    loader = DataLoader(rounds, batch_size=None, sampler=RoundSampler(lambda: step["value"], 2))
    items = list(loader)
    assert [int(item["round"]) for item in items] == [4, 5]
    assert_items_equal(items[1], rounds[5])


@pytest.mark.parametrize("n", [0, -3])
def test_round_sampler_rejects_non_positive_rounds_per_epoch(n):
    with pytest.raises(ValueError, match="rounds_per_epoch"):
        RoundSampler(lambda: 0, n)


# ------------------------------------------------------------------ weighted_mean


def updates(*values) -> list[dict[str, torch.Tensor]]:
    return [
        {"w": torch.tensor(v, dtype=torch.float64).view(2, 1), "b": torch.tensor([v[0] * 10.0], dtype=torch.float64)}
        for v in values
    ]


def test_weighted_mean_without_weights_is_the_uniform_mean():
    out = weighted_mean(updates([1.0, 2.0], [3.0, 6.0], [5.0, 1.0]))
    torch.testing.assert_close(out["w"], torch.tensor([[3.0], [3.0]], dtype=torch.float64))
    torch.testing.assert_close(out["b"], torch.tensor([30.0], dtype=torch.float64))


@pytest.mark.parametrize("as_tensor", [False, True])
def test_weighted_mean_equals_the_manual_weighted_average(as_tensor):
    ups = updates([1.0, 2.0], [3.0, 6.0], [5.0, 1.0])
    weights = [1.0, 3.0, 4.0]
    out = weighted_mean(ups, torch.tensor(weights) if as_tensor else weights)
    for name in ("w", "b"):
        manual = sum(w * u[name] for w, u in zip(weights, ups)) / sum(weights)
        torch.testing.assert_close(out[name], manual)
        assert out[name].dtype == torch.float64 and out[name].shape == ups[0][name].shape


def test_weighted_mean_with_integer_sample_counts_and_a_zero_weight():
    ups = updates([1.0, 2.0], [3.0, 6.0], [100.0, 100.0])
    out = weighted_mean(ups, [10, 30, 0])
    torch.testing.assert_close(out["w"], torch.tensor([[2.5], [5.0]], dtype=torch.float64))


def test_weighted_mean_keeps_float32_dtype():
    ups = [{"w": torch.ones(3)}, {"w": torch.zeros(3)}]
    out = weighted_mean(ups, [3, 1])
    assert out["w"].dtype == torch.float32
    torch.testing.assert_close(out["w"], torch.full((3,), 0.75))


def test_weighted_mean_rejects_mismatched_layer_names():
    with pytest.raises(ValueError, match="update 1 has layers"):
        weighted_mean([{"w": torch.ones(2)}, {"v": torch.ones(2)}])
    with pytest.raises(ValueError, match="update 1 has layers"):
        weighted_mean([{"w": torch.ones(2)}, {"w": torch.ones(2), "b": torch.ones(1)}])


@pytest.mark.parametrize("weights", [[1.0], [1.0, 2.0, 3.0], [-1.0, 2.0], [0.0, 0.0], [[1.0, 1.0]]])
def test_weighted_mean_rejects_bad_weights(weights):
    with pytest.raises(ValueError, match="weights must be 2 non-negative numbers"):
        weighted_mean(updates([1.0, 2.0], [3.0, 4.0]), weights)


@pytest.mark.parametrize("weights", [[float("nan"), 1.0], [float("inf"), 1.0]])
def test_weighted_mean_rejects_nonfinite_weights(weights):
    with pytest.raises(ValueError, match="weights"):
        weighted_mean(updates([1.0, 2.0], [3.0, 4.0]), weights)


def test_weighted_mean_of_nothing_is_a_value_error():
    with pytest.raises(ValueError, match="empty"):
        weighted_mean([])
    with pytest.raises(ValueError, match="empty"):
        weighted_mean([], [])


def test_a_chosen_batch_replaces_one_client_in_one_round_only():
    rounds, reference = make_rounds(), make_rounds()
    client = int(rounds.sample_clients(2)[0])
    chosen = [5, 9, 13, 17, 21, 25, 29, 33]  # local_steps * local_batch_size = 8
    rounds.choose(2, client, chosen)
    item = rounds[2]
    position = item["client_ids"].tolist().index(client)
    assert item["inputs"][position, :, :, 0].flatten().tolist() == chosen  # sample i carries i
    expected = reference[2]
    others = [i for i in range(3) if i != position]
    assert torch.equal(item["inputs"][others], expected["inputs"][others])
    assert_items_equal(rounds[3], reference[3])
    with pytest.raises(ValueError, match="needs local_steps \\* local_batch_size = 8 chosen samples"):
        rounds.choose(2, client, [1, 2])
    with pytest.raises(ValueError, match=r"chosen indices must be in \[0, 119\]"):
        rounds.choose(2, client, [0, 1, 2, 3, 4, 5, 6, 120])
