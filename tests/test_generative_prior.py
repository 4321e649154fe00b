"""The generative image prior attack (GGL, Li et al., CVPR 2022; GIAS, Jeon et al., NeurIPS 2021):
its generator, the generator's cache, the latent search through a known defense, CMA-ES, the
prior-only control and the arguments it refuses. Tiny generators and budgets, one thread."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from helpers import assert_rows_are_their_own_problems
from torch import nn

from lightning_gp import defenses as D
from lightning_gp.attacks import (
    AttackNotApplicable,
    DefenseKnowledge,
    GenerativeGradientLeakage,
    GeneratorCache,
    GeneratorConfig,
    ServerView,
    UnmodelledDefenseWarning,
    attacks_by_name,
    defense_knowledge,
    parameter_gradients,
    published_attack_names,
    straight_through_quantization,
    threat_class_of,
)
from lightning_gp.attacks.generative import Generator, cma_es, kernel_mmd, train_generator
from lightning_gp.attacks.generative.training import median_bandwidth
from lightning_gp.normalization import denormalize

pytestmark = pytest.mark.usefixtures("one_thread")

#: a generator that trains in about two seconds on one thread: coarse Fashion-MNIST-like blobs
TINY = GeneratorConfig(latent_dim=16, width=8, max_steps=300, check_every=50, patience=3, batch=32, eval_samples=128)
#: a latent search of about a second (one restart, a plateau stop)
SEARCH: dict[str, Any] = {"iterations": 120, "restarts": 1, "lr": 0.1, "plateau_steps": 30}


@pytest.fixture(scope="module")
def public(data):
    """The sample's test split (the server's public images): ``(images, labels)``, normalised."""
    data.setup("test")
    pairs = [data.test_dataset[i] for i in range(600)]
    return torch.stack([x for x, _ in pairs]), torch.as_tensor([int(y) for _, y in pairs])


@pytest.fixture(scope="module")
def cache(public, data):
    """One trained generator for the module's attacks (trained by the first that needs it)."""
    return GeneratorCache()


def _view(data, public, index: int = 0, defense=None, *, labels: bool = True, shape=(1, 28, 28), model=None):
    """The server's view of training image ``index`` (batch 1) under ``defense``, LeNetZhu at a fixed init."""
    from lightning_gp.models import LeNetZhu

    torch.manual_seed(0)
    model = LeNetZhu() if model is None else model
    image, label = data.train_dataset[index]
    x, y = image[None], torch.tensor([int(label)])
    shared = {
        n: g.detach() for n, g in parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False).items()
    }
    if defense is not None:
        shared = defense(shared, 0)
    view = ServerView(
        model=model, gradients=shared, batch_size=1, input_shape=shape, num_classes=10, mean=data.mean,
        std=data.std, labels=y if labels else None, public_data=public,
    )  # fmt: skip
    return view, x


def _mse(images, original, data) -> torch.Tensor:
    """Per guess, the pixel MSE to ``original`` (``images`` ``[..., C, H, W]``, normalised)."""
    pixels = denormalize(images.reshape(-1, *original.shape[1:]), data.mean, data.std)
    return (pixels - denormalize(original, data.mean, data.std)).pow(2).flatten(1).mean(1)


# ------------------------------------------------------------------------------------ the generator
def test_the_generator_trains_and_its_samples_are_closer_to_public_images_than_noise_is(public, data) -> None:
    """Metric: the unbiased kernel MMD^2 (Gaussian kernel, median-distance bandwidth) to the held-out
    public images. Uniform noise sits at about 0.3; the trained generator's fresh samples must come
    below a third of that (its own validation estimate, on other latents, is about 0.03; with 128
    samples the estimator's spread is a few thousandths)."""
    pixels = denormalize(public[0], data.mean, data.std)
    trained = train_generator(pixels, TINY, seed=0)
    assert trained.cost.steps <= TINY.max_steps and trained.cost.stopped
    assert not trained.generator.training  # eval mode, BatchNorm recalibrated
    held_out = pixels[trained.held_out]
    bandwidth = median_bandwidth(held_out)
    samples = trained.sample(128, torch.Generator().manual_seed(5))
    noise = torch.rand(128, *pixels.shape[1:], generator=torch.Generator().manual_seed(6))
    sample_mmd, noise_mmd = kernel_mmd(samples, held_out, bandwidth), kernel_mmd(noise, held_out, bandwidth)
    assert sample_mmd < noise_mmd / 3, (sample_mmd, noise_mmd, trained.cost)
    assert math.isclose(trained.cost.noise_mmd, noise_mmd, rel_tol=0.2)  # the same scale, other noise draws
    # seeded: a second training is the same generator (a shorter one, to keep the test short)
    short = GeneratorConfig(**{**TINY.__dict__, "max_steps": 20, "check_every": 10})
    once, again = train_generator(pixels, short, seed=0), train_generator(pixels, short, seed=0)
    for name, tensor in once.generator.state_dict().items():
        assert torch.equal(tensor, again.generator.state_dict()[name]), name


def test_the_cache_reuses_a_trained_generator_in_memory_and_on_disk(public, data, tmp_path) -> None:
    config = GeneratorConfig(latent_dim=8, width=4, max_steps=20, check_every=10, batch=16, eval_samples=32)
    view, _ = _view(data, public)
    first = GenerativeGradientLeakage(generator_config=config, cache=GeneratorCache(tmp_path), **SEARCH)
    trained = first.generator(view)
    assert first.cache.trainings == 1
    assert first.generator(view) is trained and first.cache.trainings == 1  # memory
    later = GeneratorCache(tmp_path)  # a later process: loads the file, trains nothing
    loaded = GenerativeGradientLeakage(generator_config=config, cache=later).generator(view)
    assert later.trainings == 0 and loaded.cost == trained.cost and torch.equal(loaded.held_out, trained.held_out)
    for name, tensor in trained.generator.state_dict().items():
        assert torch.equal(tensor, loaded.generator.state_dict()[name]), name
    # another configuration (or other public data) is another key: trained anew
    other = GenerativeGradientLeakage(generator_config=GeneratorConfig(**{**config.__dict__, "width": 5}), cache=later)
    other.generator(view)
    assert later.trainings == 1
    # a damaged file is never trusted: a warning, and the generator is trained again
    path = next(tmp_path.glob(f"generator-{first.generator_key(view).digest()}.pt"))
    path.write_bytes(b"not a generator")
    damaged = GeneratorCache(tmp_path)
    with pytest.warns(UserWarning, match="GeneratorCache: ignoring"):
        GenerativeGradientLeakage(generator_config=config, cache=damaged).generator(view)
    assert damaged.trainings == 1


# ------------------------------------------------------------------------------- the latent search
# 10 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_the_latent_search_through_a_known_defense_beats_every_prior_only_guess(public, data, cache) -> None:
    """Batch 1, LeNetZhu, small Gaussian noise the attack knows (std 1e-3 per coordinate, a gradient
    RMS of about 0.2): the gradient carries the image. The reconstruction's pixel MSE to the original
    must beat all of the attack's guesses from 5 held-out public batches (uninformed, it would with
    probability 1/6); here it is 0.029 against 0.063 and more."""
    defense = D.GaussianNoise(1e-3, seed=0)
    view, original = _view(data, public, index=2, defense=defense)
    attack = GenerativeGradientLeakage(
        knowledge=defense_knowledge(defense), generator_config=TINY, cache=cache, decoys=5, seed=0, **SEARCH
    )
    result = attack.reconstruct(view)
    assert result.labels is not None and view.labels is not None
    assert result.images.shape == original.shape and torch.equal(result.labels, view.labels)
    assert result.meta["optimizer"] == "adam" and result.meta["fallback"] is False
    assert result.loss_trace and result.meta["objective"] <= result.loss_trace[0]
    guesses = attack.prior_only_guesses(view, 255)
    assert guesses.shape == (5, 1, 1, 28, 28)
    reconstruction, decoys = _mse(result.images, original, data), _mse(guesses, original, data)
    assert float(reconstruction) < float(decoys.min()), (reconstruction, decoys)
    # shared by every client's attack of the setting: computed once, whatever the attack's own seed
    again = GenerativeGradientLeakage(
        knowledge=defense_knowledge(defense), generator_config=TINY, cache=cache, decoys=5, seed=9, **SEARCH
    )
    assert again.prior_only_guesses(view, 255) is not None
    assert torch.equal(again.prior_only_guesses(view, 3), attack.prior_only_guesses(view, 3))


#: DP-SGD's per-example clip as the server knows it (the client's noise aside)
DP_SGD_CLIP = DefenseKnowledge(defense="DPSGD", models=(), support=False, per_example_clip=0.05)


# 13 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
@pytest.mark.parametrize(
    "defense",
    [
        None, D.TopKPruning(0.8, error_feedback=False), D.LocalGaussianMechanism(0.03, max_update_norm=1.0, seed=0),
        DP_SGD_CLIP,
    ],
    ids=[
        "published", "top-k known to the server", "the Gaussian mechanism's clip known to the server",
        "DP-SGD's per-example clip known to the server",
    ],
)  # fmt: skip
def test_the_searches_side_by_side_are_the_searches_one_by_one(public, data, cache, monkeypatch, defense) -> None:
    """A client's restarts and the decoys' searches share one vmapped loop (lightning_gp.attacks.searches),
    through the match plan and the clips the server knows, each row matched as the one-problem-at-a-time
    match matches its view (``_assert_side_by_side_is_one_by_one``)."""
    if isinstance(defense, DefenseKnowledge):
        view, _ = _view(data, public, index=6)
        knowledge = defense
    else:
        view, _ = _view(data, public, index=6, defense=defense)
        knowledge = None if defense is None else defense_knowledge(defense)
    _assert_side_by_side_is_one_by_one(view, knowledge, cache, monkeypatch)


def test_the_searches_on_a_secure_aggregate_side_by_side_are_the_searches_one_by_one(
    public, data, cache, monkeypatch
) -> None:
    """The mean of 2 clients' uploads, each clipped to 0.05 on its own (the Gaussian mechanism, known to
    the server): each guess is the mean of its clients' chunks through the clip, each row of the vmapped
    match the one-by-one match of its view (DefenseKnowledge.over_clients), as in the single-client test."""
    defense = D.LocalGaussianMechanism(0.03, max_update_norm=0.05, seed=0)
    clients = [_view(data, public, index=i, defense=defense)[0] for i in (6, 7)]
    view = ServerView(
        model=clients[0].model, gradients={n: (clients[0].gradients[n] + clients[1].gradients[n]) / 2 for n in
        clients[0].gradients}, batch_size=2, input_shape=(1, 28, 28), num_classes=10, mean=data.mean,
        std=data.std, labels=torch.cat([c.labels for c in clients if c.labels is not None]), public_data=public,
    )  # fmt: skip
    knowledge = defense_knowledge(defense)
    assert knowledge is not None
    _assert_side_by_side_is_one_by_one(view, knowledge.over_clients(2), cache, monkeypatch)


def _assert_side_by_side_is_one_by_one(view, knowledge, cache, monkeypatch) -> None:
    """GGL's searches of ``view`` (the client's restarts, then the decoys' for its prior-only guesses)
    run vmapped, and every stacked match they build gives each row the match of its own view through
    the one-problem-at-a-time matcher: values and image gradients to float32 precision, at images the
    trained generator makes. The searches themselves are not compared pixel by pixel: float32 kernels sum
    in another order vmapped, and Adam carries that rounding along a search by an amount that depends
    on the CPU (a clip's kink amplifies it); the float64 form of the searches side by side
    (tests/test_attack_searches.py) is exact."""
    import lightning_gp.attacks.generative.attack as ggl

    attack = GenerativeGradientLeakage(
        knowledge=knowledge, generator_config=TINY, cache=cache, decoys=4, iterations=80, restarts=2,
        plateau_steps=30,
    )  # fmt: skip
    built: list[tuple[list, list, Any, Any, bool]] = []
    row_match = attack._row_match

    def record(views, labels, known):
        match, per_call, batched = row_match(views, labels, known)
        built.append((list(views), list(labels), known, match, batched))
        return match, per_call, batched

    monkeypatch.setattr(attack, "_row_match", record)
    ggl._PRIOR_ONLY_MEMO.clear()
    client = attack.reconstruct(view)
    guesses = attack.prior_only_guesses(view, 255)
    assert client.meta["batched"] and torch.isfinite(client.images).all() and torch.isfinite(guesses).all()
    assert len(built) >= 2 and all(batched for *_, batched in built)  # the client's search, the decoys'
    net = attack.generator(view).generator
    torch.manual_seed(0)
    for views, labels, known, match, _ in built:
        # each view is matched with its own labels (where the view carries them, as the client's here does)
        assert all(v.labels is None or torch.equal(y.to(v.labels.device), v.labels) for v, y in zip(views, labels))
        alone = [attack._matcher(v, y, known, differentiable=True) for v, y in zip(views, labels)]
        rows = torch.arange(len(views) * attack.restarts)
        with torch.no_grad():
            z = torch.randn(len(rows) * views[0].batch_size, net.latent_dim)
            images = attack._images(net, z, views[0]).reshape(len(rows), views[0].batch_size, *views[0].input_shape)
        own = [alone[row // attack.restarts] for row in rows.tolist()]
        assert_rows_are_their_own_problems(lambda x, rows=rows, match=match: match(x, rows), own, images)


def test_the_decoys_are_defended_as_the_server_models_the_defense(public, data) -> None:
    """Top-k: each layer keeps as many entries as the client sent (its largest); Gaussian noise: the
    decoy differs from its clean gradient by noise of the known std (0.5; over 13,426 coordinates the
    sample std is within 2% of it); the published attack: the clean gradient."""
    images, labels = public[0][:1], public[1][:1]
    pruned, _ = _view(data, public, defense=D.TopKPruning(0.8))
    topk = GenerativeGradientLeakage(knowledge=defense_knowledge(D.TopKPruning(0.8)))
    decoy = topk.decoy_gradients(pruned, images, labels, 0)
    for name, shared in pruned.gradients.items():
        assert int((decoy[name] != 0).sum()) == int((shared != 0).sum()), name
    noised, _ = _view(data, public, defense=D.GaussianNoise(0.5, seed=0))
    noisy = GenerativeGradientLeakage(knowledge=defense_knowledge(D.GaussianNoise(0.5)))
    clean = GenerativeGradientLeakage().decoy_gradients(noised, images, labels, 0)
    residual = torch.cat(
        [(g - clean[n]).flatten() for n, g in noisy.decoy_gradients(noised, images, labels, 0).items()]
    )
    assert abs(float(residual.std()) / 0.5 - 1) < 0.02
    exact = parameter_gradients(noised.model, noised.loss_fn, images, labels, create_graph=False)
    assert all(torch.allclose(clean[n], exact[n]) for n in exact)


def test_gias_refines_the_generator_only_where_it_matches_better(public, data, cache) -> None:
    view, _ = _view(data, public, index=5)
    plain = GenerativeGradientLeakage(generator_config=TINY, cache=cache, **SEARCH).reconstruct(view)
    refined = GenerativeGradientLeakage(
        generator_config=TINY, cache=cache, refine_generator=True, refine_iterations=40, refine_lr=1e-3, **SEARCH
    ).reconstruct(view)
    assert "refined" in refined.meta and refined.meta["refine_steps"] >= 1
    assert refined.meta["objective"] <= plain.meta["objective"] + 1e-6  # the same latent search, then never worse
    if not refined.meta["refined"]:
        assert torch.equal(refined.images, plain.images)


def test_a_straight_through_transform_is_searched_by_cma_es_through_its_exact_forward(public, data, cache) -> None:
    knowledge = DefenseKnowledge(
        defense="GradientQuantization", models=(), support=False, transform=straight_through_quantization(2)
    )
    view, _ = _view(data, public, index=1, defense=D.GradientQuantization(bits=2))
    attack = GenerativeGradientLeakage(
        knowledge=knowledge, generator_config=TINY, cache=cache, restarts=1, cma_generations=4, cma_population=6
    )
    assert attack.method(knowledge) == "cmaes" and attack.method(None) == "adam"
    result = attack.reconstruct(view)
    assert result.meta["optimizer"] == "cmaes" and result.meta["evaluations"] == 4 * 6
    assert len(result.loss_trace) == 4 and result.meta["objective"] == min(result.loss_trace)


def test_an_unmodelled_defense_falls_back_to_the_published_match_and_says_so(public, data, cache) -> None:
    view, _ = _view(data, public, index=2)
    view.meta["defenses"] = ["SomethingElse"]
    knowledge = DefenseKnowledge(defense="TopKPruning", models=("TopKPruning",))
    attack = GenerativeGradientLeakage(knowledge=knowledge, generator_config=TINY, cache=cache, **SEARCH)
    with pytest.warns(UnmodelledDefenseWarning, match="SomethingElse"):
        result = attack.reconstruct(view)
    assert result.meta["fallback"] is True and result.meta["unmodelled"] == ["SomethingElse"]


# ------------------------------------------------------------------------------------------ CMA-ES
def test_cma_es_minimises_a_shifted_ill_conditioned_quadratic_and_is_a_function_of_its_seed() -> None:
    shift = torch.linspace(-1.0, 2.5, 8, dtype=torch.float64)
    scale = torch.logspace(0, 3, 8, dtype=torch.float64)  # condition number 1000

    def quadratic(x: torch.Tensor) -> torch.Tensor:
        return ((x - shift).pow(2) * scale).sum(1)

    def run(seed: int):
        return cma_es(
            quadratic, torch.zeros(8, dtype=torch.float64), 1.0, generator=torch.Generator().manual_seed(seed),
            max_generations=2000, tol_fun=1e-14, tol_x=1e-12,
        )  # fmt: skip

    result = run(0)
    assert result.value < 1e-12 and float((result.x - shift).abs().max()) < 1e-5, result
    assert result.stopped.startswith(("tol_fun", "tol_x")) and result.generations < 2000
    assert result.evaluations == result.generations * (4 + math.floor(3 * math.log(8)))
    again, other = run(0), run(1)
    assert torch.equal(again.x, result.x) and again.trace == result.trace
    assert other.trace != result.trace
    stopped = cma_es(
        quadratic, torch.zeros(8), 1.0, generator=torch.Generator().manual_seed(0), max_generations=2000, f_target=1e-6
    )
    assert stopped.value <= 1e-6 and stopped.stopped.startswith("f_target") and stopped.x.dtype == torch.float32


# ------------------------------------------------------------------------- registry and refusals
def test_ggl_is_a_published_attack_of_the_sok_class_d_built_from_the_budget() -> None:
    from lightning_gp.audit import AttackBudget
    from lightning_gp.models import LeNetZhu

    assert "GGL" in published_attack_names()
    (published,) = attacks_by_name(["GGL"])
    built = published.build(AttackBudget(ig_iterations=7), 3, LeNetZhu())
    assert isinstance(built, GenerativeGradientLeakage) and built.iterations == 7 and built.seed == 3
    assert built.knowledge is None and threat_class_of(built).id == "D"


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"iterations": 0}, ValueError, "iterations"),
        ({"restarts": 0}, ValueError, "restarts"),
        ({"lr": -0.1}, ValueError, "lr"),
        ({"latent_weight": -1.0}, ValueError, "latent_weight"),
        ({"distance": "l1"}, ValueError, "distance"),
        ({"optimizer": "sgd"}, ValueError, "optimizer"),
        ({"cma_population": 1}, ValueError, "cma_population"),
        ({"cma_sigma": 0.0}, ValueError, "cma_sigma"),
        ({"refine_generator": 1}, TypeError, "refine_generator"),
        ({"decoys": 0}, ValueError, "decoys"),
        ({"prior_seed": -1}, ValueError, "prior_seed"),
        ({"plateau_rtol": 2.0}, ValueError, "plateau_rtol"),
        ({"knowledge": "TopK"}, TypeError, "knowledge"),
        ({"generator_config": {"width": 4}}, TypeError, "generator_config"),
        ({"cache": "/tmp"}, TypeError, "cache"),
        ({"public_data": torch.zeros(3, 1, 28, 28)}, TypeError, "public_data"),
        ({"simulate": lambda *a: {}}, ValueError, "defense_key"),
        ({"defense_key": ""}, ValueError, "defense_key"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, name) -> None:
    with pytest.raises(error, match=name):
        GenerativeGradientLeakage(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"latent_dim": 0}, "latent_dim"),
        ({"width": -1}, "width"),
        ({"max_steps": 0}, "max_steps"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"min_improvement": 1.0}, "min_improvement"),
        ({"lr": 0.0}, "lr"),
    ],
)
def test_bad_generator_configurations_are_refused_naming_them(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        GeneratorConfig(**kwargs)


def test_an_unsupported_image_shape_or_no_public_data_is_not_applicable(public, data) -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(400, 10))
    images = torch.zeros(8, 1, 20, 20)
    x, y = torch.rand(1, 1, 20, 20), torch.tensor([3])
    shared = {n: g.detach() for n, g in parameter_gradients(model, nn.CrossEntropyLoss(), x, y).items()}
    view = ServerView(
        model=model, gradients=shared, batch_size=1, input_shape=(1, 20, 20), num_classes=10,
        public_data=(images, torch.zeros(8, dtype=torch.long)),
    )  # fmt: skip
    with pytest.raises(AttackNotApplicable, match=r"C x 28 x 28 or C x 32 x 32, got input_shape \(1, 20, 20\)"):
        GenerativeGradientLeakage().reconstruct(view)
    with pytest.raises(AttackNotApplicable, match=r"\(1, 20, 20\)"):
        GenerativeGradientLeakage().prior_only_guesses(view, 4)
    with pytest.raises(ValueError, match=r"got input_shape \(3, 32, 28\)"):
        Generator((3, 32, 28), 8, 4)
    bare, _ = _view(data, None)
    with pytest.raises(AttackNotApplicable, match="public images"):
        GenerativeGradientLeakage().reconstruct(bare)
    few = (public[0][:3], public[1][:3])
    with pytest.raises(AttackNotApplicable, match="3 public images are too few"):
        GenerativeGradientLeakage(public_data=few).reconstruct(bare)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Generator((3, 32, 32), 8, 4)(torch.zeros(2, 8))  # RGB 32x32 is built
