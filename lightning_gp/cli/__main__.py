"""``python -m lightning_gp.cli``: the ``lightning-gp`` command."""

from lightning_gp.cli import main

main()
