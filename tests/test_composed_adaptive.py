"""Adaptive attacks of composed defenses: one attack models every stage a client ran.

A client that runs ``[GaussianNoise, TopKPruning]`` records both in ``meta["defenses"]``; each
single-defense attack then meets a defense it does not model and falls back to the published one.
``adaptive_attacks_of`` composes the stages' knowledge (support, transforms, noise) in pipeline
order, so its attacks do not fall back and match what the client sent.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from lightning_gp import callbacks as C
from lightning_gp import defenses as D
from lightning_gp.attacks import (
    IDLG,
    ComposedTransform,
    DefenseAwareIDLG,
    DefenseAwareInversion,
    DefenseKnowledge,
    GradientAttack,
    InvertingGradients,
    ServerView,
    UnmodelledDefenseWarning,
    adaptive_attacks,
    adaptive_attacks_of,
    compose_knowledge,
    composed_knowledge,
    composition_fallback_reason,
    coordinate_clip,
    defense_knowledge,
    mark_fallback,
    parameter_gradients,
    register_adaptive_attack,
    register_defense_knowledge,
)
from lightning_gp.attacks.registry import _DECLARATIONS
from lightning_gp.defenses.quantization import quantize


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.sigmoid(self.conv(x)).flatten(1))


def tiny_client(seed: int = 0) -> tuple[nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = TinyNet()
    x, y = torch.rand(1, 1, 4, 4), torch.tensor([1])
    grads = parameter_gradients(model, nn.CrossEntropyLoss(), x, y, create_graph=False)
    return model, x, {n: g.detach() for n, g in grads.items()}


def run_defenses(defenses: list[D.Defense], gradients: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for defense in defenses:
        gradients = defense(gradients, 0)
    return gradients


def recorded(defenses: list) -> dict:
    """``meta`` as the shared-gradient pipeline records it (``describe_defenses``)."""
    inner = [getattr(d, "defense", d) for d in defenses]
    return {"defenses": [{"name": type(d).__name__, "config": d.config()} for d in inner]}


def tiny_view(model: nn.Module, shared: dict[str, torch.Tensor], meta: dict | None = None) -> ServerView:
    return ServerView(
        model=model, gradients=shared, batch_size=1, input_shape=(1, 4, 4), num_classes=3, meta=meta or {}
    )


def knowledge_of(attack: GradientAttack) -> DefenseKnowledge:
    assert isinstance(attack, (DefenseAwareInversion, DefenseAwareIDLG))
    return attack.knowledge


def test_noise_then_pruning_is_modelled_by_one_attack_without_fallback():
    model, _, g = tiny_client()
    stages = [C.GaussianNoise(scale=0.001, seed=0), C.TopKPruning(rate=0.7, seed=0)]
    view = tiny_view(model, run_defenses([D.GaussianNoise(0.001, seed=0), D.TopKPruning(rate=0.7, seed=0)], g))
    view.meta.update(recorded(stages))

    # the first stage's attack alone (what a composed setting got before) falls back
    with pytest.warns(UnmodelledDefenseWarning, match="TopKPruning"):
        alone = adaptive_attacks(stages[0], iterations=3, seed=0)[0].reconstruct(view)
    assert alone.meta["fallback"] is True

    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmodelledDefenseWarning)
        attacks = adaptive_attacks_of(stages, iterations=3, lbfgs_iterations=2, seed=0)
        assert [type(a) for a in attacks] == [DefenseAwareInversion, DefenseAwareIDLG]
        for attack in attacks:
            assert knowledge_of(attack).models == ("GaussianNoise", "TopKPruning")
            result = attack.reconstruct(view)
            assert result.meta["fallback"] is False
            assert result.meta["defense"] == "GaussianNoise+TopKPruning"
            assert 0 < result.meta["support_fraction"] < 0.5  # only the sent entries are matched
    assert composition_fallback_reason(stages) is None


def test_the_composed_knowledge_has_each_members_support_noise_and_transform():
    stages = [D.GaussianNoise(0.03, clip=0.5), D.LaplaceNoise(0.02), D.TopKPruning(rate=0.8), D.GradientQuantization(4)]
    knowledge = composed_knowledge(stages)
    assert knowledge.models == ("GaussianNoise", "LaplaceNoise", "TopKPruning", "GradientQuantization")
    assert knowledge.support is True  # the pruning comes after both noises: its zeros arrive
    assert knowledge.noise_std == pytest.approx(math.sqrt(0.03**2 + 2 * 0.02**2))
    # clip, then the straight-through rounding; iDLG's L-BFGS keeps the clip alone
    assert isinstance(knowledge.transform, ComposedTransform) and knowledge.transform.straight_through
    g = {"w": torch.linspace(-1, 1, 41)}
    torch.testing.assert_close(knowledge.transform(g)["w"], quantize(g["w"].clamp(-0.5, 0.5), 4))
    torch.testing.assert_close(knowledge.transform.without_straight_through()(g)["w"], g["w"].clamp(-0.5, 0.5))
    # the quantisation after the noise is applied to the noiseless dummy: said, not hidden
    assert any("GradientQuantization" in c for c in knowledge.caveats)

    model, x, g = tiny_client()
    view = tiny_view(model, g)
    y = torch.tensor([1])
    full = knowledge.dummy_gradient(view, x, y)
    lbfgs = knowledge.dummy_gradient(view, x, y, straight_through=False)
    for n, t in g.items():
        torch.testing.assert_close(full[n], quantize(t.clamp(-0.5, 0.5), 4))
        torch.testing.assert_close(lbfgs[n], t.clamp(-0.5, 0.5))


def test_dp_sgd_is_composed_first_with_its_per_example_clip_and_noise():
    dp = C.DPSGD(noise_multiplier=2.0, max_grad_norm=0.5)
    knowledge = composed_knowledge([C.TopKPruning(rate=0.8), dp, C.GaussianNoise(scale=0.01)])
    assert knowledge.defense == "DPSGD+TopKPruning+GaussianNoise"  # the runner clips and noises first
    assert knowledge.per_example_clip == 0.5
    model, _, g = tiny_client()
    view = ServerView(model=model, gradients=g, batch_size=4, input_shape=(1, 4, 4), num_classes=3)
    assert callable(knowledge.noise_std)
    assert knowledge.noise_level(view) == pytest.approx(math.sqrt((2.0 * 0.5 / 4) ** 2 + 0.01**2))
    # the Gaussian noise after the pruning noises every coordinate: the pruned zeros are gone
    assert knowledge.support is False
    assert any("TopKPruning" in c and "GaussianNoise" in c for c in knowledge.caveats)


def test_supports_hidden_or_kept_by_later_stages():
    hidden = composed_knowledge([D.TopKPruning(rate=0.8), D.GaussianNoise(0.01)])
    assert hidden.support is False and hidden.caveats
    kept = composed_knowledge([D.TopKPruning(rate=0.8), D.GradientQuantization(8)])
    assert kept.support is True and not kept.caveats  # quantisation keeps zeros zero
    noiseless = composed_knowledge([D.TopKPruning(rate=0.8), D.GaussianNoise(0.0, clip=0.1)])
    assert noiseless.support is True and noiseless.transform is not None


def test_the_same_defense_twice_is_two_stages():
    knowledge = composed_knowledge([D.GaussianNoise(0.03), D.GaussianNoise(0.04)])
    assert knowledge.models == ("GaussianNoise",)
    assert knowledge.noise_std == pytest.approx(0.05)  # independent noises add in variance
    clips = composed_knowledge([D.GaussianNoise(0.0, clip=0.2), D.GaussianNoise(0.0, clip=0.1)])
    assert clips.transform is not None
    torch.testing.assert_close(clips.transform({"w": torch.tensor([0.5, -0.15])})["w"], torch.tensor([0.1, -0.1]))


def test_a_composition_with_an_unregistered_defense_is_a_marked_fallback():
    class Mystery:
        pass

    stages = [D.TopKPruning(rate=0.7), Mystery()]
    assert "Mystery" in (composition_fallback_reason(stages) or "")
    with pytest.warns(UnmodelledDefenseWarning, match="Mystery"):
        attacks = adaptive_attacks_of(stages, iterations=2, lbfgs_iterations=1, seed=0)
    model, _, g = tiny_client()
    view = tiny_view(model, D.TopKPruning(rate=0.7)(g, 0))
    for attack in attacks:
        result = attack.reconstruct(view)
        assert result.meta["fallback"] is True and "Mystery" in result.meta["fallback_reason"]
    with pytest.raises(ValueError, match="Mystery"):
        composed_knowledge(stages)


def test_a_member_whose_attack_is_not_knowledge_based_marks_every_attack_as_fallback():
    class Shuffle(D.Defense):
        def transform(self, gradients, state, call):
            return dict(gradients), state

    def factory(defense, kwargs):
        kwargs.pop("lbfgs_iterations", None)
        return [InvertingGradients(**kwargs)]

    register_adaptive_attack(Shuffle, factory)
    try:
        stages = [Shuffle(seed=0), D.TopKPruning(rate=0.7)]
        assert defense_knowledge(stages[0]) is None
        with pytest.warns(UnmodelledDefenseWarning, match="Shuffle"):
            attacks = adaptive_attacks_of(stages, iterations=2, lbfgs_iterations=1, seed=0)
        assert [type(a).__name__ for a in attacks] == [
            "InvertingGradients",
            "DefenseAwareInversion",
            "DefenseAwareIDLG",
        ]
        model, _, g = tiny_client()
        view = tiny_view(model, D.TopKPruning(rate=0.7)(g, 0), recorded(stages))
        with warnings.catch_warnings():  # the pruning's attack runs its model of the pruning, marked
            warnings.simplefilter("error", UnmodelledDefenseWarning)
            results = [a.reconstruct(view) for a in attacks]
        assert all(r.meta["fallback"] is True for r in results)
        assert results[0].meta["unmodelled"] == ["TopKPruning"]
        assert results[1].meta["unmodelled"] == ["Shuffle"] and "support_fraction" in results[1].meta
    finally:
        _DECLARATIONS.pop(Shuffle, None)


def test_graddefense_does_not_compose_and_says_so():
    stages = [D.GradDefense(), D.TopKPruning(rate=0.8)]
    with pytest.raises(ValueError, match="GradDefense"):
        composed_knowledge(stages)
    assert "GradDefense" in (composition_fallback_reason(stages) or "")
    with pytest.warns(UnmodelledDefenseWarning, match="GradDefense"):
        attacks = adaptive_attacks_of(stages, iterations=2, lbfgs_iterations=1)
    model, _, g = tiny_client()
    for attack in attacks:
        assert attack.reconstruct(tiny_view(model, g)).meta["fallback"] is True


@pytest.mark.parametrize(
    "defense",
    [
        D.TopKPruning(rate=0.8),
        D.GaussianNoise(0.01, clip=0.5),
        D.GradientQuantization(4),
        D.LaplaceNoise(0.01),
        C.DPSGD(noise_multiplier=1.0),
    ],
    ids=lambda d: type(d).__name__,
)
def test_one_defense_gives_the_attacks_it_always_had(defense):
    model, _, g = tiny_client()
    view = tiny_view(model, g)
    single = adaptive_attacks(defense, iterations=4, lbfgs_iterations=2, seed=0)
    composed = adaptive_attacks_of([defense], iterations=4, lbfgs_iterations=2, seed=0)
    assert [type(a) for a in composed] == [type(a) for a in single]
    for a, b in zip(single, composed):
        ka, kb = knowledge_of(a), knowledge_of(b)
        assert (ka.defense, ka.models, ka.support, ka.per_example_clip, ka.skip_layers, ka.caveats) == (
            kb.defense,
            kb.models,
            kb.support,
            kb.per_example_clip,
            kb.skip_layers,
            kb.caveats,
        )
        assert ka.noise_level(view) == kb.noise_level(view)
        torch.testing.assert_close(a.reconstruct(view).images, b.reconstruct(view).images, rtol=0, atol=0)
    assert compose_knowledge([knowledge_of(single[0])]) is knowledge_of(single[0])


def test_one_gaussian_noise_is_the_knowledge_the_registry_always_built():
    model, _, g = tiny_client()
    shared = D.GaussianNoise(0.01, clip=0.05, seed=0)(g, 0)
    view = tiny_view(model, shared)
    before = DefenseKnowledge(
        defense="GaussianNoise",
        models=("GaussianNoise",),
        support=False,
        transform=coordinate_clip(0.05),
        noise_std=0.01,
    )
    attack = adaptive_attacks_of([D.GaussianNoise(0.01, clip=0.05)], iterations=6, seed=0)[0]
    reference = DefenseAwareInversion(before, iterations=6, seed=0)
    torch.testing.assert_close(attack.reconstruct(view).images, reference.reconstruct(view).images, rtol=0, atol=0)


def test_a_users_knowledge_composes_with_the_packaged_defenses():
    class Clip(D.Defense):
        def transform(self, gradients, state, call):
            return {n: t.clamp(-0.1, 0.1) for n, t in gradients.items()}, state

    register_defense_knowledge(
        Clip,
        lambda d: DefenseKnowledge(defense="Clip", models=("Clip",), support=False, transform=coordinate_clip(0.1)),
    )
    try:
        knowledge = composed_knowledge([Clip(), D.TopKPruning(rate=0.8)])
        assert knowledge.models == ("Clip", "TopKPruning") and knowledge.support and knowledge.transform is not None
        with pytest.raises(ValueError, match="already has"):
            register_defense_knowledge(Clip, lambda d: DefenseKnowledge())
        # a plain factory replacing it takes it out of the compositions
        register_adaptive_attack(Clip, lambda d, kw: [InvertingGradients(**kw)], replace=True)
        assert defense_knowledge(Clip()) is None
    finally:
        _DECLARATIONS.pop(Clip, None)


def test_api_boundaries_name_the_argument():
    with pytest.raises(TypeError, match="defenses must be a sequence"):
        adaptive_attacks_of(D.TopKPruning(rate=0.8))
    with pytest.raises(TypeError, match=r"defenses\[1\]"):
        adaptive_attacks_of([D.TopKPruning(rate=0.8), None])
    with pytest.raises(TypeError, match=r"stages\[0\]"):
        compose_knowledge([D.TopKPruning(rate=0.8)])
    with pytest.raises(TypeError, match="knowledge must be callable"):
        register_defense_knowledge(D.TopKPruning, None)
    assert adaptive_attacks_of([]) == []


def test_mark_fallback_keeps_the_attack_name_and_marks_every_result():
    model, _, g = tiny_client()
    attack = mark_fallback(IDLG(iterations=1, seed=0), "models nothing here", ["Mystery"])
    assert type(attack).__name__ == "IDLG" and isinstance(attack, IDLG)
    result = attack.reconstruct(tiny_view(model, g))
    assert (result.meta["fallback"], result.meta["fallback_reason"], result.meta["unmodelled"]) == (
        True,
        "models nothing here",
        ["Mystery"],
    )


def test_the_composed_attack_beats_the_fallback_on_noise_then_top_k():
    """On LeNet/FashionMNIST (seeded), the L-BFGS match on the sent entries with the noise's Wiener
    weights reaches ~30 dB where the fallback's published iDLG stays ~8 dB; the bounds leave
    over 10 dB of margin each way."""
    from lightning_gp.data import FashionMNISTSampleDataModule
    from lightning_gp.models import LeNetZhu

    dm = FashionMNISTSampleDataModule()
    dm.setup("fit")
    torch.manual_seed(0)
    model = LeNetZhu()
    x, y = dm.train_dataset[0]
    x, y = torch.as_tensor(x)[None], torch.as_tensor(y).view(1)
    g = {n: t.detach() for n, t in parameter_gradients(model, nn.CrossEntropyLoss(), x, y).items()}
    stages = [D.GaussianNoise(1e-3, seed=0), D.TopKPruning(rate=0.8, seed=0)]
    view = ServerView(
        model=model,
        gradients=run_defenses(stages, g),
        batch_size=1,
        input_shape=(1, 28, 28),
        num_classes=10,
        mean=dm.mean,
        std=dm.std,
        meta=recorded(stages),
    )

    def score(attack: GradientAttack) -> tuple[float, bool]:
        result = attack.reconstruct(view)
        mse = (view.denormalize(result.images) - view.denormalize(x)).pow(2).mean()
        return float(10 * torch.log10(1 / mse)), bool(result.meta["fallback"])

    composed, composed_fallback = score(DefenseAwareIDLG(composed_knowledge(stages), iterations=15, restarts=1))
    with pytest.warns(UnmodelledDefenseWarning):
        fallback, fell_back = score(DefenseAwareIDLG(defense_knowledge(stages[1]), iterations=15, restarts=1))
    assert not composed_fallback and fell_back
    assert composed > 20.0
    assert composed > fallback + 10.0
