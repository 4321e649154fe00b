"""Checkpoint/resume: every client's defense state (residuals, random streams) survives a restart."""

import lightning as L
import pytest
import torch
from helpers import GaussianJitter, RandomImages, quiet_trainer, small_cnn

from lightning_gp.callbacks import GradientDefense, MagnitudePruning
from lightning_gp.federated import FederatedSimulation


def make_run(num_clients: int = 6, rate: float = 0.8):
    L.seed_everything(0)
    sim = FederatedSimulation(
        small_cnn(),
        datamodule=RandomImages(),
        num_clients=num_clients,
        clients_per_round=3,
        local_batch_size=4,
        rounds_per_epoch=4,
        server_lr=0.5,
        seed=1,
    )
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
