"""DGP, Top-k and random pruning: exact kept sets, error feedback, tiny layers, bad input."""

import lightning as L
import pytest
import torch
from helpers import RandomImages, quiet_trainer, small_cnn

from lightning_gp import callbacks
from lightning_gp.defenses import DualGradientPruning, RandomPruning, TopKPruning, magnitude_band_mask
from lightning_gp.federated import FederatedSimulation


def kept(shared: torch.Tensor) -> set[int]:
    return set(torch.nonzero(shared.flatten()).flatten().tolist())


def test_dgp_drops_the_top_k1_and_bottom_k2_and_sends_the_band_between():
    g = torch.arange(1.0, 21.0)[torch.randperm(20, generator=torch.Generator().manual_seed(0))]
    shared = DualGradientPruning(k1=0.05, k2=0.75, error_feedback=False)({"w": g})["w"]
    assert sorted(shared[shared != 0].tolist()) == [
        16.0,
        17.0,
        18.0,
        19.0,
    ]  # 20 dropped (top 5%), 1..15 dropped (bottom 75%)


def test_dgp_works_on_magnitudes_of_signed_multidimensional_layers():
    g = torch.tensor([[-10.0, 1.0], [9.0, -8.0], [0.5, 7.0], [-6.0, 0.1], [2.0, 3.0]])  # 10 entries
    shared = DualGradientPruning(k1=0.1, k2=0.5, error_feedback=False)({"w": g})["w"]
    # top 1 (|-10|) dropped, next 4 (9, -8, 7, -6) sent, bottom 5 dropped
    assert torch.equal(shared, torch.tensor([[0.0, 0.0], [9.0, -8.0], [0.0, 7.0], [-6.0, 0.0], [0.0, 0.0]]))


def test_dgp_sends_exact_counts_among_ties():
    g = torch.ones(40)
    shared = DualGradientPruning(k1=0.05, k2=0.75, error_feedback=False)({"w": g})["w"]
    assert int((shared != 0).sum()) == 8  # round(0.2 * 40), though every magnitude ties


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_tiny_layers_always_send_at_least_one_entry(n):
    g = torch.arange(1.0, n + 1.0)
    for defense in (DualGradientPruning(error_feedback=False), TopKPruning(rate=0.8, error_feedback=False)):
        assert int((defense({"b": g})["b"] != 0).sum()) >= 1
    assert DualGradientPruning(error_feedback=False)({"b": torch.tensor([-3.0])})["b"].item() == -3.0


def test_dgp_never_sends_a_layer_top_entry_when_the_layer_is_large_enough():
    g = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    shared = DualGradientPruning(error_feedback=False)({"w": g})["w"]
    top = set(g.abs().topk(50).indices.tolist())
    assert not (kept(shared) & top)
    assert len(kept(shared)) == 200


def test_error_feedback_residual_is_what_was_not_sent():
    defense = DualGradientPruning(k1=0.1, k2=0.5)
    gen = torch.Generator().manual_seed(2)
    residual = torch.zeros(30)
    for _ in range(4):
        g = torch.randn(30, generator=gen)
        compensated = g + residual
        shared = defense({"w": g})["w"]
        residual = defense.client_state(0)["w"]
        torch.testing.assert_close(residual, compensated - shared)
        assert kept(shared) == set(magnitude_band_mask(compensated, 3, 12).nonzero().flatten().tolist())


def test_error_feedback_off_keeps_no_state():
    defense = TopKPruning(rate=0.8, error_feedback=False)
    defense({"w": torch.randn(10)})
    assert defense.client_state(0) == {}


def test_top_k_sends_the_largest_fraction():
    g = torch.tensor([0.1, -5.0, 3.0, 0.2, -0.3, 4.0, 0.0, 1.0, -2.0, 0.05])
    shared = TopKPruning(rate=0.7, error_feedback=False)({"w": g})["w"]
    assert kept(shared) == {1, 2, 5}


def test_random_pruning_zeros_an_exact_seeded_fraction():
    g = torch.randn(100, generator=torch.Generator().manual_seed(3)).abs() + 0.1
    first = RandomPruning(0.8, error_feedback=False, seed=4)({"w": g}, client_id=2)["w"]
    again = RandomPruning(0.8, error_feedback=False, seed=4)({"w": g}, client_id=2)["w"]
    other = RandomPruning(0.8, error_feedback=False, seed=4)({"w": g}, client_id=3)["w"]
    assert int((first != 0).sum()) == 20
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_send_rate_and_p_give_the_papers_k1_and_k2():
    defense = DualGradientPruning.from_send_rate(0.2, p=1 / 15)
    assert defense.k1 == pytest.approx(0.05) and defense.k2 == pytest.approx(0.75)
    callback = callbacks.DualGradientPruning.from_send_rate(0.3, p=0.5)
    assert callback.defense.k1 == pytest.approx(0.7 / 1.5 * 0.5) and callback.defense.k2 == pytest.approx(0.7 / 1.5)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: DualGradientPruning(k1=0.3, k2=0.7), "k1 \\+ k2 must be < 1"),
        (lambda: DualGradientPruning(k1=-0.1, k2=0.5), "k1 must be in"),
        (lambda: DualGradientPruning(k1=0.1, k2=1.2), "k2 must be in"),
        (lambda: DualGradientPruning.from_send_rate(0.0), "send_rate must be > 0"),
        (lambda: DualGradientPruning.from_send_rate(0.2, p=-1), "p must be"),
        (lambda: TopKPruning(rate=-0.5), "rate must be in"),
        (lambda: RandomPruning(-0.2), "rate must be in"),
    ],
)
def test_bad_rates_are_rejected_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_dgp_with_error_feedback_trains_in_the_simulation():
    L.seed_everything(0)
    sim = FederatedSimulation(
        small_cnn(),
        datamodule=RandomImages(),
        num_clients=4,
        clients_per_round=4,
        local_batch_size=4,
        server_lr=0.5,
        seed=0,
    )
    defense = callbacks.DualGradientPruning()
    quiet_trainer(max_steps=3, callbacks=[defense]).fit(sim)
    assert defense.defense.clients == [0, 1, 2, 3]
    assert all(defense.defense.client_state(c)["0.weight"].abs().sum() > 0 for c in range(4))
