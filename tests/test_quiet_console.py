"""The package's own Trainers are quiet; the user's Trainers, logging and warning filters are left alone."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings

import pytest

from lightning_gp.audit import quiet_lightning, tap_fedsgd_round
from lightning_gp.models import LeNetZhu

pytestmark = pytest.mark.usefixtures("one_thread")

BEGIN, END = "=== audit begins ===", "=== audit ends ==="

# Imports torch and Lightning, snapshots logging and warnings, imports every lightning_gp module,
# snapshots again, runs a tiny audit between two markers on stderr, then builds a plain Trainer.
SCRIPT = f"""
import importlib, importlib.util, json, logging, pkgutil, sys, warnings
import lightning as L
import torch

def loggers():
    return {{
        name: [logger.level, logger.propagate, len(logger.handlers), logger.disabled]
        for name, logger in logging.root.manager.loggerDict.items() if isinstance(logger, logging.Logger)
    }}

def snapshot():
    return {{"loggers": loggers(), "root": logging.root.level, "filters": [repr(f) for f in warnings.filters]}}

before_import = snapshot()
import lightning_gp
for module in pkgutil.walk_packages(lightning_gp.__path__, "lightning_gp.", onerror=lambda name: None):
    if module.name.startswith("lightning_gp.flower") and importlib.util.find_spec("flwr") is None:
        continue  # the optional Flower extra is not installed
    if module.name.endswith(".__main__"):
        continue  # an entry point runs its command when imported
    importlib.import_module(module.name)
after_import = snapshot()

from lightning_gp.audit import tap_fedsgd_round
from lightning_gp.data import FashionMNISTSampleDataModule
from lightning_gp.models import LeNetZhu

torch.manual_seed(0)
print({BEGIN!r}, file=sys.stderr, flush=True)
records, _, _ = tap_fedsgd_round(LeNetZhu(), FashionMNISTSampleDataModule(), clients=[0], num_clients=2)
from lightning_gp.audit import defense_catalog, train_setting
# DP-SGD trains on the plain-Trainer runner through Opacus: its internal Trainer and hooks stay quiet too
train_setting(defense_catalog(["DPSGD"])[0].build(0, 1), LeNetZhu(), FashionMNISTSampleDataModule(batch_size=500), rounds=1)
print({END!r}, file=sys.stderr, flush=True)
after_audit = snapshot()
L.Trainer(accelerator="cpu", logger=False)  # the user's own Trainer
print(json.dumps({{"before_import": before_import, "after_import": after_import, "after_audit": after_audit,
                  "records": len(records)}}))
"""


@pytest.fixture(scope="module")
def run():
    # -W default shows every DeprecationWarning, so deprecation noise inside the audit cannot hide.
    result = subprocess.run(
        [sys.executable, "-W", "default", "-c", SCRIPT], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _, rest = result.stderr.split(BEGIN + "\n")
    during, after = rest.split(END + "\n")
    return json.loads(result.stdout.strip().splitlines()[-1]), during, after


def test_the_audit_prints_no_device_banner_tips_or_deprecation_noise(run) -> None:
    report, during, _ = run
    assert report["records"] == 1
    noises = ("GPU available", "TPU available", "HPU available", "Tip:", "litlogger", "Deprecat", "deprecated")
    for noise in (*noises, "no `val_dataloader`", "Full backward hook is firing"):
        assert noise not in during, f"{noise!r} printed during the audit:\n{during}"


def test_a_user_trainer_built_after_the_audit_still_prints_the_banner(run) -> None:
    _, _, after = run
    assert "GPU available: False" in after and "TPU available: False" in after


def test_importing_lightning_gp_changes_no_logging_level_or_warning_filter(run) -> None:
    report, _, _ = run
    before, after = report["before_import"], report["after_import"]
    assert after["filters"] == before["filters"] and after["root"] == before["root"]
    changed = {n: (v, after["loggers"][n]) for n, v in before["loggers"].items() if after["loggers"][n] != v}
    assert changed == {}
    ours = {n: v for n, v in after["loggers"].items() if n.startswith("lightning_gp") and v != [0, True, 0, False]}
    assert ours == {}


def test_the_audit_restores_logging_and_warning_filters(run) -> None:
    report, _, _ = run
    before, after = report["after_import"], report["after_audit"]
    assert after["filters"] == before["filters"] and after["root"] == before["root"]
    assert {n: v for n, v in before["loggers"].items() if after["loggers"].get(n) != v} == {}


def rank_zero_loggers() -> list[logging.Logger]:
    return [
        logging.getLogger(name)
        for name in ("lightning.pytorch.utilities.rank_zero", "lightning_utilities.core.rank_zero")
    ]


def test_quiet_lightning_restores_levels_and_filters_even_on_error(data) -> None:
    loggers = rank_zero_loggers()
    loggers[1].setLevel(logging.ERROR)  # a user's stricter setting is kept, not lowered
    try:
        levels, filters = [lg.level for lg in loggers], list(warnings.filters)
        inside = []

        def fail_inside() -> None:
            with quiet_lightning():
                inside.extend([loggers[0].getEffectiveLevel(), loggers[1].level])
                raise RuntimeError("inside")

        with pytest.raises(RuntimeError, match="inside"):
            fail_inside()
        assert inside == [logging.WARNING, logging.ERROR]
        assert [lg.level for lg in loggers] == levels and warnings.filters == filters
        tap_fedsgd_round(LeNetZhu(), data, clients=[0], num_clients=2)
        assert [lg.level for lg in loggers] == levels and warnings.filters == filters
    finally:
        loggers[1].setLevel(logging.NOTSET)


def test_the_command_line_drops_known_library_noise_and_keeps_lightning_s_own_lines(tmp_path):
    # Before: every `lightning-gp fit` printed the litlogger / litmodels tips, the tensorboardX notice
    # and a LeafSpec deprecation from inside Lightning
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "configs" / "fedsgd_magnitude_pruning.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "lightning_gp.cli", "fit", "--config", str(config), "--trainer.fast_dev_run=true"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    for noise in ("litlogger", "litmodels", "tensorboardX", "LeafSpec"):
        assert noise not in output, noise
    assert "`Trainer.fit` stopped" in output  # Lightning's own lines about the run still show
