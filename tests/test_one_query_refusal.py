"""A refusal never offers "use fewer queries per call" when one query is held already
(issue 28, session 37: EK-FAC influence on the Llama-200M shape at T = 512 with one
query was refused with that fix, which cannot be applied). Budgets swept from the plan's
peak down on a small GPT-2; the same sweep with two queries still offers it somewhere."""
from __future__ import annotations

import torch

import gradalg as ga

import models


def _messages(n_queries: int) -> list[str]:
    model = models.gpt2(dtype=torch.float32, n_layer=2, n_embd=64)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 101, (8 + n_queries, 32), generator=g)
    task = ga.tasks.causal_lm(model)
    rows = [{"input_ids": r} for r in ids]
    S = ga.methods.influence(task, rows[:8], rows[8:], curvature="ekfac")
    with ga.options(progress=False, memory_budget="4GB"):
        peak = ga.exec.LocalExecutor().plan(S.expr).peak_bytes
    out = []
    for f in [1.0 - i / 50 for i in range(1, 45)]:
        try:
            with ga.options(progress=False, memory_budget=int(f * peak)):
                ga.exec.LocalExecutor().plan(S.expr)
        except ga.MemoryBudgetError as err:
            out.append(str(err))
    return out


def test_one_query_is_never_told_to_use_fewer_queries():
    messages = _messages(1)
    assert messages, "no budget of the sweep was refused"
    assert not [m for m in messages if "fewer queries" in m], messages
