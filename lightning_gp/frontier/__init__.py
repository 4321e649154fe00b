"""The privacy-utility frontier: which defense at which strength keeps a client's images private
against the strongest attacker, at the smallest cost in accuracy, time and bytes.

A floor above :mod:`lightning_gp.audit`: the frontier sweeps the audit (:func:`~lightning_gp.audit.audit_setting`
and :func:`~lightning_gp.audit.train_setting`) over defense families, strengths, client batch sizes
and model stages; the audit never imports the frontier. One idea per module, layered bottom-up:

- :mod:`.workers`: worker processes that end with their parent, whatever signal ends it;
- :mod:`.grid`: the config (:class:`FrontierConfig`), defense families (:func:`register_family`,
  :func:`frontier_families`) and their strength grids (:class:`Grid`, :class:`Fixed`);
- :mod:`.run`: the jobs of a config, the resumable results file, running jobs on processes or Ray;
- :mod:`.report`: points, the Pareto set and the recommendation, as CSV, Markdown and a figure;
- :mod:`.sweep`: :func:`frontier`, the whole sweep from config to report.
"""

from lightning_gp.frontier.grid import Family, Fixed, FrontierConfig, Grid, frontier_families, register_family
from lightning_gp.frontier.report import FrontierPoint, Recommendation, pareto_mask
from lightning_gp.frontier.sweep import FrontierResult, frontier

__all__ = [
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
]
