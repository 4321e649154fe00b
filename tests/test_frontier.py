"""The privacy-utility frontier: a point is the audit's result and nothing else; an interrupted run
resumes to the same results; a bad config fails before any work, naming the field; the Pareto set;
the same run on a two-worker Ray cluster; the CLI.

Real audits on the bundled Fashion-MNIST sample with tiny budgets (iDLG, a few L-BFGS steps, one
or two images), so each test takes seconds; the conclusions of such runs mean nothing, only that the
machinery carries the audit's numbers through unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import lightning as L
import pytest
from helpers import frontier_point

from lightning_gp.attacks import LABEL_RECOVERY_REVISION
from lightning_gp.audit import AttackBudget, DefenseSetting, audit_setting, published_attacks
from lightning_gp.callbacks import GaussianNoise, GradientDefense, TopKPruning
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.defenses import Defense
from lightning_gp.frontier import Fixed, FrontierConfig, Grid, frontier, pareto_mask
from lightning_gp.frontier import grid as frontier_grid
from lightning_gp.frontier.grid import ClientTraining, Family, setting_name
from lightning_gp.frontier.report import (
    family_bests,
    family_table,
    read_csv,
    recommend,
    recommendation_table,
    write_csv,
)
from lightning_gp.frontier.run import (
    RESULTS_FILE,
    TRAINING_REVISION,
    Progress,
    attacked_images,
    coverage_order,
    decisive_first,
    frontier_jobs,
    has_stale_labels,
    has_stale_leak_rule,
    job_estimates,
    misses_learned_inverter,
    without_stale_bound,
)
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]

TINY = AttackBudget(ig_iterations=2, lbfgs_iterations=2, rtf_bins=4)


def config(**changes) -> FrontierConfig:
    base = FrontierConfig(
        model={"class_path": "lightning_gp.models.LeNetZhu"},
        datamodule={"class_path": "lightning_gp.data.FashionMNISTSampleDataModule", "init_args": {"batch_size": 500}},
        grids=[Grid("TopKPruning", "rate", [0.5, 0.99])],
        batch_sizes=[1],
        stages=[0],
        images=1,
        train_rounds=1,
        num_clients=2,
        attacks=["iDLG"],
        budget=TINY,
        lpips=False,
    )
    return dataclasses.replace(base, **changes)


def silent(line: str) -> None:
    pass


def comparable(points) -> list[dict]:
    """The points without the wall-clock fields (timing is not a result)."""
    return [
        {k: v for k, v in dataclasses.asdict(p).items() if k not in ("cost_ratio", "audit_seconds")} for p in points
    ]


def test_a_point_equals_audit_setting_on_the_same_setting() -> None:
    """The frontier's point at Top-k 0.9 (composed after Gaussian noise: two defenses, one adaptive
    attacker) at batch 2 is audit_setting's worst case on that setting, built here by hand: the same
    verdicts, leak fractions and worst-case PSNR/SSIM per threat model."""
    cfg = config(
        grids=[Grid("TopKPruning", "rate", [0.9], before=[Fixed("GaussianNoise", {"scale": 0.01})])],
        batch_sizes=[2],
        images=2,
        undefended=False,
    )
    result = frontier(cfg, log=silent)
    data = FashionMNISTSampleDataModule(batch_size=500)
    setting = DefenseSetting("by hand", [GaussianNoise(scale=0.01, seed=0), TopKPruning(rate=0.9, seed=0)])
    L.seed_everything(0, verbose=False)
    audit = audit_setting(
        setting,
        LeNetZhu(),
        data,
        indices=attacked_images(data, 2, 2, 0),
        published=published_attacks(TINY, ["iDLG"]),
        budget=TINY,
        num_clients=2,
        seed=0,
        log=silent,
    )
    assert len(result.points) == 2
    for point in result.points:
        report = audit.passive if point.threat == "passive" else audit.active
        assert report is not None
        assert point.verdict == report.verdict
        assert point.leak_fraction == report.leak_fraction
        assert point.worst_psnr == pytest.approx(report.means["psnr"], rel=0, abs=0)
        assert point.worst_ssim == pytest.approx(report.means["ssim"], rel=0, abs=0)
        assert point.pmm is None  # no undefended reference in this run: PMM is not invented


def test_a_frontier_with_the_clients_model_checks_names_them_and_keeps_its_pmm_reference() -> None:
    """``model_checks: true``: every setting (the undefended reference's too) carries the checks and says
    so, so its jobs never mix with a frontier's without them, and PMM still divides by that reference."""
    result = frontier(config(grids=[Grid("TopKPruning", "rate", [0.5])], model_checks=True), log=silent)
    assert result.points and all(p.setting.endswith("+model checks") for p in result.points)
    undefended = [p for p in result.points if p.family == "undefended"]
    assert undefended and all(p.pmm == 1.0 for p in undefended)
    assert all(p.pmm is not None for p in result.points)


# 12 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_an_interrupted_run_resumes_to_the_same_results(tmp_path: Path) -> None:
    """Killed after 2 of its 6 jobs, a rerun runs only the 4 left and ends with the results of an
    uninterrupted run (wall-clock fields aside); a line cut short by the kill is run again."""
    cfg = config()
    whole = frontier(cfg, tmp_path / "whole", log=silent)
    assert len(whole.ran) == 6

    class Killed(Exception):
        pass

    finished = []

    def kill_after_two(job, record) -> None:
        finished.append(job.key)
        if len(finished) == 2:
            raise Killed

    with pytest.raises(Killed):
        frontier(cfg, tmp_path / "cut", log=silent, on_job=kill_after_two)
    early = frontier(cfg, tmp_path / "early", log=silent, report_only=True)  # a look before any job finished
    assert early.points == [] and (tmp_path / "early" / "frontier.png").stat().st_size > 0
    results = tmp_path / "cut" / RESULTS_FILE
    assert len(results.read_text().splitlines()) == 2
    for line in (tmp_path / "whole" / RESULTS_FILE).read_text().splitlines():  # an audit's time, attack by attack
        record = json.loads(line)["record"]
        if record["kind"] == "audit":
            assert sum(c["seconds"] for c in record["cells"]) == pytest.approx(record["seconds"])
    with open(results, "a") as handle:  # a third job killed while it was being written
        handle.write('{"fingerprint": "')
    partial = frontier(cfg, tmp_path / "cut", log=silent, report_only=True)  # a look at it, nothing run
    assert partial.ran == [] and len(results.read_text().splitlines()) == 3
    assert {(p.setting, p.stage) for p in partial.points} <= {(p.setting, p.stage) for p in whole.points}
    assert "Partial: 2 of 6 jobs finished" in (tmp_path / "cut" / "frontier.md").read_text()
    resumed = frontier(cfg, tmp_path / "cut", log=silent)
    assert sorted(j.key for j in resumed.ran) == sorted(j.key for j in whole.ran if j.key not in finished)
    assert comparable(resumed.points) == comparable(whole.points)
    picks = [(r.choice.pick or r.choice.closest).name for r in whole.recommendations]  # type: ignore[union-attr]
    assert [(r.choice.pick or r.choice.closest).name for r in resumed.recommendations] == picks  # type: ignore[union-attr]
    assert (tmp_path / "cut" / "frontier.png").is_file()
    # a changed budget is another config: nothing of the first run is reused
    again = frontier(
        dataclasses.replace(cfg, budget=AttackBudget(ig_iterations=3, lbfgs_iterations=2)), tmp_path / "cut", log=silent
    )
    assert len(again.ran) == 6


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"grids": [Grid("NoSuchDefense", "rate", [0.5])]}, r"grids\[0\]\.family: unknown family 'NoSuchDefense'"),
        ({"grids": [Grid("TopKPruning", "rate", [])]}, r"grids\[0\]\.values is empty"),
        ({"grids": [Grid("TopKPruning", "rate", [0.5, 1.5])]}, r"grids\[0\]\.values\[1\] = 1.5 \(TopKPruning\.rate\)"),
        ({"grids": [Grid("GaussianNoise", "scale", [-1.0])]}, r"grids\[0\]\.values\[0\] = -1.0"),
        ({"grids": [Grid("GaussianNoise", "sigma", [0.1])]}, r"grids\[0\]\.values\[0\] = 0.1 \(GaussianNoise\.sigma\)"),
        (
            {"grids": [Grid("GaussianNoise", "scale", [0.1], before=[Fixed("Nope")])]},
            r"grids\[0\]\.before\[0\]\.family: unknown family 'Nope'",
        ),
        ({"batch_sizes": [1, 4000]}, r"batch_sizes\[1\] = 4000: the training split holds 3000 images"),
        ({"batch_sizes": []}, r"batch_sizes must be a non-empty list"),
        ({"stages": [0, -1]}, r"stages\[1\]"),
        ({"attacks": ["NoSuchAttack"]}, r"attacks: .*NoSuchAttack"),
        ({"model": {"class_path": "lightning_gp.models.NoSuchModel"}}, r"model\.class_path: cannot import"),
        ({"client_training": []}, r"client_training must be a non-empty list"),
        (
            {"client_training": [ClientTraining("fedavg", local_batch_size=3)], "batch_sizes": [4]},
            r"client_training\[0\]\.local_batch_size = 3 must divide batch_sizes\[0\] = 4",
        ),
        ({"client_training": [ClientTraining("fedavg")]}, r"client_training\[0\]: FedAvg with one local step"),
        ({"client_training": [ClientTraining("fedsgd", local_epochs=2)]}, r"client_training\[0\]: local_epochs"),
        ({"client_training": [ClientTraining("fedavg", local_epochs=0)]}, r"client_training\[0\]\.local_epochs"),
        ({"client_training": [ClientTraining(), ClientTraining()]}, r"client_training\[1\] repeats FedSGD"),
    ],
)
def test_a_bad_config_fails_before_any_work_naming_the_field(tmp_path: Path, changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        frontier(config(**changes), tmp_path, log=silent)
    assert not (tmp_path / RESULTS_FILE).exists()


def test_the_pareto_set_keeps_exactly_the_undominated_points() -> None:
    """Rows are (-PMM, PSNR, leak fraction), all minimised: a row beaten on every axis leaves the set,
    a tie stays, a row with an unknown objective is never on it and removes nothing."""
    rows = [
        [-1.0, 40.0, 1.0],  # undefended: best PMM
        [-0.9, 10.0, 0.0],  # private-looking, cheaper
        [-0.8, 12.0, 0.0],  # dominated by the row above
        [-0.9, 10.0, 0.0],  # a tie with row 1: not dominated
        [-0.5, None, 0.0],  # unknown PSNR
        [-0.7, 5.0, 0.5],  # lowest PSNR, some leaks
    ]
    assert pareto_mask(rows) == [True, True, False, True, False, True]


def test_each_stage_gets_its_own_pick_beside_the_all_stage_one() -> None:
    """A setting private against the active server at round 0, where that server is audited, and
    inconclusive at round 50, where it is not: the all-stage active pick is none (never private on a
    gap), the round-0 active pick is that setting, and the passive picks follow the stage verdicts."""
    points = [
        frontier_point("A", 0, "active", "private", 0.9),
        frontier_point("A", 50, "active", "inconclusive", 0.9),
        frontier_point("A", 0, "passive", "private", 0.9),
        frontier_point("A", 50, "passive", "private", 0.9),
        frontier_point("B", 0, "active", "leaks", 0.99),
        frontier_point("B", 50, "active", "inconclusive", 0.99),
        frontier_point("B", 0, "passive", "leaks", 0.99),
        frontier_point("B", 50, "passive", "private", 0.99),
    ]
    picks = {(r.threat, r.stage): r.choice.pick.name if r.choice.pick else None for r in recommend(points)}
    assert picks == {
        ("passive", None): "A",
        ("passive", 0): "A",
        ("passive", 50): "B",  # the higher PMM of the two private at round 50
        ("active", None): None,
        ("active", 0): "A",
        ("active", 50): None,
    }
    table = recommendation_table(recommend(points))
    assert "| 1 | active | round 0 | **A** | private |" in table


def test_each_family_s_best_is_its_own_cheapest_private_strength_else_its_closest_point() -> None:
    """Grid "noise": two private strengths (PMM 0.6 and 0.8) and a leaking one (PMM 0.99): its best is
    the private one with PMM 0.8. Grid "prune": nothing private; its best is the point with the fewest
    leaks, named as the closest. A setting private at round 0 but leaking at round 50 is not private,
    nor is one whose round 50 has not been audited (inconclusive)."""
    rows = []
    for setting, grid, pmm, verdicts in (
        ("n1", "noise", 0.6, ("private", "private")),
        ("n2", "noise", 0.8, ("private", "private")),
        ("n3", "noise", 0.99, ("private", "leaks")),
        ("p1", "prune", 0.9, ("leaks", "leaks")),
    ):
        for stage, verdict in zip((0, 50), verdicts):
            rows.append(frontier_point(setting, stage, "passive", verdict, pmm, grid=grid))
    rows.append(
        dataclasses.replace(frontier_point("p2", 0, "passive", "leaks", 0.95, grid="prune"), leak_fraction=0.25)
    )
    rows.append(
        dataclasses.replace(frontier_point("p2", 50, "passive", "leaks", 0.95, grid="prune"), leak_fraction=0.5)
    )
    rows.append(frontier_point("q1", 0, "passive", "private", 0.99, grid="quantise"))  # round 50 not audited yet
    found = family_bests(rows)
    bests = {b.grid: b for b in found}
    assert set(bests) == {"noise", "prune", "quantise"}
    assert bests["quantise"].choice.pick is None and bests["quantise"].candidate.verdict == "inconclusive"
    assert bests["noise"].choice.pick.name == "n2"
    assert bests["prune"].choice.pick is None and bests["prune"].candidate.name == "p2"
    assert bests["prune"].candidate.leak_fraction == 0.5  # the worse stage's
    table = family_table(found)
    assert "| 1 | passive | noise | n2 | private |" in table
    assert "| 1 | passive | prune | none private; closest: p2 | leaks | 50% |" in table


def test_the_csv_reads_back_to_the_same_points(tmp_path: Path) -> None:
    """write_csv then read_csv: every field as written (the strength comes back as its text)."""
    points = [
        frontier_point("A", 0, "passive", "private", 0.9),
        dataclasses.replace(
            frontier_point("B", 50, "active", "leaks", 0.5), worst_psnr=float("inf"), pmm=None, pareto=True
        ),
    ]
    write_csv(points, tmp_path / "points.csv")
    assert read_csv(tmp_path / "points.csv") == [dataclasses.replace(p, value=str(p.value)) for p in points]


def test_a_training_times_itself_against_its_own_undefended_reference_and_older_ones_rerun(tmp_path: Path) -> None:
    """Each training record holds the undefended reference trained for the same rounds before and
    after the setting in the same job, and a point's cost is the ratio to their mean; a stored training without it (revision 1, whose
    ratio divided by another job's time) runs again while the stored audits are kept."""
    cfg = config(grids=[Grid("TopKPruning", "rate", [0.9])])
    first = frontier(cfg, tmp_path, log=silent)
    path = tmp_path / RESULTS_FILE
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    trainings = {e["key"]: e["record"] for e in entries if e["record"]["kind"] == "train"}
    assert set(trainings) == {"train|undefended|B=1", "train|TopKPruning(rate=0.9)|B=1"}
    for record in trainings.values():
        assert record["revision"] == TRAINING_REVISION and min(record["reference_runs"]) > 0
        assert record["reference_seconds"] == sum(record["reference_runs"]) / 2
    topk = trainings["train|TopKPruning(rate=0.9)|B=1"]
    for point in first.points:
        if point.setting == "TopKPruning(rate=0.9)":
            assert point.cost_ratio == topk["train_seconds"] / topk["reference_seconds"]
    for e in entries:  # as revision 1 wrote them
        if e["record"]["kind"] == "train":
            for key in ("revision", "reference_seconds", "reference_runs"):
                del e["record"][key]
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    lines: list[str] = []
    again = frontier(cfg, tmp_path, log=lines.append)
    assert sorted(j.key for j in again.ran) == sorted(trainings)
    assert "run again though stored: 2 (an older version's" in lines[0]
    assert comparable(again.points) == comparable(first.points)


# 11 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_lowering_learned_min_batch_reruns_just_the_audits_the_learned_inverter_could_change(tmp_path: Path) -> None:
    """Audits stored under ``learned_min_batch=2`` ran at batch 1 without the learned inverter. With
    1 the same results file is reused (the fingerprint leaves it out): an audit whose images had not
    all leaked to the passive server runs again, now with the inverter, and records the value; one
    whose images had all leaked is kept (no attack can change it), and so are the trainings. Raising
    the value again reruns nothing."""
    budget = dataclasses.replace(TINY, learned_inversion=True, learned_max_epochs=1, learned_min_batch=2)
    cfg = config(grids=[Grid("TopKPruning", "rate", [0.9])], budget=budget)
    frontier(cfg, tmp_path, log=silent)
    path = tmp_path / RESULTS_FILE
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    audits = [e for e in entries if e["record"]["kind"] == "audit"]
    assert {e["key"] for e in audits} == {"audit|undefended|B=1|round=0", "audit|TopKPruning(rate=0.9)|B=1|round=0"}
    for e in audits:
        assert e["record"]["learned_min_batch"] == 2
        assert not any("Learned" in c["attack"] for c in e["record"]["cells"])
        passive = e["record"]["threats"]["passive"]
        # the undefended audit as if every image had leaked, the pruned one as if one had not
        passive["leak_fraction"] = 1.0 if e["key"].startswith("audit|undefended") else 0.0
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))

    lowered = dataclasses.replace(cfg, budget=dataclasses.replace(budget, learned_min_batch=1))
    lines: list[str] = []
    again = frontier(lowered, tmp_path, log=lines.append)
    assert [j.key for j in again.ran] == ["audit|TopKPruning(rate=0.9)|B=1|round=0"]
    assert "run again though stored: 1 (" in lines[0]
    rerun = json.loads(path.read_text().splitlines()[-1])["record"]
    assert rerun["learned_min_batch"] == 1
    assert {"adaptive:LearnedInversion", "adaptive:RefinedLearnedInversion"} <= {c["attack"] for c in rerun["cells"]}
    assert frontier(cfg, tmp_path, log=silent).ran == []


def test_an_audit_without_the_inverter_reruns_once_the_server_can_replay_its_setting() -> None:
    """An audit whose record has no learned-inverter cell (stored while the server could not replay
    DP-SGD) runs again when the inverter is due at its batch size, the setting can now be replayed
    and an image had not leaked; not when any of these fails."""
    budget = AttackBudget(learned_inversion=True, learned_min_batch=1)
    key = "audit|DPSGD(noise_multiplier=0.3)|B=1|round=0"
    cells = [{"attack": "adaptive:NoiseAwareMAP"}, {"attack": "IG"}]
    record = {"kind": "audit", "cells": cells, "threats": {"passive": {"leak_fraction": 0.0}}}
    assert misses_learned_inverter(key, record, budget, lambda: None)
    assert not misses_learned_inverter(key, record, budget, lambda: "DPSGD wraps the model")
    assert not misses_learned_inverter(key, record, dataclasses.replace(budget, learned_min_batch=2), lambda: None)
    assert not misses_learned_inverter(key, record, dataclasses.replace(budget, learned_inversion=False), lambda: None)
    ran = {**record, "cells": [*cells, {"attack": "adaptive:LearnedInversion"}]}
    assert not misses_learned_inverter(key, ran, budget, lambda: None)
    leaked = {**record, "threats": {"passive": {"leak_fraction": 1.0}}}
    assert not misses_learned_inverter(key, leaked, budget, lambda: None)


def test_a_batch_audit_of_an_older_label_recovery_reruns_unless_every_image_had_leaked() -> None:
    """Batch label recovery changed (LABEL_RECOVERY_REVISION): an audit at a batch of several images
    stored without the revision, or under an older one, runs again where a label could still change it
    (some image had not leaked); one image's label never changed, nor does a stamped record."""
    record = {"kind": "audit", "cells": [], "threats": {"passive": {"leak_fraction": 0.25}}}
    batch, single = "audit|TopKPruning(rate=0.9)|B=8|round=50", "audit|TopKPruning(rate=0.9)|B=1|round=50"
    assert has_stale_labels(batch, record)
    assert has_stale_labels(batch, {**record, "label_recovery_revision": LABEL_RECOVERY_REVISION - 1})
    assert not has_stale_labels(batch, {**record, "label_recovery_revision": LABEL_RECOVERY_REVISION})
    assert not has_stale_labels(single, record)
    assert not has_stale_labels(batch, {**record, "threats": {"passive": {"leak_fraction": 1.0}}})


# 10 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_a_stored_audit_that_leaked_everywhere_is_reported_until_its_rerun_replaces_it(tmp_path: Path) -> None:
    """Two batch audits stored under an older label recovery run again. Until they do, the one that
    leaked to both servers is reported as stored (its verdict cannot err in the defense's favour, and
    the report says so), and the one that read private is not reported at all; the rerun replaces both
    and the note goes."""
    cfg = config(batch_sizes=[2], images=2, undefended=False)
    whole = frontier(cfg, tmp_path, log=silent)
    leaked_key, private_key = "audit|TopKPruning(rate=0.5)|B=2|round=0", "audit|TopKPruning(rate=0.99)|B=2|round=0"
    results = tmp_path / RESULTS_FILE
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    for entry in lines:
        if entry["key"] in (leaked_key, private_key):
            verdict = "leaks" if entry["key"] == leaked_key else "private"
            entry["record"].pop("label_recovery_revision")
            for threat in entry["record"]["threats"].values():
                threat.update(verdict=verdict, leak_fraction=0.5 if verdict == "leaks" else 0.0)
    results.write_text("".join(json.dumps(entry) + "\n" for entry in lines))

    look = frontier(cfg, tmp_path, log=silent, report_only=True)
    assert {p.verdict for p in look.points if p.setting == "TopKPruning(rate=0.5)"} == {"leaks"}
    assert all(p.leak_fraction == 0.5 for p in look.points if p.setting == "TopKPruning(rate=0.5)")
    assert not [p for p in look.points if p.setting == "TopKPruning(rate=0.99)"]
    assert "1 audits not rerun yet show their stored record" in (tmp_path / "frontier.md").read_text()

    rerun = frontier(cfg, tmp_path, log=silent)
    assert sorted(job.key for job in rerun.ran) == sorted([leaked_key, private_key])
    assert comparable(rerun.points) == comparable(whole.points)
    assert "not rerun yet" not in (tmp_path / "frontier.md").read_text()


class _Exploding(Defense):
    """Raises on every gradient while ``armed``: a job that fails at run time, after the config checks."""

    armed = True

    def config(self) -> dict:
        return {}

    def transform(self, gradients, state, call):
        if _Exploding.armed:
            raise RuntimeError("exploded on purpose")
        return dict(gradients), state


def test_a_failed_job_neither_ends_the_run_nor_is_stored_and_a_rerun_retries_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setting whose defense raises while its jobs run: the run finishes the other setting, lists
    both failed jobs with their error (result, log, report), stores neither, never calls the broken
    setting private, and the same command again runs exactly those two."""

    def build(params: dict, seed: int, channels: int) -> DefenseSetting:
        return DefenseSetting(setting_name("Exploding", params), [GradientDefense(_Exploding())])

    monkeypatch.setitem(frontier_grid._FAMILIES, "Exploding", Family("Exploding", build))
    cfg = config(grids=[Grid("TopKPruning", "rate", [0.9]), Grid("Exploding", "strength", [1.0])], undefended=False)
    lines: list[str] = []
    first = frontier(cfg, tmp_path, log=lines.append)
    broken = {"train|Exploding(strength=1)|B=1", "audit|Exploding(strength=1)|B=1|round=0"}
    assert {job.key for job, _ in first.failed} == broken
    assert all(error == "RuntimeError: exploded on purpose" for _, error in first.failed)
    assert {job.key for job in first.ran} == {
        "train|TopKPruning(rate=0.9)|B=1",
        "audit|TopKPruning(rate=0.9)|B=1|round=0",
    }
    stored = {json.loads(line)["key"] for line in (tmp_path / RESULTS_FILE).read_text().splitlines()}
    assert stored == {job.key for job in first.ran}
    assert any(line.startswith("Traceback") and "in transform" in line for line in lines)
    assert "2 jobs failed and are missing here" in (tmp_path / "frontier.md").read_text()
    assert not any(p.verdict == "private" for p in first.points if p.setting.startswith("Exploding"))
    monkeypatch.setattr(_Exploding, "armed", False)
    again = frontier(cfg, tmp_path, log=silent)
    assert {job.key for job in again.ran} == broken and again.failed == []


@pytest.mark.simulation
def test_a_two_worker_ray_cluster_gives_the_local_results(tmp_path: Path) -> None:
    """The same run on a local two-worker Ray cluster and in this process: the same points."""
    pytest.importorskip("ray")
    cfg = config(grids=[Grid("TopKPruning", "rate", [0.9])])
    local = frontier(cfg, log=silent)
    distributed = frontier(cfg, tmp_path, workers=2, backend="ray", log=silent)
    assert comparable(distributed.points) == comparable(local.points)
    assert len(distributed.ran) == 4


def test_the_cli_runs_a_frontier_from_yaml_and_resumes(tmp_path: Path, capsys) -> None:
    """``lightning-gp frontier --config``: the YAML's grids reach the run, the files are written,
    and the same command again runs nothing."""
    from lightning_gp.cli import main

    yaml = tmp_path / "frontier.yaml"
    yaml.write_text(
        "model: {class_path: lightning_gp.models.LeNetZhu}\n"
        "datamodule: {class_path: lightning_gp.data.FashionMNISTSampleDataModule, init_args: {batch_size: 500}}\n"
        "grids:\n  - {family: GaussianNoise, knob: scale, values: [0.5], params: {clip: 1.0}}\n"
        "batch_sizes: [1]\nstages: [0]\nimages: 1\ntrain_rounds: 1\nnum_clients: 2\nattacks: [iDLG]\n"
        "budget: {ig_iterations: 2, lbfgs_iterations: 2, rtf_bins: 4}\nlpips: false\nundefended: false\n"
    )
    out = tmp_path / "out"
    main(["frontier", "--config", str(yaml), "--output_dir", str(out)])
    lines = (out / RESULTS_FILE).read_text().splitlines()
    assert [json.loads(line)["key"] for line in lines] == [
        "train|GaussianNoise(clip=1, scale=0.5)|B=1",
        "audit|GaussianNoise(clip=1, scale=0.5)|B=1|round=0",
    ]
    # each job's CPU time beside its wall time (a worker that waits for a core adds none); an audit's
    # covers its cells' and the taps and scoring around them
    records = [json.loads(line)["record"] for line in lines]
    assert all(r["cpu_seconds"] > 0 for r in records)
    cells = records[1]["cells"]
    assert cells and all(c["cpu_seconds"] >= 0 for c in cells) and sum(c["cpu_seconds"] for c in cells) > 0
    assert records[1]["cpu_seconds"] >= sum(c["cpu_seconds"] for c in cells)
    assert {p.name for p in out.iterdir()} >= {"frontier.csv", "frontier.md", "frontier.png"}
    capsys.readouterr()
    main(["frontier", "--config", str(yaml), "--output_dir", str(out)])
    assert "2 jobs (1 audits, 1 trainings); 2 already done" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs").glob("frontier*.yaml")))
def test_the_shipped_frontier_configs_validate(name: str, tmp_path: Path, capsys) -> None:
    """Every strength of the shipped grids is in its defense's range (``--check`` builds each
    setting); the published config on the sample's datamodule, so the check needs no download."""
    from lightning_gp.cli import main

    text = (ROOT / "configs" / f"{name}.yaml").read_text()
    copy = tmp_path / f"{name}.yaml"
    copy.write_text(text.replace("data.FashionMNISTDataModule", "data.FashionMNISTSampleDataModule"))
    main(["frontier", "--config", str(copy), "--check", "true"])
    assert "config ok:" in capsys.readouterr().out


@pytest.mark.parametrize("n", range(12))
def test_coverage_order_is_a_permutation_with_both_ends_first(n: int) -> None:
    order = coverage_order(n)
    assert sorted(order) == list(range(n))
    assert order[:2] == list(range(n))[:1] + ([n - 1] if n > 1 else [])


def test_the_first_jobs_of_a_stage_cover_every_grid_at_both_ends() -> None:
    """Two grids of five strengths and two stages: the undefended run first, then both grids'
    weakest and strongest settings before any strength between; every round-0 job before round 50."""
    cfg = config(grids=[Grid("TopKPruning", "rate", [0.5, 0.6, 0.7, 0.8, 0.9]), Grid("GaussianNoise", "scale",
                 [0.1, 0.2, 0.3, 0.4, 0.5])], stages=[0, 50])  # fmt: skip
    audits = [j for j in frontier_jobs(cfg, 1) if j.kind == "audit"]
    assert [j.stage for j in audits] == [0] * 11 + [50] * 11
    assert [j.setting for j in audits[:5]] == [
        "undefended",
        "TopKPruning(rate=0.5)",
        "GaussianNoise(scale=0.1)",
        "TopKPruning(rate=0.9)",
        "GaussianNoise(scale=0.5)",
    ]


def test_audits_of_settings_that_already_leak_to_both_servers_run_last() -> None:
    """At round 5, Top-k 0.99 (leaked to both servers at round 0) goes after Top-k 0.5 (private to the
    passive server there) and the undefended run (not audited yet); round 0's jobs keep their order.
    A job whose own stored record leaked to both servers (rerun by a stronger attack) goes last too,
    after the later rounds' undecided jobs."""
    cfg = config(stages=[0, 5])
    jobs = frontier_jobs(cfg, 1)

    def audit(verdicts: tuple[str, str]) -> dict:
        return {"kind": "audit", "threats": {t: {"verdict": v} for t, v in zip(("passive", "active"), verdicts)}}

    records = {
        "audit|TopKPruning(rate=0.99)|B=1|round=0": audit(("leaks", "leaks")),
        "audit|TopKPruning(rate=0.5)|B=1|round=0": audit(("private", "leaks")),
    }
    todo = [job for job in jobs if job.key not in records]
    ordered = decisive_first(todo, records)
    assert sorted(ordered, key=todo.index) == todo  # a permutation
    first = [job for job in ordered if job.stage == 0]
    assert first == [job for job in todo if job.stage == 0] and ordered[: len(first)] == first
    assert [job.key for job in ordered[len(first) :]] == [
        "audit|undefended|B=1|round=5",
        "audit|TopKPruning(rate=0.5)|B=1|round=5",
        "audit|TopKPruning(rate=0.99)|B=1|round=5",
    ]
    # a stored round-0 record that leaked to both servers, to be rerun by a stronger attack: it goes
    # after every job that can still change a verdict, round 5's included
    carried = {**records, "audit|undefended|B=1|round=0": audit(("leaks", "leaks"))}
    assert [job.key for job in decisive_first(todo, carried)[-3:]] == [
        "audit|undefended|B=1|round=0",
        "audit|undefended|B=1|round=5",
        "audit|TopKPruning(rate=0.99)|B=1|round=5",
    ]


def test_the_eta_counts_each_job_as_long_as_the_finished_jobs_say_it_takes() -> None:
    """A resumed run's estimates: a job's own stale record, the same setting's audit at another
    stage, else its kind and batch size's mean; the ETA scales the work left by this run's pace (a
    short training done in 2 s where 1 s was expected leaves 340 s for the 170 s of audits), where
    counting jobs says 4 s."""
    cfg = config(stages=[0, 5])
    jobs = {job.key: job for job in frontier_jobs(cfg, 1)}
    records = {
        "train|TopKPruning(rate=0.5)|B=1": {"kind": "train", "seconds": 1.0},  # stale: its job runs again
        "audit|TopKPruning(rate=0.5)|B=1|round=0": {"kind": "audit", "seconds": 100.0},
        "audit|undefended|B=1|round=0": {"kind": "audit", "seconds": 40.0},
    }
    todo = [
        jobs["train|TopKPruning(rate=0.5)|B=1"],
        jobs["audit|TopKPruning(rate=0.5)|B=1|round=5"],
        jobs["audit|TopKPruning(rate=0.99)|B=1|round=0"],
    ]
    estimates = job_estimates([*todo, jobs["train|TopKPruning(rate=0.99)|B=1"]], records)
    assert estimates == {
        "train|TopKPruning(rate=0.5)|B=1": 1.0,
        "audit|TopKPruning(rate=0.5)|B=1|round=5": 100.0,
        "audit|TopKPruning(rate=0.99)|B=1|round=0": 70.0,
        "train|TopKPruning(rate=0.99)|B=1": 1.0,  # the trainings' mean, not every job's
    }
    estimates.pop("train|TopKPruning(rate=0.99)|B=1")
    assert job_estimates(todo, {}) is None
    now = [0.0]
    lines: list[str] = []
    progress = Progress(6, 3, 1, lines.append, estimates=estimates, clock=lambda: now[0])
    assert progress.eta(0.0) == 171.0
    now[0] = 2.0
    progress.update(todo[0], {"kind": "train", "test_acc": 0.5, "seconds": 2.0})
    assert lines[-1].endswith("ETA 0:05:40")  # (100 + 70) * 2 / 1
    counting = Progress(6, 3, 1, lines.append, clock=lambda: now[0])
    now[0] = 4.0
    counting.update(todo[0], {"kind": "train", "test_acc": 0.5, "seconds": 2.0})
    assert lines[-1].endswith("ETA 0:00:04")  # 2 s per job, 2 jobs left: what a resumed run printed before


def test_the_eta_is_not_inflated_by_the_jobs_still_running_when_the_first_finishes() -> None:
    """Two workers, six jobs expected at 100 s but the second's 300 s: when the first ends at 100 s the
    other still runs. Paced by the finished job's own seconds, the 700 s of work left over 2 workers
    is 350 s (a schedule ends it at 400 s: 300 s left); paced by the wall time so far over the work
    finished, as before, it read 700 s."""
    audits = [job for job in frontier_jobs(config(stages=[0, 5]), 1) if job.kind == "audit"][:6]
    keys = [job.key for job in audits]
    estimates = dict(zip(keys, [100.0, 300.0, 100.0, 100.0, 100.0, 100.0]))
    jobs = dict(zip(keys, audits))
    record = {"kind": "audit", "threats": {t: {"verdict": "private"} for t in ("passive", "active")}}
    now = [0.0]
    for labelled in (True, False):
        lines: list[str] = []
        progress = Progress(6, 0, 2, lines.append, estimates=estimates if labelled else None, clock=lambda: now[0])
        now[0] = 100.0
        progress.update(jobs[keys[0]], {**record, "seconds": 100.0})
        # without estimates: 100 s a job, 5 left over 2 workers
        assert lines[-1].endswith("ETA 0:05:50" if labelled else "ETA 0:04:10")
        now[0] = 300.0
        progress.update(jobs[keys[1]], {**record, "seconds": 300.0})
        now[0] = 400.0
        for key in keys[2:5]:
            progress.update(jobs[key], {**record, "seconds": 100.0})
        assert lines[-1].endswith("ETA 0:01:40" if labelled else "ETA 0:02:20")  # one job left, one worker
        progress.update(jobs[keys[5]], {**record, "failed": "killed"})  # no seconds: the pace stands
        assert lines[-1].endswith("ETA 0:00:00")
        now[0] = 0.0


def test_a_fresh_run_estimates_the_audits_left_by_the_audits_it_finished_not_by_the_trainings() -> None:
    """No stored times: once an audit has finished, the audits left count at its 200 s and the
    training left at the finished training's 10 s, (10 + 3 x 200) / 2 workers = 305 s; a mean over
    every finished job said (10 + 200) / 2 x 4 jobs / 2 workers = 210 s."""
    every = frontier_jobs(config(stages=[0, 5]), 1)
    trainings = [job for job in every if job.kind == "train"][:2]
    audits = [job for job in every if job.kind == "audit" and job.batch_size == 1][:4]
    audit = {"kind": "audit", "seconds": 200.0, "threats": {t: {"verdict": "private"} for t in ("passive", "active")}}
    lines: list[str] = []
    for todo, eta in (([*trainings, *audits], "0:05:05"), (None, "0:03:30")):
        progress = Progress(6, 0, 2, lines.append, clock=lambda: 0.0, jobs=todo)
        progress.update(trainings[0], {"kind": "train", "test_acc": 0.5, "seconds": 10.0})
        progress.update(audits[0], audit)
        assert lines[-1].endswith(f"ETA {eta}")


def test_an_audit_of_an_older_leak_rule_reruns_unless_it_leaked_everywhere_and_then_shows_no_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A revision after LEAK_RULE_MONOTONE_SINCE only adds leaks and gaps (revision 4: any output of an
    attack, the per-image control, missing metrics as gaps) and changes the bound. A stored audit of such
    a revision reruns unless it leaked to every server; one that did keeps its verdict, not its bound (it
    could be too small); a stamped record keeps both. A record older than LEAK_RULE_MONOTONE_SINCE
    (revision 5's identification gate can turn a leak into "private") always reruns."""
    from lightning_gp.audit.verdict import LEAK_RULE_MONOTONE_SINCE, LEAK_RULE_REVISION
    from lightning_gp.frontier import run as frontier_run

    leaky = {"verdict": "leaks", "leak_fraction": 0.5}
    record = {"kind": "audit", "threats": {"passive": leaky, "active": leaky}, "rero_eta": 0.8, "rero_kappa": 0.7}
    assert LEAK_RULE_MONOTONE_SINCE == LEAK_RULE_REVISION == 5
    assert has_stale_leak_rule(record) and has_stale_leak_rule({**record, "leak_rule_revision": 4})
    # as it reads where the revisions since a record's only add leaks
    monkeypatch.setattr(frontier_run, "LEAK_RULE_MONOTONE_SINCE", 3)
    assert not has_stale_leak_rule(record)
    assert without_stale_bound(record)["rero_eta"] is None and without_stale_bound(record)["rero_kappa"] is None
    private = {**record, "threats": {"passive": {"verdict": "private"}, "active": leaky}}
    assert has_stale_leak_rule(private)
    stamped = {**private, "leak_rule_revision": LEAK_RULE_REVISION}
    assert not has_stale_leak_rule(stamped) and without_stale_bound(stamped)["rero_eta"] == 0.8


def test_a_budget_field_added_later_leaves_the_fingerprint_as_it_was_at_the_value_results_ran_under(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``refined_decoys`` came after the published frontier's records: at 31, the value they ran under,
    the fingerprint is the one computed without the field (the records stay current); at any other
    value it differs (they run again)."""
    from lightning_gp.frontier import run as frontier_run

    cfg = config(grids=[Grid("TopKPruning", "rate", [0.9])])
    assert cfg.budget.refined_decoys == frontier_run.BUDGET_FIELDS_ADDED["refined_decoys"] == 31
    with_field = frontier_run.fingerprint(cfg)
    stricter = frontier_run.fingerprint(
        dataclasses.replace(cfg, budget=dataclasses.replace(cfg.budget, refined_decoys=255))
    )
    full = frontier_run.asdict
    monkeypatch.setattr(
        frontier_run, "asdict", lambda obj: {k: v for k, v in full(obj).items() if k != "refined_decoys"}
    )
    assert frontier_run.fingerprint(cfg) == with_field != stricter


def test_the_undefended_reference_is_called_the_reference_not_a_ratio_to_itself() -> None:
    # Before: the undefended row read "PMM 1.00, time x0.26, upload 69%" (its time measured against itself
    # in another process, its upload against the dense gradient), which read as errors
    import dataclasses

    from helpers import frontier_point

    from lightning_gp.frontier.report import setting_candidates

    point = dataclasses.replace(
        frontier_point("undefended", 0, "passive", "leaks", 1.0), cost_ratio=0.26, upload_ratio=0.69
    )
    (candidate,) = setting_candidates([point], 1, "passive")
    assert candidate.cost == "the reference, upload 69% of dense (exact zeros go sparse)"
    other = dataclasses.replace(frontier_point("TopKPruning(rate=0.9)", 0, "passive", "leaks", 0.9), upload_ratio=0.13)
    (candidate,) = setting_candidates([other], 1, "passive")
    assert candidate.cost == "PMM 0.90, time x1.00, upload 13%"


# 19 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_the_fedavg_axis_is_a_frontier_of_its_own_measured_against_its_own_undefended_reference(tmp_path: Path) -> None:
    """client_training adds, beside FedSGD, every setting trained E local epochs in local batches: its
    audit attacks the FedAvg update (FedAvgInversion among the attacks), its training runs FedAvg's
    local steps, its PMM divides by the undefended FedAvg run's accuracy, and its recommendation is
    its own. DP-SGD (one step per round on a plain Trainer) is named as not on the FedAvg frontier."""
    fedavg = ClientTraining("fedavg", local_epochs=2, local_batch_size=1)
    cfg = config(
        grids=[Grid("TopKPruning", "rate", [0.5]), Grid("DPSGD", "noise_multiplier", [0.5])],
        batch_sizes=[2],
        images=2,
        client_training=[ClientTraining(), fedavg],
    )
    lines: list[str] = []
    result = frontier(cfg, tmp_path, log=lines.append)
    trainings = {p.training for p in result.points}
    assert trainings == {"FedSGD", "FedAvg E=2, b=1"}
    fed = [p for p in result.points if p.training == "FedAvg E=2, b=1"]
    assert {p.setting for p in fed} == {"undefended [FedAvg E=2, b=1]", "TopKPruning(rate=0.5) [FedAvg E=2, b=1]"}
    assert all(p.client == "2 (FedAvg E=2, b=1)" for p in fed)
    reference = next(p for p in fed if p.setting.startswith("undefended") and p.threat == "passive")
    assert reference.pmm == 1.0  # its own undefended FedAvg run, not the FedSGD one
    assert {r.training for r in result.recommendations} == trainings
    gap = "DPSGD is not on the FedAvg E=2, b=1 frontier"
    assert any(gap in line for line in lines) and gap in (tmp_path / "frontier.md").read_text()
    assert "| 2 (FedAvg E=2, b=1) | passive |" in (tmp_path / "frontier.md").read_text()
    stored = [json.loads(line)["record"] for line in (tmp_path / RESULTS_FILE).read_text().splitlines()]
    fed_audits = [r for r in stored if r["kind"] == "audit" and "FedAvg" in r["setting"]]
    assert len(fed_audits) == 2
    assert all("FedAvgInversion" in {c["attack"] for c in r["cells"]} for r in fed_audits)
    assert [p.training for p in read_csv(tmp_path / "frontier.csv")] == [p.training for p in result.points]
