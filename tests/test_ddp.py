"""DDP, one rank = one client: the defense runs in the comm hook, before the all-reduce."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scripts.ddp_worker import TinyNet

from lightning_gp.callbacks import OptimalGradientPruning
from lightning_gp.defenses import MagnitudePruning
from lightning_gp.defenses import OptimalGradientPruning as OptimalGradientPruningTransform

WORKER = Path(__file__).parent / "scripts" / "ddp_worker.py"


def raw_gradient(tapped: dict) -> dict[str, torch.Tensor]:
    """Recompute the rank's undefended gradient from the weights and batch it tapped."""
    model = TinyNet()
    model.load_state_dict(tapped["model_state"])
    x, y = tapped["batch"]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))


@pytest.mark.multiprocess
def test_two_process_gloo_aggregate_is_the_mean_of_defended_rank_gradients(tmp_path):
    result = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert not torch.equal(ranks[0]["tapped"]["batch"][0], ranks[1]["tapped"]["batch"][0])

    raw = [raw_gradient(r["tapped"]) for r in ranks]
    defended = [r["tapped"]["gradients"] for r in ranks]
    for rank in range(2):  # what left each rank is the defense applied to that rank's own gradient
        expected = MagnitudePruning(0.7)(raw[rank])
        for name in expected:
            torch.testing.assert_close(defended[rank][name], expected[name])

    aggregated = ranks[0]["aggregated"]
    for name in aggregated:
        torch.testing.assert_close(ranks[1]["aggregated"][name], aggregated[name])
        torch.testing.assert_close(aggregated[name], (defended[0][name] + defended[1][name]) / 2)
    assert any(not torch.allclose(aggregated[n], (raw[0][n] + raw[1][n]) / 2) for n in aggregated)


@pytest.mark.multiprocess
def test_two_process_adgp_prunes_every_rank_with_one_broadcast_mask(tmp_path):
    result = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "adgp"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["provider"] == ranks[1]["provider"] in (0, 1)
    assert [r["broadcasts"] for r in ranks] == [1, 1]  # one packed broadcast for the round
    mask = ranks[0]["mask"]
    for name in mask:
        assert torch.equal(mask[name], ranks[1]["mask"][name])
    for rank in ranks:
        raw = raw_gradient(rank["tapped"])
        for name, shared in rank["tapped"]["gradients"].items():
            sent = shared != 0
            assert not (sent & ~mask[name]).any()  # only mask positions travel
            own_top = (
                raw[name]
                .abs()
                .flatten()
                .topk(max(0, min(round(0.05 * raw[name].numel()), raw[name].numel() - 1)))
                .indices
            )
            assert not sent.flatten()[own_top].any()  # never the rank's own top-k1
    aggregated = ranks[0]["aggregated"]
    for name in aggregated:  # the server's update, what clients download, lies in the mask too
        assert not ((aggregated[name] != 0) & ~mask[name]).any()


@pytest.mark.multiprocess
def test_two_process_optimal_pruning_uses_each_rank_own_batch_sensitivity(tmp_path):
    # the sensitivity is estimated at batch start on each rank; the comm hook only defends
    result = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "optimal"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    probe_seeds = OptimalGradientPruning(rate=0.6, num_probes=4, seed=5)
    for rank, saved in enumerate(ranks):
        tapped = saved["tapped"]
        model = TinyNet()
        model.load_state_dict(tapped["model_state"])
        x, y = tapped["batch"]
        sensitivity = probe_seeds.estimate(model, x, y, seed_words=(0, rank, 0))
        expected = OptimalGradientPruningTransform(0.6)(raw_gradient(tapped), rank, sensitivity=sensitivity)
        for name in expected:
            torch.testing.assert_close(tapped["gradients"][name], expected[name])
        sent = sum(int((g != 0).sum()) for g in tapped["gradients"].values())
        assert sent == sum(g.numel() for g in expected.values()) - round(
            0.6 * sum(g.numel() for g in expected.values())
        )
    aggregated = ranks[0]["aggregated"]
    for name in aggregated:
        torch.testing.assert_close(
            aggregated[name], (ranks[0]["tapped"]["gradients"][name] + ranks[1]["tapped"]["gradients"][name]) / 2
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize("rounds, agree", [((3, 3), True), ((3, 4), False)])
def test_ranks_that_disagree_on_the_round_get_a_clear_error(tmp_path, rounds, agree):
    script = Path(__file__).parent / "scripts" / "round_check.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), *map(str, rounds)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    messages = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    if agree:
        assert messages == ["ok", "ok"]
    else:
        assert all("disagree on the round" in m and "[3, 4]" in m for m in messages)
