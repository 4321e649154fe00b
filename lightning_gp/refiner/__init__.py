"""Refiner (Fan et al., "Refiner: Data Refining against Gradient Leakage Attacks in Federated Learning", USENIX Security 2025): clients share the projected gradient of optimised robust data.

* :class:`RefinerModule` wraps a model so each client's batch is replaced by robust data
  (plain Trainer, DDP, and per client inside ``FederatedSimulation``);
* :func:`refine`, :func:`project_upload`, :func:`utility_measure`: the algorithm in pure torch;
* :class:`EvaluationNetwork`, :func:`load_evaluator`: the privacy measure ``D`` and its shipped checkpoints.
"""

from lightning_gp.refiner.evaluator import EvaluationNetwork, EvaluatorUnavailableError, load_evaluator
from lightning_gp.refiner.module import IndexedDataset, RefinerModule
from lightning_gp.refiner.robust_data import (
    RefinedBatch,
    RefinerConfig,
    layer_index,
    project_upload,
    refine,
    utility_measure,
    utility_weights,
)

__all__ = [
    "EvaluationNetwork",
    "EvaluatorUnavailableError",
    "IndexedDataset",
    "RefinedBatch",
    "RefinerConfig",
    "RefinerModule",
    "layer_index",
    "load_evaluator",
    "project_upload",
    "refine",
    "utility_measure",
    "utility_weights",
]
