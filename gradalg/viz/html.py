"""HTML rendering of an expression tree for notebooks (``_repr_html_``).

Small pure functions, CSS shipped as a package resource, collapsible ``<details>``
without JavaScript, every user string escaped.
"""
from __future__ import annotations

import html
from functools import lru_cache
from importlib.resources import files

from ..expr import Node
from .describe import facts, shown_children, title


@lru_cache(maxsize=1)
def _css() -> str:
    return files("gradalg").joinpath("static/style.css").read_text()


def _facts_html(node: Node) -> str:
    out = []
    for fact in facts(node):
        text = html.escape(fact)
        for rep in ("factored", "projected", "dense"):
            text = text.replace(f", {rep})", f', <span class="ga-rep-{rep}">{rep}</span>)')
            text = text.replace(f"({rep} ", f'(<span class="ga-rep-{rep}">{rep}</span> ')
        out.append(f'<span class="ga-fact">{text}</span>')
    return "".join(out)


def _node_html(node: Node, seen: set[str], depth: int) -> str:
    head = f'<span class="ga-title">{html.escape(title(node))}</span>{_facts_html(node)}'
    if node.token in seen:
        return f'<div class="ga-leaf">{head} <span class="ga-shared">(shared: computed once)</span></div>'
    seen.add(node.token)
    kids = shown_children(node)
    if not kids:
        return f'<div class="ga-leaf">{head}</div>'
    inner = "".join(_node_html(k, seen, depth + 1) for k in kids)
    is_open = " open" if depth < 3 else ""
    return f"<details{is_open}><summary>{head}</summary>{inner}</details>"


def html_tree(node: Node, kind: str, cost: str = "") -> str:
    """A self-contained HTML fragment: header with the cost line ``cost`` (given by the caller), then the tree."""
    body = _node_html(node, set(), 0)
    return (f"<style>{_css()}</style><div class=\"ga-expr\"><div class=\"ga-head\">"
            f"{html.escape(kind)} <span class=\"ga-cost\">{html.escape(cost)}</span></div>"
            f"{body}</div>")
