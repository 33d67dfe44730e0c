"""Planning reads each model and each node's layer kinds once: a 70B Llama's refusal took
20 s when every block asked every other block's kind (1.25 M calls) and every task token
walked the module tree again for each loss closure (120 walks per explain())."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import gradalg as ga
from gradalg import fingerprint
from gradalg.capture import layers as capture_layers
from gradalg.plan import facts as plan_facts


def _lm(n_layer=3):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=16, n_head=2, vocab_size=64, n_positions=16)).eval()
    data = [{"input_ids": torch.randint(0, 64, (8,))} for _ in range(4)]
    return ga.tasks.causal_lm(model), data


def _count(monkeypatch, module, name):
    calls = [0]
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    return calls


def test_one_plan_walks_each_model_once(monkeypatch):
    task, data = _lm()
    S = ga.methods.logra(task, data, data[:2])
    walks = _count(monkeypatch, fingerprint, "_model_digest")
    S.explain()
    assert walks[0] == 1          # was 15 per task token (loss closures hold the model) × tokens per plan


def test_a_plans_layer_kinds_are_read_per_kind_not_per_block_pair(monkeypatch):
    task, data = _lm(n_layer=6)
    S = ga.methods.logra(task, data, data[:2])
    asked = _count(monkeypatch, plan_facts, "measured_kind")
    S.explain()
    n_blocks = len(ga.grads(task, data).space.blocks)
    assert n_blocks >= 24
    assert 0 < asked[0] <= 8           # a few distinct kinds per node, not blocks² (was > n_blocks²)


def test_the_token_follows_the_weights_between_plans():
    """The digests are held within one plan or token only: a weight changed between two
    tokens gives a new token (a result computed before is never reused after)."""
    task, _ = _lm()
    before = task.token
    with torch.no_grad():
        next(task.model.parameters()).add_(1.0)
    assert task.token != before
    with fingerprint.digests_held():
        held = task.token
        with torch.no_grad():
            next(task.model.parameters()).add_(1.0)
        assert task.token == held            # inside one block: the walk is reused (no model changes there)
    assert task.token != held                 # outside it: walked again
