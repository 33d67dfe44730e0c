"""A model torch.func cannot push a tangent through (CPU's fused SDPA attention) is refused
by the curvature products with a fix that works as written: switched to eager attention,
the model gives the scores of the same model built with eager attention (whose products
``test_products_pass.py`` and the differential matrix check against references)."""
from __future__ import annotations

import pytest
import torch
from references import one_thread  # noqa: F401 - fixture

import gradalg as ga

F64 = torch.float64


def _gpt2(attn):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=16, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return GPT2LMHeadModel(cfg).to(F64).eval()


def _data():
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 16, (6, 6), generator=g)}, {"input_ids": torch.randint(0, 16, (2, 6), generator=g)}


@pytest.mark.parametrize("curvature", ["gauss_newton", "hessian"])
def test_sdpa_products_refused_with_the_eager_fix(curvature):
    train, queries = _data()
    model = _gpt2("sdpa")
    with pytest.raises(ga.errors.UnsupportedLayerError, match=r"set_attn_implementation\('eager'\)"):
        ga.methods.influence(ga.tasks.causal_lm(model), train, queries, curvature=curvature, solver="cg",
                             damping=0.1).compute()


def test_the_fix_as_written_gives_the_eager_models_scores():
    train, queries = _data()
    model = _gpt2("sdpa")
    model.set_attn_implementation("eager")       # the message's fix, as written

    def scores(m):
        return torch.as_tensor(ga.methods.influence(ga.tasks.causal_lm(m), train, queries, curvature="gauss_newton",
                                                    solver="cg", damping=0.1).compute().values)

    fixed, eager = scores(model), scores(_gpt2("eager"))
    assert torch.isfinite(fixed).all() and fixed.abs().max() > 0
    torch.testing.assert_close(fixed, eager, rtol=1e-10, atol=1e-12)
