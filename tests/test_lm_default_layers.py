"""The language tasks' default layers (the linear layers inside the transformer blocks,
``ga.TransformerBlocks``, and at a vocabulary of at most ``ga.options(vocabulary_layers_max)``
the input embedding and LM head: every zoo model's 61 tokens) and the coverage line of
``explain()``, against ``model.named_modules()`` / ``model.named_parameters()`` counted by
hand. The blocks-only default of a real vocabulary is checked under a lower
``vocabulary_layers_max`` here, and on real-size configs in ``tests/test_vocabulary_layers.py``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from references import func_rows, lm_default_names, one_thread, reference_rows  # noqa: F401 - fixture
from torch import nn

import gradalg as ga
from gradalg.capture.coverage import layer_coverage
from gradalg.capture.hooks import resolve_layers

import zoo

# the block lists of each zoo architecture, written out by hand (the code finds them generally)
BLOCK_LISTS = {"gpt2": ("transformer.h",), "bert": ("bert.encoder.layer",), "t5": ("encoder.block", "decoder.block"),
               "gpt_neox": ("gpt_neox.layers",)}


def _linear(module) -> bool:
    from transformers.pytorch_utils import Conv1D
    return isinstance(module, (nn.Linear, Conv1D))


def expected_block_linears(model, lists) -> list[str]:
    """Linear layers inside the blocks, and each expert's two matrices of a fused experts
    module there (``<module>.gate_up_proj.<e>``, ``<module>.down_proj.<e>``)."""
    names = []
    for n, m in model.named_modules():
        if not any(n.startswith(p + ".") for p in lists):
            continue
        if _linear(m):
            names.append(n)
        elif isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and m.gate_up_proj.dim() == 3:
            names += [f"{n}.{mat}.{e}" for e in range(m.gate_up_proj.shape[0]) for mat in ("gate_up_proj", "down_proj")]
    return names


def items(n=4, vocab=zoo.VOCAB, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, vocab, (L,), generator=g)} for L in (5, 7, 4, 6)[:n]]


def names_of(G) -> tuple:
    return G.expr.source.layers


def dense(G) -> torch.Tensor:
    """(n, dim) rows of G, blocks in its layer order."""
    blocks = G.to_dense()
    return torch.cat([blocks[n].flatten(1) for n in names_of(G)], 1).to(torch.float64)


def same_length(data):
    """The items cut to one length, and their (B, T) batch for the reference."""
    data = [{"input_ids": d["input_ids"][:4]} for d in data]
    return data, {"input_ids": torch.stack([d["input_ids"] for d in data])}


@pytest.mark.parametrize("arch", list(zoo.ZOO))
def test_default_layers_of_every_zoo_architecture_are_the_block_linears(arch):
    model = zoo.ZOO[arch]()[0]
    lists = BLOCK_LISTS.get(arch, ("model.layers",))
    expected = expected_block_linears(model, lists)
    assert expected, arch
    got = [r.name for r in resolve_layers(model, ga.TransformerBlocks())]
    assert got == expected
    # nothing outside the blocks, no embedding, no norm, no head
    assert not any(n.startswith(("lm_head", "cls.")) or "embed" in n or "norm" in n.lower() for n in got)
    if arch in ("bert",):
        task = ga.tasks.masked_lm(model)
    elif arch == "t5":
        task = ga.tasks.seq2seq(model)
    else:
        task = ga.tasks.causal_lm(model)
    assert list(names_of(ga.grads(task, items()))) == lm_default_names(model, expected)
    with ga.options(vocabulary_layers_max=zoo.VOCAB - 1):     # the default of a larger vocabulary
        assert list(names_of(ga.grads(task, items()))) == expected


def test_default_gradients_match_the_loop_reference_on_the_block_linears():
    model = zoo.gpt2()[0]
    task = ga.tasks.causal_lm(model)
    data, batch = same_length(items())
    G = ga.grads(task, data)
    assert "transformer.wte" in names_of(G)
    torch.testing.assert_close(dense(G), reference_rows(task, batch, list(names_of(G))), rtol=1e-6, atol=1e-8)


def test_every_entry_point_honours_the_task_default():
    model = zoo.gpt2()[0]
    task = ga.tasks.causal_lm(model)
    expected = tuple(lm_default_names(model, expected_block_linears(model, ("transformer.h",))))
    assert expected[0] == "transformer.wte"
    data = items()
    assert names_of(ga.grads(task, data)) == expected
    assert ga.hessian(task, data).expr.layers == expected
    assert ga.gauss_newton(task, data).expr.layers == expected
    for S in (ga.methods.influence(task, data, data[:2], curvature="ekfac"),
              ga.methods.influence(task, data, data[:2], curvature="kfac"),
              ga.methods.grad_dot(task, data, data[:2]),
              ga.methods.logra(task, data, data[:2], k=8),
              ga.methods.trak(task, data, data[:2], k=16)):
        sources = {n.layers for n in S.expr.walk() if type(n).__name__ == "Source"}
        assert sources == {expected}, S
        values = S.compute().values
        assert values.shape == (2, 4) and torch.isfinite(torch.as_tensor(values)).all()


def test_all_names_and_globs_keep_their_meaning_and_plain_task_keeps_its_default():
    model = zoo.gpt2()[0]
    task = ga.tasks.causal_lm(model)
    every = names_of(ga.grads(task, items(), "all"))
    assert "lm_head" in every and "transformer.wte" in every and "transformer.ln_f" in every
    assert names_of(ga.grads(task, items(), ["lm_head"])) == ("lm_head",)
    assert names_of(ga.grads(task, items(), "transformer.h.*.mlp.c_fc")) == (
        "transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc")
    plain = ga.Task(model, zoo.causal_lm_loss)
    assert plain.default_layers is None
    default = names_of(ga.grads(plain, zoo.padded_tokens()))
    assert "lm_head" in default and "transformer.wte" in default


def test_task_default_layers_can_be_names_or_a_callable():
    model = zoo.gpt2()[0]
    task = ga.Task(model, zoo.causal_lm_loss, default_layers=["lm_head"])
    assert names_of(ga.grads(task, zoo.padded_tokens())) == ("lm_head",)
    task = ga.Task(model, zoo.causal_lm_loss, default_layers=lambda m: ["transformer.h.1.mlp.c_fc"])
    assert names_of(ga.grads(task, zoo.padded_tokens())) == ("transformer.h.1.mlp.c_fc",)
    task = ga.Task(model, zoo.causal_lm_loss, default_layers=ga.TransformerBlocks())
    assert names_of(ga.grads(task, zoo.padded_tokens())) == tuple(expected_block_linears(model, ("transformer.h",)))
    with pytest.raises(TypeError, match="default_layers"):
        ga.Task(model, zoo.causal_lm_loss, default_layers=[1, 2])


def test_sequence_classification_includes_the_head():
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2ForSequenceClassification
    torch.manual_seed(0)
    gpt = GPT2ForSequenceClassification(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=29, n_positions=32,
                                                   num_labels=3, pad_token_id=0))
    bert = BertForSequenceClassification(BertConfig(vocab_size=29, hidden_size=16, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=24, num_labels=3,
                                                    max_position_embeddings=32))
    data = [{"input_ids": torch.tensor([3, 4, 5]), "labels": torch.tensor(1)}]
    got = names_of(ga.grads(ga.tasks.sequence_classification(gpt), data))
    assert got == tuple(expected_block_linears(gpt, ("transformer.h",))) + ("score",)
    got = names_of(ga.grads(ga.tasks.sequence_classification(bert), data))
    assert got == tuple(expected_block_linears(bert, ("bert.encoder.layer",))) + ("bert.pooler.dense", "classifier")


class BagLM(nn.Module):
    """A language model without blocks: embedding → two Linears → head (B, T, V)."""

    def __init__(self, vocab=23, d=8, tied=False, hf=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        if hf:   # HF's accessors name the embeddings
            self.get_input_embeddings = lambda: self.emb
            self.get_output_embeddings = lambda: self.head

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.norm(self.body(self.emb(input_ids))))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("hf", [False, True])
def test_fallback_without_blocks_leaves_out_the_embeddings_and_the_head(tied, hf):
    """Above ``vocabulary_layers_max``: the body only; at this 23-token vocabulary's default,
    the embedding and the head too (one block when tied)."""
    model = BagLM(tied=tied, hf=hf).double()
    task = ga.tasks.causal_lm(model, logits=lambda m, b: m(b["input_ids"]))
    with ga.options(vocabulary_layers_max=22):
        G = ga.grads(task, items(vocab=23))
        assert names_of(G) == ("body.0", "body.2")
        cov = layer_coverage(model, names_of(G), selection=task.default_layers)
        assert "no block list" in cov.rule and "output head" in cov.rule
        assert "not the vocabulary layers emb" in cov.rule
        assert cov.attributed == 2 * (8 * 8 + 8)
        assert cov.total == sum(p.numel() for p in model.parameters())
        text = str((G @ G.T).explain())
        assert "no block list" in text and "coverage: 2 blocks" in text
        data, batch = same_length(items(vocab=23))
        G = ga.grads(task, data)
        torch.testing.assert_close(dense(G), reference_rows(task, batch, ["body.0", "body.2"]), rtol=1e-6,
                                   atol=1e-8)
    G = ga.grads(task, data)
    assert names_of(G) == (("emb", "body.0", "body.2") if tied else ("emb", "body.0", "body.2", "head"))
    cov = layer_coverage(model, names_of(G), selection=task.default_layers)
    assert "and the vocabulary layers emb" in cov.rule
    assert cov.attributed == 2 * (8 * 8 + 8) + 23 * 8 * (1 if tied else 2)
    if not tied:        # (a tied block's layout is the weight's: checked in tests/test_tied.py)
        torch.testing.assert_close(dense(G), reference_rows(task, batch, ["emb", "body.0", "body.2", "head"]),
                                   rtol=1e-6, atol=1e-8)


def test_a_selection_of_nothing_is_refused_and_layers_all_works():
    class OnlyHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 4)
            self.head = nn.Linear(4, 11)

        def forward(self, input_ids, attention_mask=None):
            return self.head(self.emb(input_ids))

    model = OnlyHead().double()
    task = ga.tasks.causal_lm(model, logits=lambda m, b: m(b["input_ids"]))
    data = items(vocab=11)
    with ga.options(vocabulary_layers_max=10), pytest.raises(ga.UnsupportedLayerError, match="layers='all'"):
        ga.grads(task, data)
    G = ga.grads(task, data, "all")                          # the fix the message names
    assert names_of(G) == ("emb", "head") and dense(G).shape == (4, 11 * 4 + 11 * 5)
    assert names_of(ga.grads(task, data)) == ("emb", "head")  # the default at this vocabulary


def test_coverage_numbers_of_a_tied_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=16)).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    task = ga.tasks.causal_lm(model)
    with ga.options(vocabulary_layers_max=96):     # a vocabulary above the option: the blocks alone
        _tied_gpt2_coverage(model, task)


def _tied_gpt2_coverage(model, task):
    data = [{"input_ids": torch.randint(1, 97, (6,))} for _ in range(3)]
    S = ga.methods.influence(task, data, data[:1], curvature="ekfac")
    [cov] = S.explain().coverage()
    params = dict(model.named_parameters())        # a tied parameter appears once
    block = sum(p.numel() for n, p in params.items() if n.startswith("transformer.h.") and "ln_" not in n)
    total = sum(p.numel() for p in params.values())
    assert (cov.blocks, cov.attributed, cov.total) == (8, block, total)
    left = {g.label: g for g in cov.left_out}
    assert left["transformer.wte"].params == 97 * 32 and left["transformer.wte"].note == "tied to lm_head"
    assert left["transformer.wpe"].params == 16 * 32 and left["transformer.wpe"].func_only
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    assert left["norms"].modules == len(norms) == 5
    assert left["norms"].params == sum(p.numel() for n, p in params.items() if "ln_" in n)
    assert sum(g.params for g in cov.left_out) == total - block
    text, html = str(S.explain()), S.explain()._repr_html_()
    line = cov.describe().splitlines()[0]
    assert line in text and f"({100 * block / total:.1f} %)" in line and "tied to lm_head" in line
    assert ("transformer-block linears + vocabulary layers up to vocabulary_layers_max: the linear layers "
            "inside the 2 blocks of transformer.h; not the vocabulary layers transformer.wte (tied to lm_head): "
            "vocabulary 97 > ga.options(vocabulary_layers_max=96)") in text
    assert "ga-coverage" in html and "tied to lm_head" in html
    exported = S.explain().to_dict()["coverage"][0]
    assert exported["attributed_parameters"] == block and exported["trainable_parameters"] == total
    # layers="all": every parameter but the position embedding; the tied matrix counted once
    [cov_all] = ga.methods.grad_dot(task, data, data[:1], layers="all").explain().coverage()
    assert cov_all.attributed == total - 16 * 32 and [g.label for g in cov_all.left_out] == ["transformer.wpe"]
    assert 'layers="all"' not in cov_all.describe()      # that fix would not include it
    # the fix the line names for the position embedding works
    batch = {"input_ids": torch.stack([d["input_ids"] for d in data])}
    G = ga.grads(task, data, ["transformer.wpe"], backend="func")
    torch.testing.assert_close(dense(G).float(), func_rows(task, batch, ["transformer.wpe"]).float(),
                               rtol=1e-4, atol=1e-6)


def test_coverage_counts_trainable_parameters_under_lora():
    peft = pytest.importorskip("peft")
    model = zoo.llama()[0]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    task = ga.tasks.causal_lm(lora)
    G = ga.grads(task, items())
    names = names_of(G)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    [cov] = (G @ G.T).explain().coverage()
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert cov.total == trainable and cov.attributed == trainable and not cov.left_out
    # the frozen base layers named explicitly: counted apart, not as trainable coverage
    [cov] = (lambda G: (G @ G.T).explain().coverage())(ga.grads(task, items(), ["model.layers.0.self_attn.q_proj"]))
    assert cov.attributed == 0 and cov.frozen_attributed == 32 * 32
