"""A ``compute()``'s intermediates are freed by reference counting when it returns (session
48, task ``cycles``): none is left to Python's cyclic garbage collector.

Scoring checkpoints in a loop, the resident set grew by each computation's intermediates
(~230 MiB per RelatIF on a tiny GPT-2; 7 GB after 50 checkpoints) until a full cyclic
collection happened to run: the cyclic GC runs on counts of allocated objects, not on
memory. The cycles were

* the executor and its pass runner (``Executor.runner.ctx`` was the executor): the run
  state (every resolved operator — factors, eigenbases —, kept and stored rows, results)
  and the last plan lived until the cyclic GC ran;
* the recursive ``visit`` closure of :func:`gradalg.expr.base.transform` (its cell held the
  function): its memo of rebuilt nodes and its ``fn`` (``freeze_ops``'s: an executor's
  ``resolve``) likewise;
* a resolved DataInf operator in the run state streams its training rows through the
  executor (``Resolution.rows``): executor → state → operator → executor. Session 48 had an
  executor made by ``compute()`` drop its run state when the result was assembled, which
  left the cycle wherever the user holds the operator or the executor (``H.to_dense()``,
  ``ex.operator(H)``, ``ga.compile``, ``explain(analyze=True)``); session 49 broke it at its
  cause: the stream holds its executor weakly (:meth:`gradalg.exec.resolve.Resolution.rows`),
  and the windows' ``freeze_ops`` keeps no recursive closure;
* likewise a products pass's matvec (CG / LiSSA / Arnoldi over a Hessian or Gauss-Newton),
  kept in the run state, recorded its calls through the executor it held (session 49: held
  weakly).

The check: with the cyclic GC disabled, compute, drop the result, then run one collection
that saves what it finds (``gc.DEBUG_SAVEALL``): no tensor may be among it. On ``main``
every method here failed it (RelatIF: 49 tensors, 1.1 MB, the stored rows' factors among
them; TRAK: 6 tensors, its projections).
"""
from __future__ import annotations

import gc

import pytest
import torch

import gradalg as ga

import models
from references import reference_rows
from test_plan_pull_path import _datainf_reference


def _items(n, queries, T=10, vocab=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": r} for r in torch.randint(1, vocab, (n + queries, T), generator=g)]


METHODS = {
    "grad_dot": lambda t, z, q: ga.methods.grad_dot(t, z, q),
    "influence": lambda t, z, q: ga.methods.influence(t, z, q),
    "ekfac": lambda t, z, q: ga.methods.influence(t, z, q, curvature="ekfac"),
    "relatif": lambda t, z, q: ga.methods.relatif(t, z, q),
    "logra": lambda t, z, q: ga.methods.logra(t, z, q, k=16),
    "trak": lambda t, z, q: ga.methods.trak(t, z, q, k=64),
    "self_influence": lambda t, z, q: ga.methods.self_influence(ga.methods.influence, t, z),
    "datainf": lambda t, z, q: ga.methods.influence(t, z, q, curvature="datainf"),
}


def _cyclic_garbage(run) -> list:
    """What the cyclic collector alone would free after ``run()`` (its result dropped):
    the objects of one saving collection run after it with the cyclic GC disabled."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        run()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
    finally:
        gc.set_debug(0)
        found = gc.garbage[:]
        gc.garbage.clear()
        if enabled:
            gc.enable()
    return found


@pytest.mark.parametrize("method", sorted(METHODS))
def test_compute_leaves_no_tensor_to_the_cyclic_collector(method):
    model = models.gpt2(dtype=torch.float32, n_layer=1, n_embd=32)
    task, items = ga.tasks.causal_lm(model), _items(16, 3)
    ran = []

    def run():
        with ga.options(progress=False, fingerprint_cache=False):
            ran.append(METHODS[method](task, items[:16], items[16:]).compute().shape)

    tensors = [x for x in _cyclic_garbage(run) if isinstance(x, torch.Tensor)]
    assert ran, "the computation ran"
    held = sum(t.numel() * t.element_size() for t in tensors)
    assert not tensors, (f"{len(tensors)} tensors ({held} bytes) outlived {method}'s compute() in reference "
                         f"cycles, e.g. shapes {[tuple(t.shape) for t in tensors[:5]]}")


def test_the_check_finds_a_cycle_holding_a_tensor():
    """The check sees a tensor kept only by a cycle (it is not vacuous)."""
    class Holder:
        pass

    def run():
        h = Holder()
        h.me, h.rows = h, torch.zeros(1000)

    found = [x for x in _cyclic_garbage(run) if isinstance(x, torch.Tensor)]
    assert [tuple(t.shape) for t in found] == [(1000,)]



class Recording(ga.LocalExecutor):
    """A local executor that records its ``close()`` calls in ``closed``."""
    closed: list = []

    def close(self):
        Recording.closed.append(self)
        super().close()


@pytest.fixture
def recording(monkeypatch):
    """``get_executor("recording")`` makes a :class:`Recording`; yields the list of closed ones."""
    import gradalg.exec.base as base

    made = base.get_executor
    monkeypatch.setattr(base, "get_executor",
                        lambda executor=None, **kw: Recording() if executor == "recording" else made(executor, **kw))
    monkeypatch.setattr(Recording, "closed", [])
    return Recording.closed


def test_an_executor_compute_made_is_closed_and_a_given_one_is_not(recording):
    """``compute(executor="dask")`` made a DaskExecutor whose LocalCluster (worker processes)
    was never closed: one more cluster left running per call. An executor ``compute()`` makes
    from a name is closed once the result is assembled; one the user passes stays open (it
    keeps its state on purpose: the user closes it)."""
    model = models.gpt2(dtype=torch.float32, n_layer=1, n_embd=32)
    task, items = ga.tasks.causal_lm(model), _items(8, 2)
    with ga.options(progress=False):
        S = ga.methods.grad_dot(task, items[:8], items[8:])
        by_name = S.compute(executor="recording").values
        assert len(recording) == 1
        mine = Recording()
        given = S.compute(executor=mine).values
        assert len(recording) == 1 and mine.state.results, "the executor the user passed is neither closed nor reset"
        mine.close()
    assert (by_name == given).all()


def test_to_dense_closes_an_executor_it_made(recording):
    """``G.to_dense(executor="dask")`` and ``H.to_dense(executor="dask")`` left their cluster
    running too: the executor they make is closed after the rows / matrix are read."""
    model = models.gpt2(dtype=torch.float32, n_layer=1, n_embd=32)
    task, items = ga.tasks.causal_lm(model), _items(8, 0)
    with ga.options(progress=False):
        G = ga.grads(task, items, layers=["transformer.h.0.mlp.c_proj"])
        rows = G.to_dense(executor="recording")
        H = ga.fisher(G).to_dense(executor="recording")
    assert len(recording) == 2
    flat = rows["transformer.h.0.mlp.c_proj"].reshape(8, -1).double()
    assert torch.allclose(H.double(), flat.T @ flat / 8, rtol=1e-4, atol=1e-7)



def _mlp_datainf():
    """DataInf (λ = 0.1) over an MLP's 22 training rows, 3 query rows, and their float64
    rows (R, RQ) and block widths for the reference."""
    task = ga.tasks.classification(models.mlp())
    X, y = models.classification_data(n=22)
    layers = ["0", "2"]
    G, Q = ga.grads(task, (X, y), layers), ga.grads(task, (X[:3], y[:3]), layers)
    R, RQ = reference_rows(task, (X, y), layers), reference_rows(task, (X[:3], y[:3]), layers)
    return G, Q, ga.datainf(G, 0.1), R, RQ, [b.dim for b in G.space.blocks]


def _alone(G, Q, H, R, RQ, widths):
    """Resolved by an executor dropped at once, then applied (its spare reads the rows)."""
    op = ga.LocalExecutor().operator(H.expr)
    return op.apply(RQ), _datainf_reference(R, RQ, 0.1, widths)


def _beside_its_executor(G, Q, H, R, RQ, widths):
    ex = ga.LocalExecutor()
    return ex.operator(H.expr).apply(RQ), _datainf_reference(R, RQ, 0.1, widths)


def _to_dense(G, Q, H, R, RQ, widths):
    return H.to_dense(), _datainf_reference(R, torch.eye(R.shape[1], dtype=R.dtype), 0.1, widths)


def _compiled(G, Q, H, R, RQ, widths):
    got = ga.compile(Q @ H @ G.T).compute().values
    return torch.as_tensor(got), _datainf_reference(R, RQ, 0.1, widths) @ R.T


def _explained(G, Q, H, R, RQ, widths):
    """``explain(analyze=True)`` of self-scores: the Explain keeps the executor that ran them."""
    e = (Q @ H @ Q.T).diag().explain(analyze=True)
    got = e.executor.state.diagonal(e.plan.simplified.scores)
    return torch.as_tensor(got), (_datainf_reference(R, RQ, 0.1, widths) * RQ).sum(1)


HELD_DATAINF = {"alone": _alone, "beside_its_executor": _beside_its_executor, "to_dense": _to_dense,
                "compiled": _compiled, "explain_analyze": _explained}


@pytest.mark.parametrize("use", sorted(HELD_DATAINF))
def test_a_datainf_operator_the_user_holds_is_freed_without_the_cyclic_collector(use):
    """A resolved DataInf operator streams its training rows through the executor that
    resolved it, and that executor's run state keeps the operator: executor → state →
    operator → stream → executor, a cycle with the run state in it (its kept rows and
    results: 26 tensors, 0.75 MB, after ``explain(analyze=True)`` of DataInf influence on a
    tiny GPT-2),
    freed only by the cyclic GC. The stream holds its executor weakly (and once it is gone
    a spare without its state reads the rows); the windows' ``freeze_ops`` keeps no
    recursive closure. Used every way a user holds one, the numbers are DataInf's float64
    reference and nothing of an executor, a run state, an operator or a tensor is left to
    the cyclic collector. (On main every case left the executor and its state.)"""
    from gradalg.exec.base import Executor
    from gradalg.exec.state import RunState
    from gradalg.linalg import LinearOp

    G, Q, H, R, RQ, widths = _mlp_datainf()
    ran = []

    def run():
        with ga.options(progress=False, fingerprint_cache=False):
            got, want = HELD_DATAINF[use](G, Q, H, R, RQ, widths)
        ran.append(torch.testing.assert_close(got.to(torch.float64), want, rtol=1e-8, atol=1e-10) or True)

    left = [x for x in _cyclic_garbage(run) if isinstance(x, (Executor, RunState, LinearOp, torch.Tensor))]
    assert ran, "the operator was applied"
    assert not left, f"left to the cyclic collector after {use}: {sorted({type(x).__name__ for x in left})}"


def test_a_products_pass_the_user_holds_is_freed_without_the_cyclic_collector():
    """A products pass's matvec (:class:`~gradalg.plan.jobs.products.ProductPass`, each call
    one run of the pass: CG, LiSSA or Arnoldi over a Gauss-Newton or a Hessian) is kept in
    the run state and recorded each call's seconds through the executor it held: executor →
    state → matvec → executor, a cycle with the run state in it wherever the user holds the
    executor (``explain(analyze=True)``, ``ex.operator(H)``). It holds the executor weakly:
    the calls are still counted in the products pass's measured row, the scores are the dense
    Gauss-Newton's, and nothing of an executor, a run state or an operator is left to the
    cyclic collector (on main: the executor, its state and the solved operator)."""
    from gradalg.exec.base import Executor
    from gradalg.exec.state import RunState
    from gradalg.linalg import LinearOp

    task = ga.tasks.classification(models.mlp())
    (X, y), ran = models.classification_data(n=40), []
    S = ga.methods.influence(task, (X, y), (X[:3], y[:3]), curvature="gauss_newton", solver="cg", damping=0.1)

    def run():
        with ga.options(progress=False, fingerprint_cache=False):
            e = S.explain(analyze=True)
            got, calls = e.executor.state.scores(e.plan.simplified), [r.get("measured_calls") for r in e.passes()]
            flat = lambda R: torch.cat([v.flatten(1) for v in R.to_dense().values()], 1)   # noqa: E731
            Q, G, H = flat(ga.grads(task, (X[:3], y[:3]))), flat(ga.grads(task, (X, y))), ga.gauss_newton(task, (X, y))
            H = H.to_dense()
        want = Q @ torch.linalg.solve(H + 0.1 * torch.eye(len(H), dtype=H.dtype), G.T)
        torch.testing.assert_close(torch.as_tensor(got), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
        ran.append([c for c in calls if c is not None])

    run()      # warm: the first products import torch's functorch / dynamo, whose import leaves cyclic garbage
    left = [x for x in _cyclic_garbage(run) if isinstance(x, (Executor, RunState, LinearOp, torch.Tensor))]
    assert len(ran) == 2 and len(ran[1]) == 1 and ran[1][0] >= 1, ran     # the products pass's calls, counted
    assert not left, f"left to the cyclic collector: {sorted({type(x).__name__ for x in left})}"
