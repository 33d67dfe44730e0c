"""``ga.report``-style pages: one self-contained HTML file per score matrix.

    S = ga.methods.trak(task, train, queries)
    S.to_html("report.html", texts=train_texts, queries=query_texts, k=5, method="trak")
    # or: gradalg report -c run.toml --output report.html

:func:`write_report` (``Scores.to_html``) writes, per query, its text and its top and
bottom ``k`` training documents with their scores, their texts and (with per-token scores)
their tokens highlighted; once, the method's formula, its fidelity note and the plan.
The page needs no network: CSS, SVG figures and the vendored KaTeX (``katex/``, also
served by the docs site) are inlined.

Documents, not ids: ``S.topk(k, texts=...)``, ``ga.store.write(G, path, texts=...)`` and an
index's ``search`` add a ``text`` coordinate (:func:`with_texts`); :func:`documents_frame`
lists id, score and text; :func:`highlight` colours a document's tokens by their scores.
"""
from __future__ import annotations

from .fidelity import FIDELITY, FORMULAS, fidelity_note
from .katex import KATEX_DIR, inline_katex
from .page import report_html, write_report
from .texts import (HighlightedHTML, JsonlTexts, KeyedJsonlTexts, documents_frame, highlight, jsonl_texts,
                    check_texts, text_lookup, texts_for, with_texts)

__all__ = ["write_report", "report_html", "text_lookup", "texts_for", "check_texts", "with_texts", "documents_frame", "jsonl_texts", "JsonlTexts",
           "KeyedJsonlTexts", "highlight", "HighlightedHTML", "fidelity_note", "FIDELITY", "FORMULAS", "KATEX_DIR",
           "inline_katex"]
