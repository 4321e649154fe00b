"""Gradient inversion attacks from the server's view: ServerView, label recovery, DLG/iDLG,
Inverting Gradients and GradInversion.

Real models and the bundled Fashion-MNIST sample; every model, batch and attack is seeded.
Budgets are small (a few hundred Adam steps, tens of L-BFGS steps): the assertions compare
against a random guess, which the attacks beat by a wide margin long before convergence.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import Tensor, nn

from lightning_gp.attacks import (
    DLG,
    IDLG,
    GradInversion,
    InvertingGradients,
    ServerView,
    label_counts,
    label_estimates_differ,
    parameter_gradients,
    recover_labels,
)
from lightning_gp.attacks.gradient_matching import squared_l2_distance
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.models import LeNetZhu
from lightning_gp.records import TappedGradient

SHAPE = (1, 28, 28)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def first_of_class(data: FashionMNISTSampleDataModule) -> dict[int, int]:
    """Index of the first training image of each class."""
    first: dict[int, int] = {}
    for i, label in enumerate(data.train_dataset.targets.tolist()):
        first.setdefault(int(label), i)
        if len(first) == 10:
            break
    return first


def batch_of(data: FashionMNISTSampleDataModule, indices: list[int]) -> tuple[Tensor, Tensor]:
    samples = [data.train_dataset[i] for i in indices]
    return torch.stack([s[0] for s in samples]), torch.tensor([int(s[1]) for s in samples])


def make_view(model: nn.Module, x: Tensor, y: Tensor, data: FashionMNISTSampleDataModule, **kwargs) -> ServerView:
    grads = parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False)
    return ServerView(
        model=model,
        gradients=grads,
        batch_size=x.shape[0],
        input_shape=SHAPE,
        num_classes=10,
        mean=data.mean,
        std=data.std,
        **kwargs,
    )


def seeded_lenet(seed: int = 0, **kwargs) -> LeNetZhu:
    torch.manual_seed(seed)
    return LeNetZhu(**kwargs)


def pixel_psnr(view: ServerView, a: Tensor, b: Tensor) -> float:
    """PSNR in dB of two normalised images after mapping both to [0, 1] pixels (computed here, not
    with the library's metric, so the test does not rest on the code under test)."""
    mse = float((view.denormalize(a.detach()) - view.denormalize(b.detach())).pow(2).mean())
    return 10 * math.log10(1 / max(mse, 1e-30))


def random_guess_psnr(view: ServerView, x: Tensor, seed: int = 1) -> float:
    guess = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    return pixel_psnr(view, guess, x)


@pytest.fixture(scope="module")
def single(data: FashionMNISTSampleDataModule) -> tuple[ServerView, Tensor, Tensor]:
    """One image (index 0, class 9) on a seeded LeNetZhu at DLG's init."""
    x, y = batch_of(data, [0])
    return make_view(seeded_lenet(0), x, y, data), x, y


# ------------------------------------------------------------------------------ ServerView
def test_server_view_rejects_gradients_missing_a_layer(single) -> None:
    view, _, _ = single
    grads = {n: g for n, g in view.gradients.items() if n != "fc.bias"}
    with pytest.raises(ValueError, match=r"missing \['fc.bias'\]"):
        ServerView(model=view.model, gradients=grads, batch_size=1, input_shape=SHAPE, num_classes=10)


def test_server_view_rejects_unexpected_gradient_name(single) -> None:
    view, _, _ = single
    grads = {**view.gradients, "head.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"unexpected \['head.weight'\]"):
        ServerView(model=view.model, gradients=grads, batch_size=1, input_shape=SHAPE, num_classes=10)


def test_server_view_rejects_gradient_of_wrong_shape(single) -> None:
    view, _, _ = single
    grads = {**view.gradients, "fc.weight": view.gradients["fc.weight"].t()}
    with pytest.raises(ValueError, match=r"fc\.weight: gradient \(588, 10\) vs parameter \(10, 588\)"):
        ServerView(model=view.model, gradients=grads, batch_size=1, input_shape=SHAPE, num_classes=10)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -2}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 1.0}, "batch_size"),
        ({"num_classes": 1}, "num_classes"),
        ({"input_shape": (1, 0, 28)}, "input_shape"),
        ({"mean": (0.1, 0.2)}, "mean needs one value per channel"),
        ({"std": (0.3, 0.3, 0.3)}, "std needs one value per channel"),
        ({"std": (0.0,)}, "std must be positive"),
        ({"std": (-0.35,)}, "std must be positive"),
        ({"labels": torch.tensor([1, 2])}, "labels must have shape"),
        ({"labels": torch.tensor([[1]])}, "labels must have shape"),
    ],
)
def test_server_view_rejects_bad_arguments(single, overrides: dict, message: str) -> None:
    view, _, _ = single
    kwargs = dict(model=view.model, gradients=view.gradients, batch_size=1, input_shape=SHAPE, num_classes=10)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=message):
        ServerView(**kwargs)


def test_server_view_rejects_a_model_that_is_not_a_module(single) -> None:
    view, _, _ = single
    with pytest.raises(TypeError, match=r"nn.Module"):
        ServerView(model=lambda x: x, gradients=view.gradients, batch_size=1, input_shape=SHAPE, num_classes=10)


def test_server_view_repeats_a_single_mean_and_std_per_channel() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
    rgb = ServerView(
        model=model,
        gradients={n: torch.zeros_like(p) for n, p in model.named_parameters()},
        batch_size=1,
        input_shape=(3, 8, 8),
        num_classes=10,
        mean=(0.5,),
        std=(0.25,),
    )
    assert rgb.mean == (0.5, 0.5, 0.5) and rgb.std == (0.25, 0.25, 0.25)
    low, high = rgb.data_bounds()
    assert low.shape == high.shape == (1, 3, 1, 1)
    torch.testing.assert_close(low.flatten(), torch.full((3,), -2.0))
    torch.testing.assert_close(high.flatten(), torch.full((3,), 2.0))


def test_data_bounds_and_denormalize_give_back_the_original_pixels(data, single) -> None:
    view, _, _ = single
    raw = FashionMNISTSampleDataModule(normalize=False)
    raw.setup("fit")
    indices = [0, 1, 2, 3, 17]
    normalised = torch.stack([data.train_dataset[i][0] for i in indices])
    pixels = torch.stack([raw.train_dataset[i][0] for i in indices])
    assert pixels.min() >= 0 and pixels.max() <= 1 and pixels.max() > 0.9  # the ground truth really is [0, 1]

    low, high = view.data_bounds()
    assert low.shape == high.shape == (1, 1, 1, 1)
    mean, std = data.mean[0], data.std[0]
    assert float(low) == pytest.approx(-mean / std, rel=1e-6)
    assert float(high) == pytest.approx((1 - mean) / std, rel=1e-6)
    # Black pixels sit exactly on the lower bound; nothing lies outside the box.
    assert float(normalised.min()) == pytest.approx(float(low), abs=1e-5)
    assert bool((normalised >= low - 1e-5).all() and (normalised <= high + 1e-5).all())

    torch.testing.assert_close(view.denormalize(normalised), pixels, atol=1e-5, rtol=0)
    # Outside the box it clamps to [0, 1].
    assert float(view.denormalize(high + 3).max()) == 1.0
    assert float(view.denormalize(low - 3).min()) == 0.0


def test_to_device_copies_the_view(single) -> None:
    view, _, y = single
    labelled = ServerView(
        model=view.model, gradients=view.gradients, batch_size=1, input_shape=SHAPE, num_classes=10, labels=y
    )
    before = copy.deepcopy(labelled.model.state_dict())
    moved = labelled.to("cpu")
    assert moved is not labelled and moved.model is not labelled.model
    assert torch.equal(moved.labels, y) and moved.batch_size == 1 and moved.input_shape == SHAPE
    with torch.no_grad():
        for p in moved.model.parameters():
            p.add_(1.0)
    moved.gradients["fc.bias"] = torch.zeros(10)
    for name, value in labelled.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not torch.equal(labelled.gradients["fc.bias"], torch.zeros(10))


def test_from_tap_takes_only_what_the_server_knows(data) -> None:
    x, y = batch_of(data, [3, 4, 5])
    source = seeded_lenet(7)
    grads = parameter_gradients(source, nn.CrossEntropyLoss(), x, y, create_graph=False)
    record = TappedGradient(
        round=2,
        client_id=1,
        gradients=grads,
        model_state={n: t.clone() for n, t in source.state_dict().items()},
        model_class="lightning_gp.models.lenet.LeNetZhu",
        batch=(x, y),
        meta={"algorithm": "fedsgd"},
    )
    target = seeded_lenet(8)
    server = ServerView.from_tap(record, target, num_classes=10, mean=data.mean, std=data.std)
    assert server.batch_size == 3 and server.input_shape == SHAPE
    assert server.labels is None
    assert server.meta == {"algorithm": "fedsgd"} and server.server_secrets == {}
    assert server.model is target
    assert torch.equal(target.fc.weight, source.fc.weight)  # the round's weights were loaded

    known = ServerView.from_tap(record, seeded_lenet(8), num_classes=10, labels_known=True)
    assert torch.equal(known.labels, y) and known.labels is not y

    without_batch = TappedGradient(
        round=0, client_id=0, gradients=grads, model_state=record.model_state, model_class="x", batch=None
    )
    with pytest.raises(ValueError, match="no batch recorded"):
        ServerView.from_tap(without_batch, seeded_lenet(8), num_classes=10)


# -------------------------------------------------------------------------- label recovery
def test_idlg_labels_are_exact_for_one_image_of_every_class(data, first_of_class) -> None:
    model = seeded_lenet(0)
    for label, index in sorted(first_of_class.items()):
        x, y = batch_of(data, [index])
        assert int(y) == label
        view = make_view(model, x, y, data)
        recovered = recover_labels(view)
        assert recovered.dtype == torch.int64 and recovered.shape == (1,)
        assert int(recovered) == label
        assert int(recover_labels(view, "idlg")) == label


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("method", ["yin", "bias"])
def test_batch_labels_exact_for_distinct_labels_at_default_init(data, method: str, seed: int) -> None:
    """At PyTorch's default init the softmax is nearly uniform (p ~ 1/10), so every label in a
    batch of 5 distinct ones has a negative last-layer gradient: both rules are exact."""
    classes = [int(c) for c in torch.randperm(10, generator=torch.Generator().manual_seed(seed))[:5]]
    targets = data.train_dataset.targets
    x, y = batch_of(data, [int((targets == c).nonzero()[seed]) for c in classes])  # the seed-th image of each class
    view = make_view(seeded_lenet(seed, init="default"), x, y, data)
    recovered = recover_labels(view, method)
    assert recovered.tolist() == sorted(classes)  # sorted, exact set


def chance_overlap_tail(batches: int, labels: int = 5, classes: int = 10) -> list[float]:
    """``tail[t] = P(a rule that guesses `labels` of `classes` at random gets >= t right over `batches` batches)``:
    each batch's overlap is hypergeometric, the batches independent (exact convolution)."""
    one = [
        math.comb(labels, k) * math.comb(classes - labels, labels - k) / math.comb(classes, labels)
        for k in range(labels + 1)
    ]
    total = [1.0]
    for _ in range(batches):
        total = [
            sum(total[t - k] * one[k] for k in range(labels + 1) if 0 <= t - k < len(total))
            for t in range(len(total) + labels)
        ]
    return [sum(total[t:]) for t in range(len(total))]


def test_batch_labels_mostly_right_at_dlg_init(data) -> None:
    """At DLG's U[-0.5, 0.5] init LeNetZhu's softmax is saturated: one image may predict another
    batch member's class with p ~ 1, which cancels that class's negative gradient. Neither rule is
    exact then, but both stay far above chance (5/10 right).

    The bar: the count a random guess reaches with probability <= 1e-6 over these 20 batches (69 of 100,
    chance_overlap_tail), so a rule no better than guessing (or a flipped sort) fails it. Both rules pick
    the 5 most negative scores, and in float32 two scores can sit closer than float32 rounding (one
    batch here: 7e-9 relative), so the gradients are float64 and every pick is checked to be decided
    far from a tie: the outcome of these seeded batches does not depend on the machine. A fresh set of
    20 seeds would fail a correct implementation with probability ~3e-8 (bias rule; ~1e-28 for yin)
    under the per-batch accuracies of 300 other seeded batches (yin 0.92, bias 0.85 on average).
    """
    targets = data.train_dataset.targets
    batches = 20
    correct = {"yin": 0, "bias": 0}
    for seed in range(batches):
        g = torch.Generator().manual_seed(seed)
        classes = torch.randperm(10, generator=g)[:5]
        indices = [int((targets == c).nonzero()[torch.randint(300, (1,), generator=g)]) for c in classes]
        x, y = batch_of(data, indices)
        view = make_view(seeded_lenet(seed).double(), x.double(), y, data)
        scores = {"yin": view.gradients["fc.weight"].min(dim=1).values, "bias": view.gradients["fc.bias"]}
        for method in correct:
            # The 5th and 6th most negative scores are >= 1e-12 of the largest apart: sums of a few
            # bounded terms carry float64 rounding ~1e-16 of it, so no machine flips the pick.
            ordered = scores[method].sort().values
            assert float(ordered[5] - ordered[4]) >= 1e-12 * float(ordered.abs().max()), (seed, method)
            correct[method] += len(set(recover_labels(view, method).tolist()) & set(y.tolist()))
    tail = chance_overlap_tail(batches)
    bar = next(t for t in range(len(tail)) if tail[t] <= 1e-6)
    print(f"labels right of {5 * batches} at DLG's init: {correct}, chance reaches {bar} with p {tail[bar]:.1e}")
    assert correct["yin"] >= bar and correct["bias"] >= bar


def test_label_recovery_rejects_impossible_requests(data, single) -> None:
    view, _, _ = single
    x, y = batch_of(data, [0, 1])
    pair = make_view(view.model, x, y, data)
    with pytest.raises(ValueError, match="one image"):
        recover_labels(pair, "idlg")
    with pytest.raises(ValueError, match="method must be one of"):
        recover_labels(pair, "largest")
    eleven = ServerView(model=view.model, gradients=view.gradients, batch_size=11, input_shape=SHAPE, num_classes=10)
    for method in ("yin", "bias"):
        with pytest.raises(ValueError, match="distinct labels, impossible for 11 images of 10 classes"):
            recover_labels(eleven, method)


def repeated_label_batch(data, seed: int, size: int = 16) -> tuple[Tensor, Tensor]:
    """``size`` training images drawn by ``seed``: more than the 10 classes, so labels repeat."""
    order = torch.randperm(len(data.train_dataset), generator=torch.Generator().manual_seed(seed))[:size]
    return batch_of(data, order.tolist())


@pytest.mark.parametrize("seed", range(3))
def test_label_counts_are_exact_when_the_dummy_softmax_is_within_half_an_image(data, seed: int) -> None:
    """``n_c = B (p_c - g_c)`` (Geng et al. 2021) with the true batch's mean softmax ``p`` is exact up
    to float rounding; the server's dummy estimate ``p^`` moves each count by ``B |p^_c - p_c|``. When
    that is under 1/2 for every class (checked here, at PyTorch's default init whose softmax is near
    uniform), the largest-remainder rounding must return the true counts of a batch of 16 with
    repeated labels, and ``"auto"`` must return those labels, sorted."""
    x, y = repeated_label_batch(data, seed)
    model = seeded_lenet(seed, init="default").double()
    view = make_view(model, x.double(), y, data)
    low, high = (bound.double() for bound in view.data_bounds())
    dummy = low + (high - low) * torch.rand(
        (256, *SHAPE), generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    with torch.no_grad():
        shift = 16 * (model(dummy).softmax(-1).mean(0) - model(x.double()).softmax(-1).mean(0)).abs().max()
    assert float(shift) < 0.5, "precondition: the dummy softmax is within half an image of the batch's"
    assert label_counts(view).tolist() == torch.bincount(y, minlength=10).tolist()
    assert torch.equal(recover_labels(view), y.sort().values)


def test_label_counts_without_a_bias_use_the_weight_rows(data) -> None:
    """With no bias the weight rows carry the counts scaled by the mean feature sum ``O``. Features that
    sum to 1 for every input (a softmax over the pixels) make ``O`` exact on any dummy input, and zero
    weights make the class softmax exactly uniform: the counts of a batch of 12 must then be exact."""
    x, y = repeated_label_batch(data, 0, size=12)
    model = nn.Sequential(nn.Flatten(), nn.Softmax(dim=1), nn.Linear(28 * 28, 10, bias=False))
    nn.init.zeros_(model[2].weight)
    view = ServerView(
        model=model,
        gradients=parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False),
        batch_size=12,
        input_shape=SHAPE,
        num_classes=10,
    )
    assert label_counts(view).tolist() == torch.bincount(y, minlength=10).tolist()


def prototype_classifier(data, first_of_class, scale: float) -> tuple[nn.Module, Tensor]:
    """A linear classifier whose class-``k`` weights are ``scale`` times the first training image of
    class ``k`` (a "trained" model: each prototype scores its own class highest), and the prototypes."""
    prototypes = batch_of(data, [first_of_class[k] for k in range(10)])[0].double()
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10)).double()
    with torch.no_grad():
        model[1].weight.copy_(scale * prototypes.flatten(1))
        model[1].bias.zero_()
    return model, prototypes


@pytest.mark.parametrize("seed", range(3))
def test_label_counts_from_public_images_are_exact_where_dummy_images_are_wrong(data, first_of_class, seed) -> None:
    """On a trained-like model each class scores unlike the others and unlike noise, so one dummy
    softmax for every class (Geng et al.) gets counts wrong. When every batch image scores exactly
    like the public images of its class (here: the batch is made of the public prototypes), the
    gradient is exactly ``M n / B`` with the class responses ``M`` measured on the public data, and
    the least-squares counts must be the true ones: float64 rounding (~1e-15) is far below the half
    image the rounding tolerates, as the smallest singular value of ``M`` on the plane ``sum n = B``
    (checked) keeps the solve well conditioned."""
    model, prototypes = prototype_classifier(data, first_of_class, scale=0.01)
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(seed))
    public = (prototypes.repeat(3, 1, 1, 1), torch.arange(10).repeat(3))
    view = make_view(model, prototypes[y], y, data, public_data=public)
    true = torch.bincount(y, minlength=10)
    with torch.no_grad():
        softmax = model(prototypes).softmax(-1)
    response = softmax.t() - torch.eye(10, dtype=torch.float64)  # column k: q_k - e_k
    plane = torch.linalg.qr(torch.cat([torch.ones(10, 1, dtype=torch.float64), torch.eye(10)[:, :9].double()], 1)).Q
    assert float(torch.linalg.svdvals(response @ plane[:, 1:]).min()) > 1e-3, "precondition: a well-posed solve"
    assert int((label_counts(view, softmax_from="dummy") - true).abs().sum()) >= 2, "precondition: dummy is wrong"
    assert label_counts(view).tolist() == true.tolist()  # "auto" takes the public data the view holds
    assert torch.equal(recover_labels(view), y.sort().values)
    assert label_estimates_differ(view)  # the audit then runs each label-recovering attack under both


def test_label_counts_rest_on_the_bias_where_a_defense_changed_only_the_weights(data, first_of_class) -> None:
    """Soteria-like: a defense that prunes the classifier's weight gradient leaves its bias gradient
    summing to 0 (cross-entropy's always does), so the counts come from the bias alone and stay exact;
    fitting the pruned weight rows' sums as well got 55 of 64 labels wrong on Soteria at round 0."""
    model, prototypes = prototype_classifier(data, first_of_class, scale=0.01)
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(0))
    public = (prototypes.repeat(3, 1, 1, 1), torch.arange(10).repeat(3))
    view = make_view(model, prototypes[y], y, data, public_data=public)
    name = "1.weight"
    view.gradients[name] = view.gradients[name] * (torch.arange(28 * 28) % 3 == 0).double()  # 2 of 3 columns
    assert abs(float(view.gradients["1.bias"].sum())) < 1e-12
    assert label_counts(view).tolist() == torch.bincount(y, minlength=10).tolist()


@pytest.mark.parametrize("seed", range(3))
def test_label_counts_at_initialisation_are_the_same_from_public_and_dummy_images(data, seed: int) -> None:
    """At PyTorch's default init the softmax is near uniform on any input, so the per-class means of
    public images and the one mean of dummy images agree: both estimates give the true counts of a
    batch of 16 (the public images are the test split's first 200, never a training image)."""
    x, y = repeated_label_batch(data, seed)
    data.setup("test")
    public = batch_of_split(data.test_dataset, range(200))
    view = make_view(seeded_lenet(seed, init="default").double(), x.double(), y, data, public_data=public)
    true = torch.bincount(y, minlength=10).tolist()
    assert label_counts(view, softmax_from="dummy").tolist() == true
    assert label_counts(view, softmax_from="public").tolist() == true
    assert not label_estimates_differ(view)
    assert not label_estimates_differ(dataclasses.replace(view, public_data=None))


def batch_of_split(dataset, indices) -> tuple[Tensor, Tensor]:
    samples = [dataset[i] for i in indices]
    return torch.stack([s[0] for s in samples]).double(), torch.tensor([int(s[1]) for s in samples])


def test_label_counts_refuse_an_unknown_source_and_public_without_data(single) -> None:
    view, _, _ = single
    with pytest.raises(ValueError, match="softmax_from must be 'auto', 'public' or 'dummy'"):
        label_counts(view, softmax_from="test")
    with pytest.raises(ValueError, match="softmax_from='public' needs labelled public images"):
        label_counts(view, softmax_from="public")


@pytest.mark.parametrize(
    "public_data, error, message",
    [
        (torch.zeros(3, 1, 28, 28), TypeError, "a pair"),
        ((torch.zeros(3, 1, 28, 28), [0, 1, 2]), TypeError, "two tensors"),
        ((torch.zeros(3, 1, 28, 28), torch.tensor([0, 1])), ValueError, "N integer labels"),
        ((torch.zeros(3, 1, 28, 28), torch.tensor([0.0, 1.0, 2.0])), ValueError, "N integer labels"),
        ((torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.int64)), ValueError, "N >= 1"),
        ((torch.zeros(3, 1, 14, 14), torch.tensor([0, 1, 2])), ValueError, r"shape \[N, 1, 28, 28\]"),
        ((torch.zeros(3, 1, 28, 28), torch.tensor([0, 1, 10])), ValueError, r"labels must lie in \[0, 10\)"),
        ((torch.full((3, 1, 28, 28), float("nan")), torch.tensor([0, 1, 2])), ValueError, "NaN or inf"),
    ],
)
def test_server_view_rejects_bad_public_data(single, public_data, error, message: str) -> None:
    view, _, _ = single
    with pytest.raises(error, match=message):
        ServerView(
            model=view.model,
            gradients=view.gradients,
            batch_size=1,
            input_shape=SHAPE,
            num_classes=10,
            public_data=public_data,
        )


def test_label_recovery_needs_a_final_linear_with_num_classes_outputs(data) -> None:
    x, _ = batch_of(data, [0])
    torch.manual_seed(0)
    five = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 5))
    grads = parameter_gradients(five, nn.CrossEntropyLoss(), x, torch.tensor([1]), create_graph=False)
    # The view itself refuses a model whose outputs disagree with num_classes ...
    with pytest.raises(ValueError, match="num_classes is 10, but the model gives 5 outputs per input"):
        ServerView(model=five, gradients=grads, batch_size=1, input_shape=SHAPE, num_classes=10)
    # ... and label recovery needs the outputs to come from a final nn.Linear.
    convolutional = nn.Sequential(nn.Conv2d(1, 10, 28), nn.Flatten())
    grads = parameter_gradients(convolutional, nn.CrossEntropyLoss(), x, torch.tensor([1]), create_graph=False)
    view = ServerView(model=convolutional, gradients=grads, batch_size=1, input_shape=SHAPE, num_classes=10)
    with pytest.raises(ValueError, match=r"final nn.Linear with 10 outputs; Sequential has none"):
        recover_labels(view)
    # The bias rule needs a bias on the classifier.
    no_bias = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10, bias=False))
    grads = parameter_gradients(
        no_bias, nn.CrossEntropyLoss(), torch.cat([x, x]), torch.tensor([1, 2]), create_graph=False
    )
    view = ServerView(model=no_bias, gradients=grads, batch_size=2, input_shape=SHAPE, num_classes=10)
    with pytest.raises(ValueError, match="bias"):
        recover_labels(view, "bias")


# ------------------------------------------------------------------------------- DLG / iDLG
def test_idlg_beats_a_random_guess_by_20_db_with_the_exact_label(single) -> None:
    view, x, y = single
    result = IDLG(iterations=50).reconstruct(view)
    assert result.attack == "IDLG"
    assert torch.equal(result.labels, y)
    assert result.images.shape == x.shape
    reconstructed, random = pixel_psnr(view, result.images, x), random_guess_psnr(view, x)
    # A converged iDLG run matches the shared gradient to float32 precision: the objective falls by ~9
    # decades and the image lands ~70 dB above a random guess; a stalled run, a wrong label or a wrong
    # objective stays within a few dB of the guess. Both bars sit decades / tens of dB from either outcome
    # (rounding-level noise in every L-BFGS step moves the result by a few dB, never near them).
    assert reconstructed > random + 20, (reconstructed, random)
    assert result.loss_trace[-1] < 1e-3 * result.loss_trace[0]


def test_dlg_beats_a_random_guess_by_10_db_and_recovers_the_label(single) -> None:
    view, x, y = single
    result = DLG(iterations=10).reconstruct(view)
    assert result.attack == "DLG"
    assert torch.equal(result.labels, y)  # argmax of the optimised soft label
    reconstructed, random = pixel_psnr(view, result.images, x), random_guess_psnr(view, x)
    # ~+48 dB after 10 steps, within ~1 dB under rounding-level noise in every step; no progress is ~0 dB.
    assert reconstructed > random + 10, (reconstructed, random)
    assert len(result.loss_trace) <= 10 and result.loss_trace[-1] < result.loss_trace[0]


def test_dlg_uses_labels_the_threat_model_grants(data, single) -> None:
    view, x, y = single
    wrong = (y + 1) % 10
    labelled = make_view(view.model, x, y, data, labels=wrong)
    assert torch.equal(IDLG(iterations=1).reconstruct(labelled).labels, wrong)
    assert torch.equal(DLG(iterations=1).reconstruct(labelled).labels, wrong)


def test_dlg_reports_the_objective_of_the_images_it_returns(single) -> None:
    view, _, _ = single
    result = IDLG(iterations=2).reconstruct(view)
    guess = parameter_gradients(view.model, view.loss_fn, result.images, result.labels, create_graph=False)
    actual = float(squared_l2_distance(guess, view.gradients))
    assert result.meta["objective"] == pytest.approx(actual, rel=1e-3)


# ----------------------------------------------------------------------- Inverting Gradients
@pytest.fixture(scope="module")
def inverted(single):
    view, _, _ = single
    return InvertingGradients(iterations=400).reconstruct(view)


def test_inverting_gradients_beats_a_random_guess(single, inverted) -> None:
    view, x, y = single
    assert torch.equal(inverted.labels, y)
    reconstructed, random = pixel_psnr(view, inverted.images, x), random_guess_psnr(view, x)
    assert reconstructed >= random + 5, (reconstructed, random)


def test_inverting_gradients_objective_decreases(inverted) -> None:
    trace = inverted.loss_trace
    assert len(trace) == 400 and all(math.isfinite(v) for v in trace)
    assert trace[-1] < 0.1 * trace[0]
    assert sum(trace[-20:]) < sum(trace[:20])


def test_boxed_inverting_gradients_stays_in_the_pixel_box(single, inverted) -> None:
    view, _, _ = single
    low, high = view.data_bounds()
    assert bool((inverted.images >= low).all() and (inverted.images <= high).all())
    # Not vacuous: the N(0, 1) start and an unboxed run leave the box.
    unboxed = InvertingGradients(iterations=5, boxed=False).reconstruct(view).images
    assert bool(((unboxed < low) | (unboxed > high)).any())


def test_restarts_keep_the_run_with_the_lowest_objective(single) -> None:
    view, _, _ = single
    attack = InvertingGradients(iterations=40, restarts=2, seed=3)
    result = attack.reconstruct(view)
    objectives = result.meta["objectives"]
    assert len(objectives) == 2 and objectives[0] != objectives[1]
    assert result.meta["objective"] == min(objectives)
    assert result.meta["best_restart"] == objectives.index(min(objectives))
    with torch.enable_grad():
        recomputed = float(attack.objective(view, result.labels)(result.images).detach())
    assert recomputed == pytest.approx(result.meta["objective"], rel=1e-4)


def test_lr_decay_does_not_shrink_the_first_step_of_a_short_run(single) -> None:
    view, _, _ = single
    start = torch.randn((1, *SHAPE), generator=torch.Generator().manual_seed(0))
    images = InvertingGradients(iterations=1, lr=0.1, tv_weight=0, boxed=False, seed=0).reconstruct(view).images
    # Adam's first step on a signed gradient moves every pixel by exactly lr.
    torch.testing.assert_close((images - start).abs(), torch.full_like(images, 0.1), atol=1e-4, rtol=0)


def test_first_adam_step_moves_every_pixel_by_lr_without_decay(single) -> None:
    view, _, _ = single
    start = torch.randn((1, *SHAPE), generator=torch.Generator().manual_seed(0))
    images = InvertingGradients(iterations=1, lr=0.1, tv_weight=0, boxed=False, lr_decay=False).reconstruct(view).images
    torch.testing.assert_close((images - start).abs(), torch.full_like(images, 0.1), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------- GradInversion
def bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 28 * 28, 10)
    )


@pytest.fixture(scope="module")
def bn_view(data):
    model = bn_net()
    model.train()
    with torch.no_grad():  # running statistics from a few batches of other images
        for k in range(5):
            model(torch.stack([data.train_dataset[i][0] for i in range(100 + 16 * k, 116 + 16 * k)]))
    x, y = batch_of(data, [0])
    return make_view(model, x, y, data), x, y


def test_grad_inversion_needs_batchnorm_for_its_prior(single) -> None:
    view, _, _ = single
    with pytest.raises(ValueError, match="bn_weight=0"):
        GradInversion(iterations=5).reconstruct(view)
    result = GradInversion(iterations=5, bn_weight=0).reconstruct(view)  # runs without the prior
    assert result.images.shape == (1, *SHAPE) and len(result.loss_trace) == 5


def test_grad_inversion_with_batchnorm_beats_random_and_keeps_running_stats(bn_view) -> None:
    view, x, y = bn_view
    before = copy.deepcopy(view.model.state_dict())
    assert int(before["1.num_batches_tracked"]) == 5
    result = GradInversion(iterations=200).reconstruct(view)
    after = view.model.state_dict()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert view.model.training
    assert torch.equal(result.labels, y)
    assert result.loss_trace[-1] < result.loss_trace[0]
    reconstructed, random = pixel_psnr(view, result.images, x), random_guess_psnr(view, x)
    assert reconstructed >= random + 5, (reconstructed, random)


def test_grad_inversion_batchnorm_prior_matches_the_running_statistics(bn_view) -> None:
    view, _, y = bn_view
    images = torch.randn((1, *SHAPE), generator=torch.Generator().manual_seed(5))
    plain = dict(tv_weight=0.0, l2_weight=0.0, iterations=1)
    with_prior = GradInversion(bn_weight=1.0, **plain).objective(view, y)(images).detach()
    without = GradInversion(bn_weight=0.0, **plain).objective(view, y)(images).detach()
    bn = view.model[1]
    with torch.no_grad():
        features = view.model[0](images)
    expected = torch.linalg.vector_norm(features.mean((0, 2, 3)) - bn.running_mean) + torch.linalg.vector_norm(
        features.var((0, 2, 3), unbiased=False) - bn.running_var
    )
    assert float(with_prior - without) == pytest.approx(float(expected), rel=1e-4)
    assert float(expected) > 0.1  # the prior is not trivially zero


# ------------------------------------------------------------------ seeds, arguments, progress
@pytest.mark.parametrize(
    "make", [lambda s: InvertingGradients(iterations=15, seed=s), lambda s: IDLG(iterations=2, seed=s)]
)
def test_same_seed_same_reconstruction_other_seed_another(single, make) -> None:
    view, _, _ = single
    first, again, other = make(4).reconstruct(view), make(4).reconstruct(view), make(5).reconstruct(view)
    assert torch.equal(first.images, again.images)
    assert first.loss_trace == again.loss_trace
    assert not torch.equal(first.images, other.images)


@pytest.mark.parametrize(
    "cls, kwargs, name",
    [
        (InvertingGradients, {"iterations": 0}, "iterations"),
        (InvertingGradients, {"iterations": 2.5}, "iterations"),
        (InvertingGradients, {"lr": 0}, "lr"),
        (InvertingGradients, {"lr": -0.1}, "lr"),
        (InvertingGradients, {"lr": float("nan")}, "lr"),
        (InvertingGradients, {"tv_weight": -1e-4}, "tv_weight"),
        (InvertingGradients, {"restarts": 0}, "restarts"),
        (InvertingGradients, {"progress_every": -1}, "progress_every"),
        (DLG, {"iterations": 0}, "iterations"),
        (DLG, {"lr": 0.0}, "lr"),
        (DLG, {"line_search": "armijo"}, "line_search"),
        (DLG, {"restarts": 0}, "restarts"),
        (DLG, {"max_iter": 0}, "max_iter"),
        (DLG, {"tolerance": -1.0}, "tolerance"),
        (IDLG, {"iterations": 0}, "iterations"),
        (GradInversion, {"grad_weight": 0}, "grad_weight"),
        (GradInversion, {"bn_weight": -1}, "bn_weight"),
        (GradInversion, {"l2_weight": -1}, "l2_weight"),
        (GradInversion, {"tv_weight": -1}, "tv_weight"),
    ],
)
def test_bad_arguments_name_the_argument(cls, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must"):
        cls(**kwargs)


def test_progress_every_prints_iterations(single, capsys) -> None:
    view, _, _ = single
    InvertingGradients(iterations=10, progress_every=5).reconstruct(view)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 3
    assert all("[InvertingGradients] iteration" in line and "objective" in line for line in lines)
    assert ["iteration 1/10" in lines[0], "iteration 6/10" in lines[1], "iteration 10/10" in lines[2]] == [True] * 3

    InvertingGradients(iterations=10).reconstruct(view)
    assert capsys.readouterr().out == ""


def test_support_only_matching_ignores_the_entries_the_client_did_not_send(single) -> None:
    from lightning_gp.attacks.gradient_matching import cosine_distance
    from lightning_gp.defenses import TopKPruning

    view, x, y = single
    pruned = TopKPruning(rate=0.8, error_feedback=False)(view.gradients)
    import copy

    pruned_view = copy.copy(view)
    pruned_view.gradients = pruned
    guess_images = torch.randn_like(x)
    guess = parameter_gradients(view.model, view.loss_fn, guess_images, y, create_graph=False)
    masked = {n: g * pruned[n].ne(0) for n, g in guess.items()}
    attack = InvertingGradients(iterations=1, tv_weight=0.0, support_only=True)
    value = float(attack.objective(pruned_view, y)(guess_images).detach())
    assert value == pytest.approx(float(cosine_distance(masked, pruned)), rel=1e-5)
    plain = float(InvertingGradients(iterations=1, tv_weight=0.0).objective(pruned_view, y)(guess_images).detach())
    assert value != pytest.approx(plain, rel=1e-3)
