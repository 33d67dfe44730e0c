"""The report page (``Scores.to_html``, ``gradalg report``): the documents and scores it shows
equal the dense scores' top and bottom k; texts by list, dict or function; token
highlighting; one self-contained file (no URL outside it); and, in headless Chromium when
installed, a page that is not blank, shows the documents and typesets its formula.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gradalg as ga
from gradalg.errors import DataError, OptionError
from gradalg.report import FIDELITY, fidelity_note, report_html, write_report
from gradalg.report.page import _fmt
from models import classification_data, mlp

ROOT = Path(__file__).resolve().parents[1]
N_TRAIN, N_QUERY = 20, 3
TEXTS = [f"document {i}: the <quick> & brown fox #{i}" for i in range(N_TRAIN)]


@pytest.fixture(scope="module")
def scores():
    X, y = classification_data(N_TRAIN)
    task = ga.tasks.classification(mlp())
    S = ga.methods.grad_dot(task, ga.data.as_data((X, y), [f"z{i}" for i in range(N_TRAIN)]),
                            (X[:N_QUERY] + 0.1, y[:N_QUERY]))
    return S, S.compute()


def shown(page: str) -> list[dict]:
    """Per query section: [(score text, train id)] of the top list and of the bottom list."""
    out = []
    for section in page.split("<section class='query'>")[1:]:
        lists = re.findall(r"<ol class='docs'>(.*?)</ol>", section, flags=re.S)
        out.append([re.findall(r"<span class='score[^']*'>([^<]+)</span> <span class='id'>training example ([^<]+)"
                               r"</span>", block) for block in lists])
    return out


def expected(dense, k):
    """(top, bottom) [(score text, id)] per query from the dense matrix: a stable sort,
    ties by training position (as S.topk)."""
    out = []
    for row in dense.values:
        order = np.argsort(-row, kind="stable")[:k]
        low = np.argsort(row, kind="stable")[:k]
        ids = dense["train"].values
        out.append([[(_fmt(float(row[j])), str(ids[j])) for j in order],
                    [(_fmt(float(row[j])), str(ids[j])) for j in low]])
    return out


def test_top_and_bottom_equal_the_dense_scores(scores):
    S, dense = scores
    page = report_html(S, texts=TEXTS, k=4, method="grad_dot", math=False)
    assert shown(page) == expected(dense, 4)
    assert len(shown(page)) == N_QUERY


def test_k_above_n_train_shows_every_example(scores):
    S, dense = scores
    page = report_html(S, k=50, math=False)
    assert shown(page) == expected(dense, N_TRAIN)


@pytest.mark.parametrize("form", ["list", "dict", "function"])
def test_texts_by_list_dict_or_function(scores, form):
    S, _ = scores
    texts = {"list": TEXTS, "dict": {f"z{i}": t for i, t in enumerate(TEXTS)},
             "function": lambda i: TEXTS[int(i[1:])]}[form]
    page = report_html(S, texts=texts, queries=[("Why is ", "the sky blue"), "plain query", None], k=3,
                       math=False)
    for _, tid in [pair for section in shown(page) for column in section for pair in column]:
        assert f"document {tid[1:]}: the &lt;quick&gt; &amp; brown fox #{tid[1:]}" in page   # escaped, by id
    assert "<quick>" not in page
    assert "Why is <span class='completion'>the sky blue</span>" in page
    assert "plain query" in page


def test_missing_texts_and_bad_arguments(scores):
    S, _ = scores
    page = report_html(S, texts={"z0": "only one"}, k=2, math=False)
    assert "(no text given)" in page
    with pytest.raises(DataError, match="3 texts for 20 examples"):
        report_html(S, texts=TEXTS[:3], k=2)
    with pytest.raises(OptionError, match="list of texts"):
        report_html(S, texts="one string", k=2)
    with pytest.raises(OptionError, match="positive integer"):
        report_html(S, k=0)
    with pytest.raises(OptionError, match="token_scores="):
        report_html(S, k=2, tokens={"z0": ["a"]})


def test_token_highlighting(scores):
    import xarray as xr

    S, dense = scores
    values = np.full((N_QUERY, N_TRAIN, 3), np.nan)
    values[:, :, 0], values[:, :, 1] = 2.0, -1.0          # third token: padding
    token_scores = xr.DataArray(values, dims=("query", "train", "train_token"),
                                coords={"query": dense["query"].values, "train": dense["train"].values})
    tokens = {f"z{i}": ["The", " cat", " sat"] for i in range(N_TRAIN)}
    page = report_html(S, k=2, token_scores=token_scores, tokens=tokens, math=False)
    assert "<span class='tok' style='background:rgba(211,47,47,0.85)' title='2'>The</span>" in page
    assert "<span class='tok' style='background:rgba(25,118,210,0.42)' title='-1'> cat</span>" in page
    assert "<span class='tok'> sat</span>" in page
    with pytest.raises(OptionError, match="train_token"):
        report_html(S, k=2, token_scores=token_scores.rename(train_token="query_token"), tokens=tokens)
    with pytest.raises(OptionError, match="tokens="):
        report_html(S, k=2, token_scores=token_scores)


def test_one_self_contained_file(scores, tmp_path):
    S, _ = scores
    path = S.to_html(tmp_path / "sub" / "report.html", texts=TEXTS, k=3, method="grad_dot")
    page = path.read_text()
    assert path == tmp_path / "sub" / "report.html"
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page), "the page links out"
    assert not re.search(r"@import|<link\b", page)
    urls = re.findall(r"url\(([^)]{0,40})", page)
    assert urls and all(u.startswith("data:font/woff2;base64,") for u in urls)
    assert "katex" in page and "$$\\tau(q, z)" in page
    assert "LDS against retraining" in page and "0.428 [0.381, 0.464]" in page
    assert str(S.explain(topk=3).summary()).split(",")[0] in page
    assert len(page) < 1_000_000


def test_fidelity_notes_quote_docs_fidelity():
    text = (ROOT / "docs" / "fidelity.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    for name, note in FIDELITY.items():
        for quoted in re.findall(r"\d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\]", note):
            assert any(line.startswith(f"| {name} |") and quoted in line for line in rows), (name, quoted)
    from gradalg.report.fidelity import LM_CEILING
    assert LM_CEILING in " ".join(text.split())
    assert set(FIDELITY) <= set(ga.methods.CATALOGUE) | {"ensemble"}
    assert "not named" in fidelity_note(None) and "no measured fidelity" in fidelity_note("mine")


# ------------------------------------------------------------------------- in a browser
def test_report_in_chromium(scores, tmp_path):
    from chromium import dump_dom, screenshot, serve, visible_text

    S, _ = scores
    write_report(S, tmp_path / "report.html", texts=TEXTS, queries=["first query text", "second", "third"],
                 k=3, method="influence")
    with serve(tmp_path) as base:
        dom, requested = dump_dom(f"{base}/report.html", tmp_path)
        shot = screenshot(f"{base}/report.html", tmp_path)
    assert requested and all(u.startswith(base) for u in requested), requested
    text = visible_text(dom)
    assert "first query text" in text and "document 7: the &lt;quick&gt; &amp; brown fox" in dom
    assert dom.count('class="katex"') >= 1 and "$$" not in text
    from PIL import Image
    pixels = np.asarray(Image.open(shot).convert("L"))
    assert pixels.std() > 5 and len(np.unique(pixels)) > 20, "the screenshot is blank"


# ------------------------------------------------------------------------- the CLI
def test_gradalg_report_equals_api(tmp_path):
    pytest.importorskip("pydantic")
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    from gradalg.cli import main

    sys.path.insert(0, str(ROOT / "examples"))
    from make_gpt2_tiny import write_tiny

    shutil.copy(ROOT / "examples" / "gpt2_tiny.toml", tmp_path / "run.toml")
    write_tiny(tmp_path / "gpt2_tiny")
    lines = (tmp_path / "gpt2_tiny" / "train.jsonl").read_text().splitlines()
    (tmp_path / "texts.txt").write_text("\n".join(f"training text number {i}" for i in range(len(lines))) + "\n")
    out = tmp_path / "out" / "report.html"
    args = ["report", "-c", str(tmp_path / "run.toml"), "-q", "-o", str(out), "--k", "2",
            "--texts", str(tmp_path / "texts.txt"), "--no-math"]
    assert main(args) == 0
    assert main(args) == 3                                   # exists: --overwrite
    page = out.read_text()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(tmp_path / "gpt2_tiny" / "model")).to(torch.float64).eval()

    def read(name):
        rows = (tmp_path / "gpt2_tiny" / f"{name}.jsonl").read_text().splitlines()
        ids = [torch.tensor(json.loads(r)["input_ids"]) for r in rows]
        return [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in ids]

    with ga.options(batch_size=4):
        ref = ga.methods.logra(ga.tasks.causal_lm(model), read("train"), read("queries"),
                               layers=["transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"], k=16,
                               damping=1e-3).compute()
    assert shown(page) == expected(ref, 2)
    for _, tid in shown(page)[0][0]:
        assert f"training text number {tid}" in page
    assert "Method: logra" in page and "0.859 [0.838, 0.869]" in page
