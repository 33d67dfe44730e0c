"""ga.tasks for language models against loop-of-backward oracles (float64, one sequence
at a time, unpadded), and the methods on dict items with no glue."""
from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from references import block_rows, one_thread  # noqa: F401 - fixture

import gradalg as ga
from gradalg.task import ExampleRandom

F64 = torch.float64
VOCAB = 29


def gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    return GPT2LMHeadModel(cfg).to(F64).eval(), ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc",
                                                 "transformer.h.1.mlp.c_proj"]


def llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(F64).eval(), ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj",
                                                  "model.layers.1.mlp.down_proj"]


MODELS = {"gpt2": gpt2, "llama": llama}


def items(n=6, lengths=(5, 9, 3, 7, 6, 4), seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for L in lengths[:n]:
        out.append({"input_ids": torch.randint(1, VOCAB, (L,), generator=g), "attention_mask": torch.ones(L, dtype=torch.long)})
    return out


def oracle(model, layers, seqs, per_token_loss, F64=F64):
    """(n, dim) gradients of Σ_t per_token_loss(logits, seq) for each unpadded sequence alone."""
    modules = dict(model.named_modules())
    names = [f"{l}.{p}" for l in layers for p, _ in modules[l].named_parameters(recurse=False)]
    params = dict(model.named_parameters())
    rows = []
    for seq in seqs:
        ids = seq["input_ids"][None]
        logits = model(input_ids=ids).logits[0]
        loss = per_token_loss(logits, seq)
        grads = torch.autograd.grad(loss, [params[n] for n in names])
        rows.append(block_rows(model, layers, {n: g[None] for n, g in zip(names, grads)}))
    return torch.cat(rows)


def next_token_nll(logits, seq, start=0):
    ids = seq["input_ids"]
    targets = seq.get("labels", ids)[1:].clone()
    targets[: max(start - 1, 0)] = -100
    return F.cross_entropy(logits[:-1], targets, reduction="sum", ignore_index=-100)


def dense(G, layers):
    blocks = G.to_dense()
    return torch.cat([blocks[l].flatten(1) for l in layers], 1).to(F64)


def close(a, b, tol=1e-9):
    err = float((a - b).abs().max() / b.abs().max())
    assert err <= tol, err


@pytest.mark.parametrize("arch", MODELS)
def test_causal_lm_gradients_match_oracle_on_padded_batches(arch):
    model, layers = MODELS[arch]()
    data = items()
    G = ga.grads(ga.tasks.causal_lm(model), data, layers=layers, batch_size=4)   # padded to 9 and to 6
    close(dense(G, layers), oracle(model, layers, data, next_token_nll))


@pytest.mark.parametrize("arch", MODELS)
def test_left_padding_gets_the_unpadded_positions(arch):
    model, layers = MODELS[arch]()
    data = items(4)
    T = max(len(d["input_ids"]) for d in data)
    left = {"input_ids": torch.stack([F.pad(d["input_ids"], (T - len(d["input_ids"]), 0)) for d in data]),
            "attention_mask": torch.stack([F.pad(d["attention_mask"], (T - len(d["input_ids"]), 0)) for d in data])}
    G = ga.grads(ga.tasks.causal_lm(model, padding_side="left"), left, layers=layers)
    close(dense(G, layers), oracle(model, layers, data, next_token_nll))
    with pytest.raises(ga.BatchContentError, match=r"left-padded.*padding_side='left'") as err:
        ga.grads(ga.tasks.causal_lm(model), left, layers=layers, ids=[10, 11, 12, 13]).to_dense()
    long_row = max(range(4), key=lambda i: len(data[i]["input_ids"]))
    assert 10 + long_row not in err.value.example_ids and len(err.value.example_ids) == 3
    right = ga.collate.pad_collate(data)
    with pytest.raises(ga.BatchContentError, match="right-padded"):
        ga.grads(ga.tasks.causal_lm(model, padding_side="left"), right, layers=layers).to_dense()


def test_prompt_masking_by_labels_completion_mask_and_prompt_length():
    model, layers = gpt2()
    data = items()
    prompt = [2, 4, 1, 3, 2, 2]                           # tokens before the completion
    by_labels = [{**d, "labels": d["input_ids"].masked_fill(torch.arange(len(d["input_ids"])) < p, -100)}
                 for d, p in zip(data, prompt)]
    by_mask = [{**d, "completion_mask": (torch.arange(len(d["input_ids"])) >= p).long()} for d, p in zip(data, prompt)]
    by_length = [{**d, "prompt_length": torch.tensor(p)} for d, p in zip(data, prompt)]
    ref = torch.cat([oracle(model, layers, [d], lambda lg, s, p=p: next_token_nll(lg, s, start=p))
                     for d, p in zip(data, prompt)])
    close(dense(ga.grads(ga.tasks.causal_lm(model), by_labels, layers=layers, batch_size=3), layers), ref)
    for variant in (by_mask, by_length):
        task = ga.tasks.causal_lm(model, completion_only=True)
        close(dense(ga.grads(task, variant, layers=layers, batch_size=3), layers), ref)
    with pytest.raises(ga.BatchContentError, match="completion_mask"):
        ga.grads(ga.tasks.causal_lm(model, completion_only=True), data, layers=layers).to_dense()


def test_rows_that_cannot_count_are_refused_with_their_ids():
    model, layers = gpt2()
    data = items(4)
    empty_mask = [dict(d) for d in data]
    empty_mask[2] = {**data[2], "attention_mask": torch.zeros_like(data[2]["attention_mask"])}
    with pytest.raises(ga.BatchContentError, match=r"example ids \['c'\].*no real token"):
        ga.grads(ga.tasks.causal_lm(model), empty_mask, layers=layers, ids=list("abcd")).to_dense()
    no_labels = [{**d, "labels": d["input_ids"]} for d in data]
    no_labels[1] = {**data[1], "labels": torch.full_like(data[1]["input_ids"], -100)}
    no_labels[3] = {k: v[:1] for k, v in no_labels[3].items()}
    with pytest.raises(ga.BatchContentError, match=r"example ids \['b', 'd'\].*no label that counts"):
        ga.grads(ga.tasks.causal_lm(model), no_labels, layers=layers, ids=list("abcd")).to_dense()
    with pytest.raises(ga.BatchContentError, match=r"different fields: \['labels'\]"):
        ga.grads(ga.tasks.causal_lm(model), data[:2] + no_labels[2:], layers=layers).to_dense()
    holes = ga.collate.pad_collate(data)
    holes["attention_mask"][0, 1] = 0
    with pytest.raises(ga.BatchContentError, match="padding inside"):
        ga.grads(ga.tasks.causal_lm(model), holes, layers=layers).to_dense()
    with pytest.raises(ga.BatchContentError, match="no 'input_ids' field"):
        ga.grads(ga.tasks.causal_lm(model), [{"ids": d["input_ids"]} for d in data], layers=layers).to_dense()


def test_hf_dataset_and_dict_batches_give_the_list_gradients():
    datasets = pytest.importorskip("datasets")
    model, layers = gpt2()
    data = items()
    ds = datasets.Dataset.from_dict({k: [d[k].tolist() for d in data] for k in data[0]}).with_format("torch")
    task = ga.tasks.causal_lm(model)
    ref = dense(ga.grads(task, data, layers=layers, batch_size=6), layers)
    close(dense(ga.grads(task, ds, layers=layers, batch_size=4), layers), ref)
    close(dense(ga.grads(task, ga.collate.pad_collate(data), layers=layers, batch_size=2), layers), ref)


def test_output_and_per_token_trak_weights():
    """f = Σ_t log p_t/(1-p_t); Σ_t (1-p_t) ∇f_t = ∇ Σ_t log p_t = -∇L exactly."""
    model, layers = llama()
    data = items()
    task = ga.tasks.causal_lm(model, trak_output="token")

    def margin(logits, seq):
        logp = torch.log_softmax(logits[:-1], -1)
        y = seq["input_ids"][1:]
        p = logp.gather(1, y[:, None]).squeeze(1).exp()
        return (torch.log(p) - torch.log1p(-p)).sum()

    def sequence_margin(logits, seq):          # p = Π_t p_t: the sequence as one class
        log_p = -next_token_nll(logits, seq)
        return log_p - torch.log(-torch.expm1(log_p))

    minus_loss = -oracle(model, layers, data, next_token_nll)
    close(dense(ga.grads(task, data, layers=layers, objective="output", batch_size=4), layers),
          oracle(model, layers, data, margin))
    close(dense(ga.grads(task, data, layers=layers, objective="weighted_output", batch_size=4), layers), minus_loss)
    task = ga.tasks.causal_lm(model)            # default: trak_output="sequence"
    close(dense(ga.grads(task, data, layers=layers, objective="output", batch_size=4), layers),
          oracle(model, layers, data, sequence_margin))
    close(dense(ga.grads(task, data, layers=layers, objective="weighted_output", batch_size=4), layers), minus_loss)


def test_sampled_labels_follow_the_example_not_the_batch():
    model, layers = gpt2()
    data = items()
    ids = [100 + i for i in range(len(data))]
    task = ga.tasks.causal_lm(model)

    def sampled_nll(i):
        def fn(logits, seq):
            probs = torch.softmax(logits[:-1].detach(), -1)
            u = ExampleRandom(3, (ids[i],)).uniform_ragged([len(seq["input_ids"]) - 1])[0]
            cdf = probs.cumsum(-1)
            y = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp_max(VOCAB - 1)
            return F.cross_entropy(logits[:-1], y, reduction="sum")
        return fn

    ref = torch.cat([oracle(model, layers, [d], sampled_nll(i)) for i, d in enumerate(data)])
    for bs in (6, 4, 1):
        G = ga.grads(task, data, layers=layers, objective="sampled", seed=3, ids=ids, batch_size=bs)
        close(dense(G, layers), ref)
    assert task.curvature_objective == "sampled"
    assert ga.tasks.causal_lm(model, n_samples=4).curvature_objective == "expected"


def test_trak_and_influence_scores_match_dense_references():
    model, _ = gpt2()
    layers = ["transformer.h.0.attn.c_proj", "transformer.h.1.mlp.c_proj"]    # 1,312 coordinates: dense kernels
    train, queries = items(6), items(3, lengths=(6, 4, 8), seed=5)
    task = ga.tasks.causal_lm(model, trak_output="token")

    def margin(logits, seq):
        logp = torch.log_softmax(logits[:-1], -1)
        y = seq["input_ids"][1:]
        correct = logp.gather(1, y[:, None]).squeeze(1)
        others = logp.scatter(1, y[:, None], float("-inf")).logsumexp(1)
        return (correct - others).sum()

    G, Q = oracle(model, layers, train, next_token_nll), oracle(model, layers, queries, next_token_nll)
    Phi, phi = oracle(model, layers, train, margin), oracle(model, layers, queries, margin)
    eye = torch.eye(G.shape[1], dtype=F64)
    lam = 1e-2
    S = ga.methods.trak(task, train, queries, layers=layers, projector=lambda X: X, damping=lam).compute()
    ref = phi @ torch.linalg.solve(Phi.T @ Phi + lam * eye, -G.T)     # Q per token: ΦᵀQ = -∇L
    close(torch.as_tensor(S.values), ref, 1e-7)
    S = ga.methods.trak(task, train, queries, layers=layers, projector=lambda X: X, damping=None).compute()  # relative λ
    K = Phi.T @ Phi
    relative = importlib.import_module("gradalg.methods.trak").RELATIVE_DAMPING
    ref = phi @ torch.linalg.solve(K + relative * float(torch.trace(K)) / K.shape[0] * eye, -G.T)
    close(torch.as_tensor(S.values), ref, 1e-7)
    S = ga.methods.influence(task, train, queries, layers=layers, curvature="empirical", damping=lam).compute()
    ref = Q @ torch.linalg.solve(G.T @ G / len(train) + lam * eye, G.T)
    close(torch.as_tensor(S.values), ref, 1e-7)


@pytest.mark.parametrize("arch", MODELS)
def test_methods_run_on_dict_items_without_glue(arch):
    model, layers = MODELS[arch]()
    train, queries = items(6), items(2, lengths=(5, 7), seed=4)
    task = ga.tasks.causal_lm(model)
    out = {"ekfac": ga.methods.influence(task, train, queries, layers=layers, curvature="ekfac"),
           "logra": ga.methods.logra(task, train, queries, layers=layers, k=16),
           "trak": ga.methods.trak(task, train, queries, layers=layers, k=32)}
    for name, S in out.items():
        values = S.compute().values
        assert values.shape == (2, 6) and all(map(math.isfinite, values.flatten())), name
    assert "sampled" in str(out["ekfac"].explain(stage="logical"))   # the curvature's objective is shown


def test_masked_lm_seq2seq_and_sequence_classification_match_oracles():
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2ForSequenceClassification,
                              T5Config, T5ForConditionalGeneration)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    lengths = (5, 8, 3, 6)

    bert = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=24, max_position_embeddings=16,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).to(F64).eval()
    data = []
    for L in lengths:
        ids = torch.randint(1, VOCAB, (L,), generator=g)
        labels = torch.full((L,), -100)
        labels[torch.randint(0, L, (2,), generator=g)] = ids[torch.randint(0, L, (2,), generator=g)]
        data.append({"input_ids": ids, "attention_mask": torch.ones(L, dtype=torch.long), "labels": labels})
    layers = ["bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.output.dense"]
    G = ga.grads(ga.tasks.masked_lm(bert), data, layers=layers, batch_size=3)
    close(dense(G, layers), oracle(bert, layers, data, lambda lg, s: F.cross_entropy(lg, s["labels"], reduction="sum")))

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=24, num_layers=1,
                                             num_heads=2, dropout_rate=0.0, decoder_start_token_id=0,
                                             pad_token_id=0)).to(F64).eval()
    data = [{"input_ids": torch.randint(1, VOCAB, (L,), generator=g), "attention_mask": torch.ones(L, dtype=torch.long),
             "labels": torch.randint(1, VOCAB, (L % 4 + 2,), generator=g)} for L in lengths]
    layers = ["encoder.block.0.layer.0.SelfAttention.q", "decoder.block.0.layer.1.EncDecAttention.v",
              "decoder.block.0.layer.2.DenseReluDense.wo"]

    def t5_oracle(seqs):
        modules = dict(t5.named_modules())
        names = [f"{l}.weight" for l in layers]
        params = dict(t5.named_parameters())
        rows = []
        for s in seqs:
            logits = t5(input_ids=s["input_ids"][None], labels=s["labels"][None]).logits[0]
            loss = F.cross_entropy(logits, s["labels"], reduction="sum")
            grads = torch.autograd.grad(loss, [params[n] for n in names])
            rows.append(block_rows(t5, layers, {n: x[None] for n, x in zip(names, grads)}))
            assert modules
        return torch.cat(rows)

    G = ga.grads(ga.tasks.seq2seq(t5), data, layers=layers, batch_size=4)
    close(dense(G, layers), t5_oracle(data))

    clf = GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                                                   num_labels=3, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0)).to(F64).eval()
    data = [{"input_ids": torch.randint(1, VOCAB, (L,), generator=g), "attention_mask": torch.ones(L, dtype=torch.long),
             "labels": torch.tensor(i % 3)} for i, L in enumerate(lengths)]
    layers = ["transformer.h.0.mlp.c_fc", "score"]

    def clf_loss(seqs):
        modules = dict(clf.named_modules())
        names = [f"{l}.{p}" for l in layers for p, _ in modules[l].named_parameters(recurse=False)]
        params = dict(clf.named_parameters())
        rows = []
        for s in seqs:
            loss = F.cross_entropy(clf(input_ids=s["input_ids"][None]).logits, s["labels"][None], reduction="sum")
            grads = torch.autograd.grad(loss, [params[n] for n in names])
            rows.append(block_rows(clf, layers, {n: x[None] for n, x in zip(names, grads)}))
        return torch.cat(rows)

    G = ga.grads(ga.tasks.sequence_classification(clf), data, layers=layers, batch_size=4)
    close(dense(G, layers), clf_loss(data))
    with pytest.raises(ga.BatchContentError, match="'labels'"):
        ga.grads(ga.tasks.sequence_classification(clf), [{k: v for k, v in d.items() if k != "labels"} for d in data],
                 layers=layers).to_dense()


def test_items_without_an_attention_mask_get_one_when_padded():
    """Padding without a mask would be read as tokens: gradients would depend on the batch."""
    model, layers = gpt2()
    data = [{"input_ids": d["input_ids"]} for d in items()]
    batch = ga.collate.pad_collate(data[:3])
    lengths = [len(d["input_ids"]) for d in data[:3]]
    assert batch["attention_mask"].tolist() == [[1] * n + [0] * (max(lengths) - n) for n in lengths]
    assert "attention_mask" not in ga.collate.pad_collate([data[0], data[0]])   # nothing padded
    task = ga.tasks.causal_lm(model)
    close(dense(ga.grads(task, data, layers=layers, batch_size=4), layers),
          oracle(model, layers, data, next_token_nll))


@pytest.mark.parametrize("arch", MODELS)
def test_left_padded_sequences_have_their_unpadded_loss(arch):
    """Under left padding the last pad position must not 'predict' the first real token: each
    sequence's loss (what TRAK's margins and the output objectives read) equals its loss alone."""
    model, _ = MODELS[arch]()
    data = items(4)
    T = max(len(d["input_ids"]) for d in data)
    left = {"input_ids": torch.stack([F.pad(d["input_ids"], (T - len(d["input_ids"]), 0)) for d in data]),
            "attention_mask": torch.stack([F.pad(d["attention_mask"], (T - len(d["input_ids"]), 0)) for d in data])}
    task = ga.tasks.causal_lm(model, padding_side="left")
    with torch.no_grad():
        batched = float(task.summed_loss(model, left))
        alone = sum(float(next_token_nll(model(input_ids=d["input_ids"][None]).logits[0], d)) for d in data)
    assert math.isclose(batched, alone, rel_tol=1e-5), (batched, alone)


@pytest.mark.parametrize("arch", MODELS)
def test_the_meta_shape_measurement_runs_on_a_causal_lm_and_the_batch_is_still_checked(arch):
    """The planner's shape measurement runs the task's loss on meta copies of a batch: the
    token checks skip their value checks there (no ``.item()`` on meta) and keep the shape
    checks, so every layer's positions are measured; the real batch is still refused."""
    from gradalg.plan.shapes import measure_forward_shapes
    from gradalg.tasks.validation import token_batch
    model, layers = MODELS[arch]()
    meta = {"input_ids": torch.empty(2, 7, dtype=torch.long, device="meta"),
            "attention_mask": torch.empty(2, 7, dtype=torch.long, device="meta")}
    assert token_batch(meta, "causal_lm", model, labels="causal")["input_ids"].is_meta
    with pytest.raises(ga.errors.BatchContentError, match="shape"):
        token_batch({**meta, "attention_mask": torch.empty(2, 6, device="meta")}, "causal_lm", model)
    data = items()
    shapes = measure_forward_shapes(ga.grads(ga.tasks.causal_lm(model), data, layers=layers).expr.source)
    assert shapes.measured and shapes.activations > 0
    assert shapes.positions == {name: 5 for name in layers}       # the first example's 5 tokens
    bad = [{**data[0], "input_ids": data[0]["input_ids"].clone().fill_(VOCAB + 1)}]
    with pytest.raises(ga.errors.BatchContentError, match="vocabulary"):
        ga.grads(ga.tasks.causal_lm(model), bad, layers=layers).to_dense()


@pytest.mark.parametrize("arch", MODELS)
def test_a_left_padding_task_pads_a_list_of_items_on_the_left(arch):
    """``padding_side="left"`` with a list of items of unequal length: gradalg's own loader
    pads them on the task's side (before, it right-padded them and then refused its own
    batch), with completion-only counting by ``prompt_length``, against each sequence alone."""
    model, layers = MODELS[arch]()
    data = [{**d, "prompt_length": torch.tensor(p)} for d, p in zip(items(), (2, 3, 1, 4, 2, 1))]
    data = [{k: v for k, v in d.items() if k != "attention_mask"} for d in data]    # the collate adds it
    batch = ga.collate.left_pad_collate(data[:3])
    lengths = [len(d["input_ids"]) for d in data[:3]]
    assert batch["attention_mask"].tolist() == [[0] * (max(lengths) - n) + [1] * n for n in lengths]
    assert batch["input_ids"][0, -lengths[0]:].tolist() == data[0]["input_ids"].tolist()
    task = ga.tasks.causal_lm(model, padding_side="left", completion_only=True)
    assert task.collate_fn is ga.collate.left_pad_collate
    G = ga.grads(task, data, layers=layers, batch_size=4)                 # padded to 9 and to 6
    close(dense(G, layers), oracle(model, layers, data, lambda lg, s: next_token_nll(lg, s, int(s["prompt_length"]))))
    S = ga.methods.grad_dot(task, data, data[:2], layers=layers).compute()
    ref = oracle(model, layers, data, lambda lg, s: next_token_nll(lg, s, int(s["prompt_length"])))
    close(torch.as_tensor(S.values).to(F64), ref[:2] @ ref.T)
    from gradalg.data import as_data
    close(dense(ga.grads(task, as_data(data, batch_size=4), layers=layers), layers), dense(G, layers))   # a DataRef the CLI made
    loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=ga.collate.pad_collate)   # its own collate wins
    with pytest.raises(ga.BatchContentError, match="right-padded"):
        ga.grads(task, loader, layers=layers).to_dense()


def test_a_left_padding_sequence_classifier_pads_a_list_of_items_on_the_left():
    from transformers import GPT2Config, GPT2ForSequenceClassification
    torch.manual_seed(0)
    clf = GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32,
                                                   num_labels=3, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0)).to(F64).eval()
    data = [{**d, "labels": torch.tensor(i % 3)} for i, d in enumerate(items())]
    layers = ["transformer.h.0.mlp.c_fc", "score"]
    right = dense(ga.grads(ga.tasks.sequence_classification(clf), data, layers=layers, batch_size=4), layers)
    task = ga.tasks.sequence_classification(clf, padding_side="left")
    assert task.collate_fn is ga.collate.left_pad_collate
    close(dense(ga.grads(task, data, layers=layers, batch_size=4), layers), right)


@pytest.mark.parametrize("arch", MODELS)
def test_a_model_with_a_tied_head_is_measured_on_meta_like_its_untied_twin(arch):
    """A tied embedding and head (GPT2Config's default, Llama's ``tie_word_embeddings``) is one
    tensor under two names in ``state_dict``; the meta forward's state named it twice, which
    ``functional_call`` refuses, and every tied model was planned on ``tokens_hint`` (its
    shapes 'not measured', the products job on guesses): it is measured as its untied twin is."""
    from gradalg.plan.shapes import measure_forward_shapes
    untied, layers = MODELS[arch]()
    untied.config.tie_word_embeddings = True
    tied = type(untied)(untied.config).to(F64).eval()
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    shapes = {}
    for name, model in (("untied", MODELS[arch]()[0]), ("tied", tied)):
        src = ga.grads(ga.tasks.causal_lm(model), items(), layers=layers).expr.source
        shapes[name] = measure_forward_shapes(src)
    assert shapes["tied"].measured and shapes["untied"].measured
    assert shapes["tied"].positions == shapes["untied"].positions == {name: 5 for name in layers}
    assert shapes["tied"].activations == shapes["untied"].activations > 0
