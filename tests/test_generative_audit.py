"""The generative prior in the audit (AttackBudget(generative_prior=True)): built with the setting's
defense knowledge, named as SoK class D, and a gap, never "private", where asked for and not run."""

from __future__ import annotations

import lightning as L

from lightning_gp.audit import AttackBudget, DefenseSetting, audit_setting, published_attacks
from lightning_gp.audit.setting_audit import GENERATIVE_NOT_RUN
from lightning_gp.callbacks import GaussianNoise
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.models import LeNetZhu

BUDGET = AttackBudget(ig_iterations=3, lbfgs_iterations=2, generative_prior=True, generative_max_steps=30)


def audit(*, adaptive: bool, scale: float = 0.01):
    L.seed_everything(0, verbose=False)
    return audit_setting(
        DefenseSetting("noise", [GaussianNoise(scale=scale, seed=0)]),
        LeNetZhu(),
        FashionMNISTSampleDataModule(batch_size=500),
        indices=[[0]],
        published=published_attacks(BUDGET, ["iDLG"]),
        budget=BUDGET,
        num_clients=2,
        seed=0,
        log=lambda line: None,
        adaptive=adaptive,
    )


def test_the_generative_prior_runs_with_the_setting_s_knowledge_as_class_d() -> None:
    cell = audit(adaptive=True).cell("adaptive:GenerativeGradientLeakage")
    assert cell.status == "ok", cell.note
    assert cell.kind == "adaptive" and cell.sok_class == "D"
    assert cell.means.get("psnr") is not None


def test_a_generative_prior_asked_for_and_not_run_is_a_gap_never_private() -> None:
    result = audit(adaptive=False, scale=10.0)  # noise that hides the image from iDLG: no leak decides
    assert all(c.attack != "adaptive:GenerativeGradientLeakage" for c in result.cells)
    gap = GENERATIVE_NOT_RUN.format("adaptive=False")
    for worst in (result.passive, result.active):
        assert worst is not None and worst.verdict == "inconclusive"
        assert any(reason.startswith(gap) for reason in worst.verdict_reasons), worst.verdict_reasons
