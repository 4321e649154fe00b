"""Every code block of the README and of the documentation pages (``docs/``) runs as written, so
neither can drift from the API.

``python`` blocks are executed page by page, each page's blocks in order in one namespace of its own
(a later block uses the names an earlier one on the same page imported or built), in a temporary
working directory so the files they write land there. They run exactly as written; only their size
is capped, from outside, so the suite stays CI-sized:

- ``lightning.Trainer`` (``lightning.pytorch.Trainer``, the same class) is a subclass whose
  ``__init__`` caps ``max_steps`` at 2 (2 when not given), ``max_epochs`` at 1 when given, runs
  ``limit_val_batches`` / ``limit_test_batches`` = 1 on the CPU, and turns off the progress bar and
  checkpointing, and the logger unless the block passes one;
- ``FederatedSimulation`` is not capped: its blocks run their clients and local steps as written
  (the PriPrune block's 2 rounds of 10 clients x 3 local steps of LeNetZhu take well under a second);
- ``lightning_gp.attacks.InvertingGradients`` is a subclass whose ``iterations`` is at most 5
  (the pages' attack budgets are 2500; the blocks' other attacks are built, not run);
- ``PrivacyAudit``'s default attackers run 2 L-BFGS iterations of 3 steps (iDLG, one image) or 5
  Adam iterations (Inverting Gradients), and the attacker who knows the defense 5 Adam and 2 L-BFGS
  iterations with one restart (``default_attacks``, ``DEFAULT_ADAPTIVE_BUDGET``; 30, 200, 200 and
  30 in a real run, about half a minute a gradient);
- a semantic test the audit fits on a page's own data (``fit_semantic_test``) trains 3 epochs
  (``STEP_BUDGET`` 24 steps, 240 in a real run).

``bash`` blocks are not run (they are long trainings, attacks and benchmarks), nor the commands the
text gives as inline code: every file a command
line names must exist, every ``--flag`` given to a benchmark script must be one it parses, every
``make`` target must be in the Makefile, and every ``lightning-gp fit|attack|frontier --config ...``
line must parse with ``--print_config`` (in process, nothing trained).

A page whose block needs the optional ``flwr`` extra runs every other block, then the test is
reported skipped with that reason. Every repository file a page names in backticks
(``benchmarks/results/matrix.md``, ``configs/frontier.yaml``, a results file by its bare name) and
every relative link must exist.
"""

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import lightning
import lightning.pytorch
import pytest

import lightning_gp.attacks
from lightning_gp.attacks import registry
from lightning_gp.audit import callback as audit_callback
from lightning_gp.metrics import semantic_test

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]

pytestmark = pytest.mark.usefixtures("one_thread")


def code_blocks(text: str) -> list[tuple[str, str, str]]:
    """``(language, section, code)`` of every fenced block, in order; the section is the last
    heading above it."""
    blocks = []
    section = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"#{1,4} ", line):
            section = line.lstrip("#").strip()
        if line.startswith("```"):
            language = line[3:].strip()
            body = []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((language, section, "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = {page: code_blocks(page.read_text()) for page in PAGES}


def blocks_of(language: str, page: Path | None = None) -> list[tuple[str, str]]:
    pages = PAGES if page is None else [page]
    return [(section, code) for p in pages for lang, section, code in BLOCKS[p] if lang == language]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_block_is_checked_here_and_the_readme_has_its_quick_starts():
    """Python blocks run, bash lines are checked, YAML blocks parse, plain blocks are text; ``{...}`` is
    a MyST directive (a toctree, an API page). A block of another kind fails until it is checked here."""
    languages = {lang for blocks in BLOCKS.values() for lang, _, _ in blocks if not lang.startswith("{")}
    assert languages <= {"python", "bash", "yaml", ""}, languages
    assert len(blocks_of("python", README)) == 3 and len(blocks_of("bash", README)) == 2


@pytest.mark.parametrize("page", [p for p in PAGES if blocks_of("yaml", p)], ids=name)
def test_every_yaml_block_parses(page):
    import yaml

    for section, code in blocks_of("yaml", page):
        assert yaml.safe_load(code) is not None, f"{name(page)}: an empty YAML block in {section}"


class CappedTrainer(lightning.pytorch.Trainer):
    def __init__(self, *args, **kwargs):
        steps = kwargs.get("max_steps", -1)
        kwargs["max_steps"] = 2 if steps is None or steps < 0 else min(steps, 2)
        if kwargs.get("max_epochs") is not None:
            kwargs["max_epochs"] = 1
        kwargs.update(
            accelerator="cpu",
            devices=1,
            limit_val_batches=1,
            limit_test_batches=1,
            enable_progress_bar=False,
            enable_checkpointing=False,
        )
        kwargs.setdefault("logger", False)
        super().__init__(*args, **kwargs)


class CappedInvertingGradients(lightning_gp.attacks.InvertingGradients):
    def __init__(self, *args, iterations: int = 5, **kwargs):
        super().__init__(*args, iterations=min(iterations, 5), **kwargs)


def capped_default_attacks(batch_size: int) -> list:
    if batch_size == 1:
        return [lightning_gp.attacks.IDLG(iterations=2, max_iter=3)]
    return [CappedInvertingGradients(iterations=5)]


@pytest.mark.parametrize("page", [p for p in PAGES if blocks_of("python", p)], ids=name)
def test_every_python_block_runs_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(lightning, "Trainer", CappedTrainer)
    monkeypatch.setattr(lightning.pytorch, "Trainer", CappedTrainer)
    monkeypatch.setattr(lightning_gp.attacks, "InvertingGradients", CappedInvertingGradients)
    monkeypatch.setattr(registry, "_DECLARATIONS", dict(registry._DECLARATIONS))  # a block registers one
    monkeypatch.setattr(
        audit_callback, "DEFAULT_ADAPTIVE_BUDGET", {"iterations": 5, "lbfgs_iterations": 2, "restarts": 1}
    )
    monkeypatch.setattr(audit_callback, "default_attacks", capped_default_attacks)
    monkeypatch.setattr(semantic_test, "STEP_BUDGET", 24)  # a fitted semantic test trains 3 epochs
    namespace: dict = {"__name__": "docs"}
    not_run = []
    for number, (section, code) in enumerate(blocks_of("python", page), 1):
        where = f"{name(page)} python block {number} ({section})"
        if "lightning_gp.flower" in code and importlib.util.find_spec("flwr") is None:
            not_run.append(f"{where} needs the optional Flower extra: pip install 'lightning-gp[flower]'")
            continue
        try:
            exec(compile(code, where, "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{where} failed:\n{code}") from error
    if not_run:
        pytest.skip("every other python block of the page ran; " + "; ".join(not_run))


# --------------------------------------------------------------------------------------------- bash


def command_lines(code: str) -> list[list[str]]:
    lines = []
    for line in code.splitlines():
        line = line.split("  #")[0].strip()
        if line:
            lines.append(shlex.split(line, comments=True))
    return lines


BASH_LINES = [words for _, code in blocks_of("bash") for words in command_lines(code)]


def test_every_bash_line_is_a_known_command():
    assert BASH_LINES, "no bash block found"
    for words in BASH_LINES:
        assert words[0] in {"make", "lightning-gp", ".venv/bin/python"}, f"unchecked command: {words}"


@pytest.mark.parametrize("words", [w for w in BASH_LINES if w[0] == "make"], ids=" ".join)
def test_make_targets_exist(words):
    makefile = (ROOT / "Makefile").read_text()
    for target in words[1:]:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.MULTILINE), f"no make target {target!r}"


@pytest.mark.parametrize("words", [w for w in BASH_LINES if w[0] == ".venv/bin/python"], ids=" ".join)
def test_benchmark_scripts_exist_and_take_the_flags_given(words):
    script = ROOT / words[1]
    assert script.is_file(), f"{words[1]} does not exist"
    source = script.read_text() + (ROOT / "benchmarks" / "_common.py").read_text()
    for flag in (w for w in words[2:] if w.startswith("--")):
        assert f'"{flag}"' in source, f"{words[1]} does not parse {flag}"


@pytest.mark.parametrize("words", [w for w in BASH_LINES if w[0] == "lightning-gp"], ids=" ".join)
def test_cli_lines_name_configs_that_parse(words, tmp_path, monkeypatch, capsys):
    """``lightning-gp fit|attack --config X ...`` as written, plus ``--print_config``: the config and
    every override parse (in this process, from ``tmp_path``), and nothing is trained."""
    from lightning_gp.cli import main

    config = words[words.index("--config") + 1]
    assert (ROOT / config).is_file(), f"{config} does not exist"
    args = [str(ROOT / w) if w == config else w for w in words[1:]]
    if "--print_config" not in args:
        args.append("--print_config")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-gp"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code in (0, None), capsys.readouterr().err[-3000:]
    printed = capsys.readouterr().out
    assert printed.strip(), f"{words} printed no config"


def test_docs_point_only_to_files_in_the_repository():
    """The design notes and paper texts the project was built from are not shipped: no README,
    doc, config or docstring may send a reader to ``DESIGN.md`` or ``papers/``; cite the paper."""
    sources = [README, *(ROOT / "docs").rglob("*.md"), *(ROOT / "configs").rglob("*.yaml")]
    sources += [*(ROOT / "lightning_gp").rglob("*.py"), *(ROOT / "lightning_gp").rglob("*.md")]
    sources += [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").rglob("*.py")]
    offending = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sources
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "DESIGN.md" in line or "papers/" in line
    ]
    assert not offending, f"references to files outside the repository: {offending}"


# ---------------------------------------------------------------------------------- named files

# Where a page's bare file name (`matrix_batch8.md`) is looked up: the results, configs, benchmarks.
LOOKUP = [ROOT, ROOT / "benchmarks" / "results", ROOT / "configs", ROOT / "benchmarks", DOCS]
# Files a run writes into its own output directory (named so a reader finds them there), not the repository's.
RUN_OUTPUTS = {"report.md", "summary.md", "reconstructions.png", "config.yaml", "metrics.csv"}
FILE_NAME = re.compile(r"`([\w./{},-]+\.(?:md|csv|png|py|yaml|jsonl))`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def braces(token: str) -> list[str]:
    """``a_{1,8}.md`` -> ``a_1.md``, ``a_8.md`` (one level, as the pages write them)."""
    match = re.search(r"\{([^{}]*)\}", token)
    if match is None:
        return [token]
    return [
        w for part in match.group(1).split(",") for w in braces(token[: match.start()] + part + token[match.end() :])
    ]


def missing_files(page: Path) -> list[str]:
    text = page.read_text()
    missing = []
    for token in FILE_NAME.findall(text):
        for path in braces(token):
            if path.startswith(("_", "...", "lightning_gp.", "demo_output/", "runs/", "logs/")):
                continue  # a suffix (`_summary.md`), a module, or what a run writes into its own directory
            if Path(path).name in RUN_OUTPUTS:
                continue
            bases = [page.parent, ROOT, ROOT / "lightning_gp"] if "/" in path else LOOKUP
            if not any((base / path).exists() for base in bases):
                missing.append(path)
    for target in LINK.findall(text):
        if "://" not in target and not (page.parent / target).exists():
            missing.append(f"link {target}")
    return missing


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_file_and_link_a_page_names_exists(page):
    assert not missing_files(page), f"{name(page)} names what the repository does not hold"


# In the text, as inline code: `python benchmarks/x.py --flag`, `lightning-gp frontier --config ...`.
INLINE_COMMAND = re.compile(r"`((?:\.venv/bin/)?python (?:benchmarks|tools)/[^`]+|lightning-gp [^`]+)`")
INLINE = sorted({" ".join(c.split()) for page in PAGES for c in INLINE_COMMAND.findall(page.read_text())})
COMMANDS = {"fit", "validate", "test", "predict", "attack", "frontier", "refiner", "--help", "<command>"}


@pytest.mark.parametrize("command", INLINE, ids=str)
def test_every_command_in_the_text_names_a_script_flag_or_config_that_exists(command):
    words = shlex.split(command.replace("...", ""))
    if words[0] == "lightning-gp":
        assert words[1] in COMMANDS, f"no lightning-gp command {words[1]!r}"
        if "--config" in words:
            config = words[words.index("--config") + 1]
            assert (ROOT / config).is_file(), f"{config} does not exist"
        return
    script = ROOT / words[1]
    assert script.is_file(), f"{words[1]} does not exist"
    source = script.read_text() + (ROOT / "benchmarks" / "_common.py").read_text()
    for flag in (w for w in words[2:] if w.startswith("--")):
        assert f'"{flag}"' in source, f"{words[1]} does not parse {flag}"
