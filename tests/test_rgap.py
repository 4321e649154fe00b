"""R-GAP (Zhu & Blaschko, ICLR 2021): exact recursive inversion, its layer algebra, and its limits.

Every gradient here is computed the way a client computes it
(``parameter_gradients(model, CrossEntropyLoss(), x, y)``) and reaches the attack only
through a :class:`ServerView`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from lightning_gp.attacks.gradient_matching import parameter_gradients
from lightning_gp.attacks.rgap import (
    RGAP,
    ChainLayer,
    GramSolver,
    LayerSystem,
    gather_patches,
    layer_chain,
    patch_indices,
)
from lightning_gp.attacks.view import ServerView
from lightning_gp.metrics.image_quality import psnr
from lightning_gp.models import CNN6, ConvNet

MEAN, STD = (0.5,), (0.5,)


def client_view(
    model: nn.Module,
    shape: tuple[int, ...],
    label: int = 3,
    seed: int = 0,
    batch: int = 1,
    labels_known: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[ServerView, torch.Tensor]:
    """One client's round: random images in [0, 1], normalised, and the gradient it shares (model and
    images in ``dtype``: float64 where a test checks that exact arithmetic would give the image back)."""
    g = torch.Generator().manual_seed(seed)
    images = ((torch.rand(batch, *shape, generator=g) - MEAN[0]) / STD[0]).to(dtype)
    model = model.to(dtype)
    targets = torch.full((batch,), label, dtype=torch.int64)
    grads = parameter_gradients(model, nn.CrossEntropyLoss(), images, targets, create_graph=False)
    view = ServerView(
        model=model,
        gradients={n: t.detach() for n, t in grads.items()},
        batch_size=batch,
        input_shape=shape,
        num_classes=10,
        mean=MEAN,
        std=STD,
        labels=targets.clone() if labels_known else None,
    )
    return view, images


def tiny_model() -> nn.Module:
    """Conv 1->4 (k3, no padding) on 1x6x6: 64 forward + 36 gradient equations for 36 unknowns."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(64, 10, bias=False))


def image_psnr(view: ServerView, recovered: torch.Tensor, truth: torch.Tensor) -> float:
    return float(psnr(view.denormalize(recovered), view.denormalize(truth)))


def gamma(n: int, u: float = 2.0**-53) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of an n-term sum of products in
    floating point (any summation order; u = 2^-53 is float64's unit roundoff)."""
    return n * u / (1 - n * u)


def longest_sum(model: nn.Module, shape: tuple[int, ...]) -> int:
    """Terms in the longest sum of the client's forward and backward pass through the chain: a layer's fan-in
    (forward), its fan-out per input entry (input gradient) and its output positions (weight gradient)."""
    n = 1
    for layer in layer_chain(model, shape, 10):
        module = layer.module
        if isinstance(module, nn.Linear):
            n = max(n, module.in_features, module.out_features)
        else:
            taps = math.prod(module.kernel_size)
            n = max(n, module.in_channels * taps, module.out_channels * taps, math.prod(layer.out_shape[1:]))
    return n


def float64_tolerances(rec, n: int) -> list[float]:
    """First-order bounds, top-down, on the relative error of each layer's recovered input in float64.

    Exact arithmetic gives every layer's input back exactly (full rank, consistent equations). In float64
    the client's gradient has each entry within ``gamma_n`` (relative, ``n`` = :func:`longest_sum`) of the
    exact one and R-GAP's backward-stable solves add as much; a least-squares solve of a consistent full-rank
    system multiplies the relative error of its data by at most ``cond(A)`` (Golub & Van Loan, Sec. 5.3.8),
    and each layer's data (pre-activation, upstream gradient) comes from the solution of the layer above.
    So layer ``i`` (top-down) is within ``gamma_n * prod_{j <= i} cond(A_j)``; the last entry bounds the
    image. ``cond`` is LAPACK's estimate R-GAP reports. The relative residual of a layer is bounded the same
    way (backward stability: ``|A x - b| <= gamma |A| |x|``, and ``|b| >= |x| / |A^+|`` for a consistent
    full-rank system). Catches what leaves a floor above float64 rounding: an approximate read-out, a
    float32 step, a root find or refinement stopped short, a wrong layer.
    """
    bounds, product = [], 1.0
    for layer in rec.meta["rank_deficiency"]:
        assert layer["condition"] is not None, layer  # full rank: the Cholesky path with its estimate
        product *= layer["condition"]
        bounds.append(gamma(n) * product)
    return bounds


# ---------------------------------------------------------------------------------- recovery


def test_exact_recovery_on_a_tiny_full_rank_chain():
    model = tiny_model()
    view, image = client_view(model, (1, 6, 6), dtype=torch.float64)
    rec = RGAP().reconstruct(view)
    assert rec.images.shape == (1, 1, 6, 6) and rec.attack == "RGAP" and rec.loss_trace == []
    (rank,) = rec.meta["rank_deficiency"]
    assert rank == {**rank, "layer": "0", "unknowns": 36, "equations": 64 + 36, "rank": 36, "deficiency": 0}
    # Exact in exact arithmetic: in float64 within rounding amplified by the system's conditioning
    # (float64_tolerances: gamma_64 * cond ~ 8e-14 here, the error ~200x below it).
    n = longest_sum(model, (1, 6, 6))
    (bound,) = float64_tolerances(rec, n)
    assert float((rec.images - image).abs().max()) <= bound * float(image.abs().max())
    (residual,) = rec.meta["residuals"]
    assert residual["forward"] <= bound and residual["gradient"] <= bound
    # The last layer's root find: exact data has a root with residual 0; the float64 gradient it reads is
    # within gamma_n of the exact one, so the polished root's relative residual is within that too.
    assert rec.meta["last_layer"]["method"] == "root find" and rec.meta["last_layer"]["residual"] <= gamma(n)


@pytest.fixture(scope="module")
def cnn6_attack():
    torch.manual_seed(0)
    model = CNN6()
    view, image = client_view(model, (3, 32, 32), label=7, seed=1, dtype=torch.float64)
    return view, image, RGAP().reconstruct(view), longest_sum(model, (3, 32, 32))


def test_cnn6_is_recovered(cnn6_attack):
    _, image, rec, n = cnn6_attack
    assert rec.images.shape == (1, 3, 32, 32)
    assert rec.labels.tolist() == [7] and rec.meta["label"] == "recovered"
    # CNN6 is full rank in every layer: the top-down order and the size of each system
    ranks = rec.meta["rank_deficiency"]
    assert [r["layer"] for r in ranks] == [f"features.{i}" for i in (10, 8, 6, 4, 2, 0)]
    assert [r["unknowns"] for r in ranks] == [1600, 2916, 2916, 2916, 3468, 3072]
    assert all(r["deficiency"] == 0 and r["rank"] == r["unknowns"] for r in ranks)
    # Exact in exact arithmetic: in float64 every layer's residual and the image are within the rounding
    # bound amplified by the conditioning of the layers solved so far (float64_tolerances: n = 3200, the
    # classifier's fan-in; prod cond ~ 5e8; the image bound ~2e-4 relative, i.e. > 80 dB; the error is
    # ~1e-10 of it). A wrong stride, padding or layer order gives errors of order one.
    bounds = float64_tolerances(rec, n)
    assert all(max(s["forward"], s["gradient"]) <= b for s, b in zip(rec.meta["residuals"], bounds))
    assert float((rec.images - image).abs().max()) <= bounds[-1] * float(image.abs().max())


def test_other_activations_an_inner_linear_layer_and_a_biased_head():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1, bias=False),
        nn.Sigmoid(),
        nn.Conv2d(6, 8, 3, bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(128, 32, bias=False),
        nn.LeakyReLU(0.1),
        nn.Linear(32, 10),
    )
    view, image = client_view(model, (2, 6, 6), dtype=torch.float64)
    rec = RGAP().reconstruct(view)
    assert rec.meta["last_layer"]["method"] == "bias gradient"
    assert [r["deficiency"] for r in rec.meta["rank_deficiency"]] == [0, 0, 0]
    # Sigmoid and tanh are inverted exactly (logit, atanh): float64 rounding times the conditioning only
    # (float64_tolerances, ~3e-12 here); a clamp or an approximate inverse leaves a floor far above it.
    bounds = float64_tolerances(rec, longest_sum(model, (2, 6, 6)))
    assert all(max(s["forward"], s["gradient"]) <= b for s, b in zip(rec.meta["residuals"], bounds))
    assert float((rec.images - image).abs().max()) <= bounds[-1] * float(image.abs().max())


def test_rank_deficient_layer_reports_its_deficiency_and_fits_the_constraints():
    # conv 1->1 (k3, stride 2) on 8x8: 9 forward + 9 gradient equations for 64 pixels. One
    # equation per output channel is redundant (<g_o, z_o> = <W_o, dL/dW_o> for any x), and the
    # last row and column are never under the kernel
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 1, 3, stride=2, bias=False), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(9, 10, bias=False)
    )
    view, image = client_view(model, (1, 8, 8), dtype=torch.float64)
    attack = RGAP()
    rec = attack.reconstruct(view)
    (rank,) = rec.meta["rank_deficiency"]
    assert rank["unknowns"] == 64 and rank["equations"] == 18 and rank["rank"] == 17 and rank["deficiency"] == 47
    assert rank["condition"] is None
    # The minimum-norm solution is consistent: a backward-stable solve leaves |A x - b| <= gamma_n |A| |x|, and
    # on the directions it keeps |A x| >= sigma_r |x|, where GramSolver's rank rule (pivots of A^T A above
    # rcond^2 times its largest diagonal entry) puts sigma_r at about rcond * (largest column norm) >= rcond |A| /
    # sqrt(unknowns). So the relative residual is within gamma_n sqrt(64) / rcond (~1e-8 in float64; the float64
    # residual is ~1e-16, and a solution that ignores a block of equations leaves residuals of order one).
    (residual,) = rec.meta["residuals"]
    bound = gamma(longest_sum(model, (1, 8, 8))) * math.sqrt(64) / attack.rcond
    assert residual["forward"] <= bound and residual["gradient"] <= bound
    # never-seen pixels: 0 in the minimum-norm solution (float64 rounding aside)
    assert torch.allclose(rec.images[0, 0, 7], torch.zeros(8, dtype=torch.float64))
    assert image_psnr(view, rec.images, image) < 30


def test_a_pruned_gradient_still_gives_a_measurement():
    view, image = client_view(tiny_model(), (1, 6, 6))
    clean = image_psnr(view, RGAP().reconstruct(view).images, image)
    for name, grad in view.gradients.items():
        cut = grad.abs().flatten().kthvalue(int(0.7 * grad.numel())).values
        view.gradients[name] = torch.where(grad.abs() > cut, grad, torch.zeros_like(grad))
    rec = RGAP().reconstruct(view)
    assert rec.images.isfinite().all()
    assert rec.meta["last_layer"]["rank_one_ratio"] > 1e-3  # no longer one image's rank-one gradient
    assert rec.meta["residuals"][0]["gradient"] > 1e-3  # inconsistent system, least squares anyway
    assert image_psnr(view, rec.images, image) < clean - 20


# ---------------------------------------------------------------------------------- labels


def test_uses_the_labels_the_view_grants():
    view, _ = client_view(tiny_model(), (1, 6, 6), label=3, labels_known=True)
    view.labels = torch.tensor([5])  # a (wrong) granted label must be used as given
    rec = RGAP().reconstruct(view)
    assert rec.labels.tolist() == [5] and rec.meta["label"] == "given"


def test_recovers_the_label_otherwise():
    view, _ = client_view(tiny_model(), (1, 6, 6), label=8)
    rec = RGAP().reconstruct(view)
    assert rec.labels.tolist() == [8] and rec.meta["label"] == "recovered"


# ---------------------------------------------------------------------------------- layer algebra


def explicit_matrices(layer: ChainLayer, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and gradient constraint matrices column by column from PyTorch's own conv ops."""
    conv = layer.module
    weight = conv.weight.detach().double()
    n = int(np.prod(layer.in_shape))
    basis = torch.eye(n, dtype=torch.float64).view(n, *layer.in_shape)
    options = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation)
    forward = nn.functional.conv2d(basis, weight, **options).reshape(n, -1).T
    grad_out = g.view(1, *layer.out_shape)
    columns = [torch.nn.grad.conv2d_weight(basis[j : j + 1], weight.shape, grad_out, **options) for j in range(n)]
    gradient = torch.stack([c.reshape(-1) for c in columns], dim=1)
    return forward, gradient


@pytest.mark.parametrize("stride,padding,dilation", [(1, 0, 1), (2, 1, 1), (2, 2, 1), (1, 1, 2)])
def test_patch_system_matches_explicit_matrices(stride, padding, dilation):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 4 if padding == 2 else 3, stride=stride, padding=padding, dilation=dilation, bias=False)
    features = conv(torch.zeros(1, 3, 7, 7)).numel()
    model = nn.Sequential(conv, nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(features, 10, bias=False))
    layer = layer_chain(model, (3, 7, 7), 10)[0]
    out_len = int(np.prod(layer.out_shape[1:]))
    g = torch.randn(5, out_len, dtype=torch.float64)
    forward, gradient = explicit_matrices(layer, g)
    weight = conv.weight.detach().double().reshape(5, -1)
    system = LayerSystem(
        weight=weight,
        pre=torch.zeros(5, out_len, dtype=torch.float64),
        g=g,
        weight_grad=torch.zeros_like(weight),
        idx=patch_indices(layer),
        n=3 * 49,
    )
    x = torch.randn(3 * 49, dtype=torch.float64)
    got_forward, got_gradient = system.apply(x)
    assert torch.allclose(got_forward.reshape(-1), forward @ x)
    assert torch.allclose(got_gradient.reshape(-1), gradient @ x)
    stacked = torch.cat([forward, system.balance * gradient])
    assert torch.allclose(system.gram(), stacked.T @ stacked)
    f, r = torch.randn(5, out_len, dtype=torch.float64), torch.randn(5, weight.shape[1], dtype=torch.float64)
    assert torch.allclose(
        system.adjoint(f, r), forward.T @ f.reshape(-1) + system.balance**2 * gradient.T @ r.reshape(-1)
    )
    # padding entries are not unknowns: every index is a pixel or the sentinel n
    idx = patch_indices(layer)
    assert idx.min() >= 0 and idx.max() <= 3 * 49 and (idx == 3 * 49).any() == (padding > 0)
    assert torch.equal(
        gather_patches(x, idx)[idx == 3 * 49], torch.zeros(int((idx == 3 * 49).sum()), dtype=torch.float64)
    )


def test_gram_solver_gives_the_minimum_norm_solution_and_the_rank():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 12, generator=g, dtype=torch.float64) @ torch.randn(12, 30, generator=g, dtype=torch.float64)
    b = torch.randn(40, generator=g, dtype=torch.float64)
    solver = GramSolver(a.T @ a, rcond=1e-6)
    assert solver.rank == 12
    assert torch.allclose(solver.solve(a.T @ b), torch.linalg.pinv(a) @ b, atol=1e-6)
    full = torch.randn(40, 30, generator=g, dtype=torch.float64)
    solver = GramSolver(full.T @ full, rcond=1e-6)
    assert solver.rank == 30 and solver.lower is not None
    assert torch.allclose(solver.solve(full.T @ b), torch.linalg.lstsq(full, b.unsqueeze(1)).solution.squeeze(1))


# ---------------------------------------------------------------------------------- clear errors


def test_convnet_with_pooling_and_biases_is_refused_naming_its_layers():
    model = ConvNet()
    view, _ = client_view(model, (1, 28, 28))
    with pytest.raises(ValueError, match=r"conv_layers\.2 \(MaxPool2d\) is not supported") as error:
        RGAP().reconstruct(view)
    assert "conv_layers.0 (Conv2d) has a bias" in str(error.value) and "R-GAP handles" in str(error.value)


def test_batchnorm_is_refused():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, bias=False),
        nn.BatchNorm2d(4),
        nn.LeakyReLU(0.2),
        nn.Flatten(),
        nn.Linear(64, 10, bias=False),
    )
    view, _ = client_view(model, (1, 6, 6))
    with pytest.raises(ValueError, match=r"1 \(BatchNorm2d\) is not supported"):
        RGAP().reconstruct(view)


def test_conv_with_bias_is_refused():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(64, 10, bias=False))
    view, _ = client_view(model, (1, 6, 6))
    with pytest.raises(ValueError, match=r"0 \(Conv2d\) has a bias"):
        RGAP().reconstruct(view)


def test_relu_is_refused_as_not_invertible():
    model = nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(64, 10, bias=False))
    view, _ = client_view(model, (1, 6, 6))
    with pytest.raises(ValueError, match=r"1 \(ReLU\) is not invertible"):
        RGAP().reconstruct(view)


def test_batch_of_two_is_refused():
    view, _ = client_view(tiny_model(), (1, 6, 6), batch=2)
    with pytest.raises(ValueError, match="batch_size 2"):
        RGAP().reconstruct(view)


class SkipBlock(nn.Module):
    """Only supported leaves, but a residual connection: not a plain chain."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1, bias=False)
        self.act = nn.LeakyReLU(0.2)
        self.head = nn.Linear(36, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x + self.act(self.conv(x))).flatten(1))


def test_a_forward_that_is_not_the_chain_is_refused():
    view, _ = client_view(SkipBlock(), (1, 6, 6))
    with pytest.raises(ValueError, match="not the plain chain"):
        RGAP().reconstruct(view)


def test_a_missing_gradient_is_an_error_but_a_zeroed_one_is_not():
    view, _ = client_view(tiny_model(), (1, 6, 6))
    view.gradients["0.weight"] = torch.zeros_like(view.gradients["0.weight"])
    assert RGAP().reconstruct(view).images.isfinite().all()
    del view.gradients["0.weight"]
    with pytest.raises(ValueError, match=r"needs the gradient of '0.weight'"):
        RGAP().reconstruct(view)


def test_a_loss_other_than_cross_entropy_is_refused():
    view, _ = client_view(tiny_model(), (1, 6, 6))
    view.loss_fn = nn.MSELoss()
    with pytest.raises(ValueError, match="CrossEntropyLoss"):
        RGAP().reconstruct(view)
