"""The rewrite-rule registry: every algebraic simplification the planner may apply.

A rule is a named function ``node -> node | None`` registered for node types with a
priority (lower runs first). :func:`simplify_until_fixpoint` applies the rules bottom-up
until none fires, records each firing (rule, before, after) and fails loudly if the
expression has not converged after ``max_rounds`` rounds.

All rules preserve the value of the expression exactly (tested by differential tests:
rewritten = not rewritten = dense reference).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import PlanError
from ..expr import (Damp, Inner, Inverse, LowRank, Node, Normalize, Precondition, Project, ScaledOp,
                    ScoreSum, Select, Source, SumOp)
from ..expr.base import transform

__all__ = ["Rule", "RULES", "rule", "Firing", "simplify_until_fixpoint", "PlanError"]


@dataclass(frozen=True)
class Rule:
    name: str
    types: tuple[type, ...]
    priority: int
    fn: Callable[[Node], Node | None]
    doc: str


@dataclass(frozen=True)
class Firing:
    """One application of a rule, for the plan's record."""

    rule: str
    before: str
    after: str
    why: str


RULES: list[Rule] = []


def rule(name: str, types, priority: int = 50):
    """Register ``fn`` as rule ``name`` for nodes of ``types``; its docstring says why."""
    def register(fn):
        RULES.append(Rule(name, tuple(types), priority, fn, (fn.__doc__ or "").strip()))
        RULES.sort(key=lambda r: (r.priority, r.name))
        return fn
    return register


# ---------------------------------------------------------------------------- rules
@rule("absorb_precondition", [Inner], priority=10)
def _absorb_precondition(node: Inner):
    """⟨H L_i, R_j⟩ = ⟨L_i, H R_j⟩ for symmetric H: move H into the inner product so the
    executor can apply it to whichever side is smaller."""
    if not node.op.is_identity:
        return None
    if isinstance(node.left, Precondition):
        return Inner(node.left.grads, node.left.op, node.right)
    if isinstance(node.right, Precondition):
        return Inner(node.left, node.right.op, node.right.grads)
    return None


@rule("identity_precondition", [Precondition], priority=5)
def _identity_precondition(node: Precondition):
    """I G = G."""
    return node.grads if node.op.is_identity else None


@rule("full_rank_approximation", [LowRank], priority=5)
def _full_rank_approximation(node: LowRank):
    """A rank-r approximation of blocks with min(out, in) ≤ r is the rows themselves."""
    return node.grads if not node.truncated else None


@rule("zero_damping", [Damp], priority=5)
def _zero_damping(node: Damp):
    """H + 0·I = H."""
    return node.op if node.damping == 0 else None


@rule("merge_damping", [Damp], priority=20)
def _merge_damping(node: Damp):
    """(H + aI) + bI = H + (a + b)I."""
    if isinstance(node.op, Damp) and not (node.relative or node.op.relative):
        note = " + ".join(n for n in (node.op.note, node.note) if n)
        return Damp(node.op.op, node.op.damping + node.damping, note=note)
    return None


@rule("unit_scale", [ScaledOp], priority=5)
def _unit_scale(node: ScaledOp):
    """1 · H = H."""
    return node.op if node.scale == 1.0 else None


@rule("double_inverse", [Inverse], priority=20)
def _double_inverse(node: Inverse):
    """(H⁻¹)⁻¹ = H."""
    return node.op.op if isinstance(node.op, Inverse) and node.method == node.op.method == "auto" else None


@rule("inverse_identity", [Inverse], priority=20)
def _inverse_identity(node: Inverse):
    """I⁻¹ = I."""
    return node.op if node.op.is_identity else None


@rule("flatten_operator_sums", [SumOp], priority=30)
def _flatten_sums(node: SumOp):
    """(A + B) + C = A + B + C: one sum node, resolved in one step."""
    if not any(isinstance(op, SumOp) for op in node.ops):
        return None
    return SumOp(tuple(x for op in node.ops for x in (op.ops if isinstance(op, SumOp) else (op,))))


@rule("flatten_score_sums", [ScoreSum], priority=30)
def _flatten_score_sums(node: ScoreSum):
    """Σ_k c_k (Σ_l d_l S_l) = Σ_{k,l} c_k d_l S_l; a single unit term is the term itself."""
    if len(node.terms) == 1 and node.coefs[0] == 1.0:
        return node.terms[0]
    if not any(isinstance(t, ScoreSum) for t in node.terms):
        return None
    pairs = [pair for c, t in zip(node.coefs, node.terms)
             for pair in ([(c * d, u) for d, u in zip(t.coefs, t.terms)] if isinstance(t, ScoreSum) else [(c, t)])]
    return ScoreSum(tuple(u for _, u in pairs), tuple(c for c, _ in pairs))


@rule("double_normalize", [Normalize], priority=20)
def _double_normalize(node: Normalize):
    """normalize(normalize(G)) = normalize(G)."""
    return node.grads if node.op is None and isinstance(node.grads, Normalize) and node.grads.op is None else None


@rule("select_everything", [Select], priority=5)
def _select_everything(node: Select):
    """Selecting every block, in order, is no selection."""
    return node.grads if node.names == node.grads.space.names else None


@rule("select_into_source", [Select], priority=15)
def _select_into_source(node: Select):
    """Capture only the selected layers: fewer hooks, fewer factors."""
    src = node.grads
    if isinstance(src, Source) and tuple(n for n in src.layers if n in node.names) == node.names:   # in order
        return Source(src.task, src.data, node.names, src.backend, src.objective, src.seed)
    return None


@rule("select_before_project", [Select], priority=15)
def _select_before_project(node: Select):
    """A per-block projection commutes with block selection: select first, project less."""
    inner = node.grads
    if isinstance(inner, Project) and inner.projector.per_block:
        return Project(Select(inner.grads, node.names), inner.projector)
    return None


# ---------------------------------------------------------------------------- driver
def simplify_until_fixpoint(root: Node, *, enabled: bool = True, max_rounds: int = 50):
    """(simplified root, [Firing]) — rules applied bottom-up until none fires."""
    fired: list[Firing] = []
    if not enabled:
        return root, fired
    for _ in range(max_rounds):
        changed = []

        def apply(node):
            for r in RULES:
                out = r.fn(node) if isinstance(node, r.types) else None
                if out is not None and out != node:
                    changed.append(Firing(r.name, node.label, out.label, " ".join(r.doc.split("\n\n")[0].split())))
                    return out
            return None

        root = transform(root, apply)
        fired.extend(changed)
        if not changed:
            return root, fired
    raise PlanError(f"the rewrite stage did not converge in {max_rounds} rounds; rules still firing: "
                    f"{sorted({f.rule for f in fired[-10:]})}. Disable rewrites with "
                    "expr.explain(rewrites=False) and report this expression")


