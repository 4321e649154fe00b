"""Defense-aware attacks: each beats its published counterpart against the defense it models.

Why the margins hold: for every case here the adaptive objective is exactly zero at the client's
image (the sent entries, the clipped values, the unperturbed layers of the true gradient match the
shared ones), while the published objective is not (it compares with entries the defense changed),
so the published attack's optimum is some other image. The tests assert the audit issue's target,
the adaptive reconstruction at least 5 dB above the published one; on this machine the gaps were
31 (Top-k, L-BFGS, 20 steps), 20 (random pruning, Adam), 13 (clipping, Adam), 52 (clipping, L-BFGS,
20 steps) and 69 dB (skipped layer, L-BFGS).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_gp import defenses as D
from lightning_gp.attacks import (
    IDLG,
    DefenseAwareIDLG,
    DefenseAwareInversion,
    DefenseKnowledge,
    GradientAttack,
    InvertingGradients,
    ServerView,
    UnmodelledDefenseWarning,
    adaptive_attacks,
    coordinate_clip,
    gradient_matching,
    has_adaptive_attack,
    layer_noise_weights,
    parameter_gradients,
    per_example_gradients,
    register_adaptive_attack,
    straight_through_quantization,
)
from lightning_gp.attacks.registry import _DECLARATIONS
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.metrics.image_quality import psnr
from lightning_gp.models import LeNetZhu

MARGIN_DB = 5.0  # issue 12's target for the adaptive attacks


@pytest.fixture(scope="module")
def datamodule() -> FashionMNISTSampleDataModule:
    dm = FashionMNISTSampleDataModule()
    dm.setup("fit")
    return dm


def client(datamodule, seed: int, index: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = LeNetZhu()
    x, y = datamodule.train_dataset[index]
    x, y = torch.as_tensor(x)[None], torch.as_tensor(y).view(1)
    grads = parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False)
    return model, x, y, {n: g.detach() for n, g in grads.items()}


def view_of(model, shared, datamodule, **kwargs) -> ServerView:
    return ServerView(
        model=model,
        gradients=shared,
        batch_size=1,
        input_shape=(1, 28, 28),
        num_classes=10,
        mean=datamodule.mean,
        std=datamodule.std,
        **kwargs,
    )


def score(attack: GradientAttack, view: ServerView, x: torch.Tensor) -> float:
    result = attack.reconstruct(view)
    return float(psnr(view.denormalize(result.images), view.denormalize(x)))


# 12 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_support_matching_recovers_a_top_k_pruned_image_the_published_idlg_misses(datamodule):
    model, x, _, g = client(datamodule, seed=0, index=0)
    defense = D.TopKPruning(rate=0.8, seed=0)
    view = view_of(model, defense(g, 0), datamodule)
    adaptive = [a for a in adaptive_attacks(defense, lbfgs_iterations=20, seed=0) if isinstance(a, DefenseAwareIDLG)]
    assert len(adaptive) == 1
    assert score(adaptive[0], view, x) > score(IDLG(iterations=20, seed=0), view, x) + MARGIN_DB


# 9 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_support_matching_beats_published_inverting_gradients_on_random_pruning(datamodule):
    model, x, _, g = client(datamodule, seed=1, index=7)
    defense = D.RandomPruning(0.8, seed=0)
    view = view_of(model, defense(g, 0), datamodule)
    adaptive = [a for a in adaptive_attacks(defense, iterations=800, seed=1) if isinstance(a, DefenseAwareInversion)]
    assert score(adaptive[0], view, x) > score(InvertingGradients(iterations=800, seed=1), view, x) + MARGIN_DB


# 10 s per optimiser: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
@pytest.mark.parametrize("optimiser", ["adam", "lbfgs"])
def test_known_clipping_beats_the_published_attack(datamodule, optimiser):
    model, x, _, g = client(datamodule, seed=0, index=0)
    shared = D.GaussianNoise(0.0, clip=0.05, seed=0)(g, 0)  # clipping alone: the deterministic part
    view = view_of(model, shared, datamodule)
    knowledge = DefenseKnowledge(support=False, transform=coordinate_clip(0.05))
    if optimiser == "adam":
        adaptive, published = DefenseAwareInversion(knowledge, iterations=800), InvertingGradients(iterations=800)
    else:
        adaptive, published = DefenseAwareIDLG(knowledge, iterations=20), IDLG(iterations=20)
    assert score(adaptive, view, x) > score(published, view, x) + MARGIN_DB


def test_skipping_a_perturbed_layer_beats_matching_it(datamodule):
    model, x, _, g = client(datamodule, seed=1, index=7)
    shared = dict(g)
    shared["fc.weight"] = g["fc.weight"] + torch.randn(g["fc.weight"].shape, generator=torch.Generator().manual_seed(0))
    view = view_of(model, shared, datamodule)
    knowledge = DefenseKnowledge(support=False, skip_layers=("fc.weight",))
    assert score(DefenseAwareIDLG(knowledge, iterations=60), view, x) > score(IDLG(iterations=60), view, x) + MARGIN_DB


def test_straight_through_quantization_puts_the_true_image_at_zero_objective(datamodule):
    model, x, y, g = client(datamodule, seed=0, index=0)
    shared = D.GradientQuantization(3, seed=0)(g, 0)
    view = view_of(model, shared, datamodule, labels=y)
    adaptive = DefenseAwareInversion(
        DefenseKnowledge(support=False, transform=straight_through_quantization(3)), tv_weight=0
    )
    published = InvertingGradients(tv_weight=0)
    assert float(adaptive.objective(view, y)(x).detach()) < 1e-6
    assert float(published.objective(view, y)(x).detach()) > 1e-3
    # the straight-through rounding still passes a gradient to the images
    images = x.clone().requires_grad_(True)
    adaptive.objective(view, y)(images + 0.1).backward()
    assert images.grad is not None and images.grad.abs().sum() > 0


def test_per_example_clipping_reproduces_dp_sgd_without_noise(datamodule):
    torch.manual_seed(0)
    model = LeNetZhu()
    xs = torch.stack([torch.as_tensor(datamodule.train_dataset[i][0]) for i in (0, 1)])
    ys = torch.tensor([int(datamodule.train_dataset[i][1]) for i in (0, 1)])
    per_example = [parameter_gradients(model, nn.CrossEntropyLoss(), xs[i : i + 1], ys[i : i + 1]) for i in (0, 1)]
    clip = 0.5
    expected = {}
    for name in per_example[0]:
        parts = []
        for g in per_example:
            norm = torch.sqrt(sum(t.pow(2).sum() for t in g.values()))
            parts.append(g[name] * min(1.0, clip / float(norm)))
        expected[name] = torch.stack(parts).mean(0)
    view = ServerView(model=model, gradients=expected, batch_size=2, input_shape=(1, 28, 28), num_classes=10)
    guess = DefenseKnowledge(support=False, per_example_clip=clip).dummy_gradient(view, xs, ys)
    for name, value in expected.items():
        torch.testing.assert_close(guess[name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("batch_norm", [False, True])
def test_per_example_gradients_in_one_vmapped_pass_equal_the_loop_and_its_input_gradient(
    datamodule, batch_norm, monkeypatch
):
    """The vmapped per-example gradients (what DP-SGD's dummy batch clips) equal one example at a time to
    float precision, and so does the attack's gradient w.r.t. the dummy images through them; a model that
    does not map (BatchNorm in training mode updates its statistics in place) takes the loop, its running
    statistics untouched either way."""
    torch.manual_seed(0)
    model = LeNetZhu()
    if batch_norm:
        model = nn.Sequential(
            nn.Conv2d(1, 4, 5, stride=2), nn.BatchNorm2d(4), nn.Sigmoid(), nn.Flatten(), nn.LazyLinear(10)
        )
        model(torch.zeros(2, 1, 28, 28))
        model.train()
    stats = {n: b.clone() for n, b in model.named_buffers()}
    xs = torch.stack([torch.as_tensor(datamodule.train_dataset[i][0]) for i in range(4)])
    ys = torch.tensor([int(datamodule.train_dataset[i][1]) for i in range(4)])
    probe = {n: 0.01 * torch.randn(4, *p.shape) for n, p in model.named_parameters()}
    loop_calls = []
    one_at_a_time = gradient_matching.parameter_gradients
    monkeypatch.setattr(
        gradient_matching, "parameter_gradients", lambda *a, **k: loop_calls.append(1) or one_at_a_time(*a, **k)
    )
    results = []
    for vectorize in (True, False):
        images = xs.clone().requires_grad_(True)
        per_example = per_example_gradients(model, nn.CrossEntropyLoss(), images, ys, vectorize=vectorize)
        if vectorize:  # LeNetZhu maps (no example at a time); the BatchNorm model takes the loop
            assert len(loop_calls) == (4 if batch_norm else 0)
        assert {n: tuple(g.shape) for n, g in per_example.items()} == {
            n: (4, *p.shape) for n, p in model.named_parameters()
        }
        objective = sum(((g - probe[n]) ** 2).sum() for n, g in per_example.items())
        results.append((per_example, torch.autograd.grad(objective, images)[0]))
    (fast, fast_input), (loop, loop_input) = results
    # float32 sums taken in another order (a batched convolution against single ones): within 1e-5 of
    # each tensor's largest entry, about 100 float32 epsilons
    for name in loop:
        torch.testing.assert_close(fast[name], loop[name], rtol=0, atol=1e-5 * float(loop[name].abs().max()))
    torch.testing.assert_close(fast_input, loop_input, rtol=0, atol=1e-5 * float(loop_input.abs().max()))
    assert loop_input.abs().max() > 0
    for name, before in stats.items():
        assert torch.equal(dict(model.named_buffers())[name], before)


def test_wiener_weights_drop_a_layer_of_pure_noise_and_keep_a_clean_one():
    generator = torch.Generator().manual_seed(0)
    sigma = 0.1
    shared = {
        "noise": sigma * torch.randn(10_000, generator=generator),
        "signal": torch.ones(10_000) + sigma * torch.randn(10_000, generator=generator),
    }
    support = {n: torch.ones_like(t, dtype=torch.bool) for n, t in shared.items()}
    weights = layer_noise_weights(shared, sigma, support)
    # ||noise||^2 / (n sigma^2) is chi^2_n / n: within 5% of 1 at n = 10^4 beyond 1e-6 odds is false
    # only when it falls below 0.95; the gain is then at most 0.05
    assert weights["noise"] <= 0.05
    assert weights["signal"] > 0.98  # 1 - 0.01 / 1.01 in expectation


def test_every_packaged_defense_declares_an_adaptive_attack():
    from lightning_gp import callbacks as C
    from lightning_gp.priprune import PriPruneModule
    from lightning_gp.refiner import RefinerModule

    pure = [
        getattr(D, name)
        for name in D.__all__
        if isinstance(getattr(D, name), type) and issubclass(getattr(D, name), D.Defense) and name != "Defense"
    ]
    abstract = {D.SensitivityDefense, D.SparsifyingDefense}
    for cls in pure:
        if cls in abstract:
            continue
        assert has_adaptive_attack(cls.__new__(cls)), cls.__name__
    assert has_adaptive_attack(C.TopKPruning(rate=0.8))  # a callback is unwrapped to its defense
    assert has_adaptive_attack(C.DPSGD(noise_multiplier=1.0))
    assert has_adaptive_attack(RefinerModule.__new__(RefinerModule))
    assert has_adaptive_attack(PriPruneModule.__new__(PriPruneModule))


def test_an_unmodelled_defense_gets_the_published_attack_marked_as_fallback(datamodule):
    class Mystery:
        pass

    with pytest.warns(UnmodelledDefenseWarning, match="Mystery"):
        attacks = adaptive_attacks(Mystery(), iterations=5, lbfgs_iterations=2)
    model, _, _, g = client(datamodule, seed=0, index=0)
    for attack in attacks:
        assert attack.reconstruct(view_of(model, g, datamodule)).meta["fallback"] is True


def test_an_attack_given_a_defense_it_does_not_model_says_so_and_falls_back(datamodule):
    model, _, _, g = client(datamodule, seed=0, index=0)
    recorded = [{"name": "TopKPruning", "config": {}}, {"name": "GaussianNoise", "config": {}}]
    view = view_of(model, D.TopKPruning(rate=0.8, seed=0)(g, 0), datamodule, meta={"defenses": recorded})
    attack = adaptive_attacks(D.TopKPruning(rate=0.8), iterations=20, seed=0)[0]
    with pytest.warns(UnmodelledDefenseWarning, match="GaussianNoise"):
        result = attack.reconstruct(view)
    assert result.meta["fallback"] is True and result.meta["unmodelled"] == ["GaussianNoise"]
    published = InvertingGradients(iterations=20, seed=0).reconstruct(view)
    torch.testing.assert_close(result.images, published.images, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmodelledDefenseWarning)
        view.meta["defenses"] = recorded[:1]
        assert attack.reconstruct(view).meta["fallback"] is False


def test_register_adaptive_attack_plugs_in_a_new_defense_and_refuses_duplicates():
    class Shuffle(D.Defense):
        def transform(self, gradients, state, call):
            return dict(gradients), state

    built = []

    def factory(defense, kwargs):
        built.append(kwargs)
        return [InvertingGradients(**kwargs)]

    try:
        register_adaptive_attack(Shuffle, factory)
        assert has_adaptive_attack(Shuffle(seed=0))
        assert isinstance(adaptive_attacks(Shuffle(seed=0), iterations=3)[0], InvertingGradients)
        assert built == [{"iterations": 3}]
        with pytest.raises(ValueError, match="already has an adaptive attack"):
            register_adaptive_attack(Shuffle, factory)
    finally:
        _DECLARATIONS.pop(Shuffle, None)
    with pytest.raises(TypeError, match="the defense class itself"):  # a name, qualified or not, is refused
        register_adaptive_attack("tests.test_adaptive_attacks.Shuffle", factory)


def test_the_shared_gradient_pipeline_records_which_defenses_ran(datamodule):
    from lightning_gp.audit import tap_fedsgd_round
    from lightning_gp.callbacks import GaussianNoise, TopKPruning

    records, _, _ = tap_fedsgd_round(
        LeNetZhu(),
        datamodule,
        defenses=[TopKPruning(rate=0.8), GaussianNoise(scale=0.01)],
        clients=[0],
        num_clients=2,
        seed=0,
    )
    names = [d["name"] for d in records[0].meta["defenses"]]
    assert names == ["TopKPruning", "GaussianNoise"]
    assert records[0].meta["defenses"][0]["config"]["rate"] == 0.8
