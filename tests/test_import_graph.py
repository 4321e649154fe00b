"""The package's layering: no import cycles among the callbacks, and the pure layers stay pure.

The static graph counts every import of a package module anywhere in a file (module level, inside
functions, under ``TYPE_CHECKING``), so a cycle hidden behind a local import is still a cycle.
``python tests/test_import_graph.py`` prints the callbacks' graph.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_gp"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every ``lightning_gp`` module ``path`` imports, wherever the import statement stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("lightning_gp"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_gp"):
            found.add(node.module)
            # `from lightning_gp.callbacks import base` imports the submodule too
            found.update(
                f"{node.module}.{alias.name}"
                for alias in node.names
                if (PACKAGE.parent / f"{node.module}.{alias.name}".replace(".", "/")).with_suffix(".py").exists()
            )
    return found


def graph(subpackage: str) -> dict[str, set[str]]:
    """Import edges among the modules of ``lightning_gp.<subpackage>`` (the package ``__init__`` excluded:
    it imports every submodule by design, and no submodule may import it)."""
    folder = PACKAGE / subpackage
    modules = {module_name(p): p for p in folder.glob("*.py") if p.name != "__init__.py"}
    return {name: {m for m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}


def test_callbacks_modules_import_each_other_without_a_cycle():
    edges = graph("callbacks")
    try:
        list(TopologicalSorter(edges).static_order())
    except CycleError as err:
        pytest.fail(f"import cycle among lightning_gp.callbacks modules: {err.args[1]}")
    assert not edges["lightning_gp.callbacks.interfaces"]  # the interfaces depend on no adapter
    # no submodule reaches back into the package __init__ (which imports all of them)
    for path in (PACKAGE / "callbacks").glob("*.py"):
        if path.name != "__init__.py":
            assert "lightning_gp.callbacks" not in imported_modules(path), path.name


def test_no_import_cycle_between_the_package_layers():
    """Layers as modules of one graph: a subpackage depends on another if any of its files imports it."""
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    layers |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    edges: dict[str, set[str]] = {layer: set() for layer in layers}
    for path in PACKAGE.rglob("*.py"):
        layer = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for module in imported_modules(path):
            parts = module.split(".")
            if len(parts) > 1 and parts[1] in layers and parts[1] != layer:
                edges[layer].add(parts[1])
    try:
        list(TopologicalSorter(edges).static_order())
    except CycleError as err:
        pytest.fail(f"import cycle between lightning_gp layers: {err.args[1]}")
    # the pure layers know nothing of Lightning's adapters
    for pure in ("defenses", "attacks", "metrics", "records", "validation", "normalization", "named_tensors"):
        assert "callbacks" not in edges[pure], f"lightning_gp.{pure} imports lightning_gp.callbacks"


def test_each_callbacks_module_imports_alone():
    """Each module imported first, in a fresh interpreter state of the package (cycles that only
    break for one import order show up here)."""
    modules = sorted(graph("callbacks"))
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('lightning_gp')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


if __name__ == "__main__":
    for module, imports in sorted(graph("callbacks").items()):
        short = module.removeprefix("lightning_gp.callbacks.")
        print(f"{short:14} -> {', '.join(sorted(m.removeprefix('lightning_gp.callbacks.') for m in imports)) or '-'}")
