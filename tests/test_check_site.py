"""``tools/check_site.py``, which ``make docs`` runs over the built site: it reports every internal
link, fragment and loaded file that does not resolve, and search terms the index lacks."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from check_site import broken_references, main, missing_search_terms


def site(tmp_path: Path, guide: str) -> Path:
    (tmp_path / "guide").mkdir()
    (tmp_path / "_images").mkdir()
    (tmp_path / "_images" / "frontier.png").write_bytes(b"png")
    (tmp_path / "index.html").write_text(
        '<a href="guide/verdict.html#leak-lines">lines</a><img src="_images/frontier.png">'
    )
    (tmp_path / "guide" / "verdict.html").write_text(f'<h2 id="leak-lines">Leak lines</h2>{guide}')
    (tmp_path / "searchindex.js").write_text('Search.setIndex({"terms": {"privacyaudit": 1}})')
    return tmp_path


def test_a_site_whose_links_and_figures_resolve_passes(tmp_path):
    root = site(
        tmp_path, '<a href="../index.html">home</a> <a href="https://pytorch.org">out</a> <a href="#leak-lines">up</a>'
    )
    assert broken_references(root) == []
    assert missing_search_terms(root, ("PrivacyAudit",)) == []


def test_a_missing_page_fragment_or_figure_is_reported_by_page(tmp_path):
    root = site(
        tmp_path, '<a href="bounds.html">b</a> <a href="../index.html#nowhere">x</a> <img src="../_images/gone.png">'
    )
    broken = broken_references(root)
    assert broken == [
        "guide/verdict.html: href='bounds.html' (no such file)",
        "guide/verdict.html: href='../index.html#nowhere' (no element with that id)",
        "guide/verdict.html: src='../_images/gone.png' (no such file)",
    ]
    assert main([str(root)]) == 1


def test_a_term_the_search_index_lacks_fails_the_check(tmp_path):
    root = site(tmp_path, "")
    assert missing_search_terms(root, ("PrivacyAudit", "DualGradientPruning")) == ["DualGradientPruning"]
    assert main([str(tmp_path / "not-built")]) == 2
