"""The lightning-gp command and the demo, run the way a user runs them."""

import io
import json
import logging
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_gp.cli import main as cli_main
from lightning_gp.cli.attack import main as attack_main
from lightning_gp.cli.demo import main as demo_main
from lightning_gp.cli.demo import parse_args as parse_demo_args

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
# attack_*: `lightning-gp attack`; refiner_evaluator_*: `lightning-gp refiner train-evaluator`;
# frontier*: `lightning-gp frontier` (tests/test_frontier.py)
FIT_CONFIGS = [c for c in CONFIGS if not c.stem.startswith(("attack_", "refiner_evaluator_", "frontier"))]
ATTACK_CONFIGS = [c for c in CONFIGS if c.stem.startswith("attack_")]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@dataclass
class Output:
    stdout: str
    stderr: str  # also Lightning's log lines, which a fresh process writes to stderr


@pytest.fixture
def cli(tmp_path, capsys, monkeypatch):
    """Run a command's ``main(argv)`` in this process, in ``tmp_path``, and return what it printed.

    A fresh interpreter per call costs seconds of imports; the ``python -m`` entry points and the
    console script are run once each in a real process below. ``cli(main, args)`` asserts that the
    command succeeded; ``cli(main, args, fails=True)`` that it failed (exited non-zero or raised) and
    returns the error with what it printed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-gp"])  # as a fresh process sees it, not pytest's arguments

    def call(main, args: list[str], fails: bool = False) -> Output:
        log = io.StringIO()
        handler = logging.StreamHandler(log)
        lightning_log = logging.getLogger("lightning.pytorch")  # where rank_zero_info logs
        lightning_log.addHandler(handler)
        capsys.readouterr()
        error = None
        try:
            main(args)
        except SystemExit as stop:
            if stop.code not in (0, None):
                error = f"exit status {stop.code}"
        except Exception as exc:
            error = "".join(traceback.format_exception(exc))
        finally:
            lightning_log.removeHandler(handler)
        captured = capsys.readouterr()
        output = Output(captured.out, captured.err + log.getvalue() + (error or ""))
        if fails:
            assert error is not None, f"{args} succeeded:\n{output.stdout[-3000:]}"
        else:
            assert error is None, f"{args} failed:\n{output.stdout[-3000:]}\n{output.stderr[-3000:]}"
        return output

    return call


def test_configs_exist_for_an_undefended_and_a_defended_fedsgd_run():
    names = {c.stem for c in CONFIGS}
    assert {"fedsgd_undefended", "fedsgd_magnitude_pruning"} <= names


@pytest.mark.parametrize("config", FIT_CONFIGS, ids=lambda c: c.stem)
def test_every_config_runs_a_fast_dev_run(config, cli):
    result = cli(cli_main, ["fit", "--config", str(config), "--trainer.fast_dev_run=true"])
    assert "`Trainer.fit` stopped" in result.stdout + result.stderr


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_validate_and_test_subcommands_evaluate_the_simulated_model(subcommand, cli):
    config = ROOT / "configs" / "fedsgd_undefended.yaml"
    result = cli(
        cli_main,
        [subcommand, "--config", str(config), "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1"],
    )
    assert f"{'val' if subcommand == 'validate' else 'test'}_acc" in result.stdout


def test_defended_config_puts_the_defense_on_the_trainer(tmp_path):
    # `python -m lightning_gp.cli` itself, in a fresh process, once
    config = ROOT / "configs" / "fedsgd_magnitude_pruning.yaml"
    result = run([sys.executable, "-m", "lightning_gp.cli", "fit", "--config", str(config), "--print_config"], tmp_path)
    assert "lightning_gp.callbacks.MagnitudePruning" in result.stdout and "rate: 0.8" in result.stdout


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "lightning-gp"
    assert script.exists(), "pip install -e . should install the lightning-gp console script"
    assert "fit" in subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120).stdout


def test_bad_config_value_is_reported_by_name(tmp_path, cli):
    text = (ROOT / "configs" / "fedsgd_magnitude_pruning.yaml").read_text()
    assert "rate: 0.8" in text
    config = tmp_path / "bad.yaml"
    config.write_text(text.replace("rate: 0.8", "rate: 1.5"))
    result = cli(cli_main, ["fit", "--config", str(config), "--trainer.fast_dev_run=true"], fails=True)
    assert "rate must be in [0, 1]" in result.stderr


@pytest.mark.parametrize("config", ATTACK_CONFIGS, ids=lambda c: c.stem)
def test_every_attack_config_writes_its_report(config, tmp_path, cli):
    args = ["attack", "--config", str(config), "--output_dir", str(tmp_path / "out"), "--clients", "[0]"]
    if "iterations:" in config.read_text():
        args.append("--attack.init_args.iterations=3")
    cli(cli_main, args)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["attack"] and len(report["clients"]) == 1
    assert set(report["private"]) >= {"psnr", "ssim", "lpips"}
    # one attack alone never says private: only the worst case over every attack can
    assert 0.0 <= report["leak_fraction"] <= 1.0 and report["verdict"] in ("leaks", "inconclusive")
    assert report["threat_model"] == ("active" if "robbing" in config.name else "passive")
    assert report["verdict"] == "leaks" or any("one attack alone" in r for r in report["verdict_reasons"])
    assert "blank" in report["baselines"]
    assert (tmp_path / "out" / "reconstructions.png").stat().st_size > 1000
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| psnr |" in text and "Images leaked (PSNR > 20 dB, SSIM > 0.5, semantic score > " in text
    assert "Threat model: a " in text
    assert "private?" not in text  # one rule, stated once: no per-metric "private" column beside it


def test_attack_command_reports_a_bad_config_by_name(tmp_path, cli):
    config = tmp_path / "bad.yaml"
    config.write_text((ROOT / "configs" / "attack_idlg.yaml").read_text().replace("iterations: 300", "iterations: 0"))
    result = cli(cli_main, ["attack", "--config", str(config)], fails=True)
    assert "iterations must be a positive int" in result.stderr


# 20 s: a long check, left out of make test; make test-slow and CI run it
@pytest.mark.slow
def test_demo_reports_cost_and_worst_case_verdicts_with_the_adaptive_attacks(tmp_path, cli):
    # two of the default defenses and two images: the whole pipeline at a fraction of the default run's
    # cost (the adaptive L-BFGS attack's 4 starts per client are most of it)
    cli(
        demo_main,
        [
            "--rounds",
            "4",
            "--defenses",
            "undefended",
            "TopKPruning",
            "--images",
            "2",
            "--ig-iterations",
            "5",
            "--idlg-iterations",
            "15",
            "--no-lpips",
            "--output-dir",
            str(tmp_path / "out"),
        ],
    )
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    training = report["training"]
    assert [r["setting"] for r in training] == ["undefended", "TopKPruning(rate=0.8)"]
    undefended, topk = training
    assert undefended["upload_ratio"] == pytest.approx(1.0)
    assert topk["upload_ratio"] < 0.35
    assert all(0.0 <= r["test_acc"] <= 1.0 for r in training)
    audits = {a["defense"]: a for a in report["audit"]}
    assert list(audits) == [r["setting"] for r in training]
    # every attack of the setting either ran (a cell) or is listed as not run: none goes missing
    for defense, expected in (
        ("TopKPruning(rate=0.8)", {"iDLG", "IG", "RtF", "adaptive:DefenseAwareInversion", "adaptive:DefenseAwareIDLG"}),
        ("undefended", {"iDLG", "IG", "RtF"}),
    ):
        ran = {c["attack"] for c in audits[defense]["cells"]}
        assert ran | set(report["not_run"][defense]) == expected and not ran & set(report["not_run"][defense])
    kinds = {(c["attack"], c["kind"]) for c in audits["TopKPruning(rate=0.8)"]["cells"]}
    assert ("adaptive:DefenseAwareInversion", "adaptive") in kinds  # the adaptive attacks run first
    assert not any(c["kind"] == "adaptive" for c in audits["undefended"]["cells"])
    # iDLG rebuilds both undefended images, so nothing after it runs: the verdicts could not change
    idlg = next(c for c in audits["undefended"]["cells"] if c["attack"] == "iDLG")
    assert idlg["means"]["psnr"] > 40 and idlg["leak_fraction"] == 1.0
    assert report["not_run"]["undefended"] == ["IG", "RtF"]
    for threat in ("passive", "active"):
        worst = audits["undefended"][threat]
        assert worst["threat_model"] == threat and worst["verdict"] == "leaks" and worst["leak_fraction"] == 1.0
        assert worst["batch_size"] == 2
    text = (tmp_path / "out" / "report.md").read_text()
    assert "**worst case, passive**" in text and "**worst case, active**" in text
    assert "## Verdicts" in text and "Trivial baseline" in text and "Against a malicious server" in text
    assert "2 clients, one image each" in text
    assert "| undefended | IG | not run | every attacked image had already leaked" in text
    assert "Not run, as every image had already leaked to an attack run before: IG, RtF" in text
    assert "2 of 2 images leak (worst-case PSNR at least" in text  # a lower bound once attacks were skipped
    assert (tmp_path / "out" / "audit_TopKPruning_rate_0_8.png").exists()
    assert (tmp_path / "out" / "taps" / "TopKPruning_rate_0_8" / "round0_client0.pt").exists()


def test_the_demo_defaults_to_undefended_top_k_and_dgp_on_eight_images_and_checks_its_arguments():
    args = parse_demo_args([])
    assert args.defenses == ["undefended", "TopKPruning", "DualGradientPruning"] and args.images == 8
    assert args.workers == min(os.cpu_count() or 1, 3) and not args.every_attack
    assert parse_demo_args(["--defenses", "TopKPruning"]).defenses == ["undefended", "TopKPruning"]
    for bad in (["--images", "0"], ["--images", "3001"], ["--rounds", "0"], ["--workers", "0"]):
        with pytest.raises(SystemExit):
            parse_demo_args(bad)


def test_demo_refuses_an_unknown_defense(tmp_path):
    # `python -m lightning_gp.cli.demo` itself, in a fresh process, once
    result = subprocess.run(
        [sys.executable, "-m", "lightning_gp.cli.demo", "--defenses", "Nope", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode != 0 and "the catalogue has" in result.stderr


def test_a_seeded_attack_run_is_bit_identical_and_names_the_tapped_defenses(tmp_path):
    """The model is built after the seed (it was built before it: each run attacked another model),
    and a report on tap files names the defenses the tap recorded, not the config's."""
    from lightning_gp.audit import tap_fedsgd_round
    from lightning_gp.callbacks import TopKPruning
    from lightning_gp.data import FashionMNISTSampleDataModule
    from lightning_gp.models import LeNetZhu

    config = str(ROOT / "configs" / "attack_inverting_gradients.yaml")
    common = ["--config", config, "--attack.init_args.iterations=3", "--lpips=false", "--clients", "[0]", "--seed", "0"]
    first = attack_main([*common, "--output_dir", str(tmp_path / "a")])
    second = attack_main([*common, "--output_dir", str(tmp_path / "b")])
    for a, b in zip(first, second):
        assert torch.equal(a.reconstruction.images, b.reconstruction.images)
        assert a.report.means == b.report.means

    records, _, _ = tap_fedsgd_round(LeNetZhu(), FashionMNISTSampleDataModule(), defenses=[TopKPruning(rate=0.8)])
    tap = records[0].save(tmp_path / "tap.pt")
    attack_main([*common, "--tap_files", f"[{tap}]", "--output_dir", str(tmp_path / "taps")])
    report = json.loads((tmp_path / "taps" / "report.json").read_text())
    assert [d.split("(")[0] for d in report["defenses"]] == ["TopKPruning"]  # the config says MagnitudePruning
    assert "TopKPruning" in (tmp_path / "taps" / "report.md").read_text().splitlines()[0]


def test_top_level_help_is_short_and_lists_every_command(capsys):
    # Before: `lightning-gp --help` was LightningCLI's and listed neither attack nor refiner
    from lightning_gp.cli import main

    main(["--help"])
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 30
    for command in ("fit", "attack", "refiner", "lightning-gp attack --help-full"):
        assert command in text


def test_top_level_help_imports_neither_torch_nor_lightning():
    # Before: `lightning-gp --help` imported LightningCLI first, 28 s on a loaded machine
    script = (
        "import sys\nfrom lightning_gp.cli import main\nmain(['--help'])\n"
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "[]" and "commands:" in done.stdout


@pytest.mark.parametrize("command", ["attack", "frontier"])
def test_a_command_s_stored_help_is_its_parser_s_help_and_prints_without_torch(command):
    # Before: `attack --help` took 42 s and `frontier --help` 38 s on a loaded machine (torch, Lightning)
    from lightning_gp.cli.help import live_help
    from lightning_gp.cli.help_texts import COMMAND_HELP

    assert COMMAND_HELP[command] == live_help(command), "stale: run python -m lightning_gp.cli.help"
    script = (
        f"import sys\nfrom lightning_gp.cli import main\nmain([{command!r}, '--help'])\n"
        "print(sorted(m for m in ('torch', 'lightning', 'jsonargparse') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "[]" and done.stdout.startswith(f"usage: lightning-gp {command}")


def test_frontier_help_shows_plain_text_and_only_its_own_options(capsys):
    # Before: `--budget` read "Path to a configuration file", docstrings showed raw :func: markup,
    # and the last line suggested --attack.help, an option frontier does not have
    from lightning_gp.cli.frontier import main as frontier_main

    frontier_main(["--help"])
    text = capsys.readouterr().out
    assert ":func:" not in text and "``" not in text and "--attack.help" not in text
    assert "--budget             the attacks' budget: a YAML file of all its fields" in text
    assert "--grids.help C       the arguments of class C (a Grid)" in text
    assert all(len(line) <= 100 for line in text.splitlines() if not line.startswith("  lightning-gp"))


def test_frontier_help_describes_every_budget_field():
    # Before: --budget.generative_max_steps printed an empty description (its text sat inside
    # generative_prior's docstring entry)
    from dataclasses import fields

    from lightning_gp.audit import AttackBudget
    from lightning_gp.cli.help_texts import COMMAND_HELP

    lines = COMMAND_HELP["frontier"].splitlines()
    for field in fields(AttackBudget):
        option = f"--budget.{field.name}"
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(option))
        inline = lines[at].strip()[len(option) :].strip()
        assert inline or (lines[at + 1].strip() and not lines[at + 1].strip().startswith("--")), option


def test_a_config_names_a_model_class_from_a_module_in_the_working_directory(tmp_path, monkeypatch, capsys):
    # Before: `class_path: mydata.MyCNN` failed with "No module named 'mydata'" until PYTHONPATH=.
    (tmp_path / "lgp_user_models.py").write_text(
        "from lightning_gp.models import ImageClassifier, LeNetZhu\n\n"
        "class MyClassifier(ImageClassifier):\n"
        "    def __init__(self, lr: float = 0.1):\n"
        "        super().__init__(LeNetZhu(), lr=lr)\n"
    )
    config = tmp_path / "mine.yaml"
    config.write_text(
        "model:\n  class_path: lgp_user_models.MyClassifier\n  init_args: {lr: 0.05}\n"
        "data:\n  class_path: lightning_gp.data.FashionMNISTSampleDataModule\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.setattr(sys, "argv", ["lightning-gp"])
    with pytest.raises(SystemExit) as done:
        cli_main(["fit", "--config", str(config), "--print_config"])
    assert done.value.code in (0, None), capsys.readouterr().err[-3000:]
    assert "lgp_user_models.MyClassifier" in capsys.readouterr().out
    assert sys.path[-1] == str(tmp_path)  # appended: a local file never shadows an installed package


def test_attack_help_is_short_and_the_full_one_is_one_flag_away(capsys):
    # Before: `lightning-gp attack --help` was 634 lines, most of them every torch.nn.Module subclass
    from lightning_gp.cli.attack import main as attack_main

    assert attack_main(["--help"]) == []
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 40 and "--config" in text and "--tap_files" in text
    assert "torch.nn.modules" not in text
    with pytest.raises(SystemExit) as done:
        attack_main(["--help-full"])
    assert done.value.code == 0 and len(capsys.readouterr().out.splitlines()) > 100


def test_the_attack_report_states_the_rero_bound_of_a_clipped_gaussian_and_none_otherwise(tmp_path):
    config = str(ROOT / "configs" / "attack_inverting_gradients.yaml")
    common = ["--config", config, "--attack.init_args.iterations=2", "--lpips=false", "--clients", "[0]", "--seed", "0"]
    noise = '[{"class_path": "lightning_gp.callbacks.GaussianNoise", "init_args": {"scale": 1.0, "clip": 1e-4}}]'
    attack_main([*common, "--defenses", noise, "--output_dir", str(tmp_path / "noise")])
    bounded = json.loads((tmp_path / "noise" / "report.json").read_text())["rero"]
    assert bounded["kappa"] <= bounded["eta"] <= 1.0 and "GaussianNoise" in bounded["mechanism"]
    assert "ReRo bound: no attack succeeds on more than eta" in (tmp_path / "noise" / "report.md").read_text()
    pruning = '[{"class_path": "lightning_gp.callbacks.TopKPruning", "init_args": {"rate": 0.5}}]'
    attack_main([*common, "--defenses", pruning, "--output_dir", str(tmp_path / "pruned")])
    unbounded = json.loads((tmp_path / "pruned" / "report.json").read_text())["rero"]
    assert unbounded["eta"] is None and unbounded["reason"].startswith("no formal bound")
    assert "no formal bound" in (tmp_path / "pruned" / "report.md").read_text()
