"""The package's layering: no import cycles anywhere, the pure layers stay pure, the top level is small.

The static graph counts every import of a package module anywhere in a file (module level, inside
functions, under ``TYPE_CHECKING``) and every module named in a string to ``importlib.import_module``
or ``__import__`` (a lazy re-export), so a cycle hidden behind a local or lazy import is still a
cycle. ``python tests/test_import_graph.py`` prints the layers' graph.
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


def _lazy_target(node: ast.AST) -> str | None:
    """The module a call ``importlib.import_module("lightning_gp...")`` / ``__import__(...)`` loads."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    first = node.args[0]
    if name in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value if first.value.startswith("lightning_gp") else None
    return None


def imported_modules(path: Path) -> set[str]:
    """Every ``lightning_gp`` module ``path`` imports, wherever the import statement stands, lazy
    imports by name included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        lazy = _lazy_target(node)
        if lazy is not None:
            found.add(lazy)
        elif isinstance(node, ast.Import):
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


@pytest.mark.parametrize(
    "package", ["callbacks", "pipeline", "audit", "frontier", "attacks", "defenses", "metrics", "federated"]
)
def test_a_package_s_modules_import_each_other_without_a_cycle_and_never_its_face(package):
    edges = graph(package)
    try:
        list(TopologicalSorter(edges).static_order())
    except CycleError as err:
        pytest.fail(f"import cycle among lightning_gp.{package} modules: {err.args[1]}")
    # no submodule reaches back into the package __init__ (which imports all of them)
    for path in (PACKAGE / package).glob("*.py"):
        if path.name != "__init__.py":
            assert f"lightning_gp.{package}" not in imported_modules(path), path.name


def test_the_stage_interfaces_depend_on_no_other_pipeline_module():
    # stages.py names SharedGradientPipeline for typing and builds an empty one lazily; nothing else
    assert graph("pipeline")["lightning_gp.pipeline.stages"] <= {"lightning_gp.pipeline.pipeline"}


#: A package face's lazy re-export of names that moved up a floor (file -> the modules it names):
#: resolved on attribute access only, so the layer below never imports the floor above.
LAZY_COMPATIBILITY = {"audit/__init__.py": {"lightning_gp.frontier"}}


def layer_graph() -> dict[str, set[str]]:
    """Layers as modules of one graph: a subpackage depends on another if any of its files imports it."""
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    layers |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    edges: dict[str, set[str]] = {layer: set() for layer in layers}
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "__init__.py":
            continue  # the package's face re-exports names from the layers, lazily
        layer = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for module in imported_modules(path) - LAZY_COMPATIBILITY.get(path.relative_to(PACKAGE).as_posix(), set()):
            parts = module.split(".")
            if len(parts) > 1 and parts[1] in layers and parts[1] != layer:
                edges[layer].add(parts[1])
    return edges


def test_the_lazy_import_scan_sees_importlib_and_dunder_import(tmp_path):
    source = tmp_path / "lazy.py"
    source.write_text(
        "import importlib\n"
        "def __getattr__(name):\n"
        "    return importlib.import_module('lightning_gp.audit.callback').PrivacyAudit\n"
        "def other():\n"
        "    return __import__('lightning_gp.metrics')\n"
    )
    assert imported_modules(source) == {"lightning_gp.audit.callback", "lightning_gp.metrics"}


def test_no_import_cycle_between_the_package_layers():
    edges = layer_graph()
    try:
        list(TopologicalSorter(edges).static_order())
    except CycleError as err:
        pytest.fail(f"import cycle between lightning_gp layers: {err.args[1]}")
    # the pure layers know nothing of Lightning's adapters
    for pure in ("defenses", "attacks", "metrics", "records", "validation", "normalization", "named_tensors"):
        assert "callbacks" not in edges[pure], f"lightning_gp.{pure} imports lightning_gp.callbacks"


FLOOR = {"validation", "seeding", "functional", "named_tensors", "normalization", "optim", "records"}
#: What each layer may import (docs/architecture.md, "Layers and what each may import").
MAY_IMPORT: dict[str, set[str]] = {
    **dict.fromkeys(FLOOR, FLOOR),
    "defenses": FLOOR,
    "privacy": FLOOR,
    "dp_sgd": FLOOR,
    "models": FLOOR,
    "data": FLOOR,
    "augmentation": FLOOR | {"models", "data"},
    "attacks": FLOOR | {"defenses", "models", "augmentation"},
    "refiner": FLOOR | {"models", "data", "attacks"},
    "metrics": FLOOR | {"attacks", "refiner"},
    "pipeline": FLOOR | {"defenses"},
    "callbacks": FLOOR | {"defenses", "pipeline", "attacks", "privacy", "dp_sgd"},
    "federated": FLOOR | {"defenses", "pipeline", "privacy"},
}
_BELOW_AUDIT = set(MAY_IMPORT) | {"augmentation", "refiner", "metrics"}
MAY_IMPORT["priprune"] = _BELOW_AUDIT
MAY_IMPORT["flower"] = _BELOW_AUDIT
MAY_IMPORT["audit"] = _BELOW_AUDIT | {"priprune", "flower"}
MAY_IMPORT["frontier"] = MAY_IMPORT["audit"] | {"audit"}


def test_every_layer_imports_only_what_the_architecture_allows():
    edges = layer_graph()
    unknown = sorted(set(edges) - set(MAY_IMPORT) - {"cli"})
    assert not unknown, f"layers missing from docs/architecture.md and MAY_IMPORT: {unknown}"
    broken = {layer: sorted(imports - MAY_IMPORT[layer]) for layer, imports in edges.items() if layer in MAY_IMPORT}
    broken = {layer: imports for layer, imports in broken.items() if imports}
    assert not broken, f"imports the architecture does not allow (layer -> forbidden layers): {broken}"
    # nothing but the command line imports the command line
    assert all("cli" not in imports for layer, imports in edges.items() if layer != "cli")


#: The only modules allowed at the top of ``lightning_gp/``: floor-1 utilities that import no other layer.
FLOOR_ONE = {"functional", "named_tensors", "normalization", "optim", "records", "seeding", "validation"}


def test_the_top_level_holds_only_packages_and_floor_one_utilities():
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert modules <= FLOOR_ONE, f"top-level modules outside the floor-1 utilities: {sorted(modules - FLOOR_ONE)}"
    edges = layer_graph()
    for utility in modules:
        assert edges[utility] <= FLOOR_ONE, f"lightning_gp.{utility} imports {sorted(edges[utility] - FLOOR_ONE)}"


def test_audit_modules_import_each_other_without_a_cycle_and_never_the_package_face():
    edges = graph("audit")
    try:
        order = list(TopologicalSorter(edges).static_order())
    except CycleError as err:
        pytest.fail(f"import cycle among lightning_gp.audit modules: {err.args[1]}")
    assert order.index("lightning_gp.audit.verdict") < order.index("lightning_gp.audit.setting_audit")
    assert not edges["lightning_gp.audit.verdict"] and not edges["lightning_gp.audit.quiet"]
    for path in (PACKAGE / "audit").glob("*.py"):
        if path.name != "__init__.py":
            assert "lightning_gp.audit" not in imported_modules(path), path.name
    # nothing below the audit reaches up into it
    for layer in ("attacks", "callbacks", "defenses", "federated", "metrics", "models", "data"):
        assert "audit" not in layer_graph()[layer], f"lightning_gp.{layer} imports lightning_gp.audit"


def run_fresh(script: str) -> None:
    """Run ``script`` in a fresh interpreter; it must end by printing ``ok``."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_each_callbacks_and_pipeline_module_imports_alone():
    """Each module imported first, in a fresh interpreter state of the package (cycles that only
    break for one import order show up here)."""
    modules = sorted([*graph("callbacks"), *graph("pipeline")])
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('lightning_gp')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
        "print('ok')\n"
    )
    run_fresh(script)


def test_the_package_face_exports_what_it_names_and_stays_light():
    script = (
        "import sys, lightning_gp\n"
        "assert sorted(lightning_gp.__all__) == sorted(lightning_gp._FACE)\n"
        "assert not [m for m in sys.modules if m.startswith('lightning_gp.')], 'import lightning_gp loaded subpackages'\n"
        "for name in lightning_gp.__all__:\n"
        "    assert getattr(lightning_gp, name).__name__ == name, name\n"
        "print('ok')\n"
    )
    run_fresh(script)


if __name__ == "__main__":
    for layer, imports in sorted(layer_graph().items()):
        print(f"{layer:14} -> {', '.join(sorted(imports)) or '-'}")


def test_the_frontier_is_a_floor_above_the_audit_which_never_imports_it():
    edges = layer_graph()
    assert "audit" in edges["frontier"]
    below = [layer for layer, imports in edges.items() if "frontier" in imports and layer != "cli"]
    assert not below, f"layers below the frontier import it: {below}"
    # the audit's only mention is its face's lazy re-export of the names that moved (no module-level import)
    for path in (PACKAGE / "audit").glob("*.py"):
        named = {m for m in imported_modules(path) if m.startswith("lightning_gp.frontier")}
        assert named <= LAZY_COMPATIBILITY.get(f"audit/{path.name}", set()), path.name


def test_the_names_that_moved_to_the_frontier_still_resolve_from_the_audit_with_a_deprecation_warning():
    import lightning_gp.audit as audit
    import lightning_gp.frontier as frontier

    assert set(audit.MOVED_TO_FRONTIER) == set(frontier.__all__)
    for name in sorted(audit.MOVED_TO_FRONTIER):
        with pytest.warns(DeprecationWarning, match=f"lightning_gp.frontier.{name}"):
            assert getattr(audit, name) is getattr(frontier, name)
    with pytest.raises(AttributeError, match="no_such_name"):
        audit.no_such_name
