"""PriPrune (Chu et al.): base pruning, the defense mask, pseudo-pruning, aggregation, resume."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from helpers import RandomImages, quiet_trainer, small_cnn
from torch import nn

from lightning_gp.callbacks import CommunicationMeter, GradientTap
from lightning_gp.callbacks.communication import encoded_nbytes
from lightning_gp.federated import FederatedSimulation
from lightning_gp.priprune import (
    BASE_SCHEMES,
    PriPruneModule,
    PrunedFedAvgModule,
    final_share_mask,
    privacy_loss,
    sample_share_mask,
    withhold_probability,
)
from lightning_gp.priprune.mask import logit
from lightning_gp.seeding import seeded_generator

pytestmark = pytest.mark.usefixtures("one_thread")
PREFIX = "module."


def images(steps: int = 2, batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, batch, 1, 12, 12, generator=g), torch.randint(0, 4, (steps, batch), generator=g)


def prepared(module: PrunedFedAvgModule, num_clients: int = 3) -> PrunedFedAvgModule:
    datamodule = RandomImages()
    datamodule.setup("fit")
    module.prepare_clients(datamodule, num_clients=num_clients)
    module.begin_round(0)
    return module


def withholding(**kwargs) -> PriPruneModule:
    """A PriPrune client that withholds a good part of its weights after one round."""
    torch.manual_seed(0)
    return prepared(PriPruneModule(small_cnn(), mask_lr=30.0, alpha_init=0.4, **kwargs))


# ------------------------------------------------------------------ the defense mask (Eq. 18)
def test_mask_samples_are_hard_and_straight_through():
    logits = torch.linspace(-3, 3, 500).requires_grad_(True)
    mask = sample_share_mask(logits, 0.5, seeded_generator(1))
    assert set(mask.detach().unique().tolist()) <= {0.0, 1.0}  # exactly 0 or 1, not 1 - s + s
    weights = torch.linspace(1, 2, 500)
    (mask * weights).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert (logits.grad != 0).all()  # every logit gets the soft sample's gradient
    assert (logits.grad <= 0).all()  # a larger logit (more withholding) lowers the share mask's soft value


@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.9])
def test_mask_shares_with_probability_one_minus_alpha(alpha):
    n = 40_000
    logits = torch.full((n,), logit(alpha))
    shared = float(sample_share_mask(logits, 1.0, seeded_generator(7)).mean())
    sigma = math.sqrt(alpha * (1 - alpha) / n)
    assert abs(shared - (1 - alpha)) < 6 * sigma  # binomial: fails with probability ~2e-9


def test_final_mask_shares_where_alpha_is_below_one_half():
    logits = torch.tensor([-2.0, -1e-3, 1e-3, 2.0])
    assert final_share_mask(logits).tolist() == [True, True, False, False]
    assert torch.allclose(withhold_probability(logits), torch.sigmoid(logits))


# ------------------------------------------------------------------ the privacy loss (Eq. 16-17)
def test_minimising_the_privacy_loss_raises_alpha_where_the_gradient_is_large():
    gradients = {"w": torch.tensor([0.1, 1.0])}
    logits = torch.full((2,), logit(0.3), requires_grad=True)
    for _ in range(20):
        alpha = {"w": withhold_probability(logits)}
        loss = 15 * privacy_loss(gradients, alpha) + 2e-5 * alpha["w"].sum()
        (grad,) = torch.autograd.grad(loss, logits)
        logits = (logits - 0.1 * grad).detach().requires_grad_(True)
    alpha = withhold_probability(logits).detach()
    assert alpha[1] > alpha[0] > 0.3  # both rise (lambda_sha is tiny), the large gradient's faster
    assert alpha[1] > 0.5 > alpha[0]  # only the large-gradient weight is withheld


class TwoWeights(nn.Module):
    """y = w . x with two weights; input feature 1 is ten times feature 0, so is its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[0.5, -0.5]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).squeeze(-1)


def test_a_client_withholds_the_weight_with_the_large_gradient():
    z = torch.randn(1, 16, generator=torch.Generator().manual_seed(3))
    x = torch.stack([0.1 * z, z], dim=-1)  # [S=1, B=16, 2]
    y = torch.ones(1, 16)
    module = PriPruneModule(
        TwoWeights(), base_rate=0.0, lambda_acc=0.0, lambda_sha=0.0, alpha_init=0.45, loss_fn=nn.MSELoss()
    )
    module.begin_round(0)
    w = module.module.fc.weight.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(nn.MSELoss()(x[0] @ w.T, y[0, :, None]), w)
    # one step moves logit j by mask_lr * lambda_pri * (1/2) |g_j| alpha (1 - alpha): put the step between
    # the two weights' distances to alpha = 0.5
    per_unit = module.lambda_pri * 0.5 * g.abs().flatten() * 0.45 * 0.55
    module.mask_lr = float(abs(logit(0.45)) / per_unit.prod().sqrt())
    module.client_update(x, y, client_id=0, round=0, lr=0.1)
    alpha = withhold_probability(module.client_logits(0)["fc.weight"]).flatten()
    assert alpha[1] > 0.5 > alpha[0] > 0.45
    assert module.share_masks(0)["fc.weight"].flatten().tolist() == [True, False]


# ------------------------------------------------------------------ pseudo-pruning (Alg. 3)
def test_upload_is_zero_exactly_where_the_masks_say():
    module = withholding()
    sent = module.global_weights()
    x, y = images()
    update, _ = module.client_update(x, y, client_id=1, round=0, lr=0.1)
    masks = module.share_masks(1)
    withheld = sum(int((~m).sum()) for m in masks.values())
    assert 0 < module.defense_rates[1] < 1 and withheld > 0
    for name, keep in masks.items():
        received = sent[name] - update[PREFIX + name]
        assert torch.equal(received != 0, keep), name
        assert torch.equal(update[PREFIX + name][~keep], sent[name][~keep])  # exactly w_global where not sent
    for name, base in (module.masks or {}).items():
        assert not masks[name][~base].any()  # base-pruned weights are never sent


def test_pseudo_pruning_restores_the_withheld_weights_exactly():
    module = withholding()
    x, y = images()
    update, _ = module.client_update(x, y, client_id=1, round=0, lr=0.1)
    sent = module.global_weights()
    shared = {n: sent[n] - update[PREFIX + n] for n in sent}
    withheld = module.client_withheld(1)
    masks = module.share_masks(1)
    for name, keep in masks.items():
        assert not (withheld[name][keep] != 0).any()  # shared and withheld are disjoint
        assert (withheld[name][~keep & (module.masks or {}).get(name, torch.ones_like(keep))] != 0).all()
    # the server moves on: the next round starts from the new global weight where the client shared,
    # from its own withheld weight where it did not
    with torch.no_grad():
        for name, p in module.module.named_parameters():
            p.copy_(module.pruned({name: shared[name] + 0.25})[name])
    start = module.client_start(1)
    now = module.global_weights()
    for name, keep in masks.items():
        assert torch.equal(start[name][keep], now[name][keep])
        base = (module.masks or {}).get(name, torch.ones_like(keep))
        assert torch.equal(start[name][~keep & base], withheld[name][~keep & base])
    # a client that never trained starts from the global model
    fresh = module.client_start(0)
    assert all(torch.equal(fresh[n], now[n]) for n in now)


# ------------------------------------------------------------------ base pruning
@pytest.mark.parametrize("scheme", sorted(BASE_SCHEMES))
def test_each_base_scheme_prunes_every_prunable_layer_at_the_base_rate(scheme):
    torch.manual_seed(0)
    module = prepared(PrunedFedAvgModule(small_cnn(), base_scheme=scheme, base_rate=0.3))
    assert module.masks is not None and set(module.masks) == {"0.weight", "3.weight"}
    for name, keep in module.masks.items():
        n = keep.numel()
        assert int((~keep).sum()) == math.floor(0.3 * n + 0.5)
        assert not module.global_weights()[name][~keep].any()  # the server sends the pruned model
    assert module.global_weights()["0.bias"].ne(0).all()  # biases are not pruned


def test_magnitude_prunes_the_smallest_weights_and_rerank_restores_regrown_values():
    torch.manual_seed(0)
    module = prepared(PrunedFedAvgModule(small_cnn(), base_scheme="magnitude", mask_update_every=2))
    assert module.masks is not None
    dense_before = {n: module.global_weights()[n] + module.frozen[n] for n in module.masks}
    for name, keep in module.masks.items():
        magnitude = dense_before[name].abs()
        assert magnitude[keep].min() >= magnitude[~keep].max()
    # shrink the kept weights of one layer below every pruned one: the re-ranking at round 2 swaps them
    with torch.no_grad():
        module.module[3].weight.mul_(1e-3)
    module.begin_round(1)
    assert module.mask_round == 0
    pruned_before = ~module.masks["3.weight"]
    frozen_before = module.frozen["3.weight"].clone()
    module.begin_round(2)
    assert module.mask_round == 2
    regrown = pruned_before & module.masks["3.weight"]
    assert regrown.any()
    assert torch.equal(module.global_weights()["3.weight"][regrown], frozen_before[regrown])


def test_snip_needs_the_servers_calibration_batch():
    module = PrunedFedAvgModule(small_cnn(), base_scheme="snip")
    with pytest.raises(ValueError, match="calibration"):
        module.begin_round(0)


# ------------------------------------------------------------------ aggregation
def test_mask_aware_average_counts_only_the_clients_that_sent_a_weight():
    torch.manual_seed(0)
    weighted = prepared(PrunedFedAvgModule(small_cnn(), aggregation="weighted"))
    aware = prepared(PrunedFedAvgModule(small_cnn(), aggregation="mask_aware"))
    aware.load_state_dict(weighted.state_dict())
    sent = {PREFIX + n: w for n, w in weighted.global_weights().items()}
    moved = weighted.pruned({n: w + 0.5 for n, w in weighted.global_weights().items()})
    first = {PREFIX + n: sent[PREFIX + n] - w for n, w in moved.items()}  # received w + 0.5 (pruned: 0) ...
    second = {n: u.clone() for n, u in first.items()}
    second["module.3.bias"] = sent["module.3.bias"].clone()  # ... except the second client withheld this layer
    plain = weighted.aggregate_updates([first, second], None)
    masked = aware.aggregate_updates([first, second], None)
    new_plain = sent["module.3.bias"] - plain["module.3.bias"]
    new_masked = sent["module.3.bias"] - masked["module.3.bias"]
    torch.testing.assert_close(new_plain, (sent["module.3.bias"] + 0.5) / 2)  # the withheld zero averaged in
    torch.testing.assert_close(new_masked, sent["module.3.bias"] + 0.5)  # only the sender counts
    torch.testing.assert_close(masked["module.0.bias"], plain["module.0.bias"])  # both sent: same average
    for name, keep in (aware.masks or {}).items():  # nobody sent a pruned weight: it stays zero
        assert not (sent[PREFIX + name] - masked[PREFIX + name])[~keep].any()


# ------------------------------------------------------------------ in the simulation
def simulation(module: PrunedFedAvgModule, num_clients: int = 4, **kwargs) -> FederatedSimulation:
    return FederatedSimulation(
        module,
        datamodule=RandomImages(),
        algorithm="fedavg",
        num_clients=num_clients,
        clients_per_round=kwargs.pop("clients_per_round", 2),
        local_batch_size=4,
        local_steps=2,
        local_lr=0.1,
        server_lr=1.0,
        rounds_per_epoch=3,
        seed=2,
        **kwargs,
    )


def make_priprune() -> PriPruneModule:
    torch.manual_seed(0)
    return PriPruneModule(small_cnn(), base_scheme="magnitude", mask_update_every=2, mask_lr=30.0, alpha_init=0.4)


def full_state(sim: FederatedSimulation) -> dict[str, torch.Tensor]:
    module = sim.module
    assert isinstance(module, PriPruneModule)
    state = {f"param/{n}": p.detach() for n, p in sim.named_parameters()}
    state.update({f"mask/{n}": m for n, m in (module.masks or {}).items()})
    state.update({f"frozen/{n}": f for n, f in module.frozen.items()})
    for client, parts in module.clients.items():
        state.update({f"{client}/{part}": t for part, t in parts.items()})
    return state


def test_priprune_state_survives_checkpoint_and_resume_bit_exactly(tmp_path):
    L.seed_everything(0)
    straight = simulation(make_priprune())
    quiet_trainer(max_steps=4, num_sanity_val_steps=0, limit_val_batches=0).fit(straight)

    L.seed_everything(0)
    first = simulation(make_priprune())
    trainer = quiet_trainer(max_steps=2, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "round2.ckpt")

    L.seed_everything(0)
    resumed = simulation(make_priprune())
    quiet_trainer(max_steps=4, num_sanity_val_steps=0, limit_val_batches=0).fit(
        resumed, ckpt_path=tmp_path / "round2.ckpt"
    )
    expected, got = full_state(straight), full_state(resumed)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), [
        k for k in expected if not torch.equal(expected[k], got[k])
    ]
    module = resumed.module
    assert isinstance(module, PriPruneModule) and module.mask_round == 2 and len(module.clients) > 1
    assert any(parts["withheld"].ne(0).any() for parts in module.clients.values())

    # the checkpoint belongs to 4 clients and the magnitude scheme
    with pytest.raises(ValueError, match="num_clients"):
        quiet_trainer(max_steps=4, num_sanity_val_steps=0, limit_val_batches=0).fit(
            simulation(make_priprune(), num_clients=5), ckpt_path=tmp_path / "round2.ckpt"
        )


def test_a_checkpoint_of_another_scheme_or_module_kind_is_refused():
    torch.manual_seed(0)
    magnitude = prepared(PriPruneModule(small_cnn(), base_scheme="magnitude"))
    state = magnitude.state_dict()
    with pytest.raises(ValueError, match="base_scheme"):
        PriPruneModule(small_cnn(), base_scheme="random").load_state_dict(state)
    with pytest.raises(ValueError, match="base_rate"):
        PriPruneModule(small_cnn(), base_scheme="magnitude", base_rate=0.5).load_state_dict(state)
    with pytest.raises(ValueError, match="PrunedFedAvgModule"):
        PrunedFedAvgModule(small_cnn(), base_scheme="magnitude").load_state_dict(state)
    other = PriPruneModule(small_cnn(), base_scheme="magnitude")
    other.load_state_dict(state)  # same settings: fine; then a simulation of another size refuses it
    with pytest.raises(ValueError, match="num_clients"):
        other.prepare_clients(RandomImages(), num_clients=7)


def test_meter_counts_the_weights_clients_send_and_the_model_they_receive():
    L.seed_everything(0)
    sim = simulation(make_priprune(), num_clients=2, clients_per_round=2)
    meter, taps = CommunicationMeter(), [GradientTap(clients=c, rounds=[0, 1]) for c in (0, 1)]
    quiet_trainer(max_steps=2, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[meter, *taps]).fit(sim)
    records = [r for tap in taps for r in tap.records]
    assert len(records) == meter.uploads == 4
    sent = [{n: r.model_state[n] for n in r.gradients} for r in records]
    upload = sum(encoded_nbytes(s[n] - g) for s, r in zip(sent, records) for n, g in r.gradients.items())
    download = sum(encoded_nbytes(w) for s in sent for w in s.values())
    assert meter.total_upload_bytes == upload
    assert meter.total_download_bytes == download
    # a withheld weight arrives as w_global - 0 in the update, but costs nothing on the wire
    as_updates = sum(encoded_nbytes(g) for r in records for g in r.gradients.values())
    assert upload < as_updates
    dense = sum(g.numel() * g.element_size() for g in records[0].gradients.values())
    assert meter.total_dense_bytes == 4 * dense and download < 4 * dense  # the model is sent pruned


# ------------------------------------------------------------------ the client state in checkpoints (compact)
def mlp() -> nn.Module:
    """19,076 weights: large enough that a dense copy per client would dominate the checkpoint."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(144, 128), nn.Tanh(), nn.Linear(128, 4))


def trained(rounds: int, **kwargs) -> tuple[FederatedSimulation, L.Trainer]:
    L.seed_everything(0)
    sim = simulation(PriPruneModule(mlp(), mask_lr=30.0, alpha_init=0.4, **kwargs), num_clients=6)
    trainer = quiet_trainer(max_steps=rounds, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(sim)
    return sim, trainer


CONTAINER_BYTES = 64 * 1024  # zip directory, pickled metadata and Lightning's own state: independent of the model
PER_TENSOR_BYTES = 1024  # a zip record, its 64-byte alignment and its pickled reference


def test_a_checkpoint_holds_logits_and_only_the_withheld_weights_of_the_clients_that_trained(tmp_path):
    """Bytes <= model + base masks + frozen pruned values + sum over trained clients of 4 (N + withheld_c),
    plus a container allowance: no dense copy of the model per client."""
    rounds = 3
    sim, trainer = trained(rounds)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    module = sim.module
    assert isinstance(module, PriPruneModule) and module.masks is not None and sim._rounds is not None
    n = sum(p.numel() for p in module.module.parameters())
    sampled = {int(c) for r in range(rounds) for c in sim._rounds.sample_clients(r)}
    assert set(module.clients) == sampled and len(sampled) < 6  # a client never sampled stores nothing
    withheld = {c: int((~final_share_mask(s["logits"])).sum()) for c, s in module.clients.items()}
    assert sum(withheld.values()) > 0

    saved = torch.load(tmp_path / "run.ckpt", weights_only=False)["state_dict"]["module._extra_state"]
    for client, state in saved["clients"].items():
        assert state["logits"].shape == (n,) and state["withheld"].shape == (withheld[client],)
        for t in state.values():  # each its own storage: torch.save writes a view's whole storage
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()

    pruned = sum(int((~m).sum()) for m in module.masks.values())
    mask_entries = sum(m.numel() for m in module.masks.values())
    tensors = 2 * len(sampled) + 3 * len(module.masks) + len(list(module.module.parameters()))
    bound = (
        4 * n  # the global model
        + mask_entries  # base masks, one byte per prunable weight
        + 4 * pruned  # the pruned weights' last values
        + sum(4 * (n + k) for k in withheld.values())  # per trained client: logits and withheld weights
        + CONTAINER_BYTES
        + PER_TENSOR_BYTES * tensors
    )
    size = (tmp_path / "run.ckpt").stat().st_size
    assert size <= bound, (size, bound)


def test_a_checkpoint_written_before_the_compact_format_resumes_to_the_same_state():
    """Format 1 stored dense frozen weights and dense per-client logits and withheld weights by name."""
    sim, _ = trained(2)
    module = sim.module
    assert isinstance(module, PriPruneModule) and module.masks is not None
    state = module.get_extra_state()
    like = module.global_weights()
    old = dict(state, format="lightning_gp.PrunedFedAvg/1", frozen=dict(module.frozen))
    old["clients"] = {
        c: {"logits": module.client_logits(c), "withheld": module.client_withheld(c)} for c in module.clients
    }
    fresh = PriPruneModule(mlp(), mask_lr=30.0, alpha_init=0.4)
    fresh.set_extra_state(old)
    assert fresh.clients.keys() == module.clients.keys() and fresh.mask_round == module.mask_round
    for c, parts in module.clients.items():
        assert all(torch.equal(fresh.clients[c][part], t) for part, t in parts.items()), c
    assert all(torch.equal(fresh.frozen[n], f) for n, f in module.frozen.items())
    assert all(torch.equal(fresh.masks[n], m) for n, m in module.masks.items())
    assert all(like[n].shape == t.shape for n, t in fresh.client_logits(next(iter(fresh.clients))).items())


def test_client_state_of_another_model_size_is_refused():
    sim, _ = trained(1)
    state = sim.module.get_extra_state()
    client = next(iter(state["clients"]))
    state["clients"][client] = {**state["clients"][client], "withheld": torch.zeros(3)}
    with pytest.raises(ValueError, match="does not match this model"):
        PriPruneModule(mlp()).set_extra_state(state)
    state["clients"][client] = {"logits": torch.zeros(10), "withheld": torch.zeros(0)}
    with pytest.raises(ValueError, match="does not match this model"):
        PriPruneModule(mlp()).set_extra_state(state)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"base_rate": 1.5}, "base_rate"),
        ({"base_rate": -0.1}, "base_rate"),
        ({"lambda_pri": -1.0}, "lambda_pri"),
        ({"lambda_acc": -1.0}, "lambda_acc"),
        ({"lambda_sha": -1e-5}, "lambda_sha"),
        ({"temperature": 0.0}, "temperature"),
        ({"mask_lr": 0.0}, "mask_lr"),
        ({"alpha_init": 1.0}, "alpha_init"),
        ({"base_scheme": "grasp"}, "base_scheme"),
        ({"aggregation": "median"}, "aggregation"),
        ({"mask_update_every": -1}, "mask_update_every"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PriPruneModule(small_cnn(), **kwargs)


def test_a_model_without_a_prunable_layer_is_refused():
    with pytest.raises(ValueError, match=r"module .* no prunable layer"):
        PriPruneModule(nn.Sequential(nn.Flatten(), nn.LayerNorm(144)))


def test_the_simulation_runs_these_modules_with_fedavg_only():
    with pytest.raises(ValueError, match="algorithm='fedavg'"):
        FederatedSimulation(PriPruneModule(small_cnn()), datamodule=RandomImages(), algorithm="fedsgd")
