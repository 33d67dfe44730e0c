"""The language tasks' vocabulary layers (issue 31 after issue 28 item 1).

``ga.tasks.causal_lm`` (and every ``ga.tasks`` language task) defaults to
``ga.TransformerBlocks(vocabulary="auto")``: the linear layers inside the transformer blocks,
plus the input embedding and the LM head (one block when tied) when the vocabulary is at
most ``ga.options().vocabulary_layers_max``. Checked here: which layers that selects on a
tied GPT-2, an untied Llama, a LoRA model and real-size configs (meta tensors, no training);
what ``explain()``'s coverage line says and that its fix works; and every method at its
defaults on the new layers, Grad-Dot and the empirical-Fisher influence against a
loop-of-backward reference (one ``backward()`` per example).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from references import block_rows, one_thread  # noqa: F401 - fixture
from torch import nn

import gradalg as ga
from gradalg.capture.hooks import resolve_layers

V = 53


def gpt2(vocab=V, device=None, **size):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(**{**dict(n_layer=2, n_embd=8, n_head=2, n_positions=32), **size}, vocab_size=vocab,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    with torch.device(device or "cpu"):
        model = GPT2LMHeadModel(cfg)
    return model.eval() if device == "meta" else model.double().eval()


def llama(vocab=V, device=None, **size):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**dict(hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, max_position_embeddings=32), **size},
                      vocab_size=vocab, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device(device or "cpu"):
        model = LlamaForCausalLM(cfg)
    return model.eval() if device == "meta" else model.double().eval()


def block_linears(model, lists) -> list[str]:
    from transformers.pytorch_utils import Conv1D
    return [n for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, Conv1D)) and any(n.startswith(p + ".") for p in lists)]


def items(n, vocab=V, seed=0, length=6):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, vocab, (length,), generator=g)} for _ in range(n)]


def default_names(task) -> tuple:
    return tuple(r.name for r in resolve_layers(task.model, task.layers_for(None)))


# --------------------------------------------------------------------- which layers
def test_small_tied_gpt2_adds_the_tied_embedding_as_one_block_and_says_why():
    model = gpt2()
    task = ga.tasks.causal_lm(model)
    assert task.default_layers == ga.TransformerBlocks(vocabulary="auto")
    blocks = block_linears(model, ["transformer.h"])
    assert default_names(task) == ("transformer.wte", *blocks)           # lm_head is the same block
    S = ga.methods.grad_dot(task, items(4), items(1, seed=1))
    [cov] = S.explain().coverage()
    params = dict(model.named_parameters())
    block = sum(p.numel() for n, p in params.items() if n.startswith("transformer.h.") and "ln_" not in n)
    assert (cov.blocks, cov.attributed) == (len(blocks) + 1, block + V * 8)
    assert "transformer.wte" not in [g.label for g in cov.left_out]
    text = str(S.explain())
    assert (f"and the vocabulary layers transformer.wte (tied to lm_head): vocabulary {V} ≤ "
            "ga.options(vocabulary_layers_max=4096)") in text
    # the position embedding and the norms stay out
    assert {g.label for g in cov.left_out} == {"transformer.wpe", "norms"}


def test_above_the_option_the_blocks_alone_and_the_line_names_the_fix():
    model = gpt2()
    task = ga.tasks.causal_lm(model)
    blocks = tuple(block_linears(model, ["transformer.h"]))
    with ga.options(vocabulary_layers_max=V - 1):
        assert default_names(task) == blocks
        S = ga.methods.grad_dot(task, items(4), items(1, seed=1))
        text = str(S.explain())
    assert (f"not the vocabulary layers transformer.wte (tied to lm_head): vocabulary {V} > "
            f"ga.options(vocabulary_layers_max={V - 1})") in text
    assert f"raise vocabulary_layers_max above {V}" in text
    with ga.options(vocabulary_layers_max=V):                          # the fix, as written
        assert default_names(task) == ("transformer.wte", *blocks)
    with ga.options(vocabulary_layers_max=0):
        assert default_names(task) == blocks
    with pytest.raises(ga.OptionError, match="vocabulary_layers_max"):
        ga.options(vocabulary_layers_max=-1)
    with pytest.raises(ga.OptionError, match="vocabulary"):
        ga.TransformerBlocks(vocabulary="yes")


def test_untied_llama_adds_the_embedding_and_the_head():
    model = llama()
    task = ga.tasks.causal_lm(model)
    blocks = block_linears(model, ["model.layers"])
    assert default_names(task) == ("model.embed_tokens", *blocks, "lm_head")
    [cov] = ga.methods.grad_dot(task, items(3), items(1, seed=1)).explain().coverage()
    assert [g.label for g in cov.left_out] == ["norms"]
    assert f"the vocabulary layers model.embed_tokens, lm_head: vocabulary {V} ≤" in cov.rule


def test_lora_keeps_the_adapters_default():
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    names = default_names(ga.tasks.causal_lm(lora))
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)


def test_bare_transformer_blocks_and_explicit_layers_keep_their_meaning():
    model = gpt2()
    blocks = tuple(block_linears(model, ["transformer.h"]))
    assert tuple(r.name for r in resolve_layers(model, ga.TransformerBlocks())) == blocks
    assert tuple(r.name for r in resolve_layers(model, ga.TransformerBlocks(vocabulary=True))) == (
        "transformer.wte", *blocks)
    task = ga.tasks.causal_lm(model)
    G = ga.grads(task, items(2), layers=ga.TransformerBlocks())
    assert G.expr.source.layers == blocks


@pytest.mark.parametrize("build, vocab, lists", [(gpt2, 50257, ["transformer.h"]), (llama, 32000, ["model.layers"])])
def test_real_size_vocabularies_keep_the_blocks_only(build, vocab, lists):
    """GPT-2 small (tied, 50,257) and a Llama-shaped config (untied, 32,000), on meta tensors."""
    size = dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024) if build is gpt2 else dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=2048)
    model = build(vocab, device="meta", **size)
    task = ga.tasks.causal_lm(model)
    assert default_names(task) == tuple(block_linears(model, lists))
    from gradalg.capture.blocks import select_block_layers
    rule = select_block_layers(model, vocabulary="auto").rule
    assert f"vocabulary {vocab:,} > ga.options(vocabulary_layers_max=4096)" in rule


# ------------------------------------------------------ numbers over the new layers
def loop_rows(task, data, layers) -> torch.Tensor:
    """(n, dim) per-example gradients, one ``backward()`` per example, laid out as the blocks
    (a tied matrix's gradient is the sum of its uses: the shared tensor's ``.grad``)."""
    model = task.model
    modules = dict(model.named_modules())
    names = [f"{layer}.{p}" for layer in layers for p, _ in modules[layer].named_parameters(recurse=False)]
    params = dict(model.named_parameters(remove_duplicate=False))
    rows = {n: [] for n in names}
    for item in data:
        model.zero_grad(set_to_none=True)
        task.loss(model, ga.collate.pad_collate([item])).backward()
        for n in names:
            rows[n].append(params[n].grad.detach().clone())
    model.zero_grad(set_to_none=True)
    return block_rows(model, layers, {n: torch.stack(r) for n, r in rows.items()})


@pytest.mark.parametrize("build", [gpt2, llama])
def test_grad_dot_and_influence_over_the_new_default_layers_match_a_loop_of_backward(build):
    model = build()
    task = ga.tasks.causal_lm(model)
    train, queries = items(6), items(2, seed=1)
    layers = list(default_names(task))
    assert any("embed" in n or "wte" in n for n in layers)
    G, Q = loop_rows(task, train, layers), loop_rows(task, queries, layers)
    S = ga.methods.grad_dot(task, train, queries).compute()
    torch.testing.assert_close(torch.as_tensor(np.asarray(S.values)), Q @ G.T, rtol=1e-7, atol=1e-9)
    lam = 1e-2
    S = ga.methods.influence(task, train, queries, curvature="empirical", damping=lam).compute()
    H = G.T @ G / len(train) + lam * torch.eye(G.shape[1], dtype=G.dtype)
    torch.testing.assert_close(torch.as_tensor(np.asarray(S.values)), Q @ torch.linalg.solve(H, G.T),
                               rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("build", [gpt2, llama])
def test_every_method_runs_at_its_defaults_on_the_new_layers(build):
    model = build()
    task = ga.tasks.causal_lm(model)
    train, queries = items(8), items(2, seed=1)
    layers = default_names(task)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    task.loss(model, ga.collate.pad_collate(train)).backward()
    opt.step()
    model.zero_grad(set_to_none=True)
    m = ga.methods
    runs = {
        "grad_dot": lambda: m.grad_dot(task, train, queries),
        "grad_cos": lambda: m.grad_cos(task, train, queries),
        "trak": lambda: m.trak(task, train, queries),
        "logra": lambda: m.logra(task, train, queries),
        "grass": lambda: m.grass(task, train, queries),
        "relatif": lambda: m.relatif(task, train, queries),
        "tracin": lambda: m.tracin([task, task], [1e-3, 1e-3], train, queries),
        "less": lambda: m.less([task], [opt], [1e-3], train, queries, np.arange(len(queries))),
        "trackstar": lambda: m.trackstar(task, train, queries, optimizer=opt),
        "source": lambda: m.source([m.Segment((task,), 1e-3, 2), m.Segment((task,), 1e-3, 2)], queries,
                                   train=train, final=task),
        **{f"influence-{c}": (lambda c=c: m.influence(task, train, queries, curvature=c))
           for c in ("auto", "ekfac", "kfac", "gauss_newton", "empirical", "datainf")},
    }
    for name, run in runs.items():
        S = run()
        sources = {n.layers for n in S.expr.walk() if type(n).__name__ == "Source"}
        assert sources == {layers}, name
        values = np.asarray(S.compute().values)
        assert values.shape in ((2, 8), (8, 2)) and np.isfinite(values).all(), name
    self_scores = np.asarray(m.self_influence(m.influence, task, train).compute().values)
    full = np.asarray(m.influence(task, train, train).compute().values)
    np.testing.assert_allclose(self_scores, np.diag(full), rtol=1e-6, atol=1e-9 * np.abs(full).max())
