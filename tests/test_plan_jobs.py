"""The typed plan and its interpreter: every job class runs through the pass runner and
gives the dense reference's numbers; the executor runs what the plan decided (forced
choices, kernels) and never re-decides; each threshold option changes the plan as
``explain()`` displays it."""
from __future__ import annotations

import functools
import pickle
import os
import sys

import pytest
import torch

import gradalg as ga
from gradalg.capture.chunks import flatten
from gradalg.plan import Choices, DecisionKind, DecisionSource
from gradalg.plan.jobs import CollectJob, DiagJob, EKFACJob, FisherJob, GroupJob, KFACJob, ScoresJob, StoreJob
from gradalg.plan.planner import plan

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import reference_rows  # noqa: E402

LAYERS = ("0", "2")
TOL = dict(rtol=1e-9, atol=1e-11)


@functools.cache
def setup():
    model = models.mlp()                       # Linear(8, 16) → tanh → Linear(16, 3), float64
    task = ga.tasks.classification(model)
    train, query = models.classification_data(24, seed=1), models.classification_data(3, seed=2)
    return dict(model=model, task=task, train=train, query=query,
                R=reference_rows(task, train, LAYERS), RQ=reference_rows(task, query, LAYERS))


def grads(s=None, which="train", batch_size=5):
    s = s or setup()
    return ga.grads(s["task"], s[which], list(LAYERS), batch_size=batch_size)


def job_classes(p) -> set:
    return {type(j) for step in p.passes for j in step.jobs}


def run(S, ex):
    out = S.compute(executor=ex)
    return out if isinstance(out, torch.Tensor) else torch.as_tensor(out.values)


def kfac_reference(s):
    """Per layer (S, A) = (E[d dᵀ], E[a aᵀ]) for an MLP (one position per example): a the
    layer's input with a ones column, d = ∂loss/∂output, the gradient's bias column."""
    x, _ = s["train"]
    model, R, n = s["model"], s["R"], s["train"][0].shape[0]
    ones = torch.ones(n, 1, dtype=x.dtype)
    inputs = {"0": torch.cat([x, ones], 1), "2": torch.cat([torch.tanh(model[0](x)).detach(), ones], 1)}
    out, start = {}, 0
    for name in LAYERS:
        o, i = model[int(name)].out_features, model[int(name)].in_features + 1
        G = R[:, start:start + o * i].reshape(n, o, i)
        start += o * i
        d, a = G[:, :, -1], inputs[name]
        out[name] = (d.T @ d / n, a.T @ a / n, R[:, start - o * i:start])
    return out


# ---------------------------------------------------------------------- the job types
def test_collect_and_scores_jobs_round_trip():
    s = setup()
    G, Q = grads(), grads(which="query")
    ex = ga.LocalExecutor()
    rows = ex.gradients(G.expr)
    assert job_classes(ex.last_plan) == {CollectJob}
    torch.testing.assert_close(flatten(rows, G.expr.space).to(torch.float64), s["R"], **TOL)
    got = run(Q @ G.T, ex)
    assert job_classes(ex.last_plan) == {CollectJob, ScoresJob}
    torch.testing.assert_close(got, s["RQ"] @ s["R"].T, **TOL)
    # results are keyed by (kind, token), not by strings built from them
    assert ("scores", (Q @ G.T).expr.token) in ex.state.results


def test_fisher_and_store_jobs_round_trip():
    s = setup()
    G, Q = grads(), grads(which="query")
    S = Q @ ga.fisher(G).damp(0.1).inv() @ G.T
    ex = ga.LocalExecutor(choices=Choices(store="always"))
    got = run(S, ex)
    assert {FisherJob, StoreJob, ScoresJob} <= job_classes(ex.last_plan)
    R, RQ = s["R"], s["RQ"]
    F = R.T @ R / R.shape[0]
    want = RQ @ torch.linalg.solve(F + 0.1 * torch.eye(F.shape[0], dtype=F.dtype), R.T)
    torch.testing.assert_close(got, want, **TOL)


def test_group_job_round_trips():
    s = setup()
    groups = [i % 4 for i in range(24)]
    G, Q = grads(), grads(which="query")
    ex = ga.LocalExecutor()
    got = run(Q @ G.group_mean(groups).T, ex)
    assert GroupJob in job_classes(ex.last_plan)
    means = torch.stack([s["R"][[i for i, g in enumerate(groups) if g == k]].mean(0) for k in range(4)])
    torch.testing.assert_close(got, s["RQ"] @ means.T, **TOL)


def test_held_group_means_are_read_where_their_group_job_keeps_them():
    """LESS's held side is a group mean: its group job keeps the rows, and the scores read
    them there; no pass collects (copies) them again. Held the other way, they are
    streamed from the group job's rows."""
    s = setup()
    groups = [0, 1, 0]                          # 3 queries, 2 groups
    G, Q = grads(), grads(which="query")
    S = Q.group_mean(groups) @ G.T
    ex = ga.LocalExecutor(choices=Choices(held="left"))
    got = run(S, ex)
    p = ex.last_plan
    assert job_classes(p) == {GroupJob, ScoresJob}
    assert [[j.kind for j in step.jobs] for step in p.passes] == [["group"], ["scores"]]
    means = torch.stack([s["RQ"][[i for i, g in enumerate(groups) if g == k]].mean(0) for k in range(2)])
    torch.testing.assert_close(got, means @ s["R"].T, **TOL)
    right = run(S, ga.LocalExecutor(choices=Choices(held="right")))
    torch.testing.assert_close(right, means @ s["R"].T, **TOL)


def test_diag_jobs_round_trip():
    s = setup()
    G = grads()
    ex = ga.LocalExecutor()
    got = (G @ G.T).diag().compute(executor=ex)
    assert job_classes(ex.last_plan) == {DiagJob}
    torch.testing.assert_close(torch.as_tensor(got.values), (s["R"] ** 2).sum(1), **TOL)
    # the preconditioned self-influence: a Fisher pass, then the diagonal ⟨g_i, (F + λI)⁻¹ g_i⟩
    R = s["R"]
    F = R.T @ R / R.shape[0]
    got = torch.as_tensor((G @ ga.fisher(G).damp(0.1).inv() @ G.T).diag().compute(executor=ex).values)
    assert {FisherJob, DiagJob} <= job_classes(ex.last_plan)
    want = (R * torch.linalg.solve(F + 0.1 * torch.eye(F.shape[0], dtype=F.dtype), R.T).T).sum(1)
    torch.testing.assert_close(got, want, **TOL)


def test_kfac_and_ekfac_jobs_round_trip():
    s = setup()
    G = grads()
    ref = kfac_reference(s)
    ex = ga.LocalExecutor()
    K = ex.operator(ga.kfac(G).expr)
    assert job_classes(ex.last_plan) == {KFACJob}
    want = torch.block_diag(*[torch.kron(S_, A_) for S_, A_, _ in ref.values()])
    torch.testing.assert_close(K.dense(), want, **TOL)
    E = ex.operator(ga.ekfac(G).expr)
    assert {KFACJob, EKFACJob} <= job_classes(ex.last_plan) <= {KFACJob, EKFACJob, StoreJob}
    blocks = []
    for S_, A_, rows in ref.values():
        Q_S, Q_A = torch.linalg.eigh(S_)[1], torch.linalg.eigh(A_)[1]
        B = torch.kron(Q_S, Q_A)
        corrected = ((rows @ B) ** 2).mean(0)     # E[(Q_Sᵀ G Q_A)²] in the K-FAC eigenbasis
        blocks.append(B @ torch.diag(corrected) @ B.T)
    torch.testing.assert_close(E.dense(), torch.block_diag(*blocks), rtol=1e-8, atol=1e-10)


def test_rows_a_pass_cannot_keep_beside_its_statistics_are_read_again():
    """Issue 28: EK-FAC on the Llama-200M shape at T = 512 was refused at its default
    budget: the first pass kept the training rows for the correction pass (under the store
    cap) beside the float64 factor sums, over the budget, where reading the rows again
    fits. The planner now reads them again, shown as a STORE decision with the refusal and
    the recomputing plan's cost; the scores equal the stored plan's to 1e-10 (the same rows
    recaptured). A forced Choices(store="always") is still refused."""
    from gradalg.errors import MemoryBudgetError
    G, Q = grads(batch_size=1), grads(which="query", batch_size=1)    # batches of one: the smallest pass
    S = Q @ ga.ekfac(G).damp(0.1).inv() @ G.T
    ex = ga.LocalExecutor()
    want = run(S, ex)                                  # the default budget: the rows stored
    assert StoreJob in job_classes(ex.last_plan) and ex.last_plan.data_passes == 2
    # 20 kB, rows stored under half of it: the first pass would hold 21 kB of statistics and
    # stored rows and 1.7 kB per example; without them 12.4 kB, and every pass fits (15.9 kB at most)
    with ga.options(memory_budget=20_000, store_fraction=0.5):
        with pytest.raises(MemoryBudgetError):
            plan(S.expr, choices=Choices(store="always"))
        ex = ga.LocalExecutor()
        got = run(S, ex)
    p = ex.last_plan
    assert StoreJob not in job_classes(p) and p.data_passes == 4
    fallback = [d for d in p.decisions.of(DecisionKind.STORE) if d.subject == "memory budget"]
    assert len(fallback) == 1 and fallback[0].chosen == "recompute"
    assert fallback[0].alternatives["store"].startswith("refused") and fallback[0].alternatives["recompute"] > 0
    # forced to recompute by the planner's own fallback, not by the caller: typed as the planner's
    assert all(d.source is DecisionSource.PLANNER and d.setting == "" for d in p.decisions.of(DecisionKind.STORE))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------- interpreting, never re-deciding
def test_forced_choices_are_obeyed_and_recorded():
    s = setup()
    G, Q = grads(), grads(which="query")
    S = Q @ ga.fisher(G).damp(0.1).inv() @ G.T
    R, RQ = s["R"], s["RQ"]
    F = R.T @ R / R.shape[0]
    want = RQ @ torch.linalg.solve(F + 0.1 * torch.eye(F.shape[0], dtype=F.dtype), R.T)
    # the queries held, the training rows read again after the Fisher instead of stored
    ex = ga.LocalExecutor(choices=Choices(held="left", store="never"))
    torch.testing.assert_close(run(S, ex), want, **TOL)
    p = ex.last_plan
    d = p.decisions.one(DecisionKind.STORE)
    assert d.chosen == "recompute" and d.forced
    assert (d.source, d.setting) == (DecisionSource.CHOICES, "store='never'")
    assert d.explanation() == f"forced by Choices(store='never'); {d.reason}"     # rendered from the fields
    assert pickle.loads(pickle.dumps(d)) == d and d.to_dict()["source"] == "choices"
    assert StoreJob not in job_classes(p) and p.data_passes == 3
    held = p.decisions.one(DecisionKind.HELD_SIDE)
    assert held.chosen == "left (query) rows" and (held.source, held.setting) == (DecisionSource.CHOICES, "held='left'")
    # the training rows held (collected beside the Fisher), the queries streamed
    ex = ga.LocalExecutor(choices=Choices(held="right"))
    torch.testing.assert_close(run(S, ex), want, **TOL)
    p = ex.last_plan
    d = p.decisions.one(DecisionKind.HELD_SIDE)
    assert d.chosen == "right (training) rows" and (d.source, d.setting) == (DecisionSource.CHOICES, "held='right'")
    (job,) = [j for step in p.passes for j in step.jobs if isinstance(j, ScoresJob)]
    assert job.transposed and job.held == G.expr and job.streams == (Q.expr,)


def test_decisions_forced_by_options_are_typed_and_the_planners_own_are_not():
    s = setup()
    G, Q = grads(s), grads(s, which="query")
    S = Q @ G.T
    want = s["RQ"] @ s["R"].T
    with ga.options(ghost="always"):
        ex = ga.LocalExecutor()
        torch.testing.assert_close(run(S, ex), want, **TOL)
    kernels = ex.last_plan.decisions.of(DecisionKind.KERNEL)
    assert kernels and all((d.chosen, d.source, d.setting) == ("ghost", DecisionSource.OPTIONS, "ghost='always'")
                           for d in kernels)
    assert all(d.to_dict()["reason"] == "forced by ga.options(ghost='always'); " + d.reason for d in kernels)
    with ga.options(row_storage="flat"):
        ex = ga.LocalExecutor()
        torch.testing.assert_close(run(S, ex), want, **TOL)
    stored = ex.last_plan.decisions.of(DecisionKind.HELD_STORAGE)
    assert stored and all((d.source, d.setting) == (DecisionSource.OPTIONS, "row_storage='flat'") for d in stored)
    ex = ga.LocalExecutor()
    torch.testing.assert_close(run(S, ex), want, **TOL)
    p = ex.last_plan
    assert p.decisions and all(d.source is DecisionSource.PLANNER and not d.forced and d.setting == ""
                               and d.explanation() == d.reason for d in p.decisions)
    with pytest.raises(ga.plan.PlanError, match="names its setting"):
        p.decisions[0].__class__(DecisionKind.STORE, "x", "store", {}, source=DecisionSource.CHOICES)


def test_normalization_of_the_streamed_side_is_a_decision_the_sink_follows():
    s = setup()
    G, Q = grads(), grads(which="query")
    S = Q @ G.normalize().T
    ex = ga.LocalExecutor()
    got = run(S, ex)
    d = ex.last_plan.decisions.one(DecisionKind.NORMALIZATION)
    (job,) = [j for step in ex.last_plan.passes for j in step.jobs if isinstance(j, ScoresJob)]
    assert d.chosen == "in the score kernel" and job.normalize_streamed and set(d.alternatives) == {
        "in the score kernel", "row-wise"}
    R = s["R"]
    torch.testing.assert_close(got, s["RQ"] @ (R / R.norm(dim=1, keepdim=True)).T, **TOL)


def test_the_executor_runs_the_kernels_the_plan_names():
    """Kernels are the plan's: a plan edited to say dense for a block the planner sent to
    ghost runs dense there, with the same numbers."""
    s = setup()
    G, Q = grads(), grads(which="query")
    ex = ga.LocalExecutor()
    p = ex.plan((Q @ G.T).expr)
    (job,) = [j for step in p.passes for j in step.jobs if isinstance(j, ScoresJob)]
    assert job.kernels == {"0": "ghost", "2": "ghost"}
    job.kernels["0"] = "dense"
    ex.run(p)
    chunks = -(-24 // 5)
    assert dict(ex.trace) == {"ghost": chunks, "dense": chunks}
    torch.testing.assert_close(ex.state.scores(p.simplified), s["RQ"] @ s["R"].T, **TOL)


def test_conv_kernels_are_decided_before_the_run():
    """Convolutions' positions are measured before a run is planned: every block has a
    kernel decision, and every chunk runs the kernel its block's decision names."""
    model = models.cnn()
    task = ga.tasks.classification(model)
    G, Q = ga.grads(task, models.image_data(n=8), batch_size=4), ga.grads(task, models.image_data(n=2, seed=5))
    display = plan((Q @ G.T).expr)
    assert {d.chosen for d in display.decisions.of(DecisionKind.KERNEL)} >= {"when run"}
    ex = ga.LocalExecutor()
    (Q @ G.T).compute(executor=ex)
    kernels = {d.block: d.chosen for d in ex.last_plan.decisions.of(DecisionKind.KERNEL)}
    assert len(kernels) == len(G.layers) and set(kernels.values()) <= {"ghost", "dense"}
    ran = {k: v * 1 for k, v in ex.trace.items()}
    assert sum(ran.values()) == 2 * len(G.layers)           # 2 chunks × every block
    assert ran.get("ghost", 0) == 2 * sum(v == "ghost" for v in kernels.values())


def test_captured_rows_are_planned_with_their_recorded_positions():
    """Rows recorded by ga.capture are in memory: the plan reads their factors' shapes and
    decides every kernel (T = 1 for an MLP: ghost), and the run follows it."""
    import torch.nn.functional as F_

    s = setup()
    model = s["model"]
    x, y = s["train"]
    with ga.capture(model, layers=list(LAYERS)) as cap:
        for a in range(0, 24, 8):
            F_.cross_entropy(model(x[a:a + 8]), y[a:a + 8], reduction="sum").backward()
    model.zero_grad(set_to_none=True)
    Q = grads(which="query")
    S = Q @ cap.grads.T
    display = plan(S.expr)
    for name in LAYERS:
        d = display.decisions.one(DecisionKind.KERNEL, block=name)
        assert d.chosen == "ghost" and "T=1/1" in d.reason
    ex = ga.LocalExecutor()
    got = run(S, ex)
    assert dict(ex.trace) == {"ghost": 3 * len(LAYERS)}
    torch.testing.assert_close(got, s["RQ"] @ s["R"].T, **TOL)


# ---------------------------------------------------------------------- thresholds as options
def influence():
    G, Q = grads(), grads(which="query")
    return Q @ ga.fisher(G).damp(0.1).inv() @ G.T


def test_store_fraction_decides_the_store_and_is_shown():
    S = influence()
    assert plan(S.expr).decisions.one(DecisionKind.STORE).chosen == "store"
    with ga.options(store_fraction=1e-9):
        p = plan(S.expr)
        text = str(S.explain())
    d = p.decisions.one(DecisionKind.STORE)
    assert d.chosen == "recompute" and isinstance(d.alternatives["store"], str)    # over the cap: not costed
    assert "would exceed the store cap" in d.reason and "store_fraction=1e-09" in text


@pytest.mark.parametrize("mode", ["flat", "factors"])
def test_row_storage_decides_how_rows_are_kept_and_is_shown(mode):
    s = setup()
    G, Q = grads(), grads(which="query")
    S = Q @ G.T
    assert plan(S.expr).decisions.one(DecisionKind.HELD_STORAGE).chosen == "factors"     # an MLP: factors are smaller
    with ga.options(row_storage=mode):
        p = plan(S.expr)
        text = str(S.explain())
        ex = ga.LocalExecutor()
        got = run(S, ex)
    assert p.decisions.one(DecisionKind.HELD_STORAGE).chosen == mode and f"row_storage={mode!r}" in text
    (job,) = [j for step in p.passes for j in step.jobs if isinstance(j, ScoresJob)]
    assert set(job.kernels.values()) == {"ghost" if mode == "factors" else "dense"}
    torch.testing.assert_close(got, s["RQ"] @ s["R"].T, **TOL)


def test_ghost_slice_elements_is_shown_and_keeps_the_numbers():
    s = setup()
    G, Q = grads(), grads(which="query")
    with ga.options(ghost_slice_elements=4):
        text = str((Q @ G.T).explain())
        got = run(Q @ G.T, ga.LocalExecutor())
    assert "in slices of at most 4 elements" in text
    torch.testing.assert_close(got, s["RQ"] @ s["R"].T, **TOL)


def test_reuse_buffer_bytes_is_shown_for_dense_kernels():
    s = setup()
    G, Q = grads(), grads(which="query")
    with ga.options(ghost="never", reuse_buffer_bytes=64):
        text = str((Q @ G.T).explain())
        got = run(Q @ G.T, ga.LocalExecutor())
    assert "streamed blocks of 64 B or more are materialized into one reused buffer" in text
    torch.testing.assert_close(got, s["RQ"] @ s["R"].T, **TOL)


def test_device_memory_fraction_sets_the_budget_shown_for_another_device():
    from gradalg.plan.cost import _si
    from gradalg.devices import profile

    S = influence()
    with ga.options(device_memory_fraction=0.1):
        e = S.explain(device="a100")
    assert e.plan.options.memory_budget == int(0.1 * profile("a100").memory)
    assert f"memory budget {_si(e.plan.options.memory_budget)}B" in str(e)


@pytest.mark.parametrize("bad", [dict(store_fraction=0), dict(store_fraction=1.5), dict(row_storage="both"),
                                 dict(ghost_slice_elements=0), dict(reuse_buffer_bytes=-1),
                                 dict(device_memory_fraction=True)])
def test_threshold_options_are_validated(bad):
    with pytest.raises(ga.OptionError):
        ga.options(**bad)
