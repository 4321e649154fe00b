"""The threat models of the gradient-inversion SoK as the audit's vocabulary: what the server knows
and what it may change (Carletti et al., "SoK: Gradient Inversion Attacks in Federated Learning",
USENIX Security 2025, the threat-model table).

Each of the SoK's eight classes grants a set of capabilities (:data:`CAPABILITIES`); each attack
declares the capabilities it uses (``GradientAttack.requires``), and its class is the first of
``A .. H`` that grants them all (:func:`threat_class_of`). The audit's two views map onto them: the
passive server is any of ``A .. E`` (it only reads updates), the active one ``F .. H`` (it changes
the model it sends). A threat model forbids the attacks that need more than it grants
(:meth:`SoKThreatModel.allows`, ``audit_setting(threat_model="C")``), so a verdict can be read
against the SoK's and LeakPro's tables.

The attack-to-class assignments follow the SoK's attack table where it lists the attack (DLG and
iDLG: A; Inverting Gradients, R-GAP, Cocktail Party: B; the FedAvg attack of Dimitrov et al.: C;
generative priors: D; GradInversion: E; Robbing the Fed: G) and, for this package's own attacks,
what the attack's code reads: a defense-aware attack knows the defense's configuration (a training
detail), the learned inverter trains on public data (surrogate data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: What a server may hold or do, in the SoK's order: the client's model update; basic knowledge of
#: the task (architecture, loss, the data's shape and range); the training details (hyperparameters,
#: local epochs and batches, the defense's configuration); surrogate (public) data of the task; the
#: statistics of the clients' data distribution; active manipulation of the model it sends; and the
#: choice of which clients take part in a round.
CAPABILITIES = (
    "model_updates",
    "basic_knowledge",
    "training_details",
    "surrogate_data",
    "data_distribution",
    "active_manipulation",
    "client_selection",
)


@dataclass(frozen=True)
class SoKThreatModel:
    """One threat model of the SoK: its letter, its name and the capabilities it grants."""

    id: str
    name: str
    grants: frozenset[str]

    @property
    def active(self) -> bool:
        """Whether the server may change the model it sends (the audit's active view)."""
        return "active_manipulation" in self.grants

    def allows(self, requires: frozenset[str]) -> bool:
        """Whether an attack needing ``requires`` is within this threat model."""
        return requires <= self.grants

    def describe(self) -> str:
        return f"{self.id} ({self.name})"


def _model(letter: str, name: str, *grants: str) -> SoKThreatModel:
    unknown = set(grants) - set(CAPABILITIES)
    assert not unknown, unknown  # a typo in the table below
    return SoKThreatModel(letter, name, frozenset(("model_updates", *grants)))


_BASIC, _TRAINING, _SURROGATE = "basic_knowledge", "training_details", "surrogate_data"

#: The SoK's threat models, ``A`` (weakest) to ``H``, by letter.
SOK_THREAT_MODELS: dict[str, SoKThreatModel] = {
    m.id: m
    for m in (
        _model("A", "Eavesdropper"),
        _model("B", "Informed Eavesdropper", _BASIC),
        _model("C", "Parameter-Aware Eavesdropper", _BASIC, _TRAINING),
        _model("D", "Data-Enhanced Eavesdropper", _BASIC, _TRAINING, _SURROGATE),
        _model("E", "Statistical-Informed Eavesdropper", _BASIC, _TRAINING, _SURROGATE, "data_distribution"),
        _model("F", "Active Manipulator", _BASIC, _TRAINING, "active_manipulation"),
        _model("G", "Data-Enhanced Manipulator", _BASIC, _TRAINING, _SURROGATE, "active_manipulation"),
        _model(
            "H", "Active Client Manipulator", _BASIC, _TRAINING, _SURROGATE, "active_manipulation", "client_selection"
        ),
    )
}


def requirements(*capabilities: str) -> frozenset[str]:
    """The capabilities an attack declares (``model_updates`` always included), checked by name."""
    unknown = sorted(set(capabilities) - set(CAPABILITIES))
    if unknown:
        raise ValueError(f"unknown capabilities {unknown}; the SoK's are {list(CAPABILITIES)}")
    return frozenset(("model_updates", *capabilities))


def threat_model(threat: str | SoKThreatModel) -> SoKThreatModel:
    """The SoK threat model named by its letter (``"C"``) or given; anything else is an error listing them."""
    if isinstance(threat, SoKThreatModel):
        return threat
    found = SOK_THREAT_MODELS.get(threat) if isinstance(threat, str) else None
    if found is None:
        choices = ", ".join(m.describe() for m in SOK_THREAT_MODELS.values())
        raise ValueError(f"threat_model must be one of the SoK's threat models {choices}; got {threat!r}")
    return found


def attack_requirements(attack: Any) -> frozenset[str]:
    """The capabilities ``attack`` (an instance or a class) declares it uses."""
    requires = getattr(attack, "requires", None)
    if not isinstance(requires, frozenset):
        raise TypeError(f"{type(attack).__name__} declares no capabilities (a frozenset 'requires')")
    return requires


def threat_class_of(attack: Any) -> SoKThreatModel:
    """The weakest SoK threat model under which ``attack`` runs: the first of ``A .. H`` granting
    every capability it declares."""
    requires = attack_requirements(attack)
    for model in SOK_THREAT_MODELS.values():
        if model.allows(requires):
            return model
    raise ValueError(f"no SoK threat model grants {sorted(requires)}")
