"""How kept rows are stored, per block: ``"factors"`` (n·T_b·(in + out) numbers) or
``"flat"`` (n·dim), and the decisions that record it (part of the decide stage)."""
from __future__ import annotations

from ..expr import AdamPrecondition, GradNode, Identity, Inner, Normalize, Precondition, Project
from ..expr.lowrank import lowrank_below
from .cost import _si
from .decisions import Decision, DecisionKind
from .facts import Facts
from .graph import ROW_WISE, stream_root
from .memory import positions, rows_bytes

__all__ = ["storage", "as_captured", "is_factored", "held_storage", "storage_decision", "low_rank_decision"]


def _kron_factored(node: GradNode, block: str, facts: Facts) -> bool:
    root = node
    while isinstance(root, ROW_WISE) and not isinstance(root, Project):
        if isinstance(root, (Precondition, AdamPrecondition)) or (isinstance(root, Normalize) and root.op):
            return False
        root = root.grads
    return isinstance(root, Project) and root.projector.kind == "kron" and \
        stream_root(root.grads) is not None and facts.representation(root.grads).get(block) == "factored"


def is_factored(node: GradNode, block: str, facts: Facts) -> bool:
    """Whether ``node``'s rows of ``block`` arrive as factors (A, D): captured so, or
    through a Kronecker projection of factored rows."""
    rep = facts.representation(node)[block]
    return rep == "factored" or (rep == "projected" and _kron_factored(node, block, facts))


def _factored_blocks(node: GradNode, facts: Facts) -> list:
    return [b for b in node.space.blocks if len(b.shape) == 2 and is_factored(node, b.name, facts)]


def storage(node: GradNode, facts: Facts, need_factors: frozenset = frozenset()) -> dict[str, str]:
    """How kept rows are stored, per block: "factors" (n·T_b·(in+out) numbers) or "flat"
    (n·dim), whichever is smaller under ``ga.options(row_storage="auto")``, else as that
    option forces; factors where a consumer needs them (``need_factors``: K-FAC
    statistics) or ``ga.options(ghost="always")`` forces ghost kernels. Blocks that are
    not factored are flat."""
    T = positions(node)
    forced = facts.options.ghost == "always"  # ghost kernels need the factors kept
    mode = facts.options.row_storage
    factored = {b.name for b in _factored_blocks(node, facts)}
    out = {}
    for b in node.space.blocks:
        keep = b.name in factored and (forced or b.name in need_factors or mode == "factors"
                                       or (mode == "auto" and T[b.name] * (b.shape[0] + b.shape[1]) < b.dim))
        out[b.name] = "factors" if keep else "flat"
    return out


def as_captured(node: GradNode, facts: Facts) -> dict[str, str]:
    """Rows kept as the pass produces them: factored blocks as factors, others flat."""
    factored = {b.name for b in _factored_blocks(node, facts)}
    return {b.name: "factors" if b.name in factored else "flat" for b in node.space.blocks}


def held_storage(held: GradNode, kernels: dict, inner: Inner, facts: Facts) -> dict[str, str]:
    """The held rows' storage: :func:`storage`, except that a block whose kernel is
    dense in an unpreconditioned product is kept flat under ``row_storage="auto"``: the
    dense kernel multiplies the flat rows, so keeping the factors too would hold the
    block twice (factors and their materialization)."""
    kept = storage(held, facts)
    if facts.options.row_storage != "auto" or not isinstance(inner.op, Identity):
        return kept
    return {name: "flat" if how == "factors" and kernels.get(name) == "dense" else how
            for name, how in kept.items()}


def storage_decision(node: GradNode, kept: dict, kind: DecisionKind, facts: Facts) -> Decision | None:
    """The factors-vs-flat decision for kept rows (``kind``: held or stored rows), when
    some block could be either."""
    factored = _factored_blocks(node, facts)
    if not factored:
        return None
    kinds = sorted({kept[b.name] for b in factored})
    chosen = kinds[0] if len(kinds) == 1 else ", ".join(
        f"{k} for {sum(kept[b.name] == k for b in factored)} block(s)" for k in kinds)
    as_factors = {**kept, **{b.name: "factors" for b in factored}}
    as_flat = {**kept, **{b.name: "flat" for b in factored}}
    mode = facts.options.row_storage
    why = ("per block the smaller of its factors, T·(in + out) numbers per row, and its flat "
           "gradient, out·in" if mode == "auto" else f"forced by ga.options(row_storage={mode!r})")
    T = positions(node)
    if mode == "auto" and kind is DecisionKind.HELD_STORAGE and any(
            kept[b.name] == "flat" and T[b.name] * sum(b.shape) < b.dim for b in factored):
        why += "; flat where the block's kernel is dense (it multiplies the flat rows: not kept twice)"
    if facts.options.ghost == "always":
        why += "; factors kept for ghost kernels (ga.options(ghost='always'))"
    return Decision(kind, node.token, chosen,
                    {"factors": f"{_si(rows_bytes(node, as_factors, facts.dtype))}B",
                     "flat": f"{_si(rows_bytes(node, as_flat, facts.dtype))}B"}, why, label=repr(node.label))


def low_rank_decision(held: GradNode, facts: Facts) -> Decision | None:
    """What a rank-r approximation of the held rows keeps (``G.low_rank(r)``,
    ``query_gradient_rank=``): its bytes against the exact rows', per truncated block."""
    low = lowrank_below(held)
    if low is None:
        return None
    r, names = low.rank, low.truncated
    kept = [b.name for b in low.space.blocks if b.name not in names]
    exact = rows_bytes(low.grads, storage(low.grads, facts), facts.dtype)   # as the exact rows would be kept
    approx = rows_bytes(low, storage(low, facts), facts.dtype)
    return Decision(
        DecisionKind.LOW_RANK, held.token, f"rank-{r} factors",
        {"exact rows": f"{_si(exact)}B", f"rank-{r} factors": f"{_si(approx)}B"},
        f"each held row's (out, in) block replaced by its best rank-{r} approximation L Rᵀ (truncated "
        f"SVD), r·(out + in) numbers instead of out·in, in {len(names)} block(s)"
        + (f"; exact in {len(kept)} block(s) with min(out, in) ≤ {r} or no matrix shape" if kept else "")
        + "; scored against factored rows as Σ_t Σ_k (d_t·l_k)(a_t·r_k) (the ghost kernel with r "
          "held positions) or materialized once (dense: out·in per row while scoring), per the kernel "
          "decisions; ga.options(ghost='always') keeps them factored", label=repr(held.label))
