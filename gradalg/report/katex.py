"""The vendored KaTeX (``gradalg/report/katex/``, KaTeX 0.19.1, MIT license), for pages that
must typeset math without a network: the docs site serves the files (``docs/tooling/hooks.py``
copies them to ``assets/katex/``), the report inlines them.

``inline_katex()`` returns the ``<style>`` and ``<script>`` elements of a self-contained page:
katex.min.css with its woff2 fonts as ``data:`` URLs, katex.min.js, auto-render and
``render-math.js`` (which typesets ``$…$`` / ``$$…$$`` inside elements of class
``gradalg-math``). About 0.6 MB of HTML.
"""
from __future__ import annotations

import base64
import re
from functools import lru_cache
from pathlib import Path

__all__ = ["KATEX_DIR", "KATEX_VERSION", "inline_katex"]

KATEX_DIR = Path(__file__).resolve().parent / "katex"
"""The vendored KaTeX files (JS, CSS, woff2 fonts, its LICENSE), served by the docs site and inlined in reports."""
KATEX_VERSION = "0.19.1"
_FONT = re.compile(r"url\((fonts/[^)]+\.woff2)\)")


def _font_data_url(match: re.Match) -> str:
    data = base64.b64encode((KATEX_DIR / match.group(1)).read_bytes()).decode("ascii")
    return f"url(data:font/woff2;base64,{data})"


@lru_cache(maxsize=1)
def inline_katex() -> str:
    """``<style>`` + ``<script>`` elements that typeset the math of a page offline."""
    css = _FONT.sub(_font_data_url, (KATEX_DIR / "katex.min.css").read_text(encoding="utf-8"))
    scripts = [(KATEX_DIR / name).read_text(encoding="utf-8")
               for name in ("katex.min.js", "auto-render.min.js", "render-math.js")]
    scripts = [re.sub(r"</(script)", r"<\\/\1", s, flags=re.I) for s in scripts]   # would end the element
    return f"<style>{css}</style>\n" + "\n".join(f"<script>{s}</script>" for s in scripts)
