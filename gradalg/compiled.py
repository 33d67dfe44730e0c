"""Compile once: resolve a score expression's operators and precondition its training
side a single time, then score new queries against them.

    S = Q @ ga.fisher(G).damp(1e-3).inv() @ G.T
    C = ga.compile(S)              # the Fisher pass, its inverse, H⁻¹G held: once
    C.scores(Q_new)                # Q_new @ H⁻¹ @ G.T: one pass over Q_new's data
    C(S2)                          # any expression: compiled parts substituted where S2 has them
    C.compute()                    # equal to S.compute()

What is kept, per inner product ``L @ H @ R.T`` of ``S`` (after the planner's rewrites):

* the resolved operator H (a :class:`~gradalg.linalg.LinearOp`, with the named rules
  that made it), as an operator leaf: any expression using H reads it, no pass runs;
* the training side preconditioned, ``H R`` (n_train, dim), held in memory when
  ``hold`` says so: a new query then costs one pass over its own data. Without it (the
  default for rows already in a gradient store, ``ga.store.open``), a query costs its
  pass plus one read of the stored rows (H is applied to the query side instead).

Identity and invalidation: compiled parts are matched to a new expression by node
token. Tokens are cached per node, and model fingerprints per tensor version, which an
in-place write through ``p.data`` does not bump; so before every use the compiled
object re-hashes its models' weights without the fingerprint cache
(``check_weights="full"``, the default; "versions" trusts version counters and is
cheaper). The data is checked the same way, by its content fingerprint
(:func:`gradalg.data.data_fingerprint`; tensors by their values, cached per tensor
version, so an in-place edit of a training or query tensor is seen; a write through
``X.data`` needs ``ga.fingerprint.forget(X)``). When weights or data changed,
``on_change="recompute"`` compiles again (new passes; the expression's data is named
anew by its content) and ``"raise"`` raises :class:`~gradalg.errors.StaleCompiledError`.
``C.invalidate()`` drops everything; the next use compiles again. A dataset without a
stable fingerprint (unpicklable, no ``__gradalg_fingerprint__``) is named per object, so
its in-place edits cannot be seen.
"""
from __future__ import annotations

from dataclasses import dataclass

from .api import GradientSet, Scores
from .errors import OptionError, StaleCompiledError
from .expr import Identity, Inner, Source
from .expr.base import transform
from .expr.stored import Stored, StoredOp
from .fingerprint import forget
from .store.describe import digest
from .store.rows import check_row_ids

__all__ = ["compile", "Compiled"]


class _HeldOperator:
    """A resolved operator kept in memory, as the store of an operator leaf."""

    def __init__(self, op, token: str, label: str):
        self.op, self.token, self.label = op, token, label
        self.structure = op.structure   # read by the planner's rule listing, without data
        self.rules = tuple(op.rules)

    def load(self):
        return self.op


class _HeldRows:
    """Preconditioned rows H R kept in memory, as the store of a ``Stored`` leaf."""

    def __init__(self, chunk, token: str, label: str):
        self.chunk, self.token, self.label = chunk, token, label
        self.ids = tuple(chunk.ids)
        self.n = len(self.ids)
        self.reads = 0

    def chunks(self):
        self.reads += 1
        return [self.chunk]

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.chunk.blocks.values())


@dataclass
class _Part:
    """One compiled inner product ``L @ H @ R.T``."""

    inner: Inner
    op_leaf: StoredOp | None
    held_leaf: Stored | None


def _tasks(node) -> list:
    seen, out = set(), []
    for x in node.walk():
        if isinstance(x, Source) and id(x.task) not in seen:
            seen.add(id(x.task))
            out.append(x.task)
    return out


def _datas(node) -> list:
    """The DataRefs the expression's sources read, each once."""
    seen, out = set(), []
    for x in node.walk():
        if isinstance(x, Source) and id(x.data) not in seen:
            seen.add(id(x.data))
            out.append(x.data)
    return out


def _renamed_data(node):
    """``node`` with every source's DataRef named again from its data's content now (an
    in-place edit since the DataRef was made changes its name, so no memo of the old
    content is reused)."""
    from dataclasses import replace
    fresh = {}

    def fn(x):
        if isinstance(x, Source):
            if id(x.data) not in fresh:
                fresh[id(x.data)] = replace(x.data, key=None)
            return replace(x, data=fresh[id(x.data)])
        return None

    return transform(node, fn)


def _drop_cached_tokens(root) -> None:
    """Forget the tokens cached on ``root``'s nodes (they name the old weights), so that the
    expression — and the user's expressions sharing its nodes — are matched by the new ones."""
    nodes = list(root.walk())
    for node in nodes:
        node.__dict__.pop("token", None)


def _is_stored(node) -> bool:
    from .plan.planner import stream_root
    return not isinstance(stream_root(node), Source)


class Compiled:
    """A compiled score expression (see :func:`compile`)."""

    def __init__(self, S: Scores, *, executor=None, hold="auto", on_change: str = "recompute",
                 check_weights: str = "full"):
        if not isinstance(S, Scores):
            raise OptionError(f"ga.compile takes Scores (Q @ H @ G.T), got {type(S).__name__}")
        if hold not in ("auto", True, False):
            raise OptionError(f"hold must be 'auto', True or False, got {hold!r}")
        if on_change not in ("recompute", "raise"):
            raise OptionError(f"on_change must be 'recompute' or 'raise', got {on_change!r}")
        if check_weights not in ("full", "versions"):
            raise OptionError(f"check_weights must be 'full' or 'versions', got {check_weights!r}")
        self.source = S
        self.executor = executor
        self.hold = hold
        self.on_change = on_change
        self.check_weights = check_weights
        self.compilations = 0
        self._parts: list[_Part] | None = None
        self._compile()

    # ------------------------------------------------------------------ compiling
    def _executor(self):
        from .exec.local import LocalExecutor
        return self.executor if self.executor is not None else LocalExecutor()

    def _weights(self) -> dict:
        """A fresh digest of every model the expression captures from."""
        tasks = _tasks(self.source.expr)
        if self.check_weights == "versions":
            return {id(t): t.token for t in tasks}
        from .options import options
        with options(fingerprint_cache=False):
            return {id(t): t.token for t in tasks}

    def _data(self) -> dict:
        """The content fingerprint of every dataset the expression reads, now (tensor
        digests cached per version: an in-place edit is seen)."""
        from .data import data_fingerprint
        return {id(d): data_fingerprint(d.source) for d in _datas(self.source.expr)}

    def _holds(self, inner: Inner) -> bool:
        if self.hold != "auto":
            return bool(self.hold)
        if _is_stored(inner.right):
            return False    # a store is read once per query; holding H R would copy it into memory
        from .options import get_options
        from .plan.budget import budget_bytes
        return inner.right.n * inner.right.space.dim * 8 <= budget_bytes(get_options())

    def _compile(self) -> None:
        from .exec.resolve import precondition
        from .plan.rules import simplify_until_fixpoint

        self._stamp = self._weights()
        self._data_stamp = self._data()
        epoch = digest(sorted(self._stamp.values()) + sorted(self._data_stamp.values()))
        simplified, _ = simplify_until_fixpoint(self.source.expr)
        self._simplified = simplified
        ex = self._executor()
        parts = []
        inners = [n for n in simplified.walk() if isinstance(n, Inner)]
        for inner in inners:
            op_leaf = held_leaf = None
            resolved = None
            if not inner.op.is_identity:
                resolved = ex.operator(inner.op)
                token = f"compiled-op-{digest([inner.op.token, epoch])}"
                op_leaf = StoredOp(_HeldOperator(resolved, token, f"compiled {inner.op.label}"), inner.op.space,
                                   resolved.kind)
            if self._holds(inner):
                rows = ex.gradients(inner.right)
                check_row_ids(rows.ids, inner.right.ids, f"rows of {inner.right.label}")   # held by position
                if resolved is not None:
                    rows = precondition(resolved, rows, inner.right.space)
                rows = rows.replace({n: _flat(v) for n, v in rows.blocks.items()})
                token = f"compiled-rows-{digest([inner.op.token, inner.right.token, epoch])}"
                store = _HeldRows(rows, token, f"compiled H·{inner.right.label}")
                held_leaf = Stored(store, inner.right.space, tuple((b.name, "dense") for b in inner.right.space.blocks))
            parts.append(_Part(inner, op_leaf, held_leaf))
        self._parts = parts
        self.compilations += 1

    def _fresh(self) -> None:
        """Compile again if invalidated or if the models' weights changed."""
        if self._parts is None:
            self._compile()
            return
        weights_changed = self._weights() != self._stamp
        data_changed = self._data() != self._data_stamp
        if not (weights_changed or data_changed):
            return
        if weights_changed:
            for task in _tasks(self.source.expr):   # cached digests are stale: drop them
                forget(task.model)
            _drop_cached_tokens(self.source.expr)
        if data_changed:   # the DataRefs name the old content: name the data again
            self.source = Scores(_renamed_data(self.source.expr))
            reset = getattr(self.executor, "reset", None)
            if reset is not None:   # its memo holds results under the old data's names
                reset()
        if self.on_change == "raise":
            what = " and ".join(w for w, changed in (("the model weights", weights_changed),
                                                    ("the data (a training or query tensor)", data_changed)) if changed)
            raise StaleCompiledError(
                f"{what} changed since ga.compile(S) (an optimizer step or an in-place write): "
                "its operators and preconditioned training rows are stale. Call C.invalidate() and use it "
                "again (or compile with on_change='recompute'), and rebuild the query gradients")
        self._compile()

    def invalidate(self) -> None:
        """Drop the compiled operators and rows; the next use compiles again."""
        self._parts = None

    # ------------------------------------------------------------------ using
    def rewrite(self, S2: Scores) -> Scores:
        """``S2`` with the compiled parts substituted: every inner product ``L @ H @ R.T``
        with a compiled H and R becomes ``L @ (H R).T`` over the held rows (or
        ``L @ H_compiled @ R.T``), and every compiled operator its resolved leaf."""
        from .plan.rules import simplify_until_fixpoint

        self._fresh()
        node, _ = simplify_until_fixpoint(S2.expr)
        by_op = {p.inner.op.token: p.op_leaf for p in self._parts if p.op_leaf is not None}
        by_pair = {}   # transform() rebuilds bottom-up: an Inner arrives with its operator substituted
        for p in self._parts:
            for op_token in {p.inner.op.token, p.op_leaf.token if p.op_leaf is not None else p.inner.op.token}:
                by_pair[(op_token, p.inner.right.token)] = p

        def fn(x):
            if isinstance(x, Inner):
                part = by_pair.get((x.op.token, x.right.token))
                if part is not None and part.held_leaf is not None:
                    return Inner(x.left, Identity(x.left.space), part.held_leaf)
                return None
            return by_op.get(x.token)

        return Scores(transform(node, fn))

    def __call__(self, S2: Scores, executor=None):
        """``S2.compute()`` with the compiled parts reused (see :meth:`rewrite`)."""
        return self._compute(S2, executor)

    def _compute(self, S2: Scores, executor=None):
        if not isinstance(S2, Scores):
            raise OptionError(f"a compiled expression scores Scores (C(S2), S2 = Q2 @ H @ G.T), got {type(S2).__name__}")
        rewritten = self.rewrite(S2)
        out = rewritten.compute(executor if executor is not None else self.executor)
        # label the result with the expression the user wrote
        from .api import _expression_text
        out.attrs["expression"] = _expression_text(S2.expr)
        out.attrs["compiled"] = True
        return out

    def compute(self, executor=None):
        """The compiled expression's scores (equal to ``S.compute()``)."""
        return self._compute(self.source, executor)

    def scores(self, queries: GradientSet, executor=None):
        """Scores of new ``queries`` in place of the expression's query side: ``S`` with its
        left (query) gradient set replaced. Needs an ``S`` with one query side."""
        if not isinstance(queries, GradientSet):
            raise OptionError(f"C.scores takes a GradientSet of queries, got {type(queries).__name__}")
        lefts = {p.inner.left.token: p.inner.left for p in self._parts} if self._parts else \
            {n.left.token: n.left for n in self._simplified.walk() if isinstance(n, Inner)}
        if len(lefts) != 1:
            raise OptionError(f"C.scores(queries) needs an expression with one query side; this one has "
                              f"{len(lefts)}: build the new expression and call C(S_new)")
        (old,) = lefts.values()
        old.space.check_same(queries.space, "the compiled query side and the new queries")
        new = transform(self._simplified, lambda x: queries.expr if x.token == old.token else None)
        return self._compute(Scores(new), executor)

    # ------------------------------------------------------------------ inspection
    @property
    def operators(self) -> dict:
        """{operator label: resolved LinearOp} of the compiled inner products."""
        self._fresh()
        return {p.inner.op.label: p.op_leaf.store.op for p in self._parts if p.op_leaf is not None}

    @property
    def held_rows(self) -> dict:
        """{training side label: bytes of its preconditioned rows held in memory}."""
        return {p.inner.right.label: p.held_leaf.store.nbytes() for p in (self._parts or ())
                if p.held_leaf is not None}

    def __repr__(self):
        lines = [f"Compiled ({self.compilations} compilation{'s' if self.compilations != 1 else ''}, "
                 f"on_change={self.on_change!r})"]
        for p in self._parts or ():
            op = "identity" if p.op_leaf is None else \
                f"{p.inner.op.label}: {p.op_leaf.store.op.kind}, {p.op_leaf.store.op.nbytes():,} B, " \
                f"rules {list(p.op_leaf.store.rules)}"
            held = f"H·R held ({p.held_leaf.store.nbytes():,} B)" if p.held_leaf is not None \
                else "R read per query"
            lines.append(f"  {p.inner.right.label}  ·  {op}  ·  {held}")
        if self._parts is None:
            lines.append("  invalidated: compiles again on next use")
        return "\n".join(lines)


def _flat(value):
    from .capture.chunks import flat_block
    return flat_block(value)


def compile(S: Scores, *, executor=None, hold="auto", on_change: str = "recompute",  # noqa: A001 - ga.compile
            check_weights: str = "full") -> Compiled:
    """Resolve ``S``'s operators and precondition its training side once (see
    :mod:`gradalg.compiled`).

    hold : "auto" (hold H·R in memory when its n_train × dim float64 numbers fit
        the memory budget (``gradalg.plan.budget``) and R is not already a store), True or False.
    on_change : when the models' weights changed since compiling: "recompute" or "raise".
    check_weights : "full" (re-hash the weights before every use; sees writes through
        ``p.data``) or "versions" (trust tensor version counters; cheaper).
    executor : the executor that resolves and scores (default: a local one).
    """
    return Compiled(S, executor=executor, hold=hold, on_change=on_change, check_weights=check_weights)
