"""Aligned DGP: one client's top-2k mask per round; clients send their k largest inside it."""

import lightning as L
import pytest
import torch
from helpers import RandomImages, quiet_trainer, small_cnn
from torch import nn

from lightning_gp import callbacks
from lightning_gp.defenses import AlignedDualGradientPruning, share_in_process
from lightning_gp.federated import FederatedSimulation, client_gradients


def test_clients_send_their_k_largest_inside_the_mask_and_never_their_own_top_k1():
    adgp = AlignedDualGradientPruning(k=0.2, k1=0.05, error_feedback=False, seed=0)
    gen = torch.Generator().manual_seed(0)
    grads = {c: {"w": torch.randn(200, generator=gen)} for c in range(3)}
    adgp.begin_round(0, [0, 1, 2], grads, share_in_process)
    provider = adgp.mask_provider
    mask = adgp.round_mask["w"]
    assert provider in (0, 1, 2) and int(mask.sum()) == 80  # top 2k = 40%
    assert torch.equal(
        mask, torch.zeros(200, dtype=torch.bool).index_fill(0, grads[provider]["w"].abs().topk(80).indices, True)
    )
    for client, g in grads.items():
        sent = adgp({"w": g["w"]}, client)["w"] != 0
        assert int(sent.sum()) == 40
        assert not (sent & ~mask).any()
        own_top = g["w"].abs().topk(10).indices
        assert not sent[own_top].any()
        allowed = mask.clone()
        allowed[own_top] = False
        expected = torch.where(allowed, g["w"].abs(), torch.tensor(-1.0)).topk(40).indices
        assert set(sent.nonzero().flatten().tolist()) == set(expected.tolist())


def test_the_provider_is_a_seeded_draw_among_the_round_participants():
    adgp = AlignedDualGradientPruning(seed=5)
    draws = [adgp.provider(r, [2, 7, 9]) for r in range(40)]
    assert set(draws) <= {2, 7, 9} and len(set(draws)) == 3
    assert draws == [AlignedDualGradientPruning(seed=5).provider(r, [9, 2, 7]) for r in range(40)]


def test_error_feedback_carries_everything_not_sent():
    adgp = AlignedDualGradientPruning(seed=0)
    g = {"w": torch.randn(50, generator=torch.Generator().manual_seed(1))}
    adgp.begin_round(0, [0], {0: g}, share_in_process)
    shared = adgp(g, 0)["w"]
    torch.testing.assert_close(adgp.client_state(0)["w"], g["w"] - shared)


def test_in_the_simulation_every_upload_and_the_server_update_lie_in_the_round_mask():
    L.seed_everything(0)
    sim = FederatedSimulation(
        small_cnn(),
        datamodule=RandomImages(),
        num_clients=5,
        clients_per_round=3,
        local_batch_size=4,
        server_lr=1.0,
        seed=2,
    )
    start = {n: p.detach().clone() for n, p in sim.module.named_parameters()}
    adgp = callbacks.AlignedDualGradientPruning(k=0.2, k1=0.05, error_feedback=False, seed=1)
    taps = [callbacks.GradientTap(clients=c, rounds=[0]) for c in range(5)]
    quiet_trainer(max_steps=1, callbacks=[adgp, *taps]).fit(sim)
    records = [r for t in taps for r in t.records]
    mask = adgp.defense.round_mask
    assert len(records) == 3 and adgp.defense.mask_provider in {r.client_id for r in records}
    for record in records:
        x, y = record.batch
        model = small_cnn()
        model.load_state_dict(record.model_state)
        raw, _ = client_gradients(model, nn.CrossEntropyLoss(), x[None], y[None], vectorize=False)
        for name, shared in record.gradients.items():
            sent = shared != 0
            assert not (sent & ~mask[name]).any()
            n = shared.numel()
            top = raw[name][0].abs().flatten().topk(min(round(0.05 * n), n - 1)).indices
            assert not sent.flatten()[top].any()
    for name, p in sim.module.named_parameters():  # what clients download: only mask positions change
        changed = (p.detach() - start[name]) != 0
        assert not (changed & ~mask[name]).any()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"k": 0.2, "k1": 0.2}, "k1 < k"), ({"k": 0.6, "k1": 0.05}, "k must be <= 0.5"), ({"k": -0.1}, "k must be in")],
)
def test_bad_rates_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AlignedDualGradientPruning(**kwargs)


def test_a_mask_for_another_model_is_rejected():
    adgp = AlignedDualGradientPruning(seed=0)
    adgp.begin_round(0, [0], {0: {"w": torch.randn(10)}}, share_in_process)
    with pytest.raises(ValueError, match="location mask does not match"):
        adgp({"w": torch.randn(12)}, 0)


def test_a_rejected_mask_leaves_the_client_residual_untouched():
    adgp = AlignedDualGradientPruning(seed=0)
    adgp({"w": torch.randn(10)}, 0)
    before = adgp.client_state(0)["w"]
    adgp.round_mask = {"w": torch.ones(12, dtype=torch.bool)}
    with pytest.raises(ValueError, match="location mask does not match"):
        adgp({"w": torch.randn(10)}, 0)
    assert torch.equal(adgp.client_state(0)["w"], before)
