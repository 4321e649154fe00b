"""The package keeps its functions short: none of lightning_gp/ is over 80 lines (issue 23).

Length is ``end_lineno - lineno + 1`` of the ``def`` node (decorators excluded, docstring included),
for every function and method, nested ones too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_gp

MAX_LINES = 80
PACKAGE = Path(lightning_gp.__file__).parent


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` for every function under ``root`` longer than ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_in_the_package_is_over_80_lines() -> None:
    too_long = long_functions(PACKAGE)
    assert not too_long, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(too_long)


def test_the_length_check_names_a_long_function_and_passes_one_at_the_limit(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    lines = [f"x{i} = {i}" for i in range(MAX_LINES)]
    # a function of exactly MAX_LINES lines (its def and MAX_LINES - 1 statements) passes
    (package / "short.py").write_text("def fits():\n" + "".join(f"    {line}\n" for line in lines[:-1]))
    # a method one line longer, inside a class, is named with its file and line
    (package / "long.py").write_text(
        "class C:\n    def too_long(self):\n" + "".join(f"        {line}\n" for line in lines)
    )
    assert long_functions(package) == [f"pkg/long.py:2 too_long ({MAX_LINES + 1} lines)"]
