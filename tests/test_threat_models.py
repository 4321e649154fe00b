"""The SoK's threat models (Carletti et al., USENIX Security 2025) as the audit's vocabulary: each
attack's class, the audit's cells naming it, and a threat model that forbids what it does not grant."""

from __future__ import annotations

import lightning as L
import pytest

import lightning_gp.attacks as attacks
from lightning_gp.attacks import SOK_THREAT_MODELS, GradientAttack, threat_class_of
from lightning_gp.attacks.registry import attacks_by_name
from lightning_gp.attacks.threat_models import requirements, threat_model
from lightning_gp.audit import AttackBudget, DefenseSetting, audit_setting, published_attacks
from lightning_gp.callbacks import GaussianNoise
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.models import LeNetZhu

TINY = AttackBudget(ig_iterations=2, lbfgs_iterations=2, rtf_bins=4, adaptive_restarts=1, lbfgs_restarts=1)


def attack_classes() -> list[type]:
    """Every concrete attack class the package exports."""
    return [
        value
        for value in vars(attacks).values()
        if isinstance(value, type) and issubclass(value, GradientAttack) and value is not GradientAttack
    ]


@pytest.mark.parametrize(
    ("name", "letter"),
    [("DLG", "A"), ("iDLG", "A"), ("IG", "B"), ("GradInversion", "E"), ("R-GAP", "B"), ("RtF", "G")],
)
def test_each_published_attack_takes_the_class_the_sok_s_attack_table_gives_it(name: str, letter: str) -> None:
    (published,) = attacks_by_name([name])
    assert threat_class_of(published.attack_type).id == letter


def test_the_package_s_own_attacks_take_the_class_of_what_they_read() -> None:
    assert threat_class_of(attacks.FedAvgInversion).id == "C"  # the client's local training
    assert threat_class_of(attacks.DefenseAwareIDLG).id == "C"  # the defense's configuration
    assert threat_class_of(attacks.NoiseAwareMAP).id == "C"
    assert threat_class_of(attacks.LearnedInversion).id == "D"  # trained on public data
    assert threat_class_of(attacks.RefinedLearnedInversion).id == "D"


def test_an_attack_is_active_exactly_when_its_class_grants_active_manipulation() -> None:
    for cls in attack_classes():
        modifies = callable(getattr(cls, "modify_model", None))
        assert threat_class_of(cls).active == modifies, cls.__name__


def test_the_classes_nest_as_the_sok_s_table_says() -> None:
    a, b, c, d, e, f, g, h = (SOK_THREAT_MODELS[x].grants for x in "ABCDEFGH")
    assert a < b < c < d < e and c < f < g < h and d < g
    assert not (e <= h) and not (f <= e)  # the data distribution and active manipulation are apart


def test_bad_names_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"unknown capabilities \['model_weights'\]"):
        requirements("model_weights")
    with pytest.raises(ValueError, match=r"threat_model must be one of the SoK's threat models A \(Eavesdropper\)"):
        threat_model("Z")


def audit(sok_class: str | None):
    data = FashionMNISTSampleDataModule(batch_size=500)
    L.seed_everything(0, verbose=False)
    return audit_setting(
        DefenseSetting("noise", [GaussianNoise(scale=0.01, seed=0)]),
        LeNetZhu(),
        data,
        indices=[[0]],
        published=published_attacks(TINY, ["iDLG", "IG", "RtF"]),
        budget=TINY,
        num_clients=2,
        seed=0,
        log=lambda line: None,
        sok_class=sok_class,
    )


def test_a_threat_model_forbids_the_attacks_that_need_more_than_it_grants() -> None:
    """Under the SoK's Informed Eavesdropper (B) the audit runs iDLG (A) and IG (B) only: the adaptive
    attacks (C: they know the defense) and Robbing the Fed (G: a modified model) are forbidden, named,
    and the audit has no active verdict; unrestricted, every cell names its class."""
    everything = audit(None)
    classes = {c.attack: c.sok_class for c in everything.cells}
    assert classes["iDLG"] == "A" and classes["IG"] == "B" and classes["RtF"] == "G"
    assert any(letter == "C" for name, letter in classes.items() if name.startswith("adaptive:"))
    assert everything.active is not None and everything.forbidden == [] and everything.sok_class is None

    informed = audit("B")
    assert {c.attack for c in informed.cells} <= {"iDLG", "IG", "iDLG (dummy-input labels)", "IG (dummy-input labels)"}
    assert all(SOK_THREAT_MODELS[c.sok_class].grants <= SOK_THREAT_MODELS["B"].grants for c in informed.cells)
    assert any(reason.startswith("RtF needs SoK threat model G") for reason in informed.forbidden)
    assert any(reason.startswith("adaptive:") and "beyond B" in reason for reason in informed.forbidden)
    assert informed.active is None and informed.sok_class == "B"
    assert informed.passive is not None


def test_an_unknown_threat_model_fails_before_any_attack() -> None:
    with pytest.raises(ValueError, match="threat_model must be one of"):
        audit("Z")
