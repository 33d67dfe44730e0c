"""Architectures nobody tuned on (issue 28, ``benchmarks/arch_probe.py``), as tiny configs:
OPT (and OPT-350m's project_in/out), BLOOM, Falcon (both decoder layouts), GPT-Neo, GPT-J,
Gemma-3, Phi, StableLM, OLMoE, Qwen3-MoE and Qwen2-MoE (fused 3-D experts: one block per
expert and matrix, ``gradalg.capture.experts``; Qwen2-MoE's shared expert and its 1-wide
sigmoid gate beside them), and Mistral with a sliding window shorter than the sequences. For
each, with ``ga.tasks.causal_lm`` at its defaults: Grad-Dot scores equal the loop-of-backward
reference (each sequence alone, ``torch.autograd.grad`` of its summed token cross-entropy
written from the HF call), the influence scores equal the dense formula, and the coverage
line counts what a hand count of the block linears gives. An encoder-decoder model given to
``causal_lm`` is refused with a fix that works as written."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import gradalg as ga
from gradalg.capture.coverage import layer_coverage
from gradalg.capture.hooks import resolve_layers
from references import block_rows, lm_default_names, one_thread  # noqa: F401 - fixture
from zoo import stock_oracle

F64 = torch.float64
V = 37


def build(arch: str, h: int = 16) -> nn.Module:
    """A 2-layer, width-``h`` model of ``arch`` at its config's defaults otherwise (tied
    heads where the architecture ties them), float64, eval."""
    import transformers as tf
    torch.manual_seed(0)
    SMALL = dict(hidden_size=h, num_attention_heads=2, vocab_size=V)
    n2 = dict(num_hidden_layers=2)
    if arch == "opt":
        model = tf.OPTForCausalLM(tf.OPTConfig(**SMALL, **n2, ffn_dim=24, word_embed_proj_dim=h,
                                               max_position_embeddings=32, dropout=0.0, pad_token_id=1))
    elif arch == "opt_project":   # OPT-350m: embeddings of another width, project_in / project_out
        model = tf.OPTForCausalLM(tf.OPTConfig(**SMALL, **n2, ffn_dim=24, word_embed_proj_dim=h // 2,
                                               do_layer_norm_before=False, max_position_embeddings=32,
                                               dropout=0.0, pad_token_id=1))
    elif arch == "bloom":
        model = tf.BloomForCausalLM(tf.BloomConfig(hidden_size=h, n_layer=2, n_head=2, vocab_size=V))
    elif arch == "falcon":
        model = tf.FalconForCausalLM(tf.FalconConfig(**SMALL, **n2))
    elif arch == "falcon_new":    # Falcon-40B's layout: GQA, two layer norms, parallel attention
        model = tf.FalconForCausalLM(tf.FalconConfig(**SMALL, **n2, num_kv_heads=1, new_decoder_architecture=True))
    elif arch == "gpt_neo":
        model = tf.GPTNeoForCausalLM(tf.GPTNeoConfig(hidden_size=h, num_layers=2, num_heads=2, vocab_size=V,
                                                     attention_types=[[["global", "local"], 1]], window_size=3,
                                                     max_position_embeddings=32))
    elif arch == "gptj":
        model = tf.GPTJForCausalLM(tf.GPTJConfig(n_embd=h, n_layer=2, n_head=2, rotary_dim=4, vocab_size=V,
                                                 n_positions=32))
    elif arch == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**SMALL, **n2, intermediate_size=24, num_key_value_heads=1,
                                                         head_dim=8, sliding_window=3, max_position_embeddings=32))
    elif arch == "phi":
        model = tf.PhiForCausalLM(tf.PhiConfig(**SMALL, **n2, intermediate_size=24, max_position_embeddings=32))
    elif arch == "stablelm":
        model = tf.StableLmForCausalLM(tf.StableLmConfig(**SMALL, **n2, intermediate_size=24, num_key_value_heads=1,
                                                         max_position_embeddings=32))
    elif arch == "olmoe":
        model = tf.OlmoeForCausalLM(tf.OlmoeConfig(**SMALL, **n2, intermediate_size=8, num_experts=4,
                                                   num_experts_per_tok=2, max_position_embeddings=32,
                                                   experts_implementation="eager"))
    elif arch == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**SMALL, **n2, intermediate_size=24, moe_intermediate_size=8,
                                                         num_key_value_heads=1, head_dim=8, num_experts=4,
                                                         num_experts_per_tok=2, max_position_embeddings=32,
                                                         experts_implementation="eager"))
    elif arch == "qwen2_moe":     # shared expert beside the routed ones, its sigmoid gate a (1, H) linear
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**SMALL, **n2, intermediate_size=24, moe_intermediate_size=8,
                                                         shared_expert_intermediate_size=12, num_key_value_heads=1,
                                                         num_experts=4, num_experts_per_tok=2,
                                                         max_position_embeddings=32, experts_implementation="eager"))
    elif arch == "mistral":       # a sliding window (3) shorter than the sequences (4-7 tokens)
        model = tf.MistralForCausalLM(tf.MistralConfig(**SMALL, **n2, intermediate_size=24, num_key_value_heads=1,
                                                       sliding_window=3, max_position_embeddings=32))
    else:
        raise KeyError(arch)
    return model.double().eval()


ARCHS = ("opt", "opt_project", "bloom", "falcon", "falcon_new", "gpt_neo", "gptj", "gemma3", "phi", "stablelm",
         "olmoe", "qwen3_moe", "qwen2_moe", "mistral")


def items(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, V, (length,), generator=g)} for length in (6, 4, 5, 7)[:n]]


def block_linears(model: nn.Module) -> list[str]:
    """By hand: the nn.Linear / HF Conv1D modules inside ``<...>.layers`` / ``.h`` (the blocks),
    and each expert's two matrices of a fused experts module there (``<module>.<matrix>.<e>``)."""
    from transformers.pytorch_utils import Conv1D
    names = []
    for n, m in model.named_modules():
        if not any(f".{lst}." in f".{n}" for lst in ("layers", "h")):
            continue
        if isinstance(m, (nn.Linear, Conv1D)):
            names.append(n)
        elif isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and m.gate_up_proj.dim() == 3:
            names += [f"{n}.{mat}.{e}" for e in range(m.gate_up_proj.shape[0]) for mat in ("gate_up_proj", "down_proj")]
    return names


def block_params(model, layers) -> list[str]:
    """The parameter names the blocks ``layers`` hold (a fused experts module's once)."""
    modules = dict(model.named_modules())
    out = []
    for name in layers:
        if name in modules:
            out += [f"{name}.{p}" for p, _ in modules[name].named_parameters(recurse=False)]
        else:
            out.append(name.rsplit(".", 1)[0])
    return list(dict.fromkeys(out))


def reference_rows(model, data, layers) -> torch.Tensor:
    return block_rows(model, layers, stock_oracle(model, data, "causal_lm", block_params(model, layers)))


@pytest.mark.parametrize("arch", ARCHS)
def test_grad_dot_at_defaults_matches_the_loop_reference_and_coverage_is_counted(arch):
    model = build(arch)
    task = ga.tasks.causal_lm(model)
    train, queries = items(4, 1), items(2, 2)
    blocks = block_linears(model)
    assert [r.name for r in resolve_layers(model, ga.TransformerBlocks())] == blocks
    # the task's default at this 61-token vocabulary: the block linears and the vocabulary layers
    layers = lm_default_names(model, blocks)
    assert len(layers) > len(blocks)
    S = ga.methods.grad_dot(task, train, queries)
    got = torch.from_numpy(S.compute().values)                               # (2, 4)
    expected = reference_rows(model, queries, layers) @ reference_rows(model, train, layers).T
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    # the coverage line: the default layers' parameters over every trainable one, each once
    cov = layer_coverage(model, layers, selection=task.default_layers)
    assert "and the vocabulary layers" in cov.rule
    by_hand = sum(model.get_parameter(n).numel() for n in block_params(model, layers))
    assert (cov.attributed, cov.total) == (by_hand, sum(p.numel() for p in model.parameters()))
    assert f"{100 * by_hand / cov.total:.1f} %" in str(S.explain())


@pytest.mark.parametrize("arch", ("opt", "bloom", "falcon_new", "gptj", "gemma3", "phi", "olmoe", "qwen2_moe", "mistral"))
def test_influence_at_defaults_matches_the_dense_formula(arch):
    """curvature='auto' is the dense Gauss-Newton of sampled labels at this size, damped by
    its mean eigenvalue: RQ (CᵀC/n + λI)⁻¹ RGᵀ with λ = tr(CᵀC/n)/dim (width 8: ≈ 1,000
    coordinates)."""
    model = build(arch, h=8)
    task = ga.tasks.causal_lm(model)
    train, queries = items(4, 1), items(2, 2)
    layers = block_linears(model)
    # over the block linears (the layout of the references'): a vocabulary above the option
    with ga.options(dense_curvature_dim=10**5, vocabulary_layers_max=0):
        got = torch.from_numpy(ga.methods.influence(task, train, queries).compute().values)
        C = ga.grads(task, train, objective="sampled", seed=0).to_dense()
    C = torch.cat([C[n].flatten(1) for n in layers], 1).to(F64)
    H = C.T @ C / C.shape[0]
    H += torch.trace(H) / H.shape[0] * torch.eye(H.shape[0], dtype=F64)
    RG, RQ = reference_rows(model, train, layers), reference_rows(model, queries, layers)
    torch.testing.assert_close(got, RQ @ torch.linalg.solve(H, RG.T), rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("arch", ("olmoe", "qwen3_moe"))
def test_fused_experts_are_default_layers_and_their_blocks_add_up_to_the_parameters(arch):
    """Fused 3-D experts (transformers ≥ 5) are block linears: one factored block per expert
    and matrix, counted by the coverage line; naming the module records all of them, and
    ``to_params`` sums them into the 3-D parameters exactly (the loop of backward)."""
    model = build(arch)
    line = layer_coverage(model, block_linears(model), selection=ga.TransformerBlocks()).describe()
    assert "experts" not in line and "24 blocks" in line
    data = items(3, 1)
    captured = ga.grads(ga.tasks.causal_lm(model), data, layers=["model.layers.0.mlp.experts"]).to_params()
    assert sorted(captured) == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"]
    reference = stock_oracle(model, data, "causal_lm", list(captured))
    for name in captured:
        torch.testing.assert_close(captured[name], reference[name], rtol=1e-9, atol=1e-12)


def test_causal_lm_refuses_an_encoder_decoder_and_its_fix_works():
    import transformers as tf
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(tf.T5Config(d_model=16, d_ff=24, d_kv=8, num_layers=2, num_heads=2,
                                                      vocab_size=V, decoder_start_token_id=0,
                                                      pad_token_id=0)).double().eval()
    with pytest.raises(ga.errors.HeadMismatchError, match=r"ga.tasks.seq2seq\(model\) with items"):
        ga.tasks.causal_lm(model)
    # the fix as written: ga.tasks.seq2seq(model), items {'input_ids': ..., 'labels': ...}
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": torch.randint(3, V, (5,), generator=g), "labels": torch.randint(3, V, (3,), generator=g)}
            for _ in range(3)]
    task = ga.tasks.seq2seq(model)
    got = torch.from_numpy(ga.methods.grad_dot(task, data[:2], data[2:]).compute().values)
    layers = lm_default_names(model, [r.name for r in resolve_layers(model, ga.TransformerBlocks())])
    params = [f"{n}.{p}" for n in layers for p, _ in dict(model.named_modules())[n].named_parameters(recurse=False)]
    rows = block_rows(model, layers, stock_oracle(model, data, "seq2seq", params))
    torch.testing.assert_close(got, rows[2:] @ rows[:2].T, rtol=1e-9, atol=1e-12)


def test_a_memory_refusal_offers_fewer_queries_only_where_that_fits():
    """K-FAC statistics do not shrink with the queries: a refusal they cause does not offer
    "fewer queries per call" (applied, it would be refused again); held query rows do, and
    there the fix, applied as written, runs (Phi-3-mini's EK-FAC at 4 GB was the first case)."""
    model = build("opt")
    task = ga.tasks.causal_lm(model)
    train = items(4, 1)
    g = torch.Generator().manual_seed(5)
    queries = [{"input_ids": torch.randint(3, V, (6,), generator=g)} for _ in range(64)]
    with ga.options(memory_budget="200kB"):
        for n in (2, 1):
            with pytest.raises(ga.errors.MemoryBudgetError) as err:
                ga.methods.influence(task, train, queries[:n], curvature="ekfac").explain()
            assert "fewer queries" not in str(err.value) and "ga.proj.kron" in str(err.value)
        with pytest.raises(ga.errors.MemoryBudgetError, match="use fewer queries per call"):
            ga.methods.grad_dot(task, train, queries).explain()
        got = torch.from_numpy(ga.methods.grad_dot(task, train, queries[:1]).compute().values)
    layers = lm_default_names(model, block_linears(model))        # the vocabulary layers too (V = 61)
    expected = reference_rows(model, queries[:1], layers) @ reference_rows(model, train, layers).T
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def _float64_grouped_mm_moe():
    import transformers as tf
    torch.manual_seed(0)
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        hidden_size=16, num_attention_heads=2, vocab_size=V, num_hidden_layers=2, intermediate_size=24,
        moe_intermediate_size=8, shared_expert_intermediate_size=12, num_key_value_heads=1, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, experts_implementation="grouped_mm")).double().eval()


def test_an_error_the_models_op_raises_inside_capture_is_a_batch_content_error():
    """Qwen2-MoE in float64 with transformers' default ``grouped_mm`` experts: the model's
    own forward fails (no float64 kernel). Raised by the op while gradalg's weight-use mode
    forwarded the call, it was a raw ``RuntimeError``; it is the model's error on the batch,
    a typed ``BatchContentError`` carrying the op's message, which says the model's own
    forward fails (not "inputs of the dtype its layers take") and names the fixes. Each
    fix, run as written (the message's code spans, executed), makes Grad-Dot's scores
    those of the loop of backward."""
    model = _float64_grouped_mm_moe()
    with pytest.raises(RuntimeError, match="Float32"):      # the model alone, without gradalg
        model(input_ids=items(1, 1)[0]["input_ids"][None])
    train, queries = items(3, 1), items(1, 2)
    with pytest.raises(ga.errors.BatchContentError, match="own forward fails on this batch.*Float32") as err:
        ga.methods.grad_dot(ga.tasks.causal_lm(model), train, queries).compute()
    message = str(err.value)
    assert "dtype, shape and device" not in message and "grouped_mm" in message and "float64" in message
    fixes = re.findall(r"`([^`]+)`", message)
    assert fixes == ['model.set_experts_implementation("eager")', "model = model.float()"]
    for fix, rtol in zip(fixes, (1e-9, 1e-4)):
        scope = {"model": _float64_grouped_mm_moe()}
        exec(fix, scope)                                     # the fix as the message writes it
        fixed = scope["model"]
        got = torch.from_numpy(ga.methods.grad_dot(ga.tasks.causal_lm(fixed), train, queries).compute().values)
        layers = lm_default_names(fixed, block_linears(fixed))
        expected = reference_rows(fixed, queries, layers) @ reference_rows(fixed, train, layers).T
        torch.testing.assert_close(got.to(F64), expected, rtol=rtol, atol=1e-6 * expected.abs().max().item())


def test_a_model_whose_own_forward_fails_is_told_so():
    """A Phi whose config's ``num_key_value_heads`` (3) does not match its 4 heads fails on
    any input: the error says the model's own forward fails on this batch, with torch's
    message, and advises checking the model, not the inputs' dtype or shape. A model whose
    plain forward runs is told the inputs' advice as before."""
    import transformers as tf
    torch.manual_seed(0)
    config = tf.PhiConfig(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=32)
    config.num_key_value_heads = 3
    model = tf.PhiForCausalLM(config).double().eval()
    with pytest.raises(RuntimeError, match="size of tensor a") as plain:
        model(input_ids=items(1, 1)[0]["input_ids"][None])
    with pytest.raises(ga.errors.BatchContentError, match="own forward fails on this batch") as err:
        ga.methods.grad_dot(ga.tasks.causal_lm(model), items(3, 1), items(1, 2)).compute()
    assert str(plain.value)[:80] in str(err.value) and "config" in str(err.value)
    assert "dtype, shape and device" not in str(err.value)
    # a classifier given features of the wrong width: its own forward fails too, and the
    # advice names the inputs first (they were not checked against the model's layers)
    mlp = nn.Sequential(nn.Linear(5, 3))
    with pytest.raises(ga.errors.BatchContentError, match="own forward fails on this batch.*mat1 and mat2") as err:
        ga.methods.grad_dot(ga.tasks.classification(mlp), [(torch.randn(4), 0)], [(torch.randn(4), 1)]).compute()
    assert "could not read the batch" in str(err.value)
    assert "give it inputs of the dtype, shape and device its layers take" in str(err.value)


def test_the_plain_forward_runs_without_gradalgs_hooks_and_gets_them_back():
    """``own_forward_error`` runs the model with gradalg's forward hooks off (a module's and
    the global ones; the user's stay on), in eval mode, and puts every hook dict and
    training flag back after: a batch norm's running statistics are not touched."""
    from torch.nn.modules import module as mm
    from gradalg.own_hooks import ours
    from gradalg.tasks.validation import own_forward_error
    calls = []

    def theirs(m, args, out):
        calls.append("user")

    def gradalgs(m, args, out):
        calls.append("gradalg")
    lin = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).train()
    stats = lin[1].running_mean.clone()
    handles = [lin.register_forward_hook(theirs), ours(lin.register_forward_hook(gradalgs)),
               ours(mm.register_module_forward_hook(gradalgs))]
    try:
        dicts = (lin._forward_hooks, mm._global_forward_hooks)
        before = [list(d.items()) for d in dicts]
        assert own_forward_error(lin, (torch.randn(3, 3),)) is None and calls == ["user"]
        assert [list(d.items()) for d in dicts] == before and len(lin._forward_hooks) == 2
        assert lin.training and lin[1].training and torch.equal(lin[1].running_mean, stats)   # no state changed
        assert isinstance(own_forward_error(lin, (torch.randn(3, 4),)), RuntimeError)
        lin(torch.randn(3, 3))
        # all back on: the user's, gradalg's on the Sequential, the global one on its 3 modules
        assert calls[0] == "user" and calls[1:].count("user") == 1 and calls[1:].count("gradalg") == 1 + 3
    finally:
        for h in handles:
            h.remove()
