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
        assert "8.39 MB" in msg                           # the budget, and where it came from
        with pytest.raises(MemoryBudgetError):
            S.compute()
        for fix in re.findall(r"ga\.proj\.\w+\(\d+\)", msg):   # each fix, applied as written
            P2 = eval(fix, {"ga": ga})
            S2 = P2(Q) @ P2(G).T
            S2.explain()
            assert S2.compute().values.shape == (5, 40)
