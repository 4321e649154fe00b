"""The audit of real FedAvg rounds: a client trains local epochs over its images and shares its update."""

import pytest
import torch
from helpers import quiet_trainer

from lightning_gp.attacks import FedAvgInversion, local_sgd_update
from lightning_gp.audit import PrivacyAudit
from lightning_gp.audit.catalog import DefenseSetting
from lightning_gp.audit.rounds import local_schedule, tap_defended_round
from lightning_gp.audit.setting_audit import AttackBudget, audit_setting, published_attacks
from lightning_gp.callbacks import DPSGD
from lightning_gp.federated import FederatedSimulation
from lightning_gp.models import LeNetZhu

INDICES = [[0, 2, 4, 6]]


def _local_training(**kwargs) -> DefenseSetting:
    return DefenseSetting("undefended", [], algorithm="fedavg", **kwargs)


def test_a_fedavg_client_shares_the_update_of_its_local_epochs_over_its_own_images(data) -> None:
    torch.manual_seed(0)
    model = LeNetZhu()
    setting = _local_training(local_epochs=2, local_batch_size=2)
    records, _, _ = tap_defended_round(setting, model, data, indices=INDICES, seed=3)
    record = records[0]
    assert record.meta["local_epochs"] == 2 and record.meta["local_steps"] == 4
    assert record.meta["dataset_indices"] == INDICES[0] and record.inputs.shape[0] == 4
    expected_inputs = torch.stack([data.train_dataset[i][0] for i in INDICES[0]])
    torch.testing.assert_close(record.inputs, expected_inputs)
    # the same update from the schedule's batches by plain unrolled SGD
    batch, steps, items = local_schedule(setting, INDICES, 3)
    assert (batch, steps) == (2, 4) and sorted(items[0]) == sorted(INDICES[0] * 2)
    pairs = [data.train_dataset[i] for i in items[0]]
    xs = torch.stack([x for x, _ in pairs]).view(steps, batch, 1, 28, 28)
    ys = torch.as_tensor([int(y) for _, y in pairs]).view(steps, batch)
    reference = LeNetZhu()
    reference.load_state_dict(record.model_state)
    update = local_sgd_update(reference, torch.nn.CrossEntropyLoss(), list(zip(xs, ys)), 0.1, create_graph=False)
    for name, value in update.items():
        torch.testing.assert_close(record.gradients[name], value.detach(), rtol=1e-4, atol=1e-6)


def test_the_fedavg_audit_runs_the_fedavg_attack_and_finds_an_undefended_leak(data) -> None:
    torch.manual_seed(0)
    budget = AttackBudget(ig_iterations=300, lbfgs_iterations=100)
    audit = audit_setting(
        DefenseSetting("undefended", []),
        LeNetZhu(),
        data,
        indices=INDICES,
        published=published_attacks(budget, ["IG", "FedAvgInversion"]),
        budget=budget,
        algorithm="fedavg",
        local_epochs=2,
        local_batch_size=2,
        log=lambda _: None,
    )
    cells = {c.attack: c for c in audit.cells}
    assert cells["FedAvgInversion"].status == "ok" and cells["IG"].status == "ok"
    assert audit.verdict("passive") == "leaks" and audit.passive.leaked >= 1


def test_local_training_needs_fedavg_and_whole_local_batches(data) -> None:
    with pytest.raises(ValueError, match="need algorithm='fedavg'"):
        DefenseSetting("x", [], local_epochs=2)
    with pytest.raises(ValueError, match="local_epochs"):
        _local_training(local_epochs=0)
    with pytest.raises(ValueError, match="plain-Trainer runner"):
        DefenseSetting("dp", [DPSGD(noise_multiplier=1.0)], runner="trainer").with_client_training("fedavg", 2)
    with pytest.raises(ValueError, match="local_batch_size=3 must divide the 4 images"):
        local_schedule(_local_training(local_batch_size=3), INDICES, 0)


def test_privacy_audit_attacks_a_fedavg_run_with_the_fedavg_attack(data) -> None:
    """PrivacyAudit on a FedAvg simulation of several local steps: the attack built for FedAvg runs on
    what each audited client shared (one epoch of local steps), judged with the recognisable-image tests
    calibrated on the data."""
    torch.manual_seed(0)
    simulation = FederatedSimulation(
        LeNetZhu(),
        datamodule=data,
        algorithm="fedavg",
        num_clients=4,
        clients_per_round=4,
        local_batch_size=2,
        local_steps=2,
        server_lr=1.0,
        seed=0,
    )
    audit = PrivacyAudit(
        rounds=[0],
        attacks=[FedAvgInversion(iterations=5)],
        adaptive=False,
        lpips=False,
        save_images=False,
        labels_known=True,
    )
    quiet_trainer(max_steps=1, callbacks=[audit]).fit(simulation)
    (result,) = audit.results
    assert [r.reconstruction.attack for r in result.attacks] == ["FedAvgInversion"] and not result.skipped
    assert result.attacks[0].view.meta["local_steps"] == 2 and result.attacks[0].report.batch_size == 4
    # judged with the tests calibrated on the data's public split: every image has its identification p-value
    assert len(result.worst.rows) == 4 and all(r.values["identification"] is not None for r in result.worst.rows)
