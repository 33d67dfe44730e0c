"""Text rendering of an expression tree (``repr`` of every user object)."""
from __future__ import annotations

from ..expr import Node
from .describe import facts, shown_children, title


def text_tree(node: Node, kind: str, cost: str = "") -> str:
    """``kind`` header with the cost estimate, then one line per node with its facts.

    A sub-expression that appears twice is shown once and then marked ``↑ as above``.
    ``cost`` is the header's estimate line (the caller plans: viz/ sits beside plan/,
    not above it; ``api`` passes ``estimated cost: ...``).
    """
    lines = [f"<{kind}> {cost}".rstrip()]
    seen: set[str] = set()

    def visit(n: Node, prefix: str, last: bool, top: bool):
        branch = "" if top else ("└─ " if last else "├─ ")
        info = "; ".join(facts(n))
        if n.token in seen:
            lines.append(f"{prefix}{branch}{title(n)}  ↑ as above (shared, computed once)")
            return
        seen.add(n.token)
        lines.append(f"{prefix}{branch}{title(n)}" + (f"  [{info}]" if info else ""))
        kids = shown_children(n)
        child_prefix = prefix if top else prefix + ("   " if last else "│  ")
        for i, child in enumerate(kids):
            visit(child, child_prefix, i == len(kids) - 1, False)

    visit(node, "", True, True)
    del visit   # its cell holds it: a cycle left to the cyclic GC
    return "\n".join(lines)
