"""Per-client gradients (FedSGD) and local updates (FedAvg): vmap path == loop path == hand loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gp.federated import client_gradients, client_local_updates, updates_running_stats
from lightning_gp.models import LeNetZhu

ATOL = 1e-6
C, S, B = 4, 3, 3


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def lenet() -> nn.Module:
    torch.manual_seed(1)
    return LeNetZhu(num_classes=10, in_channels=1, image_size=16)


def data(clients: int, *batch_dims: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(clients, *batch_dims, 1, 16, 16, generator=g)
    y = torch.randint(0, 10, (clients, *batch_dims), generator=g)
    return x, y


def small_net(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(3)
    layers = [nn.Conv2d(1, 4, 3, stride=2)]
    if batchnorm:
        layers.append(nn.BatchNorm2d(4))
    layers += [nn.Tanh(), nn.Flatten(), nn.Linear(4 * 7 * 7, 10)]
    return nn.Sequential(*layers)


def hand_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads, losses = [], []
    for xc, yc in zip(x, y):
        loss = F.cross_entropy(model(xc), yc)
        grads.append(torch.autograd.grad(loss, list(params.values())))
        losses.append(loss.detach())
    return {n: torch.stack([g[i] for g in grads]) for i, n in enumerate(params)}, torch.stack(losses)


def hand_fedavg(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, lr: float):
    deltas, losses, models = [], [], []
    for xc, yc in zip(xs, ys):
        local = copy.deepcopy(model)
        opt = torch.optim.SGD([p for p in local.parameters() if p.requires_grad], lr=lr)
        step_losses = []
        for x, y in zip(xc, yc):
            opt.zero_grad()
            loss = F.cross_entropy(local(x), y)
            loss.backward()
            opt.step()
            step_losses.append(loss.detach())
        deltas.append({n: p.detach() for n, p in local.named_parameters() if p.requires_grad})
        losses.append(torch.stack(step_losses).mean())
        models.append(local)
    start = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    stacked = {n: torch.stack([start[n] - d[n] for d in deltas]) for n in start}
    return stacked, torch.stack(losses), models


def assert_close_dicts(a: dict, b: dict, atol: float = ATOL) -> None:
    assert list(a) == list(b)
    for n in a:
        assert a[n].shape == b[n].shape, n
        torch.testing.assert_close(a[n], b[n], atol=atol, rtol=1e-5, msg=n)


# ------------------------------------------------------------------ FedSGD


def test_vectorized_client_gradients_equal_loop_and_hand_autograd():
    model = lenet()
    x, y = data(C, B)
    vec, vec_losses = client_gradients(model, F.cross_entropy, x, y, vectorize=True)
    loop, loop_losses = client_gradients(model, F.cross_entropy, x, y, vectorize=False)
    hand, hand_losses = hand_gradients(model, x, y)
    assert list(vec) == [n for n, _ in model.named_parameters()]
    assert vec["fc.weight"].shape == (C, *model.fc.weight.shape)
    assert_close_dicts(vec, loop)
    assert_close_dicts(vec, hand)
    assert_close_dicts(loop, hand)
    assert vec_losses.shape == loop_losses.shape == (C,)
    torch.testing.assert_close(vec_losses, loop_losses, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(vec_losses, hand_losses, atol=ATOL, rtol=1e-5)


def test_clients_get_their_own_gradients_not_the_batch_mean():
    model = lenet()
    x, y = data(C, B)
    vec, _ = client_gradients(model, F.cross_entropy, x, y, vectorize=True)
    for c in range(1, C):
        assert not torch.allclose(vec["fc.weight"][0], vec["fc.weight"][c])
    pooled = torch.autograd.grad(F.cross_entropy(model(x.flatten(0, 1)), y.flatten()), model.fc.weight)[0]
    torch.testing.assert_close(vec["fc.weight"].mean(0), pooled, atol=ATOL, rtol=1e-5)  # equal batch sizes


def test_chunked_vectorization_equals_unchunked():
    model = lenet()
    x, y = data(C, B)
    full, full_losses = client_gradients(model, F.cross_entropy, x, y, vectorize=True)
    chunked, chunked_losses = client_gradients(model, F.cross_entropy, x, y, vectorize=True, chunk_size=3)
    assert_close_dicts(full, chunked)
    torch.testing.assert_close(full_losses, chunked_losses)


def test_client_gradients_do_not_touch_the_model():
    model = lenet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = data(C, B)
    for vectorize in (True, False):
        client_gradients(model, F.cross_entropy, x, y, vectorize=vectorize)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None, n


# ------------------------------------------------------------------ FedAvg


def test_vectorized_fedavg_equals_loop_and_manual_sgd():
    model = lenet()
    xs, ys = data(3, S, 2)
    lr = 0.5
    vec, vec_losses, vec_buffers = client_local_updates(model, F.cross_entropy, xs, ys, lr=lr, vectorize=True)
    loop, loop_losses, _ = client_local_updates(model, F.cross_entropy, xs, ys, lr=lr, vectorize=False)
    hand, hand_losses, _ = hand_fedavg(model, xs, ys, lr)
    assert vec_buffers is None
    assert_close_dicts(vec, loop)
    assert_close_dicts(vec, hand)
    torch.testing.assert_close(vec_losses, loop_losses, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(vec_losses, hand_losses, atol=ATOL, rtol=1e-5)


def test_fedavg_with_several_steps_differs_from_one_gradient_step():
    model = lenet()
    xs, ys = data(2, S, 2)
    lr = 0.5
    deltas, _, _ = client_local_updates(model, F.cross_entropy, xs, ys, lr=lr, vectorize=True)
    first_step, _ = client_gradients(model, F.cross_entropy, xs[:, 0], ys[:, 0], vectorize=True)
    one_step, _, _ = client_local_updates(model, F.cross_entropy, xs[:, :1], ys[:, :1], lr=lr, vectorize=True)
    # one local step is exactly lr * gradient; three steps are not
    torch.testing.assert_close(one_step["fc.weight"], lr * first_step["fc.weight"], atol=ATOL, rtol=1e-5)
    assert not torch.allclose(deltas["fc.weight"], lr * first_step["fc.weight"], atol=1e-4)


def test_fedavg_leaves_the_global_model_unchanged():
    model = lenet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    xs, ys = data(2, S, 2)
    for vectorize in (True, False):
        client_local_updates(model, F.cross_entropy, xs, ys, lr=0.5, vectorize=vectorize)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


# ------------------------------------------------------------------ BatchNorm


def test_updates_running_stats_detects_training_batchnorm_only():
    assert updates_running_stats(small_net(batchnorm=True))
    assert not updates_running_stats(small_net(batchnorm=False))
    assert not updates_running_stats(small_net(batchnorm=True).eval())
    untracked = small_net(batchnorm=True)
    untracked[1] = nn.BatchNorm2d(4, track_running_stats=False)
    assert not updates_running_stats(untracked)


def test_loop_fedavg_with_batchnorm_returns_clients_mean_buffers():
    model = small_net(batchnorm=True)
    xs, ys = data(3, 2, 4)
    lr = 0.1
    deltas, losses, buffers = client_local_updates(model, F.cross_entropy, xs, ys, lr=lr, vectorize=False)
    hand, hand_losses, locals_ = hand_fedavg(model, xs, ys, lr)
    assert_close_dicts(deltas, hand)
    torch.testing.assert_close(losses, hand_losses, atol=ATOL, rtol=1e-5)
    assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for name in ("1.running_mean", "1.running_var"):
        expected = torch.stack([dict(m.named_buffers())[name] for m in locals_]).mean(0)
        torch.testing.assert_close(buffers[name], expected, atol=ATOL, rtol=1e-5)
    assert buffers["1.num_batches_tracked"].dtype == torch.int64
    assert int(buffers["1.num_batches_tracked"]) == 2  # two local steps per client
    # the clients ran on copies: the global model's statistics are untouched
    assert torch.equal(model[1].running_mean, torch.zeros(4))
    assert int(model[1].num_batches_tracked) == 0


# ------------------------------------------------------------------ frozen parameters


def frozen_net() -> nn.Module:
    model = small_net()
    model[0].weight.requires_grad_(False)
    return model


def test_vectorized_gradients_skip_a_frozen_parameter_and_match_the_loop():
    model = frozen_net()
    x, y = data(C, B)
    vec, vec_losses = client_gradients(model, F.cross_entropy, x, y, vectorize=True)
    loop, loop_losses = client_gradients(model, F.cross_entropy, x, y, vectorize=False)
    hand, _ = hand_gradients(model, x, y)
    assert "0.weight" not in vec and "0.weight" not in loop
    assert list(vec) == ["0.bias", "3.weight", "3.bias"]
    assert_close_dicts(vec, loop)
    assert_close_dicts(vec, hand)
    torch.testing.assert_close(vec_losses, loop_losses, atol=ATOL, rtol=1e-5)


def test_vectorized_gradients_use_the_frozen_parameters_value():
    model = frozen_net()
    x, y = data(C, B)
    before, _ = client_gradients(model, F.cross_entropy, x, y, vectorize=True)
    with torch.no_grad():
        model[0].weight.mul_(3.0)
    after, _ = client_gradients(model, F.cross_entropy, x, y, vectorize=True)
    assert not torch.allclose(before["3.weight"], after["3.weight"])


def test_vectorized_fedavg_with_a_frozen_parameter_matches_the_loop():
    model = frozen_net()
    xs, ys = data(3, S, 2)
    vec, vec_losses, _ = client_local_updates(model, F.cross_entropy, xs, ys, lr=0.3, vectorize=True)
    loop, loop_losses, _ = client_local_updates(model, F.cross_entropy, xs, ys, lr=0.3, vectorize=False)
    hand, _, _ = hand_fedavg(model, xs, ys, 0.3)
    assert "0.weight" not in vec
    assert_close_dicts(vec, loop)
    assert_close_dicts(vec, hand)
    torch.testing.assert_close(vec_losses, loop_losses, atol=ATOL, rtol=1e-5)
