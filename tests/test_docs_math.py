"""Math on the docs site renders offline: every page with formulas, opened in headless
Chromium, shows KaTeX output (``class="katex"``), no raw ``$…$`` / ``$$…$$`` / ``\\(…\\)``
left in its text, and asks nothing of any server but the site's own.

The site is built once by the ``site`` fixture of ``tests/test_docs.py`` (``mkdocs build
--strict``); the browser tests skip when no ``chromium`` is installed.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from chromium import dump_dom, serve, visible_text
from test_docs import ROOT, site  # noqa: F401 - the module fixture that builds the site

KATEX = ROOT / "gradalg" / "report" / "katex"
_DOLLAR = re.compile(r"\$[^$\s][^$]*\$")


def formula_pages(site_dir: Path) -> list[str]:
    """Site paths of the pages with formulas: notebooks whose markdown cells hold ``$…$``,
    and pages where ``pymdownx.arithmatex`` marked a formula."""
    pages = []
    for folder in ("notebooks", "tutorials"):
        for nb in sorted((ROOT / folder).glob("*.ipynb")):
            cells = json.loads(nb.read_text())["cells"]
            text = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
            if _DOLLAR.search(text):
                pages.append(f"{folder}/{nb.stem}.html")
    for page in sorted(site_dir.rglob("*.html")):
        rel = page.relative_to(site_dir).as_posix()
        if rel not in pages and 'class="arithmatex"' in page.read_text():
            pages.append(rel)
    return pages


def test_katex_is_vendored_small_and_licensed():
    files = {p.relative_to(KATEX).as_posix() for p in KATEX.rglob("*") if p.is_file()}
    assert {"katex.min.js", "katex.min.css", "auto-render.min.js", "render-math.js", "LICENSE"} <= files
    css = (KATEX / "katex.min.css").read_text()
    fonts = set(re.findall(r"url\((fonts/[^)]+)\)", css))
    assert fonts and all((KATEX / f).is_file() for f in fonts), "katex.min.css names a font that is not vendored"
    assert sum(p.stat().st_size for p in KATEX.rglob("*") if p.is_file()) < 700_000
    assert "MIT" in (KATEX / "LICENSE").read_text()


def test_katex_ships_in_the_wheel():
    import tomllib
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gradalg"]
    for name in ("katex.min.js", "katex.min.css", "auto-render.min.js", "render-math.js", "LICENSE",
                 "fonts/KaTeX_Main-Regular.woff2"):
        assert any(Path("report/katex", name).match(pattern) for pattern in data), (name, data)


def test_site_serves_katex_and_no_cdn(site):  # noqa: F811
    site_dir, _ = site
    assert (site_dir / "assets" / "katex" / "katex.min.js").is_file()
    assert (site_dir / "assets" / "katex" / "fonts" / "KaTeX_Main-Regular.woff2").is_file()
    pages = formula_pages(site_dir)
    assert len(pages) >= 5, pages
    for rel in pages:
        html = (site_dir / rel).read_text()
        assert "assets/katex/katex.min.js" in html, rel
        assert "mathjax" not in html.lower(), f"{rel} still loads MathJax"
        loaded = re.findall(r'<(?:script|img|link|iframe)\b[^>]*\b(?:src|href)="((?:https?:)?//[^"]+)"', html)
        assert not [u for u in loaded if "rel=" not in u], f"{rel} loads {loaded}"


def test_every_formula_page_renders_in_chromium(site, tmp_path):  # noqa: F811
    site_dir, _ = site
    pages = formula_pages(site_dir)
    with serve(site_dir) as base:
        for rel in pages:
            dom, requested = dump_dom(f"{base}/{rel}", tmp_path)
            assert dom.count('class="katex"') >= 1, f"{rel}: KaTeX rendered nothing"
            text = visible_text(dom)
            assert "$$" not in text and not _DOLLAR.search(text) and "\\(" not in text, \
                f"{rel}: raw TeX left: {(_DOLLAR.search(text) or [text[:0]])[0]!r}"
            outside = [u for u in requested if not u.startswith(base)]
            assert not outside, f"{rel} asked other servers for {outside}"
            assert any(u.endswith("katex.min.js") for u in requested), requested
