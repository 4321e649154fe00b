"""Checkpoint/resume: every client's defense state (residuals, random streams) survives a restart,
so does what a defense callback keeps across steps (GradDefense's sensitivity, a reused statistic),
and a resume with other settings is refused."""

import re

import lightning as L
import pytest
import torch
from helpers import GaussianJitter, RandomImages, quiet_trainer, small_cnn
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gp.callbacks import (
    GradDefense,
    GradientDefense,
    MagnitudePruning,
    OptimalGradientNoise,
    OptimalGradientPruning,
    Soteria,
)
from lightning_gp.federated import FederatedSimulation
from lightning_gp.models import ImageClassifier


def make_run(num_clients: int = 6, rate: float = 0.8, callbacks=None, model=None):
    """A seeded simulation and its defense callbacks (``callbacks``: a factory of other ones)."""
    L.seed_everything(0)
    sim = FederatedSimulation(
        model if model is not None else small_cnn(),
        datamodule=RandomImages(),
        num_clients=num_clients,
        clients_per_round=3,
        local_batch_size=4,
        rounds_per_epoch=4,
        server_lr=0.5,
        seed=1,
    )
    if callbacks is not None:
        return sim, callbacks()
    callbacks = [
        MagnitudePruning(rate=rate, error_feedback=True, seed=5),
        GradientDefense(GaussianJitter(std=0.05, seed=9)),
    ]
    return sim, callbacks


def weights(sim) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in sim.parameters()])


def test_resumed_run_matches_an_uninterrupted_run(tmp_path):
    straight, straight_callbacks = make_run()
    quiet_trainer(max_steps=7, callbacks=straight_callbacks).fit(straight)

    first, first_callbacks = make_run()
    trainer = quiet_trainer(max_steps=3, callbacks=first_callbacks)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "round3.ckpt")  # mid-epoch: 4 rounds per epoch

    resumed, resumed_callbacks = make_run()
    assert not torch.equal(weights(resumed), weights(first))  # fresh start would differ
    quiet_trainer(max_steps=7, callbacks=resumed_callbacks).fit(resumed, ckpt_path=tmp_path / "round3.ckpt")

    torch.testing.assert_close(weights(resumed), weights(straight), rtol=0, atol=0)
    pruning, resumed_pruning = straight_callbacks[0].defense, resumed_callbacks[0].defense
    assert pruning.clients == resumed_pruning.clients and len(pruning.clients) > 1
    for client in pruning.clients:
        for name, residual in pruning.client_state(client).items():
            assert torch.equal(resumed_pruning.client_state(client)[name], residual)
            assert residual.abs().sum() > 0


def test_resume_without_the_restored_state_diverges(tmp_path):
    """Control for the test above: dropping the defense state changes the result."""
    straight, straight_callbacks = make_run()
    quiet_trainer(max_steps=7, callbacks=straight_callbacks).fit(straight)
    first, first_callbacks = make_run()
    trainer = quiet_trainer(max_steps=3, callbacks=first_callbacks)
    trainer.fit(first)
    checkpoint_path = tmp_path / "round3.ckpt"
    trainer.save_checkpoint(checkpoint_path)
    checkpoint = torch.load(checkpoint_path, weights_only=False)
    for state in checkpoint["callbacks"].values():
        state["defense"]["client_states"] = {}
        state["defense"]["generator_states"] = {}
    torch.save(checkpoint, checkpoint_path)
    resumed, resumed_callbacks = make_run()
    quiet_trainer(max_steps=7, callbacks=resumed_callbacks).fit(resumed, ckpt_path=checkpoint_path)
    assert not torch.allclose(weights(resumed), weights(straight))


def test_resuming_with_another_defense_configuration_is_an_error(tmp_path):
    first, callbacks = make_run()
    trainer = quiet_trainer(max_steps=2, callbacks=callbacks)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    other, other_callbacks = make_run(rate=0.5)
    with pytest.raises(ValueError, match=r"MagnitudePruning\(rate=0.8.*none for MagnitudePruning\(rate=0.5"):
        quiet_trainer(max_steps=4, callbacks=other_callbacks).fit(other, ckpt_path=tmp_path / "c.ckpt")


def test_resuming_with_another_number_of_clients_is_an_error(tmp_path):
    first, callbacks = make_run()
    trainer = quiet_trainer(max_steps=2, callbacks=callbacks)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    other, other_callbacks = make_run(num_clients=8)
    with pytest.raises(ValueError, match="6 clients, but this run has 8"):
        quiet_trainer(max_steps=4, callbacks=other_callbacks).fit(other, ckpt_path=tmp_path / "c.ckpt")


def test_resuming_onto_another_model_is_an_error(tmp_path):
    first, callbacks = make_run()
    trainer = quiet_trainer(max_steps=2, callbacks=callbacks)
    trainer.fit(first)
    checkpoint_path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(checkpoint_path)
    checkpoint = torch.load(checkpoint_path, weights_only=False)
    for state in checkpoint["callbacks"].values():  # as if written for a model with a wider layer
        state["defense"]["layer_shapes"]["3.weight"] = [4, 101]
    torch.save(checkpoint, checkpoint_path)
    other, other_callbacks = make_run()
    with pytest.raises(ValueError, match=r"3\.weight: \(4, 101\) -> \(4, 100\)"):
        quiet_trainer(max_steps=4, callbacks=other_callbacks).fit(other, ckpt_path=checkpoint_path)


# ------------------------------------------------------------------ the callbacks' own settings and state
def two_linear_cnn() -> nn.Module:
    """small_cnn with two nn.Linear layers ("3" and "5"), so Soteria can defend either."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 5 * 5, 8), nn.Tanh(), nn.Linear(8, 4)
    )


# (what the error says differs, the callback the run was started with, the one it is resumed with)
DIGEST = "'sha256:[0-9a-f]{16}'"
CHANGED_SETTINGS = [
    (
        "probes: 2 in the checkpoint, 3 now",
        lambda: OptimalGradientNoise(probes=2, seed=3),
        lambda: OptimalGradientNoise(probes=3, seed=3),
    ),
    (
        "method: 'batch' in the checkpoint, 'per_example' now",
        lambda: OptimalGradientNoise(probes=2, seed=3),
        lambda: OptimalGradientNoise(probes=2, method="per_example", seed=3),
    ),
    (
        "refresh_every: 1 in the checkpoint, 2 now",
        lambda: OptimalGradientPruning(probes=2, seed=3),
        lambda: OptimalGradientPruning(probes=2, refresh_every=2, seed=3),
    ),
    (
        "layer: '3' in the checkpoint, '5' now",
        lambda: Soteria(rate=0.5, layer="3", seed=3),
        lambda: Soteria(rate=0.5, layer="5", seed=3),
    ),
    (
        "method: 'jacobian' in the checkpoint, 'probes' now; probes: not set in the checkpoint, 10 now",
        lambda: Soteria(rate=0.5, seed=3),
        lambda: Soteria(rate=0.5, method="probes", seed=3),
    ),
    (
        "root_per_class: 2 in the checkpoint, 5 now",
        lambda: GradDefense(root_data="train", root_per_class=2, seed=3),
        lambda: GradDefense(root_data="train", seed=3),
    ),
    (
        "refresh_every: 1 in the checkpoint, 2 now",
        lambda: GradDefense(root_data="train", root_per_class=2, seed=3),
        lambda: GradDefense(root_data="train", root_per_class=2, refresh_every=2, seed=3),
    ),
    (
        f"root_data: {DIGEST} in the checkpoint, {DIGEST} now",  # the same shapes, other targets
        lambda: GradDefense(root_data=(torch.ones(4, 1, 12, 12), torch.arange(4)), seed=3),
        lambda: GradDefense(root_data=(torch.ones(4, 1, 12, 12), torch.arange(4).flip(0)), seed=3),
    ),
]


@pytest.mark.parametrize(
    ("differ", "started", "resumed"),
    CHANGED_SETTINGS,
    ids=[c[0].split(":")[0] + f"-{i}" for i, c in enumerate(CHANGED_SETTINGS)],
)
def test_resuming_with_another_callback_setting_is_an_error_naming_it(tmp_path, differ, started, resumed):
    # Before: these settings were no part of the state key, so the resume was silently accepted.
    first, callbacks = make_run(callbacks=lambda: [started()], model=two_linear_cnn())
    trainer = quiet_trainer(max_steps=1, callbacks=callbacks)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    other, other_callbacks = make_run(callbacks=lambda: [resumed()], model=two_linear_cnn())
    pattern = re.escape("(settings that differ: ") + differ.replace("(", r"\(") + re.escape(");")
    with pytest.raises(ValueError, match=pattern):
        quiet_trainer(max_steps=2, callbacks=other_callbacks).fit(other, ckpt_path=tmp_path / "c.ckpt")


def test_chunk_size_is_no_setting_of_the_checkpoint():
    # a memory knob: resuming on a smaller device with smaller chunks is allowed
    assert OptimalGradientNoise(seed=0).state_key == OptimalGradientNoise(chunk_size=2, seed=0).state_key


# every third round computes a new statistic: the checkpoint after round 3 comes between two of them
KEPT_STATE = {
    "graddefense": lambda: [GradDefense(root_data="train", root_per_class=2, refresh_every=3, scale=0.05, seed=3)],
    "optimal": lambda: [OptimalGradientNoise(scale=0.05, probes=2, refresh_every=3, seed=3)],
}


@pytest.mark.parametrize("name", list(KEPT_STATE))
def test_a_resumed_simulation_reuses_the_kept_statistic_bit_for_bit(tmp_path, name):
    # Before: GradDefense's sensitivity cache and the optimal defenses' reused sensitivity were not
    # checkpointed, so the resumed run recomputed them at round 4 under other weights.
    straight, straight_callbacks = make_run(callbacks=KEPT_STATE[name])
    quiet_trainer(max_steps=6, callbacks=straight_callbacks).fit(straight)

    first, first_callbacks = make_run(callbacks=KEPT_STATE[name])
    trainer = quiet_trainer(max_steps=4, callbacks=first_callbacks)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "round4.ckpt")

    resumed, resumed_callbacks = make_run(callbacks=KEPT_STATE[name])
    quiet_trainer(max_steps=6, callbacks=resumed_callbacks).fit(resumed, ckpt_path=tmp_path / "round4.ckpt")
    torch.testing.assert_close(weights(resumed), weights(straight), rtol=0, atol=0)


def classifier_run(callbacks):
    L.seed_everything(0)
    generator = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(8, 1, 12, 12, generator=generator), torch.randint(0, 4, (8,), generator=generator))
    return ImageClassifier(small_cnn(), lr=0.5), DataLoader(data, batch_size=4), callbacks()


def test_a_resumed_trainer_reuses_graddefenses_sensitivity_bit_for_bit(tmp_path):
    # The plain Trainer computes the sensitivity at batch start: steps 3, 4 and 5 use step 3's.
    def defense():
        root = torch.randn(4, 1, 12, 12, generator=torch.Generator().manual_seed(1)), torch.arange(4)
        # 40 slices: fine enough that step 4's own sensitivity would cut other slices than step 3's
        return [GradDefense(root_data=root, slices=40, perturbed_slices=20, refresh_every=3, scale=0.05, seed=3)]

    straight, loader, callbacks = classifier_run(defense)
    saver = ModelCheckpoint(tmp_path, every_n_train_steps=4, save_top_k=-1)  # within the run: at step 4
    quiet_trainer(max_steps=6, callbacks=[*callbacks, saver], enable_checkpointing=True).fit(straight, loader)

    resumed, loader, callbacks = classifier_run(defense)
    (checkpoint,) = tmp_path.glob("*step=4.ckpt")
    quiet_trainer(max_steps=6, callbacks=callbacks).fit(resumed, loader, ckpt_path=checkpoint)
    for p, q in zip(resumed.parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert callbacks[0]._cache is not None and callbacks[0]._cache[0] == 3  # step 3's, not recomputed
