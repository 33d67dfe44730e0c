"""The inner-product kernel of each block of a scores job, ``ghost`` (from the factors)
or ``dense`` (materialize, one GEMM), each a recorded decision where there is a choice
(part of the decide stage). The executor runs what this returns; it never routes a chunk."""
from __future__ import annotations

from ..expr import Captured, GradNode, Identity, Inner, Source
from . import estimates
from .cost import _si
from .decisions import Decision, DecisionKind
from .facts import Facts, positions_known
from .graph import CONV_KINDS
from .memory import positions
from .shapes import element_size, forward_shapes
from .storage import is_factored, storage

__all__ = ["kernels", "positions_measured"]


def positions_measured(node: GradNode) -> bool:
    """Whether ``positions(node)`` are every layer's real T: known from the data's shape
    (token ids, flat vectors) or measured by a meta-device forward (the plan's facts)."""
    if positions_known(node) and not any(b.kind in CONV_KINDS for b in node.space.blocks):
        return True
    src = node.source
    if isinstance(src, Captured):
        return True     # rows in memory: their factors' shapes are known (memory.captured_positions)
    return isinstance(src, Source) and forward_shapes(src).measured


def _without_choice(inner: Inner, held_storage: str, known: bool, facts: Facts) -> tuple | None:
    """``(chosen, alternatives, reason)`` of a factored block whose kernel is not a
    costed choice: dense for a preconditioned product or flat held rows, "when run"
    while the positions per example are unmeasured; None when both kernels are costed."""
    if not isinstance(inner.op, Identity):
        return ("dense", {"ghost": "unavailable", "dense": "the preconditioned held rows"},
                "H·L_i of a preconditioned product is not a product of the factors of L_i: the held "
                "rows are materialized once, preconditioned, and multiplied with each streamed chunk")
    if held_storage != "factors":
        return ("dense", {"ghost": "needs the held factors", "dense": "the flat held rows"},
                "the held rows of this block are kept flat (see their storage decision)")
    if facts.options.ghost == "auto" and not known and not facts.for_run:
        # T differs per layer (convolutions, non-token inputs): measured on the meta
        # device by the executor, which plans again with it before running
        return ("when run", {"ghost": "needs T", "dense": "needs T"},
                "the positions per example (T) of this layer are not known from the data's shape: "
                "an executor measures them (one meta-device forward) and decides before the run")
    return None


def _costed(held, streamed, b, TL, TR, known, facts: Facts) -> tuple[str, dict, str]:
    """``(chosen, {"ghost": s, "dense": s}, reason)``: both kernels priced by the
    calibrated cost model on the device profile, as the scores job costs them."""
    o, device, mode = facts.options, facts.device, facts.options.ghost
    out_f, in_f = b.shape
    costs = estimates.kernel_costs(held.n, streamed.n, o.batch_size, TL, TR, in_f, out_f, element_size(facts.dtype))
    ghost, dense = (device.time_of(costs[k], facts.dtype) for k in ("ghost", "dense"))
    if mode == "auto" and not known:
        chosen = "dense"   # the forward could not be measured: dense grows linearly in T, ghost as T²
        why = (f"T of this layer unknown (its model cannot run on the meta device; {TL}/{TR} "
               "assumed): dense, whose cost grows linearly with T where ghost's grows as T²")
    else:
        chosen = "ghost" if (mode == "always" or (mode == "auto" and ghost <= dense)) else "dense"
        why = (f"T={TL}/{TR}, in={in_f}, out={out_f}, {held.n}×{streamed.n} pairs in chunks of "
               f"{min(o.batch_size, streamed.n)}: the faster by the device profile ({device.name})"
               + ("" if mode == "auto" else f" (forced by ga.options(ghost={mode!r}))"))
    if chosen == "ghost":
        why += (f"; in slices of at most {o.ghost_slice_elements:,} elements, "
                f"pairs of blocks of {o.token_block} positions")
    else:
        why += f"; streamed blocks of {_si(o.reuse_buffer_bytes)}B or more are materialized into one reused buffer"
    return chosen, {"ghost": ghost, "dense": dense}, why


def kernels(held: GradNode, streamed: GradNode, inner: Inner, facts: Facts) -> tuple[dict, list]:
    """``({block: "ghost" | "dense" | "when run"}, decisions)`` of the scores ``inner``
    holding ``held`` and streaming ``streamed``."""
    out, decisions = {}, []
    kept = storage(held, facts)
    P_h, P_s = positions(held), positions(streamed)
    known = positions_measured(held) and positions_measured(streamed)
    for b in held.space.blocks:
        out[b.name] = "dense"
        if not (len(b.shape) == 2 and is_factored(held, b.name, facts) and is_factored(streamed, b.name, facts)):
            continue           # flat rows on one side: dense is the only kernel
        chosen = _without_choice(inner, kept[b.name], known, facts) or \
            _costed(held, streamed, b, P_h[b.name], P_s[b.name], known, facts)
        out[b.name] = chosen[0]
        decisions.append(Decision(DecisionKind.KERNEL, inner.token, *chosen, block=b.name, label=inner.label))
    return out, decisions
