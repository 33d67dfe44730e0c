"""``gradalg query --interactive`` and ``ga.widgets.QueryBox`` on a tiny GPT-2 with a word-level
tokenizer and texts: a piped session through the entry point (exit codes, the saved CSV
equal to a non-interactive ``gradalg query`` of the same prompt and completion, and to the
dense scores), the widget's ``.ask`` against the dense reference, and a query model that is
another checkpoint than the store's: refused by default (API and CLI), scored as the
mixed-checkpoint inner product ⟨P g_θ'(x), P g_θ(z)⟩ with ``other_checkpoint``.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gradalg as ga
from gradalg.errors import DataError, OptionError, StoreMismatchError
from gradalg.testing import assert_close

pytest.importorskip("pydantic")
pytest.importorskip("zarr")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from gradalg.cli import main  # noqa: E402
from gradalg.cli.outputs import read_scores  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["<eos>", "[UNK]"] + "the cat sat on a mat dog ran to park bird flew over tree big small".split()
TEXTS = ["the cat sat on a mat", "a dog ran to the park", "the bird flew over a tree", "the cat ran to a tree",
         "a bird sat on the mat", "the dog flew over the park", "a big cat sat", "the small dog ran to a mat",
         "a tree on the park", "the big bird flew"]
LAYERS = ["transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"]
MAX_NEW = 4

CONFIG = """\
layers = ["transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"]
[model]
class = "GPT2LMHeadModel"
config = "model"
seed = 0
dtype = "float64"
[data.train]
path = "train.jsonl"
text = "text"
tokenizer = "tok"
[data.queries]
path = "queries.jsonl"
columns = ["input_ids", "labels"]
[projector]
kind = "kron"
k = 16
[store]
path = "out/train.zarr"
chunk_rows = 4
[query]
output = "out/top.csv"
top_k = 3
[options]
batch_size = 4
"""


def run(*args) -> int:
    return main([str(a) for a in args])


def model_at(seed: int):
    """The config's model: GPT-2 of the saved config, random weights seeded by ``seed``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config.from_pretrained(WORK["root"] / "model")).to(torch.float64).eval()


WORK: dict = {}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tokenizer, a model config, texts, and the store ``gradalg build`` wrote from them."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import AutoTokenizer, GPT2Config, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("interactive")
    tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<eos>",
                            eos_token="<eos>").save_pretrained(root / "tok")
    GPT2Config(vocab_size=len(WORDS), n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
               eos_token_id=0).save_pretrained(root / "model")
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (root / "run.toml").write_text(CONFIG)
    WORK.update(root=root)
    tokenizer = AutoTokenizer.from_pretrained(str(root / "tok"))
    model = model_at(0)
    task = ga.tasks.causal_lm(model)
    items = [{"input_ids": torch.tensor(tokenizer(t)["input_ids"])} for t in TEXTS]
    for x in items:
        x["attention_mask"] = torch.ones_like(x["input_ids"])
    P = ga.proj.kron(16, 0)
    WORK.update(tok=tokenizer, model=model, task=task, P=P, G=P(ga.grads(task, items, LAYERS)))
    _queries(root, ["the cat"])
    assert run("build", "-c", root / "run.toml", "-q") == 0
    assert ga.store.texts(root / "out" / "train.zarr") == dict(enumerate(TEXTS))   # build recorded the texts
    return WORK


def _queries(root, prompts, model=None):
    """queries.jsonl: each prompt with its greedy completion as token ids, prompt masked."""
    task = WORK["task"] if model is None else ga.tasks.causal_lm(model)
    items = ga.tasks.queries_from_prompts(task, prompts, tokenizer=WORK["tok"], max_new_tokens=MAX_NEW)
    (root / "queries.jsonl").write_text("".join(
        json.dumps({"input_ids": x["input_ids"].tolist(), "labels": x["labels"].tolist()}) + "\n" for x in items))
    return items


def dense(items, model=None):
    """(n_query, n_train) of ⟨P g(x), P g_θ(z)⟩ in memory, the query at ``model`` (default θ)."""
    task = WORK["task"] if model is None else ga.tasks.causal_lm(model)
    Q = WORK["P"](ga.grads(task, items, LAYERS))
    with ga.options(batch_size=4, check_models=False):
        return (Q @ WORK["G"].T).compute().values


def ranked(row, k):
    """(top, bottom) training positions: a stable sort, ties by position (as S.topk)."""
    return list(np.argsort(-row, kind="stable")[:k]), list(np.argsort(row, kind="stable")[:k])


# ------------------------------------------------------------------------- the CLI
def test_piped_session_through_the_entry_point(work):
    """Prompts and commands piped to ``python -m gradalg.cli query -i``: the answers printed,
    the CSV saved, exit 0; the CSV equals a non-interactive query of the same item."""
    root = work["root"]
    session = "the cat\n:k 2\na dog ran\n\n:save out/session.csv\n:quit\nnever read\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "gradalg.cli", "query", "-c", str(root / "run.toml"), "-i",
                           "--max-new-tokens", str(MAX_NEW), "--k", "3"], input=session, capture_output=True,
                          text=True, env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "top 3 (highest dot scores)" in proc.stdout and "top 2 (highest dot scores)" in proc.stdout
    assert "saved 2 answer(s)" in proc.stdout
    assert "the cat sat on a mat" in proc.stdout           # documents shown as text

    import pandas as pd
    table = pd.read_csv(root / "out" / "session.csv")
    assert list(table.columns) == ["query", "prompt", "completion", "side", "rank", "train", "score", "text"]
    assert table.groupby("query").size().to_dict() == {"q0": 6, "q1": 4}      # k = 3, then k = 2: both ends
    items = _queries(root, ["the cat", "a dog ran"])
    completion = work["tok"].decode(items[0]["input_ids"][items[0]["completion_mask"].bool()],
                                    skip_special_tokens=True)
    assert (table[table["query"] == "q0"]["completion"].fillna("") == completion).all()

    # the same prompt and completion through `gradalg query` (non-interactive)
    out = root / "out" / "batch.csv"
    assert run("query", "-c", root / "run.toml", "-q", "--set", f"query.output='{out}'", "--overwrite") == 0
    batch = read_scores(out)
    top = table[(table["query"] == "q0") & (table["side"] == "top")].sort_values("rank")
    assert list(top["train"]) == list(batch["train"].sel(query=0).values)
    assert_close(torch.tensor(top["score"].values), torch.from_numpy(batch["score"].sel(query=0).values),
                 rtol=1e-10, atol=1e-12)

    # and the dense in-memory reference, both ends, both prompts
    values = dense(items)
    for q, k in (("q0", 3), ("q1", 2)):
        row = values[int(q[1])]
        hi, lo = ranked(row, k)
        for side, order in (("top", hi), ("bottom", lo)):
            got = table[(table["query"] == q) & (table["side"] == side)].sort_values("rank")
            assert list(got["train"]) == order
            assert_close(torch.tensor(got["score"].values), torch.from_numpy(row[order]), rtol=1e-9, atol=1e-12)
            assert list(got["text"]) == [TEXTS[j] for j in order]


def _interactive(monkeypatch, capsys, root, text, *extra):
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code = run("query", "-c", root / "run.toml", "-i", "--max-new-tokens", MAX_NEW, *extra)
    return code, capsys.readouterr()


def test_exit_codes_of_a_piped_session(work, monkeypatch, capsys):
    root = work["root"]
    again = root / "out" / "again.csv"
    code, out = _interactive(monkeypatch, capsys, root, f"the cat\n:save {again}\n")
    assert code == 0 and "saved 1 answer(s)" in out.out
    code, out = _interactive(monkeypatch, capsys, root, f"the cat\n:save {again}\n")
    assert code == 3 and "exists" in out.out          # an existing file: refused, the session goes on
    code, _ = _interactive(monkeypatch, capsys, root, f":save {again}\n", "--overwrite")
    assert code == 0
    code, out = _interactive(monkeypatch, capsys, root, f":k 0\n:bogus\n:save {root}/x.txt\nthe cat\n")
    assert code == 2 and "positive integer" in out.out and "unknown command :bogus" in out.out
    assert ".csv or .parquet" in out.out and "top 3" in out.out     # the prompt after the errors is answered
    code, out = _interactive(monkeypatch, capsys, root, "")           # end of input at once
    assert code == 0
    code, out = _interactive(monkeypatch, capsys, root, "", "--max-new-tokens", "0")
    assert code == 2 and "--max-new-tokens" in out.err


def test_missing_tokenizer_or_texts_name_the_fix(work, monkeypatch, capsys, tmp_path):
    root = work["root"]
    text = CONFIG.replace('text = "text"\ntokenizer = "tok"\n', "").replace("config = \"model\"",
                                                                           f"config = \"{root / 'model'}\"")
    (tmp_path / "c.toml").write_text(text.replace('path = "out/train.zarr"', f'path = "{root}/out/train.zarr"')
                                     .replace('path = "train.jsonl"', f'path = "{root}/train.jsonl"'))
    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat\n"))
    assert run("query", "-c", tmp_path / "c.toml", "-i") == 2
    assert "--tokenizer" in capsys.readouterr().err
    # a store without texts, no text column: refused, --texts names the fix; with --texts it runs
    ga.store.write(work["G"], tmp_path / "bare.zarr", chunk_rows=4)
    conf = (tmp_path / "c.toml").read_text().replace(f'{root}/out/train.zarr', f'{tmp_path}/bare.zarr')
    (tmp_path / "c.toml").write_text(conf)
    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat\n"))
    assert run("query", "-c", tmp_path / "c.toml", "-i", "--tokenizer", root / "tok") == 2
    assert "--texts" in capsys.readouterr().err
    (tmp_path / "t.txt").write_text("\n".join(TEXTS) + "\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat\n"))
    assert run("query", "-c", tmp_path / "c.toml", "-i", "--tokenizer", root / "tok", "--texts",
               tmp_path / "t.txt", "--max-new-tokens", MAX_NEW) == 0
    assert "the cat sat on a mat" in capsys.readouterr().out


# ---------------------------------------------------------------------- the widget
def test_widget_ask_equals_the_dense_scores(work, tmp_path):
    box = ga.widgets.QueryBox(work["root"] / "out" / "train.zarr", work["model"], work["tok"], k=4,
                              max_new_tokens=MAX_NEW)
    answers = [box.ask("the cat"), box.ask("a bird")]
    items = [a.item for a in answers]
    values = dense(items)
    for a, row in zip(answers, values):
        hi, lo = ranked(row, 4)
        assert list(a.top["train"]) == hi and list(a.bottom["train"]) == lo
        assert_close(torch.tensor(a.top["score"].values), torch.from_numpy(row[hi]), rtol=1e-9, atol=1e-12)
        assert list(a.bottom["text"]) == [TEXTS[j] for j in lo]
        assert not a.other_checkpoint
    assert answers[0].item["labels"][:2].tolist() == [-100, -100]       # the prompt is not a target
    page = box._repr_mimebundle_()["text/html"]
    assert "a bird" in page and TEXTS[hi[0]] in page                     # the last answer, as text
    table = box.frame()
    assert len(table) == 16 and set(table["side"]) == {"top", "bottom"}
    box.save(tmp_path / "s.parquet")
    import pandas as pd
    assert pd.read_parquet(tmp_path / "s.parquet")["score"].tolist() == table["score"].tolist()
    with pytest.raises(DataError, match="non-empty"):
        box.ask("   ")
    with pytest.raises(OptionError, match="positive integer"):
        box.k = 0
    with pytest.raises(OptionError, match=".csv or .parquet"):
        box.save(tmp_path / "s.txt")


def test_widget_builds_its_controls(work):
    pytest.importorskip("ipywidgets")
    box = ga.widgets.QueryBox(work["root"] / "out" / "train.zarr", work["model"], work["tok"], k=2,
                              max_new_tokens=MAX_NEW)
    w = box.widget
    box.k_field.value = 3
    assert box.k == 3
    box.prompt.value = "the dog"               # what Enter in the Text box does
    assert box.answers[-1].prompt == "the dog" and box.answers[-1].k == 3 and box.last_error is None
    box._submit("")
    assert "non-empty" in box.last_error
    assert w is box.widget


# ----------------------------------------------------------- another checkpoint
def test_another_checkpoint_refused_or_scored_with_its_meaning(work, monkeypatch, capsys):
    root, path = work["root"], work["root"] / "out" / "train.zarr"
    other = model_at(1)                          # same architecture, other weights: θ' ≠ θ
    box = ga.widgets.QueryBox(path, other, work["tok"], k=3, max_new_tokens=MAX_NEW)
    with pytest.raises(StoreMismatchError, match="other_checkpoint=True"):
        box.ask("the cat")
    box = ga.widgets.QueryBox(path, other, work["tok"], k=3, max_new_tokens=MAX_NEW, other_checkpoint=True)
    a = box.ask("the cat")
    assert a.other_checkpoint and a.query_model != a.store_model
    row = dense([a.item], model=other)[0]        # ⟨P g_θ'(x), P g_θ(z_i)⟩, the completion θ' generated
    hi, lo = ranked(row, 3)
    assert list(a.top["train"]) == hi and list(a.bottom["train"]) == lo
    assert_close(torch.tensor(a.top["score"].values), torch.from_numpy(row[hi]), rtol=1e-9, atol=1e-12)

    # the CLI: the config's model at seed 1 is another checkpoint than the store's
    items = _queries(root, ["the cat"], model=other)
    out = root / "out" / "other.csv"
    args = ["query", "-c", root / "run.toml", "-q", "--set", "model.seed=1", "--set", f"query.output='{out}'",
            "--set", "query.top_k=0", "--overwrite"]
    assert run(*args) == 3
    err = capsys.readouterr().err
    assert "model_fingerprint" in err and "query.other_checkpoint = true" in err
    assert run(*args, "--set", "query.other_checkpoint=true") == 0
    got = read_scores(out)
    assert_close(torch.from_numpy(np.asarray(got.sel(query=0).values)), torch.from_numpy(dense(items, other)[0]),
                 rtol=1e-9, atol=1e-12)
    side = json.loads(Path(str(out) + ".gradalg.json").read_text())
    assert side["store_model_fingerprint"] == [a.store_model]
    # interactive: the same refusal, before any prompt (exit 3); the same scores once allowed
    code, o = _interactive(monkeypatch, capsys, root, "the cat\n", "--set", "model.seed=1")
    assert code == 3 and "query.other_checkpoint = true" in o.err and o.out == ""
    code, o = _interactive(monkeypatch, capsys, root, "the cat\n", "--set", "model.seed=1", "--set",
                           "query.other_checkpoint=true", "--k", "3")
    assert code == 0 and "mixed-checkpoint" in o.out
    _queries(root, ["the cat"])                  # leave queries.jsonl as the other tests wrote it


# ------------------------------------------------------------ prompts in [data.queries]
def test_prompt_column_queries_generate_and_score_without_the_loop(work, tmp_path):
    """``[data.queries] prompt = "prompt"``: ``gradalg query`` (non-interactive) generates each
    completion greedily and scores the completion's loss only: equal to the dense reference of
    ``ga.tasks.queries_from_prompts``; a given ``completion`` column is used as written."""
    root = work["root"]
    prompts = ["the cat", "a dog ran"]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "reference": "sat on a mat"}) + "\n"
                                                for p in prompts))
    base = ["--set", "data.queries.path='prompts.jsonl'", "--set", "data.queries.prompt='prompt'",
            "--set", "data.queries.tokenizer='tok'", "--set", f"data.queries.max_new_tokens={MAX_NEW}",
            "--set", "query.top_k=0", "--overwrite"]
    out = root / "out" / "prompts.zarr"
    assert run("query", "-c", root / "run.toml", "-q", "--set", f"query.output='{out}'", *base) == 0
    got = read_scores(out)
    items = ga.tasks.queries_from_prompts(work["task"], prompts, tokenizer=work["tok"], max_new_tokens=MAX_NEW)
    assert_close(torch.from_numpy(np.asarray(got.values)), torch.from_numpy(dense(items)), rtol=1e-9, atol=1e-12)

    given = root / "out" / "given.zarr"
    assert run("query", "-c", root / "run.toml", "-q", "--set", f"query.output='{given}'", *base,
               "--set", "data.queries.completion='reference'") == 0
    items = ga.tasks.queries_from_prompts(work["task"], prompts, ["sat on a mat"] * 2, tokenizer=work["tok"])
    assert_close(torch.from_numpy(np.asarray(read_scores(given).values)), torch.from_numpy(dense(items)),
                 rtol=1e-9, atol=1e-12)


def test_prompt_column_bad_configs_name_the_fix(work, capsys):
    root = work["root"]
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "the cat"}) + "\n")
    code = run("query", "-c", root / "run.toml", "-q", "--set", "data.queries.path='prompts.jsonl'",
               "--set", "data.queries.prompt='prompt'", "--overwrite")
    assert code == 2 and "prompt needs tokenizer" in capsys.readouterr().err
    code = run("query", "-c", root / "run.toml", "-q", "--set", "data.queries.path='prompts.jsonl'",
               "--set", "data.queries.prompt='question'", "--set", "data.queries.tokenizer='tok'", "--overwrite")
    assert code == 2 and "no column 'question'" in capsys.readouterr().err
    code = run("query", "-c", root / "run.toml", "-q", "--set", "data.train.prompt='text'", "--overwrite")
    err = capsys.readouterr().err
    assert code == 2 and "data.train" in err and "prompt" in err
    code = run("query", "-c", root / "run.toml", "-q", "--set", "data.queries.completion='reference'", "--overwrite")
    assert code == 2 and "completion needs prompt" in capsys.readouterr().err
