"""The in-process federated simulation: per-client defenses, aggregation, vmap vs loop."""

import lightning as L
import pytest
import torch
from helpers import CountingDefense, RandomImages, quiet_trainer, small_cnn
from torch import nn

from lightning_gp.callbacks import CommunicationMeter, GradientDefense, GradientTap, MagnitudePruning
from lightning_gp.defenses import MagnitudePruning as MagnitudePruningTransform
from lightning_gp.federated import FederatedSimulation, client_gradients


def simulation(**kwargs) -> FederatedSimulation:
    defaults = dict(
        datamodule=RandomImages(),
        num_clients=6,
        clients_per_round=3,
        local_batch_size=4,
        server_optimizer="sgd",
        server_lr=1.0,
        seed=3,
    )
    defaults.update(kwargs)
    return FederatedSimulation(
        kwargs.pop("module", None) or small_cnn(), **{k: v for k, v in defaults.items() if k != "module"}
    )


def all_client_taps(num_clients: int) -> list[GradientTap]:
    return [GradientTap(clients=c, rounds=None) for c in range(num_clients)]


def test_fedsgd_server_applies_the_mean_of_the_defended_client_gradients():
    L.seed_everything(0)
    sim = simulation()
    start = {n: p.detach().clone() for n, p in sim.module.named_parameters()}
    taps = all_client_taps(6)
    quiet_trainer(max_steps=1, callbacks=[MagnitudePruning(rate=0.7), *taps]).fit(sim)
    records = [r for tap in taps for r in tap.records]
    assert len(records) == 3 and sorted(r.client_id for r in records) == sim._rounds.sample_clients(0).tolist()
    for record in records:  # each shared gradient is the defense applied to that client's own gradient
        x, y = record.batch
        model = small_cnn()
        model.load_state_dict(record.model_state)
        raw, _ = client_gradients(model, nn.CrossEntropyLoss(), x[None], y[None], vectorize=False)
        expected = MagnitudePruningTransform(0.7)({n: g[0] for n, g in raw.items()})
        for name in expected:
            torch.testing.assert_close(record.gradients[name], expected[name])
    for name, p in sim.module.named_parameters():  # SGD at lr 1: w1 = w0 - mean(shared)
        mean_shared = torch.stack([r.gradients[name] for r in records]).mean(0)
        torch.testing.assert_close(start[name] - p.detach(), mean_shared)


def test_each_client_keeps_its_own_error_feedback_state():
    L.seed_everything(0)
    defense = MagnitudePruning(rate=0.9, error_feedback=True)
    quiet_trainer(max_steps=4, callbacks=[defense]).fit(simulation())
    clients = defense.defense.clients
    assert len(clients) >= 4 and set(clients) <= set(range(6))
    residuals = [defense.defense.client_state(c)["0.weight"] for c in clients]
    assert all(r.abs().sum() > 0 for r in residuals)
    assert not torch.allclose(residuals[0], residuals[1])


@pytest.mark.parametrize("algorithm", ["fedsgd", "fedavg"])
def test_vmap_and_loop_paths_share_the_same_per_client_gradients(algorithm):
    shared = {}
    for vectorize in (True, False):
        L.seed_everything(0)
        taps = all_client_taps(6)
        extra = {"local_steps": 3, "local_lr": 0.05} if algorithm == "fedavg" else {}
        sim = simulation(vectorize=vectorize, algorithm=algorithm, **extra)
        quiet_trainer(max_steps=3, callbacks=[MagnitudePruning(rate=0.5, error_feedback=True), *taps]).fit(sim)
        shared[vectorize] = {(r.round, r.client_id): r.gradients for tap in taps for r in tap.records}
        shared[vectorize, "weights"] = {n: p.detach() for n, p in sim.module.named_parameters()}
    assert len(shared[True]) == 9 and shared[True].keys() == shared[False].keys()
    for key, gradients in shared[True].items():
        for name, grad in gradients.items():
            torch.testing.assert_close(grad, shared[False][key][name], atol=1e-6, rtol=1e-5)
    for name, w in shared[True, "weights"].items():
        torch.testing.assert_close(w, shared[False, "weights"][name], atol=1e-6, rtol=1e-5)


def test_fedavg_clients_share_weight_deltas_of_their_local_training():
    L.seed_everything(0)
    sim = simulation(algorithm="fedavg", local_steps=2, local_lr=0.1)
    start = {n: p.detach().clone() for n, p in sim.module.named_parameters()}
    taps = all_client_taps(6)
    quiet_trainer(max_steps=1, callbacks=taps).fit(sim)
    records = [r for tap in taps for r in tap.records]
    for record in records:  # replay the client's two local SGD steps by hand
        x, y = record.batch
        model = small_cnn()
        model.load_state_dict(record.model_state)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[step * 4 : (step + 1) * 4]), y[step * 4 : (step + 1) * 4]).backward()
            opt.step()
        for name, p in model.named_parameters():
            torch.testing.assert_close(record.gradients[name], start[name] - p.detach(), atol=1e-6, rtol=1e-5)
    for name, p in sim.module.named_parameters():
        torch.testing.assert_close(start[name] - p.detach(), torch.stack([r.gradients[name] for r in records]).mean(0))


def test_batchnorm_models_take_the_loop_path_and_update_running_stats():
    L.seed_everything(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(100, 4))
    sim = simulation(module=model)
    counting = GradientDefense(CountingDefense())
    quiet_trainer(max_steps=2, callbacks=[counting]).fit(sim)
    assert counting.defense.calls == 6  # 3 clients x 2 rounds, one defense call each
    assert not torch.allclose(model[1].running_mean, torch.zeros(4))
    with pytest.raises(ValueError, match="BatchNorm"):
        simulation(module=model, vectorize=True)


def test_same_seed_gives_the_same_run():
    finals = []
    for _ in range(2):
        L.seed_everything(0)
        sim = simulation(server_lr=0.5, module=small_cnn())
        quiet_trainer(max_steps=10, callbacks=[MagnitudePruning(rate=0.5)]).fit(sim)
        finals.append(torch.cat([p.detach().flatten() for p in sim.parameters()]))
    assert torch.equal(finals[0], finals[1])


def test_communication_meter_counts_every_client_upload():
    L.seed_everything(0)
    meter = CommunicationMeter()
    quiet_trainer(max_steps=2, callbacks=[MagnitudePruning(rate=0.8), meter]).fit(simulation())
    assert meter.uploads == 6
    params = sum(p.numel() for p in small_cnn().parameters())
    assert meter.total_dense_bytes == 6 * params * 4
    assert 0.15 < meter.upload_ratio < 0.4  # 20% of values plus bitmaps/indices


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_clients": 0}, "num_clients"),
        ({"clients_per_round": 7}, "clients_per_round"),
        ({"local_batch_size": 0}, "local_batch_size"),
        ({"local_steps": 2}, "fedavg"),
        ({"algorithm": "fedprox"}, "algorithm"),
        ({"partition": "zipf"}, "partition"),
        ({"dirichlet_alpha": 0.0}, "dirichlet_alpha"),
        ({"server_lr": -1.0}, "server_lr"),
        ({"weighting": "loss"}, "weighting"),
    ],
)
def test_bad_arguments_are_rejected_with_the_argument_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulation(**kwargs)


def test_data_must_be_given_to_the_simulation_not_to_fit():
    with pytest.raises(ValueError, match="needs data"):
        quiet_trainer(max_steps=1).fit(simulation(datamodule=None))
    with pytest.raises(ValueError, match=r"not to Trainer.fit"):
        quiet_trainer(max_steps=1).fit(simulation(), datamodule=RandomImages())


def test_label_skew_partition_reaches_the_clients():
    L.seed_everything(0)
    sim = simulation(partition="shards", shards_per_client=1)
    quiet_trainer(max_steps=1).fit(sim)
    labels = sim.source_datamodule.train_dataset.targets
    classes_per_client = [len(labels[idx].unique()) for idx in sim.client_indices]
    assert max(classes_per_client) <= 2  # one label-sorted shard spans at most a class boundary


def test_wrapped_lightning_module_provides_the_server_optimizer_and_loss(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_gp.models import ImageClassifier

    L.seed_everything(0)
    classifier = ImageClassifier(small_cnn(), optimizer="adam", lr=0.01)
    sim = simulation(module=classifier)
    assert sim.loss_fn is classifier.loss_fn
    trainer = quiet_trainer(
        max_steps=3,
        callbacks=[MagnitudePruning(rate=0.5), CommunicationMeter()],
        logger=CSVLogger(tmp_path, name="run"),
        log_every_n_steps=1,
        val_check_interval=3,
        check_val_every_n_epoch=None,
    )
    trainer.fit(sim)
    assert isinstance(trainer.optimizers[0], torch.optim.Adam)
    metrics = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    assert {"train_loss", "comm/upload_bytes", "comm/upload_ratio", "val_acc"} <= set(header)


def test_download_bytes_are_the_encoded_aggregate_for_every_participant():
    from lightning_gp.callbacks import encoded_nbytes

    L.seed_everything(0)
    sim = simulation()  # SGD at lr 1: the server update is exactly the aggregate
    start = {n: p.detach().clone() for n, p in sim.module.named_parameters()}
    meter = CommunicationMeter()
    quiet_trainer(max_steps=1, callbacks=[MagnitudePruning(rate=0.8), meter]).fit(sim)
    aggregate = {n: start[n] - p.detach() for n, p in sim.module.named_parameters()}
    assert meter.total_download_bytes == 3 * sum(encoded_nbytes(a) for a in aggregate.values())
    assert meter.upload_ratio < meter.download_ratio <= 1.0  # the union of supports is denser than one upload
