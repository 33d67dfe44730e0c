"""Expression nodes, rewrites, laziness, errors, options, routing and streaming.

Counts are taken with hooks on the model (forward calls with gradients enabled are
capture passes; the loss-reduction check runs its extra forwards without gradients) and
with spies on the kernels, so each test proves what actually ran.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg.capture import chunks as capture_chunks
import gradalg.plan.jobs.scores
from gradalg.linalg import ResolvedOp
from gradalg.capture.factors import Factors, dense_flops, ghost_flops
from gradalg.expr import Inner, Precondition, ScoreSum
from gradalg.plan import DecisionKind
from gradalg.testing import assert_close
from gradalg.testing.conformance import project_dense

sys.path.insert(0, os.path.dirname(__file__))
import models
from references import one_thread, reference_rows  # noqa: F401 - one_thread is an autouse fixture

F64 = torch.float64


class Setup:
    """An MLP task with 24 training and 5 query examples held as Dataset objects."""

    def __init__(self, n_train=24, n_query=5, batch_size=8):
        self.model = models.mlp()
        self.task = ga.tasks.classification(self.model)
        self.x, self.y = models.classification_data(n_train)
        self.xq, self.yq = models.classification_data(n_query, seed=9)
        self.train = TensorDataset(self.x, self.y)
        self.query = TensorDataset(self.xq, self.yq)
        self.batch_size = batch_size
        self.forwards: list[torch.Tensor] = []
        self.model.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        if torch.is_grad_enabled():
            self.forwards.append(args[0].detach())

    def G(self, **kw):
        return ga.grads(self.task, self.train, ["0", "2"], batch_size=self.batch_size, **kw)

    def Q(self, **kw):
        return ga.grads(self.task, self.query, ["0", "2"], batch_size=self.batch_size, **kw)

    def train_forwards(self) -> int:
        """Forward calls (with gradients) whose inputs are a batch of the training set."""
        return sum(1 for f in self.forwards if any(torch.equal(f, self.x[s:s + len(f)])
                                                   for s in range(0, len(self.x), self.batch_size)))

    @functools.cached_property
    def R(self):
        return reference_rows(self.task, (self.x, self.y), ("0", "2"))

    @functools.cached_property
    def RQ(self):
        return reference_rows(self.task, (self.xq, self.yq), ("0", "2"))


@pytest.fixture
def s():
    return Setup()


class CountForwards:
    """Every module forward in the process while active."""

    def __enter__(self):
        self.calls = 0

        def hook(module, args):
            self.calls += 1

        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def values(S, executor=None) -> torch.Tensor:
    return torch.from_numpy(S.compute(executor=executor).values)


# ====================================================================== identity
def test_same_expression_built_twice_is_equal(s):
    def build(damping=1e-3, seed=0, layers=("0", "2")):
        G = ga.grads(s.task, s.train, list(layers))
        Q = ga.grads(s.task, s.query, list(layers))
        P = ga.proj.kron(8, seed=seed)
        return P(Q) @ ga.fisher(P(G)).damp(damping).inv() @ P(G).T

    a, b = build(), build()
    assert a.expr is not b.expr
    assert a.expr == b.expr and a.expr.token == b.expr.token and hash(a.expr) == hash(b.expr)
    assert len({a.expr, b.expr}) == 1
    assert build(damping=1e-2).expr != a.expr
    assert build(seed=1).expr != a.expr
    assert build(layers=("0",)).expr != a.expr
    # sub-expressions too: the Fisher built twice is one node
    assert ga.fisher(s.G()).damp(0.1) .expr == ga.fisher(s.G()).damp(0.1).expr
    assert ga.fisher(s.G()).damp(0.1).expr != ga.fisher(s.G()).damp(0.2).expr
    assert ga.fisher(s.G(), "block").expr != ga.fisher(s.G(), "diag").expr
    # a tuple of tensors passed twice is the same data
    assert ga.grads(s.task, (s.x, s.y)) == ga.grads(s.task, (s.x, s.y))
    # identity is content: the same task built twice is the same expression; another
    # loss over the same model is not
    assert ga.grads(ga.tasks.classification(s.model), s.train) == ga.grads(s.task, s.train)
    other = ga.tasks.classification(s.model, targets=lambda b: (b[1] + 1) % 3)
    assert ga.grads(other, s.train) != ga.grads(s.task, s.train)


def test_tokens_are_deterministic_strings(s):
    G = s.G()
    t = (G @ G.T).expr.token
    assert isinstance(t, str) and t.startswith("inner-")
    assert (G @ G.T).expr.token == t
    w = torch.arange(float(G.space.dim), dtype=F64)
    assert ga.diagonal(w, G).expr == ga.diagonal(w.clone(), G).expr   # by content
    assert ga.diagonal(w, G).expr != ga.diagonal(w + 1, G).expr


def test_shared_subexpression_computed_once(s):
    """P(Q) @ fisher(P(G)).inv() @ P(G).T reads the training data once, although P(G)
    feeds both the Fisher and the scores."""
    G, Q = s.G(), s.Q()
    P = ga.proj.kron(8, seed=0)
    S = P(Q) @ ga.fisher(P(G)).inv() @ P(G).T
    got = values(S)
    n_batches = math.ceil(len(s.x) / s.batch_size)
    assert s.train_forwards() == n_batches, f"{s.train_forwards()} training forwards for {n_batches} batches"
    assert len(s.forwards) == n_batches + 1          # and the 5 queries in one batch
    RG, RQ = project_dense(s.R, G.space, P), project_dense(s.RQ, Q.space, P)
    expected = RQ @ torch.linalg.solve(RG.T @ RG / len(RG), RG.T)
    assert_close(got, expected, rtol=1e-6, atol=1e-8, what="P(Q) F⁻¹ P(G)ᵀ")


def test_unprojected_fisher_and_scores_share_one_pass(s):
    G, Q = s.G(), s.Q()
    got = values(Q @ ga.fisher(G, "block").damp(0.1).inv() @ G.T)
    assert s.train_forwards() == math.ceil(len(s.x) / s.batch_size)
    F0 = s.R[:, :144].T @ s.R[:, :144] / 24 + 0.1 * torch.eye(144, dtype=F64)
    F2 = s.R[:, 144:].T @ s.R[:, 144:] / 24 + 0.1 * torch.eye(51, dtype=F64)
    expected = s.RQ @ torch.block_diag(torch.linalg.inv(F0), torch.linalg.inv(F2)) @ s.R.T
    assert_close(got, expected, rtol=1e-7, atol=1e-9, what="block Fisher influence")


def test_sum_of_equal_scores_reads_data_once(s):
    G, Q = s.G(), s.Q()
    S = Q @ G.T
    got = values(ga.sum([S, S * 2.0, Q.normalize() @ G.normalize().T]))
    assert s.train_forwards() == math.ceil(len(s.x) / s.batch_size)
    Rn, RQn = s.R / s.R.norm(dim=1, keepdim=True), s.RQ / s.RQ.norm(dim=1, keepdim=True)
    assert_close(got, 3 * s.RQ @ s.R.T + RQn @ Rn.T, rtol=1e-9, atol=1e-11, what="sum of scores")


# ====================================================================== rewrites
def test_precondition_absorption_rewrite(s):
    from gradalg.plan.rules import simplify_until_fixpoint

    G, Q = s.G(), s.Q()
    H = ga.dense(torch.eye(G.space.dim, dtype=F64) * 2, G)
    S = Q @ H @ G.T                          # parses as (Q @ H) @ G.T
    assert isinstance(S.expr, Inner) and isinstance(S.expr.left, Precondition)
    simplified, fired = simplify_until_fixpoint(S.expr)
    assert simplified == Inner(Q.expr, H.expr, G.expr)    # the hand-built expected plan
    assert "absorb_precondition" in [f.rule for f in fired]
    mirror, _ = simplify_until_fixpoint((Q @ (H @ G.T)).expr)
    assert mirror == Inner(Q.expr, H.expr, G.expr)
    total, _ = simplify_until_fixpoint((S + S).expr)
    assert isinstance(total, ScoreSum) and all(t == Inner(Q.expr, H.expr, G.expr) for t in total.terms)
    # the rewrite preserves the value (rewrites disabled = enabled = dense reference)
    expected = 2 * s.RQ @ s.R.T
    assert_close(values(S), expected, rtol=1e-9, atol=1e-11, what="rewritten")
    assert_close(values(S, ga.LocalExecutor(rewrites=False)), expected, rtol=1e-9, atol=1e-11, what="not rewritten")


def test_preconditioner_applied_to_the_smaller_side(s, monkeypatch):
    """G @ H @ Q.T with 24 training and 5 query rows: H is applied to the 5 query rows only."""
    rows_seen = []
    real = ResolvedOp.apply

    def spy(self, rows):
        rows_seen.append(rows.shape[0])
        return real(self, rows)

    monkeypatch.setattr(ResolvedOp, "apply", spy)
    G, Q = s.G(), s.Q()
    M = torch.diag(torch.linspace(0.5, 2.0, G.space.dim, dtype=F64))
    got = values(G @ ga.dense(M, G) @ Q.T)
    assert rows_seen == [Q.n], rows_seen
    assert_close(got, s.R @ M @ s.RQ.T, rtol=1e-9, atol=1e-11, what="G H Qᵀ")


# ====================================================================== laziness
def test_building_displaying_and_costing_run_nothing(s, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("a kernel ran while only building an expression")

    monkeypatch.setattr(capture_chunks, "materialize", forbidden)
    with CountForwards() as count:
        G, Q = s.G(), s.Q()
        P = ga.proj.kron(8, seed=0)
        H = ga.fisher(P(G)).damp(1e-3)
        exprs = [G, Q, P(G), H, H.inv(), P(Q) @ H.inv() @ P(G).T, Q.normalize() @ G.normalize().T,
                 ga.methods.influence(s.task, s.train, s.query, projector=P),
                 ga.methods.trak(s.task, s.train, s.query, k=8)]
        for e in exprs:
            assert repr(e) and e._repr_html_()
            assert e.cost().flops > 0
            if hasattr(e, "explain"):
                str(e.explain())
    assert count.calls == 0
    assert s.forwards == []


def test_reprs_show_shapes_and_representations(s):
    G, Q = s.G(), s.Q()
    P = ga.proj.kron(8, seed=0)
    text = repr(G)
    assert "24 examples × 195 coords" in text
    assert "0 (linear 16×9, factored)" in text and "2 (linear 3×17, factored)" in text
    ptext = repr(P(G))
    assert "ga.proj.kron(k=8, seed=0)" in ptext and "projected" in ptext and "16 coords" in ptext
    S = P(Q) @ ga.fisher(P(G)).damp(1e-3).inv() @ P(G).T
    stext = repr(S)
    assert stext.startswith("<Scores>") and "5 × 24" in stext
    assert "fisher[dense]" in stext and "damp(λ=0.001)" in stext and "inverse" in stext
    assert "shared, computed once" in stext
    assert "pass(es) over data" in stext
    html = S._repr_html_()
    assert "<details" in html and "ga-rep-projected" in html and "ga-rep-factored" in html
    assert "5 × 24" in html
    op = repr(ga.fisher(P(G), "block"))
    assert "block operator on 16 coords (2 blocks)" in op
    assert repr(G.T).endswith(".T")


def test_repr_escapes_html(s):
    task = ga.Task(s.model, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum"), name="<b>x</b>")
    html = ga.grads(task, s.train)._repr_html_()
    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html


# ====================================================================== errors
def test_space_mismatch_between_layers(s):
    Q1 = ga.grads(s.task, s.query, ["0"])
    with pytest.raises(ga.SpaceMismatchError) as err:
        Q1 @ s.G().T
    msg = str(err.value)
    assert "blocks only on the" in msg and "same `layers`" in msg


@pytest.mark.parametrize("left,right", [
    (ga.proj.kron(8, 0), ga.proj.kron(8, 1)),
    (ga.proj.gaussian(8, 0), ga.proj.gaussian(8, 1)),
    (ga.proj.gaussian(8, 0), ga.proj.rademacher(8, 0)),
    (ga.proj.gaussian(8, 0), ga.proj.gaussian(8, 0, per_block=True)),
    (ga.proj.kron(8, 0), None),
])
def test_space_mismatch_between_projectors(s, left, right):
    Q, G = s.Q(), s.G()
    rhs = right(G) if right is not None else G
    with pytest.raises(ga.SpaceMismatchError) as err:
        left(Q) @ rhs.T
    assert "same projector object" in str(err.value)


def test_operator_on_another_space_is_refused_when_built(s):
    G, Q = s.G(), s.Q()
    H = ga.fisher(ga.proj.kron(8, 0)(G))
    for build in (lambda: Q @ H, lambda: H @ G.T, lambda: Q @ H @ G.T):
        with pytest.raises(ga.SpaceMismatchError):
            build()
    with pytest.raises(ga.SpaceMismatchError):
        H + ga.identity(G)


def test_shape_mismatch_for_wrong_size_operators(s):
    G = s.G()
    with pytest.raises(ga.ShapeMismatchError, match=r"\(195,\)"):
        ga.diagonal(torch.ones(194), G)
    with pytest.raises(ga.ShapeMismatchError, match=r"\(195, 195\)"):
        ga.dense(torch.eye(196), G)
    with pytest.raises(ga.ShapeMismatchError):
        ga.dense(torch.ones(195, 194), G)


def test_scores_over_different_examples_cannot_be_added(s):
    G, Q = s.G(), s.Q()
    with pytest.raises(ga.ShapeMismatchError):
        (Q @ G.T) + (Q @ Q.T)


def test_memory_budget_error_for_a_dense_fisher(s):
    G, Q = s.G(), s.Q()
    with ga.options(memory_budget="64KB"):   # a dense 195×195 float64 Fisher takes 297 KiB
        with pytest.raises(ga.MemoryBudgetError) as err:
            ga.fisher(G).to_dense()
        with pytest.raises(ga.MemoryBudgetError):
            (Q @ ga.fisher(G).damp(1.0).inv() @ G.T).compute()
        ga.fisher(G, "diag").to_dense()          # 1.5 KiB: fits
    assert "memory_budget" in str(err.value) and "ga.proj" in str(err.value)
    assert s.train_forwards() == math.ceil(len(s.x) / s.batch_size)   # only the diagonal ran


def test_singular_inverse_names_damping(s):
    G = s.G()                       # 24 examples, 195 coordinates: the Fisher is singular
    for op in (ga.fisher(G).inv(), ga.fisher(G).pow(-1), ga.fisher(G, "block").inv(),
               ga.diagonal(torch.zeros(G.space.dim), G).inv()):
        with pytest.raises(ga.GradalgError, match="damp"):
            op.to_dense()
    ga.fisher(G).damp(1e-3).inv().to_dense()


# ====================================================================== options
def test_options_validation():
    before = ga.get_options()
    with pytest.raises(TypeError, match="valid options"):
        ga.options(batchsize=3)
    for bad in ({"batch_size": 0}, {"batch_size": 2.5}, {"ghost": "sometimes"}, {"memory_budget": -1},
                {"memory_budget": "0GB"}):
        with pytest.raises(ValueError):
            ga.options(**bad)
    assert ga.get_options() == before, "a refused option must change nothing"


def test_options_parse_memory_sizes():
    # decimal units are powers of 1000, binary (…iB) powers of 1024 (the full table: tests/test_units.py)
    for text, expected in (("4GB", 4 * 10**9), ("512 MiB", 512 * 2**20), ("1.5k", 1500), (1000, 1000)):
        with ga.options(memory_budget=text):
            assert ga.get_options().memory_budget == expected


def test_options_context_manager_restores():
    before = ga.get_options()
    with ga.options(batch_size=7, ghost="never") as opts:
        assert opts.batch_size == 7 and ga.get_options().ghost == "never"
        with ga.options(ghost="always"):
            assert ga.get_options().ghost == "always" and ga.get_options().batch_size == 7
        assert ga.get_options().ghost == "never"
    assert ga.get_options() == before
    with pytest.raises(RuntimeError), ga.options(batch_size=3):
        raise RuntimeError("boom")
    assert ga.get_options() == before


def test_options_set_globally_without_with():
    before = ga.get_options()
    try:
        shown = repr(ga.options(batch_size=5))       # what a notebook cell ending in it displays
        assert ga.get_options().batch_size == 5
        assert shown.startswith("ga.options(batch_size=5) -> Options(batch_size=5,")
    finally:
        ga.options(**dataclasses.asdict(before))
    assert ga.get_options() == before


def test_options_as_a_decorator():
    before = ga.get_options()

    @ga.options(batch_size=3)
    def inner():
        return ga.get_options().batch_size

    assert ga.get_options() == before, "decorating must not change the options"
    assert inner() == 3
    assert inner() == 3, "a decorated function can be called again"
    assert ga.get_options() == before


def test_executor_uses_the_options_in_force(s):
    G, Q = s.G(), s.Q()
    with ga.options(ghost="never"):
        ex = ga.LocalExecutor()
    (Q @ G.T).compute(executor=ex)
    assert ex.trace["ghost"] == 0 and ex.trace["dense"] > 0
    with ga.options(ghost="always"):
        out = (Q @ G.T).compute()
    assert out.attrs["kernels"].get("ghost", 0) > 0 and out.attrs["kernels"].get("dense", 0) == 0


# ====================================================================== routing
def _factors(n, T, n_in, n_out):
    g = torch.Generator().manual_seed(n * 1000 + T)
    return Factors(torch.randn(n, T, n_in, generator=g), torch.randn(n, T, n_out, generator=g))


@pytest.mark.parametrize("n,T,width,expected", [
    (4, 1, 512, "ghost"),      # one position, a wide layer: (in+out) ≪ in·out
    (8, 4, 1024, "ghost"),     # short sequences, wide layer
    (4, 128, 64, "dense"),     # long sequences: T² (in+out) ≫ T·in·out
    (16, 512, 256, "dense"),
])
def test_ghost_and_dense_flops_order_by_shape(n, T, width, expected):
    """The FLOP counts of the two kernels (capture/factors.py): ghost wins for short
    sequences and wide layers, dense for long sequences."""
    L, R = _factors(2, T, width, width), _factors(n, T, width, width)
    args = (L.n, R.n, T, T, width, width)
    cheaper = "ghost" if ghost_flops(*args) <= dense_flops(*args, left_ready=True) else "dense"
    assert expected == cheaper


class SequenceModel(nn.Module):
    """A Linear applied at every one of T positions (in=4, out=6), then a classifier."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):                       # x: (B, T, 4)
        return self.head(torch.tanh(self.inner(x)).mean(1))


@pytest.mark.parametrize("T", [1, 40])
def test_trace_shows_the_kernel_that_ran(T):
    torch.manual_seed(0)
    model = SequenceModel().to(F64)
    task = ga.tasks.classification(model)
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(12, T, 4, generator=g, dtype=F64), torch.randint(0, 3, (12,), generator=g))
    query = (torch.randn(3, T, 4, generator=g, dtype=F64), torch.randint(0, 3, (3,), generator=g))
    G, Q = ga.grads(task, data, batch_size=4), ga.grads(task, query)
    ex = ga.LocalExecutor()
    auto = values(Q @ G.T, ex)
    chunks = 3
    # the head (T = 1, in=7, out=3) always goes ghost; the inner layer goes dense for long T
    if T == 1:
        assert dict(ex.trace) == {"ghost": 2 * chunks}
        chosen = {d.chosen for d in ex.last_plan.decisions.of(DecisionKind.KERNEL)}
        assert chosen <= {"ghost", "at run time"}, "the plan must not announce another kernel than ran"
    else:
        assert dict(ex.trace) == {"ghost": chunks, "dense": chunks}
        assert ghost_flops(3, 4, T, T, 5, 6) > dense_flops(3, 4, T, T, 5, 6, left_ready=True)
    with ga.options(ghost="never"):
        ex_never = ga.LocalExecutor()
    assert_close(values(Q @ G.T, ex_never), auto, rtol=1e-10, atol=1e-12, what="never vs auto")
    assert dict(ex_never.trace) == {"dense": 2 * chunks}
    expected = reference_rows(task, query, ("inner", "head")) @ reference_rows(task, data, ("inner", "head")).T
    assert_close(auto, expected, rtol=1e-9, atol=1e-11, what="scores")


def test_plan_reports_the_kernel_that_runs_for_token_inputs():
    """Token inputs give the planner T exactly: its decision is the kernel that runs."""
    model = models.gpt2(n_layer=1, n_embd=16, vocab=31)
    task = models.lm_task(model)
    G = ga.grads(task, models.padded_token_data(n=4, vocab=31, max_len=6), ["transformer.h.0.mlp.c_fc"],
                 batch_size=2)
    Q = ga.grads(task, models.padded_token_data(n=2, vocab=31, max_len=6, seed=4), ["transformer.h.0.mlp.c_fc"])
    ex = ga.LocalExecutor()
    (Q @ G.T).compute(executor=ex)
    decision = ex.last_plan.decisions.one(DecisionKind.KERNEL, block="transformer.h.0.mlp.c_fc")
    assert decision.chosen in ("ghost", "dense") and "T=6/6" in decision.reason
    assert dict(ex.trace) == {decision.chosen: 2}


def test_cnn_routes_conv_layers_dense_and_the_head_ghost():
    model = models.cnn()
    task = ga.tasks.classification(model)
    data, query = models.image_data(n=8), models.image_data(n=2, seed=5)
    G, Q = ga.grads(task, data, batch_size=4), ga.grads(task, query)
    ex = ga.LocalExecutor()
    got = values(Q @ G.T, ex)
    chosen = {d.block: d.chosen for d in ex.last_plan.decisions.of(DecisionKind.KERNEL)}
    # the executor measured the convolutions' positions (conv1: T=16, in=19, out=4): its
    # held rows are smaller flat than as factors, so they are kept flat and scored dense
    # (no kernel choice); conv2 (T=4, in=36, out=5) and fc (T=1) go the faster way by the
    # device profile: every chunk (2 per block) runs the kernel the plan recorded
    assert chosen["conv1"] == "dense" and chosen["fc"] == "ghost"
    ran = {"dense": 0, "ghost": 0}
    for layer in ("conv1", "conv2", "fc"):
        ran[chosen[layer]] += 2
    assert dict(ex.trace) == {k: v for k, v in ran.items() if v}
    layers = ("conv1", "conv2", "fc")
    expected = reference_rows(task, query, layers) @ reference_rows(task, data, layers).T
    assert_close(got, expected, rtol=1e-9, atol=1e-11, what="cnn scores")


# ====================================================================== streaming
def test_streaming_never_materializes_more_than_a_batch(monkeypatch):
    """n=40 training examples, batch_size=4: every materialized training block and every
    captured batch has at most 4 rows; only the 6 held query rows are materialized at once."""
    s = Setup(n_train=40, n_query=6, batch_size=4)
    sizes = []
    real = capture_chunks.materialize

    def spy(factors, *args, **kwargs):
        sizes.append(factors.n)
        return real(factors, *args, **kwargs)

    # every module that materializes factors: the rows of a chunk and the score kernels
    monkeypatch.setattr(capture_chunks, "materialize", spy)
    monkeypatch.setattr(gradalg.plan.jobs.scores, "materialize", spy)
    G = s.G()
    Q = ga.grads(s.task, s.query, ["0", "2"], batch_size=6)
    P = ga.proj.gaussian(8, seed=0)
    exprs = [
        ("dense scores", Q @ G.T, s.RQ @ s.R.T),
        ("projected influence", P(Q) @ ga.fisher(P(G)).damp(0.1).inv() @ P(G).T, None),
        ("block fisher", Q @ ga.fisher(G, "block").damp(0.1).inv() @ G.T, None),
    ]
    for what, S, expected in exprs:
        sizes.clear()
        s.forwards.clear()
        with ga.options(ghost="never"):
            got = values(S)
        assert sizes, what
        train_sizes = [n for n in sizes if n != Q.n]
        assert max(train_sizes) <= 4, f"{what}: materialized {sizes}"
        assert sizes.count(Q.n) <= 2 * len(G.space.blocks), f"{what}: the held side was materialized {sizes}"
        assert max(len(f) for f in s.forwards) <= 6 and s.train_forwards() == 10, what
        if expected is not None:
            assert_close(got, expected, rtol=1e-9, atol=1e-11, what=what)
