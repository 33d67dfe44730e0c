"""Scores over training time (``ga.trajectory``) against a dense reference over saved checkpoints.

The reference trains a copy of the same model on the same schedule, saves θ_t before every
optimizer step (and Adam's moments after it), and computes every τ_{q,i,t} with a loop of
``torch.autograd.grad``: one backward per query and per row, at θ_t, flattened over the
parameters of the attributed layers. The schedule has gradient accumulation (a step of two
micro-batches), an example seen at two steps, an example seen twice in one step, and
examples absent from steps (which must score exactly 0 there).
"""
from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradalg as ga
from references import one_thread  # noqa: F401 - one intra-op thread for this module

LAYERS = ["0", "2"]
TOL = 1e-9
# steps of micro-batches of example ids: accumulation at step 1, example 0 at steps 0 and 1,
# example 1 twice in step 3, examples 10..11 never seen
SCHEDULE = [[[0, 1, 2]], [[3, 4], [5, 0]], [[6, 7, 8, 9]], [[1, 1, 2]]]


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(12, 4, generator=g, dtype=torch.float64)
    Y = torch.randint(0, 3, (12,), generator=g)
    Qx = torch.randn(3, 4, generator=g, dtype=torch.float64)
    Qy = torch.randint(0, 3, (3,), generator=g)
    return X, Y, Qx, Qy


def sum_ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1], reduction="sum")


def make_opt(model, kind, lr=0.1):
    if kind in ("sgd", "sgd-decay"):
        return torch.optim.SGD(model.parameters(), lr=lr)
    if kind == "sgd-groups":     # per-layer learning rates: M_t is a diagonal, not a number
        return torch.optim.SGD([{"params": model[0].parameters(), "lr": lr},
                                {"params": model[2].parameters(), "lr": lr / 4}], lr=lr)
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.05, betas=(0.8, 0.95), eps=1e-3)
    if kind == "adam-ams-l2":    # amsgrad's running maximum; L2 decay inside Adam's gradient
        return torch.optim.Adam(model.parameters(), lr=0.05, eps=1e-3, amsgrad=True, weight_decay=0.05)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, eps=1e-3)
    raise ValueError(kind)


def train_with_trajectory(kind, reduction="sum", precondition=None, schedule=SCHEDULE, **kw):
    X, Y, Qx, Qy = data()
    model = net()
    opt = make_opt(model, kind)
    traj = ga.trajectory(model, ga.Task(model, sum_ce), (Qx, Qy), layers=LAYERS, optimizer=opt,
                         precondition=precondition, **kw)
    sched = decay(opt, kind)
    with traj:
        for step in schedule:
            for mb in step:
                traj.ids_next(mb)
                F.cross_entropy(model(X[mb]), Y[mb], reduction=reduction).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    return traj, model


def decay(opt, kind):
    """A learning-rate schedule: η_t = η / (1 + t) for "-decay" kinds, constant otherwise."""
    return torch.optim.lr_scheduler.LambdaLR(opt, (lambda t: 1 / (1 + t)) if kind.endswith("decay") else (lambda t: 1.0))


def reference(kind, reduction="sum", precondition=None, schedule=SCHEDULE):
    """Dense τ (query, example id, step) and the trained model, from saved checkpoints."""
    X, Y, Qx, Qy = data()
    model = net()
    opt = make_opt(model, kind)
    checkpoints, denoms, lrs = [], [], []
    sched = decay(opt, kind)
    for step in schedule:
        checkpoints.append(copy.deepcopy(model))
        lrs.append({id(p): g["lr"] for g in opt.param_groups for p in g["params"]})
        for mb in step:
            F.cross_entropy(model(X[mb]), Y[mb], reduction=reduction).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if precondition == "adam":   # Adam's own state after the step: v_{t+1} and t+1
            d = {}
            for g in opt.param_groups:
                for p in g["params"]:
                    st = opt.state[p]
                    bc2 = 1 - g["betas"][1] ** float(st["step"])
                    v = st["max_exp_avg_sq"] if g["amsgrad"] else st["exp_avg_sq"]
                    d[id(p)] = (v.double() / bc2).sqrt() + g["eps"]
            denoms.append(d)
    tau = np.zeros((len(Qx), len(X), len(schedule)))
    for t, (theta, step) in enumerate(zip(checkpoints, schedule)):
        params = [p for name in LAYERS for p in dict(theta.named_modules())[name].parameters()]
        orig = [p for name in LAYERS for p in dict(model.named_modules())[name].parameters()]
        weights = [lrs[t][id(o)] / (denoms[t][id(o)] if precondition == "adam" else 1.0) for o in orig]
        for q in range(len(Qx)):
            gq = torch.autograd.grad(sum_ce(theta, (Qx[q:q + 1], Qy[q:q + 1])), params)
            for mb in step:
                for i in mb:
                    li = F.cross_entropy(theta(X[i:i + 1]), Y[i:i + 1], reduction="sum")
                    if reduction == "mean":
                        li = li / len(mb)
                    gi = torch.autograd.grad(li, params)
                    tau[q, i, t] += float(sum((a * w * b).sum() for a, w, b in zip(gq, weights, gi)))
    return tau, model


def dense_of(S) -> np.ndarray:
    """The trajectory's (query, train, step) array laid out over all 12 example ids."""
    A = S.array
    out = np.zeros((A.sizes["query"], 12, A.sizes["step"]))
    for c, i in enumerate(A.train.values):
        out[:, int(i)] = A.values[:, c]
    return out


@pytest.mark.parametrize("kind,reduction,precondition", [
    ("sgd", "sum", None), ("sgd", "mean", None), ("sgd-groups", "sum", None), ("sgd-decay", "sum", None),
    ("adam", "sum", "adam"), ("adamw", "mean", "adam"), ("adam-ams-l2", "sum", "adam"),
])
def test_matches_dense_reference_over_checkpoints(kind, reduction, precondition):
    traj, model = train_with_trajectory(kind, reduction, precondition)
    ref, ref_model = reference(kind, reduction, precondition)
    # capture and scoring do not disturb training
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    S = traj.scores
    assert S.shape == (3, 10, 4)                       # ids 10, 11 never seen
    got = dense_of(S)
    np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL)
    # absent examples score exactly 0 at a step; an example seen twice accumulates
    assert got[:, 3, 0].tolist() == [0.0, 0.0, 0.0] and got[:, 0, 2].tolist() == [0.0, 0.0, 0.0]
    assert np.abs(got[:, 0, :2]).min() > 0 and np.abs(got[:, 1, 3]).min() > 0
    np.testing.assert_allclose(S.total().values, ref.sum(-1)[:, :10], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(S.cumulative().values[..., -1], S.total().values, rtol=TOL, atol=TOL)
    rec = S.records()                                  # long format: one row per (query, example, step) seen
    assert len(rec) == 3 * (3 + 4 + 4 + 2)             # distinct examples per step (1 twice in step 3: summed)
    for r in rec.itertuples():
        assert r.score == pytest.approx(ref[r.query, r.train, r.step], rel=TOL, abs=TOL)
    assert list(S.array.step.values) == [0, 1, 2, 3]
    if kind == "sgd-decay":                            # η_t read at each step, before the scheduler moves it
        np.testing.assert_allclose(S.array.lr.values, [0.1 / (1 + t) for t in range(4)])


def test_step_sum_is_first_order_loss_change():
    """Σ_i τ_{q,i,t} = η ⟨g_q(θ_t), ∇L_batch(θ_t)⟩ whatever the loss's reduction (rows are contributions)."""
    X, Y, Qx, Qy = data()
    traj, _ = train_with_trajectory("sgd", "mean")
    model, seen = net(), []
    opt = make_opt(model, "sgd")
    for step in SCHEDULE:
        gq = torch.autograd.grad(sum_ce(model, (Qx, Qy)), list(model.parameters()))
        for mb in step:
            F.cross_entropy(model(X[mb]), Y[mb]).backward()
        seen.append(0.1 * float(sum((a * p.grad).sum() for a, p in zip(gq, model.parameters()))))
        opt.step()
        opt.zero_grad()
    per_step = traj.scores.array.sum(("query", "train")).values
    np.testing.assert_allclose(per_step, seen, rtol=TOL)


def test_full_batch_sum_equals_tracin_over_checkpoints():
    X, Y, Qx, Qy = data()
    schedule = [[list(range(12))]] * 3
    traj, _ = train_with_trajectory("sgd", "sum", schedule=schedule)
    model = net()
    opt = make_opt(model, "sgd")
    tasks = []
    for _ in schedule:
        tasks.append(ga.Task(copy.deepcopy(model), sum_ce))
        sum_ce(model, (X, Y)).backward()
        opt.step()
        opt.zero_grad()
    T = ga.methods.tracin(tasks, [0.1] * 3, (X, Y), (Qx, Qy), layers=LAYERS).compute()
    tot = traj.scores.total()
    np.testing.assert_allclose(tot.values, T.sel(train=tot.train.values).values, rtol=1e-9, atol=1e-12)


def projected_reference(kind, precondition, P):
    """The same scores as ga's own lazy expression over the saved checkpoints:
    ``P(Q_t [@ M_t]) @ P(G_t).T`` with G_t captured by ``ga.grads`` (not by training hooks)."""
    X, Y, Qx, Qy = data()
    model = net()
    opt = make_opt(model, kind)
    tau = np.zeros((3, 12, len(SCHEDULE)))
    for t, step in enumerate(SCHEDULE):
        theta = copy.deepcopy(model)
        rows = [i for mb in step for i in mb]
        for mb in step:
            sum_ce(model, (X[mb], Y[mb])).backward()
        task = ga.Task(theta, sum_ce)
        Q, G = ga.grads(task, (Qx, Qy), LAYERS), ga.grads(task, (X[rows], Y[rows]), LAYERS)
        if precondition == "adam":
            opt.step()
            d = []
            for p in opt.param_groups[0]["params"]:
                st, g = opt.state[p], opt.param_groups[0]
                bc2 = 1 - g["betas"][1] ** float(st["step"])
                d.append(g["lr"] / ((st["exp_avg_sq"].double() / bc2).sqrt() + g["eps"]))
            w, b, w2, b2 = d       # blocks [W | b] of layers "0" and "2", row-major
            diag = torch.cat([torch.cat([w, b[:, None]], 1).flatten(), torch.cat([w2, b2[:, None]], 1).flatten()])
            S = (P(Q @ ga.diagonal(diag, like=Q)) @ P(G).T).compute().values
        else:
            S = 0.1 * (P(Q) @ P(G).T).compute().values
            opt.step()
        opt.zero_grad()
        for c, i in enumerate(rows):
            tau[:, i, t] += S[:, c]
    return tau


@pytest.mark.parametrize("kind,precondition,projector", [
    ("sgd", None, ga.proj.kron(k=16, seed=3)), ("adam", "adam", ga.proj.gaussian(k=24, seed=0)),
])
def test_projected_scores_are_the_projected_inner_products(kind, precondition, projector):
    traj, _ = train_with_trajectory(kind, "sum", precondition, projector=projector)
    got = dense_of(traj.scores)
    np.testing.assert_allclose(got, projected_reference(kind, precondition, projector), rtol=1e-8, atol=1e-10)
    exact, _ = reference(kind, "sum", precondition)
    assert np.corrcoef(got.ravel(), exact.ravel())[0, 1] > 0.6     # a JL estimate (k ≈ 32 of 51 coordinates)


def test_topk_keeps_largest_and_exact_totals():
    full, _ = train_with_trajectory("sgd", "sum")
    top, _ = train_with_trajectory("sgd", "sum", topk=2)
    A, B = full.scores.array.values, top.scores.array.values
    np.testing.assert_allclose(top.scores.total().values, full.scores.total().values, rtol=TOL)
    kept = ~np.isnan(B)
    np.testing.assert_allclose(B[kept], A[kept], rtol=TOL, atol=TOL)
    # each query keeps at most 2 rows per step; every dropped |τ| ≤ the smallest kept one
    st = top.scores.steps[2]
    assert st.values.shape == (3, 2)
    for q in range(3):
        col = full.scores.at(2).values[q]
        assert np.abs(col).max() == pytest.approx(np.abs(st.values[q]).max())
    only, _ = train_with_trajectory("sgd", "sum", topk=0)
    np.testing.assert_allclose(only.scores.total().values, full.scores.total().values, rtol=TOL)
    with pytest.raises(ga.GradalgError, match="totals only"):
        only.scores.array


def test_attach_to_an_existing_capture_and_plain_on_step():
    X, Y, Qx, Qy = data()
    model = net()
    opt = make_opt(model, "sgd")
    tc = ga.integrations.training_capture(model, LAYERS, optimizer=opt)
    traj = ga.trajectory(model, ga.Task(model, sum_ce), (Qx, Qy), layers=["2"], optimizer=opt)
    tc.on_step(traj.on_step)                     # the step knows its capture: no attach needed
    with tc:
        for step in SCHEDULE:
            for mb in step:
                tc.ids_next(mb)
                sum_ce(model, (X[mb], Y[mb])).backward()
            opt.step()
            opt.zero_grad()
    assert traj.scores.shape == (3, 10, 4)


def test_bad_input_is_refused():
    X, Y, Qx, Qy = data()
    model = net()
    task = ga.Task(model, sum_ce)
    with pytest.raises(ga.DataError, match="queries do not fit the model"):
        ga.trajectory(model, task, (torch.randn(3, 5, dtype=torch.float64), Qy), layers=LAYERS, lr=0.1)
    with pytest.raises(ga.DataError):
        ga.trajectory(model, task, (Qx, Qy[:2]), layers=LAYERS, lr=0.1)
    adam = ga.trajectory(model, task, (Qx, Qy), layers=LAYERS, precondition="adam")   # the HF callback may bring it
    with pytest.raises(ga.OptionError, match=r"optimizer=opt\) \(a torch.optim.Adam"):
        with adam:                                    # refused before the first forward
            raise AssertionError("not reached")
    with pytest.raises(ga.OptionError, match="Adam or AdamW"):
        ga.trajectory(model, task, (Qx, Qy), layers=LAYERS, precondition="adam",
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ga.OptionError, match="precondition"):
        ga.trajectory(model, task, (Qx, Qy), layers=LAYERS, precondition="sgd")
    with pytest.raises(ga.OptionError, match="topk"):
        ga.trajectory(model, task, (Qx, Qy), layers=LAYERS, lr=0.1, topk=-1)
    with pytest.raises(ga.ModelMismatchError):
        ga.trajectory(model, ga.Task(net(), sum_ce), (Qx, Qy), layers=LAYERS, lr=0.1)
    traj = ga.trajectory(model, task, (Qx, Qy), layers=LAYERS)   # no optimizer, no lr
    with pytest.raises(ga.OptionError, match="lr="):
        with traj:
            raise AssertionError("not reached")
    tc = ga.integrations.training_capture(model, LAYERS)
    tc.on_step(traj.on_step)                           # a plain callback: refused at the first step
    with pytest.raises(ga.OptionError, match="lr="):
        with tc:
            sum_ce(model, (X[:2], Y[:2])).backward()
    assert not tc._active


def test_plot_trajectory_draws_the_top_examples():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traj, _ = train_with_trajectory("sgd", "sum")
    S = traj.scores
    fig = ga.viz.plot_trajectory(S, query=1, top=3)
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert len(lines) == 3
    best = S.top(1, 3)
    assert [line.get_label() for line in lines] == [f"train {i}" for i in best.index]
    cum = S.cumulative().sel(query=1)
    for line, i in zip(lines, best.index):
        np.testing.assert_allclose(line.get_xdata(), S.array.step.values)
        np.testing.assert_allclose(line.get_ydata(), cum.sel(train=i).values)
    plt.close(fig)
    fig, ax = plt.subplots()                            # on a given axis, with the two lowest totals dashed
    assert ga.viz.plot_trajectory(S.array, query=0, top=1, bottom=2, ax=ax) is fig
    labels = [line.get_label() for line in ax.get_lines()]
    worst = S.top(0, 2, largest=False)
    assert labels == [f"train {S.top(0, 1).index[0]}"] + [f"train {i}" for i in worst.index]
    assert [line.get_linestyle() for line in ax.get_lines()] == ["-", "--", "--"]
    plt.close(fig)
    with pytest.raises(ga.OptionError, match="query"):
        ga.viz.plot_trajectory(S, query=99)
    with pytest.raises(ga.OptionError, match="dims"):
        ga.viz.plot_trajectory(S.total(), query=0)


# ---------------------------------------------------------------------------- HF Trainer
def lm_sum(model, batch):
    """Σ over tokens of the cross-entropy of each sequence, summed over sequences (the rows of
    ``GradientCallback(scale="sum")``: ∇ Σ_t ce_it)."""
    ids, mask = batch
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_hf_trainer_matches_dense_reference(optim, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from models import gpt2, padded_token_data

    layers = ["transformer.h.0.attn.c_attn", "lm_head"]
    ids, mask = padded_token_data(n=8, seed=3)
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i].masked_fill(mask[i] == 0, -100)}
            for i in range(8)]
    qids, qmask = padded_token_data(n=2, seed=9)
    model = gpt2()
    traj = ga.trajectory(model, ga.Task(model, lm_sum), (qids, qmask), layers=layers,
                         precondition="adam" if optim != "sgd" else None)
    cb = traj.hf_callback(scale="sum")
    saved, after = [], []

    @cb.on_step
    def keep(step):                       # θ_t and the step's example ids, for the reference
        saved.append(({k: v.clone() for k, v in model.state_dict().items()}, step.ids))

    class AfterStep(TrainerCallback):     # Adam's own state after each step: v_{t+1}, t+1
        def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
            opt = getattr(optimizer, "optimizer", optimizer)
            g = opt.param_groups[0]
            after.append({n: ((opt.state[p]["exp_avg_sq"].double()
                               / (1 - g["betas"][1] ** float(opt.state[p]["step"]))).sqrt() + g["eps"])
                          for n, p in model.named_parameters() if p in opt.state and "exp_avg_sq" in opt.state[p]})

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=2, learning_rate=0.05, use_cpu=True, report_to=[], logging_strategy="no",
                             save_strategy="no", seed=0, lr_scheduler_type="constant", optim=optim,
                             weight_decay=0.0, max_grad_norm=0.0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[cb, AfterStep()]).train()
    S = traj.scores
    assert S.shape[2] == 2 and len(saved) == 2
    A = S.array
    names = [f"{layer}.{p}" for layer in layers for p, _ in dict(model.named_modules())[layer].named_parameters()]
    for t, (state, step_ids) in enumerate(saved):
        theta = gpt2()                    # a fresh module (a deep copy would carry the callback's hooks)
        theta.load_state_dict(state)
        params = [theta.get_parameter(n) for n in names]
        w = [0.05 / (after[t][n] if optim != "sgd" else 1.0) for n in names]
        for q in range(2):
            gq = torch.autograd.grad(lm_sum(theta, (qids[q:q + 1], qmask[q:q + 1])), params)
            ref = {}
            for i in step_ids:
                gi = torch.autograd.grad(lm_sum(theta, (ids[i:i + 1], mask[i:i + 1])), params)
                ref[i] = ref.get(i, 0.0) + float(sum((a * c * b).sum() for a, c, b in zip(gq, w, gi)))
            for i in range(8):
                got = float(A.sel(query=q, step=t, train=i)) if i in A.train.values else 0.0
                # Trainer's loss casts the logits to float32 (ForCausalLMLoss): float32 agreement
                assert got == pytest.approx(ref.get(i, 0.0), rel=1e-5, abs=1e-9), (t, q, i)
