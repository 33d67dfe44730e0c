"""One line (title) and a few facts per node, shared by the text and HTML displays."""
from __future__ import annotations

from ..expr import GradNode, Inner, Node, OpNode, ScoreNode


def block_label(block, representation: str | None = None) -> str:
    """A block as a reader knows it: its module path, then its kind and ``(out, in)`` shape
    (bias folded into ``in``), e.g. ``0 (linear 16×9, factored)`` for ``nn.Sequential``'s
    first layer; a projected block reads ``0 (projected 2×2)``. Display only: the API keys
    blocks by the bare name (``G["0"]``)."""
    shape = "×".join(map(str, block.shape))
    extra = f", {representation}" if representation and representation != block.kind else ""
    return f"{block.name or '<root>'} ({block.kind} {shape}{extra})"


def title(node: Node) -> str:
    return node.label


def facts(node: Node) -> list[str]:
    """Shapes, representations and structure of ``node``, as short strings."""
    if isinstance(node, GradNode):
        rep = node.representation
        blocks = ", ".join(block_label(b, rep[b.name]) for b in node.space.blocks[:6])
        more = "" if len(node.space.blocks) <= 6 else f", … {len(node.space.blocks) - 6} more"
        return [f"{node.n:,} examples × {node.space.dim:,} coords", f"blocks: {blocks}{more}"]
    if isinstance(node, OpNode):
        return [f"{node.structure} operator on {node.space.dim:,} coords ({len(node.space.blocks)} blocks)"]
    if isinstance(node, ScoreNode):
        return [f"{node.shape[0]:,} × {node.shape[1]:,}"]
    return []


def operator_chain(op: OpNode) -> str:
    """An operator as the operations that build it, innermost first, without display notes:
    ``ekfac → damp(λ=0.1·mean eig) → inverse``; a sum lists its terms, ``sum(fisher[dense], I)``."""
    name = op.label.split(" [")[0]
    operands = [c for c in op.children if isinstance(c, OpNode)]
    if len(operands) == 1:
        return f"{operator_chain(operands[0])} → {name}"
    if operands:
        return f"{name}({', '.join(operator_chain(c) for c in operands)})"
    return name


def shown_children(node: Node) -> tuple:
    """The children a display shows: all but the identity operator of a plain inner
    product (``Q @ G.T`` is ⟨Q, G⟩, not ⟨Q, I, G⟩)."""
    kids = node.children
    if isinstance(node, Inner):
        kids = tuple(k for k in kids if not (isinstance(k, OpNode) and k.is_identity))
    return kids
