"""Robbing the Fed (Fowl et al., ICLR 2022): the imprint block and the analytic read-out.

Real modules and the bundled Fashion-MNIST sample; every batch and model is seeded.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from lightning_gp.attacks.gradient_matching import parameter_gradients
from lightning_gp.attacks.robbing_the_fed import ImprintBlock, ImprintedModel, RobbingTheFed
from lightning_gp.attacks.view import ServerView
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.defenses import MagnitudePruning
from lightning_gp.models import LeNetZhu

SHAPE = (1, 28, 28)
BATCH = 16
# 8 x the batch: with K equal-mass bins an image is alone in its bin with probability
# (1 - 1/K)^(B - 1): 0.79 for K = 4B = 64 (below the 80% target on average), 0.89 for K = 128.
NUM_BINS = 8 * BATCH
# Unit roundoff of each float type: every float32 / float64 operation is exact up to a factor (1 + e), |e| <= u.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}


@pytest.fixture(scope="module")
def public_data(data: FashionMNISTSampleDataModule) -> Tensor:
    """What the server holds: test-split images, disjoint from the clients' training batches."""
    return torch.stack([data.test_dataset[i][0] for i in range(1000)])


def client_batch(data: FashionMNISTSampleDataModule, size: int, seed: int) -> tuple[Tensor, Tensor]:
    order = torch.randperm(len(data.train_dataset), generator=torch.Generator().manual_seed(seed))[:size]
    samples = [data.train_dataset[int(i)] for i in order]
    return torch.stack([s[0] for s in samples]), torch.tensor([int(s[1]) for s in samples])


def shared_view(
    model: nn.Module, x: Tensor, y: Tensor, data: FashionMNISTSampleDataModule, secrets: dict
) -> ServerView:
    grads = parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False)
    return ServerView(
        model=model,
        gradients=grads,
        batch_size=x.shape[0],
        input_shape=SHAPE,
        num_classes=10,
        mean=data.mean,
        std=data.std,
        server_secrets=secrets,
    )


def client_round(
    model: nn.Module, x: Tensor, y: Tensor, data: FashionMNISTSampleDataModule, secrets: dict
) -> tuple[ServerView, Tensor]:
    """The client's shared gradient, and what that same backward pass sent into each imprint unit.

    ``delta[s, i] = dL/dz[s, i]`` of image ``s`` at unit ``i`` (``z`` = the imprint layer's pre-activation):
    the factors of the shared rows ``dL/dW_i = sum_s delta[s, i] x_s`` and ``dL/db_i = sum_s delta[s, i]``,
    captured (not recomputed) from the client's own backward pass, so the bound below sees its exact values.
    """
    captured: dict[str, Tensor] = {}

    def capture(module: nn.Module, inputs: tuple, output: Tensor) -> None:
        if output.requires_grad:  # the client's pass, not ServerView's shape probe
            captured["active"] = output.detach() > 0
            output.register_hook(lambda grad: captured.update(grad=grad.detach()))

    handle = model.imprint.relu.register_forward_hook(capture)
    try:
        view = shared_view(model, x, y, data, secrets)
    finally:
        handle.remove()
    return view, torch.where(captured["active"], captured["grad"], torch.zeros_like(captured["grad"]))


def bin_of(delta: Tensor) -> Tensor:
    """Each image's bin in the client's pass: units 0..bin were active (the thresholds increase)."""
    return (delta != 0).sum(1) - 1


def exact_readout(delta: Tensor, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """What bin ``k`` of the client's gradient holds in exact arithmetic, and how far rounding may move it.

    Returns ``(target, bound)`` per pixel. ``target = N0 / D0`` with ``N0 = sum_s (delta[s, k] - delta[s, k+1]) x_s``
    and ``D0`` the same without ``x_s`` (row ``K`` is zero): the attack's read-out (rows ``k`` minus ``k + 1`` of
    the weight gradient over the same of the bias gradient) done exactly on the client's own ``delta``.

    Bound (Higham, Accuracy and Stability of Numerical Algorithms, Sec. 3.1): the client's rows are B-term
    dot products, so in any summation order the shared weight row i is off by at most
    ``gamma_B sum_s |delta[s, i]| |x_s|`` per pixel and the bias row by ``gamma_B sum_s |delta[s, i]|``, with
    ``gamma_n = n u / (1 - n u)``. Hence the numerator is off by at most ``E = gamma (sum_s (|delta[s, k]| +
    |delta[s, k+1]|) |x_s|)``, the denominator by ``F`` (the same without ``|x_s|``), and the ratio by
    ``(E + F |target|) / (|D0| - F)``. ``n = B + 2`` covers the attack's own subtraction and division (float64
    for float32 data: each within one more ``u``), ``+ u (|target| + bound)`` the cast back to the data's dtype.
    The bound scales with ``sum_s |delta[s]| / |delta[t]|``: an image the model already classifies well has a
    small ``delta[t]`` and comes back less exactly (under 80 dB PSNR for one image in these batches, which
    is why a fixed dB threshold was machine-dependent). A correct read-out stays well inside the bound (a few
    percent of it); a 0.1% mix of two images, a wrong pair of rows or a half-precision step exceeds it.
    """
    u = UNIT_ROUNDOFF[delta.dtype]
    batch = delta.shape[0]
    gamma = (batch + 2) * u / (1 - (batch + 2) * u)
    d = delta.double()
    upper = d[:, k + 1] if k + 1 < d.shape[1] else torch.zeros_like(d[:, k])
    weights = d[:, k] - upper
    pixels = x.double().flatten(1)
    numerator, denominator = weights @ pixels, weights.sum()
    size = d[:, k].abs() + upper.abs()
    e, f = gamma * (size @ pixels.abs()), gamma * size.sum()
    target = numerator / denominator
    if float(denominator.abs()) <= float(f):
        return target, torch.full_like(target, math.inf)  # the bin's images cancel: nothing to promise
    bound = (e + f * target.abs()) / (denominator.abs() - f)
    return target, bound + u * (target.abs() + bound)


def check_readout(view: ServerView, rec_images: Tensor, delta: Tensor, x: Tensor, bins: list[int]) -> int:
    """Every recovered image is its bin's exact read-out within the rounding bound; returns how many
    came from a bin holding one image, i.e. are that image verbatim (to float rounding)."""
    low, high = (b.double().flatten() for b in view.data_bounds())
    members = bin_of(delta)
    verbatim = 0
    for image, k in zip(rec_images, bins):
        target, bound = exact_readout(delta, x, k)
        inside = (members == k).nonzero().flatten().tolist()
        if len(inside) == 1:
            # One image: exact arithmetic gives it back verbatim. `target` differs from it only if the
            # client's float32 backward gave linear1's identical columns different values (it does not
            # here; the block structure test pins the identical columns): that much is in the shared
            # gradient itself, and no read-out can undo it.
            truth = x[inside[0]].double().flatten()
            bound = bound + (target - truth).abs()
            verbatim += 1
        else:  # a collision: the gradient-weighted mix of the bin's images
            truth = target
        error = (image.double().flatten() - torch.max(torch.min(truth, high), low)).abs()
        assert bool((error <= bound).all()), (k, inside, float(error.max()), float(bound[error.argmax()]))
    return verbatim


def lone_count_distribution(masses: np.ndarray, batch: int) -> np.ndarray:
    """``P(s of the batch's images are alone in their bin)``, ``s = 0..batch``, for images drawn independently
    into bins of probability ``masses`` (exact: the multinomial sum over occupancies, one bin at a time;
    ``table[n, s]`` sums ``prod m_i^c_i / c_i!`` over the bins so far holding ``n`` images, ``s`` of them alone)."""
    table = np.zeros((batch + 1, batch + 1))
    table[0, 0] = 1.0
    for m in masses:
        new = table.copy()  # no image in this bin
        new[1:, 1:] += table[:-1, :-1] * m  # exactly one: a lone image
        for c in range(2, batch + 1):
            new[c:] += table[:-c] * (m**c / math.factorial(c))
        table = new
    return table[batch] * math.factorial(batch)


def matched_psnr(view: ServerView, recovered: Tensor, originals: Tensor) -> Tensor:
    """PSNR (dB, [0, 1] pixels) of each original against its best recovered image (Hungarian matching on MSE)."""
    a = view.denormalize(recovered.float()).flatten(1)
    b = view.denormalize(originals.float()).flatten(1)
    mse = ((a[:, None] - b[None]) ** 2).mean(-1)
    rows, cols = linear_sum_assignment(mse.numpy())
    return 10 * torch.log10(1 / mse[rows, cols].clamp_min(1e-12))


def test_imprinted_model_layout_and_block_structure(data: FashionMNISTSampleDataModule) -> None:
    torch.manual_seed(0)
    attack = RobbingTheFed(num_bins=32)
    modified, secrets = attack.modify_model(LeNetZhu(), SHAPE, data.mean, data.std)
    assert isinstance(modified, ImprintedModel)
    names = [n for n, _ in modified.named_parameters()]
    assert names[:4] == [
        "imprint.linear0.weight",
        "imprint.linear0.bias",
        "imprint.linear1.weight",
        "imprint.linear1.bias",
    ]
    assert "model.fc.weight" in names
    assert secrets["imprint"]["weight"] == "imprint.linear0.weight" and len(secrets["imprint"]["bins"]) == 32
    block = modified.imprint
    # The attack's two structural requirements: identical measurement rows, identical back columns.
    assert torch.equal(block.linear0.weight, block.linear0.weight[:1].expand_as(block.linear0.weight))
    assert torch.equal(block.linear1.weight, block.linear1.weight[:, :1].expand_as(block.linear1.weight))
    assert torch.allclose(block.linear0.weight[0], torch.full((784,), 1 / 784))
    bins = torch.tensor(secrets["imprint"]["bins"])
    assert bool((bins[1:] > bins[:-1]).all()) and torch.allclose(block.linear0.bias, -bins.float())
    # Residual connection: the image passes through, shifted only uniformly (along w = 1/D).
    x, _ = client_batch(data, 4, seed=0)
    with torch.no_grad():
        shift = (block(x) - x).flatten(1)
    assert torch.allclose(shift, shift[:, :1].expand_as(shift), atol=1e-5)
    assert float(shift.abs().max()) < 1.0


@pytest.fixture(scope="module")
def training_measurements(data: FashionMNISTSampleDataModule) -> Tensor:
    """The measurement (mean normalised brightness, float64) of every image client batches are drawn from."""
    return torch.stack([data.train_dataset[i][0] for i in range(len(data.train_dataset))]).double().flatten(1).mean(1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("connection", ["residual", "linear"])
def test_exact_recovery_when_each_image_has_its_own_bin(
    data: FashionMNISTSampleDataModule, dtype: torch.dtype, connection: str
) -> None:
    x, y = client_batch(data, 8, seed=1)
    x = x.to(dtype)
    # Thresholds between consecutive measurements (average normalised brightness): one image per bin.
    m = x.flatten(1).double().mean(1).sort().values
    assert bool((m[1:] > m[:-1]).all())
    bins = [float(m[0]) - 1.0, *((m[:-1] + m[1:]) / 2).tolist()]
    torch.manual_seed(0)
    attack = RobbingTheFed(connection=connection)
    modified, secrets = attack.modify_model(LeNetZhu(), SHAPE, data.mean, data.std, bins=bins)
    modified = modified.to(dtype)
    view, delta = client_round(modified, x, y, data, secrets)
    rec = attack.reconstruct(view)
    assert rec.images.shape == x.shape and rec.labels is None
    assert rec.meta["num_recovered"] == 8 and rec.meta["num_filled"] == 0
    # Recovered images come in bin order, i.e. sorted by measurement: image order[k] alone in bin k.
    order = x.flatten(1).double().mean(1).argsort()
    assert rec.meta["bins"] == list(range(8)) and bin_of(delta)[order].tolist() == list(range(8))
    # Each is its image to within the rounding bound of the client's float type (exact_readout); a mix, a
    # wrong pair of rows or a lower-precision step in the read-out exceeds it.
    assert check_readout(view, rec.images, delta, x, rec.meta["bins"]) == 8


def test_real_batches_of_16_mostly_recovered_verbatim(
    data: FashionMNISTSampleDataModule, public_data: Tensor, training_measurements: Tensor
) -> None:
    """Strength target: >= 80% of a batch of 16 recovered verbatim, in expectation.

    Collisions are the only thing that costs images: with K bins of equal mass an image is alone in
    its bin with probability (1 - 1/K)^(B - 1) = 0.889 (K = 128, B = 16). Four checks, none of them a
    number one machine printed:

    1. The bins are the public data's equal-mass quantiles: each holds floor or ceil of 1000 / K public
       images (exact; catches wrong bins, and a K other than 128).
    2. The expected lone fraction for the population the batches come from (the 3000 training images
       in each bin), sum_i m_i (1 - m_i)^(B - 1), reaches 0.8. Quantiles from n = 1000 public images
       give K sum m_i^2 ~ 1 + K / n, i.e. an expected (1 - 1/K - 1/n)^(B - 1) ~ 0.875 (0.875 here; over
       random draws of the 1000 public images 0.873 +- 0.002, so 0.8 is decided far from it); K = 64
       gives 0.78 and fails.
    3. The lone images in the 10 seeded batches number at least the 1e-6 quantile of their exact
       distribution given those masses (lone_count_distribution; drawing without replacement only
       makes collisions rarer): a correct implementation fails this with probability <= 1e-6.
    4. Every recovered image is its bin's exact read-out to within the float32 rounding bound
       (check_readout): a lone image comes back verbatim, a collision as the gradient-weighted mix.
       Every lone image whose bin's signal clears the attack's threshold tenfold is recovered.
    """
    num_public = public_data.shape[0]
    lone_total, verbatim_total, distribution = 0, 0, np.ones(1)
    for seed in range(10):
        torch.manual_seed(seed)
        attack = RobbingTheFed(num_bins=NUM_BINS)
        modified, secrets = attack.modify_model(LeNetZhu(), SHAPE, data.mean, data.std, public_data=public_data)
        thresholds = torch.tensor(modified.imprint.bins, dtype=torch.float64)
        assert modified.imprint.linear0.out_features == NUM_BINS == len(thresholds)
        # 1. Unit i fires when m > c_i: bin = (number of thresholds below m) - 1. float64 measurements
        # against float64 thresholds: no public image is within 4e-7 of a threshold, float64 rounding of a
        # measurement is ~1e-15, so the counts do not depend on the machine's BLAS.
        public_counts = torch.bincount(
            torch.bucketize(public_data.double().flatten(1).mean(1), thresholds) - 1, minlength=NUM_BINS
        )
        assert int(public_counts.min()) == num_public // NUM_BINS
        assert int(public_counts.max()) == -(-num_public // NUM_BINS)
        # 2. Bin masses over the training population (a training image within float rounding of a
        # threshold moves a mass by 1/3000: far from deciding either check).
        masses = torch.bincount(torch.bucketize(training_measurements, thresholds) - 1, minlength=NUM_BINS).double()
        masses = (masses / masses.sum()).numpy()
        expected_lone = float((masses * (1 - masses) ** (BATCH - 1)).sum())
        assert expected_lone >= 0.8, expected_lone
        distribution = np.convolve(distribution, lone_count_distribution(masses, BATCH))

        x, y = client_batch(data, BATCH, seed=seed)
        view, delta = client_round(modified, x, y, data, secrets)
        rec = attack.reconstruct(view)
        assert rec.meta["num_recovered"] + rec.meta["num_filled"] == BATCH
        # 4. Recovered images against the client's own pass (bins from its activation pattern).
        verbatim_total += check_readout(view, rec.images[: rec.meta["num_recovered"]], delta, x, rec.meta["bins"])
        counts = torch.bincount(bin_of(delta), minlength=NUM_BINS)
        lone_bins = (counts == 1).nonzero().flatten()
        lone_total += len(lone_bins)
        bias = view.gradients["imprint.linear0.bias"].double()
        signal = (bias - torch.cat([bias[1:], bias.new_zeros(1)])).abs()
        clear = lone_bins[signal[lone_bins] >= 10 * attack.rel_threshold * signal.max()]
        assert set(clear.tolist()) <= set(rec.meta["bins"]), (clear.tolist(), rec.meta["bins"])
    # 3. The 1e-6 quantile of the lone count over the 10 batches (independent given the bins).
    quantile = int((np.cumsum(distribution) <= 1e-6).sum())  # P(lone_total < quantile) <= 1e-6
    print(
        f"RtF K={NUM_BINS} B={BATCH}: {lone_total}/160 images alone in their bin ({verbatim_total} recovered "
        f"verbatim), expected {float(np.arange(len(distribution)) @ distribution):.1f}, 1e-6 quantile {quantile}"
    )
    assert lone_total >= quantile
    assert verbatim_total >= quantile


def test_normal_assumption_bins_without_public_data(data: FashionMNISTSampleDataModule) -> None:
    """Bins from a normal prior only (standard normal, truncated to the valid range) still work, less well."""
    torch.manual_seed(0)
    attack = RobbingTheFed(num_bins=NUM_BINS)
    modified, secrets = attack.modify_model(LeNetZhu(), SHAPE, data.mean, data.std)
    x, y = client_batch(data, BATCH, seed=0)
    view = shared_view(modified, x, y, data, secrets)
    psnr = matched_psnr(view, attack.reconstruct(view).images, x)
    assert int((psnr > 40).sum()) >= BATCH // 2


def test_unmodified_model_is_rejected(data: FashionMNISTSampleDataModule) -> None:
    torch.manual_seed(0)
    model = LeNetZhu()
    x, y = client_batch(data, 4, seed=0)
    attack = RobbingTheFed(num_bins=16)
    with pytest.raises(ValueError, match="modify_model"):
        attack.reconstruct(shared_view(model, x, y, data, {}))
    # Secrets of a modified model, but the client trained the original: the gradient lacks the block.
    _, secrets = attack.modify_model(model, SHAPE, data.mean, data.std)
    with pytest.raises(ValueError, match="server-modified model"):
        attack.reconstruct(shared_view(model, x, y, data, secrets))


def test_magnitude_pruning_degrades_recovery(data: FashionMNISTSampleDataModule, public_data: Tensor) -> None:
    torch.manual_seed(0)
    attack = RobbingTheFed(num_bins=NUM_BINS)
    modified, secrets = attack.modify_model(LeNetZhu(), SHAPE, data.mean, data.std, public_data=public_data)
    x, y = client_batch(data, BATCH, seed=0)
    clean = shared_view(modified, x, y, data, secrets)
    pruned = ServerView(
        model=modified,
        gradients=MagnitudePruning(0.8)(clean.gradients),
        batch_size=BATCH,
        input_shape=SHAPE,
        num_classes=10,
        mean=data.mean,
        std=data.std,
        server_secrets=secrets,
    )
    clean_psnr = matched_psnr(clean, attack.reconstruct(clean).images, x)
    pruned_psnr = matched_psnr(pruned, attack.reconstruct(pruned).images, x)
    print(
        f"RtF under 80% magnitude pruning: mean PSNR {float(pruned_psnr.mean()):.1f} dB "
        f"(clean {float(clean_psnr.mean()):.1f}), PSNR>40: {int((pruned_psnr > 40).sum())}/{BATCH} "
        f"(clean {int((clean_psnr > 40).sum())}/{BATCH})"
    )
    assert float(pruned_psnr.mean()) < float(clean_psnr.mean())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_bins=0), "num_bins"),
        (dict(measurement="median"), "measurement"),
        (dict(connection="skip"), "connection"),
        (dict(rel_threshold=1.5), "rel_threshold"),
    ],
)
def test_invalid_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RobbingTheFed(**kwargs)


def test_bins_must_increase() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        ImprintBlock(SHAPE, bins=[0.0, 0.0, 1.0])
    assert math.isclose(ImprintBlock(SHAPE, bins=[-1.0, 0.5]).linear0.bias[1].item(), -0.5)
