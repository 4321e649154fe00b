"""Short, task-first help for the ``lightning-gp`` commands (the full option lists stay one flag away)."""

from __future__ import annotations

from collections.abc import Sequence

from jsonargparse import ArgumentParser

#: what ``lightning-gp --help`` (or no arguments) prints
TOP_HELP = """usage: lightning-gp <command> [options]

Train with a gradient defense, attack what a client shares, and score what leaks.

commands:
  fit        train from a config: a Trainer with defense callbacks (LightningCLI;
             also validate, test, predict)
  attack     attack one FedSGD round's shared gradients and score the reconstructions
  frontier   sweep defenses over their strengths: which setting keeps images private, at what cost
  refiner    Refiner tools: train-evaluator (the network that rates robust data)

examples:
  lightning-gp fit --config configs/fedsgd_magnitude_pruning.yaml
  lightning-gp fit --config configs/fedsgd_magnitude_pruning.yaml --trainer.fast_dev_run=true
  lightning-gp attack --config configs/attack_inverting_gradients.yaml
  lightning-gp frontier --config configs/frontier_quick.yaml --output_dir runs/frontier_quick
  lightning-gp refiner train-evaluator --config configs/refiner_evaluator_1ch.yaml

Every option of a command: lightning-gp fit --help, lightning-gp attack --help-full.
The configs in configs/ show every defense, attack and dataset; docs/architecture.md the design."""


def short_help(parser: ArgumentParser, *, usage: str, examples: Sequence[str], full_flag: str) -> str:
    """``usage``, then one line per option of ``parser`` (its help text, not the classes a typed
    option accepts), the examples, and the flag that prints jsonargparse's full help."""
    lines = [f"usage: {usage}", ""]
    if parser.description:
        lines += [parser.description.strip().splitlines()[0], ""]
    lines.append("options:")
    for action in parser._actions:  # jsonargparse keeps argparse's action list
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or flags[0] in ("--help", "--print_config") or flags[0].endswith(".help"):
            continue
        lines.append(f"  {flags[0]:<20} {action.help or ''}".rstrip())
    if any(f.endswith(".help") for a in parser._actions for f in a.option_strings):
        lines.append(f"  {'--<option>.help C':<20} the init_args of class C, e.g. --attack.help InvertingGradients")
    lines += [
        "",
        "examples:",
        *(f"  {e}" for e in examples),
        "",
        f"All options and the classes they accept: {full_flag}",
    ]
    return "\n".join(lines)
