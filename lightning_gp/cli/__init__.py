"""The ``lightning-gp`` command: LightningCLI over every model, datamodule and defense callback.

    lightning-gp fit --config configs/fedsgd_magnitude_pruning.yaml
    lightning-gp fit --config configs/fedsgd_magnitude_pruning.yaml --trainer.fast_dev_run=true
    lightning-gp test --config configs/fedsgd_undefended.yaml --ckpt_path=path/to/last.ckpt
    lightning-gp attack --config configs/attack_inverting_gradients.yaml
    lightning-gp refiner train-evaluator --config configs/refiner_evaluator_1ch.yaml
    lightning-gp frontier --config configs/frontier_quick.yaml

Models, datamodules and callbacks are chosen by class path in the YAML (``class_path:
lightning_gp.callbacks.MagnitudePruning``); any importable LightningModule or datamodule works.
A ``FederatedSimulation`` carries its datamodule inside (``model.init_args.datamodule``), so
federated configs have no top-level ``data`` section.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# Nothing heavy at import: `lightning-gp --help` prints without importing torch or Lightning, and each
# subcommand imports what it runs.


def __getattr__(name: str) -> Any:
    if name == "LightningGPCLI":
        from lightning_gp.cli.lightning_cli import LightningGPCLI

        return LightningGPCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def importable_from_working_directory() -> None:
    """Let a config name the user's own modules (``class_path: mydata.MyCNN`` for ``./mydata.py``) as
    ``python -m`` would: a console script's ``sys.path`` holds its own bin directory, not the working
    directory. Appended, so a local file never shadows an installed package."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)


def main(args: Any = None) -> None:
    """Console entry point (``lightning-gp``): ``attack`` (an audit), ``frontier`` (the privacy-utility
    frontier), ``refiner`` (Refiner tools), else LightningCLI."""
    argv = sys.argv[1:] if args is None else args
    importable_from_working_directory()
    if isinstance(argv, list) and argv in ([], ["-h"], ["--help"]):
        from lightning_gp.cli.help import TOP_HELP

        print(TOP_HELP)
        return
    if isinstance(argv, list) and len(argv) == 2 and argv[1] in ("-h", "--help"):
        from lightning_gp.cli.help_texts import COMMAND_HELP

        if argv[0] in COMMAND_HELP:  # stored: building a command's parser imports torch and Lightning
            print(COMMAND_HELP[argv[0]])
            return
    if isinstance(argv, list) and argv[:1] == ["attack"]:
        from lightning_gp.audit.quiet import library_noise_silenced
        from lightning_gp.cli.attack import main as attack_main

        with library_noise_silenced():
            attack_main(argv[1:])
        return
    if isinstance(argv, list) and argv[:1] == ["frontier"]:
        from lightning_gp.audit.quiet import library_noise_silenced
        from lightning_gp.cli.frontier import main as frontier_main

        with library_noise_silenced():
            frontier_main(argv[1:])
        return
    if isinstance(argv, list) and argv[:1] == ["refiner"]:
        from lightning_gp.refiner.cli import main as refiner_main

        refiner_main(argv[1:])
        return
    from lightning_gp.audit.quiet import library_noise_silenced
    from lightning_gp.cli.lightning_cli import LightningGPCLI

    with library_noise_silenced():  # the suite's entry point: known library noise goes, the rest shows
        LightningGPCLI(args=args)


if __name__ == "__main__":
    main()
