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

import sys
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from lightning_gp.cli.shapes import data_built_first, instantiate


class LightningGPCLI(LightningCLI):
    """LightningCLI with subclass mode for models and data, and config saving that overwrites."""

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_kwargs", {"description": "lightning-gp: gradient-privacy defenses for Lightning"})
        super().__init__(
            model_class=None,
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            **kwargs,
        )

    def instantiate_classes(self) -> None:
        """Build the datamodule first and give the model the data's shape arguments
        (:mod:`lightning_gp.cli.shapes`), then build everything as LightningCLI does."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        parser = self._parser(self.subcommand)
        with data_built_first(config, lambda spec: instantiate(parser, Namespace(data=spec)).data) as note:
            if note:
                rank_zero_info(f"lightning-gp: {note}")
            super().instantiate_classes()

    def _dump_config(self) -> None:
        # Lightning's hyperparameter instantiator for LightningDataModules reads the top-level
        # `data` section and fails when it is null, which it is whenever a FederatedSimulation
        # builds its own nested datamodule. Give it the nested section instead.
        super()._dump_config()
        if self.config_dump.get("data") is None:
            model = self.config_dump.get("model") or {}
            self.config_dump["data"] = (model.get("init_args") or {}).get("datamodule") or {}


def main(args: Any = None) -> None:
    """Console entry point (``lightning-gp``): ``attack`` (an audit), ``frontier`` (the privacy-utility
    frontier), ``refiner`` (Refiner tools), else LightningCLI."""
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv in ([], ["-h"], ["--help"]):
        from lightning_gp.cli.help import TOP_HELP

        print(TOP_HELP)
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

    with library_noise_silenced():  # the suite's entry point: known library noise goes, the rest shows
        LightningGPCLI(args=args)


if __name__ == "__main__":
    main()
