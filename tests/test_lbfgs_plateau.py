"""DLG's plateau rule: an L-BFGS run stops once its best objective fell by less than ``plateau_rtol``
over the last ``plateau_steps`` outer steps. The rule only truncates a run: the steps it takes are the
steps of the same run without it (same seed, same iterates)."""

from __future__ import annotations

import csv

import pytest
import torch
from helpers import run_benchmark
from torch import nn

from lightning_gp import defenses as D
from lightning_gp.attacks import DLG, IDLG, ServerView, parameter_gradients
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")


def pruned_view() -> ServerView:
    """One image's gradient with half its entries zeroed at random: iDLG cannot match the zeros, so its
    objective levels off far above zero."""
    dm = FashionMNISTSampleDataModule()
    dm.setup("fit")
    torch.manual_seed(0)
    model = LeNetZhu()
    x, y = dm.train_dataset[3]
    x, y = torch.as_tensor(x)[None], torch.as_tensor(y).view(1)
    grads = {n: g.detach() for n, g in parameter_gradients(model, nn.CrossEntropyLoss(), x, y).items()}
    shared = D.RandomPruning(0.5, seed=0)(grads, 0)
    return ServerView(
        model=model, gradients=shared, batch_size=1, input_shape=(1, 28, 28), num_classes=10, mean=dm.mean, std=dm.std
    )


def test_a_run_stops_on_a_plateau_and_takes_exactly_the_steps_of_the_run_without_the_rule():
    view = pruned_view()
    steps, rtol = 3, 0.05
    stopped = IDLG(iterations=40, seed=0, plateau_steps=steps, plateau_rtol=rtol).reconstruct(view)
    full = IDLG(iterations=40, seed=0, plateau_steps=0).reconstruct(view)
    trace, reference = stopped.loss_trace, full.loss_trace
    assert steps < len(trace) < len(reference)  # the premise: the rule fired before the cap
    assert trace == reference[: len(trace)]  # a truncation of the same run
    # it fired at the first step where the rule holds, and not before
    held = [min(reference[: i + 1]) > (1 - rtol) * min(reference[: i + 1 - steps]) for i in range(steps, len(trace))]
    assert held[-1] and not any(held[:-1])


def test_the_rule_reads_the_best_objective_over_its_window():
    attack = DLG(plateau_steps=2, plateau_rtol=0.1)
    assert not attack._plateaued([10.0, 9.0])  # no full window yet
    assert not attack._plateaued([10.0, 9.0, 8.0, 7.0])  # 7 < 0.9 * 9
    assert attack._plateaued([10.0, 9.5, 9.2, 9.4])  # best 9.2 > 0.9 * 10: under 10% in two steps
    assert attack._plateaued([10.0, 12.0, 11.0])  # a rise is no progress
    assert not DLG(plateau_steps=0)._plateaued([1.0] * 50)  # off


@pytest.mark.parametrize(("name", "value"), [("plateau_steps", -1), ("plateau_steps", 1.5), ("plateau_rtol", 1.5)])
def test_a_bad_plateau_setting_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        DLG(**{name: value})


def test_the_observer_sees_the_images_after_every_outer_step():
    view = pruned_view()
    seen: list[tuple[int, tuple[int, ...]]] = []
    result = IDLG(
        iterations=4, seed=0, plateau_steps=0, observer=lambda i, images: seen.append((i, images.shape))
    ).reconstruct(view)
    assert seen == [(i, (1, 1, 1, 28, 28)) for i in range(len(result.loss_trace))]
    with pytest.raises(TypeError, match="observer"):
        DLG(observer="print")  # type: ignore[arg-type]


def test_the_convergence_benchmark_replays_every_rule_on_its_traces(tmp_path):
    result = run_benchmark(
        "lbfgs_convergence.py",
        "--cases",
        "RandomPruning(rate=0.5):iDLG:1",
        "--images",
        "1",
        "--iterations",
        "25",
        "--sample",
        "--output-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "lbfgs_convergence.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["rule (steps, rtol)"] for r in rows] == ["20, 0.001", "20, 0.01", "10, 0.01", "50, 0.001"]
    with open(tmp_path / "lbfgs_convergence_traces.csv") as handle:
        trace = list(csv.DictReader(handle))
    steps = [int(r["step"]) for r in trace]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) <= 25
    for row in rows:  # a rule stops at or before the last step the run took
        stop = int(row["stops at (mean; max)"].split("; ")[1])
        assert stop <= len(steps)
