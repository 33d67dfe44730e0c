"""Online data selection: the corrected step equals a fresh backward over the kept examples.

Every test takes one model, runs the user's ordinary step under ``OnlineSelection``,
reads which examples the policy kept, and compares each parameter's corrected gradient
with a fresh backward pass of a copy of the model over the kept examples only.
"""
from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradalg as ga
from gradalg.integrations import (BatchMean, DropFraction, FixedTarget, KeepAll, OnlineSelection, RandomDrop,
                                  Reweight, Threshold, ValidationTarget)
from gradalg.capture import Factors
from gradalg.integrations.selection import TargetSpec, _score_layer
from models import classification_data, gpt2, lm_loss, mlp, padded_token_data

TOL = 1e-9


def sum_ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum")


def weighted_grads(model, loss_per_example, batch, weights):
    """Gradients of Σ_i w_i ℓ_i on a fresh copy: the reference for a corrected step."""
    fresh = copy.deepcopy(model)
    fresh.zero_grad()
    (loss_per_example(fresh, batch) * weights.to(torch.float64)).sum().backward()
    return {n: p.grad.clone() for n, p in fresh.named_parameters() if p.grad is not None}


def ce_per_example(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def assert_grads_equal(model, reference, tol=TOL):
    for name, p in model.named_parameters():
        ref = reference.get(name, torch.zeros_like(p))
        err = float((p.grad - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err <= tol, f"{name}: relative error {err:.3g}"


def one_step(model, batch, sel, loss=sum_ce):
    model.zero_grad()
    with sel.attach(model):                # no optimizer: step_on="manual"
        loss(model, batch).backward()
        sel.apply()
    return sel.last


def oracle_scores(model, batch, target_vec, layers_params):
    """⟨g_i, t⟩ from torch.func per-example gradients (t flattened in the same order)."""
    grads = ga.per_example_grads(ga.tasks.classification(model), batch, layers_params)
    flat = torch.cat([grads[n].flatten(1) for n in layers_params], 1)
    return flat @ target_vec


# ---------------------------------------------------------------------------- exact correction
@pytest.mark.parametrize("target", ["batch_mean", "fixed", "validation"])
def test_drop_fraction_equals_fresh_backward_over_kept(target):
    model = mlp()
    batch = classification_data(n=12)
    if target == "batch_mean":
        tgt = BatchMean()
    elif target == "fixed":
        g = torch.Generator().manual_seed(5)
        tgt = FixedTarget({"0": torch.randn(16, 9, generator=g, dtype=torch.float64),
                           "2": torch.randn(3, 17, generator=g, dtype=torch.float64)})
    else:
        tgt = ValidationTarget(sum_ce, classification_data(n=5, seed=9))
    sel = OnlineSelection(tgt, DropFraction(0.25))
    rec = one_step(model, batch, sel)
    assert rec.kept == 9 and rec.scores.shape == (12,)
    # the dropped ones are the three lowest scores
    assert set(torch.argsort(rec.scores)[:3].tolist()) == set((rec.weights == 0).nonzero().flatten().tolist())
    kept = rec.weights.bool()
    fresh = copy.deepcopy(model)
    fresh.zero_grad()
    sum_ce(fresh, (batch[0][kept], batch[1][kept])).backward()       # a fresh pass over the kept examples only
    assert_grads_equal(model, {n: p.grad for n, p in fresh.named_parameters()})


def test_scores_are_inner_products_with_the_target():
    model = mlp()
    batch = classification_data(n=8)
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    val = classification_data(n=4, seed=9)
    for similarity in ("dot", "cosine"):
        sel = OnlineSelection(ValidationTarget(sum_ce, val), KeepAll(), similarity=similarity)
        rec = one_step(model, batch, sel)
        t = ga.per_example_grads(ga.tasks.classification(model), val, names)
        tvec = torch.cat([t[n].flatten(1) for n in names], 1).mean(0)
        g = ga.per_example_grads(ga.tasks.classification(model), batch, names)
        gflat = torch.cat([g[n].flatten(1) for n in names], 1)
        expected = gflat @ tvec
        if similarity == "cosine":
            expected = expected / (gflat.norm(dim=1) * tvec.norm())
        torch.testing.assert_close(rec.scores, expected, rtol=1e-9, atol=1e-12)
    # keep-all leaves the gradient of the whole batch untouched
    assert_grads_equal(model, weighted_grads(model, ce_per_example, batch, torch.ones(8)))


def test_threshold_and_batch_mean_scores():
    model = mlp()
    batch = classification_data(n=10)
    sel = OnlineSelection(BatchMean(), Threshold(0.0))
    rec = one_step(model, batch, sel)
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    g = ga.per_example_grads(ga.tasks.classification(model), batch, names)
    gflat = torch.cat([g[n].flatten(1) for n in names], 1)
    torch.testing.assert_close(rec.scores, gflat @ gflat.mean(0), rtol=1e-9, atol=1e-12)
    assert torch.equal(rec.weights, (rec.scores >= 0).double())
    assert 0 < rec.kept < 10
    assert_grads_equal(model, weighted_grads(model, ce_per_example, batch, rec.weights))


def test_reweight_gives_the_weighted_gradient():
    model = mlp()
    batch = classification_data(n=9)
    sel = OnlineSelection(BatchMean(), Reweight.softmax(temperature=5.0))
    rec = one_step(model, batch, sel)
    assert torch.all(rec.weights > 0) and abs(float(rec.weights.sum()) - 9) < 1e-9
    assert_grads_equal(model, weighted_grads(model, ce_per_example, batch, rec.weights))


def test_mean_loss_with_renormalize_equals_mean_over_kept():
    model = mlp()
    batch = classification_data(n=12)
    sel = OnlineSelection(BatchMean(), DropFraction(0.5), renormalize=True)
    rec = one_step(model, batch, sel, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    kept = rec.weights.bool()
    fresh = copy.deepcopy(model)
    fresh.zero_grad()
    F.cross_entropy(fresh(batch[0][kept]), batch[1][kept]).backward()
    assert_grads_equal(model, {n: p.grad for n, p in fresh.named_parameters()})


def test_gradient_accumulation_selects_over_the_whole_step_and_the_optimizer_sees_it():
    model = mlp()
    reference = copy.deepcopy(model)
    batch = classification_data(n=12)
    halves = [tuple(t[:7] for t in batch), tuple(t[7:] for t in batch)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sel = OnlineSelection(BatchMean(), DropFraction(1 / 3))
    with sel.attach(model, optimizer=opt):
        opt.zero_grad()
        for half in halves:                               # two backwards, one optimizer step
            sum_ce(model, half).backward()
        opt.step()                                        # the step pre-hook corrected p.grad
    rec = sel.last
    assert rec.step == 0 and rec.scores.shape == (12,) and rec.kept == 8
    # the same selection done by hand on the whole batch
    grads = weighted_grads(reference, ce_per_example, batch, rec.weights)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p -= 0.1 * grads[name]
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=name)


def lm_logits(m, b):
    ids, mask = b
    positions = torch.arange(ids.shape[1]).expand_as(ids)   # (B, T): wpe gets per-example rows
    return m(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1]


def lm_per_example(m, b):
    ids, mask = b
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    tok = F.cross_entropy(lm_logits(m, b).transpose(1, 2), targets, reduction="none", ignore_index=-100)
    return tok.sum(1) / mask[:, 1:].sum(1).clamp_min(1)


@pytest.mark.parametrize("tied", [False, True])
def test_gpt2_every_parameter_including_layernorms(tied):
    model = gpt2(tied=tied)
    model.train()
    batch = padded_token_data(n=6)
    # every Conv1D/Embedding; the position embedding must be named (the default leaves it
    # out, as HF models usually share positions across the batch; lm_logits passes them per row)
    layers = ["transformer.wte", "transformer.wpe", "transformer.h.*", "lm_head"]
    sel = OnlineSelection(BatchMean(), DropFraction(0.5), layers=layers)
    rec = one_step(model, batch, sel, loss=lambda m, b: lm_per_example(m, b).sum())
    assert rec.kept == 3
    assert set(sel._affine.modules) >= {"transformer.ln_f", "transformer.h.0.ln_1"}
    assert_grads_equal(model, weighted_grads(model, lm_per_example, batch, rec.weights), tol=1e-8)


def test_gpt2_shared_position_embedding_is_refused_clearly():
    model = gpt2()
    with pytest.raises(ga.UnsupportedLayerError, match="position_ids of shape"):
        with ga.capture(model, layers=["transformer.wpe", "transformer.h.0.mlp.c_fc"]):
            lm_loss(model, padded_token_data(n=3)).backward()


def test_score_routes_agree():
    g = torch.Generator().manual_seed(0)
    parts = [Factors(torch.randn(3, 4, 5, generator=g, dtype=torch.float64),
                                torch.randn(3, 4, 6, generator=g, dtype=torch.float64)) for _ in range(2)]
    tf = Factors(torch.randn(2, 3, 5, generator=g, dtype=torch.float64),
                            torch.randn(2, 3, 6, generator=g, dtype=torch.float64))
    c = torch.tensor([0.3, -0.7], dtype=torch.float64)
    ghost, route_g, tn_g = _score_layer(parts, TargetSpec(factors=[tf], coeffs=[c]), True, route="ghost")
    V = torch.einsum("n,nto,nti->oi", c, tf.D, tf.A)
    dense, route_d, tn_d = _score_layer(parts, TargetSpec(dense=V), True)
    via_dense, route_v, _ = _score_layer(parts, TargetSpec(factors=[tf], coeffs=[c]), True, route="dense")
    assert (route_g, route_d, route_v) == ("ghost", "dense", "dense")
    torch.testing.assert_close(ghost, dense)
    torch.testing.assert_close(via_dense, dense)
    assert _score_layer(parts, TargetSpec(factors=[tf], coeffs=[c]), False)[1] == "dense"  # 900 < 1584 MACs
    assert abs(tn_g - tn_d) < 1e-9 * tn_d


# ---------------------------------------------------------------------------- refusals and baselines
class WithScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3).double()
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x):
        return self.fc(x) * self.scale


def test_uncovered_parameters_are_refused_or_ignored():
    model = WithScale()
    with pytest.raises(ga.UnsupportedLayerError, match="scale"):
        OnlineSelection(BatchMean(), DropFraction(0.5)).attach(model)
    batch = classification_data(n=6)
    sel = OnlineSelection(BatchMean(), DropFraction(0.5), uncovered="ignore")
    rec = one_step(model, batch, sel)
    ref = weighted_grads(model, ce_per_example, batch, rec.weights)
    torch.testing.assert_close(model.fc.weight.grad, ref["fc.weight"])
    with pytest.raises(ValueError, match="manual"):
        OnlineSelection().attach(mlp(), step_on="backward")


def test_random_drop_is_a_seeded_baseline():
    s = torch.arange(10.0)
    a, b = RandomDrop(0.3, seed=1).weights(s, 4), RandomDrop(0.3, seed=1).weights(s, 4)
    assert torch.equal(a, b) and int(a.sum()) == 7
    assert not torch.equal(a, RandomDrop(0.3, seed=1).weights(s, 5))


def test_training_capture_steps_and_callbacks():
    """The training-time callback API: a step per optimizer step, before it, any representation."""
    model = mlp()
    data = classification_data(n=12)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    tc = ga.integrations.training_capture(model, layers=["0", "2"], optimizer=opt, keep=True)

    @tc.on_step
    def look(step):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        P = ga.proj.kron(k=4, seed=0)
        seen.append((step.index, step.n, step.micro_batches, step.sq_norms(), P(step.grads).to_dense(), before))

    with tc:
        for i in range(0, 12, 3):
            sum_ce(model, tuple(t[i:i + 3] for t in data)).backward()
            if i % 6 == 3:
                snap = {n: p.detach().clone() for n, p in model.named_parameters()}
                opt.step()
                opt.zero_grad()
                assert all(torch.equal(seen[-1][5][n], snap[n]) for n in snap)   # called before opt.step
    assert [(s[0], s[1], s[2]) for s in seen] == [(0, 6, 2), (1, 6, 2)]
    assert tc.grads.n == 12 and tc.grads.ids == tuple(range(12))
    dense = tc.grads.to_dense()
    norms = torch.cat([s[3] for s in seen])
    expected = sum(v.flatten(1).pow(2).sum(1) for v in dense.values())
    torch.testing.assert_close(norms, expected)
