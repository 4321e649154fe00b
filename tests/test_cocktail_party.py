"""The Cocktail Party attack (Kariyappa et al., ICML 2023): ICA on a first fully connected layer's gradient.

Real modules and the bundled Fashion-MNIST sample; every batch and model is seeded.

The bounds. An uninformed guess, the batch's own per-pixel mean image (which even knows the batch),
scores 10-12 dB against each image on this data; the attack must beat it by 6 dB (a quarter of its
squared error). Fashion-MNIST images resemble each other (two shirts correlate at 0.9), so a
recovery "correlates with its original" only when it correlates with it more than any other image of
the batch does: an attack returning look-alikes, even the batch's own other images, scores 0 on that.
A peeled pure row is exact up to float32 rounding: the gradient's relative error is about 1e-7, and
each deflation carries the rounding of the images peeled before into the rows left, which on these
batches costs at most a few 1e-3 of the pixel range (50 dB); 40 dB, an error of 1% of the range, is
far beyond any approximate recovery (the ICA's best images reach 25-35 dB) and keeps a margin.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_gp.attacks import (
    AttackNotApplicable,
    CocktailParty,
    ServerView,
    attacks_by_name,
    first_linear_layer,
    threat_class_of,
)
from lightning_gp.attacks.gradient_matching import parameter_gradients
from lightning_gp.audit import AttackBudget
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.metrics.image_quality import psnr
from lightning_gp.metrics.matching import match_reconstructions
from lightning_gp.models import MLP, LeNetZhu

SHAPE = (1, 28, 28)
BEAT_THE_MEAN_DB = 6.0
EXACT_DB = 40.0

pytestmark = pytest.mark.usefixtures("one_thread")  # small matrices: one thread, immune to shared cores


@pytest.fixture(scope="module")
def data() -> FashionMNISTSampleDataModule:
    datamodule = FashionMNISTSampleDataModule(seed=0)
    datamodule.setup("fit")
    return datamodule


def client_batch(data: FashionMNISTSampleDataModule, size: int, seed: int) -> tuple[Tensor, Tensor]:
    order = torch.randperm(len(data.train_dataset), generator=torch.Generator().manual_seed(seed))[:size]
    samples = [data.train_dataset[int(i)] for i in order]
    return torch.stack([s[0] for s in samples]), torch.tensor([int(s[1]) for s in samples])


def mlp(seed: int, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(**kwargs)


def view_of(model: nn.Module, gradients: dict[str, Tensor], batch: int, data) -> ServerView:
    return ServerView(
        model=model,
        gradients=gradients,
        batch_size=batch,
        input_shape=SHAPE,
        num_classes=10,
        mean=data.mean,
        std=data.std,
    )


def batch_view(model: nn.Module, x: Tensor, y: Tensor, data) -> ServerView:
    return view_of(model, parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False), len(x), data)


def scores(view: ServerView, images: Tensor, originals: Tensor) -> dict[str, Tensor]:
    """Per original (in pixels): the PSNR of its one-to-one match, the mean-image baseline, the best
    |r| of any recovery, and the highest |r| of any other original of the batch."""
    recovered, truth = view.denormalize(images), view.denormalize(originals)
    matched = psnr(recovered[match_reconstructions(recovered, truth, "mse")], truth)
    baseline = psnr(truth.mean(dim=0, keepdim=True).expand_as(truth), truth)

    def unit(batch: Tensor) -> Tensor:
        flat = batch.flatten(1).double()
        flat = flat - flat.mean(dim=1, keepdim=True)
        return flat / flat.norm(dim=1, keepdim=True).clamp(min=1e-12)

    correlation = (unit(truth) @ unit(recovered).T).abs()
    among = (unit(truth) @ unit(truth).T).abs() - 2 * torch.eye(len(truth), dtype=torch.float64)
    return {"psnr": matched, "baseline": baseline, "best_r": correlation.amax(dim=1), "other_r": among.amax(dim=1)}


# ----------------------------------------------------------------------------------- recovery
def test_the_papers_ica_unmixes_a_batch_far_beyond_an_uninformed_guess(data) -> None:
    x, y = client_batch(data, 12, seed=3)
    model = mlp(3)
    view = batch_view(model, x, y, data)
    result = CocktailParty(peel=False).reconstruct(view)
    assert result.images.shape == (12, *SHAPE) and result.labels is None and result.attack == "CocktailParty"
    assert result.meta["peeled"] == 0 and result.meta["ica_components"] == 12 and result.meta["converged"]
    assert result.meta["scale"] == ["bias"] * 12 and len(result.loss_trace) == result.meta["iterations"]
    s = scores(view, result.images, x)
    assert float(s["psnr"].mean()) >= float(s["baseline"].mean()) + BEAT_THE_MEAN_DB, s
    recognised = (s["best_r"] > s["other_r"]).double().mean()
    assert float(recognised) >= 0.75, s
    low, high = view.data_bounds()
    assert bool((result.images >= low).all() and (result.images <= high).all())


def test_pure_rows_of_a_relu_layer_give_every_image_exactly(data) -> None:
    x, y = client_batch(data, 12, seed=3)
    view = batch_view(mlp(3), x, y, data)
    result = CocktailParty().reconstruct(view)
    assert result.meta["peeled"] == 12 and result.meta["ica_components"] == 0
    assert all(ratio < 1e-4 for ratio in result.meta["peel_ratios"])
    s = scores(view, result.images, x)
    assert bool((s["psnr"] > EXACT_DB).all()), s["psnr"]
    assert bool((s["best_r"] > 0.9999).all())


def test_a_secure_aggregate_of_four_clients_is_unmixed(data) -> None:
    """The server sees only the mean of 4 clients' gradients (8 images each): one mixture of 32 images."""
    model = mlp(1)
    batches = [client_batch(data, 8, seed=100 + c) for c in range(4)]
    grads = [parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False) for x, y in batches]
    mean = {name: torch.stack([g[name] for g in grads]).mean(dim=0) for name in grads[0]}
    originals = torch.cat([x for x, _ in batches])
    view = view_of(model, mean, 32, data)
    for peel in (False, True):  # the paper's ICA alone, then with the exact peeling first
        result = CocktailParty(iterations=2000, peel=peel).reconstruct(view)
        assert result.images.shape == (32, *SHAPE) and result.meta["num_missing"] == 0
        s = scores(view, result.images, originals)
        assert float(s["psnr"].mean()) >= float(s["baseline"].mean()) + BEAT_THE_MEAN_DB, s
        assert float((s["best_r"] > s["other_r"]).double().mean()) >= 0.75, s
    assert result.meta["peeled"] > 0
    truth = view.denormalize(originals)
    for image in view.denormalize(result.images[: result.meta["peeled"]]):  # each is one of the 32, exactly
        assert float(psnr(image.expand_as(truth), truth).max()) > EXACT_DB


def test_without_exact_zeros_nothing_is_peeled_and_ica_still_unmixes(data) -> None:
    x, y = client_batch(data, 8, seed=5)
    view = batch_view(mlp(5, activation="sigmoid"), x, y, data)
    result = CocktailParty().reconstruct(view)
    assert result.meta["peeled"] == 0 and result.meta["ica_components"] == 8
    s = scores(view, result.images, x)
    assert float(s["psnr"].mean()) >= float(s["baseline"].mean()) + BEAT_THE_MEAN_DB, s


def test_without_a_bias_the_scale_comes_from_the_valid_range(data) -> None:
    x, y = client_batch(data, 8, seed=5)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 64, bias=False), nn.ReLU(), nn.Linear(64, 10))
    view = batch_view(model, x, y, data)
    result = CocktailParty().reconstruct(view)
    assert result.meta["scale"] == ["range"] * 8 and result.meta["peeled"] == 0
    s = scores(view, result.images, x)
    assert float(s["psnr"].mean()) >= float(s["baseline"].mean()) + BEAT_THE_MEAN_DB, s


def test_the_same_seed_gives_the_same_reconstruction(data) -> None:
    x, y = client_batch(data, 6, seed=7)
    view = batch_view(mlp(7), x, y, data)
    runs = [CocktailParty(iterations=200, peel=False, init="random", seed=s).reconstruct(view) for s in (1, 1, 2)]
    assert torch.equal(runs[0].images, runs[1].images) and runs[0].loss_trace == runs[1].loss_trace
    assert runs[0].meta == runs[1].meta
    assert runs[0].loss_trace != runs[2].loss_trace  # the random start is the seed's
    identity = [CocktailParty(iterations=200, peel=False, seed=s).reconstruct(view) for s in (1, 2)]
    assert torch.equal(identity[0].images, identity[1].images)  # the paper's start uses no randomness


# ------------------------------------------------------------------------------- named gaps
def test_a_conv_first_model_is_not_applicable_naming_its_first_layer(data) -> None:
    x, y = client_batch(data, 4, seed=0)
    torch.manual_seed(0)
    view = batch_view(LeNetZhu(), x, y, data)
    with pytest.raises(AttackNotApplicable, match=r"body\.0 \(Conv2d\), not an nn\.Linear"):
        CocktailParty().reconstruct(view)


def test_fewer_hidden_units_than_images_is_not_applicable_naming_the_rank(data) -> None:
    x, y = client_batch(data, 16, seed=0)
    view = batch_view(mlp(0, hidden=(8,)), x, y, data)
    with pytest.raises(AttackNotApplicable, match=r"8 hidden units for a batch of 16 images: .* rank at most 8 < 16"):
        CocktailParty().reconstruct(view)


def test_a_first_linear_layer_on_a_transformed_input_is_not_applicable(data) -> None:
    class Halve(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x / 2

    x, y = client_batch(data, 4, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), Halve(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10))
    with pytest.raises(AttackNotApplicable, match=r"input of the first layer 2 \(Linear\) is not the flattened image"):
        CocktailParty().reconstruct(batch_view(model, x, y, data))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("iterations", 0),
        ("lr", 0.0),
        ("ne_weight", -1.0),
        ("tv_weight", -1.0),
        ("mi_weight", -0.5),
        ("temperature", -1.0),
        ("range_weight", float("nan")),
        ("tol", -1e-9),
        ("plateau_steps", -1),
        ("plateau_rtol", 2.0),
        ("peel_tol", 0.0),
        ("init", "pca"),
    ],
)
def test_bad_arguments_are_refused_naming_them(name: str, value) -> None:
    with pytest.raises(ValueError, match=name):
        CocktailParty(**{name: value})


# ------------------------------------------------------------------------------- the registry
def test_the_attack_is_published_passive_and_in_the_sok_s_class_b() -> None:
    (published,) = attacks_by_name(["CocktailParty"])
    attack = published.build(AttackBudget(), 3, MLP())
    assert isinstance(attack, CocktailParty) and attack.seed == 3
    assert not callable(getattr(attack, "modify_model", None))  # the audit's passive and aggregate views run it
    assert threat_class_of(attack).id == "B"


# ------------------------------------------------------------------------------------ the model
def test_the_mlp_is_a_linear_first_layer_on_the_flattened_image_and_checks_its_arguments() -> None:
    model = MLP(num_classes=3, in_channels=3, image_size=(4, 5), hidden=(7, 6), activation="tanh")
    assert model(torch.zeros(2, 3, 4, 5)).shape == (2, 3)
    layer = first_linear_layer(model, (3, 4, 5))
    assert (layer.name, layer.weight, layer.bias, layer.module.out_features) == (
        "layers.1",
        "layers.1.weight",
        "layers.1.bias",
        7,
    )
    for kwargs, name in [
        ({"hidden": ()}, "hidden"),
        ({"hidden": (0,)}, "hidden"),
        ({"hidden": 256}, "hidden"),
        ({"activation": "gelu"}, "activation"),
        ({"num_classes": 1}, "num_classes"),
    ]:
        with pytest.raises(ValueError, match=name):
            MLP(**kwargs)
