"""Short, task-first help for the ``lightning-gp`` commands (the full option lists stay one flag away)."""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path

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


#: Width of the option column and of a help line.
_OPTION_WIDTH, _LINE_WIDTH = 20, 100


def plain(text: str) -> str:
    """A docstring's help text as terminal text: Sphinx roles (``:func:`~a.b.c` `` -> ``c``) and
    literal markup (````x```` -> ``x``) dropped, and its lines joined into one paragraph."""
    text = re.sub(r":[\w:]+:`~([\w.]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    text = re.sub(r":[\w:]+:`([^`]+)`", r"\1", text)
    return " ".join(text.replace("``", "").split())


def _option_line(flag: str, text: str) -> list[str]:
    """``flag`` and its help, wrapped, continuation lines indented under the help column."""
    indent = " " * (_OPTION_WIDTH + 3)
    lines = textwrap.wrap(plain(text), _LINE_WIDTH, initial_indent=indent, subsequent_indent=indent) or [indent]
    head = f"  {flag:<{_OPTION_WIDTH}} "
    if len(flag) > _OPTION_WIDTH:
        return [head.rstrip(), *lines]
    return [head + lines[0][len(indent) :], *lines[1:]]


def short_help(parser: ArgumentParser, *, usage: str, examples: Sequence[str], full_flag: str) -> str:
    """``usage``, then one entry per option of ``parser`` (its help text, not the classes a typed
    option accepts), the examples, and the flag that prints jsonargparse's full help."""
    lines = [f"usage: {usage}", ""]
    if parser.description:
        lines += [plain(parser.description.strip().splitlines()[0]), ""]
    lines.append("options:")
    groups = getattr(parser, "groups", None) or {}
    class_helps = []
    for action in parser._actions:  # jsonargparse keeps argparse's action list
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or flags[0] in ("--help", "--print_config"):
            continue
        if flags[0].endswith(".help"):
            class_helps.append((flags[0], action.help or ""))
            continue
        text = action.help or ""
        group = groups.get(flags[0][2:])
        if group is not None:  # a dataclass option: its own help is the group's title; its fields follow
            text = f"{group.title or ''}: a YAML file of all its fields, or each field as below"
        lines += _option_line(flags[0], text)
    for flag, text in class_helps:
        named = re.search(r"help for (?:the given subclass of )?(\w+)", text)
        target = f" (a {named.group(1)})" if named else ""
        lines += _option_line(f"{flag} C", f"the arguments of class C{target}")
    lines += [
        "",
        "examples:",
        *(f"  {e}" for e in examples),
        "",
        f"All options and the classes they accept: {full_flag}",
    ]
    return "\n".join(lines)


#: The commands whose ``--help`` prints the text stored in :mod:`lightning_gp.cli.help_texts`.
STORED_HELP_COMMANDS = ("attack", "frontier")


def live_help(command: str) -> str:
    """``command``'s short help built from its parser now (imports the command: torch, Lightning)."""
    from importlib import import_module

    text: str = import_module(f"lightning_gp.cli.{command}").help_text()
    return text


def write_help_texts(path: Path | None = None) -> Path:
    """Store every command's live help in ``lightning_gp/cli/help_texts.py``, which ``lightning-gp
    <command> --help`` prints without importing torch (a test fails when it is stale)."""
    path = Path(__file__).with_name("help_texts.py") if path is None else path
    texts = {command: live_help(command) for command in STORED_HELP_COMMANDS}
    # double-quoted, as ruff format writes them (``repr`` picks single quotes where the text has ")
    body = "".join(
        f"    {json.dumps(command)}: {json.dumps(text, ensure_ascii=False)},\n" for command, text in texts.items()
    )
    path.write_text(
        '"""The short help of each command, stored so that ``--help`` prints in a fraction of a second.\n\n'
        "Generated from the parsers by ``python -m lightning_gp.cli.help``; ``tests/test_cli.py`` fails when\n"
        'a parser changed and this file did not."""\n\n'
        f"COMMAND_HELP: dict[str, str] = {{\n{body}}}\n"
    )
    return path


if __name__ == "__main__":
    print(f"written: {write_help_texts()}")
