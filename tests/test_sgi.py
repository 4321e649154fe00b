"""SGI (PriPrune Alg. 2): the mask from the received weights, the target, the unrolled FedAvg update."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import RandomImages, quiet_trainer, small_cnn

from lightning_gp.attacks import SGI, InvertingGradients, ServerView, received_weights, recover_mask
from lightning_gp.attacks.gradient_matching import total_variation
from lightning_gp.callbacks import GradientTap
from lightning_gp.defenses import MagnitudePruning
from lightning_gp.federated import FederatedSimulation
from lightning_gp.priprune import PriPruneModule, PrunedFedAvgModule, server_view

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sgi_recovers_the_mask_exactly_from_the_received_weights():
    torch.manual_seed(0)
    module = PriPruneModule(small_cnn(), base_scheme="magnitude", mask_lr=30.0, alpha_init=0.4)
    sim = FederatedSimulation(
        module,
        datamodule=RandomImages(),
        algorithm="fedavg",
        num_clients=3,
        clients_per_round=3,
        local_batch_size=4,
        local_steps=2,
        local_lr=0.1,
        server_lr=1.0,
        seed=1,
    )
    tap = GradientTap(clients=2, rounds=[1])
    L.seed_everything(0)
    quiet_trainer(max_steps=2, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[tap]).fit(sim)
    view = server_view(tap.latest(), small_cnn(), num_classes=4)
    assert view.meta["algorithm"] == "fedavg" and view.batch_size == 8  # 2 local steps of 4 images
    recovered = SGI(mask="received").support(view)  # Alg. 2: the nonzeros of the received weights
    observed = SGI().support(view)
    assert all(torch.equal(observed[n], recovered[n] & (view.gradients[n] != 0)) for n in observed)
    truth = module.share_masks(2)  # the client's final defense mask times the base mask
    assert recovered.keys() == truth.keys()
    assert all(torch.equal(recovered[n], truth[n]) for n in truth)
    withheld = sum(int((~m).sum()) for m in truth.values())
    base_pruned = sum(int((~m).sum()) for m in (module.masks or {}).values())
    assert withheld > base_pruned  # the defense withheld weights beyond the base pruning


def pruned_update(steps: int, batch: int) -> tuple[ServerView, torch.Tensor, torch.Tensor]:
    """A pruned-FedAvg client's update of ``steps`` local steps, as the server sees it."""
    torch.manual_seed(0)
    module = PrunedFedAvgModule(small_cnn(), base_scheme="random", base_rate=0.3)
    datamodule = RandomImages()
    datamodule.setup("fit")
    module.prepare_clients(datamodule, num_clients=1)
    module.begin_round(0)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(steps, batch, 1, 12, 12, generator=g), torch.randint(0, 4, (steps, batch), generator=g)
    update, _ = module.client_update(x, y, client_id=0, round=0, lr=0.2)
    model = small_cnn()
    model.load_state_dict(module.module.state_dict())
    view = ServerView(
        model=model,
        gradients={n.removeprefix("module."): u for n, u in update.items()},
        batch_size=steps * batch,
        input_shape=(1, 12, 12),
        num_classes=4,
        meta={"algorithm": "fedavg", "local_steps": steps, "local_lr": 0.2},
    )
    return view, x.flatten(0, 1), y.flatten(0, 1)


def matching_distance(attack, view: ServerView, images: torch.Tensor, labels: torch.Tensor) -> float:
    """The attack's objective at the client's true batch, without the image prior."""
    if isinstance(attack, SGI):
        objective = attack.objective(view, attack.support(view), labels)
        value = objective(images.flatten().clone().requires_grad_(True))
    else:
        value = attack.objective(view, labels)(images.clone().requires_grad_(True))
    return float(value.detach()) - attack.tv_weight * float(total_variation(images))


@pytest.mark.parametrize("steps", [1, 3])
def test_the_true_batch_reproduces_the_masked_update(steps):
    """SGI's dummy update (the unrolled local steps on the recovered support) is exact at the truth;
    plain Inverting Gradients compares a gradient with the pruned update and is not."""
    view, images, labels = pruned_update(steps, batch=2)
    mask = SGI().support(view)
    base = view.model.state_dict()
    assert all(torch.equal(mask[n], base[n] != 0) for n in mask)  # no defense: the support is the base mask
    assert matching_distance(SGI(), view, images, labels) < 1e-5  # float32 rounding of a cosine near 1
    assert matching_distance(InvertingGradients(), view, images, labels) > 1e-3


def test_sgi_on_a_fedsgd_gradient_is_inverting_gradients_on_the_shared_support():
    torch.manual_seed(0)
    model = small_cnn()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 1, 12, 12, generator=g), torch.tensor([1, 3])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    gradient = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
    shared = MagnitudePruning(0.7, seed=0)(gradient, 0)
    view = ServerView(model=model, gradients=shared, batch_size=2, input_shape=(1, 12, 12), num_classes=4)
    sgi = SGI(tv_weight=1e-3)
    assert sgi.update_kind(view) == "gradient"
    assert all(torch.equal(m, shared[n] != 0) for n, m in sgi.support(view).items())
    guess = torch.randn(2, 1, 12, 12, generator=g)
    ours = sgi.objective(view, sgi.support(view), y)(guess.flatten().clone().requires_grad_(True))
    theirs = InvertingGradients(tv_weight=1e-3, support_only=True).objective(view, y)(
        guess.clone().requires_grad_(True)
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_received_weights_and_mask_follow_alg_2():
    model = small_cnn()
    sent = {n: p.detach() for n, p in model.named_parameters()}
    received = {n: torch.where(torch.rand_like(w) < 0.5, w * 0.9, torch.zeros_like(w)) for n, w in sent.items()}
    view = ServerView(
        model=model,
        gradients={n: sent[n] - received[n] for n in sent},
        batch_size=1,
        input_shape=(1, 12, 12),
        num_classes=4,
        meta={"algorithm": "fedavg"},
    )
    assert all(torch.equal(received_weights(view)[n] == 0, received[n] == 0) for n in sent)
    assert all(torch.equal(m, received[n] != 0) for n, m in recover_mask(received).items())
    target = SGI().target(view, SGI().support(view))
    assert all(torch.equal(target[n][received[n] == 0], torch.zeros_like(target[n][received[n] == 0])) for n in sent)


def test_sgi_runs_and_returns_soft_labels():
    view, images, _ = pruned_update(steps=1, batch=1)
    result = SGI(iterations=5, lr=0.1, seed=0).reconstruct(view)
    assert result.images.shape == images.shape and result.labels is not None and result.labels.shape == (1,)
    assert result.meta["update"] == "weights" and 0.6 < result.meta["support_fraction"] < 0.8
    assert len(result.loss_trace) == 5


def test_bad_arguments_and_inconsistent_views_are_refused():
    with pytest.raises(ValueError, match="labels"):
        SGI(labels="hard")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="update"):
        SGI(update="delta")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_steps"):
        SGI(local_steps=0)
    view, _, _ = pruned_update(steps=1, batch=3)
    with pytest.raises(ValueError, match=r"local_steps .* must divide"):
        SGI(iterations=1, local_steps=2).reconstruct(view)
