"""Composed defenses: a stage prepares its round from the gradient as the stages before it defend it.

``[GaussianNoise(...), AlignedDualGradientPruning()]`` must choose the round's mask from the
noised gradient (else the positions sent reveal the raw gradient's largest entries), and the
noise stage must draw once per client and round: what the later stage's ``begin_round`` sees is
exactly what its ``defend`` then receives. Checked on the local path, the simulation and the DDP
hook's held path (one gloo rank).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers import CountingDefense, RandomImages, quiet_trainer, run_script, small_cnn
from test_local_path import TinyClassifier, loader, raw_gradient
from torch import nn

from lightning_gp import defenses
from lightning_gp.callbacks import AlignedDualGradientPruning, GaussianNoise, GradientDefense, GradientTap
from lightning_gp.defenses import Defense, NonFiniteGradientError, share_in_process
from lightning_gp.federated import FederatedSimulation, client_gradients
from lightning_gp.pipeline import RoundNotPrepared, SharedGradientPipeline, StageCall
from lightning_gp.pipeline.ddp import DefendedAllReduce
from lightning_gp.pipeline.stages import ClientSetup

SCALE = 5.0  # far above the gradients' own magnitudes: the noised ranking is not the raw one


class RoundRecorder(Defense):
    """Identity that records what its ``begin_round`` and its defense receive, per client."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.prepared: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # round -> client -> gradients
        self.defended: list[tuple[int, dict[str, torch.Tensor]]] = []  # (client, gradients), in call order

    def config(self) -> dict:
        return {"records": "begin_round"}  # a state key of its own beside other GradientDefense callbacks

    def begin_round(self, round, clients, local_gradients, share):
        self.prepared[round] = {c: {n: g.clone() for n, g in grads.items()} for c, grads in local_gradients.items()}

    def __call__(self, gradients, client_id=0, *, out=None):
        self.defended.append((client_id, {n: g.clone() for n, g in gradients.items()}))
        return super().__call__(gradients, client_id, out=out)

    def transform(self, gradients, state, call):
        return dict(gradients), state


def assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


def far_from(actual: dict[str, torch.Tensor], raw: dict[str, torch.Tensor]) -> bool:
    return all(not torch.allclose(actual[n], raw[n], atol=1e-2) for n in raw)


# ---------------------------------------------------------------- local path (one process, one client)


def test_local_path_prepares_the_second_stage_from_the_noised_gradient_drawn_once():
    L.seed_everything(0)
    model = TinyClassifier()
    raw = raw_gradient(model, next(iter(loader())))
    noise, recorder, tap = GaussianNoise(scale=SCALE, seed=3), RoundRecorder(), GradientTap(rounds=[0])
    quiet_trainer(max_steps=2, callbacks=[noise, GradientDefense(recorder), tap]).fit(model, loader())

    standalone = defenses.GaussianNoise(SCALE, seed=3)
    noised = standalone(raw, 0)  # the noise stage's first draw on round 0's gradient
    assert sorted(recorder.prepared) == [0, 1]
    assert_equal(recorder.prepared[0][0], noised)
    assert far_from(recorder.prepared[0][0], raw)
    assert [c for c, _ in recorder.defended] == [0, 0]
    for round, (_, defended) in enumerate(recorder.defended):  # begin_round saw what defend then got
        assert_equal(recorder.prepared[round][0], defended)
    assert_equal(tap.latest().gradients, noised)
    # one draw per round, not one in begin_round and another in process
    standalone(raw, 0)
    assert torch.equal(
        noise.defense.state_dict()["generator_states"][0], standalone.state_dict()["generator_states"][0]
    )


def test_local_path_adgp_after_noise_masks_the_noised_gradient():
    L.seed_everything(0)
    model = TinyClassifier()
    raw = raw_gradient(model, next(iter(loader())))
    adgp, tap = AlignedDualGradientPruning(k=0.2, k1=0.05, error_feedback=False, seed=1), GradientTap(rounds=[0])
    quiet_trainer(max_steps=1, callbacks=[GaussianNoise(scale=SCALE, seed=3), adgp, tap]).fit(model, loader())

    noised = defenses.GaussianNoise(SCALE, seed=3)(raw, 0)
    expected_mask = adgp.defense.location_mask(noised)
    assert_equal(adgp.defense.round_mask, expected_mask)
    assert any(not torch.equal(expected_mask[n], adgp.defense.location_mask(raw)[n]) for n in raw)
    reference = defenses.AlignedDualGradientPruning(k=0.2, k1=0.05, error_feedback=False, seed=1)
    reference.begin_round(0, [0], {0: noised}, share_in_process)
    assert_equal(tap.latest().gradients, reference(noised, 0))


# ---------------------------------------------------------------- the simulation (every client known at round start)


def test_simulation_prepares_every_later_stage_from_each_client_s_defended_gradient():
    L.seed_everything(0)
    sim = FederatedSimulation(
        small_cnn(), datamodule=RandomImages(), num_clients=5, clients_per_round=3, local_batch_size=4, seed=2
    )
    counting, recorder = CountingDefense(), RoundRecorder()
    adgp = AlignedDualGradientPruning(k=0.2, k1=0.05, error_feedback=False, seed=1)
    masks: list[dict[str, torch.Tensor]] = []

    class KeepMask(GradientTap):  # sees every client; keeps the round's mask before the next round replaces it
        def observe_aggregate(self, update, *, round, clients):
            masks.append({n: m.clone() for n, m in adgp.defense.round_mask.items()})

    taps = [GradientTap(clients=c, rounds=None) for c in range(5)]
    callbacks = [GaussianNoise(scale=SCALE, seed=3), GradientDefense(counting), GradientDefense(recorder), adgp]
    quiet_trainer(max_steps=2, callbacks=[*callbacks, *taps, KeepMask(rounds=None)]).fit(sim)

    assert counting.calls == 2 * 3  # each client of each round through each stage once
    records = {(r.round, r.client_id): r for tap in taps for r in tap.records}
    for round in (0, 1):
        clients = sim._rounds.sample_clients(round).tolist()
        assert sorted(recorder.prepared[round]) == sorted(clients)
        defended = dict(recorder.defended[3 * round : 3 * round + 3])
        assert sorted(defended) == sorted(clients)
        for client in clients:
            record = records[(round, client)]
            x, y = record.batch
            model = small_cnn()
            model.load_state_dict(record.model_state)
            raw, _ = client_gradients(model, nn.CrossEntropyLoss(), x[None], y[None], vectorize=False)
            raw = {n: g[0] for n, g in raw.items()}
            prepared = recorder.prepared[round][client]
            assert far_from(prepared, raw)  # the noised gradient, not the raw one
            assert_equal(prepared, defended[client])
        provider = adgp.defense.provider(round, clients)
        assert_equal(masks[round], adgp.defense.location_mask(recorder.prepared[round][provider]))


# ---------------------------------------------------------------- DDP, held path (one gloo rank)


class WholeModelBucket:
    """A GradBucket holding all of a Linear(3, 2): gradients are views into one flat buffer, as DDP's."""

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


@pytest.mark.parametrize("second", ["recorder", "adgp"])
def test_ddp_held_path_prepares_the_second_stage_from_the_rank_s_noised_gradient(tmp_path, second):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        module = nn.Linear(3, 2)
        recorder = RoundRecorder()
        adgp = AlignedDualGradientPruning(k=0.25, k1=0.1, error_feedback=False, seed=1)
        stages = [GaussianNoise(scale=SCALE, seed=3), GradientDefense(recorder) if second == "recorder" else adgp]
        for stage in stages:
            stage.bind(ClientSetup(1, module, {n: p.shape for n, p in module.named_parameters()}, cohort_size=1))
        pipeline = SharedGradientPipeline(stages, [])
        hook = DefendedAllReduce(SimpleNamespace(global_rank=0, global_step=0, world_size=1), module, pipeline, None)
        assert not hook.bucketwise  # a stage that prepares rounds needs the whole gradient
        buffer = torch.tensor([0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.7, -0.8])
        raw = {"weight": buffer[:6].view(2, 3).clone(), "bias": buffer[6:].clone()}
        aggregate = hook.on_bucket(WholeModelBucket(module, buffer)).wait()

        noised = defenses.GaussianNoise(SCALE, seed=3)(raw, 0)
        if second == "recorder":
            assert_equal(recorder.prepared[0][0], noised)
            assert recorder.defended[0][0] == 0
            assert_equal(recorder.defended[0][1], noised)
            expected = noised
        else:
            mask = adgp.defense.location_mask(noised)
            assert_equal(adgp.defense.round_mask, mask)
            assert any(not torch.equal(mask[n], adgp.defense.location_mask(raw)[n]) for n in raw)
            reference = defenses.AlignedDualGradientPruning(k=0.25, k1=0.1, error_feedback=False, seed=1)
            reference.begin_round(0, [0], {0: noised}, share_in_process)
            expected = reference(noised, 0)
        assert torch.equal(aggregate, torch.cat([expected["weight"].flatten(), expected["bias"]]))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_ranks_share_the_mask_of_the_provider_s_noised_gradient_and_agree_on_failure_first(tmp_path):
    script = Path(__file__).parent / "scripts" / "composed_round_check.py"
    result = run_script(script, str(tmp_path), timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    provider = ranks[0]["provider"]
    assert ranks[1]["provider"] == provider in (0, 1)
    module = nn.Linear(8, 4)
    shapes = {n: p.shape for n, p in module.named_parameters()}

    def named(flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(shapes, (part.view(shape) for part, shape in zip(flat.split([36 - 4, 4]), shapes.values()))))

    raw = {rank: named(ranks[rank]["raw"]) for rank in range(2)}
    noised = {rank: defenses.GaussianNoise(SCALE, seed=3)(raw[rank], rank) for rank in range(2)}
    adgp = defenses.AlignedDualGradientPruning(k=0.25, k1=0.1, error_feedback=False, seed=1)
    mask = adgp.location_mask(noised[provider])
    assert any(not torch.equal(mask[n], adgp.location_mask(raw[provider])[n]) for n in mask)
    for rank in range(2):
        assert_equal(ranks[rank]["mask"], mask)
    adgp.begin_round(0, [0, 1], noised, share_in_process)
    sent = [adgp(noised[rank], rank) for rank in range(2)]
    expected = torch.cat([((sent[0][n] + sent[1][n]) / 2).flatten() for n in shapes])
    for rank in range(2):
        torch.testing.assert_close(ranks[rank]["aggregate"], expected)
    # rank 1's NaN stops its noise stage before ADGP's broadcast: both ranks raise the same error
    # (rank 0 does not wait for a mask rank 1 will never send)
    assert ranks[0]["nan"] == ranks[1]["nan"]
    assert ranks[0]["nan"].startswith(
        "DistributedDefenseError: the shared-gradient pipeline failed at step 0 on 1 of 2"
    )
    assert "rank 1: NonFiniteGradientError" in ranks[0]["nan"]


# ---------------------------------------------------------------- the pipeline's contract


def gradients() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1.0, 7.0)}


def composed() -> tuple[SharedGradientPipeline, RoundRecorder]:
    recorder = RoundRecorder()
    return SharedGradientPipeline(
        [GradientDefense(defenses.GaussianNoise(1.0, seed=0)), GradientDefense(recorder)], []
    ), recorder


def test_only_stages_that_prepare_rounds_make_the_pipeline_hold_whole_gradients():
    assert GradientDefense(RoundRecorder()).prepares_rounds
    assert AlignedDualGradientPruning().prepares_rounds
    assert not GaussianNoise().prepares_rounds
    pipeline, _ = composed()
    assert not pipeline.layerwise


def test_a_stage_prepared_first_is_given_the_raw_gradient_and_nothing_is_defended_early():
    counting, recorder = CountingDefense(), RoundRecorder()
    pipeline = SharedGradientPipeline([GradientDefense(recorder), GradientDefense(counting)], [])
    g = gradients()
    pipeline.begin_round(0, [0], {0: g}, share_in_process)  # no model needed: nothing runs before the recorder
    assert counting.calls == 0 and recorder.defended == []
    assert_equal(recorder.prepared[0][0], g)
    pipeline.process(g, StageCall(0, 0, nn.Linear(1, 1)))
    assert counting.calls == 1


def test_begin_round_needs_the_model_when_earlier_stages_must_defend():
    pipeline, _ = composed()
    with pytest.raises(ValueError, match="begin_round needs model="):
        pipeline.begin_round(0, [0], {0: gradients()}, share_in_process)


def test_begin_round_needs_a_batch_for_every_local_client_and_clients_of_the_round():
    pipeline, _ = composed()
    with pytest.raises(ValueError, match="batches has no batch for clients \\[1\\]"):
        pipeline.begin_round(
            0, [0, 1], {0: gradients(), 1: gradients()}, share_in_process, model=nn.Linear(1, 1), batches={0: None}
        )
    with pytest.raises(ValueError, match="local_gradients holds clients \\[2\\]"):
        pipeline.begin_round(0, [0, 1], {2: gradients()}, share_in_process, model=nn.Linear(1, 1))


def test_process_refuses_gradients_other_than_those_the_round_was_prepared_with():
    pipeline, _ = composed()
    model = nn.Linear(1, 1)
    pipeline.begin_round(0, [0], {0: gradients()}, share_in_process, model=model)
    with pytest.raises(ValueError, match="gradients: client 0's gradients are not the ones given to begin_round"):
        pipeline.process(gradients(), StageCall(0, 0, model))
    pipeline.begin_round(1, [0], {0: gradients()}, share_in_process, model=model)
    with pytest.raises(RuntimeError, match="begin_round prepared round 1"):
        pipeline.process(gradients(), StageCall(0, 2, model))


def test_processes_agree_on_a_failure_before_a_later_stage_prepares_the_round():
    said: list[bool] = []

    def agree(failed: bool) -> bool:  # one process: it learns only what it said itself
        said.append(failed)
        return failed

    pipeline, recorder = composed()
    bad = {"w": torch.tensor([1.0, float("nan")])}
    with pytest.raises(NonFiniteGradientError):
        pipeline.begin_round(0, [0], {0: bad}, share_in_process, model=nn.Linear(1, 1), agree=agree)
    assert said == [True] and recorder.prepared == {}  # it told the others, then raised its own error

    said.clear()
    pipeline.begin_round(1, [0], {0: gradients()}, share_in_process, model=nn.Linear(1, 1), agree=agree)
    assert said == [False] and 0 in recorder.prepared[1]

    def another_failed(failed: bool) -> bool:
        return True

    with pytest.raises(RoundNotPrepared, match=r"another process failed .* before RoundRecorder could prepare round 2"):
        pipeline.begin_round(2, [0, 1], {0: gradients()}, share_in_process, model=nn.Linear(1, 1), agree=another_failed)
    assert 2 not in recorder.prepared
