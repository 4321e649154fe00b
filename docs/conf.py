"""Sphinx configuration: the user guide and results pages are MyST Markdown; the API reference is
generated from the package's docstrings (``make docs`` builds it with warnings as errors)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

project = "lightning-gp"
author = "lightning-gp contributors"
copyright = "2026, lightning-gp contributors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "lightning-gp"
html_static_path: list[str] = []

# The API pages document what each package's ``__all__`` exports; Flower is an optional extra.
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_inherit_docstrings = False  # members a class overrides from Lightning keep no Lightning docstring
autodoc_mock_imports = ["flwr"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
