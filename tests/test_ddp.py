"""DDP, one rank = one client: the defense runs in the comm hook, before the all-reduce."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import run_script
from scripts.ddp_worker import BranchyNet, TinyNet

from lightning_gp.callbacks import OptimalGradientPruning
from lightning_gp.defenses import MagnitudePruning, Soteria, representation_scores
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
    result = run_script(WORKER, str(tmp_path), timeout=300, cwd=tmp_path)
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
    result = run_script(WORKER, str(tmp_path), "adgp", timeout=300, cwd=tmp_path)
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
    result = run_script(WORKER, str(tmp_path), "optimal", timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    probe_seeds = OptimalGradientPruning(rate=0.6, probes=4, seed=5, loss_fn=torch.nn.functional.cross_entropy)
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
def test_two_process_soteria_prunes_each_rank_by_its_own_batch_feature_scores(tmp_path):
    result = run_script(WORKER, str(tmp_path), "soteria", timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    pruned_columns = []
    for rank, saved in enumerate(ranks):
        tapped = saved["tapped"]
        model = TinyNet()
        model.load_state_dict(tapped["model_state"])
        x, _ = tapped["batch"]
        scores = representation_scores(model, x, "net.1")  # the first linear layer called
        expected = Soteria(0.5)(raw_gradient(tapped), rank, scores=scores, layer="net.1")
        for name in expected:
            torch.testing.assert_close(tapped["gradients"][name], expected[name])
        pruned_columns.append((tapped["gradients"]["net.1.weight"] == 0).all(dim=0))
        assert int(pruned_columns[-1].sum()) == 6  # half of the 12 input features
    assert not torch.equal(pruned_columns[0], pruned_columns[1])  # each rank's own batch decides
    aggregated = ranks[0]["aggregated"]
    for name in aggregated:
        torch.testing.assert_close(
            aggregated[name], (ranks[0]["tapped"]["gradients"][name] + ranks[1]["tapped"]["gradients"][name]) / 2
        )


@pytest.mark.multiprocess
def test_ranks_agree_on_the_round_and_on_failure_before_sharing(tmp_path):
    script = Path(__file__).parent / "scripts" / "round_check.py"
    result = run_script(script, str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for case in ("same_round", "no_rank_fails"):
        assert [r[case] for r in ranks] == ["ok", "ok"]
    assert all("disagree on the round" in r["different_rounds"] and "[3, 4]" in r["different_rounds"] for r in ranks)
    # A failure on one rank is the same clear error on every rank (not a gloo "connection closed" later).
    failures = [r["one_rank_fails"] for r in ranks]
    assert failures[0] == failures[1]
    assert failures[0].startswith("DistributedDefenseError: the shared-gradient pipeline failed at step 5 on 1 of 2")
    assert "rank 1: NonFiniteGradientError: client 1's gradient holds NaN" in failures[0]


def run_worker(tmp_path: Path, scenario: str) -> subprocess.CompletedProcess:
    return run_script(WORKER, str(tmp_path), scenario, timeout=300, cwd=tmp_path)


@pytest.mark.multiprocess
def test_error_feedback_mass_survives_parameters_ddp_leaves_without_grad(tmp_path):
    """find_unused_parameters=True: DDP leaves .grad None for a parameter no rank used this step.
    Top-k's error feedback still sends residual mass for it; that mass must reach the optimizer
    (before the fix it was counted as sent, removed from the residual, and dropped)."""
    result = run_worker(tmp_path, "unused")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    stepped = ranks[0]["stepped"]  # identical on both ranks after the all-reduce
    assert stepped[1]["aux.weight"] is not None, "the optimizer never saw the aux head's error-feedback mass"
    for name in ("aux.weight", "aux.bias"):
        sent = (ranks[0]["shared"][1][name] + ranks[1]["shared"][1][name]) / 2
        assert bool(sent.any())  # the residual of step 0 is being sent in step 1
        torch.testing.assert_close(stepped[1][name], sent)
    # Conservation: what the optimizer applied plus what the clients still hold is what they computed.
    raw = {r: [branchy_gradient(ranks[r], t) for t in range(2)] for r in range(2)}
    for name in raw[0][0]:
        applied = sum(step[name] for step in stepped if step[name] is not None)
        held = (ranks[0]["residual"][name] + ranks[1]["residual"][name]) / 2
        computed = sum(raw[r][t][name] for r in range(2) for t in range(2)) / 2
        torch.testing.assert_close(applied + held, computed, rtol=1e-5, atol=1e-6)


def branchy_gradient(saved: dict, step: int) -> dict[str, torch.Tensor]:
    """The undefended gradient a rank computed at ``step`` (the aux head only takes part in step 0)."""
    model = BranchyNet()
    model.load_state_dict(saved["weights"][step])
    x, y = saved["batches"][step]
    logits = model(x) + (model.aux(x.flatten(1)) if step == 0 else 0)
    loss = torch.nn.functional.cross_entropy(logits, y)
    return dict(
        zip(
            [n for n, _ in model.named_parameters()],
            torch.autograd.grad(loss, list(model.parameters()), allow_unused=True, materialize_grads=True),
        )
    )


@pytest.mark.multiprocess
def test_a_nan_on_one_rank_is_the_same_clear_error_on_every_rank(tmp_path):
    """Before: rank 1 raised NonFiniteGradientError alone, and rank 0 died later inside gloo
    ("connection closed") or hung in the all-reduce."""
    result = run_worker(tmp_path, "nan")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    message = "DistributedDefenseError: the shared-gradient pipeline failed at step 0 on 1 of 2 DDP ranks"
    assert output.count(message) >= 2, output[-4000:]  # raised by both processes
    assert "rank 1: NonFiniteGradientError: client 1's gradient holds NaN or inf" in output
    assert "Connection closed" not in output and "Connection reset" not in output
