"""The DDP hook defends layerwise defenses bucket by bucket (overlapping the all-reduce with the
backward pass) and gives bit for bit what holding every bucket and defending the whole gradient gives."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers import run_script
from torch import nn

from lightning_gp import defenses
from lightning_gp.callbacks import AlignedDualGradientPruning, GaussianNoise, GradientTap, TopKPruning
from lightning_gp.pipeline import ObserverStage, SharedGradientPipeline, StageCall
from lightning_gp.pipeline.ddp import DefendedAllReduce

WORKER = Path(__file__).parent / "scripts" / "ddp_overlap_worker.py"

LAYERWISE = {
    "top-k with error feedback": lambda: defenses.TopKPruning(rate=0.7, seed=1),
    "magnitude with error feedback": lambda: defenses.MagnitudePruning(0.6, error_feedback=True, seed=1),
    "random pruning": lambda: defenses.RandomPruning(0.5, seed=2),
    "DGP": lambda: defenses.DualGradientPruning(seed=3),
    "Gaussian noise, clipped": lambda: defenses.GaussianNoise(0.1, clip=0.5, seed=4),
    "Laplace noise": lambda: defenses.LaplaceNoise(0.1, seed=5),
    "stochastic 4-bit quantisation": lambda: defenses.GradientQuantization(4, stochastic_rounding=True, seed=6),
}
SHAPES = {"a.weight": (20, 30), "a.bias": (20,), "b.weight": (5, 20), "b.bias": (5,)}


def gradients(step: int, client: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + client)
    return {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}


@pytest.mark.parametrize("name", list(LAYERWISE))
def test_defending_layers_part_by_part_equals_defending_them_at_once(name):
    """Outputs, error-feedback state and random streams: bucket order, two clients, four steps."""
    whole, parts = LAYERWISE[name](), LAYERWISE[name]()
    assert whole.layerwise
    for defense in (whole, parts):
        defense.set_num_clients(2)
        defense.check_layer_shapes({n: torch.Size(s) for n, s in SHAPES.items()})
    buckets = [["b.bias", "b.weight"], ["a.bias"], ["a.weight"]]  # DDP's order: last layers first
    for step in range(4):
        for client in (0, 1):
            g = gradients(step, client)
            ordered = {n: g[n] for bucket in buckets for n in bucket}
            expected = whole(ordered, client)
            got = {}
            for bucket in buckets:
                got.update(parts.defend_layers({n: g[n] for n in bucket}, client))
            for n in SHAPES:
                assert torch.equal(got[n], expected[n]), (step, client, n)
    for client in (0, 1):
        if whole.clients:
            expected_state, got_state = whole.client_state(client), parts.client_state(client)
            assert expected_state.keys() == got_state.keys()
            assert all(torch.equal(got_state[n], expected_state[n]) for n in expected_state)
    assert whole.state_dict()["generator_states"].keys() == parts.state_dict()["generator_states"].keys()
    for client, state in whole.state_dict()["generator_states"].items():
        assert torch.equal(parts.state_dict()["generator_states"][client], state)


def test_whole_model_defenses_refuse_to_defend_part_of_the_gradient():
    adgp = defenses.AlignedDualGradientPruning()
    assert not adgp.layerwise
    with pytest.raises(TypeError, match="not layerwise"):
        adgp.defend_layers(gradients(0, 0))
    for defense in (defenses.Outpost(), defenses.OptimalGradientPruning(), defenses.GradDefense()):
        assert not defense.layerwise


def test_a_part_must_name_declared_layers_of_the_declared_shapes():
    topk = defenses.TopKPruning(rate=0.7)
    with pytest.raises(RuntimeError, match="declared first"):
        topk.defend_layers({"a.bias": torch.ones(20)})
    topk.check_layer_shapes({n: torch.Size(s) for n, s in SHAPES.items()})
    with pytest.raises(ValueError, match=re.escape("a.bias: (21,)")):
        topk.defend_layers({"a.bias": torch.ones(21)})
    with pytest.raises(ValueError, match=re.escape("c.weight")):
        topk.defend_layers({"c.weight": torch.ones(3)})


def test_a_layerwise_defense_cannot_prepare_rounds_across_clients():
    with pytest.raises(TypeError, match="layerwise = True but overrides begin_round"):

        class Coordinated(defenses.TopKPruning):
            def begin_round(self, round, clients, local_gradients, share):
                pass


def test_the_pipeline_is_layerwise_only_when_every_defense_is():
    tap = GradientTap()
    assert SharedGradientPipeline([], [tap]).layerwise  # observers alone: nothing to hold for
    assert SharedGradientPipeline([TopKPruning(), GaussianNoise()], [tap]).layerwise
    mixed = SharedGradientPipeline([TopKPruning(), AlignedDualGradientPruning()], [tap])
    assert not mixed.layerwise
    with pytest.raises(RuntimeError, match="every defense is layerwise"):
        mixed.defend(gradients(0, 0), StageCall(0, 0, torch.nn.Linear(1, 1)), part=True)


@pytest.mark.multiprocess
def test_two_process_bucketwise_aggregates_are_bit_identical_to_holding_every_bucket(tmp_path):
    result = run_script(WORKER, str(tmp_path), timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    settings = sorted({setting for setting, _ in ranks[0]})
    assert len(settings) == 3
    for rank in ranks:
        for setting in settings:
            overlapped, held = rank[(setting, False)], rank[(setting, True)]
            assert [s["bucketwise"] for s in overlapped["steps"]] == [True] * 3
            assert [s["bucketwise"] for s in held["steps"]] == [False] * 3
            # DDP's first step uses its initial bucket; after rebuilding, the 1 KB cap splits the model
            assert all(s["buckets"] > 1 for s in overlapped["steps"][1:])
            for step in range(3):
                a, b = overlapped["steps"][step]["aggregate"], held["steps"][step]["aggregate"]
                assert all(torch.equal(a[n], b[n]) for n in b), (setting, step)
                # observers saw the same complete shared gradient once per step
                assert overlapped["shared"][step].keys() == held["shared"][step].keys()
                assert all(torch.equal(overlapped["shared"][step][n], t) for n, t in held["shared"][step].items())
            assert len(overlapped["shared"]) == len(held["shared"]) == 3
            for got, expected in zip(overlapped["states"], held["states"]):
                assert got.keys() == expected.keys()
                assert all(torch.equal(got[n], expected[n]) for n in expected)
            assert all(torch.equal(overlapped["weights"][n], w) for n, w in held["weights"].items())
    # the ranks' aggregates agree, and they are the mean of the two ranks' shared gradients
    for setting in settings:
        for step in range(3):
            aggregate = ranks[0][(setting, False)]["steps"][step]["aggregate"]
            shared = [ranks[r][(setting, False)]["shared"][step] for r in range(2)]
            for n, a in aggregate.items():
                assert torch.equal(ranks[1][(setting, False)]["steps"][step]["aggregate"][n], a)
                torch.testing.assert_close(a, (shared[0][n] + shared[1][n]) / 2)


class KeepShared(ObserverStage):
    """Keeps the tensors it is shown (as an observer must not, to expose aliasing)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def observe(self, gradients, call) -> None:
        self.seen.append(dict(gradients))


class OneBucket:
    """A GradBucket of a Linear(3, 2): its gradients are views into one flat buffer, as DDP's are."""

    def __init__(self, module: nn.Linear, buffer: torch.Tensor) -> None:
        self.module, self.flat = module, buffer

    def parameters(self) -> list[nn.Parameter]:
        return [self.module.weight, self.module.bias]

    def gradients(self) -> list[torch.Tensor]:
        return [self.flat[:6].view(2, 3), self.flat[6:]]

    def buffer(self) -> torch.Tensor:
        return self.flat

    def is_last(self) -> bool:
        return True


@pytest.mark.parametrize("stages", ["no defense", "top-k"])
def test_bucketwise_observers_see_what_the_rank_sent_not_the_bucket_ddp_reuses(tmp_path, stages):
    # Regression: with no defense the shared layers were the bucket's own views, and the in-place
    # asynchronous all-reduce averaged them before the observers (taps) copied them (a 2-process
    # run tapped the other rank's mean about one time in three).
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        module, observer = nn.Linear(3, 2), KeepShared()
        defense = [] if stages == "no defense" else [TopKPruning(rate=0.5, seed=0)]
        for stage in defense:
            stage.defense.check_layer_shapes({n: p.shape for n, p in module.named_parameters()})
        pipeline = SharedGradientPipeline(defense, [observer])
        hook = DefendedAllReduce(SimpleNamespace(global_rank=0, global_step=0, world_size=1), module, pipeline, None)
        buffer = torch.arange(1.0, 9.0)
        expected = {"weight": buffer[:6].view(2, 3).clone(), "bias": buffer[6:].clone()}
        if defense:
            expected = defenses.TopKPruning(rate=0.5, seed=0)(expected)
        hook.on_bucket(OneBucket(module, buffer)).wait()
        buffer.mul_(-1)  # DDP's memory: the next backward writes into it
        assert len(observer.seen) == 1
        for name, value in expected.items():
            assert torch.equal(observer.seen[0][name], value), name
    finally:
        dist.destroy_process_group()
