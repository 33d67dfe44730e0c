"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): ``ga.exec.TorchDistributed`` post-hoc
attribution with the model sharded by FSDP2 or replicated by DDP, against a single-process
``LocalExecutor`` result computed here on a plain copy of the model. Rank 0 writes
``{case: "ok" | error}`` as JSON to the path given as the first argument.

Each case checks, on every rank: the DataArray's dims and coordinates equal the single
process's, its values equal them to float64 tolerance, and every rank holds the same bits.
The data splits unevenly (13 training examples, batch 3: ranks read 7 and 6 examples in 3
and 2 batches, the second rank pads one), and one query set has fewer examples than ranks.
Every collective of a case runs before its assertions, so a failing check on one rank
cannot leave the other waiting.
"""
from __future__ import annotations

import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import gradalg as ga
from gradalg.errors import DistributedError
from cases import run_and_report  # noqa: E402 - the script folder is on sys.path
from models import classification_data, gpt2, mlp

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
R, W = dist.get_rank(), dist.get_world_size()
GPT2_LAYERS = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"]


def wrap(model, how):
    if how == "ddp":
        return DDP(model)
    if hasattr(model, "transformer"):           # GPT-2: each block its own FSDP unit
        for block in model.transformer.h:
            fully_shard(block)
    else:
        fully_shard(model[0])
        fully_shard(model[2])
    fully_shard(model)
    return model


def mlp_case():
    X, y = classification_data(n=18, seed=5)
    return mlp, ga.tasks.classification, (X[:13], y[:13]), (X[13:18], y[13:18]), None


def gpt2_case():
    g = torch.Generator().manual_seed(2)
    seqs = []
    for _ in range(10):
        n = int(torch.randint(3, 9, (1,), generator=g))
        ids = torch.randint(1, 50, (n,), generator=g)
        seqs.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    make = lambda: gpt2(n_layer=2, n_embd=32, vocab=50)   # noqa: E731
    return make, ga.tasks.causal_lm, seqs[:7], seqs[7:10], GPT2_LAYERS


METHODS = {
    "grad_dot": lambda task, train, queries, layers: ga.methods.grad_dot(task, train, queries, layers=layers),
    "ekfac_influence": lambda task, train, queries, layers: ga.methods.influence(
        task, train, queries, layers=layers, curvature="ekfac"),
    "logra": lambda task, train, queries, layers: ga.methods.logra(task, train, queries, layers=layers, k=16),
    "trak": lambda task, train, queries, layers: ga.methods.trak(task, train, queries, layers=layers, k=24),
}


def compare(got, ref, what, rtol=1e-9):
    """Same coordinates as one process, same values to rtol, and the same bits on every rank."""
    everyone, kernels = [None] * W, [None] * W
    dist.all_gather_object(everyone, np.asarray(got.values))
    dist.all_gather_object(kernels, got.attrs["kernels"])
    assert got.dims == ref.dims, f"{what}: dims {got.dims} vs {ref.dims}"
    for dim in ref.dims:
        assert list(got[dim].values) == list(ref[dim].values), f"{what}: {dim} coordinates differ"
    err = float(np.linalg.norm(got.values - ref.values) / max(np.linalg.norm(ref.values), 1e-300))
    assert err <= rtol, f"{what}: relative error {err:.3g} against one process"
    for r, values in enumerate(everyone):
        assert np.array_equal(values, everyone[0]), f"{what}: rank {r} holds other numbers than rank 0"
        assert kernels[r] == kernels[0], f"{what}: rank {r} counts other kernels {kernels[r]} than rank 0 {kernels[0]}"


def run_case(model_case, how, method):
    make, task_of, train, queries, layers = model_case()
    with ga.options(progress=False, batch_size=3):
        ref = METHODS[method](task_of(make()), train, queries, layers).compute()
        ex = ga.exec.TorchDistributed()
        S = METHODS[method](task_of(wrap(make(), how)), train, queries, layers)
        got = S.compute(executor=ex)
    compare(got, ref, f"{method} {how}")
    if method == "grad_dot":   # the scores pass: each rank's columns out, the whole matrix back
        n_q, n = got.shape
        last = ex.traffic[-1]
        assert last["part_bytes"] >= 8 * n_q * (n // W) and last["result_bytes"] >= 8 * n_q * n, ex.traffic
        assert last["result_bytes"] < 8 * n_q * n + 4096, ex.traffic
    return ex


def case_one_query_fewer_than_ranks():
    """One query over two ranks: rank 1 reads nothing and pads every step of that pass."""
    make, task_of, train, queries, layers = mlp_case()
    one = (queries[0][:1], queries[1][:1])
    with ga.options(progress=False, batch_size=3):
        ref = ga.methods.influence(task_of(make()), train, one, curvature="ekfac").compute()
        got = ga.methods.influence(task_of(wrap(make(), "fsdp2")), train, one, curvature="ekfac").compute(
            executor=ga.exec.TorchDistributed())
    compare(got, ref, "ekfac one query")


def case_topk_fsdp2():
    """S.topk(k) over two ranks (FSDP2, uneven split): each rank's running top-k, positions
    offset by its range, merged in rank order, equals the stable sort of one process's
    scores, values and training ids, on every rank."""
    make, task_of, train, queries, layers = mlp_case()
    with ga.options(progress=False, batch_size=3):
        ref = ga.methods.influence(task_of(make()), train, queries, curvature="ekfac").compute()
        S = ga.methods.influence(task_of(wrap(make(), "fsdp2")), train, queries, curvature="ekfac")
        got = S.topk(4, executor=ga.exec.TorchDistributed())
    order = np.argsort(-ref.values, axis=1, kind="stable")[:, :4]
    want = np.take_along_axis(ref.values, order, axis=1)
    err = float(np.abs(got.values - want).max() / np.abs(want).max())
    assert err <= 1e-9, f"topk values: relative error {err:.3g}"
    assert (got["train"].values == ref["train"].values[order]).all(), "topk: other training ids than one process"
    everyone = [None] * W
    dist.all_gather_object(everyone, (np.asarray(got.values), np.asarray(got["train"].values)))
    for values, ids in everyone:
        assert np.array_equal(values, everyone[0][0]) and np.array_equal(ids, everyone[0][1]), "ranks differ"


def case_padding_steps_counted():
    """The uneven split really pads: rank 1 reads 2 of the 13 training examples' 5 batches;
    the pass runs 3 steps on each rank (counted by a forward pre-hook)."""
    make, task_of, train, queries, _ = mlp_case()
    model = wrap(make(), "fsdp2")
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with ga.options(progress=False, batch_size=3, check_reduction=False):
        ex = ga.exec.TorchDistributed()
        G = ga.grads(task_of(model), train)
        plan = ex.plan(G.expr)       # planning may run a forward to measure shapes: not counted
        calls.clear()
        ex.run(plan)
        text = str(G.explain(executor=ex))
    counts = [None] * W
    dist.all_gather_object(counts, len(calls))
    assert "2 ranks, 6–7 examples each, 3 forward/backward steps per rank" in text, text
    assert counts == [3] * W, f"forward calls per rank {counts}: expected 3 on each (one padded on rank 1)"


def case_plans_differ_refused():
    """Ranks given other data are refused on every rank before any pass runs."""
    make, task_of, train, queries, _ = mlp_case()
    X, y = train
    mine = (X[:13 - R], y[:13 - R])          # rank 1 has one example fewer
    raised = None
    try:
        with ga.options(progress=False):
            S = ga.methods.grad_dot(task_of(wrap(make(), "ddp")), mine, queries)
            S.compute(executor=ga.exec.TorchDistributed())
    except DistributedError as err:
        raised = str(err)
    assert raised is not None and "planned different passes" in raised, raised


def case_nan_on_one_rank_raised_everywhere():
    """A NaN input in rank 1's range (example 10): rank 1 raises NonFiniteGradientError naming
    it, rank 0 a DistributedError naming rank 1; both leave the pass (no collective left
    waiting) and the next computation on the same model still runs."""
    make, task_of, train, queries, _ = mlp_case()
    X, y = train[0].clone(), train[1]
    X[10, 0] = float("nan")
    model = wrap(make(), "fsdp2")
    raised = None
    with ga.options(progress=False, batch_size=3):
        ex = ga.exec.TorchDistributed()
        try:
            ga.methods.grad_dot(task_of(model), (X, y), queries).compute(executor=ex)
        except ga.GradalgError as err:
            raised = err
        after = ga.methods.grad_dot(task_of(model), train, queries).compute(executor=ga.exec.TorchDistributed())
        ref = ga.methods.grad_dot(task_of(make()), train, queries).compute()
    expected = ga.errors.NonFiniteGradientError if R == 1 else DistributedError
    assert isinstance(raised, expected), repr(raised)
    assert "10" in str(raised), str(raised)
    compare(after, ref, "grad_dot after a failed pass")


def case_token_stable_through_forward():
    """A sharded model's token is the same before and after a forward that leaves the root
    unit's weights gathered (a no-grad forward), and hashing it does not stop FSDP2 from
    freeing them (a capture afterwards runs)."""
    make, task_of, train, queries, layers = gpt2_case()
    model = wrap(make(), "fsdp2")
    task = task_of(model)
    before = task.token
    from gradalg.collate import pad_collate
    with torch.no_grad():
        model(**pad_collate(train[:2]))
    during = task.token
    with ga.options(progress=False):
        G = ga.grads(task, train[:4], layers=layers)
        rows = G.to_dense(executor=ga.exec.TorchDistributed())
    assert before == during == task.token, "the token changed through a forward"
    assert set(rows) == set(layers)


def case_gauss_newton_products_ddp():
    """Gauss-Newton influence solved by CG under DDP: the products' passes (one per solver call) read
    the whole training set on every rank, with the same numbers."""
    make, task_of, train, queries, _ = mlp_case()
    with ga.options(progress=False, batch_size=3):
        ref = ga.methods.influence(task_of(make()), train, queries, solver="cg", damping=0.1).compute()
        got = ga.methods.influence(task_of(wrap(make(), "ddp")), train, queries, solver="cg", damping=0.1).compute(
            executor=ga.exec.TorchDistributed())
    compare(got, ref, "gauss-newton cg ddp")


def case_gauss_newton_dense_fsdp2():
    """The default influence (dense Gauss-Newton from sampled labels) under FSDP2."""
    make, task_of, train, queries, _ = mlp_case()
    with ga.options(progress=False, batch_size=3):
        ref = ga.methods.influence(task_of(make()), train, queries).compute()
        got = ga.methods.influence(task_of(wrap(make(), "fsdp2")), train, queries).compute(
            executor=ga.exec.TorchDistributed())
    compare(got, ref, "gauss-newton fsdp2")


def case_ekfac_operator_fsdp2():
    """An operator entry point: the dense EK-FAC matrix of the GPT-2's layers, resolved from
    statistics over both ranks' examples, equals one process's."""
    make, task_of, train, queries, layers = gpt2_case()
    with ga.options(progress=False, batch_size=3):
        ref = ga.ekfac(ga.grads(task_of(make()), train, layers=layers[:2])).to_dense()
        got = ga.ekfac(ga.grads(task_of(wrap(make(), "fsdp2")), train, layers=layers[:2])).to_dense(
            executor=ga.exec.TorchDistributed())
    everyone = [None] * W
    dist.all_gather_object(everyone, got)
    err = float((got - ref).norm() / ref.norm())
    assert err <= 1e-9, f"EK-FAC operator: relative error {err:.3g}"
    assert all(torch.equal(e, everyone[0]) for e in everyone), "ranks hold other operators"


def case_fsdp1_refused():
    """FSDP1 (flat parameters) is refused with FSDP2 and DDP named."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    make, task_of, train, queries, _ = mlp_case()
    model = FSDP1(make(), use_orig_params=True, device_id=torch.device("cpu"))
    raised = None
    try:
        with ga.options(progress=False):
            ga.methods.grad_dot(task_of(model), train, queries).compute(executor=ga.exec.TorchDistributed())
    except DistributedError as err:
        raised = str(err)
    assert raised is not None and "fully_shard" in raised and "DDP" in raised, raised


def case_func_backend_refused():
    """backend='func' on a sharded model is refused with the fix named."""
    make, task_of, train, queries, _ = mlp_case()
    task = task_of(wrap(make(), "fsdp2"))
    raised = None
    try:
        G = ga.grads(task, train, backend="func")
        (G @ G.T).compute(executor=ga.exec.TorchDistributed())
    except DistributedError as err:
        raised = str(err)
    assert raised is not None and "backend='hooks'" in raised, raised


CASES = {f"{method}_{name}_{how}": (lambda c=case, h=how, m=method: run_case(c, h, m))
         for name, case in (("mlp", mlp_case), ("gpt2", gpt2_case))
         for how in ("fsdp2", "ddp") for method in METHODS}
CASES.update({name.removeprefix("case_"): fn for name, fn in list(globals().items()) if name.startswith("case_")})

if __name__ == "__main__":
    run_and_report(CASES, traceback_limit=int(os.environ.get("TB_LIMIT", 8)))
