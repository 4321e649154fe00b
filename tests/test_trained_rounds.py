"""Audits at a trained round: the tapped round sees the weights and the defenses' state of round r.

Real FederatedSimulation rounds on the bundled Fashion-MNIST sample; seeded models.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gp.attacks import parameter_gradients
from lightning_gp.audit import DefenseSetting, tap_defended_round
from lightning_gp.callbacks import TopKPruning
from lightning_gp.defenses import pruning
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")

CHOSEN = [[3, 11]]


def lenet() -> LeNetZhu:
    torch.manual_seed(0)
    return LeNetZhu()


def tapped_and_fresh(data, error_feedback: bool, round: int) -> tuple[dict, dict, dict]:
    """The gradient client 0 shared at ``round`` under Top-k, the same Top-k of that round's raw
    gradient by a defense with no history, and the round's weights."""
    setting = DefenseSetting("topk", [TopKPruning(rate=0.8, error_feedback=error_feedback, seed=0)])
    records, sent, _ = tap_defended_round(setting, lenet(), data, indices=CHOSEN, num_clients=3, round=round)
    record = records[0]
    assert record.round == round
    sent.load_state_dict(record.model_state)
    raw = parameter_gradients(sent, nn.CrossEntropyLoss(), record.inputs, record.targets, create_graph=False)
    fresh = pruning.TopKPruning(rate=0.8, error_feedback=error_feedback, seed=0)(raw, client_id=0)
    return record.gradients, fresh, record.model_state


def differs(a: dict, b: dict) -> bool:
    return any(not torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-7) for n in a)


def test_a_trained_round_carries_the_error_feedback_residual(data) -> None:
    """Top-k with error feedback shares top-k(g_r + residual): after two rounds the residual is not zero,
    so what client 0 shares at round 2 is not the top-k of its round-2 gradient alone. Without error
    feedback (the control) it is, to float rounding; at round 0 both coincide (no history yet)."""
    shared, fresh, state = tapped_and_fresh(data, error_feedback=True, round=2)
    assert differs(shared, fresh)
    initial = lenet().state_dict()
    assert any(not torch.equal(state[n], initial[n]) for n in initial), "round 2 must see trained weights"
    shared, fresh, _ = tapped_and_fresh(data, error_feedback=False, round=2)
    assert not differs(shared, fresh)
    shared, fresh, _ = tapped_and_fresh(data, error_feedback=True, round=0)
    assert not differs(shared, fresh)


def test_a_plain_trainer_round_is_tapped_from_the_weights_its_training_reached(data) -> None:
    """On the plain-Trainer runner, round 1 is tapped after one step of that runner: the record
    carries the trained weights, not the initial ones, and is the gradient there of the chosen images."""
    plain = DefenseSetting("plain", runner="trainer")
    torch.manual_seed(0)
    model = lenet()
    initial = {n: t.clone() for n, t in model.state_dict().items()}
    (record,), sent, _ = tap_defended_round(plain, model, data, indices=CHOSEN, round=1)
    assert any(not torch.equal(record.model_state[n], initial[n]) for n in initial)
    sent.load_state_dict(record.model_state)
    fresh = parameter_gradients(sent, nn.CrossEntropyLoss(), record.inputs, record.targets, create_graph=False)
    assert record.gradients.keys() == fresh.keys()
    for name, shared in record.gradients.items():
        torch.testing.assert_close(shared, fresh[name], msg=name)


def test_a_trained_round_is_refused_where_it_cannot_be_simulated(data) -> None:
    with pytest.raises(ValueError, match="round must be"):
        tap_defended_round(DefenseSetting("undefended"), lenet(), data, indices=CHOSEN, round=-1)
