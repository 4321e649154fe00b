"""ROG, the obfuscation-robust gradient inversion (Yue et al., USENIX Security 2023): the low-resolution
inversion, its robustness to pruning, the restoration network and its cache, the prior-only control,
the registry and the inputs it refuses. Tiny networks and budgets, one thread."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from helpers import assert_rows_are_their_own_problems
from torch import nn

from lightning_gp import defenses as D
from lightning_gp.attacks import (
    AttackNotApplicable,
    ObfuscationRobustInversion,
    RestorationCache,
    RestorationConfig,
    ServerView,
    attacks_by_name,
    parameter_gradients,
    published_attack_names,
    threat_class_of,
)
from lightning_gp.attacks.obfuscation_robust import (
    RestorationNetwork,
    default_scale_factor,
    degrade,
    train_restoration,
    upsample,
)
from lightning_gp.normalization import denormalize

pytestmark = pytest.mark.usefixtures("one_thread")

#: a restoration network that trains in about 1.5 s on one thread
TINY = RestorationConfig(width=8, max_steps=150, check_every=50, patience=2, batch=16)
#: one restart of the inversion, stopped on a plateau (about half a second at batch 1)
SEARCH: dict[str, Any] = {"iterations": 1000, "restarts": 1}


@pytest.fixture(scope="module")
def public(data):
    """The sample's test split (the server's public images): ``(images, labels)``, normalised."""
    data.setup("test")
    pairs = [data.test_dataset[i] for i in range(600)]
    return torch.stack([x for x, _ in pairs]), torch.as_tensor([int(y) for _, y in pairs])


@pytest.fixture(scope="module")
def cache():
    """One trained restoration network for the module's attacks (trained by the first that needs it)."""
    return RestorationCache()


def _view(data, public, index: int = 0, defense=None, *, labels: bool = True):
    """The server's view of training image ``index`` (batch 1) under ``defense``, LeNetZhu at a fixed init."""
    from lightning_gp.models import LeNetZhu

    torch.manual_seed(0)
    model = LeNetZhu()
    image, label = data.train_dataset[index]
    x, y = image[None], torch.tensor([int(label)])
    shared = {
        n: g.detach() for n, g in parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False).items()
    }
    if defense is not None:
        shared = defense(shared, 0)
    view = ServerView(
        model=model, gradients=shared, batch_size=1, input_shape=(1, 28, 28), num_classes=10, mean=data.mean,
        std=data.std, labels=y if labels else None, public_data=public,
    )  # fmt: skip
    return view, x


def _mse(images, original, data) -> torch.Tensor:
    """Per guess, the pixel MSE to ``original`` (``images`` ``[..., C, H, W]``, normalised)."""
    pixels = denormalize(images.reshape(-1, *original.shape[1:]), data.mean, data.std)
    return (pixels - denormalize(original, data.mean, data.std)).pow(2).flatten(1).mean(1)


# ------------------------------------------------------------------------------------ the attack
def test_undefended_rog_reconstructs_a_batch_of_one_far_better_than_the_public_mean_image(public, data, cache) -> None:
    """Statistic: on the sample's first 12 training images the low-resolution inversion alone (s = 2)
    reached 15.3-22.9 dB PSNR where the public mean image scores 7.0-13.6 dB, a gap of at least 6.1 dB
    on every image. The restored reconstruction must keep half of that gap (3 dB: MSE under half the
    mean image's) on two of them."""
    mean_image = public[0].mean(0, keepdim=True)
    for index in (0, 3):  # 3: the image whose gap was smallest
        view, original = _view(data, public, index=index, labels=False)
        result = ObfuscationRobustInversion(restoration_config=TINY, cache=cache, **SEARCH).reconstruct(view)
        assert result.images.shape == original.shape and result.labels is not None
        assert int(result.labels[0]) == int(data.train_dataset[index][1])  # recovered from the gradient
        assert result.meta["scale_factor"] == 2 and result.meta["postprocessed"] is True
        assert result.loss_trace and result.meta["objective"] == min(result.loss_trace)
        assert result.meta["restoration"]["steps"] <= TINY.max_steps
        assert float(_mse(result.images, original, data)) < float(_mse(mean_image, original, data)) / 2


# 19 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_under_top_k_90_the_low_resolution_inversion_beats_full_resolution_matching_of_the_same_budget(
    public, data
) -> None:
    """ROG's claim without any prior: the same Adam matching of the same pruned gradient, once over
    14 x 14 pixels upsampled (s = 2), once over all 28 x 28 (s = 1). On the sample's first 12 images
    under Top-k 90% the low-resolution one was never worse (12 of 12, 0.0 to 4.6 dB better, 2 dB on
    average, either seed); here its mean pixel MSE over three images must be the lower."""
    low, full = [], []
    for index in (0, 2, 3):
        view, original = _view(data, public, index=index, defense=D.TopKPruning(0.9, error_feedback=False))
        for scale, errors in ((2, low), (1, full)):
            attack = ObfuscationRobustInversion(scale_factor=scale, postprocess=False, **SEARCH)
            errors.append(float(_mse(attack.reconstruct(view).images, original, data)))
    assert sum(low) < sum(full), (low, full)


def test_the_same_seed_gives_the_same_reconstruction_and_restarts_keep_the_best_match(public, data, cache) -> None:
    view, _ = _view(data, public, index=1)
    kwargs: dict[str, Any] = {"restoration_config": TINY, "cache": cache, "iterations": 120, "restarts": 2}
    once = ObfuscationRobustInversion(seed=4, **kwargs).reconstruct(view)
    again = ObfuscationRobustInversion(seed=4, **kwargs).reconstruct(view)
    other = ObfuscationRobustInversion(seed=5, **kwargs).reconstruct(view)
    assert torch.equal(once.images, again.images) and once.loss_trace == again.loss_trace
    assert not torch.equal(once.images, other.images)
    assert len(once.meta["objectives"]) == 2 and once.meta["objective"] == min(once.meta["objectives"])


def test_default_scale_factor_is_two_for_small_images_and_the_paper_s_four_from_64_pixels() -> None:
    assert default_scale_factor((1, 28, 28)) == default_scale_factor((3, 32, 32)) == 2
    assert default_scale_factor((3, 64, 64)) == default_scale_factor((3, 128, 128)) == 4
    low = torch.rand(2, 3, 14, 14)
    assert upsample(low, (28, 28)).shape == (2, 3, 28, 28) and upsample(low, (14, 14)) is low


# ------------------------------------------------------------------------- the restoration network
def test_the_restoration_network_lowers_the_error_of_degraded_held_out_images(public, data) -> None:
    """After a short training the held-out error is well below that of the degraded inputs themselves:
    0.031 per pixel at noise up to 0.3, 0.0185 after TINY's 150 steps (a fifth lower is asked)."""
    pixels = denormalize(public[0], data.mean, data.std)
    trained = train_restoration(pixels, public[1], 10, 2, TINY, seed=0)
    cost = trained.cost
    assert cost.validation_mse < 0.8 * cost.input_mse and cost.steps <= TINY.max_steps and cost.stopped
    assert cost.images + len(trained.held_out) == len(pixels)
    assert not trained.network.training
    noisy = degrade(pixels[:4], 2, torch.full((4,), 0.1), torch.Generator().manual_seed(0))
    assert noisy.shape == pixels[:4].shape and float(noisy.min()) >= 0 and float(noisy.max()) <= 1
    rgb = RestorationNetwork((3, 32, 32), 10, 4)(torch.rand(2, 3, 32, 32), torch.tensor([0, 9]))
    assert rgb.shape == (2, 3, 32, 32)


def test_the_cache_trains_once_and_reuses_in_memory_and_on_disk(public, data, tmp_path) -> None:
    config = RestorationConfig(width=2, max_steps=10, check_every=5, batch=8)
    view, _ = _view(data, public)
    first = ObfuscationRobustInversion(restoration_config=config, cache=RestorationCache(tmp_path))
    trained = first.restoration(view)
    assert first.cache.trainings == 1
    assert first.restoration(view) is trained and first.cache.trainings == 1  # memory
    later = RestorationCache(tmp_path)  # a later process: loads the file, trains nothing
    loaded = ObfuscationRobustInversion(restoration_config=config, cache=later).restoration(view)
    assert later.trainings == 0 and loaded.cost == trained.cost and torch.equal(loaded.held_out, trained.held_out)
    for name, tensor in trained.network.state_dict().items():
        assert torch.equal(tensor, loaded.network.state_dict()[name]), name
    # another scale factor (or configuration, or public data) is another key: trained anew
    ObfuscationRobustInversion(scale_factor=4, restoration_config=config, cache=later).restoration(view)
    assert later.trainings == 1
    path = next(tmp_path.glob(f"restoration-{first.restoration_key(view).digest()}.pt"))
    path.write_bytes(b"not a network")
    damaged = RestorationCache(tmp_path)
    with pytest.warns(UserWarning, match="RestorationCache: ignoring"):
        ObfuscationRobustInversion(restoration_config=config, cache=damaged).restoration(view)
    assert damaged.trainings == 1


# ------------------------------------------------------------------------------ the prior-only control
def test_prior_only_guesses_attack_held_out_public_decoys_once_per_setting(public, data, cache) -> None:
    import lightning_gp.attacks.obfuscation_robust.attack as rog
    from lightning_gp.audit.prior_control import HasDataPrior

    view, _ = _view(data, public, index=2, defense=D.TopKPruning(0.8, error_feedback=False))
    attack = ObfuscationRobustInversion(restoration_config=TINY, cache=cache, decoys=3, iterations=60, restarts=1)
    assert isinstance(attack, HasDataPrior)  # the audit's test for an attack with a data prior
    guesses = attack.prior_only_guesses(view, 255)
    assert guesses.shape == (3, 1, 1, 28, 28)
    other_seed = ObfuscationRobustInversion(
        restoration_config=TINY, cache=cache, decoys=3, iterations=60, restarts=1, seed=7
    )
    rog._PRIOR_ONLY_MEMO.clear()  # computed again: shared by every client's attack, seeded by prior_seed alone
    assert torch.equal(other_seed.prior_only_guesses(view, 255), guesses)
    decoy = attack.decoy_gradients(view, public[0][:1], public[1][:1])
    for name, shared in view.gradients.items():  # cut to the upload's support size
        assert int((decoy[name] != 0).sum()) == int((shared != 0).sum()), name


def test_the_decoys_searched_side_by_side_are_the_decoys_searched_one_by_one(public, data, cache, monkeypatch) -> None:
    """The client's restarts and the decoys' inversions share one vmapped loop (lightning_gp.attacks.searches);
    every stacked match they build gives each row the squared-L2 match of its own view, as the
    one-problem-at-a-time match computes it: values and dummy gradients to float32 precision, at
    upsampled low-resolution dummies. The searches themselves are not compared pixel by pixel: float32
    kernels sum in another order vmapped, and Adam carries that rounding along a search by an amount
    that depends on the CPU (the float64 form of the searches side by side, tests/test_attack_searches.py,
    is exact)."""
    import lightning_gp.attacks.obfuscation_robust.attack as rog
    from lightning_gp.attacks.gradient_matching import squared_l2_distance

    view, _ = _view(data, public, index=4, defense=D.TopKPruning(0.8, error_feedback=False))
    rog._PRIOR_ONLY_MEMO.clear()
    attack = ObfuscationRobustInversion(restoration_config=TINY, cache=cache, decoys=4, iterations=80, restarts=2)
    built: list[tuple[list, list, Any, bool]] = []
    row_match = attack._row_match

    def record(views, labels):
        match, per_call, batched = row_match(views, labels)
        built.append((list(views), list(labels), match, batched))
        return match, per_call, batched

    monkeypatch.setattr(attack, "_row_match", record)
    client = attack.reconstruct(view)
    guesses = attack.prior_only_guesses(view, 255)
    assert client.meta["batched"] and torch.isfinite(client.images).all() and torch.isfinite(guesses).all()
    assert len(built) >= 2 and all(batched for *_, batched in built)  # the client's search, the decoys'
    torch.manual_seed(0)
    for views, labels, match, _ in built:
        # each view is matched with its own labels (where the view carries them, as the client's here does)
        assert all(v.labels is None or torch.equal(y.to(v.labels.device), v.labels) for v, y in zip(views, labels))
        rows = torch.arange(len(views) * attack.restarts)
        batch, (channels, height, width) = views[0].batch_size, views[0].input_shape
        scale = attack.scale_factor_for(views[0])
        low = torch.rand(len(rows) * batch, channels, height // scale, width // scale)
        dummies = attack._dummy(views[0], low).reshape(len(rows), batch, channels, height, width)

        def own_match(view, y, dummy):
            return squared_l2_distance(parameter_gradients(view.model, view.loss_fn, dummy, y), view.gradients)

        own = [functools.partial(own_match, views[r // attack.restarts], labels[r // attack.restarts]) for r in rows]
        assert_rows_are_their_own_problems(lambda x, rows=rows, match=match: match(x, rows), own, dummies)


@pytest.mark.parametrize("rgb", [False, True], ids=["fashion-mnist sample", "rgb 32x32 photo crops"])
def test_the_audit_runs_rog_as_a_published_class_d_attack_judged_with_its_prior_only_control(rgb: bool) -> None:
    """No hook in the audit: an attack with ``prior_only_guesses`` gets the control (HasDataPrior), on
    grey 28x28 and on RGB 32x32 images (a 16 x 16 x 3 low-resolution image, the restoration network
    and the decoys in three channels)."""
    import lightning as L

    from lightning_gp.audit import AttackBudget, DefenseSetting, audit_setting
    from lightning_gp.audit.setting_audit import AttackSpec
    from lightning_gp.callbacks import TopKPruning
    from lightning_gp.data import FashionMNISTSampleDataModule, PhotoCropsDataModule
    from lightning_gp.models import LeNetZhu

    cache = RestorationCache()

    def build(seed: int, model: nn.Module) -> ObfuscationRobustInversion:
        return ObfuscationRobustInversion(
            restoration_config=TINY, cache=cache, decoys=3, iterations=100, restarts=1, seed=seed
        )

    L.seed_everything(0, verbose=False)
    data = (
        PhotoCropsDataModule(per_class_train=8, per_class_test=16, batch_size=500)
        if rgb
        else FashionMNISTSampleDataModule(batch_size=500)
    )
    model = LeNetZhu(num_classes=11, in_channels=3, image_size=32) if rgb else LeNetZhu()
    audit = audit_setting(
        DefenseSetting("top-k", [TopKPruning(rate=0.9)]), model, data, indices=[[0]],
        published=[AttackSpec("ROG", "published", build)], budget=AttackBudget(), adaptive=False, num_clients=2,
        seed=0, log=lambda line: None,
    )  # fmt: skip
    cell = audit.cell("ROG")
    assert cell.status == "ok", cell.note
    assert cell.kind == "published" and cell.sok_class == "D" and cell.means.get("psnr") is not None
    (result,) = audit.results["ROG"]
    assert result.report.prior_only is not None and result.report.prior_only_false_alarm is not None
    assert cache.trainings == 1  # the decoys reuse the network the attack trained
    assert tuple(result.reconstruction.images.shape) == ((1, 3, 32, 32) if rgb else (1, 1, 28, 28))


# ------------------------------------------------------------------------------ registry and refusals
def test_rog_is_a_published_attack_of_the_sok_class_d_built_from_the_budget() -> None:
    from lightning_gp.audit import AttackBudget
    from lightning_gp.models import LeNetZhu

    assert "ROG" in published_attack_names()
    (published,) = attacks_by_name(["ROG"])
    built = published.build(AttackBudget(ig_iterations=7), 3, LeNetZhu())
    assert isinstance(built, ObfuscationRobustInversion) and built.iterations == 7 and built.seed == 3
    assert built.postprocess and built.scale_factor is None
    assert threat_class_of(built).id == "D"


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"scale_factor": 0}, ValueError, "scale_factor"),
        ({"scale_factor": 2.5}, ValueError, "scale_factor"),
        ({"iterations": 0}, ValueError, "iterations"),
        ({"restarts": 0}, ValueError, "restarts"),
        ({"lr": -0.1}, ValueError, "lr"),
        ({"plateau_steps": -1}, ValueError, "plateau_steps"),
        ({"plateau_rtol": 2.0}, ValueError, "plateau_rtol"),
        ({"postprocess": 1}, TypeError, "postprocess"),
        ({"decoys": 0}, ValueError, "decoys"),
        ({"prior_seed": -1}, ValueError, "prior_seed"),
        ({"restoration_config": {"width": 4}}, TypeError, "restoration_config"),
        ({"cache": "/tmp"}, TypeError, "cache"),
        ({"public_data": torch.zeros(3, 1, 28, 28)}, TypeError, "public_data"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, name) -> None:
    with pytest.raises(error, match=name):
        ObfuscationRobustInversion(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"width": 0}, "width"),
        ({"max_steps": 0}, "max_steps"),
        ({"patience": 0}, "patience"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"min_improvement": 1.0}, "min_improvement"),
        ({"lr": 0.0}, "lr"),
        ({"noise_max": -0.1}, "noise_max"),
    ],
)
def test_bad_restoration_configurations_are_refused_naming_them(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        RestorationConfig(**kwargs)


def test_an_image_side_not_divisible_by_the_scale_factor_is_not_applicable(public, data) -> None:
    view, _ = _view(data, public)
    attack = ObfuscationRobustInversion(scale_factor=3)
    with pytest.raises(AttackNotApplicable, match=r"28 x 28 is not divisible by the scale factor 3"):
        attack.reconstruct(view)
    with pytest.raises(AttackNotApplicable, match="scale factor 3"):
        attack.prior_only_guesses(view, 4)


def test_no_public_data_too_few_public_images_or_a_non_finite_gradient_is_not_applicable(public, data) -> None:
    bare, _ = _view(data, None)
    with pytest.raises(AttackNotApplicable, match="public images"):
        ObfuscationRobustInversion(iterations=2).reconstruct(bare)
    few = (public[0][:3], public[1][:3])
    with pytest.raises(AttackNotApplicable, match="3 public images are too few"):
        ObfuscationRobustInversion(public_data=few, iterations=2).reconstruct(bare)
    # without the postprocessing no public data is needed
    assert ObfuscationRobustInversion(postprocess=False, iterations=2).reconstruct(bare).meta["postprocessed"] is False
    broken, _ = _view(data, public)
    name = next(iter(broken.gradients))
    broken.gradients[name][0] = float("nan")
    with pytest.raises(AttackNotApplicable, match=f"NaN or inf in \\['{name}'\\]"):
        ObfuscationRobustInversion(iterations=2).reconstruct(broken)
