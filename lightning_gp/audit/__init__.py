"""The privacy audit: what an attacker can still recover from what a client shares, and the verdict.

One idea per module, layered bottom-up (no module imports one above it):

- :mod:`.quiet`: the package's own short, silent Trainer runs;
- :mod:`.catalog`: the defense catalogue (:class:`DefenseSetting`, :func:`register_defense`,
  :func:`defense_catalog`) and each setting's adaptive attack (every defense of it modelled together);
- :mod:`.rounds`: tapped rounds (:func:`tap_fedsgd_round`, :func:`tap_defended_round`, the
  malicious server's model);
- :mod:`.engine`: the attack-and-score engine (:func:`attack_record`, the attacker's loss);
- :mod:`.verdict`: the one leak rule (:class:`LeakRule`), the worst case over attacks and the verdict
  ("private", "leaks", "inconclusive");
- :mod:`.advantage`: the reconstruction advantage over the prior (:func:`reconstruction_advantage`: how
  much more often the attacks identify an original than the best prior-only guess does, with its interval);
- :mod:`.setting_audit`: every attack against one setting, judged per threat model
  (:func:`audit_setting`, the engine of the matrix and the demo);
- :mod:`.training`: what a setting costs (:func:`train_setting`);
- :mod:`.summary`: which setting to pick and why (:func:`choose`: the private one with the highest
  accuracy, never an inconclusive one), as a one-screen Markdown summary;
- :mod:`.figure`: the figure of one audited batch (:func:`save_audit_figure`: the verdict, the rule,
  each image's worst case, bounded in size);
- :mod:`.callback`: :class:`PrivacyAudit`, the audit inside a user's own training run;

The privacy-utility frontier, which sweeps this audit over defense families, strengths, batch sizes and
stages, is the floor above: :mod:`lightning_gp.frontier`. The audit never imports it; its names that
users imported from here (``frontier``, ``FrontierConfig``, ...) still resolve, lazily, with a
``DeprecationWarning`` naming their new home.

The flow: catalogue -> :class:`DefenseSetting` -> tapped round (what each client shared) -> every
published attack and the setting's adaptive attack (:func:`attack_record`) -> per-attack reports ->
worst case per threat model -> verdict with its reasons.
"""

import importlib
import warnings
from typing import Any

from lightning_gp.audit.advantage import ReconstructionAdvantage, identifying_rule, reconstruction_advantage
from lightning_gp.audit.bounds import FormalBound, defense_mechanism, prior_only_kappa, setting_bound
from lightning_gp.audit.callback import AuditResult, PrivacyAudit
from lightning_gp.audit.catalog import CatalogEntry, DefenseSetting, defense_catalog, register_defense
from lightning_gp.audit.engine import AttackResult, attack_record, attacker_loss, mean_scores
from lightning_gp.audit.figure import save_audit_figure
from lightning_gp.audit.learned import learned_inversion_attacks, setting_simulator, simulation_refusal
from lightning_gp.audit.quiet import internal_trainer, library_noise_silenced, quiet_lightning
from lightning_gp.audit.recognition import datamodule_recognition_tests, recognition_tests
from lightning_gp.audit.rounds import (
    NoPublicSplitError,
    aggregate_record,
    malicious_server_model,
    public_examples,
    tap_defended_round,
    tap_fedsgd_round,
)
from lightning_gp.audit.setting_audit import (
    THREAT_MODELS,
    AttackBudget,
    AttackSpec,
    Cell,
    SettingAudit,
    audit_setting,
    published_attacks,
)
from lightning_gp.audit.summary import Candidate, Choice, choose, combined_verdict, summary_markdown
from lightning_gp.audit.training import TrainingResult, train_setting
from lightning_gp.audit.verdict import (
    LEAK_THRESHOLDS,
    NOISE_RATIO_LINE,
    VERDICT_THRESHOLDS,
    BaselineScores,
    LeakRule,
    WorstCaseReport,
    WorstImage,
    trivial_baselines,
    worst_case_of_reconstructions,
    worst_case_report,
)

__all__ = [
    "LEAK_THRESHOLDS",
    "NOISE_RATIO_LINE",
    "THREAT_MODELS",
    "VERDICT_THRESHOLDS",
    "AttackBudget",
    "AttackResult",
    "AttackSpec",
    "AuditResult",
    "BaselineScores",
    "Candidate",
    "CatalogEntry",
    "Cell",
    "Choice",
    "DefenseSetting",
    "FormalBound",
    "LeakRule",
    "NoPublicSplitError",
    "PrivacyAudit",
    "ReconstructionAdvantage",
    "SettingAudit",
    "TrainingResult",
    "WorstCaseReport",
    "WorstImage",
    "aggregate_record",
    "attack_record",
    "attacker_loss",
    "audit_setting",
    "choose",
    "combined_verdict",
    "datamodule_recognition_tests",
    "defense_catalog",
    "defense_mechanism",
    "identifying_rule",
    "internal_trainer",
    "learned_inversion_attacks",
    "library_noise_silenced",
    "malicious_server_model",
    "mean_scores",
    "prior_only_kappa",
    "public_examples",
    "published_attacks",
    "quiet_lightning",
    "recognition_tests",
    "reconstruction_advantage",
    "register_defense",
    "save_audit_figure",
    "setting_bound",
    "setting_simulator",
    "simulation_refusal",
    "summary_markdown",
    "tap_defended_round",
    "tap_fedsgd_round",
    "train_setting",
    "trivial_baselines",
    "worst_case_of_reconstructions",
    "worst_case_report",
]

#: Names that moved to :mod:`lightning_gp.frontier` (the floor above the audit), resolved lazily so the
#: audit itself never imports the frontier.
MOVED_TO_FRONTIER = frozenset(
    {
        "Family",
        "Fixed",
        "FrontierConfig",
        "FrontierPoint",
        "FrontierResult",
        "Grid",
        "Recommendation",
        "frontier",
        "frontier_families",
        "pareto_mask",
        "register_family",
    }
)


def __getattr__(name: str) -> Any:
    if name in MOVED_TO_FRONTIER:
        warnings.warn(
            f"lightning_gp.audit.{name} moved to lightning_gp.frontier.{name}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module("lightning_gp.frontier"), name)
    raise AttributeError(f"module 'lightning_gp.audit' has no attribute {name!r}")
