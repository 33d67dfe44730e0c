"""Small transformers models of many architectures (random init, float64) and the
loop-of-backward oracle for the zoo tests.

Each entry builds ``(model, task, data, unpad)``: ``data`` is a tuple of right-padded
tensors, ``unpad(data, i)`` the i-th example alone, without padding, as a batch of one.
The losses are written here (sum over examples of the summed token cross-entropy over
unmasked, shifted labels), independent of ``ga.tasks``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import gradalg as ga

VOCAB = 61
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)


def padded_tokens(n=5, min_len=3, max_len=8, seed=3, vocab=VOCAB):
    """(input_ids, attention_mask), variable lengths right-padded (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    lengths[0] = max_len
    ids = torch.randint(1, vocab, (n, max_len), generator=g)
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    return ids.masked_fill(~mask, 0), mask.long()


def causal_lm_loss(model, batch):
    """Σ_sequences Σ_tokens CE(logits_t, ids_{t+1}) over unmasked next tokens."""
    ids, mask = batch[:2]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum",
                           ignore_index=-100)


def masked_lm_loss(model, batch):
    """Σ CE over the positions whose label is not -100 (BERT's masked-LM objective)."""
    ids, mask, labels = batch
    logits = model(input_ids=ids, attention_mask=mask).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum",
                           ignore_index=-100)


def seq2seq_loss(model, batch):
    """Σ CE of the decoder's predictions of the labels (teacher forcing; -100 ignored)."""
    ids, mask, dec_ids, dec_mask, labels = batch
    logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec_ids,
                   decoder_attention_mask=dec_mask).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum",
                           ignore_index=-100)


def _unpad_lm(data, i):
    L = int(data[1][i].sum())
    return tuple(t[i:i + 1, :L] for t in data)


def _unpad_seq2seq(data, i):
    ids, mask, dec_ids, dec_mask, labels = data
    L, M = int(mask[i].sum()), int(dec_mask[i].sum())
    return ids[i:i + 1, :L], mask[i:i + 1, :L], dec_ids[i:i + 1, :M], dec_mask[i:i + 1, :M], labels[i:i + 1, :M]


def _causal(config_cls, model_cls, **extra):
    def build():
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**SMALL, **extra})).double().eval()
        task = ga.Task(model, causal_lm_loss, token_mask=lambda b: b[1].bool())
        return model, task, padded_tokens(), _unpad_lm
    return build


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
    model = GPT2LMHeadModel(config).double().eval()
    return model, ga.Task(model, causal_lm_loss, token_mask=lambda b: b[1].bool()), padded_tokens(), _unpad_lm


def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return _causal(GPTNeoXConfig, GPTNeoXForCausalLM, rotary_pct=0.5)()


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return _causal(LlamaConfig, LlamaForCausalLM, num_key_value_heads=2)()


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _causal(Qwen2Config, Qwen2ForCausalLM, num_key_value_heads=1)()       # GQA: 4 heads, 1 kv


def mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return _causal(MistralConfig, MistralForCausalLM, num_key_value_heads=2, sliding_window=4)()


def gemma():
    from transformers import GemmaConfig, GemmaForCausalLM
    return _causal(GemmaConfig, GemmaForCausalLM, num_key_value_heads=2, head_dim=8)()


def phi3():
    from transformers import Phi3Config, Phi3ForCausalLM
    return _causal(Phi3Config, Phi3ForCausalLM, num_key_value_heads=2, pad_token_id=0)()


def olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM
    return _causal(Olmo2Config, Olmo2ForCausalLM, num_key_value_heads=2)()


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return _causal(MixtralConfig, MixtralForCausalLM, num_key_value_heads=2, num_local_experts=4,
                   num_experts_per_tok=2, experts_implementation="eager")()


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return _causal(Qwen2MoeConfig, Qwen2MoeForCausalLM, num_key_value_heads=2, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                   decoder_sparse_step=1, experts_implementation="eager")()


def bert():
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(config).double().eval()
    ids, mask = padded_tokens()
    g = torch.Generator().manual_seed(5)
    chosen = (torch.rand(ids.shape, generator=g) < 0.4) & mask.bool()
    chosen[:, 0] = True
    labels = ids.masked_fill(~chosen, -100)
    ids = ids.masked_fill(chosen, 1)                     # id 1 plays [MASK]
    return model, ga.Task(model, masked_lm_loss, token_mask=lambda b: b[1].bool()), (ids, mask, labels), _unpad_lm


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    config = T5Config(d_model=32, d_ff=48, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
                      vocab_size=VOCAB, dropout_rate=0.0, tie_word_embeddings=False,
                      decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config).double().eval()
    # untie the encoder's and decoder's embeddings from `shared` (tied weights are tested
    # elsewhere): each is then its own parameter, and `shared` is not called
    for stack in (model.encoder, model.decoder):
        stack.embed_tokens.weight = torch.nn.Parameter(stack.embed_tokens.weight.detach().clone())
    ids, mask = padded_tokens(max_len=8)
    labels, dec_mask = padded_tokens(max_len=6, seed=9)
    dec_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], 1)   # shifted right
    labels = labels.masked_fill(dec_mask == 0, -100)
    # no token mask: the encoder's and decoder's T differ (padding gets no gradient anyway)
    return model, ga.Task(model, seq2seq_loss), (ids, mask, dec_ids, dec_mask, labels), _unpad_seq2seq


ZOO = {"gpt2": gpt2, "llama": llama, "qwen2": qwen2, "mistral": mistral, "gemma": gemma, "phi3": phi3,
       "gpt_neox": gpt_neox, "olmo2": olmo2, "bert": bert, "t5": t5, "mixtral": mixtral,
       "qwen2_moe": qwen2_moe}


def loop_oracle(task, data, unpad, params: list[str]) -> dict[str, torch.Tensor]:
    """Each example alone and unpadded: ``torch.autograd.grad`` of its loss on ``params``."""
    model = task.model
    tensors = [model.get_parameter(n) for n in params]
    rows = []
    for i in range(data[0].shape[0]):
        loss = task.loss(model, unpad(data, i))
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, tensors)])
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(params)}


def worst_relative_error(captured: dict, reference: dict) -> tuple[float, str]:
    """Worst over modules of ‖captured − reference‖_∞ / ‖reference‖_∞, each module's
    parameters and examples together (a parameter whose gradient is zero in exact
    arithmetic, BERT's key bias, is measured against its module's scale)."""
    modules: dict[str, list[str]] = {}
    for name in reference:
        modules.setdefault(name.rsplit(".", 1)[0], []).append(name)
    worst, where = 0.0, ""
    for module, names in modules.items():
        scale = max(reference[n].abs().max().item() for n in names)
        err = max((captured[n] - reference[n]).abs().max().item() for n in names) / (scale or 1.0)
        if err > worst or not where:
            worst, where = err, module
    return worst, where


# ------------------------------------------------------------------ stock checkpoints
# Each architecture as a released checkpoint is built: its config class's defaults (tied
# embeddings and head where the architecture ties them), small sizes, dropout off, and the
# ga.tasks task its head takes. Items are dicts of unpadded tensors of unequal lengths.
STOCK_TASKS = {"bert": "masked_lm", "t5": "seq2seq", "bart": "seq2seq"}


def stock(arch: str):
    """``(model, task)`` of ``arch`` at its config's defaults (tied weights kept), float64."""
    import transformers as tf
    torch.manual_seed(0)
    small = {k: v for k, v in SMALL.items() if k != "tie_word_embeddings"}
    if arch == "gpt2":
        config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(config)
    elif arch == "bert":
        config = tf.BertConfig(**small, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = tf.BertForMaskedLM(config)
    elif arch == "t5":
        config = tf.T5Config(d_model=32, d_ff=48, d_kv=8, num_layers=2, num_heads=4, vocab_size=VOCAB,
                             dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
        model = tf.T5ForConditionalGeneration(config)
    elif arch == "bart":
        config = tf.BartConfig(d_model=32, encoder_ffn_dim=48, decoder_ffn_dim=48, encoder_layers=2,
                               decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                               vocab_size=VOCAB, max_position_embeddings=64, dropout=0.0,
                               attention_dropout=0.0, activation_dropout=0.0)
        model = tf.BartForConditionalGeneration(config)
    else:
        extra = {"gpt_neox": dict(rotary_pct=0.5), "llama": dict(num_key_value_heads=2),
                 "qwen2": dict(num_key_value_heads=1), "mistral": dict(num_key_value_heads=2, sliding_window=4),
                 "gemma": dict(num_key_value_heads=2, head_dim=8), "phi3": dict(num_key_value_heads=2, pad_token_id=0),
                 "olmo2": dict(num_key_value_heads=2),
                 "mixtral": dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                 experts_implementation="eager"),
                 "qwen2_moe": dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                   decoder_sparse_step=1, experts_implementation="eager")}[arch]
        names = {"gpt_neox": "GPTNeoX", "llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral",
                 "gemma": "Gemma", "phi3": "Phi3", "olmo2": "Olmo2", "mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe"}
        config = getattr(tf, names[arch] + "Config")(**small, **extra)
        model = getattr(tf, names[arch] + "ForCausalLM")(config)
    model = model.double().eval()
    kind = STOCK_TASKS.get(arch, "causal_lm")
    return model, getattr(ga.tasks, kind)(model)


def stock_items(arch: str, n: int = 3) -> list[dict]:
    """``n`` unpadded dict items of unequal lengths for ``arch``'s task."""
    g = torch.Generator().manual_seed(11)
    kind = STOCK_TASKS.get(arch, "causal_lm")
    items = []
    for i, length in enumerate((6, 4, 5, 7)[:n]):
        ids = torch.randint(3, VOCAB, (length,), generator=g)
        if kind == "masked_lm":
            labels = torch.full_like(ids, -100)
            labels[:: 2] = ids[:: 2]
            items.append({"input_ids": ids.masked_fill(labels != -100, 2), "labels": labels})
        elif kind == "seq2seq":
            items.append({"input_ids": ids, "labels": torch.randint(3, VOCAB, (2 + i,), generator=g)})
        else:
            items.append({"input_ids": ids})
    return items


def stock_loss(model, item: dict, kind: str) -> torch.Tensor:
    """One item's summed token cross-entropy, written from the HF call (independent of ga.tasks)."""
    batch = {k: v[None] for k, v in item.items()}
    if kind == "causal_lm":
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
        targets = batch["input_ids"][:, 1:]
    elif kind == "masked_lm":
        logits, targets = model(input_ids=batch["input_ids"]).logits, batch["labels"]
    else:
        labels = batch["labels"]
        dec = model.prepare_decoder_input_ids_from_labels(labels=labels)
        logits, targets = model(input_ids=batch["input_ids"], decoder_input_ids=dec).logits, labels
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum",
                           ignore_index=-100)


def stock_oracle(model, items, kind, params: list[str]) -> dict[str, torch.Tensor]:
    """Each item alone: ``torch.autograd.grad`` of :func:`stock_loss` on ``params``."""
    tensors = [model.get_parameter(n) for n in params]
    rows = []
    for item in items:
        grads = torch.autograd.grad(stock_loss(model, item, kind), tensors, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, tensors)])
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(params)}
