"""lightning-gp: gradient-privacy defenses, attacks and audits for PyTorch Lightning.

Subpackages (see DESIGN.md): ``defenses`` (pure gradient transforms), ``callbacks`` (the Lightning
adapters), ``federated`` (partitions and the FedSGD/FedAvg simulation), ``models``, ``data``,
``attacks`` and ``metrics``.
"""

__version__ = "0.1.0"
