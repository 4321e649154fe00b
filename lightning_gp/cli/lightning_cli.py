"""``LightningGPCLI``: LightningCLI with subclass mode for models and data, the data built first."""

from __future__ import annotations

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
