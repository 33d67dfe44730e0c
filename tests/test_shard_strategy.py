"""The one compute path with a shard strategy written here (:class:`gradalg.exec.ShardStrategy`).

An executor is :class:`gradalg.exec.Executor` and a strategy: where each pass runs is
decided when the plan is made (``plan.placement``) and read from the plan by the runner;
only passes placed on shards reach ``run_shards``. A strategy that splits every pass over
data into two halves in this process (fresh sinks per half, partial states absorbed in
order, as the Dask and torch.distributed strategies do across processes) gives the local
executor's numbers for scores, self-scores, top-k and operators.
"""
import pytest
import torch

import gradalg as ga
from gradalg.exec import Executor, LocalExecutor, ShardStrategy
from gradalg.plan.placement import Placement
from gradalg.exec.shards import restrict_step, shard_ranges


class Halves(ShardStrategy):
    """Every pass over data as two shards, here; passes over rows in memory whole."""

    keeps_held_rows = True   # accumulators are opened again per shard: the raw held rows are read again

    def __init__(self):
        self.placed, self.sharded = [], []

    def place(self, step):
        self.placed.append(step.label)
        return Placement(True, "two halves") if step.reads_data else Placement(False, "rows in memory")

    def run_shards(self, runner, step, accs):
        self.sharded.append(step.label)
        data = step.sources()[0].data
        for start, stop in shard_ranges(data.n, 2):
            shard = restrict_step(step, data.token, start, stop)
            parts = [job.accumulator(runner.ctx) for job in shard.jobs]
            for job, part in zip(shard.jobs, parts):
                job.for_shard(part, start)
            runner.feed(shard, parts)
            for acc, part in zip(accs, parts):
                acc.absorb(part.export())
        return {}


def _setting(n=23, nq=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    X, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
    return ga.tasks.classification(model), (X, y), (X[:nq], y[:nq])


@pytest.mark.parametrize("curvature", ["kfac", "ekfac", "empirical"])
def test_a_strategy_of_two_halves_equals_the_local_executor(curvature):
    task, train, queries = _setting()
    S = ga.methods.influence(task, train, queries, curvature=curvature)
    with ga.options(progress=False, batch_size=4):
        local = LocalExecutor().scores(S.expr)
        strategy = Halves()
        ex = Executor(shards=strategy)
        got = ex.scores(S.expr)
    torch.testing.assert_close(got, local, rtol=1e-4, atol=1e-6)
    p = ex.last_plan
    # the placement was decided once per pass, when the plan was made, and read from it
    assert len(p.placement) == len(p.passes) and strategy.placed == [step.label for step in p.passes]
    assert strategy.sharded == [step.label for step, where in zip(p.passes, p.placement) if where.sharded]


def test_self_scores_topk_and_operators_take_the_same_path():
    task, train, _ = _setting(n=17)
    G = ga.grads(task, train)
    S = G @ G.T
    H = ga.fisher(G, structure="block")
    with ga.options(progress=False, batch_size=4):
        local, halves = LocalExecutor(), Executor(shards=Halves())
        torch.testing.assert_close(halves.diagonal(S.diag().expr), local.diagonal(S.diag().expr))
        from gradalg.plan.jobs import TopK
        values, positions = halves.topk(S.expr, TopK(3, True))
        want_values, want_positions = local.topk(S.expr, TopK(3, True))
        torch.testing.assert_close(values, want_values)
        assert torch.equal(positions, want_positions)
        torch.testing.assert_close(halves.operator(H.expr).dense(), local.operator(H.expr).dense())


def test_the_executors_differ_only_in_their_strategy():
    """DaskExecutor and TorchDistributed write no entry point of their own."""
    from gradalg.exec.dask import DaskExecutor, DaskShards
    from gradalg.exec.distributed import RankShards, TorchDistributed
    entry = {"plan", "run", "compute", "scores", "diagonal", "topk", "gradients", "operator", "resolve", "window",
             "windows"}
    for cls, strategy in ((DaskExecutor, DaskShards), (TorchDistributed, RankShards)):
        assert cls.__mro__[1:3] == (strategy, ShardStrategy) and Executor in cls.__mro__
        assert not entry & set(vars(cls)) and not entry & set(vars(strategy))


def test_the_plan_records_placement_the_strategy_only_answers_where():
    """The place stage (``plan.placement.place_passes``) asks the strategy's ``place`` once
    per pass and writes the ``PLACEMENT`` / ``SHARDS`` decisions itself: the strategy has
    no decision-making member, and a plan made without an executor is placed by the stage
    alone (alternatives: the pass's seconds here, and divided by ``ways()`` on shards)."""
    from gradalg.plan import DecisionKind
    from gradalg.plan.placement import place_passes
    from gradalg.plan.planner import plan

    class Thirds(Halves):
        def ways(self):
            return 3

        def place(self, step):
            return Placement(True, "thirds", shards=3, weighed=(("fixed", "3"),)) if step.reads_data \
                else Placement(False, "rows in memory")

    assert not hasattr(ShardStrategy, "placement") and not hasattr(Executor, "place_passes")
    task, train, queries = _setting()
    S = ga.methods.influence(task, train, queries, curvature="kfac")
    with ga.options(progress=False, batch_size=4):
        p = plan(S.expr)
    assert p.placement == () and not p.decisions.of(DecisionKind.PLACEMENT)
    placed = place_passes(p, Thirds())
    assert len(placed.placement) == len(p.passes) and list(placed.decisions)[:len(p.decisions)] == list(p.decisions)
    where = placed.decisions.of(DecisionKind.PLACEMENT)
    shards = placed.decisions.of(DecisionKind.SHARDS)
    assert [d.subject for d in where] == [(i, step.key) for i, step in enumerate(p.passes)]
    for d, step in zip(where, p.passes):
        assert d.chosen == ("on shards" if step.reads_data else "in this process")
        assert d.alternatives == {"in this process": step.seconds, "on shards": step.seconds / 3}
    assert [d.subject for d in shards] == [(i, step.key) for i, step in enumerate(p.passes) if step.reads_data]
    assert all(d.chosen == "3" and d.alternatives == {"fixed": "3"} for d in shards)
    # a strategy that never shards places every pass here and records nothing
    local = place_passes(p, LocalExecutor().shards)
    assert all(not w.sharded for w in local.placement) and list(local.decisions) == list(p.decisions)


def test_a_pass_names_its_models_and_the_operators_its_chains_apply():
    """``Pass.models()`` (distinct, in the jobs' order) and ``Pass.operators()`` (the
    row-wise chains' operators, in order), as the Dask strategy asks them."""
    from gradalg.plan.planner import plan

    task, train, queries = _setting()
    G, Q = ga.grads(task, train), ga.grads(task, queries)
    H = ga.fisher(G, structure="block").damp(0.1)
    N = G.normalize(metric=H)
    with ga.options(progress=False, batch_size=4):
        p = plan((Q @ N.T).expr)
    reading = [step for step in p.passes if step.reads_data]
    assert reading and all(step.models() == [task.model] for step in reading)
    ops = [op for step in p.passes for op in step.operators()]
    assert ops and {op.token for op in ops} == {N.expr.op.token}
