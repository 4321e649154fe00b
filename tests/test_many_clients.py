"""FedSGD and FedAvg with many clients per round (train_many_clients) train exactly what FederatedSimulation trains."""

from __future__ import annotations

import copy
import csv
import inspect

import pytest
import torch
from helpers import BENCHMARKS, quiet_trainer, run_benchmark

import lightning_gp.callbacks
import lightning_gp.defenses
from lightning_gp.audit import DefenseSetting
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.defenses import Soteria
from lightning_gp.federated import (
    FederatedSimulation,
    accuracy_on_test_split,
    fedsgd_many_clients,
    train_many_clients,
)
from lightning_gp.models import LeNetZhu

#: Float tolerance on the trained weights. Both runs compute the same per-client gradients and
#: noise; they differ only in the order the clients' shared gradients are summed (vmap chunks here,
#: one stack there), a relative difference of a few float32 eps in each round's mean. Adam divides
#: the mean by its own running scale, so that relative error reaches a weight as a few eps of a
#: step of size <= lr (1e-3), far below one ulp of the weights (|w| <= 0.5 + 3 lr, ulp 6e-8).
#: 1e-6 is 16 such ulps; a client given another's noise stream or batch moves a weight by O(lr).
WEIGHT_ATOL = 1e-6


def simulated(model, *, clients, per_round, batch, rounds, seed, callbacks, **local_training):
    """The reference: ``model`` trained in place by FederatedSimulation as train_setting builds it."""
    simulation = FederatedSimulation(
        model,
        datamodule=FashionMNISTSampleDataModule(),
        num_clients=clients,
        clients_per_round=per_round,
        local_batch_size=batch,
        **local_training,
        server_optimizer=DefenseSetting("x").server_optimizer,
        server_lr=DefenseSetting("x").server_lr,
        seed=seed,
    )
    quiet_trainer(max_steps=rounds, callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0).fit(simulation)


#: FedAvg as the simulation runs it: 3 local SGD steps a round, each on its own local batch.
FEDAVG = {"algorithm": "fedavg", "local_steps": 3, "local_lr": 0.05}


@pytest.mark.parametrize(
    ("clients", "per_round", "chunk", "defense", "local_training"),
    [
        (3, 3, 2, None, {}),
        (4, 4, 1, "GaussianNoise", {}),
        (3, 3, 1000, "GaussianNoise", {}),
        (5, 3, 2, "GaussianNoise", {}),
        (4, 4, 3, "AlignedDualGradientPruning", {}),  # prepares each round from every client's gradient
        (4, 4, 3, "Outpost", {}),  # reads the current weights
        (3, 3, 2, None, FEDAVG),
        (5, 3, 2, "GaussianNoise", FEDAVG),
    ],
    ids=[
        "undefended-chunked",
        "noise-one-per-chunk",
        "noise-one-chunk",
        "noise-3-of-5-sampled",
        "adgp",
        "outpost",
        "fedavg-undefended-chunked",
        "fedavg-noise-3-of-5-sampled",
    ],
)
def test_many_clients_trains_the_weights_the_simulation_trains(
    clients, per_round, chunk, defense, local_training, one_thread
):
    torch.manual_seed(0)
    start = LeNetZhu()
    reference, fast = copy.deepcopy(start), copy.deepcopy(start)
    callbacks = [] if defense is None else [getattr(lightning_gp.callbacks, defense)(seed=5)]
    simulated(
        reference,
        clients=clients,
        per_round=per_round,
        batch=2,
        rounds=3,
        seed=7,
        callbacks=callbacks,
        **local_training,
    )
    pure = None if defense is None else getattr(lightning_gp.defenses, defense)(seed=5)
    run = train_many_clients(
        fast,
        FashionMNISTSampleDataModule(),
        defense=pure,
        num_clients=clients,
        clients_per_round=per_round,
        client_batch_size=2,
        rounds=3,
        seed=7,
        chunk_size=chunk,
        **local_training,
    )
    assert [r.round for r in run.rounds] == [0, 1, 2]
    for (name, ours), theirs, before in zip(fast.named_parameters(), reference.parameters(), start.parameters()):
        assert (ours - before).abs().max() > 100 * WEIGHT_ATOL, name  # training moved it: the match says something
        torch.testing.assert_close(ours, theirs, atol=WEIGHT_ATOL, rtol=0, msg=name)
    if pure is not None:  # every client drew from its own stream, clients 0..n-1 only
        assert set(pure.clients) <= set(range(clients)) and len(pure.clients) >= per_round


def test_fedavg_epochs_over_one_batch_train_the_client_the_audit_attacks(one_thread):
    """local_epochs=E over one batch of B is the audit's FedAvg client (E epochs over its B images in
    one local batch, replayed by the server's simulation): one round with the server applying the
    mean update as is (SGD at rate 1) moves the weights by the mean of the replayed clients' updates."""
    from lightning_gp.audit.learned import setting_simulator
    from lightning_gp.federated import ClientRounds, iid_partition

    data = FashionMNISTSampleDataModule()
    data.setup("fit")
    torch.manual_seed(0)
    start = LeNetZhu()
    trained = copy.deepcopy(start)
    clients, batch, epochs, lr = 3, 4, 3, 0.05
    train_many_clients(
        trained, data, clients_per_round=clients, client_batch_size=batch, rounds=1, algorithm="fedavg",
        local_epochs=epochs, local_lr=lr, server_optimizer="sgd", server_lr=1.0, seed=2,
    )  # fmt: skip
    split = iid_partition(len(data.train_dataset), clients, 2)
    rounds = ClientRounds(data.train_dataset, split, clients, batch, seed=2)
    items = [[data.train_dataset[int(i)] for i in rounds.sample_local_indices(0, c)] for c in range(clients)]
    images = torch.stack([torch.stack([x for x, _ in client]) for client in items])
    labels = torch.tensor([[int(y) for _, y in client] for client in items])
    setting = DefenseSetting("undefended", local_lr=lr).with_client_training("fedavg", epochs, batch)
    replayed = setting_simulator(setting, num_clients=clients)(copy.deepcopy(start), images, labels, 0)
    for (name, ours), before in zip(trained.named_parameters(), start.parameters()):
        expected = before - replayed[name].mean(0)
        assert (ours - before).abs().max() > 100 * WEIGHT_ATOL, name
        torch.testing.assert_close(ours, expected, atol=WEIGHT_ATOL, rtol=0, msg=name)


def test_the_defaults_are_the_server_optimizer_and_local_rate_train_setting_uses():
    defaults = inspect.signature(train_many_clients).parameters
    setting = DefenseSetting("undefended")
    assert defaults["server_optimizer"].default == setting.server_optimizer
    assert defaults["server_lr"].default == setting.server_lr
    assert defaults["local_lr"].default == setting.local_lr
    assert (defaults["algorithm"].default, defaults["local_steps"].default) == ("fedsgd", 1)


def test_a_data_dependent_defense_a_bad_chunk_and_bad_local_training_are_refused_by_name():
    data = FashionMNISTSampleDataModule()
    with pytest.raises(ValueError, match="defense: Soteria"):
        train_many_clients(LeNetZhu(), data, defense=Soteria(seed=0), clients_per_round=2, rounds=1)
    with pytest.raises(ValueError, match="chunk_size"):
        train_many_clients(LeNetZhu(), data, clients_per_round=2, rounds=1, chunk_size=0)
    with pytest.raises(ValueError, match="clients_per_round"):
        train_many_clients(LeNetZhu(), data, clients_per_round=3, num_clients=2, rounds=1)
    with pytest.raises(ValueError, match="algorithm"):
        train_many_clients(LeNetZhu(), data, clients_per_round=2, rounds=1, algorithm="fedprox")
    with pytest.raises(ValueError, match="local_steps > 1 needs algorithm='fedavg'"):
        train_many_clients(LeNetZhu(), data, clients_per_round=2, rounds=1, local_steps=2)
    with pytest.raises(ValueError, match="local_epochs > 1 needs algorithm='fedavg'"):
        train_many_clients(LeNetZhu(), data, clients_per_round=2, rounds=1, local_epochs=2)
    with pytest.raises(ValueError, match="local_lr"):
        train_many_clients(LeNetZhu(), data, clients_per_round=2, rounds=1, algorithm="fedavg", local_lr=0.0)


def test_the_old_name_warns_and_trains_the_same_fedsgd(one_thread):
    torch.manual_seed(0)
    old, new = LeNetZhu(), LeNetZhu()
    new.load_state_dict(old.state_dict())
    with pytest.warns(DeprecationWarning, match="train_many_clients"):
        fedsgd_many_clients(old, FashionMNISTSampleDataModule(), clients_per_round=2, rounds=1)
    train_many_clients(new, FashionMNISTSampleDataModule(), clients_per_round=2, rounds=1)
    for a, b in zip(old.parameters(), new.parameters()):
        assert torch.equal(a, b)


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


def test_the_benchmark_writes_pmm_against_the_same_clients_undefended_run(tmp_path):
    result = run_benchmark(
        "many_clients.py",
        "--sample",
        "--defenses",
        "GaussianNoise",
        "LaplaceNoise(scale=0.05)",
        "--clients-per-round",
        "2",
        "4",
        "--batch-sizes",
        "1",
        "--rounds",
        "2",
        "--output-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "many_clients.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["defense"], r["clients_per_round"]) for r in rows] == [
        (defense, clients)
        for clients in ("2", "4")
        for defense in ("undefended", "GaussianNoise(scale=0.01)", "LaplaceNoise(scale=0.05)")
    ]
    for row in rows:  # PMM is over the undefended run of the same clients per round
        base = next(
            r for r in rows if r["defense"] == "undefended" and r["clients_per_round"] == row["clients_per_round"]
        )
        assert float(row["undefended_acc"]) == float(base["test_acc"])
        assert float(row["PMM"]) == pytest.approx(float(row["test_acc"]) / float(base["test_acc"]), abs=1e-4)
    assert (tmp_path / "many_clients.png").stat().st_size > 0
    assert "round 2/2" in result.stdout and "s/round" in result.stdout


def test_the_benchmark_trains_fedavg_and_says_so(tmp_path):
    common = [
        "--sample",
        "--defenses",
        "GaussianNoise",
        "--clients-per-round",
        "2",
        "--batch-sizes",
        "1",
        "--rounds",
        "1",
    ]
    refused = run_benchmark("many_clients.py", *common, "--local-epochs", "3")
    assert refused.returncode != 0 and "--local-epochs > 1 needs --algorithm fedavg" in refused.stderr
    result = run_benchmark(
        "many_clients.py", *common, "--algorithm", "fedavg", "--local-epochs", "3", "--output-dir", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "many_clients.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["algorithm"], r["local_steps"], r["local_epochs"]) for r in rows} == {("fedavg", "1", "3")}
    text = (tmp_path / "many_clients.md").read_text()
    assert "FedAvg (3 epoch(s) over 1 local batch(es) a round)" in text
    assert "--algorithm fedavg --local-steps 1 --local-epochs 3" in text


def test_the_benchmark_reads_pure_defense_specs_and_refuses_what_is_not_one_fedsgd_gradient_defense(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import many_clients

    label, build, setting = many_clients.parse_defense("LaplaceNoise(scale=0.05)", seed=4, channels=1)
    first, second = build(), build()
    assert label == "LaplaceNoise(scale=0.05)" and first is not second  # a fresh defense per run
    assert (type(first).__name__, first.scale, first.seed) == ("LaplaceNoise", 0.05, 4)
    assert setting.server_optimizer == "adam"
    with pytest.raises(ValueError, match="not one gradient defense of FedSGD"):
        many_clients.parse_defense("DPSGD", seed=0, channels=1)  # Opacus runs its own client step
    with pytest.raises(ValueError, match=r"not a defense of lightning_gp\.defenses"):
        many_clients.parse_defense("ImageClassifier(lr=0.1)", seed=0, channels=1)
