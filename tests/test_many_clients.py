"""FedSGD with many clients per round (fedsgd_many_clients) trains exactly what FederatedSimulation trains."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from helpers import quiet_trainer

from lightning_gp.audit import DefenseSetting
from lightning_gp.callbacks import GaussianNoise
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.defenses import GaussianNoise as GaussianNoiseTransform
from lightning_gp.defenses import Soteria
from lightning_gp.federated import FederatedSimulation, accuracy_on_test_split, fedsgd_many_clients
from lightning_gp.models import LeNetZhu

#: Float tolerance on the trained weights. Both runs compute the same per-client gradients and
#: noise; they differ only in the order the clients' shared gradients are summed (vmap chunks here,
#: one stack there), a relative difference of a few float32 eps in each round's mean. Adam divides
#: the mean by its own running scale, so that relative error reaches a weight as a few eps of a
#: step of size <= lr (1e-3), far below one ulp of the weights (|w| <= 0.5 + 3 lr, ulp 6e-8).
#: 1e-6 is 16 such ulps; a client given another's noise stream or batch moves a weight by O(lr).
WEIGHT_ATOL = 1e-6


def simulated(model, *, clients, per_round, batch, rounds, seed, callbacks):
    """The reference: ``model`` trained in place by FederatedSimulation as train_setting builds it."""
    simulation = FederatedSimulation(
        model,
        datamodule=FashionMNISTSampleDataModule(),
        num_clients=clients,
        clients_per_round=per_round,
        local_batch_size=batch,
        server_optimizer=DefenseSetting("x").server_optimizer,
        server_lr=DefenseSetting("x").server_lr,
        seed=seed,
    )
    quiet_trainer(max_steps=rounds, callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0).fit(simulation)


@pytest.mark.parametrize(
    ("clients", "per_round", "chunk", "noise"),
    [(3, 3, 2, None), (4, 4, 1, 0.01), (3, 3, 1000, 0.01), (5, 3, 2, 0.01)],
    ids=["undefended-3-chunked", "noise-4-one-per-chunk", "noise-3-one-chunk", "noise-3-of-5-sampled"],
)
def test_many_clients_trains_the_weights_the_simulation_trains(clients, per_round, chunk, noise, one_thread):
    torch.manual_seed(0)
    start = LeNetZhu()
    reference, fast = copy.deepcopy(start), copy.deepcopy(start)
    callbacks = [] if noise is None else [GaussianNoise(scale=noise, seed=5)]
    simulated(reference, clients=clients, per_round=per_round, batch=2, rounds=3, seed=7, callbacks=callbacks)
    defense = None if noise is None else GaussianNoiseTransform(noise, seed=5)
    run = fedsgd_many_clients(
        fast,
        FashionMNISTSampleDataModule(),
        defense=defense,
        num_clients=clients,
        clients_per_round=per_round,
        client_batch_size=2,
        rounds=3,
        seed=7,
        chunk_size=chunk,
    )
    assert [r.round for r in run.rounds] == [0, 1, 2]
    for (name, ours), theirs, before in zip(fast.named_parameters(), reference.parameters(), start.parameters()):
        assert (ours - before).abs().max() > 100 * WEIGHT_ATOL, name  # training moved it: the match says something
        torch.testing.assert_close(ours, theirs, atol=WEIGHT_ATOL, rtol=0, msg=name)
    if defense is not None:  # every client drew from its own stream, clients 0..n-1 only
        assert set(defense.clients) <= set(range(clients)) and len(defense.clients) >= per_round


def test_the_defaults_are_the_server_optimizer_train_setting_uses_for_fedsgd():
    defaults = inspect.signature(fedsgd_many_clients).parameters
    setting = DefenseSetting("undefended")
    assert defaults["server_optimizer"].default == setting.server_optimizer
    assert defaults["server_lr"].default == setting.server_lr


def test_a_data_dependent_defense_and_a_bad_chunk_are_refused_by_name():
    data = FashionMNISTSampleDataModule()
    with pytest.raises(ValueError, match="defense: Soteria"):
        fedsgd_many_clients(LeNetZhu(), data, defense=Soteria(seed=0), clients_per_round=2, rounds=1)
    with pytest.raises(ValueError, match="chunk_size"):
        fedsgd_many_clients(LeNetZhu(), data, clients_per_round=2, rounds=1, chunk_size=0)
    with pytest.raises(ValueError, match="clients_per_round"):
        fedsgd_many_clients(LeNetZhu(), data, clients_per_round=3, num_clients=2, rounds=1)


def test_accuracy_on_the_test_split_of_a_constant_classifier_is_its_class_frequency():
    data = FashionMNISTSampleDataModule()
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.nn.functional.one_hot(torch.tensor(3), 10).float())
    model.train()
    data.setup("test")
    labels = torch.cat([y for _, y in data.test_dataloader()])
    assert accuracy_on_test_split(model, data) == int((labels == 3).sum()) / len(labels)
    assert model.training  # put back as it was
