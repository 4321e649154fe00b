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
- :mod:`.setting_audit`: every attack against one setting, judged per threat model
  (:func:`audit_setting`, the engine of the matrix and the demo);
- :mod:`.training`: what a setting costs (:func:`train_setting`);
- :mod:`.summary`: which setting to pick and why (:func:`choose`: the private one with the highest
  accuracy, never an inconclusive one), as a one-screen Markdown summary;
- :mod:`.figure`: the figure of one audited batch (:func:`save_audit_figure`: the verdict, the rule,
  each image's worst case, bounded in size);
- :mod:`.callback`: :class:`PrivacyAudit`, the audit inside a user's own training run;
- :mod:`.frontier_grid`, :mod:`.frontier_run`, :mod:`.frontier_report`, :mod:`.frontier`: the
  privacy-utility frontier (:func:`frontier`): defense families swept over their strengths, batch
  sizes and stages, the Pareto set and the recommendation.

The flow: catalogue -> :class:`DefenseSetting` -> tapped round (what each client shared) -> every
published attack and the setting's adaptive attack (:func:`attack_record`) -> per-attack reports ->
worst case per threat model -> verdict with its reasons.
"""

from lightning_gp.audit.bounds import FormalBound, defense_mechanism, prior_only_kappa, setting_bound
from lightning_gp.audit.callback import AuditResult, PrivacyAudit
from lightning_gp.audit.catalog import CatalogEntry, DefenseSetting, defense_catalog, register_defense
from lightning_gp.audit.engine import AttackResult, attack_record, attacker_loss, mean_scores
from lightning_gp.audit.figure import save_audit_figure
from lightning_gp.audit.frontier import FrontierResult, frontier
from lightning_gp.audit.frontier_grid import Family, Fixed, FrontierConfig, Grid, frontier_families, register_family
from lightning_gp.audit.frontier_report import FrontierPoint, Recommendation, pareto_mask
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
    "Family",
    "Fixed",
    "FormalBound",
    "FrontierConfig",
    "FrontierPoint",
    "FrontierResult",
    "Grid",
    "LeakRule",
    "NoPublicSplitError",
    "PrivacyAudit",
    "Recommendation",
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
    "frontier",
    "frontier_families",
    "internal_trainer",
    "learned_inversion_attacks",
    "library_noise_silenced",
    "malicious_server_model",
    "mean_scores",
    "pareto_mask",
    "prior_only_kappa",
    "public_examples",
    "published_attacks",
    "quiet_lightning",
    "recognition_tests",
    "register_defense",
    "register_family",
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
