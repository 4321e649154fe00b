"""The attack registries: the adaptive attack(s) of every defense and the published attacks by name.

The expectation table was written from what the registry returned before registration moved next
to each attack's definition: the move must not change which attack a defense gets.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from lightning_gp import defenses as D
from lightning_gp.attacks import (
    DLG,
    DefenseAwareIDLG,
    DefenseAwareInversion,
    DefenseKnowledge,
    InvertingGradients,
    RobbingTheFed,
    UnmodelledDefenseWarning,
    adaptive_attacks,
    adaptive_attacks_of,
    attacks_by_name,
    declaration_of,
    has_adaptive_attack,
    published_attack_names,
    register_adaptive_attack,
    register_attack,
    register_defense_knowledge,
)
from lightning_gp.attacks.registry import _DECLARATIONS
from lightning_gp.audit import AttackBudget, defense_catalog, published_attacks
from lightning_gp.models import LeNetZhu

PAIR = ("DefenseAwareInversion", "DefenseAwareIDLG")
ADAM = ("DefenseAwareInversion",)
NOISE = (*PAIR, "NoiseAwareMAP")  # the noise defenses: the pair and the noise-aware MAP

#: catalogue entry -> (the attacks' classes, the knowledge they are built on: ``describe()`` or None)
EXPECTED: dict[str, tuple[tuple[str, ...], str | None]] = {
    "undefended": ((), None),
    "TopKPruning": (PAIR, "defense='TopKPruning', support"),
    "MagnitudePruning": (PAIR, "defense='MagnitudePruning', support"),
    "RandomPruning": (PAIR, "defense='RandomPruning', support"),
    "DualGradientPruning": (PAIR, "defense='DualGradientPruning', support"),
    "AlignedDualGradientPruning": (PAIR, "defense='AlignedDualGradientPruning', support"),
    "OptimalGradientPruning": (PAIR, "defense='OptimalGradientPruning', support"),
    "OptimalGradientNoise": (NOISE, "defense='OptimalGradientNoise', support, noise_std, noise_variance"),
    "OptimalDPSGD": (NOISE, "defense='OptimalDPSGD', support, transform, noise_std, noise_variance"),
    "GaussianNoise": (NOISE, "defense='GaussianNoise', noise_std"),
    "LaplaceNoise": (NOISE, "defense='LaplaceNoise', noise_std, noise_law=laplace"),
    "LocalGaussianMechanism": (NOISE, "defense='LocalGaussianMechanism', transform, noise_std"),
    "GradientQuantization": (ADAM, "defense='GradientQuantization', transform"),
    "DPSGD": (NOISE, "defense='DPSGD', per_example_clip=1, noise_std"),
    "Soteria": (PAIR, "defense='Soteria', support"),
    "GradDefense": (NOISE, "defense='GradDefense', noise_std, coordinate_weights, view_transform"),
    "Outpost": (PAIR, "defense='Outpost', coordinate_weights, view_transform"),
    "PRECODE": (("PRECODEAwareInversion",), None),
    "ATS": (("ATSAwareInversion", "ATSAwareRobbing"), None),
    "Refiner": (("RefinerAwareInversion",), None),
    "PriPrune": (("SGI",), None),
}

#: the names ``published_attacks`` accepts, in its order: those accepted before the registry, then the attacks added since
PUBLISHED = [
    "DLG", "iDLG", "IG", "GradInversion", "R-GAP", "RtF", "FedAvgInversion", "CocktailParty", "GGL", "LOKI", "ROG"
]  # fmt: skip

#: every class with a declared adaptive attack (the 16 qualified names the registry was keyed by, and those added since)
DECLARED = sorted(
    [
        "lightning_gp.augmentation.module.ATSModule",
        "lightning_gp.callbacks.dp_sgd.DPSGD",
        "lightning_gp.callbacks.graddefense.GradDefense",
        "lightning_gp.defenses.graddefense.GradDefense",
        "lightning_gp.defenses.noise.GaussianNoise",
        "lightning_gp.defenses.noise.LaplaceNoise",
        "lightning_gp.defenses.noise.LocalGaussianMechanism",
        "lightning_gp.defenses.optimal.OptimalDPSGD",
        "lightning_gp.defenses.optimal.OptimalGradientNoise",
        "lightning_gp.defenses.optimal.OptimalGradientPruning",
        "lightning_gp.defenses.outpost.Outpost",
        "lightning_gp.defenses.quantization.GradientQuantization",
        "lightning_gp.defenses.soteria.Soteria",
        "lightning_gp.defenses.sparsification.SparsifyingDefense",
        "lightning_gp.models.precode.PRECODE",
        "lightning_gp.priprune.module.PrunedFedAvgModule",
        "lightning_gp.refiner.module.RefinerModule",
    ]
)
#: the modules that register them: each beside the attack it declares (a class defined above the
#: attacks, e.g. DPSGD or RefinerModule, registers in its own module the attack defined here)
REGISTERING_MODULES = [
    "adaptive",
    "ats_aware",
    "noise_aware",
    "perturbation_aware",
    "precode_aware",
    "refiner_aware",
    "sgi",
]


def test_the_expectation_table_covers_the_whole_catalogue():
    assert [e.name for e in defense_catalog()] == list(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_catalogue_defense_resolves_to_the_attacks_it_had(name):
    (entry,) = defense_catalog([name])
    torch.manual_seed(0)
    found = entry.build(0, 1).defenses(LeNetZhu())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmodelledDefenseWarning)  # none of them is a fallback
        attacks = adaptive_attacks_of(found, iterations=2, lbfgs_iterations=2, seed=0)
    classes, knowledge = EXPECTED[name]
    assert tuple(type(a).__name__ for a in attacks) == classes
    assert all(has_adaptive_attack(d) for d in found)
    for attack in attacks:
        built_on = getattr(attack, "knowledge", None)
        assert (None if built_on is None else built_on.describe()) == knowledge
        if built_on is not None:
            assert built_on.models == (type(found[0]).__name__,) and built_on.fallback_reason is None


def test_an_unregistered_defense_gets_the_documented_fallback():
    class Mystery:
        pass

    message = (
        "no adaptive attack is registered for Mystery: using the published Inverting Gradients, marked as a "
        "fallback (register one with lightning_gp.attacks.register_adaptive_attack)"
    )
    assert not has_adaptive_attack(Mystery())
    with pytest.warns(UnmodelledDefenseWarning) as caught:
        attacks = adaptive_attacks(Mystery(), iterations=3, lbfgs_iterations=2, restarts=2, seed=0)
    assert [str(w.message) for w in caught] == [message]
    assert [type(a) for a in attacks] == [DefenseAwareInversion, DefenseAwareIDLG]
    for attack in attacks:
        k = attack.knowledge
        assert (k.defense, k.models, k.support, k.fallback_reason) == ("Mystery", (), False, "Mystery is not modelled")
    assert (attacks[0].iterations, attacks[0].restarts) == (3, 2)
    assert (attacks[1].iterations, attacks[1].restarts) == (2, 4)
    with pytest.warns(UnmodelledDefenseWarning, match="Mystery"):
        assert [type(a) for a in adaptive_attacks_of([Mystery()], iterations=3)] == [
            DefenseAwareInversion,
            DefenseAwareIDLG,
        ]


def test_the_published_attacks_are_the_names_accepted_before_in_the_same_order():
    budget = AttackBudget(ig_iterations=7, lbfgs_iterations=3, rtf_bins=16)
    specs = published_attacks(budget)
    assert [s.name for s in specs] == PUBLISHED
    assert all(s.kind == "published" for s in specs)
    built = {s.name: s.build(0, LeNetZhu()) for s in specs}
    assert {n: type(a).__name__ for n, a in built.items()} == {
        "DLG": "DLG",
        "iDLG": "IDLG",
        "IG": "InvertingGradients",
        "GradInversion": "GradInversion",
        "R-GAP": "RGAP",
        "RtF": "RobbingTheFed",
        "FedAvgInversion": "FedAvgInversion",
        "CocktailParty": "CocktailParty",
        "GGL": "GenerativeGradientLeakage",
        "LOKI": "LOKI",
        "ROG": "ObfuscationRobustInversion",
    }
    assert (built["DLG"].iterations, built["iDLG"].iterations, built["IG"].iterations) == (3, 3, 7)
    assert (built["GradInversion"].iterations, built["GradInversion"].bn_weight) == (7, 0.0)  # LeNetZhu: no BN
    assert built["RtF"].num_bins == 16
    assert [s.name for s in published_attacks(budget, ["RtF", "DLG"])] == ["RtF", "DLG"]


def test_an_unknown_published_attack_is_an_error_listing_the_choices():
    with pytest.raises(ValueError) as err:
        published_attacks(AttackBudget(), ["IG", "Nope", "dlg"])
    assert str(err.value) == f"unknown attack(s) ['Nope', 'dlg']; published attacks: {PUBLISHED}"


# 13 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_the_registries_are_complete_once_the_defining_modules_are_imported_whatever_came_first():
    # a fresh interpreter per first import; the pure defenses' attacks are declared by the attacks
    # package itself, a class defined above it (DPSGD, RefinerModule, ...) declares its own in its module
    script = (
        "import importlib, sys\n"
        "importlib.import_module(sys.argv[1])\n"
        "import lightning_gp.attacks as A\n"
        "below = [c for c in A.declared_defenses() if c.__module__.split('.')[1] in ('defenses', 'models', 'augmentation')]\n"
        "import lightning_gp.callbacks, lightning_gp.refiner, lightning_gp.priprune\n"
        "from lightning_gp.attacks.registry import _DECLARATIONS\n"
        "print(sorted(f'{c.__module__}.{c.__qualname__}' for c in A.declared_defenses()))\n"
        "print(sorted({d.registrant.rsplit('.', 1)[0] for d in _DECLARATIONS.values()}))\n"
        "print(A.published_attack_names())\n"
        "print(sorted(f'{c.__module__}.{c.__qualname__}' for c in below))\n"
    )
    below = [n for n in DECLARED if n.split(".")[1] in ("defenses", "models", "augmentation")]
    expected = [
        str(DECLARED),
        str(["lightning_gp.attacks." + m for m in REGISTERING_MODULES]),
        str(PUBLISHED),
        str(below),
    ]
    for first in ("lightning_gp.priprune", "lightning_gp.callbacks", "lightning_gp.attacks"):
        done = subprocess.run(
            [sys.executable, "-c", script, first], capture_output=True, text=True, check=False, timeout=300
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == expected, first


def test_registering_a_second_attack_for_one_class_is_an_error_naming_both():
    class Shuffle(D.Defense):
        def transform(self, gradients, state, call):
            return dict(gradients), state

    @register_adaptive_attack(Shuffle)
    def first(defense, kwargs):
        return [InvertingGradients(**kwargs)]

    def second(defense):
        return DefenseKnowledge()

    try:
        assert declaration_of(Shuffle(seed=0)).factory is first
        with pytest.raises(ValueError) as err:
            register_defense_knowledge(Shuffle, second)
        message = str(err.value)
        assert f"{__name__}.{Shuffle.__qualname__}" in message
        assert f"{first.__module__}.{first.__qualname__}" in message
        assert f"{second.__module__}.{second.__qualname__}" in message
        assert declaration_of(Shuffle(seed=0)).factory is first  # the refused one changed nothing
        register_defense_knowledge(Shuffle, second, replace=True)
        assert declaration_of(Shuffle(seed=0)).knowledge is second
    finally:
        _DECLARATIONS.pop(Shuffle, None)
    # a packaged defense's class is taken too, by the module that defines its attack
    with pytest.raises(ValueError, match=r"lightning_gp\.attacks\.noise_aware\._gaussian"):
        register_adaptive_attack(D.GaussianNoise, first)


def test_a_defense_is_keyed_by_its_class_never_by_a_name():
    with pytest.raises(TypeError, match="the defense class itself"):
        register_adaptive_attack("lightning_gp.defenses.noise.GaussianNoise", lambda d, kw: [])
    with pytest.raises(TypeError, match="the defense class itself"):
        register_defense_knowledge(D.GaussianNoise(0.01), lambda d: DefenseKnowledge())


def test_a_published_name_is_registered_once():
    with pytest.raises(ValueError, match=r"'IG' is already lightning_gp\.attacks\.optimization\.InvertingGradients"):
        register_attack("IG", order=99, build=lambda budget, seed, model: DLG(seed=seed))(DLG)
    assert published_attack_names() == PUBLISHED
    assert [p.attack_type for p in attacks_by_name(["IG", "RtF"])] == [InvertingGradients, RobbingTheFed]
