"""Two cost controls of ``AttackBudget``. ``stop_when_all_leak=True``: a client whose images all leak to
a passive attack is attacked no further, and once that holds for every client no further attack runs;
the verdicts and leak fractions are those of the full audit. ``learned_min_batch``: the learned
inverter runs only on clients that large."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_gp.attacks import IDLG, InvertingGradients, Reconstruction, ServerView
from lightning_gp.audit import AttackBudget, AttackSpec, DefenseSetting, audit_setting, published_attacks
from lightning_gp.callbacks import GaussianNoise
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")


def silent(line: str) -> None:
    pass


def audit(budget: AttackBudget, setting: DefenseSetting | None = None):
    data = FashionMNISTSampleDataModule(batch_size=500)
    L.seed_everything(0, verbose=False)
    return audit_setting(
        setting or DefenseSetting("undefended", []),
        LeNetZhu(),
        data,
        indices=[[0], [1]],
        published=published_attacks(budget, ["iDLG", "IG", "RtF"]),
        budget=budget,
        num_clients=2,
        seed=0,
        log=silent,
        adaptive=False,
    )


def test_an_audit_stops_once_every_image_leaks_with_the_full_audits_verdicts() -> None:
    """iDLG recovers both undefended one-image clients exactly (its L-BFGS converges to the
    tolerance), so IG and Robbing the Fed are not run; both verdicts and both leak fractions are the
    full audit's (every image leaks in both)."""
    budget = AttackBudget(ig_iterations=5, lbfgs_iterations=60, rtf_bins=4)
    full = audit(budget)
    stopped = audit(AttackBudget(ig_iterations=5, lbfgs_iterations=60, rtf_bins=4, stop_when_all_leak=True))
    assert full.passive is not None and full.passive.leak_fraction == 1.0  # the premise: iDLG leaks both
    assert [c.attack for c in full.cells] == ["iDLG", "IG", "RtF"] and full.skipped == []
    assert [c.attack for c in stopped.cells] == ["iDLG"]
    assert stopped.skipped == ["IG", "RtF"]
    for threat in ("passive", "active"):
        a, b = getattr(full, threat), getattr(stopped, threat)
        assert (a.verdict, a.leak_fraction) == (b.verdict, b.leak_fraction) == ("leaks", 1.0)


def test_an_audit_where_an_image_survives_runs_every_attack() -> None:
    """Under Gaussian noise of scale 10 no passive attack recovers an image, so nothing is skipped."""
    noise = DefenseSetting("noise", [GaussianNoise(scale=10.0, seed=0)])
    stopped = audit(AttackBudget(ig_iterations=2, lbfgs_iterations=2, rtf_bins=4, stop_when_all_leak=True), noise)
    assert stopped.passive is not None and stopped.passive.leak_fraction < 1.0
    assert [c.attack for c in stopped.cells] == ["iDLG", "IG", "RtF"] and stopped.skipped == []


def test_stop_when_all_leak_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="stop_when_all_leak"):
        AttackBudget(stop_when_all_leak="yes")  # type: ignore[arg-type]


def test_the_learned_inverter_is_not_run_below_its_minimum_batch() -> None:
    """``learned_min_batch=2`` on one-image clients: no learned cell (and nothing trained)."""
    data = FashionMNISTSampleDataModule(batch_size=500)
    L.seed_everything(0, verbose=False)
    budget = AttackBudget(ig_iterations=2, lbfgs_iterations=2, learned_inversion=True, learned_min_batch=2)
    result = audit_setting(
        DefenseSetting("noise", [GaussianNoise(scale=0.01, seed=0)]),
        LeNetZhu(),
        data,
        indices=[[0]],
        published=published_attacks(budget, ["iDLG"]),
        budget=budget,
        num_clients=2,
        seed=0,
        log=silent,
    )
    names = [c.attack for c in result.cells]
    assert "iDLG" in names and not any("Learned" in n for n in names)
    with pytest.raises(ValueError, match="learned_min_batch"):
        AttackBudget(learned_min_batch=0)


# 11 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_a_client_whose_images_leaked_is_attacked_no_further() -> None:
    """iDLG recovers client 0 exactly and is made to fail on client 1 (NaN images); the next attack
    then runs on client 1 only, its cell says so, and the verdicts and leak fractions are the full
    audit's."""

    class NaNOnSecondClient(IDLG):
        calls = 0

        def reconstruct(self, view: ServerView) -> Reconstruction:
            result = super().reconstruct(view)
            NaNOnSecondClient.calls += 1
            if NaNOnSecondClient.calls % 2 == 0:
                result.images = torch.full_like(result.images, float("nan"))
            return result

    class CountingIG(InvertingGradients):
        calls = 0

        def reconstruct(self, view: ServerView) -> Reconstruction:
            CountingIG.calls += 1
            return super().reconstruct(view)

    published = [
        AttackSpec("iDLG", "published", lambda seed, model: NaNOnSecondClient(iterations=60, seed=seed)),
        AttackSpec("IG", "published", lambda seed, model: CountingIG(iterations=2, seed=seed)),
    ]

    def run(stop: bool):
        data = FashionMNISTSampleDataModule(batch_size=500)
        L.seed_everything(0, verbose=False)
        budget = AttackBudget(ig_iterations=2, lbfgs_iterations=60, stop_when_all_leak=stop)
        return audit_setting(
            DefenseSetting("undefended", []),
            LeNetZhu(),
            data,
            indices=[[0], [1]],
            published=published,
            budget=budget,
            num_clients=2,
            seed=0,
            log=silent,
        )

    full = run(False)
    assert CountingIG.calls == 2
    assert [row.leaks for row in full.passive.rows] == [True, False]  # the premise
    CountingIG.calls = 0
    stopped = run(True)
    assert CountingIG.calls == 1  # client 1 only
    assert stopped.partial == {"IG": 1} and stopped.skipped == []
    assert "run on 1 of 2 clients" in stopped.cell("IG").note and stopped.cell("IG").status == "ok"
    for threat in ("passive", "active"):
        a, b = getattr(full, threat), getattr(stopped, threat)
        assert (a.verdict, a.leak_fraction) == (b.verdict, b.leak_fraction)
        assert [r.leaks for r in a.rows] == [r.leaks for r in b.rows]


# 10 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_the_attacker_who_knows_the_defense_goes_first_and_spares_the_published_attacks() -> None:
    """Top-k 20%: the support-matching L-BFGS recovers a one-image client (it matches only the
    entries the client sent, so the client's image is at objective zero). With ``stop_when_all_leak``
    the adaptive attacks run before the published ones, which are then skipped; without it the
    published ones run first (``test_an_audit_stops_once_every_image_leaks_with_the_full_audits_verdicts``
    shows the verdicts of a stopped audit are the full one's)."""
    from lightning_gp.callbacks import TopKPruning

    data = FashionMNISTSampleDataModule(batch_size=500)
    L.seed_everything(0, verbose=False)
    budget = AttackBudget(ig_iterations=2, lbfgs_iterations=20, rtf_bins=4, stop_when_all_leak=True)
    stopped = audit_setting(
        DefenseSetting("top-k", [TopKPruning(rate=0.8)]),
        LeNetZhu(),
        data,
        indices=[[0]],
        published=published_attacks(budget, ["iDLG", "IG"]),
        budget=budget,
        num_clients=2,
        seed=0,
        log=silent,
    )
    assert [c.attack for c in stopped.cells] == ["adaptive:DefenseAwareInversion", "adaptive:DefenseAwareIDLG"]
    assert stopped.cells[-1].leak_fraction == 1.0 and stopped.skipped == ["iDLG", "IG"]
    for threat in ("passive", "active"):
        report = getattr(stopped, threat)
        assert (report.verdict, report.leak_fraction) == ("leaks", 1.0)


@pytest.mark.parametrize("disagree", [True, False])
def test_where_the_label_estimates_differ_each_passive_attack_also_runs_on_dummy_input_labels(
    monkeypatch: pytest.MonkeyPatch, disagree: bool
) -> None:
    """The public-image label counts beat the dummy-input ones on average, not on every batch, so
    where the two differ the audit keeps both attacks: each passive attack that recovers labels runs
    again on the dummy-input counts, in its own cell the worst case takes; the active attack (its
    own model, no label recovery) does not. Where they agree nothing runs twice. (Whether the two
    estimates differ is label_estimates_differ's, tested on real views in test_attacks.)"""
    import lightning_gp.audit.setting_audit as setting_audit

    monkeypatch.setattr(setting_audit, "_label_estimates_differ", lambda record, campaign: disagree)
    budget = AttackBudget(ig_iterations=2, lbfgs_iterations=2, rtf_bins=4)
    data = FashionMNISTSampleDataModule(batch_size=500)
    L.seed_everything(0, verbose=False)
    result = audit_setting(
        DefenseSetting("Gaussian noise", [GaussianNoise(scale=0.01, seed=0)]),
        LeNetZhu(),
        data,
        indices=[[0, 1], [2, 3]],
        published=published_attacks(budget, ["iDLG", "RtF"]),
        budget=budget,
        num_clients=2,
        seed=0,
        log=silent,
        adaptive=False,
    )
    names = [cell.attack for cell in result.cells]
    doubled = ["iDLG", f"iDLG{setting_audit.DUMMY_LABELS_SUFFIX}", "RtF"]
    assert names == (doubled if disagree else ["iDLG", "RtF"])
    assert (f"iDLG{setting_audit.DUMMY_LABELS_SUFFIX}" in result.results) == disagree
