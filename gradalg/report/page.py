"""The report page: one self-contained HTML file of what a score matrix says, per query.

    ga.methods.trak(task, train, queries).to_html("report.html", texts=train_texts,
                                                  queries=query_texts, k=5, method="trak")

For each query: its text (a ``(prompt, completion)`` pair shows the completion marked),
the ``k`` training examples with the highest scores (the ones that helped the query most)
and the ``k`` with the lowest (the most harmful), each with its score, its text and, when
per-token scores are given, its tokens coloured by their score; a bar chart (inline SVG) of
those 2k scores. Once per report: the method, its score formula (typeset by the vendored
KaTeX, inlined), its fidelity note (``gradalg.report.fidelity``) and the plan of the
top-k computation (``S.explain(topk=k)``: its one-line summary, the full text folded).

Everything is in the file: CSS, SVG, KaTeX and its fonts (``data:`` URLs); the page asks
no server for anything. The pieces are small pure functions of their inputs, escaped.
"""
from __future__ import annotations

import html
import math
import numbers
import os
from pathlib import Path

import numpy as np

from ..errors import OptionError
from .fidelity import FORMULAS, fidelity_note
from .katex import inline_katex
from .texts import text_lookup

__all__ = ["write_report", "report_html"]

_CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#fafafa;color:#1d1d1f}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:1.6em;margin:0 0 4px}h2{font-size:1.25em;margin:0 0 8px}h3{font-size:1em;margin:12px 0 6px}
.meta{color:#555;margin:0 0 16px}
section{background:#fff;border:1px solid #ddd;border-radius:8px;padding:16px 20px;margin:0 0 18px}
.formula{margin:8px 0}.note{color:#333}
pre{background:#f3f3f3;padding:8px;overflow-x:auto;font-size:12px}
.query-text{background:#f5f7ff;border-left:4px solid #3f51b5;padding:8px 12px;white-space:pre-wrap}
.completion{background:#fff3c4;border-radius:3px}
.cols{display:flex;gap:18px;flex-wrap:wrap}.cols>div{flex:1 1 420px;min-width:0}
ol.docs{padding-left:22px;margin:0}ol.docs li{margin:0 0 10px}
.score{font-family:ui-monospace,monospace;font-weight:600}.pos{color:#b71c1c}.neg{color:#0d47a1}
.id{color:#666;font-size:.9em}
.doc{white-space:pre-wrap;background:#fbfbfb;border:1px solid #eee;padding:6px 8px;margin-top:3px;
  max-height:12em;overflow:auto;font-size:.93em}
.doc.none{color:#888;font-style:italic}
.tok{border-radius:2px}
"""


def _esc(value) -> str:
    return html.escape(str(value), quote=True)


def _fmt(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.4g}"


def text_html(text) -> str:
    """A text as HTML: a ``(prompt, completion)`` pair shows the completion marked; None: a
    note that no text was given."""
    if text is None:
        return "<div class='doc none'>(no text given)</div>"
    if isinstance(text, tuple) and len(text) == 2:
        prompt, completion = text
        return f"<div class='query-text'>{_esc(prompt)}<span class='completion'>{_esc(completion)}</span></div>"
    return f"<div class='doc'>{_esc(text)}</div>"


def tokens_html(tokens, values) -> str:
    """Tokens coloured by their scores: red where the token helped the query (positive),
    blue where it hurt, the strength ``|v| / max |v|`` over the document; NaN (padding) and
    tokens beyond the scores are left white. ``tokens``: (T,) strings; ``values``: (T',)."""
    values = np.asarray(values, dtype=float)
    finite = values[np.isfinite(values)]
    vmax = float(np.abs(finite).max()) if finite.size else 0.0
    out = []
    for j, tok in enumerate(tokens):
        v = values[j] if j < len(values) else float("nan")
        if not math.isfinite(v) or vmax == 0.0:
            out.append(f"<span class='tok'>{_esc(tok)}</span>")
            continue
        a = min(abs(v) / vmax, 1.0) * 0.85
        rgb = "211,47,47" if v > 0 else "25,118,210"
        out.append(f"<span class='tok' style='background:rgba({rgb},{a:.2f})' title='{_fmt(v)}'>{_esc(tok)}</span>")
    return "<div class='doc tokens'>" + "".join(out) + "</div>"


def bars_svg(labels, values, *, width: int = 520, row: int = 16) -> str:
    """A horizontal bar chart (inline SVG) of ``values`` (n,) labelled by ``labels`` (n,):
    bars right of the axis for positive scores (red), left for negative (blue)."""
    values = np.asarray(values, dtype=float)
    finite = values[np.isfinite(values)]
    vmax = float(np.abs(finite).max()) if finite.size and np.abs(finite).max() > 0 else 1.0
    label_w, pad = 150, 6
    half = (width - label_w - 2 * pad) / 2
    axis = label_w + pad + half
    height = row * len(values) + 2 * pad
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img' "
             f"aria-label='scores of the documents shown'>",
             f"<line x1='{axis:.1f}' y1='0' x2='{axis:.1f}' y2='{height}' stroke='#999'/>"]
    for i, (label, v) in enumerate(zip(labels, values)):
        y = pad + i * row
        w = 0.0 if not math.isfinite(v) else abs(v) / vmax * half
        x = axis if v >= 0 else axis - w
        colour = "#d32f2f" if v >= 0 else "#1976d2"
        parts.append(f"<text x='{label_w}' y='{y + row - 4}' font-size='11' text-anchor='end'>{_esc(label)}</text>")
        parts.append(f"<rect x='{x:.1f}' y='{y + 2}' width='{w:.1f}' height='{row - 4}' fill='{colour}'>"
                     f"<title>{_esc(label)}: {_fmt(v)}</title></rect>")
    parts.append("</svg>")
    return "".join(parts)


def _documents(title: str, train_ids, values, text_of, token_html_of) -> str:
    items = []
    for tid, v in zip(train_ids, values):
        body = token_html_of(tid)
        if body is None:
            body = text_html(text_of(tid))
        sign = "pos" if v > 0 else "neg" if v < 0 else ""
        items.append(f"<li><span class='score {sign}'>{_fmt(float(v))}</span> "
                     f"<span class='id'>training example {_esc(tid)}</span>{body}</li>")
    return f"<div><h3>{_esc(title)}</h3><ol class='docs'>{''.join(items)}</ol></div>"


def _token_lookup(token_scores, tokens):
    """A function (query id, train id) → token-highlighted HTML, or None when no per-token
    scores are given for the pair."""
    if token_scores is None:
        if tokens is not None:
            raise OptionError("tokens= colours the training documents by per-token scores: pass token_scores= "
                              "too, e.g. (Q @ H @ G.per_token().T).compute(), or leave tokens= out")
        return lambda q, t: None
    dims = tuple(getattr(token_scores, "dims", ()))
    if set(dims) != {"query", "train", "train_token"}:
        raise OptionError(f"token_scores= takes the per-token scores of the training documents, dims "
                          f"('query', 'train', 'train_token') from (Q @ H @ G.per_token().T).compute(); got dims "
                          f"{dims}")
    if tokens is None:
        raise OptionError("token_scores= needs the tokens' strings: tokens={train id: [str, ...]} or a function "
                          "train id -> list of strings (e.g. tokenizer.convert_ids_to_tokens of its input_ids)")
    grid = token_scores.transpose("query", "train", "train_token")
    rows = {(q.item() if hasattr(q, "item") else q): i for i, q in enumerate(grid["query"].values)}
    cols = {(t.item() if hasattr(t, "item") else t): i for i, t in enumerate(grid["train"].values)}
    values = np.asarray(grid.values)
    fetch = tokens if callable(tokens) and not isinstance(tokens, dict) else tokens.get

    def lookup(q, t):
        q, t = (q.item() if hasattr(q, "item") else q), (t.item() if hasattr(t, "item") else t)
        strings = fetch(t)
        if q not in rows or t not in cols or strings is None:
            return None
        return tokens_html(list(strings), values[rows[q], cols[t]])
    return lookup


def report_html(scores, *, texts=None, queries=None, k: int = 5, method: str | None = None,
                title: str | None = None, token_scores=None, tokens=None, math: bool = True,
                executor=None) -> str:
    """The report of ``scores`` (lazy :class:`~gradalg.api.Scores`, (n_query, n_train)) as
    one HTML string; :func:`write_report` writes it. Parameters as :func:`write_report`."""
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1:
        raise OptionError(f"k= is how many top and bottom training examples to show per query: a positive "
                          f"integer, got {k!r}")
    k = int(k)
    expr = scores.expr
    text_of = text_lookup(texts, list(expr.col_ids), what="texts")
    query_of = text_lookup(queries, list(expr.row_ids), what="queries")
    token_html_of = _token_lookup(token_scores, tokens)
    top = scores.topk(k, executor=executor)                      # (n_query, k)
    bottom = scores.topk(k, largest=False, executor=executor)    # (n_query, k), lowest first
    plan = scores.explain(topk=k)
    n_query, n_train = scores.shape
    name = method or "(method not named)"
    title = title or f"gradalg report: {name}"

    formula = FORMULAS.get(method or "")
    if formula is None:
        formula_html = ""
    elif math:
        formula_html = f"<div class='formula gradalg-math'>$${_esc(formula)}$$</div>"
    else:
        formula_html = f"<div class='formula'><code>{_esc(formula)}</code></div>"
    head = (f"<section class='method'><h2>Method: {_esc(name)}</h2>{formula_html}"
            f"<p class='note'><b>Fidelity.</b> {_esc(fidelity_note(method))}</p>"
            f"<p><b>Scores.</b> Higher means the training example helped the query more (removing it "
            f"would raise the query's loss); the expression is in the plan below.</p>"
            f"<p><b>Plan.</b> {_esc(plan.summary())}</p>"
            f"<details><summary>the plan of the top-{k} computation</summary><pre>{_esc(plan)}</pre></details>"
            f"</section>")

    sections = []
    for qi, qid in enumerate(top["query"].values):
        top_ids, top_v = top["train"].values[qi], top.values[qi]
        bot_ids, bot_v = bottom["train"].values[qi], bottom.values[qi]               # lowest (most harmful) first
        labels = [f"#{t}" for t in list(top_ids) + list(bot_ids[::-1])]
        chart = bars_svg(labels, np.concatenate([top_v, bot_v[::-1]]))               # descending
        qtext = query_of(qid)
        query_block = "" if qtext is None else (text_html(qtext) if isinstance(qtext, tuple)
                                               else f"<div class='query-text'>{_esc(qtext)}</div>")
        docs = (_documents(f"Top {len(top_ids)}: helped most", top_ids, top_v, text_of,
                           lambda t, q=qid: token_html_of(q, t)) +
                _documents(f"Bottom {len(bot_ids)}: hurt most", bot_ids, bot_v, text_of,
                           lambda t, q=qid: token_html_of(q, t)))
        sections.append(f"<section class='query'><h2>Query {_esc(qid)}</h2>{query_block}"
                        f"<div class='chart'>{chart}</div><div class='cols'>{docs}</div></section>")

    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{_esc(title)}</title><style>{_CSS}</style>{inline_katex() if math else ''}</head>"
            f"<body><main><h1>{_esc(title)}</h1><p class='meta'>{n_query} queries × {n_train} training examples; "
            f"top and bottom {k} per query</p>{head}{''.join(sections)}</main></body></html>")


def write_report(scores, path, *, texts=None, queries=None, k: int = 5, method: str | None = None,
                 title: str | None = None, token_scores=None, tokens=None, math: bool = True,
                 executor=None) -> Path:
    """Write the report of ``scores`` to ``path``: one self-contained HTML file (inline CSS,
    SVG and KaTeX; no network) with, per query, its text and its top and bottom ``k``
    training examples with their scores and texts; once, the method, its formula, its
    fidelity note and the plan. Returns the path.

    Parameters
    ----------
    scores : lazy :class:`~gradalg.api.Scores`, (n_query, n_train); computed here twice as a
        streaming top-k (``S.topk(k)`` and ``S.topk(k, largest=False)``), never as the full matrix.
    texts : the training examples' texts: a list (n_train,) in data order, a dict
        {train id: text} or a function train id -> text.
    queries : the queries' texts, as ``texts`` (n_query,); a text may be a
        ``(prompt, completion)`` pair, shown with the completion marked.
    k : how many top and bottom training examples per query.
    method : the ``ga.methods`` name of the method that made ``scores`` (its formula and
        fidelity note; None: not shown).
    token_scores : per-token scores of the training documents, an xarray DataArray with dims
        ("query", "train", "train_token") (``(Q @ H @ G.per_token().T).compute()``): the
        documents shown are coloured token by token. Needs ``tokens``.
    tokens : the training documents' token strings: {train id: [str, ...]} or a function.
    math : inline KaTeX (about 0.6 MB) to typeset the formula; False writes it as TeX.
    executor : as ``Scores.compute``.
    """
    path = Path(os.fspath(path))
    page = report_html(scores, texts=texts, queries=queries, k=k, method=method, title=title,
                       token_scores=token_scores, tokens=tokens, math=math, executor=executor)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
