"""Choosing what the audit attacks: explicit training-set indices or per-client positions.

The chosen images become the attacked clients' batches in the audited round of a real FedSGD
simulation, so the tapped gradient is the defended gradient of exactly those images.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from lightning_gp import defenses
from lightning_gp.audit import tap_fedsgd_round
from lightning_gp.callbacks import MagnitudePruning
from lightning_gp.cli import main as cli_main
from lightning_gp.federated.partition import partition
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")

INDICES = [[12, 7], [301, 5]]


def seeded_lenet(seed: int = 0) -> LeNetZhu:
    torch.manual_seed(seed)
    return LeNetZhu()


def images_of(data, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    items = [data.train_dataset[i] for i in indices]
    return torch.stack([x for x, _ in items]), torch.stack([torch.as_tensor(y) for _, y in items])


def direct_gradient(record, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mean cross-entropy gradient of ``images`` at the weights the record was computed at."""
    model = LeNetZhu()
    model.load_state_dict(record.model_state)
    model.zero_grad()
    nn.functional.cross_entropy(model(images), labels).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def assert_same_gradients(tapped: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert tapped.keys() == expected.keys()
    for name, g in tapped.items():
        scale = float(expected[name].abs().max())
        # float32 sums in another order (vmap over clients vs one autograd pass): a few ulps of the scale
        torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-6 * scale, msg=name)


@pytest.fixture(scope="module")
def pruned(data):
    return tap_fedsgd_round(
        seeded_lenet(0), data, defenses=[MagnitudePruning(rate=0.8)], indices=INDICES, num_clients=4
    )


def test_each_attacked_batch_holds_exactly_the_requested_images(data, pruned) -> None:
    records, _, _ = pruned
    assert [r.client_id for r in records] == [0, 1]  # clients default to one per list
    for record, indices in zip(records, INDICES):
        images, labels = images_of(data, indices)
        assert torch.equal(record.inputs, images) and torch.equal(record.targets, labels)
        assert record.meta["dataset_indices"] == indices and record.meta["local_batch_size"] == 2


def test_the_gradient_is_the_defended_gradient_of_exactly_those_images(data, pruned) -> None:
    records, _, _ = pruned
    transform = defenses.MagnitudePruning(0.8)  # round 0: no error-feedback residual yet
    for record, indices in zip(records, INDICES):
        raw = direct_gradient(record, *images_of(data, indices))
        expected = transform(raw, client_id=record.client_id)
        assert_same_gradients(record.gradients, expected)
        for name, g in record.gradients.items():  # and the defense did act: 80% of each layer is zero
            assert int((g == 0).sum()) == int(0.8 * g.numel() + 0.5), name


def test_a_later_round_keeps_the_earlier_rounds_and_replaces_only_the_chosen_batch(data) -> None:
    plain, _, _ = tap_fedsgd_round(seeded_lenet(1), data, round=1, clients=[2], num_clients=4)
    chosen, _, _ = tap_fedsgd_round(seeded_lenet(1), data, round=1, clients=[2], num_clients=4, indices=[[40]])
    for name, value in plain[0].model_state.items():  # round 0 ran on the sampler's batches in both runs
        assert torch.equal(chosen[0].model_state[name], value), name
    assert plain[0].meta["dataset_indices"] != [40]
    images, labels = images_of(data, [40])
    assert torch.equal(chosen[0].inputs, images)
    assert_same_gradients(chosen[0].gradients, direct_gradient(chosen[0], images, labels))


def test_positions_pick_from_the_clients_own_partition(data) -> None:
    records, _, _ = tap_fedsgd_round(
        seeded_lenet(0), data, clients=[3], positions=torch.tensor([[0, 5, 2]]), num_clients=4, seed=7
    )
    owned = partition("iid", 4, num_samples=len(data.train_dataset), seed=7)[3]
    expected = owned[[0, 5, 2]].tolist()
    assert records[0].meta["dataset_indices"] == expected
    assert torch.equal(records[0].inputs, images_of(data, expected)[0])


def test_numpy_indices_are_accepted(data) -> None:
    records, _, _ = tap_fedsgd_round(seeded_lenet(0), data, indices=np.array([[9]]), clients=[1], num_clients=2)
    assert records[0].client_id == 1 and records[0].meta["dataset_indices"] == [9]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"indices": [[12, 3000]]}, ValueError, r"indices\[0\]\[1\] must be an int in \[0, 2999\], got 3000"),
        ({"indices": [[-1]]}, ValueError, r"indices\[0\]\[0\] must be an int in \[0, 2999\], got -1"),
        ({"indices": [[1.5]]}, ValueError, r"indices\[0\]\[0\] must be an int .* got 1.5"),
        ({"indices": [[True]]}, ValueError, r"indices\[0\]\[0\] must be an int"),
        ({"indices": [12, 7]}, ValueError, r"indices must be one list per attacked client .*indices\[0\] is 12"),
        ({"indices": []}, ValueError, r"indices must hold at least one list"),
        ({"indices": [[1], []]}, ValueError, r"indices\[1\] is empty"),
        ({"indices": [[1, 2], [3]]}, ValueError, r"every list in indices must have the same length .*\[2, 1\]"),
        ({"indices": [[1], [2]], "clients": [0]}, ValueError, r"indices needs one list per attacked client"),
        ({"indices": [[1, 2]], "local_batch_size": 1}, ValueError, r"local_batch_size=1 disagrees .* in indices"),
        ({"indices": [[1]], "clients": [9]}, ValueError, r"clients must be ids in \[0, 4\)"),
        ({"indices": [[1]], "positions": [[1]]}, ValueError, r"pass indices .* or positions .* not both"),
        ({"positions": [[0, 750]], "clients": [1]}, ValueError, r"positions \[750\] are outside client 1's partition"),
        ({"positions": [[0], [1]], "clients": [1, 1]}, ValueError, r"clients must be distinct"),
    ],
)
def test_bad_choices_are_errors_naming_the_argument(data, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        tap_fedsgd_round(seeded_lenet(0), data, num_clients=4, **kwargs)


def test_attack_command_attacks_the_chosen_images(tmp_path, monkeypatch, data) -> None:
    config = tmp_path / "attack.yaml"
    config.write_text(
        "model: {class_path: lightning_gp.models.LeNetZhu}\n"
        "data: {class_path: lightning_gp.data.FashionMNISTSampleDataModule}\n"
        "attack: {class_path: lightning_gp.attacks.InvertingGradients, init_args: {iterations: 2}}\n"
        "defenses: [{class_path: lightning_gp.callbacks.MagnitudePruning, init_args: {rate: 0.8}}]\n"
        "clients: [2, 3]\n"
        "num_clients: 4\n"
        "indices: [[12], [301]]\n"
        "lpips: false\n"
        f"output_dir: {tmp_path / 'out'}\n"
    )
    monkeypatch.chdir(tmp_path)
    cli_main(["attack", "--config", str(config)])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(c["client_id"], c["dataset_indices"]) for c in report["clients"]] == [(2, [12]), (3, [301])]
    assert "client 3, round 0, training images [301]" in (tmp_path / "out" / "report.md").read_text()
