"""benchmarks/fidelity_text.py's data at tiny size: the BPE tokenizer trained on stdlib
sources round-trips them, the text chunks and instruct items are deterministic and well
formed, and the completion-only loss the instruct setting trains on and targets equals a
hand-computed masked loss (Σ over completion tokens of −log softmax, one row at a time)."""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import gradalg as ga

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity_text.py"
FILES = ("random.py", "fractions.py", "heapq.py")
VOCAB = 512


@pytest.fixture(scope="module")
def ft():
    spec = importlib.util.spec_from_file_location("fidelity_text_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                     # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def data(ft):
    sources = ft.stdlib_sources(FILES)
    return sources, ft.train_tokenizer(sources, VOCAB, cache=None)


def tiny(ft, name, n_train=12, n_query=4):
    return dataclasses.replace(ft.SETTINGS[name], n_train=n_train, n_query=n_query, vocab_size=VOCAB,
                               n_embd=16, n_head=2, train_steps=3)


def test_tokenizer_round_trips_and_is_deterministic(ft, data, tmp_path):
    sources, tok = data
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id(ft.EOT) == ft.PAD == 0
    for _, text in sources:
        ids = ft.encode(tok, text)
        assert ft.PAD not in ids and tok.decode(ids) == text          # byte-level: exact, whitespace too
    again = ft.train_tokenizer(sources, VOCAB, cache=tmp_path)          # trained again, and cached
    assert again.to_str() == tok.to_str()                               # vocabulary and merges alike
    cached = ft.train_tokenizer(sources, VOCAB, cache=tmp_path)         # read back from the JSON
    assert len(list(tmp_path.glob("text-bpe-512-*.json"))) == 1 and cached.to_str() == again.to_str()


def test_items_are_deterministic_and_well_formed(ft, data):
    sources, tok = data
    for kind, build in (("text", ft.text_chunks), ("instruct", ft.instruct_items)):
        first, second = build(tok, sources, 0), build(tok, sources, 0)
        assert len(first) == len(second) > 16
        for a, b in zip(first, second):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        other = build(tok, sources, 1)                                     # another seed: another order
        assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, other))
        for item in first:
            n = len(item["input_ids"])
            assert item["input_ids"].dtype == torch.long and item["attention_mask"].sum() == n
            if kind == "text":
                assert ft.CHUNK[0] <= n <= ft.CHUNK[1]
            else:
                c = item["completion_mask"]
                k = int(c.sum())
                assert ft.COMPLETION[0] <= k <= ft.COMPLETION[1] and 1 <= n - k <= ft.PROMPT_MAX
                assert torch.equal(c, (torch.arange(n) >= n - k).long())   # prompt first, then completion
    pairs = ft.instruct_pairs(sources)
    assert pairs[0][0].startswith("def ") and pairs[0][0].endswith("):\n") and len(set(pairs)) == len(pairs)


def hand_loss(model, item, completion_only):
    """Σ_t −log softmax(logits_t)[x_{t+1}] over the counted targets of one unpadded row."""
    ids = item["input_ids"]
    logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].double(), -1)
    total = 0.0
    for t in range(len(ids) - 1):
        if not completion_only or item["completion_mask"][t + 1]:
            total -= float(logp[t, ids[t + 1]].detach())
    return total


def test_completion_only_losses_equal_a_hand_masked_loss(ft, data):
    sources, tok = data
    setting = tiny(ft, "instruct")
    torch.manual_seed(0)
    model = ft.new_model(setting).eval()
    items = ft.instruct_items(tok, sources, 0)[:6]
    task = ft.task_of(setting, model)
    batch = ga.collate.pad_collate(items)                                    # right-padded, unequal lengths
    with torch.no_grad():
        targets = ft.query_losses(setting, model, batch)                     # (6,) the benchmark's targets
        for i, item in enumerate(items):
            hand = hand_loss(model, item, completion_only=True)
            one = {k: v[None] for k, v in item.items()}
            assert float(task.loss(model, one)) == pytest.approx(hand, rel=1e-5)
            assert float(targets[i]) == pytest.approx(hand, rel=1e-5)
            assert hand < hand_loss(model, item, completion_only=False)     # the prompt is left out
        assert float(task.loss(model, batch)) == pytest.approx(float(targets.sum()), rel=1e-5)
    text = tiny(ft, "text")                                                   # the text setting: every token
    chunks = ft.text_chunks(tok, sources, 0)[:3]
    with torch.no_grad():
        got = ft.query_losses(text, model, ga.collate.pad_collate(chunks))
    assert got.tolist() == pytest.approx([hand_loss(model, c, completion_only=False) for c in chunks], rel=1e-5)


def test_training_is_seeded(ft, data):
    sources, tok = data
    setting = tiny(ft, "instruct")
    items = ft.instruct_items(tok, sources, 0)[:12]
    a, b = ft.train_model(setting, items, seed=3), ft.train_model(setting, items, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_defaults_rows_at_the_default_layers_and_variants_on_the_blocks(ft, monkeypatch):
    """``method_rows``: each defaults row calls its method as a user would (no ``layers=``:
    the task's default layers, the tied embedding included since 2026-12-06), the variants
    of fidelity_lm (EK-FAC, K-FAC, DataInf, RelatIF at 1e-3, LESS's sparse map) name the
    blocks only, as their rows of 2026-12-05 measured: a rerun keeps each label's meaning."""
    calls = {}

    def recorder(name):
        @functools.wraps(getattr(ga.methods, name))           # its signature: the rows' labels read the defaults
        def record(*args, **kw):
            calls.setdefault(name, []).append(kw.get("layers", "default"))
        return record

    for name in ("grad_dot", "grad_cos", "influence", "trak", "logra", "grass", "relatif", "tracin", "less",
                 "trackstar"):
        monkeypatch.setattr(ga.methods, name, recorder(name))
    monkeypatch.setattr(ft, "checkpoints", lambda p: ([object()] * 3, [object()] * 3, [3e-3] * 3))
    p = type("P", (), {"task": lambda self: object(), "train": [0] * 4, "queries": [0] * 2})()
    layers = {}
    for method, config, thunk in ft.method_rows(p):
        calls.clear()
        thunk()
        layers[(method, config)] = calls[method][-1]
    defaults = {k: v for k, v in layers.items() if k[1].startswith("defaults")}
    assert len(defaults) == 10 and set(defaults.values()) == {"default"}
    for key in (("influence", "EK-FAC"), ("influence", "K-FAC"), ("influence", "DataInf"),
                ("relatif", "EK-FAC, damping=0.001"), ("less", "3 Adam checkpoints, sparse k=8192")):
        assert layers[key] == ["transformer.h.*"], key
