"""Open every page of the built documentation in headless Chromium, as a reader would.

Checks what a link checker (``tools/check_site.py``, run by ``make docs``) cannot: that each page
loads without a failed request or a script error, that every image renders, and that the search
page returns results. Not part of CI: it needs Debian's Chromium (``apt-get install chromium``) and
Playwright's Python driver (``pip install playwright``; it launches ``/usr/bin/chromium``, it does
not download a browser)::

    python tools/browse_site.py docs/_build/html --screenshot site.png
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
from pathlib import Path

#: The flags that keep Chromium from reaching the network at start.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
QUERIES = ("DualGradientPruning", "PrivacyAudit", "frontier", "inconclusive")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(root: Path) -> str:
    """Serve ``root`` on a free localhost port in a daemon thread; its base URL."""
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/"


def browse(root: Path, chromium: str, screenshot: Path | None) -> list[str]:
    """Every problem found on the site under ``root``; prints what it checked."""
    from playwright.sync_api import sync_playwright

    base = serve(root)
    pages = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.html") if "_sources" not in p.parts)
    problems: list[str] = []
    images = 0
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page()
        failed: list[str] = []
        page.on("requestfailed", lambda r: failed.append(f"{r.url} ({r.failure})"))
        page.on("response", lambda r: failed.append(f"{r.url} HTTP {r.status}") if r.status >= 400 else None)
        page.on("pageerror", lambda e: failed.append(f"script error: {e}"))
        for name in pages:
            failed.clear()
            page.goto(base + name, wait_until="load")
            broken = page.eval_on_selector_all(
                "img", "els => els.filter(e => !(e.complete && e.naturalWidth > 0)).map(e => e.src)"
            )
            images += page.eval_on_selector_all("img", "els => els.length")
            problems += [f"{name}: {f}" for f in failed] + [f"{name}: image did not render: {b}" for b in broken]
        for query in QUERIES:
            page.goto(base + f"search.html?q={query}", wait_until="load")
            try:
                page.wait_for_function(  # Sphinx writes "Search finished, found N pages ..." at the end
                    "(document.querySelector('.search-summary') || {}).innerText?.includes('found')", timeout=20_000
                )
            except Exception:
                problems.append(f"search for {query!r} returned nothing")
                continue
            hits = page.eval_on_selector_all("ul.search li", "els => els.map(e => e.innerText.split('\\n')[0])")
            if not hits:
                problems.append(f"search for {query!r} returned nothing")
                continue
            print(f"search {query!r}: {len(hits)} results, first: {hits[0]}")
        if screenshot is not None:
            page.goto(base + "index.html", wait_until="load")
            page.screenshot(path=str(screenshot))
        browser.close()
    print(f"{len(pages)} pages and {images} images opened in Chromium")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("site", type=Path, help="the built HTML (docs/_build/html)")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--screenshot", type=Path, default=None, help="save the front page as a PNG")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").exists():
        parser.error(f"{args.site} has no index.html: build the site first (make docs)")
    if not Path(args.chromium).exists():
        parser.error(f"no Chromium at {args.chromium}: apt-get install chromium, or pass --chromium")
    problems = browse(args.site.resolve(), args.chromium, args.screenshot)
    print("\n".join(problems) or "no problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
