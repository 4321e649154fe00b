"""``lightning_gp.attacks.monitored``: inside it an attack prints a heartbeat while it iterates and
stops at its next iteration once asked; outside it attacks neither print nor check."""

from __future__ import annotations

import pytest
import torch
from helpers import small_cnn

from lightning_gp.attacks import IDLG, AttackInterrupted, ServerView, monitored


def view() -> ServerView:
    torch.manual_seed(0)
    model = small_cnn()
    x, y = torch.rand(1, 1, 12, 12), torch.tensor([2])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    gradients = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
    return ServerView(model=model, gradients=gradients, input_shape=(1, 12, 12), batch_size=1, num_classes=4)


def test_an_attack_stops_at_its_next_iteration_once_asked_and_runs_outside_the_block() -> None:
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 2

    with monitored(heartbeat=None, stop=stop), pytest.raises(AttackInterrupted, match="IDLG stopped at iteration 3/50"):
        IDLG(iterations=50, max_iter=2).reconstruct(view())
    assert isinstance(AttackInterrupted("x"), BaseException) and not isinstance(AttackInterrupted("x"), Exception)
    IDLG(iterations=2, max_iter=2).reconstruct(view())  # no block: nothing asks, nothing stops


def test_the_heartbeat_names_the_attack_its_iteration_and_objective() -> None:
    lines: list[str] = []
    with monitored(heartbeat=1e-9, write=lines.append):
        IDLG(iterations=3, max_iter=2).reconstruct(view())
    assert [line.split(",")[0] for line in lines] == [f"  [IDLG] iteration {i}/3" for i in (1, 2, 3)]
    with pytest.raises(ValueError, match="heartbeat"), monitored(heartbeat=0):
        pass
