"""Per-block choices of the decide stage: how kept rows are stored (``"factors"``,
n·T_b·(in + out) numbers, or ``"flat"``, n·dim) and the inner-product kernel of a
scores job (``ghost`` from the factors, or ``dense``: materialize, one GEMM), each a
recorded :class:`~gradalg.plan.decisions.Decision` where there is a choice; and the rows
per window of rows read outside a pass (:func:`window_rows`: DataInf's, the ``WINDOWS``
decision). The executor runs what these return; it never routes a chunk itself."""
from __future__ import annotations

from ..capture.experts import ExpertMatrixRule
from ..expr import AdamPrecondition, Captured, GradNode, Inner, Normalize, Precondition, Project, Source
from ..expr.lowrank import lowrank_below
from ..expr.windows import by_examples
from ..units import format_bytes
from . import estimates
from .cost import _si
from .decisions import Decision, DecisionKind, DecisionSource
from .facts import Facts, data_positions
from .lower import ROW_WISE
from .memory import positions, rows_bytes
from .shapes import forward_shapes

__all__ = ["storage", "as_captured", "held_storage", "storage_decision", "low_rank_decision", "kernels", "store_cap",
           "window_rows", "windows_decision"]


def _factored(node: GradNode, facts: Facts) -> list:
    """The 2-D blocks whose rows arrive as factors (A, D): captured so, or through a
    Kronecker projection of factored rows (with no preconditioner or metric between)."""
    rep, out = facts.representation(node), []
    for b in node.space.blocks:
        if len(b.shape) != 2 or rep[b.name] not in ("factored", "projected"):
            continue
        root = node      # down to a projection, not through a preconditioner or a metric
        while rep[b.name] == "projected" and isinstance(root, ROW_WISE) and not isinstance(
                root, (Project, Precondition, AdamPrecondition)) and not (isinstance(root, Normalize) and root.op):
            root = root.grads
        if rep[b.name] == "factored" or (isinstance(root, Project) and root.projector.kind_object.keeps_factors
                                         and facts.representation(root.grads).get(b.name) == "factored"):
            out.append(b)
    return out


def storage(node: GradNode, facts: Facts, need_factors: frozenset = frozenset()) -> dict[str, str]:
    """How kept rows are stored, per block: "factors" where smaller than flat under
    ``ga.options(row_storage="auto")`` (T_b·(in + out) < dim), else as that option forces;
    factors where a consumer needs them (``need_factors``: K-FAC statistics) or
    ``ga.options(ghost="always")`` forces ghost kernels. Blocks not factored are flat."""
    T, o = positions(node, facts.shapes), facts.options
    factored = {b.name for b in _factored(node, facts)}
    return {b.name: "factors" if b.name in factored and (
        o.ghost == "always" or b.name in need_factors or o.row_storage == "factors"
        or (o.row_storage == "auto" and T[b.name] * (b.shape[0] + b.shape[1]) < b.dim)) else "flat"
        for b in node.space.blocks}


def as_captured(node: GradNode, facts: Facts) -> dict[str, str]:
    """Rows kept as the pass produces them: factored blocks as factors, others flat."""
    factored = {b.name for b in _factored(node, facts)}
    return {b.name: "factors" if b.name in factored else "flat" for b in node.space.blocks}


def store_cap(options) -> str:
    """The store cap as the plan shows it: ``ga.options(store_fraction=...)`` of the budget."""
    return (f"{_si(options.store_fraction * options.memory_budget)}B "
            f"(store_fraction={options.store_fraction:g} of the memory budget)")


def window_rows(rows: GradNode, facts: Facts, budget: float) -> tuple[int, float]:
    """``(rows per window, bytes of one kept row)`` of ``rows`` read outside a pass, window
    by window: the most rows whose kept rows (as captured, :func:`as_captured`, at
    ``facts``' positions) fit ``ga.options(store_fraction)`` of ``budget`` bytes, at least
    one. The executor reads them so (:meth:`~gradalg.exec.base.Executor.window_rows`) and
    the plan shows them (:func:`windows_decision`)."""
    per_row = max(rows_bytes(rows, as_captured(rows, facts), facts) / max(rows.n, 1), 1.0)
    return int(max(1, min(rows.n, facts.options.store_fraction * budget // per_row))), per_row


def windows_decision(op, rows: GradNode, facts: Facts) -> Decision:
    """How an operator that reads its ``rows`` when applied (DataInf) reads them where no
    planned apply job does (self-scores, a row-wise chain, a sum or multiple of operators,
    the operator on its own): all of them at each application (for each chunk of the rows
    it is applied to), in windows of :func:`window_rows` rows under the plan's budget, each
    window planned as a pass of its own; one window of all of them where they cannot be
    read by ranges of examples (:func:`~gradalg.expr.windows.by_examples`). The executor
    sizes them again under its budget when they are read (the same unless the budget is a
    fraction of the memory available then)."""
    size, per_row = window_rows(rows, facts, facts.options.memory_budget)
    size = size if by_examples(rows) else rows.n
    count = -(-rows.n // size)
    return Decision(DecisionKind.WINDOWS, op.token, f"{count} window{'s' * (count != 1)} of {size:,} rows",
                    {"one window of all rows": f"{format_bytes(rows.n * per_row)} kept",
                     "store cap": store_cap(facts.options)},
                    f"applied outside a planned apply job, it reads all {rows.n:,} rows at each application (each "
                    "chunk it is applied to), window by window, each window the plan of its rows: " + (
                        f"the most rows whose kept rows ({format_bytes(per_row)} a row) fit the store cap, at "
                        "least one" if by_examples(rows) else "rows not read by ranges of examples: one window"),
                    label=op.label)


def held_storage(held: GradNode, kernels: dict, inner: Inner, facts: Facts) -> dict[str, str]:
    """The held rows' :func:`storage`, except that a block whose kernel is dense in an
    unpreconditioned product is kept flat under ``row_storage="auto"`` (the dense kernel
    multiplies the flat rows: factors too would hold the block twice)."""
    kept = storage(held, facts)
    if facts.options.row_storage != "auto" or not inner.op.is_identity:
        return kept
    return {name: "flat" if how == "factors" and kernels.get(name) == "dense" else how for name, how in kept.items()}


def storage_decision(node: GradNode, kept: dict, kind: DecisionKind, facts: Facts) -> Decision | None:
    """The factors-vs-flat decision for kept rows (``kind``: held or stored rows), when
    some block could be either."""
    if not (factored := _factored(node, facts)):
        return None
    kinds = sorted({kept[b.name] for b in factored})
    chosen = kinds[0] if len(kinds) == 1 else ", ".join(
        f"{k} for {sum(kept[b.name] == k for b in factored)} block(s)" for k in kinds)
    mode, T = facts.options.row_storage, positions(node, facts.shapes)
    why = ("per block the smaller of its factors, T·(in + out) numbers per row, and its flat "
           "gradient, out·in" if mode == "auto" else "")
    if mode == "auto" and kind is DecisionKind.HELD_STORAGE and any(
            kept[b.name] == "flat" and T[b.name] * sum(b.shape) < b.dim for b in factored):
        why += "; flat where the block's kernel is dense (it multiplies the flat rows: not kept twice)"
    if facts.options.ghost == "always":
        why += ("; " if why else "") + "factors kept for ghost kernels (ga.options(ghost='always'))"
    sizes = {how: f"{_si(rows_bytes(node, {**kept, **{b.name: how for b in factored}}, facts))}B"
             for how in ("factors", "flat")}
    return Decision(kind, node.token, chosen, sizes, why, label=repr(node.label),
                    source=DecisionSource.PLANNER if mode == "auto" else DecisionSource.OPTIONS,
                    setting="" if mode == "auto" else f"row_storage={mode!r}")


def low_rank_decision(held: GradNode, facts: Facts) -> Decision | None:
    """What a rank-r approximation of the held rows keeps (``G.low_rank(r)``,
    ``query_gradient_rank=``): its bytes against the exact rows', per truncated block."""
    if (low := lowrank_below(held)) is None:
        return None
    r, names = low.rank, low.truncated
    kept = [b.name for b in low.space.blocks if b.name not in names]
    # the exact rows as they would be kept, and the approximation
    exact, approx = (rows_bytes(x, storage(x, facts), facts) for x in (low.grads, low))
    return Decision(
        DecisionKind.LOW_RANK, held.token, f"rank-{r} factors",
        {"exact rows": f"{_si(exact)}B", f"rank-{r} factors": f"{_si(approx)}B"},
        f"each held row's (out, in) block replaced by its best rank-{r} approximation L Rᵀ (truncated "
        f"SVD), r·(out + in) numbers instead of out·in, in {len(names)} block(s)"
        + (f"; exact in {len(kept)} block(s) with min(out, in) ≤ {r} or no matrix shape" if kept else "")
        + "; scored against factored rows as Σ_t Σ_k (d_t·l_k)(a_t·r_k) (the ghost kernel with r "
          "held positions) or materialized once (dense: out·in per row while scoring), per the kernel "
          "decisions; ga.options(ghost='always') keeps them factored", label=repr(held.label))


def _block_positions(node: GradNode, b, facts: Facts) -> str:
    """How ``positions(node, facts.shapes)[b]`` is known: ``"known"`` (every layer's real T:
    known from the data's shape, token ids or flat vectors, rows in memory, or measured, the plan's facts),
    ``"estimated"`` (before the routing is measured, a display's: a fused expert's padded
    length at balanced routing, :meth:`~gradalg.capture.experts.ExpertMatrixRule.positions_for_tokens`),
    else ``"unknown"``. In a token model whose only layers with positions of their own are
    fused experts, every other layer's positions are the data's tokens: known."""
    src = node.source
    if facts.positions_known(node) or isinstance(src, Captured) or (
            isinstance(src, Source) and forward_shapes(src, facts.shapes).measured):
        return "known"
    if isinstance(src, Source) and data_positions(node) and facts.own_position_kinds(node) <= {ExpertMatrixRule.kind}:
        return "estimated" if b.kind == ExpertMatrixRule.kind else "known"
    return "unknown"


def _fixed_kernel(inner: Inner, held_storage: str, known: bool, facts: Facts) -> tuple | None:
    """``(chosen, alternatives, reason, "")`` of a factored block whose kernel is not a costed
    choice: dense for a preconditioned product or flat held rows, "when run" while the
    positions per example are unmeasured (an executor measures them and plans again)."""
    if not inner.op.is_identity:
        return ("dense", {"ghost": "unavailable", "dense": "the preconditioned held rows"},
                "H·L_i of a preconditioned product is not a product of the factors of L_i: the held "
                "rows are materialized once, preconditioned, and multiplied with each streamed chunk", "")
    if held_storage != "factors":
        return ("dense", {"ghost": "needs the held factors", "dense": "the flat held rows"},
                "the held rows of this block are kept flat (see their storage decision)", "")
    if facts.options.ghost == "auto" and not known and not facts.for_run:
        return ("when run", {"ghost": "needs T", "dense": "needs T"},
                "the positions per example (T) of this layer are not known from the data's shape: "
                "an executor measures them (one meta-device forward) and decides before the run", "")
    return None


def _costed(held, streamed, b, TL: int, TR: int, known: bool, facts: Facts) -> tuple[str, dict, str, str]:
    """``(chosen, {"ghost": s, "dense": s}, reason, setting)``: both kernels priced by the
    calibrated cost model on the device profile, as the scores job costs them; ``setting``
    is ``"ghost='always'"`` / ``"ghost='never'"`` where the option forced the kernel, else ``""``."""
    o, device, mode = facts.options, facts.device, facts.options.ghost
    out_f, in_f = b.shape
    costs = estimates.kernel_costs(held.n, streamed.n, o.batch_size, TL, TR, in_f, out_f, facts.elem)
    ghost, dense = (device.time_of(costs[k], facts.dtype) for k in ("ghost", "dense"))
    if mode == "auto" and not known:
        chosen = "dense"   # the forward could not be measured: dense grows linearly in T, ghost as T²
        why = (f"T of this layer unknown (its model cannot run on the meta device; {TL}/{TR} "
               "assumed): dense, whose cost grows linearly with T where ghost's grows as T²")
    else:
        chosen = "ghost" if (mode == "always" or (mode == "auto" and ghost <= dense)) else "dense"
        why = (f"T={TL}/{TR}, in={in_f}, out={out_f}, {held.n}×{streamed.n} pairs in chunks of "
               f"{min(o.batch_size, streamed.n)}: "
               + (f"the faster by the device profile ({device.name})" if mode == "auto"
                  else f"both priced by the device profile ({device.name})"))
    why += (f"; in slices of at most {o.ghost_slice_elements:,} elements, pairs of blocks of {o.token_block} "
            "positions" if chosen == "ghost" else
            f"; streamed blocks of {_si(o.reuse_buffer_bytes)}B or more are materialized into one reused buffer")
    return chosen, {"ghost": ghost, "dense": dense}, why, "" if mode == "auto" else f"ghost={mode!r}"


def kernels(held: GradNode, streamed: GradNode, inner: Inner, facts: Facts) -> tuple[dict, list]:
    """``({block: "ghost" | "dense" | "when run"}, decisions)`` of the scores ``inner``
    holding ``held`` and streaming ``streamed``: dense where one side is flat."""
    out, decisions, kept = {b.name: "dense" for b in held.space.blocks}, [], storage(held, facts)
    P_h, P_s = positions(held, facts.shapes), positions(streamed, facts.shapes)
    both = {b.name for b in _factored(held, facts)} & {b.name for b in _factored(streamed, facts)}
    for b in (b for b in held.space.blocks if b.name in both):
        how = {_block_positions(held, b, facts), _block_positions(streamed, b, facts)}
        known = "unknown" not in how
        kernel, alternatives, why, setting = _fixed_kernel(inner, kept[b.name], known, facts) or \
            _costed(held, streamed, b, P_h[b.name], P_s[b.name], known, facts)
        if "estimated" in how and kernel in ("ghost", "dense"):
            why += ("; this expert's T is the balanced-routing estimate (no model run): a run measures the "
                    "routing of the first chunk and decides again")
        out[b.name] = kernel
        decisions.append(Decision(DecisionKind.KERNEL, inner.token, kernel, alternatives, why, block=b.name,
                                  label=inner.label, setting=setting,
                                  source=DecisionSource.OPTIONS if setting else DecisionSource.PLANNER))
    return out, decisions
