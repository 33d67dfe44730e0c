"""One forward for several objectives.

Sources of one pass that differ only in their objective (the training loss and labels
drawn from the model; the loss and TRAK's output function) share each batch's forward
(:class:`gradalg.exec.capture_pass.SharedForward`) and run one backward each. Checked
here: the shared capture equals one forward per source to the last bits on GPT-2 and an
MLP, the data is forwarded once, a loss that calls the model differently falls back to
separate forwards with the same result, and the model's ``forward`` is restored.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg.exec.capture_pass import PassCapture, SharedForward, _same_inputs
from gradalg.testing import assert_close

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402


class Forwards:
    """Counts real forwards: a hook on a submodule fires only when the model really runs
    (the planner's shape probe runs on the meta device: no data, not counted)."""

    def __init__(self, module):
        self.module, self.examples = module, 0

    def __enter__(self):
        def count(m, args, out):
            if args[0].device.type != "meta":
                self.examples += args[0].shape[0]
        self.handle = self.module.register_forward_hook(count)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def gpt2_sampled_task(model):
    def sampled_loss(model, batch, rng):
        ids, mask = batch
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        targets = rng.sample(torch.softmax(logits.detach(), -1)).masked_fill(mask[:, 1:] == 0, -100)
        tok = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)
        return (tok.sum(1) / mask[:, 1:].sum(1).clamp_min(1)).sum()
    return ga.Task(model, models.lm_loss, sampled_loss=sampled_loss, token_mask=lambda b: b[1].bool(),
                   name="gpt2-sampled")


def both(S):
    with ga.options(check_reduction=False, batch_size=4):
        shared = torch.as_tensor(S.compute().values)
    with ga.options(check_reduction=False, batch_size=4, share_forward=False):
        separate = torch.as_tensor(S.compute().values)
    return shared, separate


def test_loss_and_sampled_labels_share_the_forward_gpt2():
    model = models.gpt2()
    task = gpt2_sampled_task(model)
    train = models.padded_token_data(n=6, seed=3)
    query = models.padded_token_data(n=2, seed=5)
    G, Gs, Q = ga.grads(task, train), ga.grads(task, train, objective="sampled"), ga.grads(task, query)
    S = Q @ G.T + 0.5 * (Q @ Gs.T)
    with Forwards(model.transformer.h[0]) as seen:
        shared, separate = both(S)
    # shared: query 2 + train 6; separate: query 2 + train 2 × 6
    assert seen.examples == (2 + 6) + (2 + 12)
    assert_close(shared, separate, what="shared vs separate forwards", rtol=0, atol=1e-12)
    # and each part is what it claims: the sampled part differs from the loss part
    with ga.options(check_reduction=False):
        loss_part = torch.as_tensor((Q @ G.T).compute().values)
    assert not torch.allclose(shared, loss_part)
    assert "forward" not in vars(model)


def test_an_objective_calling_the_model_twice_falls_back():
    model = models.mlp()

    def output(model, batch):   # calls the model twice, once with other inputs
        x, y = batch
        return model(x).gather(1, y[:, None]).sum() + 0.1 * model(2 * x).sum()

    task = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum"), output=output)
    x, y = models.classification_data(10, seed=1)
    xq, yq = models.classification_data(3, seed=2)
    train, query = TensorDataset(x, y), TensorDataset(xq, yq)
    G, Go, Q = ga.grads(task, train), ga.grads(task, train, objective="output"), ga.grads(task, query)
    shared, separate = both(Q @ G.T + Q @ Go.T)
    assert_close(shared, separate, what="fallback vs separate", rtol=0, atol=1e-12)
    names = [n for n, _ in model.named_parameters()]
    ref = ga.per_example_grads(task, (x, y), names)
    ref_o = ga.per_example_grads(task, (x, y), names, loss_fn=output)
    ref_q = ga.per_example_grads(task, (xq, yq), names)
    flat = lambda g: torch.cat([v.flatten(1) for v in g.values()], 1)  # noqa: E731
    want = flat(ref_q) @ flat(ref).T + flat(ref_q) @ flat(ref_o).T
    assert_close(shared, want, what="fallback vs torch.func", rtol=1e-9, atol=1e-10)


def test_pass_capture_stops_sharing_after_a_miss():
    model = models.mlp()
    calls = []

    def output(model, batch):
        calls.append(1)
        return model(batch[0] + 1).sum()

    task = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum"), output=output)
    x, y = models.classification_data(8, seed=1)
    sources = [ga.grads(task, (x, y)).expr, ga.grads(task, (x, y), objective="output").expr]
    capture = PassCapture(sources, ga.get_options(), set())
    assert [len(g) for g in capture.groups] == [2]
    with ga.options(check_reduction=False):
        out = capture.capture((x, y), list(range(8)))
    assert set(out) == {s.token for s in sources}
    assert [len(g) for g in capture.groups] == [1, 1] and capture.shared_batches == 0
    assert "forward" not in vars(model)


def test_shared_forward_restores_an_instance_forward_and_counts():
    model = torch.nn.Linear(3, 2)
    own = model.forward
    model.forward = lambda x: own(x) * 2          # an instance-level override, kept
    x = torch.randn(4, 3)
    with SharedForward(model) as shared:
        a = model(x)
        b = model(x.clone())                        # equal values: the first output
        c = model(x + 1)                            # other inputs: a real forward
    assert a is b and c is not a and (shared.calls, shared.hits) == (3, 1)
    assert_close(c, own(x + 1) * 2, what="miss runs the real forward", rtol=0, atol=0)
    assert model.forward.__name__ == "<lambda>"
    assert _same_inputs(({"ids": x, "k": 2}, [1, "a"]), ({"ids": x.clone(), "k": 2}, [1, "a"]))
    assert not _same_inputs({"ids": x}, {"ids": x[:2]})
    assert not _same_inputs((x,), ([x],))


def test_planner_costs_one_forward_for_shared_sources():
    from gradalg.plan.planner import plan
    model = models.mlp()
    task = ga.tasks.classification(model)
    x, y = models.classification_data(10, seed=1)
    xq, yq = models.classification_data(3, seed=2)
    G, Go, Q = ga.grads(task, (x, y)), ga.grads(task, (x, y), objective="output"), ga.grads(task, (xq, yq))
    S = Q @ G.T + Q @ Go.T
    shared = plan(S.expr)
    with ga.options(share_forward=False):
        separate = plan(S.expr)
    last = lambda p: p.passes[-1].cost.flops  # noqa: E731  (the training pass, two sources)
    assert last(shared) < last(separate)


def test_gauss_newton_terms_share_the_forward_with_the_loss():
    """objective="expected" (one backward per class term) and the loss from one forward:
    an influence function with the exact Gauss-Newton matrix reads each batch once."""
    model = models.mlp()
    task = ga.tasks.classification(model)
    x, y = models.classification_data(12, seed=1)
    xq, yq = models.classification_data(3, seed=2)
    train, query = TensorDataset(x, y), TensorDataset(xq, yq)
    P = ga.proj.kron(4, seed=0)
    G, Q = P(ga.grads(task, train)), P(ga.grads(task, query))
    S = Q @ ga.fisher(P(ga.grads(task, train, objective="expected"))).damp(0.1).inv() @ G.T
    with Forwards(model[0]) as seen:
        shared, separate = both(S)
    assert seen.examples == (3 + 12) + (3 + 2 * 12)
    assert_close(shared, separate, what="GN terms shared vs separate", rtol=0, atol=1e-12)


def test_row_weights_replay_the_captured_forward():
    """TRAK's weights 1 − p_z read the outputs of the forward that captured the batch
    instead of running the model again; with share_forward=False they run it."""
    model = models.mlp()
    task = ga.tasks.classification(model)
    x, y = models.classification_data(12, seed=1)
    xq, yq = models.classification_data(3, seed=2)
    S = ga.methods.trak(task, TensorDataset(x, y), TensorDataset(xq, yq), k=8, damping=1e-3)
    with Forwards(model[0]) as seen:
        shared, separate = both(S)
    # shared: 3 + 12 captured, weights replayed; separate: 3 + 12 captured, 12 again for 1 − p
    assert seen.examples == (3 + 12) + (3 + 12 + 12)
    assert_close(shared, separate, what="replayed vs recomputed weights", rtol=0, atol=1e-12)
