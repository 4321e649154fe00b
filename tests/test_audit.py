"""The privacy audit: tap a real FedSGD round (through the defenses), attack it, score it.

Real FederatedSimulation rounds on the bundled Fashion-MNIST sample, seeded models, real attacks.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lightning_gp.attacks import IDLG, Reconstruction, RobbingTheFed
from lightning_gp.audit import AttackResult, attack_record, mean_scores, tap_fedsgd_round
from lightning_gp.callbacks import MagnitudePruning
from lightning_gp.metrics import reconstruction_report
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")


def seeded_lenet(seed: int = 0) -> LeNetZhu:
    torch.manual_seed(seed)
    return LeNetZhu()


@pytest.fixture(scope="module")
def undefended(data):
    model = seeded_lenet(0)
    initial = copy.deepcopy(model.state_dict())
    records, sent, secrets = tap_fedsgd_round(model, data, clients=[0, 1], num_clients=4)
    return records, sent, secrets, initial


@pytest.fixture(scope="module")
def pruned(data):
    records, sent, secrets = tap_fedsgd_round(
        seeded_lenet(0), data, defenses=[MagnitudePruning(rate=0.8)], clients=[0, 1], num_clients=4
    )
    return records, sent, secrets


def test_tap_returns_one_record_per_client_at_the_round_0_weights(undefended) -> None:
    records, _, secrets, initial = undefended
    assert secrets == {}
    assert [r.client_id for r in records] == [0, 1]
    for record in records:
        assert record.round == 0
        assert record.inputs.shape == (1, 1, 28, 28) and record.targets.shape == (1,)
        assert record.meta["algorithm"] == "fedsgd" and record.meta["local_batch_size"] == 1
        assert set(record.model_state) == set(initial)
        for name, value in initial.items():
            assert torch.equal(record.model_state[name], value), name
        assert set(record.gradients) == {n for n, _ in LeNetZhu().named_parameters()}
    assert not torch.equal(records[0].inputs, records[1].inputs)


def test_the_tapped_gradient_is_what_magnitude_pruning_let_out(undefended, pruned) -> None:
    full, defended = undefended[0][0], pruned[0][0]
    assert torch.equal(full.inputs, defended.inputs)  # same seed: same client batch, same model
    for name, g in defended.gradients.items():
        reference = full.gradients[name]
        kept = g != 0
        n = g.numel()
        assert int((~kept).sum()) == int(0.8 * n + 0.5), name  # exactly round(0.8 n) zeros per layer
        assert abs(float((~kept).float().mean()) - 0.8) <= 0.05, name
        assert torch.equal(g[kept], reference[kept]), name  # survivors are untouched
        assert float(reference[kept].abs().min()) >= float(reference[~kept].abs().max()), name  # the largest


@pytest.fixture(scope="module")
def idlg_results(data, undefended, pruned):
    out = {}
    for key, (records, sent, *_rest) in {"undefended": undefended, "pruned": pruned}.items():
        out[key] = attack_record(
            records[0], sent, IDLG(iterations=50), num_classes=10, mean=data.mean, std=data.std, lpips=False
        )
    return out


def test_idlg_through_the_audit_recovers_the_undefended_image(idlg_results, undefended) -> None:
    result = idlg_results["undefended"]
    record = undefended[0][0]
    assert isinstance(result, AttackResult) and result.record is record
    assert result.view.labels is None  # not granted: iDLG recovered it
    assert result.view.batch_size == 1 and result.seconds > 0
    assert result.report.batch_size == 1 and result.report.means["lpips"] is None
    assert result.report.means["psnr"] > 40
    assert result.report.label_accuracy == 1.0
    assert torch.equal(result.reconstruction.labels, record.targets)


def test_pruning_defeats_idlg_through_the_audit(idlg_results, pruned) -> None:
    result = idlg_results["pruned"]
    for name, g in pruned[0][0].gradients.items():
        assert torch.equal(result.view.gradients[name], g), name  # the attack saw the pruned gradient
    assert result.report.means["psnr"] < 20
    assert result.report.means["psnr"] < idlg_results["undefended"].report.means["psnr"] - 30


def test_attack_record_grants_labels_only_when_known(data, undefended) -> None:
    records, sent, *_ = undefended
    result = attack_record(
        records[1],
        sent,
        IDLG(iterations=1),
        num_classes=10,
        mean=data.mean,
        std=data.std,
        labels_known=True,
        lpips=False,
    )
    assert torch.equal(result.view.labels, records[1].targets)


def test_robbing_the_fed_through_the_audit(data) -> None:
    rtf = RobbingTheFed()
    records, model, secrets = tap_fedsgd_round(
        seeded_lenet(0), data, clients=[0], num_clients=4, local_batch_size=16, attack=rtf
    )
    assert "imprint" in secrets and records[0].inputs.shape == (16, 1, 28, 28)
    assert "imprint.linear0.weight" in records[0].gradients
    result = attack_record(
        records[0], model, rtf, num_classes=10, mean=data.mean, std=data.std, server_secrets=secrets, lpips=False
    )
    assert result.view.server_secrets == secrets
    assert result.reconstruction.images.shape == (16, 1, 28, 28)
    recovered = sum(row.psnr > 40 for row in result.report.rows)
    assert recovered >= 12, [round(row.psnr, 1) for row in result.report.rows]


def _result(originals: torch.Tensor, reconstructed: torch.Tensor, labels, true_labels) -> AttackResult:
    reconstruction = Reconstruction(images=reconstructed, labels=labels, attack="test")
    report = reconstruction_report(reconstruction, originals, ((0.5,), (0.5,)), true_labels=true_labels, lpips=False)
    # mean_scores reads only the reports; record and view are not needed for the arithmetic.
    return AttackResult(record=None, view=None, reconstruction=reconstruction, report=report, seconds=0.0)


def test_mean_scores_averages_per_image_rows_across_results() -> None:
    g = torch.Generator().manual_seed(0)
    originals = torch.rand(5, 1, 12, 12, generator=g) * 2 - 1
    noisy = originals + 0.2 * torch.randn(5, 1, 12, 12, generator=g)
    a = _result(originals[:2], noisy[:2], torch.tensor([3, 3]), torch.tensor([3, 4]))  # label accuracy 1/2
    b = _result(originals[2:3], noisy[2:3], None, torch.tensor([1]))  # no labels
    c = _result(originals[3:], noisy[3:], torch.tensor([7, 8]), torch.tensor([8, 7]))  # accuracy 1 (multiset)
    assert (a.report.label_accuracy, b.report.label_accuracy, c.report.label_accuracy) == (0.5, None, 1.0)

    means = mean_scores([a, b, c])
    rows = a.report.rows + b.report.rows + c.report.rows
    assert len(rows) == 5
    for metric in ("mse", "psnr", "ssim", "nmi"):
        expected = sum(getattr(r, metric) for r in rows) / 5
        assert means[metric] == pytest.approx(expected, rel=1e-6), metric
    # Per image, not the mean of the three batch means (they differ with batches of 2, 1, 2).
    batch_means = sum(r.report.means["mse"] for r in (a, b, c)) / 3
    assert abs(means["mse"] - batch_means) > 1e-6
    # PSNR from MSE on [0, 1] pixels: the pixels are x * 0.5 + 0.5, clamped.
    pixel_mse = ((noisy * 0.5 + 0.5).clamp(0, 1) - (originals * 0.5 + 0.5).clamp(0, 1)).pow(2).flatten(1).mean(1)
    assert means["psnr"] == pytest.approx(float((10 * torch.log10(1 / pixel_mse)).mean()), rel=1e-5)
    assert means["lpips"] is None  # skipped
    assert means["label_accuracy"] == pytest.approx(0.75)  # over the results that returned labels

    exact = _result(originals[:1], originals[:1].clone(), None, None)
    assert math.isinf(mean_scores([a, exact])["psnr"])
    assert mean_scores([b])["label_accuracy"] is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"round": -1}, "round must be an int >= 0"),
        ({"clients": [4], "num_clients": 4}, r"clients must be ids in \[0, 4\)"),
        ({"clients": [-1], "num_clients": 4}, "clients must be ids"),
        ({"clients": [0, 10]}, "clients must be ids"),
        ({"clients": []}, "clients must be ids"),
    ],
)
def test_tap_rejects_bad_arguments(data, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tap_fedsgd_round(seeded_lenet(0), data, **kwargs)
