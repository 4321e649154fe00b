"""The gradient pipeline: the engine between a client's ``.grad`` and what it shares.

client batch -> a **runner** computes each client's gradient -> **defense stages** rewrite it ->
shared gradient -> **observer stages** see it -> aggregation -> optimizer step

* :mod:`~lightning_gp.pipeline.stages`: the three roles (:class:`ClientStepRunner`,
  :class:`DefenseStage`, :class:`ObserverStage`), the per-call context :class:`StageCall` and
  the run's :class:`ClientSetup`;
* :mod:`~lightning_gp.pipeline.pipeline`: :class:`SharedGradientPipeline`, the one object that holds
  a fit's stages in order; the fit's runner holds it from fit start;
* the runners: :class:`LocalClientStep` (one process, one client), :class:`DDPClientStep` (one
  rank, one client, in DDP's communication hook); ``FederatedSimulation`` and ``DPSGD`` are
  runners themselves; :func:`resolve_runner` picks the one of a fit, :func:`start_pipeline` hands it
  the pipeline.

Lightning adapters (the callbacks users put in a ``Trainer``) live in :mod:`lightning_gp.callbacks`;
see docs/architecture.md.
"""

from lightning_gp.pipeline.ddp import DDPClientStep, DistributedDefenseError
from lightning_gp.pipeline.local import LocalClientStep, defend_parameter_gradients, parameter_setup
from lightning_gp.pipeline.pipeline import ClientStepRunner, RoundNotPrepared, SharedGradientPipeline
from lightning_gp.pipeline.runners import resolve_runner, start_pipeline
from lightning_gp.pipeline.stages import ClientSetup, DefenseStage, ObserverStage, StageCall

__all__ = [
    "ClientSetup",
    "ClientStepRunner",
    "DDPClientStep",
    "DefenseStage",
    "DistributedDefenseError",
    "LocalClientStep",
    "ObserverStage",
    "RoundNotPrepared",
    "SharedGradientPipeline",
    "StageCall",
    "defend_parameter_gradients",
    "parameter_setup",
    "resolve_runner",
    "start_pipeline",
]
