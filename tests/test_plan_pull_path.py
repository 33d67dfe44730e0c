"""Work the planner used to leave to run time, now decided and shown by the plan:

* a dense projection whose matrix is over the memory budget is refused when the plan is
  made (``explain()`` raises it), and the fix its message names works as written;
* where each pass runs is a typed :class:`~gradalg.plan.decisions.Decision` (kind
  ``PLACEMENT``), asserted by its fields;
* statistics an operator needs are computed by planned passes, also when the operator is
  resolved on its own (``executor.resolve``), against dense references.
"""
import re

import pytest
import torch

import gradalg as ga
from gradalg.errors import MemoryBudgetError
from gradalg.plan.shapes import ModelFacts


def _mlp(n=40, nq=5, width=64):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 10))
    X, y = torch.randn(n, width), torch.randint(0, 10, (n,))
    task = ga.tasks.classification(model)
    return task, ga.grads(task, (X, y)), ga.grads(task, (X[:nq], y[:nq]))


def test_a_dense_projection_over_the_budget_is_refused_by_the_plan_and_its_fix_works():
    _, G, Q = _mlp()
    P = ga.proj.gaussian(512)
    S = P(Q) @ P(G).T
    with ga.options(memory_budget="8MB", progress=False):
        with pytest.raises(MemoryBudgetError) as err:
            S.explain()                                   # at plan time: nothing ran
        msg = str(err.value)
        assert "dense gaussian projection of 4,810 coordinates to k=512" in msg and "19.7 MB" in msg
        assert "The memory budget is 8 MB (ga.options(memory_budget=...))" in msg   # the budget, as given
        with pytest.raises(MemoryBudgetError):
            S.compute()
        for fix in re.findall(r"ga\.proj\.\w+\(\d+\)", msg):   # each fix, applied as written
            P2 = eval(fix, {"ga": ga})
            S2 = P2(Q) @ P2(G).T
            S2.explain()
            assert S2.compute().values.shape == (5, 40)


def test_where_each_pass_runs_is_a_typed_decision():
    from gradalg.exec import Executor, LocalExecutor
    from gradalg.plan.decisions import DecisionKind
    from test_shard_strategy import Halves
    task, G, Q = _mlp(n=23, width=8)
    H = ga.fisher(G, structure="block").damp(0.1).inv()
    S = Q @ H @ G.T
    with ga.options(progress=False, batch_size=4):
        ex = Executor(shards=Halves())
        ex.scores(S.expr)
        local = LocalExecutor()
        local.scores(S.expr)
    p = ex.last_plan
    placed = p.decisions.of(DecisionKind.PLACEMENT)
    assert len(placed) == len(p.passes) == len(p.placement)
    for i, (d, step, where) in enumerate(zip(placed, p.passes, p.placement)):
        assert d.subject == (i, step.key)
        assert d.chosen == ("on shards" if where.sharded else "in this process")
        assert d.chosen == ("on shards" if step.reads_data else "in this process")   # Halves' rule
        assert set(d.alternatives) == {"in this process", "on shards"}
        assert d.alternatives["in this process"] == step.seconds
        assert d.reason.startswith("two halves" if step.reads_data else "rows in memory")
    # one process has nothing to choose: no placement decision
    assert local.last_plan.decisions.of(DecisionKind.PLACEMENT) == []
    # explain() renders them from the fields, with or without a run
    text = str(S.explain(executor=Executor(shards=Halves())))
    assert f"where pass 1 ({p.passes[0].label}) runs: chose {placed[0].chosen}" in text


@pytest.mark.parametrize("make", ["fisher", "kfac", "ekfac"])
def test_an_operator_resolved_on_its_own_has_its_statistics_planned(make):
    """``executor.resolve(op)`` outside a plan of ``op``: its statistics are the passes of a
    plan (estimated, placed by the shard strategy, run by the runner), the same numbers as
    ``executor.operator(op)``, the Fisher against the dense float64 reference."""
    from gradalg.exec import Executor, LocalExecutor
    from references import reference_rows
    from test_shard_strategy import Halves
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    X, y = torch.randn(13, 5), torch.randint(0, 3, (13,))
    task = ga.tasks.classification(model)
    G = ga.grads(task, (X, y), ["0", "2"])
    op = {"fisher": ga.fisher(G, structure="block"), "kfac": ga.kfac(G), "ekfac": ga.ekfac(G)}[make].expr
    with ga.options(progress=False, batch_size=4):
        ex, halves = LocalExecutor(), Executor(shards=Halves())
        got, sharded = ex.resolve(op), halves.resolve(op)
        want = LocalExecutor().operator(op)
    kinds = [j.kind for step in ex.last_plan.passes for j in step.jobs if j.kind != "store"]
    assert kinds == {"fisher": ["fisher"], "kfac": ["kfac"], "ekfac": ["kfac", "ekfac"]}[make]
    assert len(ex.pass_stats) == len(ex.last_plan.passes) and all(p.seconds > 0 for p in ex.last_plan.passes)
    assert halves.shards.sharded == [s.label for s in halves.last_plan.passes if s.reads_data]   # on shards
    torch.testing.assert_close(got.dense(), want.dense(), rtol=0, atol=0)
    torch.testing.assert_close(sharded.dense(), want.dense(), rtol=1e-5, atol=1e-7)   # float32 rows, summed per shard
    if make == "fisher":
        R = reference_rows(task, (X, y), ["0", "2"])
        blocks = [R[:, :24], R[:, 24:]]                      # (4×5 + 4) and (3×4 + 3) coordinates
        dense = torch.block_diag(*[b.T @ b / len(X) for b in blocks])
        torch.testing.assert_close(got.dense(), dense, rtol=1e-5, atol=1e-7)


def _datainf_reference(R, RQ, lam, splits):
    """DataInf's H⁻¹ applied to the query rows RQ, per block, from float64 rows R (n, dim)."""
    out, start = [], 0
    for width in splits:
        g, q = R[:, start:start + width], RQ[:, start:start + width]
        coef = (q @ g.T) / (lam + (g * g).sum(1))
        out.append((q - coef @ g / len(g)) / lam)
        start += width
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("shards", ["local", "halves"])
def test_datainf_reads_its_rows_in_a_planned_pass(shards):
    """DataInf applied to the held queries is a planned ``apply`` job (shown by explain(),
    estimated, run on shards by a strategy) in the pass that also keeps the training rows:
    the training data is read once, not again outside the plan; scores against float64."""
    from gradalg.exec import Executor, LocalExecutor
    from references import reference_rows
    from test_shard_strategy import Halves
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    X, y = torch.randn(30, 5), torch.randint(0, 3, (30,))
    task = ga.tasks.classification(model)
    G, Q = ga.grads(task, (X, y), ["0", "2"]), ga.grads(task, (X[:4], y[:4]), ["0", "2"])
    S = Q @ ga.datainf(G, 0.1) @ G.T
    reads = []

    class Counting(LocalExecutor if shards == "local" else Executor):
        def window(self, node, start=None, stop=None):      # rows read outside the plan's passes
            reads.append(node.label)
            return super().window(node, start, stop)

    with ga.options(progress=False, batch_size=8):
        text = str(S.explain())
        ex = Counting() if shards == "local" else Counting(shards=Halves())
        got = ex.scores(S.expr)
    assert "apply datainf⁻¹(λ=0.1) to the held rows" in text
    p = ex.last_plan
    jobs = [sorted(j.kind for j in step.jobs) for step in p.passes]
    assert jobs == [["collect"], ["apply", "store"], ["scores"]] and p.data_passes == 2
    apply_pass = p.passes[1]
    apply = next(j for j in apply_pass.jobs if j.kind == "apply")
    assert apply_pass.seconds > 0 and apply.cost.flops > 0      # estimated like any job
    assert reads == []                                   # nothing read outside the plan's passes
    R, RQ = reference_rows(task, (X, y), ["0", "2"]), reference_rows(task, (X[:4], y[:4]), ["0", "2"])
    want = _datainf_reference(R, RQ, 0.1, [24, 15]) @ R.T
    torch.testing.assert_close(got.to(torch.float64), want, rtol=1e-5, atol=1e-6)


def test_datainf_outside_a_held_side_still_reads_its_rows_when_applied():
    """Self-scores have no held side to apply it to in a pass: the operator reads its rows
    when applied, the same numbers as the float64 reference."""
    from references import reference_rows
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    X, y = torch.randn(30, 5), torch.randint(0, 3, (30,))
    task = ga.tasks.classification(model)
    G, Q = ga.grads(task, (X, y), ["0", "2"]), ga.grads(task, (X[:4], y[:4]), ["0", "2"])
    with ga.options(progress=False, batch_size=8):
        got = (Q @ ga.datainf(G, 0.1) @ Q.T).diag().compute().values
    R, RQ = reference_rows(task, (X, y), ["0", "2"]), reference_rows(task, (X[:4], y[:4]), ["0", "2"])
    want = (_datainf_reference(R, RQ, 0.1, [24, 15]) * RQ).sum(1)
    torch.testing.assert_close(torch.as_tensor(got).to(torch.float64), want, rtol=1e-5, atol=1e-6)


def test_the_scores_job_does_not_count_a_planned_application_again():
    """The apply job carries DataInf's application (its pass reads the rows); the scores
    job names it (``applied``: its key, decided in the plan) and its estimate is its own
    work only: the same job priced doing the application itself costs one ``apply_cost``
    (a read of the training rows) more."""
    from dataclasses import replace
    from gradalg.plan.estimates import apply_cost
    from gradalg.plan.planner import plan
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    X, y = torch.randn(30, 5), torch.randint(0, 3, (30,))
    task = ga.tasks.classification(model)
    G, Q = ga.grads(task, (X, y)), ga.grads(task, (X[:4], y[:4]))
    op = ga.datainf(G, 0.1).expr
    p = plan((Q @ ga.datainf(G, 0.1) @ G.T).expr)
    scores = next(j for j in p.jobs.values() if j.kind == "scores")
    layout = {b.name: "flat" for b in scores.held.space.blocks}
    (apply,) = [j for j in p.jobs.values() if j.kind == "apply"]
    assert scores.applied == apply.key and apply.key in scores.deps
    alone = replace(scores, applied=None).once_cost(ModelFacts(), lambda node: layout, p.options, set())
    planned = scores.once_cost(ModelFacts(), lambda node: layout, p.options, set())
    extra = apply_cost(op, scores.held.space, scores.held.n, 4, p.options)
    assert extra.flops > 0 and alone.flops == pytest.approx(planned.flops + extra.flops)
    assert alone.seconds(p.device, torch.float32) > planned.seconds(p.device, torch.float32)
