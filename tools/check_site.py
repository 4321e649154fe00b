#!/usr/bin/env python3
"""Check the built documentation site as a reader's browser would load it (``make docs`` runs it).

Every page's internal links (``href``) and loaded files (``src``: figures, scripts, styles) must
resolve to a file of the build, a link's ``#fragment`` to an element id on its target page, and the
search index must hold the names a user searches for. External links are not fetched (no network).

    python tools/check_site.py [docs/_build/html]
"""

from __future__ import annotations

import argparse
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

REPO = Path(__file__).resolve().parents[1]
#: Names the search must find: the entry points of the quick starts.
SEARCH_TERMS = ("PrivacyAudit", "DualGradientPruning", "frontier", "FederatedSimulation")


class _Page(HTMLParser):
    """The ids a page defines and the links and loads it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.references: list[tuple[str, str]] = []  # (attribute, value)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name"):
                self.ids.add(value)
            elif name == "src" or (name == "href" and tag in ("a", "link")):
                self.references.append((name, value))


def parse(page: Path) -> _Page:
    parsed = _Page()
    parsed.feed(page.read_text(encoding="utf-8"))
    return parsed


def broken_references(site: Path) -> list[str]:
    """``page: reference (why)`` for every internal link or load of ``site`` that does not resolve."""
    pages = {page: parse(page) for page in sorted(site.rglob("*.html"))}
    broken = []
    for page, parsed in pages.items():
        for attribute, value in parsed.references:
            parts = urlsplit(value)
            if parts.scheme or parts.netloc or value.startswith(("mailto:", "javascript:", "data:")):
                continue  # external: not fetched here
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            where = f"{page.relative_to(site)}: {attribute}={value!r}"
            if not target.is_file():
                broken.append(f"{where} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{where} (no element with that id)")
    return broken


def missing_search_terms(site: Path, terms: tuple[str, ...] = SEARCH_TERMS) -> list[str]:
    """The ``terms`` the search index does not hold (all of them when there is no index)."""
    index = site / "searchindex.js"
    if not index.is_file():
        return list(terms)
    text = index.read_text(encoding="utf-8").lower()
    return [term for term in terms if term.lower() not in text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("site", nargs="?", type=Path, default=REPO / "docs" / "_build" / "html")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"error: no built site at {args.site} (run make docs)", file=sys.stderr)
        return 2
    broken = broken_references(args.site)
    missing = missing_search_terms(args.site)
    for line in broken:
        print(f"broken: {line}", file=sys.stderr)
    for term in missing:
        print(f"search: the index does not hold {term!r}", file=sys.stderr)
    pages = sum(1 for _ in args.site.rglob("*.html"))
    if broken or missing:
        return 1
    print(
        f"site ok: {pages} pages, every internal link and file resolves, the search index holds {', '.join(SEARCH_TERMS)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
