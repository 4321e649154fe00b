"""LocalGaussianMechanism: the client clips its whole update to L2 norm C and adds N(0, (zC)^2) before
upload; its adaptive attacks model that law exactly, and its formal bound is a replace-one Gaussian
mechanism of sensitivity 2C."""

from __future__ import annotations

import math
import statistics
import warnings

import pytest
import torch
from test_noise_aware import SIGMAS, tiny_client, view_of

from lightning_gp import callbacks
from lightning_gp import defenses as D
from lightning_gp.attacks import (
    IDLG,
    DefenseAwareIDLG,
    DefenseKnowledge,
    NoiseAwareMAP,
    UnmodelledDefenseWarning,
    adaptive_attacks,
    adaptive_attacks_of,
    defense_knowledge,
)
from lightning_gp.audit import defense_catalog, defense_mechanism, setting_bound
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.frontier import frontier_families
from lightning_gp.metrics.image_quality import psnr
from lightning_gp.models import LeNetZhu

SHAPES = {"conv.weight": (16, 1, 5, 5), "fc.weight": (100, 120), "fc.bias": (100,)}  # 12,500 coordinates


@pytest.fixture(scope="module")
def datamodule() -> FashionMNISTSampleDataModule:
    dm = FashionMNISTSampleDataModule()
    dm.setup("fit")
    return dm


def gradient(seed: int, norm: float) -> dict[str, torch.Tensor]:
    """A random update over :data:`SHAPES` scaled to L2 norm ``norm``."""
    generator = torch.Generator().manual_seed(seed)
    g = {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}
    factor = norm / D.update_norm(g)
    return {n: t * factor for n, t in g.items()}


def zeros() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s) for n, s in SHAPES.items()}


def reconstruction_psnr(attack, view, images) -> float:
    """PSNR (dB, pixels in [0, 1]) of ``attack``'s reconstruction of ``images`` from ``view``; never a fallback."""
    result = attack.reconstruct(view)
    assert not result.meta.get("fallback", False)
    return float(psnr(view.denormalize(result.images), view.denormalize(images)))


def flat(update: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in update.values()])


@pytest.mark.parametrize("norm", [0.3, 5.0], ids=["inside-the-ball", "clipped"])
def test_the_upload_minus_its_noise_is_the_update_clipped_to_c_as_a_whole(norm):
    # the same seed and client draw the same noise whatever the gradient: a zero update (never
    # clipped) uploads the noise alone, so the difference is exactly what the client clipped
    C = 1.0
    g = gradient(0, norm)
    upload = D.LocalGaussianMechanism(0.5, C, seed=7)(g, 3)
    noise = D.LocalGaussianMechanism(0.5, C, seed=7)(zeros(), 3)
    clipped = {n: upload[n] - noise[n] for n in g}
    eps = 1e-5  # float32 rounding of x + noise - noise, on an update of norm <= 5
    assert D.update_norm(clipped) <= C + eps
    if norm <= C:
        torch.testing.assert_close(clipped, g, atol=eps, rtol=0)
    else:  # scaled onto the sphere as one vector: every layer by the same factor C / ||g||
        torch.testing.assert_close(clipped, {n: t * (C / norm) for n, t in g.items()}, atol=eps, rtol=0)
        assert D.update_norm(clipped) == pytest.approx(C, abs=eps)


def test_without_noise_the_upload_is_the_clipped_update_exactly():
    g = gradient(1, 3.0)
    assert D.update_norm(D.LocalGaussianMechanism(0.0, 2.0, seed=0)(g)) == pytest.approx(2.0, rel=1e-6)
    short = gradient(1, 1.0)
    assert all(torch.equal(D.LocalGaussianMechanism(0.0, 2.0, seed=0)(short)[n], short[n]) for n in short)


def test_the_noise_has_std_z_c_on_every_coordinate():
    # 12,500 coordinates: the sample std of n normals has standard error sigma / sqrt(2 (n - 1)),
    # the sample mean sigma / sqrt(n); both within SIGMAS standard errors
    z, C = 0.5, 2.0
    noise = flat(D.LocalGaussianMechanism(z, C, seed=0)(zeros(), 0)).double()
    n, sigma = noise.numel(), z * C
    assert n >= 10_000
    assert abs(float(noise.std()) - sigma) < SIGMAS * sigma / math.sqrt(2 * (n - 1))
    assert abs(float(noise.mean())) < SIGMAS * sigma / math.sqrt(n)


def test_each_client_draws_its_own_stream_and_the_seed_repeats_it():
    g = gradient(2, 0.5)
    defense = D.LocalGaussianMechanism(0.5, 1.0, seed=11)
    first, other, again = defense(g, 0), defense(g, 1), defense(g, 0)
    replay = D.LocalGaussianMechanism(0.5, 1.0, seed=11)
    assert not torch.equal(flat(first), flat(other))  # two clients, two streams
    assert not torch.equal(flat(first), flat(again))  # a client's stream moves on from round to round
    assert torch.equal(flat(replay(g, 1)), flat(other))  # the same seed, the same client: the same draws
    assert torch.equal(flat(replay(g, 0)), flat(first))  # whatever order the clients come in
    assert not torch.equal(flat(D.LocalGaussianMechanism(0.5, 1.0, seed=12)(g, 0)), flat(first))


@pytest.mark.parametrize("norm", [0.3, 5.0], ids=["inside-the-ball", "clipped"])
def test_writing_into_given_tensors_or_the_gradient_itself_uploads_the_same(norm):
    g = gradient(4, norm)
    fresh = D.LocalGaussianMechanism(0.5, 1.0, seed=3)(g, 1)
    out = zeros()
    written = D.LocalGaussianMechanism(0.5, 1.0, seed=3)(g, 1, out=out)
    assert all(written[n] is out[n] and torch.equal(out[n], fresh[n]) for n in g)
    in_place = {n: t.clone() for n, t in g.items()}
    D.LocalGaussianMechanism(0.5, 1.0, seed=3)(in_place, 1, out=in_place)  # out aliases the gradient it reads
    assert all(torch.equal(in_place[n], fresh[n]) for n in g)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"noise_multiplier": -0.1}, "noise_multiplier"),
        ({"noise_multiplier": float("nan")}, "noise_multiplier"),
        ({"max_update_norm": 0.0}, "max_update_norm"),
        ({"max_update_norm": float("inf")}, "max_update_norm"),
        ({"seed": -1}, "seed"),
        ({"nonfinite": "skip"}, "nonfinite"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, named):
    with pytest.raises(ValueError, match=named):
        D.LocalGaussianMechanism(**kwargs)
    with pytest.raises(ValueError, match=named):
        callbacks.LocalGaussianMechanism(**kwargs)


def test_a_nan_gradient_is_refused_naming_it_or_zeroed_under_the_zero_policy():
    g = gradient(3, 5.0)
    g["fc.bias"][4] = float("nan")
    with pytest.raises(D.NonFiniteGradientError, match=r"fc\.bias"):
        D.LocalGaussianMechanism(0.5, 1.0, seed=0)(g, 2)
    with pytest.warns(RuntimeWarning, match=r"fc\.bias"):
        upload = D.LocalGaussianMechanism(0.0, 1.0, nonfinite="zero", seed=0)(g, 2)
    assert torch.isfinite(flat(upload)).all()
    assert D.update_norm(upload) == pytest.approx(1.0, rel=1e-6)  # the zeroed update, clipped as usual
    assert float(upload["fc.bias"][4]) == 0.0


def test_the_callback_holds_the_defense_with_its_arguments():
    callback = callbacks.LocalGaussianMechanism(noise_multiplier=0.3, max_update_norm=2.0, seed=5)
    assert type(callback.defense) is D.LocalGaussianMechanism
    assert callback.defense.config() == {"noise_multiplier": 0.3, "max_update_norm": 2.0}
    assert callback.defense.seed == 5 and callback.defense.noise_std == pytest.approx(0.6)


@pytest.mark.parametrize("composed", [False, True], ids=["alone", "after-TopK"])
def test_the_adaptive_attacks_model_the_clip_and_the_noise_not_a_fallback(composed):
    defense = callbacks.LocalGaussianMechanism(noise_multiplier=0.5, max_update_norm=1.0, seed=0)
    stages = [callbacks.TopKPruning(rate=0.9, seed=0), defense] if composed else [defense]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmodelledDefenseWarning)
        attacks = adaptive_attacks_of(stages, iterations=2, lbfgs_iterations=2, seed=0)
    # a composition gets the builder its stages agree on: the pair here (TopK declares only the pair)
    expected = ["DefenseAwareInversion", "DefenseAwareIDLG"] + ([] if composed else ["NoiseAwareMAP"])
    assert [type(a).__name__ for a in attacks] == expected
    for attack in attacks:
        knowledge = attack.knowledge
        assert knowledge.fallback_reason is None and knowledge.transform is not None
        assert knowledge.noise_std == pytest.approx(0.5) and knowledge.noise_law == "gaussian"
        # a view recording these defenses is attacked with the model of them, not the published fallback
        assert set(knowledge.models) == {type(s.defense).__name__ for s in stages}
    # the known transform is the whole-update L2 clip: a long dummy gradient comes out of norm C
    long = gradient(4, 7.0)
    assert D.update_norm(attacks[-1].knowledge.transform(long)) == pytest.approx(1.0, rel=1e-6)


def test_the_likelihood_at_the_true_image_has_the_law_s_expectation_only_with_the_clip(datamodule):
    # u = clip_C(g(x)) + N(0, (zC)^2 I): at the true image the NLL is chi^2_n / 2 (mean n/2, variance
    # n/2); a likelihood that forgets the clip sees the residual g - clip_C(g) as well
    model, x, y, g = tiny_client(datamodule, 0)
    C = 0.1 * D.update_norm(g)  # clipping active
    defense = D.LocalGaussianMechanism(0.01, C, seed=0)
    view = view_of(model, defense(g, 0), datamodule)
    attack = NoiseAwareMAP(defense_knowledge(defense))
    value = float(attack.negative_log_likelihood(view, x, y))
    n = sum(t.numel() for t in g.values())
    mean, std = n / 2, math.sqrt(n / 2)
    assert abs(value - mean) < SIGMAS * std
    unclipped = NoiseAwareMAP(DefenseKnowledge(support=False, noise_std=defense.noise_std))
    assert float(unclipped.negative_log_likelihood(view, x, y)) > mean + SIGMAS * std


def test_the_formal_bound_is_a_replace_one_gaussian_mechanism_whose_eta_falls_as_z_grows():
    kappa, etas = 0.1, []
    for z in (0.5, 1.0, 2.0, 4.0):
        mechanism = defense_mechanism(callbacks.LocalGaussianMechanism(noise_multiplier=z, max_update_norm=3.0))
        assert mechanism.neighbouring == "replace_one" and mechanism.steps == 1
        assert mechanism.sensitivity == pytest.approx(6.0) and mechanism.noise_std == pytest.approx(3.0 * z)
        eta = mechanism.eta(kappa)
        # Gaussian DP with mu = 2C / (zC) = 2 / z: eta = Phi(Phi^-1(kappa) + 2 / z) (Dong et al. 2019)
        normal = statistics.NormalDist()
        assert eta == pytest.approx(normal.cdf(normal.inv_cdf(kappa) + 2 / z), abs=1e-3)
        assert kappa < eta < 1
        etas.append(eta)
    assert etas == sorted(etas, reverse=True) and len(set(etas)) == len(etas)
    (entry,) = defense_catalog(["LocalGaussianMechanism"])
    bound = setting_bound(entry.build(0, 1), LeNetZhu())
    assert bound.mechanism is not None and 0 < bound.at(kappa).eta < 1  # type: ignore[operator]


def test_the_adaptive_attacks_beat_the_published_idlg_where_the_clip_is_active_and_the_noise_small(datamodule):
    # z = 1e-3 and C a tenth of every client's gradient norm: nearly no noise, but the clip scales the
    # upload by ~0.1, which no image's unclipped gradient reproduces, so the published iDLG misses;
    # the attacks that clip their guess match it. 4 seeded clients (7x7 images, LeNetZhu), the same
    # L-BFGS budget and start: the one-sided 95% lower bound of the mean PSNR gain (Student t, 3 degrees
    # of freedom) must exceed 10 dB, for the defense-aware iDLG and for the noise-aware MAP.
    t_95_3 = 2.353
    gains: dict[str, list[float]] = {"DefenseAwareIDLG": [], "NoiseAwareMAP": []}
    for index in range(4):
        model, x, _, g = tiny_client(datamodule, index, size=7)
        defense = D.LocalGaussianMechanism(1e-3, 0.1 * D.update_norm(g), seed=index)
        view = view_of(model, defense(g, 0), datamodule, size=7)
        knowledge = defense_knowledge(defense)

        published = reconstruction_psnr(IDLG(iterations=10, restarts=1, seed=index), view, x)
        for attack in (
            DefenseAwareIDLG(knowledge, iterations=10, restarts=1, seed=index),
            NoiseAwareMAP(knowledge, iterations=10, restarts=1, seed=index),
        ):
            gains[type(attack).__name__].append(reconstruction_psnr(attack, view, x) - published)
    for name, gain in gains.items():
        lower = statistics.mean(gain) - t_95_3 * statistics.stdev(gain) / math.sqrt(len(gain))
        assert lower > 10.0, (name, gain)


def test_the_catalogue_entry_and_the_frontier_family_build_it_and_its_attacks_resolve():
    (entry,) = defense_catalog(["LocalGaussianMechanism"])
    (found,) = entry.build(0, 1).defenses(LeNetZhu())
    assert found.defense.config() == {"noise_multiplier": 0.5, "max_update_norm": 1.0}
    attacks = adaptive_attacks(found, iterations=2, lbfgs_iterations=2, seed=0)
    assert isinstance(attacks[-1], NoiseAwareMAP)
    family = frontier_families()["LocalGaussianMechanism"]
    (swept,) = family.build({"noise_multiplier": 2.0}, 3, 1).defenses(LeNetZhu())
    assert swept.defense.config() == {"noise_multiplier": 2.0, "max_update_norm": 1.0} and swept.defense.seed == 3
