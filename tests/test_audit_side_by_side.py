"""The audit attacks a cell's clients side by side where the attack allows it, else one by one."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch

from lightning_gp.attacks import InvertingGradients
from lightning_gp.audit import (
    AttackBudget,
    audit_setting,
    defense_catalog,
    published_attacks,
    setting_audit,
    tap_defended_round,
)
from lightning_gp.audit.engine import Scoring, attack_record, attack_records_side_by_side
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.models import LeNetZhu

TINY = AttackBudget(ig_iterations=5, lbfgs_iterations=2, rtf_bins=8)


@pytest.fixture(scope="module")
def datamodule() -> FashionMNISTSampleDataModule:
    return FashionMNISTSampleDataModule()


def _records(datamodule, clients: int = 3):
    L.seed_everything(0, verbose=False)
    setting = defense_catalog(["GaussianNoise"])[0].build(0, 1)
    records, model, _ = tap_defended_round(
        setting, LeNetZhu(), datamodule, indices=[[c] for c in range(clients)], num_clients=clients
    )
    return records, model


def _double(record):
    """The record in float64, so that the vmapped and the one-by-one paths agree to float64 rounding."""
    inputs, targets = record.batch
    return dataclasses.replace(
        record,
        gradients={n: g.double() for n, g in record.gradients.items()},
        model_state={n: t.double() if t.is_floating_point() else t for n, t in record.model_state.items()},
        batch=(inputs.double(), targets),
    )


def _options(datamodule) -> dict:
    return dict(num_classes=datamodule.num_classes, mean=datamodule.mean, std=datamodule.std)


def test_the_audit_attacks_a_cells_clients_side_by_side_where_the_attack_allows(datamodule, monkeypatch):
    calls: list[tuple[str, int, bool]] = []
    real = setting_audit.attack_records_side_by_side

    def spy(records, model, attacks, **kwargs):
        found = real(records, model, attacks, **kwargs)
        calls.append((type(attacks[0]).__name__, len(records), found is not None))
        return found

    monkeypatch.setattr(setting_audit, "attack_records_side_by_side", spy)
    L.seed_everything(0, verbose=False)
    audit = audit_setting(  # Top-k: its adaptive attacks are the two that stack (NoiseAwareMAP's: test_lockstep.py)
        defense_catalog(["TopKPruning"])[0].build(0, 1),
        LeNetZhu(),
        datamodule,
        indices=[[0], [1], [2]],
        published=published_attacks(TINY, ["iDLG", "IG"]),
        budget=TINY,
        lpips_fn=None,
        log=lambda line: None,
    )
    together = {name for name, _, shared in calls if shared}
    assert together == {"InvertingGradients", "DefenseAwareInversion", "IDLG", "DefenseAwareIDLG"}
    assert all(count == 3 for _, count, _ in calls)
    for name, mark in [
        ("IG", "batched"),
        ("adaptive:DefenseAwareInversion", "batched"),
        ("iDLG", "clients_side_by_side"),
        ("adaptive:DefenseAwareIDLG", "clients_side_by_side"),
    ]:
        cell = audit.cell(name)
        assert cell.status == "ok" and cell.leak_fraction is not None and cell.means["psnr"] is not None
        assert [bool(r.reconstruction.meta.get(mark)) for r in audit.results[name]] == [True] * 3, name


@pytest.fixture
def records64(datamodule):
    """A round's records and model in float64, the attacks drawing their starts in float64 too."""
    records, model = _records(datamodule)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield [_double(r) for r in records], model.double()
    torch.set_default_dtype(before)


def test_side_by_side_results_are_each_clients_attack_record(datamodule, records64):
    records, model = records64
    attacks = [InvertingGradients(iterations=6, seed=c) for c in range(3)]
    together = attack_records_side_by_side(
        records, model, attacks, scoring=Scoring(lpips=False), **_options(datamodule)
    )
    assert together is not None
    for result, record, attack in zip(together, records, attacks):
        alone = attack_record(record, model, attack, lpips=False, **_options(datamodule))
        assert result.record is record and result.reconstruction.meta["batched"] is True
        # the vmapped kernels sum in another order: the images agree to float64 rounding
        torch.testing.assert_close(result.reconstruction.images, alone.reconstruction.images, rtol=0, atol=1e-10)
        assert [row.psnr for row in result.report.rows] == pytest.approx([row.psnr for row in alone.report.rows])


def test_a_client_that_cannot_join_leaves_every_client_to_the_one_by_one_path(datamodule):
    records, model = _records(datamodule)
    attacks = [InvertingGradients(iterations=3, seed=c) for c in range(3)]
    one = attack_records_side_by_side(
        records[:1], model, attacks[:1], scoring=Scoring(lpips=False), **_options(datamodule)
    )
    assert one is None  # one client has nothing to share: it runs as it always did
    unscorable = [records[0], dataclasses.replace(records[1], batch=None), records[2]]
    assert (
        attack_records_side_by_side(unscorable, model, attacks, scoring=Scoring(lpips=False), **_options(datamodule))
        is None
    )
    assert (
        attack_records_side_by_side(records[:2], model, attacks, scoring=Scoring(lpips=False), **_options(datamodule))
        is None
    )
