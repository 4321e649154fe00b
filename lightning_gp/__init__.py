"""lightning-gp: gradient-privacy defenses, attacks and audits for PyTorch Lightning.

The names a user starts with are here::

    from lightning_gp import DualGradientPruning, GradientTap, PrivacyAudit, ImageClassifier

Everything else lives in its subpackage (docs/architecture.md): ``defenses`` (pure gradient
transforms), ``callbacks`` (the Lightning adapters), ``pipeline`` (the engine between ``.grad`` and
the wire), ``federated`` (partitions and the FedSGD/FedAvg simulation), ``attacks``, ``metrics``,
``audit`` (catalogue to verdict), ``models``, ``data``, ``refiner``, ``priprune``, ``flower``.
The names below load their subpackage on first use, so ``import lightning_gp.defenses`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: name -> the subpackage that defines it
_FACE = {
    "GradientDefense": "lightning_gp.callbacks",
    "DualGradientPruning": "lightning_gp.callbacks",
    "AlignedDualGradientPruning": "lightning_gp.callbacks",
    "OptimalGradientNoise": "lightning_gp.callbacks",
    "DPSGD": "lightning_gp.callbacks",
    "GradientTap": "lightning_gp.callbacks",
    "CommunicationMeter": "lightning_gp.callbacks",
    "PrivacyAudit": "lightning_gp.audit",
    "FederatedSimulation": "lightning_gp.federated",
    "ImageClassifier": "lightning_gp.models",
}

__all__ = [
    "DPSGD",
    "AlignedDualGradientPruning",
    "CommunicationMeter",
    "DualGradientPruning",
    "FederatedSimulation",
    "GradientDefense",
    "GradientTap",
    "ImageClassifier",
    "OptimalGradientNoise",
    "PrivacyAudit",
]

if TYPE_CHECKING:
    from lightning_gp.audit import PrivacyAudit
    from lightning_gp.callbacks import (
        DPSGD,
        AlignedDualGradientPruning,
        CommunicationMeter,
        DualGradientPruning,
        GradientDefense,
        GradientTap,
        OptimalGradientNoise,
    )
    from lightning_gp.federated import FederatedSimulation
    from lightning_gp.models import ImageClassifier


def __getattr__(name: str) -> Any:
    if name in _FACE:
        return getattr(importlib.import_module(_FACE[name]), name)
    raise AttributeError(f"module 'lightning_gp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_FACE])
