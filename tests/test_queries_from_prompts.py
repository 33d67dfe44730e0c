"""ga.tasks.queries_from_prompts / causal_lm(...).queries_from_prompts: generations as queries.

The query gradient is checked against a loop of backward passes of the completion tokens'
loss alone (written here without the task); generated completions against
``model.generate``; the chat-template path against ``tokenizer.apply_chat_template``."""
import pytest
import torch
import torch.nn.functional as F

import gradalg as ga
from gradalg.errors import DataError, GradalgError, OptionError

from models import gpt2

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CORPUS = ["the cat sat on the mat", "a dog ran in the park", "the bird sang a song",
          "what did the cat do", "where did the dog run", "user: assistant: system:"]
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
LAYERS = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"]
PROMPTS = ["the cat sat", "where did the dog", "a bird"]


def tiny_tokenizer():
    """A byte-level-free BPE trained on a few strings (nothing downloaded), vocabulary < 101."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=90, special_tokens=specials))
    assert tok.get_vocab_size() <= 101
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT
    return fast


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return gpt2(seed=4)


def completion_loss_rows(model, items, layers) -> torch.Tensor:
    """Loop of backward: for each item, ∇ Σ_{t ∈ completion} −log p(x_t | x_<t), the
    parameters of ``layers`` flattened in named_parameters order.   (n, D)"""
    params = [(n, p) for n, p in model.named_parameters() if any(n.startswith(l + ".") for l in layers)]
    rows = []
    for item in items:
        ids, keep = item["input_ids"], item["completion_mask"].bool()
        model.zero_grad()
        logits = model(input_ids=ids[None]).logits[0]
        pos = torch.nonzero(keep).flatten()                    # completion positions t ≥ 1
        F.cross_entropy(logits[pos - 1], ids[pos], reduction="sum").backward()
        rows.append(torch.cat([p.grad.flatten() for _, p in params]).clone())
    model.zero_grad()
    return torch.stack(rows), [n for n, _ in params]


def grad_rows(task, items, names) -> torch.Tensor:
    grads = ga.grads(task, items, layers=LAYERS).to_params()
    return torch.cat([grads[n].flatten(1) for n in names], dim=1)


def test_generated_completions_are_model_generate(model, tok):
    task = ga.tasks.causal_lm(model)
    items = task.queries_from_prompts(PROMPTS, tokenizer=tok, max_new_tokens=6)
    assert len(items) == len(PROMPTS)
    for prompt, item in zip(PROMPTS, items):
        head = tok(prompt, return_tensors="pt")["input_ids"]
        ref = model.generate(input_ids=head, attention_mask=torch.ones_like(head), max_new_tokens=6,
                             do_sample=False, pad_token_id=tok.pad_token_id)[0]
        assert torch.equal(item["input_ids"], ref)
        m = head.shape[1]
        assert item["completion_mask"].tolist() == [0] * m + [1] * (len(ref) - m)
        assert (item["labels"][:m] == -100).all() and torch.equal(item["labels"][m:], ref[m:])
        assert item["attention_mask"].sum() == len(ref)
    # the function and the method agree; sampling through generate= is seeded
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in
               zip(items, ga.tasks.queries_from_prompts(task, PROMPTS, tokenizer=tok, max_new_tokens=6)))
    sampled = [task.queries_from_prompts(PROMPTS, tokenizer=tok, max_new_tokens=6, seed=3,
                                         generate={"do_sample": True, "top_k": 20}) for _ in range(2)]
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(*sampled))
    head = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    torch.manual_seed(3)
    ref = model.generate(input_ids=head, attention_mask=torch.ones_like(head), max_new_tokens=6,
                         do_sample=True, top_k=20, pad_token_id=tok.pad_token_id)[0]
    assert torch.equal(sampled[0][0]["input_ids"], ref)


@pytest.mark.parametrize("completion_only", [False, True])
def test_query_gradient_counts_completion_tokens_only(model, tok, completion_only):
    task = ga.tasks.causal_lm(model, completion_only=completion_only)
    generated = task.queries_from_prompts(PROMPTS, tokenizer=tok, max_new_tokens=4)
    given = task.queries_from_prompts(PROMPTS, ["on the mat", "run", "sang a song"], tokenizer=tok)
    for items in (generated, given):
        ref, names = completion_loss_rows(model, items, LAYERS)
        got = grad_rows(task, items, names)
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-11)
        # the prompt counts for nothing: the full-sequence loss gives another gradient
        full = [{"input_ids": it["input_ids"], "attention_mask": it["attention_mask"]} for it in items]
        assert not torch.allclose(grad_rows(ga.tasks.causal_lm(model), full, names), ref)


def test_given_completion_appended_to_prompt_tokens(model, tok):
    item = ga.tasks.queries_from_prompts(model, ["the cat"], ["sat on the mat"], tokenizer=tok)[0]
    head = tok("the cat")["input_ids"]
    tail = tok("sat on the mat", add_special_tokens=False)["input_ids"]
    assert item["input_ids"].tolist() == head + tail
    assert item["completion_mask"].tolist() == [0] * len(head) + [1] * len(tail)


def test_chat_template(model, tok):
    task = ga.tasks.causal_lm(model)
    items = task.queries_from_prompts(["where did the dog run"], ["in the park"], tokenizer=tok,
                                      chat_template=True, system="a cat")
    text = tok.apply_chat_template([{"role": "system", "content": "a cat"},
                                    {"role": "user", "content": "where did the dog run"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|assistant|>")
    head = tok(text, add_special_tokens=False)["input_ids"]
    assert head[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    tail = tok("in the park", add_special_tokens=False)["input_ids"]
    assert items[0]["input_ids"].tolist() == head + tail
    assert items[0]["completion_mask"].tolist() == [0] * len(head) + [1] * len(tail)
    # message lists, and generation after the template
    messages = [[{"role": "user", "content": "the cat sat"}]]
    gen = task.queries_from_prompts(messages, tokenizer=tok, chat_template=True, max_new_tokens=3)[0]
    head = tok(tok.apply_chat_template(messages[0], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False, return_tensors="pt")["input_ids"]
    ref = model.generate(input_ids=head, attention_mask=torch.ones_like(head), max_new_tokens=3,
                         do_sample=False, pad_token_id=tok.pad_token_id)[0]
    assert torch.equal(gen["input_ids"], ref)
    ref_rows, names = completion_loss_rows(model, [gen], LAYERS)
    torch.testing.assert_close(grad_rows(task, [gen], names), ref_rows, rtol=1e-9, atol=1e-11)


class NoGenerate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("call, error, fix", [
    (lambda t, m, tok: t.queries_from_prompts(["the cat", ""], tokenizer=tok), DataError, "prompt 1 is empty"),
    (lambda t, m, tok: t.queries_from_prompts(["  "], ["x"], tokenizer=tok), DataError, "drop it"),
    (lambda t, m, tok: t.queries_from_prompts([], tokenizer=tok), DataError, "one or more prompts"),
    (lambda t, m, tok: t.queries_from_prompts("the cat", tokenizer=tok), DataError, "[prompt]"),
    (lambda t, m, tok: t.queries_from_prompts(["the cat", "a dog"], ["sat"], tokenizer=tok), DataError,
     "one completion per prompt"),
    (lambda t, m, tok: t.queries_from_prompts(["the cat"], [""], tokenizer=tok), DataError,
     "non-empty completion"),
    (lambda t, m, tok: ga.tasks.queries_from_prompts(ga.Task(NoGenerate(), lambda m, b: m.lin.weight.sum()),
                                                     ["the cat"], tokenizer=tok), OptionError,
     "pass completions=[...]"),
    (lambda t, m, tok: t.queries_from_prompts(["the cat"], tokenizer=tok, max_new_tokens=0), OptionError,
     "positive int"),
    (lambda t, m, tok: t.queries_from_prompts(["the cat"], ["sat"], tokenizer=tok, system="s"), OptionError,
     "chat_template=True"),
])
def test_bad_input_names_the_fix(model, tok, call, error, fix):
    with pytest.raises(error) as info:
        call(ga.tasks.causal_lm(model), model, tok)
    assert isinstance(info.value, GradalgError) and fix in str(info.value)


def test_tokenizer_without_chat_template(model):
    plain = tiny_tokenizer()
    plain.chat_template = None
    with pytest.raises(OptionError, match="no chat template"):
        ga.tasks.causal_lm(model).queries_from_prompts(["the cat"], ["sat"], tokenizer=plain, chat_template=True)


def test_model_kept_in_its_mode_and_rng_untouched(tok):
    m = gpt2(seed=4)
    m.train()
    state = torch.random.get_rng_state()
    ga.tasks.causal_lm(m).queries_from_prompts(["the cat"], tokenizer=tok, max_new_tokens=2,
                                               generate={"do_sample": True})
    assert m.training and torch.equal(state, torch.random.get_rng_state())


def test_scores_of_training_documents_for_a_generation(model, tok):
    """A method's scores with generated queries: ∇L(completion | prompt) · ∇L(document)."""
    task = ga.tasks.causal_lm(model)
    queries = task.queries_from_prompts(PROMPTS[:2], tokenizer=tok, max_new_tokens=3)
    train = [{"input_ids": torch.tensor(tok(text)["input_ids"]),
              "attention_mask": torch.ones(len(tok(text)["input_ids"]), dtype=torch.long)} for text in CORPUS[:5]]
    S = ga.methods.grad_dot(task, train, queries, layers=LAYERS).compute()
    Q, _ = completion_loss_rows(model, queries, LAYERS)
    every_target = [dict(item, completion_mask=(torch.arange(len(item["input_ids"])) > 0).long()) for item in train]
    G, _ = completion_loss_rows(model, every_target, LAYERS)
    scores = torch.as_tensor(S.values)
    assert scores.shape == (2, 5)
    torch.testing.assert_close(scores, Q @ G.T, rtol=1e-8, atol=1e-10)


def test_prompt_keeps_bos_but_not_an_appended_eos(model):
    """A tokenizer that wraps text as <bos> … <eos>: the prompt ends with its text, not EOS."""
    from tokenizers.processors import TemplateProcessing

    tok = tiny_tokenizer()
    bos, eos = tok.convert_tokens_to_ids("<|system|>"), tok.eos_token_id
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|system|> $A <eos>",
                                                              special_tokens=[("<|system|>", bos), ("<eos>", eos)])
    plain = tok("the cat", add_special_tokens=False)["input_ids"]
    assert tok("the cat")["input_ids"] == [bos] + plain + [eos]
    item = ga.tasks.queries_from_prompts(model, ["the cat"], ["sat"], tokenizer=tok)[0]
    assert item["input_ids"].tolist() == [bos] + plain + tok("sat", add_special_tokens=False)["input_ids"]
    assert item["completion_mask"].tolist() == [0] * (len(plain) + 1) + [1]
