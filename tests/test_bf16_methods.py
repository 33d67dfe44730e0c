"""Every projected and curvature method on a bfloat16 model (a tied, Qwen2-shaped causal LM
at its default layers): the scores come back in float32, and gradalg adds no error of its
own beyond the model's rounding.

Three runs per method, on the same (bf16-rounded) weights:

* ``bf16``: the bf16 model as a user runs it (factors captured in bfloat16, kernels in
  float32, statistics in float64: tests/test_low_precision.py);
* ``bf16 / float64 factors``: the same bf16 model, its factors cast to float64 right after
  capture (every kernel, projection and curvature then in float64): what the bf16 model's
  scores are when only the model computes in bfloat16;
* ``float64``: the same weights as a float64 model.

gradalg's share of the error is rel(bf16, bf16 / float64 factors) (relative Frobenius);
the model's own is rel(bf16, float64). Measured (2 layers × 64, vocabulary 97, 8 training
sequences and 3 queries of 16 tokens, one Adam step for LESS):

===================  =============  ================
method               gradalg share  model's rounding
===================  =============  ================
grad_dot             1.2e-7         5.4e-3
logra                7.0e-6         2.7e-1
grass                2.4e-7         6.8e-2
trak                 5.6e-5         6.9e-3
less                 3.2e-7         1.8e-2
influence (EK-FAC)   5.9e-6         2.2e-1
influence (K-FAC)    3.6e-6         8.9e-2
influence (DataInf)  1.7e-7         5.5e-3
===================  =============  ================

The model's rounding (each activation and output gradient rounded to 8 bits, u = 2⁻⁸) is
amplified by the inverse curvature: Grad-Dot and DataInf see 1.4 u, LoGra and EK-FAC
(a damped inverse of factors from 128 tokens of a random-init model) 55–70 u. That error
is the bf16 model's, not the accumulation's: scores of a bf16 model preconditioned by a
curvature are only as good as its gradients, and a user who needs them tighter runs the
model in float32. The tolerance on gradalg's share is 1e-4 (float32 sums of the same
factors; TRAK's TensorSketch and its kernel regression reach 5.6e-5, the others ≤ 7e-6).
"""
from __future__ import annotations

import copy

import pytest
import torch

import gradalg as ga
import gradalg.exec.capture_pass as capture_pass
from gradalg.capture.factors import Factors
from references import one_thread  # noqa: F401 - one intra-op thread per test module

transformers = pytest.importorskip("transformers")

VOCAB = 97
METHODS = ["grad_dot", "logra", "grass", "less", "influence_ekfac", "influence_kfac", "influence_datainf"]
GRADALG_SHARE = 1e-4


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, vocab_size=VOCAB,
                                   max_position_embeddings=64, tie_word_embeddings=True)
    bf16 = transformers.Qwen2ForCausalLM(cfg).eval().to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    train = [{"input_ids": torch.randint(0, VOCAB, (16,), generator=g)} for _ in range(8)]
    queries = [{"input_ids": torch.randint(0, VOCAB, (16,), generator=g)} for _ in range(3)]
    return bf16, copy.deepcopy(bf16).double(), train, queries


def _adam(task, model, train):
    """Adam after one step on 4 training sequences, the weights put back (LESS reads its moments)."""
    saved = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    task.summed_loss(model, {"input_ids": torch.stack([x["input_ids"] for x in train[:4]])}).backward()
    opt.step()
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
            p.grad = None
    return opt


def scores(method, model, train, queries) -> torch.Tensor:
    task = ga.tasks.causal_lm(model)
    m = ga.methods
    if method == "less":
        S = m.less([task], [_adam(task, model, train)], [1.0], train, queries, torch.arange(len(queries)))
    elif method.startswith("influence_"):
        S = m.influence(task, train, queries, curvature=method.split("_", 1)[1])
    else:
        S = getattr(m, method)(task, train, queries)
    return torch.as_tensor(S.compute().values)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("method", METHODS)
def test_bf16_scores_carry_the_models_rounding_only(models, method, monkeypatch):
    bf16, f64, train, queries = models
    S = scores(method, bf16, train, queries)
    assert S.dtype == torch.float32 and torch.isfinite(S).all()
    S64 = scores(method, f64, train, queries)

    calls = []
    capture = capture_pass.capture_batch

    def float64_factors(*args, **kwargs):
        blocks = capture(*args, **kwargs)
        calls.append({f.D.dtype for f in blocks.values()})
        return {n: Factors(f.A.double() if isinstance(f.A, torch.Tensor) else f.A, f.D.double())
                for n, f in blocks.items()}

    monkeypatch.setattr(capture_pass, "capture_batch", float64_factors)
    S_up = scores(method, bf16, train, queries)
    assert calls and all(d == {torch.bfloat16} for d in calls)     # the bf16 capture went through the patch
    assert rel(S, S_up) < GRADALG_SHARE                            # gradalg's own arithmetic: float32-exact
    # the model's rounding is there (a bf16 model, not a float64 shortcut) and bounded
    assert 2.0 ** -12 < rel(S, S64) < 0.5
