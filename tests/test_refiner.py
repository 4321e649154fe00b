"""Refiner (Fan et al., USENIX Security 2025): the utility measure, the upload projection, and RefinerModule on
every client path (plain Trainer, 2-process DDP, FederatedSimulation) with warm start and resume.

The mechanics tests use a small seeded evaluation network (the App. D architecture at width
1/32); the shipped networks' quality is tested in tests/test_refiner_evaluator.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import run_script
from scripts.refiner_ddp_worker import tiny_evaluator, tiny_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.callbacks import GradientTap, MagnitudePruning
from lightning_gp.defenses import MagnitudePruning as MagnitudePruningTransform
from lightning_gp.federated import FederatedSimulation
from lightning_gp.models import ImageClassifier
from lightning_gp.refiner import (
    IndexedDataset,
    RefinerConfig,
    RefinerModule,
    layer_index,
    project_upload,
    refine,
    utility_measure,
    utility_weights,
)
from lightning_gp.refiner.robust_data import parameter_gradients

WORKER = Path(__file__).parent / "scripts" / "refiner_ddp_worker.py"
MEAN, STD = (0.5,), (0.5,)


def batch(n: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(n, 1, 6, 6, generator=g)
    return (pixels - 0.5) / 0.5, torch.randint(0, 4, (n,), generator=g)


def trainer(**kwargs) -> L.Trainer:
    options = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
    }
    return L.Trainer(**{**options, **kwargs})


def refiner_module(**kwargs) -> RefinerModule:
    torch.manual_seed(0)
    options = {"loss_fn": nn.CrossEntropyLoss(), "mean": MEAN, "std": STD, "evaluator": tiny_evaluator()}
    return RefinerModule(tiny_model(), **{**options, **kwargs})


def global_distance(a: dict, b: dict) -> float:
    return math.sqrt(sum(float(((a[n].double() - b[n].double()) ** 2).sum()) for n in a))


# ------------------------------------------------------------------------------ the measure


def test_layers_are_counted_from_the_input_with_weight_and_bias_sharing_an_index() -> None:
    names = [n for n, _ in tiny_model().named_parameters()]
    assert layer_index(names) == {"0.weight": 1, "0.bias": 1, "3.weight": 2, "3.bias": 2}


@pytest.mark.parametrize("reading", ["printed", "sentence"])
def test_utility_measure_is_zero_at_the_raw_batch_and_positive_elsewhere(reading: str) -> None:
    torch.manual_seed(0)
    model, loss = tiny_model(), nn.CrossEntropyLoss()
    x, y = batch()
    params = dict(model.named_parameters())
    raw, _ = parameter_gradients(model, loss, x, y, params, create_graph=False)
    weights = utility_weights(raw, params, tau=0.95)
    same, _ = parameter_gradients(model, loss, x.clone(), y, params, create_graph=False)
    assert float(utility_measure(same, raw, weights, reading)) == 0.0
    other, _ = parameter_gradients(model, loss, x + 0.3 * torch.randn_like(x), y, params, create_graph=False)
    assert float(utility_measure(other, raw, weights, reading)) > 0.0
    # Eq. 3: |g theta| tau^i, the second layer decayed once more than the first
    assert torch.equal(weights["3.weight"], (raw["3.weight"] * params["3.weight"]).abs().detach() * 0.95**2)


# ------------------------------------------------------------------------------ the projection


def named(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": scale * torch.randn(3, 4, generator=g), "b.bias": scale * torch.randn(5, generator=g)}


def test_projection_returns_the_robust_gradient_when_within_eps() -> None:
    raw = named(0)
    robust = {n: g + 1e-3 * d for (n, g), d in zip(raw.items(), named(1).values())}
    upload, moved = project_upload(robust, raw, eps=0.1)
    assert not moved and all(torch.equal(upload[n], robust[n]) for n in raw)


@pytest.mark.parametrize("per_layer", [False, True])
def test_an_infinite_eps_turns_the_projection_off_as_documented(per_layer: bool) -> None:
    # Before: RefinerConfig(eps=math.inf) was accepted, then project_upload refused it after the optimisation
    raw, robust = named(0), named(1, scale=3.0)
    upload, moved = project_upload(robust, raw, eps=math.inf, per_layer=per_layer)
    assert not moved and all(torch.equal(upload[n], robust[n]) for n in raw)
    with pytest.raises(ValueError, match="eps must be a number >= 0"):
        project_upload(robust, raw, eps=float("nan"))


@pytest.mark.parametrize("eps", [0.01, 0.1, 1.0])
def test_projection_lands_at_exactly_eps_towards_the_robust_gradient(eps: float) -> None:
    raw, robust = named(0), named(1, scale=3.0)
    upload, moved = project_upload(robust, raw, eps=eps)
    assert moved
    # float32 rounding of g + s d: relative 2^-24 per entry of norm-1 vectors
    assert abs(global_distance(upload, raw) - eps) <= 1e-6 * (
        1 + global_distance(raw, {n: 0 * g for n, g in raw.items()})
    )
    # on the segment from g to g*: upload - g is a positive multiple of g* - g
    d = torch.cat([(robust[n] - raw[n]).flatten() for n in raw]).double()
    u = torch.cat([(upload[n] - raw[n]).flatten() for n in raw]).double()
    assert float(torch.nn.functional.cosine_similarity(u, d, dim=0)) > 1 - 1e-6


def test_per_layer_projection_bounds_every_layer_by_eps() -> None:
    raw, robust = named(0), named(1, scale=3.0)
    upload, moved = project_upload(robust, raw, eps=0.2, per_layer=True)
    assert moved
    for n in raw:
        assert abs(float(torch.linalg.vector_norm((upload[n] - raw[n]).double())) - 0.2) <= 1e-6


def norm_of(tensors: dict) -> float:
    return global_distance(tensors, {n: 0 * g for n, g in tensors.items()})


@pytest.mark.parametrize("eps", [0.01, 0.1, 0.5])
def test_a_relative_radius_lands_at_exactly_eps_times_the_raw_norm(eps: float) -> None:
    raw, robust = named(0, scale=20.0), named(1, scale=60.0)
    upload, moved = project_upload(robust, raw, eps=eps, eps_relative=True)
    assert moved
    radius = eps * norm_of(raw)
    # float32 rounding of g + s d: relative 2^-24 per entry, of ||g|| + radius at most
    assert abs(global_distance(upload, raw) - radius) <= 1e-6 * (norm_of(raw) + radius)
    d = torch.cat([(robust[n] - raw[n]).flatten() for n in raw]).double()
    u = torch.cat([(upload[n] - raw[n]).flatten() for n in raw]).double()
    assert float(torch.nn.functional.cosine_similarity(u, d, dim=0)) > 1 - 1e-6
    # the same radius given absolutely is the same projection
    absolute, _ = project_upload(robust, raw, eps=radius)
    assert all(torch.allclose(upload[n], absolute[n], rtol=0, atol=1e-5) for n in raw)


def test_a_relative_radius_keeps_the_robust_gradient_inside_it() -> None:
    # ||g* - g|| = 0.05 ||g||: inside the relative radius 0.1 ||g||, outside an absolute eps of 0.1 (||g|| ~ 120)
    raw = named(0, scale=30.0)
    direction = named(1)
    robust = {n: raw[n] + 0.05 * norm_of(raw) / norm_of(direction) * direction[n] for n in raw}
    assert global_distance(robust, raw) > 0.1
    upload, moved = project_upload(robust, raw, eps=0.1, eps_relative=True)
    assert not moved and all(torch.equal(upload[n], robust[n]) for n in raw)
    _, moved_absolutely = project_upload(robust, raw, eps=0.1)
    assert moved_absolutely


def test_a_relative_per_layer_radius_bounds_each_layer_by_eps_times_its_own_norm() -> None:
    raw, robust = named(0), named(1, scale=3.0)
    raw["b.bias"] = 50 * raw["b.bias"]  # layers of very different norms get very different radii
    robust["b.bias"] = raw["b.bias"] + 1e-3 * robust["b.bias"]  # inside 0.2 ||g_b||: kept as g*_b
    upload, moved = project_upload(robust, raw, eps=0.2, per_layer=True, eps_relative=True)
    assert moved
    radius = 0.2 * float(torch.linalg.vector_norm(raw["a.weight"].double()))
    distance = float(torch.linalg.vector_norm((upload["a.weight"] - raw["a.weight"]).double()))
    assert abs(distance - radius) <= 1e-6 * (1 + radius + float(torch.linalg.vector_norm(raw["a.weight"].double())))
    assert torch.equal(upload["b.bias"], robust["b.bias"])


def test_projection_refuses_mismatched_layers_and_negative_eps() -> None:
    raw = named(0)
    with pytest.raises(ValueError, match="different layers"):
        project_upload({"a.weight": raw["a.weight"]}, raw, eps=0.1)
    with pytest.raises(ValueError, match="eps"):
        project_upload(raw, raw, eps=-1.0)
    with pytest.raises(ValueError, match="eps must be finite with eps_relative=True"):
        project_upload(raw, raw, eps=math.inf, eps_relative=True)
    with pytest.raises(TypeError, match="eps_relative"):
        project_upload(raw, raw, eps=0.1, eps_relative="yes")


# ------------------------------------------------------------------------------ the optimisation


def test_refined_batch_stays_in_pixel_range_keeps_labels_and_is_reproducible() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    x, y = batch(seed=1)
    kwargs = {"evaluator": tiny_evaluator(), "mean": MEAN, "std": STD, "config": RefinerConfig(eps=0.01)}
    first = refine(model, nn.CrossEntropyLoss(), x, y, generator=torch.Generator().manual_seed(5), **kwargs)
    again = refine(model, nn.CrossEntropyLoss(), x, y, generator=torch.Generator().manual_seed(5), **kwargs)
    assert torch.equal(first.pixels, again.pixels)
    assert float(first.pixels.min()) >= 0 and float(first.pixels.max()) <= 1
    assert torch.allclose(first.inputs, (first.pixels - 0.5) / 0.5)
    assert first.iterations == 10 and len(first.utility) == len(first.privacy) == 11
    assert first.projected and abs(first.distance - global_distance(first.robust, first.raw)) <= 1e-6 * first.distance
    assert abs(global_distance(first.upload, first.raw) - 0.01) <= 1e-6 * (
        1 + global_distance(first.raw, {n: 0 * g for n, g in first.raw.items()})
    )
    # the robust data is not the raw batch: alpha = 0.5 blends half the picture with noise
    assert float((first.pixels - (x * 0.5 + 0.5)).abs().mean()) > 0.05


def test_the_objective_pulls_each_way_it_should() -> None:
    """beta = 0: gradient descent on UM alone lowers UM; a large beta raises the evaluator's score."""
    torch.manual_seed(0)
    model = tiny_model()
    x, y = batch(seed=2)
    common = {"evaluator": tiny_evaluator(), "mean": MEAN, "std": STD, "generator": torch.Generator().manual_seed(0)}
    utility_only = refine(
        model, nn.CrossEntropyLoss(), x, y, config=RefinerConfig(beta=0.0, step_rule="adam", step_size=0.01), **common
    )
    assert utility_only.utility[-1] < utility_only.utility[0]
    common["generator"] = torch.Generator().manual_seed(0)
    privacy_only = refine(
        model, nn.CrossEntropyLoss(), x, y, config=RefinerConfig(beta=1.0, step_rule="adam", step_size=0.01), **common
    )
    assert privacy_only.privacy[-1] > privacy_only.privacy[0]


def test_batchnorm_statistics_see_the_robust_batch_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(32, 4))
    x, y = batch(seed=3)
    result = refine(model, nn.CrossEntropyLoss(), x, y, evaluator=tiny_evaluator(), mean=MEAN, std=STD)
    assert int(model[1].num_batches_tracked) == 1
    expected = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    expected.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith(("0.", "1."))}, strict=False)
    expected[1].reset_running_stats()
    expected(result.inputs)
    assert torch.allclose(model[1].running_mean, expected[1].running_mean, atol=1e-6)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": -0.1}, "alpha"),
        ({"tau": 2.0}, "tau"),
        ({"beta": -1.0}, "beta"),
        ({"eps": -0.1}, "eps"),
        ({"eps": float("nan")}, "eps"),
        ({"iterations": 0}, "iterations"),
        ({"warm_iterations": 0}, "warm_iterations"),
        ({"step_size": 0.0}, "step_size"),
        ({"projection": "blockwise"}, "projection"),
        ({"utility": "mean"}, "utility"),
        ({"eps": math.inf, "eps_relative": True}, "eps must be finite"),
        ({"eps": -0.1, "eps_relative": True}, "eps"),
    ],
)
def test_bad_settings_are_refused_naming_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        refiner_module(**kwargs)


def test_bad_modules_inputs_and_batches_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="no trainable parameters"):
        RefinerModule(nn.ReLU(), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="loss_fn"):
        RefinerModule(tiny_model())
    with pytest.raises(TypeError, match="eps_relative"):
        refiner_module(eps_relative=1)
    with pytest.raises(ValueError, match="both mean and std"):
        RefinerModule(tiny_model(), loss_fn=nn.CrossEntropyLoss(), mean=0.5)
    module = refiner_module()
    tokens = torch.randint(0, 10, (4, 1, 6, 6))
    with pytest.raises(TypeError, match="continuous inputs"):
        module.refine_batch(tokens, torch.zeros(4, dtype=torch.long), client_id=0, round=0)
    with pytest.raises(ValueError, match="NaN"):
        module.refine_batch(
            torch.full((4, 1, 6, 6), float("nan")), torch.zeros(4, dtype=torch.long), client_id=0, round=0
        )
    unnormalised = RefinerModule(tiny_model(), loss_fn=nn.CrossEntropyLoss(), evaluator=tiny_evaluator())
    with pytest.raises(ValueError, match="mean= and std="):
        unnormalised.refine_batch(*batch(), client_id=0, round=0)
    warm = refiner_module(warm_start=True)
    with pytest.raises(ValueError, match="IndexedDataset"):
        warm.refine_batch(*batch(), client_id=0, round=0)


# ------------------------------------------------------------------------------ the client paths


class TapUpload(L.Callback):
    """Refiner's own upload of each step, to compare with what the tap recorded."""

    def __init__(self) -> None:
        self.uploads: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.uploads.append({n: g.clone() for n, g in pl_module.last_refined.upload.items()})


def test_plain_trainer_shares_and_steps_with_the_projected_upload() -> None:
    x, y = batch(8, seed=4)
    module = refiner_module(learning_rate=0.5)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    tap, uploads = GradientTap(clients=0, rounds=0), TapUpload()
    trainer(max_steps=1, callbacks=[tap, uploads]).fit(module, DataLoader(TensorDataset(x, y), batch_size=8))
    shared, upload = tap.latest().gradients, uploads.uploads[0]
    assert set(shared) == set(upload) == {f"module.{n}" for n, _ in tiny_model().named_parameters()}
    assert all(torch.allclose(shared[n], upload[n], atol=1e-7) for n in upload)
    assert abs(global_distance(upload, module.last_refined.raw) - 0.1) <= 1e-5
    # SGD stepped with the upload, not with the raw batch's gradient
    for n, p in module.named_parameters():
        assert torch.allclose(p.detach(), before[n] - 0.5 * upload[n], atol=1e-6)


def test_a_relative_radius_bounds_the_trained_upload_by_eps_times_the_raw_norm() -> None:
    x, y = batch(8, seed=4)
    module = refiner_module(eps=0.01, eps_relative=True, learning_rate=0.5)
    assert module.hparams["eps_relative"] is True and module.config.eps_relative is True
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    uploads = TapUpload()
    trainer(max_steps=1, callbacks=[uploads]).fit(module, DataLoader(TensorDataset(x, y), batch_size=8))
    refined, upload = module.last_refined, uploads.uploads[0]
    radius = 0.01 * norm_of(refined.raw)
    assert refined.projected and refined.distance > radius
    # moved: on the sphere of radius 0.01 ||g|| (float32 rounding of g + s d, relative to ||g||)
    assert abs(global_distance(upload, refined.raw) - radius) <= 1e-6 * norm_of(refined.raw)
    for n, p in module.named_parameters():
        assert torch.allclose(p.detach(), before[n] - 0.5 * upload[n], atol=1e-6)


def test_defense_callbacks_rewrite_refiners_upload() -> None:
    x, y = batch(8, seed=5)
    module = refiner_module()
    tap, uploads = GradientTap(clients=0, rounds=0), TapUpload()
    trainer(max_steps=1, callbacks=[MagnitudePruning(rate=0.5, error_feedback=False), tap, uploads]).fit(
        module, DataLoader(TensorDataset(x, y), batch_size=8)
    )
    expected = MagnitudePruningTransform(rate=0.5, error_feedback=False)(uploads.uploads[0], 0)
    assert all(torch.allclose(tap.latest().gradients[n], expected[n]) for n in expected)


def test_two_process_ddp_each_rank_shares_its_own_projected_upload(tmp_path: Path) -> None:
    result = run_script(WORKER, str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert all(torch.equal(r["shared"][n], r["upload"][n]) for n in r["upload"])
        assert abs(global_distance(r["upload"], r["raw"]) - 0.05) <= 1e-6
    # the all-reduce averages the two uploads; each rank refined its own half of the data
    for n in ranks[0]["shared"]:
        mean = (ranks[0]["shared"][n] + ranks[1]["shared"][n]) / 2
        assert torch.allclose(ranks[0]["aggregated"][n], mean, atol=1e-7)
    assert not set(ranks[0]["cached"]) & set(ranks[1]["cached"])
    # the checkpoint (written by rank 0) holds both ranks' warm-start caches
    state = torch.load(tmp_path / "refiner.ckpt", weights_only=True)["state_dict"]["_extra_state"]
    assert {c: sorted(e["indices"].tolist()) for c, e in state["clients"].items()} == {
        0: ranks[0]["cached"],
        1: ranks[1]["cached"],
    }


def sample_simulation(module: nn.Module, **kwargs) -> FederatedSimulation:
    from lightning_gp.data import FashionMNISTSampleDataModule

    options = {"num_clients": 4, "clients_per_round": 2, "local_batch_size": 4, "seed": 1}
    return FederatedSimulation(module, FashionMNISTSampleDataModule(), **{**options, **kwargs})


def lenet_refiner(**kwargs) -> RefinerModule:
    from lightning_gp.models import LeNetZhu
    from lightning_gp.refiner.evaluator import EvaluationNetwork

    torch.manual_seed(0)
    evaluator = EvaluationNetwork(in_channels=1, width=1 / 32).eval()
    return RefinerModule(LeNetZhu(), loss_fn=nn.CrossEntropyLoss(), evaluator=evaluator, iterations=2, **kwargs)


def test_simulation_shares_each_clients_projected_upload() -> None:
    refiner = lenet_refiner(eps=0.02)
    simulation = sample_simulation(refiner, clients_per_round=4)  # every client takes part in round 0
    tap = GradientTap(clients=2, rounds=0)
    trainer(max_steps=1, callbacks=[tap]).fit(simulation)
    record = tap.latest()
    x, y = record.batch
    # replay client 2's Refiner step from the recorded round: same weights, same stream, same upload
    replay = lenet_refiner(eps=0.02)
    replay.load_state_dict(record.model_state, strict=False)
    replay.prepare_clients(simulation.source_datamodule)
    again = replay.refine_batch(x, y, client_id=2, round=0)
    assert all(torch.allclose(record.gradients[n], again.upload[n], atol=1e-6) for n in again.upload)
    assert abs(global_distance(record.gradients, again.raw) - 0.02) <= 1e-5


def test_simulation_refuses_fedavg_with_refiner() -> None:
    with pytest.raises(ValueError, match="fedsgd"):
        sample_simulation(lenet_refiner(), algorithm="fedavg", local_steps=2)


# ------------------------------------------------------------------------------ warm start


def test_warm_start_reuses_each_samples_cached_robust_image() -> None:
    module = refiner_module(warm_start=True)
    x, y = batch(4, seed=6)
    cold = module.refine_batch(x, y, client_id=0, round=0, sample_ids=[10, 11, 12, 13])
    assert cold.iterations == 10 and sorted(module.cache[0]) == [10, 11, 12, 13]
    warm = module.refine_batch(x, y, client_id=0, round=1, sample_ids=[10, 11, 12, 13])
    assert warm.iterations == 5
    # the warm run starts at the cached x*: with zero steps' worth of movement it would return it
    still = refiner_module(warm_start=True, warm_iterations=1, step_size=1e-12)
    still.cache = {0: {i: module.cache[0][i].clone() for i in (10, 11, 12, 13)}}
    kept = still.refine_batch(x, y, client_id=0, round=2, sample_ids=[10, 11, 12, 13])
    assert torch.allclose(kept.pixels, torch.stack([module.cache[0][i] for i in (10, 11, 12, 13)]), atol=1e-6)
    # a batch with one new sample runs the cold budget; other clients' caches are separate
    mixed = module.refine_batch(x, y, client_id=0, round=3, sample_ids=[10, 11, 12, 99])
    assert mixed.iterations == 10
    module.refine_batch(x, y, client_id=1, round=0, sample_ids=[10, 11, 12, 13])
    assert set(module.cache) == {0, 1}


def test_warm_start_cache_resumes_from_a_checkpoint(tmp_path: Path) -> None:
    x, y = batch(8, seed=7)
    data = DataLoader(IndexedDataset(TensorDataset(x, y)), batch_size=4)
    first = refiner_module(warm_start=True)
    run = trainer(max_steps=2, enable_checkpointing=True, default_root_dir=tmp_path)
    run.fit(first, data)
    path = tmp_path / "refiner.ckpt"
    run.save_checkpoint(path)
    assert sorted(first.cache[0]) == list(range(8))
    resumed = refiner_module(warm_start=True)
    resumed_trainer = trainer(max_steps=3)
    resumed_trainer.fit(resumed, data, ckpt_path=str(path))
    # the restored cache made step 3's batch (samples 0..3) warm
    assert resumed.last_refined.iterations == 5
    saved = torch.load(path, weights_only=True)["state_dict"]["_extra_state"]["clients"][0]
    assert sorted(saved["indices"].tolist()) == list(range(8)) and saved["pixels"].shape == (8, 1, 6, 6)


def test_simulation_warm_cache_is_per_client_and_checkpointed(tmp_path: Path) -> None:
    simulation = sample_simulation(lenet_refiner(warm_start=True), rounds_per_epoch=2)
    run = trainer(max_steps=2, default_root_dir=tmp_path)
    run.fit(simulation)
    cache = simulation.module.cache
    assert cache and all(len(v) > 0 for v in cache.values())
    owned = {c: set(simulation.client_indices[c].tolist()) for c in range(4)}
    assert all(set(v) <= owned[c] for c, v in cache.items())
    path = tmp_path / "sim.ckpt"
    run.save_checkpoint(path)
    restored = sample_simulation(lenet_refiner(warm_start=True), rounds_per_epoch=2)
    restored.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    assert {c: sorted(v) for c, v in restored.module.cache.items()} == {c: sorted(v) for c, v in cache.items()}


def test_image_classifier_trains_through_refiner_on_the_sample() -> None:
    from lightning_gp.data import FashionMNISTSampleDataModule
    from lightning_gp.models import LeNetZhu
    from lightning_gp.refiner.evaluator import EvaluationNetwork

    torch.manual_seed(0)
    module = RefinerModule(
        ImageClassifier(LeNetZhu()), evaluator=EvaluationNetwork(in_channels=1, width=1 / 32).eval(), iterations=1
    )
    trainer(max_steps=2).fit(module, datamodule=FashionMNISTSampleDataModule(batch_size=8))
    assert module.last_refined is not None and module.normalisation(1) == (
        FashionMNISTSampleDataModule.mean,
        FashionMNISTSampleDataModule.std,
    )
