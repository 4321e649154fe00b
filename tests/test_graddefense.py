"""GradDefense (issue 13): sensitivity, equal-sensitivity slices, the noise, compensation, every path."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import run_script
from torch import nn

from lightning_gp.attacks import (
    IDLG,
    DefenseAwareIDLG,
    DefenseAwareInversion,
    InvertingGradients,
    NoiseAwareMAP,
    ServerView,
    adaptive_attacks,
    has_adaptive_attack,
    parameter_gradients,
)
from lightning_gp.audit import tap_fedsgd_round
from lightning_gp.callbacks import GradDefense as GradDefenseCallback
from lightning_gp.callbacks import GradientTap
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.defenses import GradDefense, root_set_sensitivity
from lightning_gp.defenses.graddefense import compensate, compensation_shape, equal_sensitivity_slices
from lightning_gp.metrics.image_quality import psnr
from lightning_gp.models import ImageClassifier, LeNetZhu
from lightning_gp.named_tensors import flatten_named

MARGIN_DB = 5.0


def _uniform(gradients: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float(g.numel()) for n, g in gradients.items()}  # one unit of sensitivity per entry


def test_slices_carry_equal_sensitivity_on_a_constructed_vector():
    # densities 0.5 and 0.5: five slices of 1 unit are 2 entries each
    assert equal_sensitivity_slices({"a": 4, "b": 6}, {"a": 2.0, "b": 3.0}, 5) == [0, 2, 4, 6, 8, 10]
    # layer a: 2 entries of 4 units, b: 8 entries of 0.25; slices of 2 units: an entry of 4 fills
    # two slices' worth, so the slice after each of them is empty, and b is the last slice
    assert equal_sensitivity_slices({"a": 2, "b": 8}, {"a": 8.0, "b": 2.0}, 5) == [0, 1, 1, 2, 2, 10]
    # no sensitivity anywhere: equal-size slices; a layer of zero sensitivity joins the slice before it
    assert equal_sensitivity_slices({"a": 4, "b": 6}, {"a": 0.0, "b": 0.0}, 5) == [0, 2, 4, 6, 8, 10]
    assert equal_sensitivity_slices({"a": 3, "z": 2, "b": 4}, {"a": 1.0, "z": 0.0, "b": 0.0}, 3) == [0, 1, 2, 9]
    # uneven layers: every slice's sensitivity is T / S = 10 (densities 2, 0.5, 5)
    sizes, sens = {"a": 5, "b": 20, "c": 2}, {"a": 10.0, "b": 10.0, "c": 10.0}
    bounds = equal_sensitivity_slices(sizes, sens, 3)
    density = [2.0] * 5 + [0.5] * 20 + [5.0] * 2
    assert [sum(density[s:t]) for s, t in itertools.pairwise(bounds)] == [10.0, 10.0, 10.0]


def test_exactly_the_chosen_number_of_slices_is_perturbed():
    gradients = {"w": torch.zeros(40, 5), "b": torch.zeros(10)}
    bounds = equal_sensitivity_slices({"w": 200, "b": 10}, _uniform(gradients), 10)
    for perturbed in (0, 1, 5, 10):
        for seed in range(5):
            shared = GradDefense(10, perturbed, 1.0, q=None, seed=seed)(gradients, 0, sensitivity=_uniform(gradients))
            flat = flatten_named(shared)
            noised = [k for k in range(10) if bool((flat[bounds[k] : bounds[k + 1]] != 0).any())]
            assert len(noised) == perturbed
            untouched = [k for k in range(10) if k not in noised]
            assert all(bool((flat[bounds[k] : bounds[k + 1]] == 0).all()) for k in untouched)


def test_the_noise_on_perturbed_slices_has_std_sigma():
    # 100000 zeros, 5 of 10 equal slices noised: 50000 draws of N(0, 0.01^2). The sample std's
    # relative sd is 1 / sqrt(2n) = 0.32%, the mean's sd is 0.01 / sqrt(n) = 4.5e-5: 5 sd bounds
    gradients = {"w": torch.zeros(100_000)}
    shared = GradDefense(10, 5, 0.01, q=None, seed=3)(gradients, 0, sensitivity={"w": 1.0})["w"]
    noise = shared[shared != 0].double()
    assert noise.numel() == 50_000
    assert abs(float(noise.std()) / 0.01 - 1) < 5 / math.sqrt(2 * 50_000)
    assert abs(float(noise.mean())) < 5 * 0.01 / math.sqrt(50_000)


def test_compensation_projects_out_the_eigenvectors_inside_the_noise_bulk():
    # 24 entries, Q = 1.5: v = the smallest divisor >= sqrt(36) = 6, w = 4, Q' = 1.5. Column 0 has
    # variance 2^2 * 6/5 = 4.8, column 1 variance 4/5 = 0.8 (orthogonal, centred), columns 2-3 zero.
    # With s = 1 the bulk is [(1 - 1/sqrt(1.5))^2, (1 + 1/sqrt(1.5))^2] = [0.034, 3.30]: only
    # column 1's eigenvalue lies inside, so exactly column 1 is removed.
    assert compensation_shape(24, 1.5) == (6, 4)
    matrix = torch.zeros(6, 4)
    matrix[:, 0] = 2 * torch.tensor([1.0, -1, 1, -1, 1, -1])
    matrix[:, 1] = torch.tensor([1.0, 1, -1, -1, 0, 0])
    flat = matrix.reshape(-1)
    gradients = {"w": flat[:16].view(4, 4).clone(), "b": flat[16:].clone()}
    out = compensate(gradients, noise_std=1.0, q=1.5)
    expected = matrix.clone()
    expected[:, 1] = 0
    torch.testing.assert_close(flatten_named(out), expected.reshape(-1), rtol=0, atol=1e-6)
    # no noise: the bulk collapses to a point and nothing is removed
    torch.testing.assert_close(flatten_named(compensate(gradients, 0.0, 1.5)), flat, rtol=0, atol=1e-6)
    assert compensation_shape(13426, 6.0) == (959, 14)  # LeNetZhu on 28x28


def test_the_defense_compensates_with_the_noise_of_the_perturbed_share_and_warns_when_it_cannot():
    generator = torch.Generator().manual_seed(0)
    gradients = {"w": torch.randn(60, 4, generator=generator)}
    defense = GradDefense(10, 5, 0.1, q=6.0, seed=1)
    shared = defense(gradients, 0, sensitivity={"w": 1.0})
    uncompensated = GradDefense(10, 5, 0.1, q=None, seed=1)(gradients, 0, sensitivity={"w": 1.0})
    assert defense.compensation_noise_std == pytest.approx(0.1 * math.sqrt(0.5))
    torch.testing.assert_close(shared["w"], compensate(uncompensated, 0.1 * math.sqrt(0.5), 6.0)["w"])
    prime = {"w": torch.ones(13)}  # 13 = 13 x 1: nothing to project
    with pytest.warns(RuntimeWarning, match="uncompensated"):
        GradDefense(q=6.0, seed=0)(prime, 0, sensitivity={"w": 1.0})
    with pytest.raises(ValueError, match="cannot compensate"):
        compensate(prime, 0.1, 6.0)


def test_clipping_bounds_each_perturbed_slice_and_leaves_the_others():
    gradients = {"w": torch.ones(100)}
    shared = GradDefense(10, 5, 0.0, max_slice_norm=0.5, q=None, seed=2)(gradients, 0, sensitivity={"w": 1.0})["w"]
    norms = shared.view(10, 10).norm(dim=1)  # ten equal slices of 10 ones (norm sqrt(10) each)
    clipped = torch.isclose(norms, torch.tensor(0.5))
    assert int(clipped.sum()) == 5
    assert torch.equal(shared.view(10, 10)[~clipped], torch.ones(5, 10))
    loose = GradDefense(10, 10, 0.0, max_slice_norm=100.0, q=None, seed=2)(gradients, 0, sensitivity={"w": 1.0})["w"]
    assert torch.equal(loose, gradients["w"])  # a bound above the norm changes nothing


def test_same_seed_same_share_other_seed_other_slices():
    generator = torch.Generator().manual_seed(0)
    gradients = {"w": torch.randn(30, 8, generator=generator), "b": torch.randn(30, generator=generator)}
    sens = {"w": 2.0, "b": 1.0}
    first = GradDefense(seed=5)(gradients, 0, sensitivity=sens)
    again = GradDefense(seed=5)(gradients, 0, sensitivity=sens)
    other = GradDefense(seed=6)(gradients, 0, sensitivity=sens)
    for n in gradients:
        assert torch.equal(first[n], again[n])
    assert any(not torch.equal(first[n], other[n]) for n in gradients)


def test_root_set_sensitivity_matches_the_closed_form_of_a_linear_model():
    # f(x) = w . x, L = mean_b (w . x_b)^2 / 2, g = mean_b (w . x_b) x_b, so
    # d(sum_i g_i) / d x_b = ((1 . x_b) w + (w . x_b) 1) / B and s = mean_b of its norm
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    x = torch.randn(4, 3)
    w = model.weight.detach().view(3)
    per_example = ((x.sum(1, keepdim=True) * w) + (x @ w).unsqueeze(1)) / 4
    expected = per_example.norm(dim=1).mean()
    s = root_set_sensitivity(model, lambda out, y: out.squeeze(1).pow(2).mean() / 2, x, torch.zeros(4))
    torch.testing.assert_close(s["weight"], expected)
    # a model with BatchNorm keeps its running statistics
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    before = bn[1].running_mean.clone()
    root_set_sensitivity(bn, nn.CrossEntropyLoss(), x, torch.tensor([0, 1, 0, 1]))
    assert torch.equal(bn[1].running_mean, before)


def test_bad_inputs_name_the_argument():
    for kwargs, name in [
        ({"slices": 0}, "slices"),
        ({"slices": 4, "perturbed_slices": 5}, "perturbed_slices"),
        ({"perturbed_slices": -1}, "perturbed_slices"),
        ({"scale": -0.1}, "scale"),
        ({"max_slice_norm": 0.0}, "max_slice_norm"),
        ({"q": 0.5}, "q"),
        ({"scale": float("nan")}, "scale"),
    ]:
        with pytest.raises(ValueError, match=name):
            GradDefense(**kwargs)
    gradients = {"w": torch.ones(4), "b": torch.ones(2)}
    with pytest.raises(TypeError, match="sensitivity="):
        GradDefense()(gradients, 0)
    with pytest.raises(ValueError, match=r"no sensitivity for the layers \['b'\]"):
        GradDefense()(gradients, 0, sensitivity={"w": 1.0})
    with pytest.raises(ValueError, match=r"sensitivity\['w'\]"):
        GradDefense()(gradients, 0, sensitivity={"w": -1.0, "b": 1.0})
    with pytest.raises(ValueError, match=r"sensitivity\['w'\]"):
        GradDefense()(gradients, 0, sensitivity={"w": float("inf"), "b": 1.0})
    root = (torch.rand(2, 1, 4, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="root_per_class"):
        GradDefenseCallback(root_data=root, root_per_class=0)
    with pytest.raises(ValueError, match="refresh_every"):
        GradDefenseCallback(root_data=root, refresh_every=0)
    with pytest.raises(TypeError, match="root_data"):
        GradDefenseCallback(root_data=3.5)
    with pytest.raises(FileNotFoundError, match="neither"):
        GradDefenseCallback(root_data="no/such/root.pt")
    with pytest.raises(ValueError, match="one target per input"):
        GradDefenseCallback(root_data=(torch.rand(2, 3), torch.tensor([0])))


def _root(dm: FashionMNISTSampleDataModule) -> tuple[torch.Tensor, torch.Tensor]:
    xs = torch.stack([torch.as_tensor(dm.val_dataset[i][0]) for i in range(20)])
    return xs, torch.tensor([int(dm.val_dataset[i][1]) for i in range(20)])


def test_the_callback_defends_in_the_simulation_and_on_the_local_path(tmp_path):
    dm = FashionMNISTSampleDataModule(batch_size=4)
    dm.setup("fit")
    root = _root(dm)
    torch.save(root, tmp_path / "root.pt")
    # FederatedSimulation: the server model's sensitivity on the root set (a saved file here)
    L.seed_everything(0, verbose=False)
    records, _, _ = tap_fedsgd_round(
        LeNetZhu(),
        dm,
        defenses=[GradDefenseCallback(root_data=str(tmp_path / "root.pt"), seed=0)],
        clients=[0, 1],
        seed=0,
    )
    sent = LeNetZhu()
    sent.load_state_dict(records[0].model_state)  # the model the server sent that round
    sensitivity = root_set_sensitivity(sent, nn.CrossEntropyLoss(), *root)
    for record in records:
        x, y = record.batch
        raw = {n: t.detach() for n, t in parameter_gradients(sent, nn.CrossEntropyLoss(), x, y).items()}
        expected = GradDefense(seed=0)(raw, record.client_id, sensitivity=sensitivity)
        for name in raw:
            torch.testing.assert_close(record.gradients[name], expected[name], rtol=1e-4, atol=1e-6)
        assert record.meta["defenses"][0]["name"] == "GradDefense"

    # plain Trainer: the sensitivity at batch start, under the module's weights ("val": the datamodule's split)
    L.seed_everything(0, verbose=False)
    tap = GradientTap(rounds=[0])
    module = ImageClassifier(LeNetZhu())
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[GradDefenseCallback(root_data="val", root_per_class=2, seed=0), tap],
    )
    trainer.fit(module, datamodule=dm)
    record = tap.latest()
    model = ImageClassifier(LeNetZhu())
    model.load_state_dict(record.model_state)
    val = dm.val_dataset
    labels = torch.as_tensor(val.targets)
    chosen = sorted(i for c in range(10) for i in (labels == c).nonzero().view(-1)[:2].tolist())
    xs = torch.stack([torch.as_tensor(val[i][0]) for i in chosen])
    sensitivity = root_set_sensitivity(model, nn.CrossEntropyLoss(), xs, labels[chosen])
    x, y = record.batch
    raw = {n: t.detach() for n, t in parameter_gradients(model, nn.CrossEntropyLoss(), x, y).items()}
    expected = GradDefense(seed=0)(raw, 0, sensitivity=sensitivity)
    for name in raw:
        torch.testing.assert_close(record.gradients[name], expected[name], rtol=1e-4, atol=1e-6)


def _lenet_case(seed: int, dm: FashionMNISTSampleDataModule):
    torch.manual_seed(seed)
    model = LeNetZhu()
    x, y = dm.train_dataset[0]
    x, y = torch.as_tensor(x)[None], torch.as_tensor(y).view(1)
    g = {n: t.detach() for n, t in parameter_gradients(model, nn.CrossEntropyLoss(), x, y).items()}
    return model, x, g


def _score(attack, view: ServerView, x: torch.Tensor) -> float:
    result = attack.reconstruct(view)
    return float(psnr(view.denormalize(result.images), view.denormalize(x)))


@pytest.mark.parametrize(
    ("q", "optimiser"),
    # 15 s with L-BFGS: a long check, left out of make test; make test-slow and CI run it
    [(None, "adam"), pytest.param(6.0, "lbfgs", marks=pytest.mark.slow)],
)
def test_the_slice_aware_attack_beats_the_published_one(q, optimiser):
    """The server cuts the same slices from the public root set and the model it sent, rules out the
    slices whose energy is far below the noise, and leaves the perturbed_slices most energetic of
    the rest out of the match (projecting the dummy gradient like compensation did).

    sigma = 0.3: at Plato's 0.01 the noise is ~3% of LeNet's gradient and the published attacks
    already reach 30-35 dB, leaving nothing to beat. Seed 2, one image. Measured here: Adam (q=None)
    28.1 vs 8.0 dB, L-BFGS (q=6) 30.9 vs 5.3 dB. Uncompensated the slice classification was exact
    on seeds 0-2 (L-BFGS 76-78 dB vs 5-6 dB); with compensation seed 1 misclassified one slice and
    the attack failed (5.4 vs 5.8 dB).
    """
    dm = FashionMNISTSampleDataModule()
    dm.setup("fit")
    model, x, g = _lenet_case(2, dm)
    callback = GradDefenseCallback(root_data=_root(dm), scale=0.3, q=q, loss_fn=nn.CrossEntropyLoss(), seed=2)
    shared = callback.defense(g, 0, sensitivity=callback.sensitivity_for(model))
    view = ServerView(
        model=model, gradients=shared, batch_size=1, input_shape=(1, 28, 28), num_classes=10, mean=dm.mean, std=dm.std
    )
    attacks = adaptive_attacks(callback, iterations=800, lbfgs_iterations=60, seed=2)
    if optimiser == "adam":
        adaptive = next(a for a in attacks if isinstance(a, DefenseAwareInversion))
        published = InvertingGradients(iterations=800, seed=2)
    else:
        adaptive = next(a for a in attacks if isinstance(a, DefenseAwareIDLG))
        published = IDLG(iterations=60, seed=2)
    assert _score(adaptive, view, x) > _score(published, view, x) + MARGIN_DB


def test_both_the_defense_and_the_callback_declare_an_attack():
    assert has_adaptive_attack(GradDefense())
    callback = GradDefenseCallback(root_data=(torch.rand(2, 1, 28, 28), torch.tensor([0, 1])))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attacks = adaptive_attacks(callback, iterations=2, lbfgs_iterations=2)
    assert {type(a) for a in attacks} == {DefenseAwareInversion, DefenseAwareIDLG, NoiseAwareMAP}
    assert all(a.knowledge.coordinate_weights is not None for a in attacks)


@pytest.mark.multiprocess
def test_under_ddp_each_rank_shares_its_gradient_through_graddefense_then_outpost(tmp_path):
    # the sensitivity is computed at batch start on each rank; the comm hook only defends
    from scripts.ddp_worker import TinyNet

    from lightning_gp.defenses import Outpost

    worker = Path(__file__).parent / "scripts" / "baselines_ddp_worker.py"
    result = run_script(worker, str(tmp_path), timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        tapped = saved["tapped"]
        model = TinyNet()
        model.load_state_dict(tapped["model_state"])
        x, y = tapped["batch"]
        raw = {n: t.detach() for n, t in parameter_gradients(model, nn.CrossEntropyLoss(), x, y).items()}
        sensitivity = root_set_sensitivity(model, nn.CrossEntropyLoss(), *saved["root"])
        expected = GradDefense(scale=0.05, q=None, seed=1)(raw, rank, sensitivity=sensitivity)
        expected = Outpost(beta=0.0, seed=2)(expected, rank, weights=dict(model.named_parameters()))
        for name in raw:
            torch.testing.assert_close(tapped["gradients"][name], expected[name], rtol=1e-4, atol=1e-6)
        assert int(saved["step"]) == 1
