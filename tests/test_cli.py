"""The ``gradalg`` command line on a tiny GPT-2 (random init from a saved config) and
JSON-lines token ids, all in a temporary folder, with ``examples/gpt2_tiny.toml``.

Every command's result is compared with the Python API's: ``build`` with ``P(G)``'s
rows, ``query`` (CSV / parquet / Zarr, top k) and ``score`` with ``S.compute()``; a
build killed with SIGKILL and resumed equals one that ran through; ``explain`` opens
no data; configs with a bad field exit 2 naming the field; mismatched stores exit 3.
Commands run in-process through ``main([...])``, except the entry point and the
killed build (subprocesses).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

import gradalg as ga
from gradalg.testing import assert_close

pytest.importorskip("pydantic")
pytest.importorskip("zarr")
pytest.importorskip("transformers")

from gradalg.cli import main  # noqa: E402
from gradalg.cli.outputs import read_scores  # noqa: E402
from gradalg.store import layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt2_tiny.toml"
sys.path.insert(0, str(ROOT / "examples"))
from make_gpt2_tiny import write_tiny  # noqa: E402

LAYERS = ["transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The example config beside its generated model config and data; one store built."""
    root = tmp_path_factory.mktemp("cli")
    shutil.copy(EXAMPLE, root / "run.toml")
    write_tiny(root / "gpt2_tiny")
    assert main(["build", "-c", str(root / "run.toml"), "-q"]) == 0
    return root


@pytest.fixture(scope="module")
def api(workdir):
    """The same computation written with the Python API."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(workdir / "gpt2_tiny" / "model")).to(torch.float64).eval()
    task = ga.tasks.causal_lm(model)

    def read(name):
        lines = (workdir / "gpt2_tiny" / f"{name}.jsonl").read_text().splitlines()
        ids = [torch.tensor(json.loads(line)["input_ids"]) for line in lines]
        return [{"input_ids": x, "attention_mask": torch.ones_like(x)} for x in ids]

    train, queries = read("train"), read("queries")
    P = ga.proj.kron(16, 0)
    G = P(ga.grads(task, train, LAYERS))
    Q = P(ga.grads(task, queries, LAYERS))
    return {"task": task, "train": train, "queries": queries, "G": G, "Q": Q}


def run(*args) -> int:
    return main([str(a) for a in args])


def cfg(workdir) -> str:
    return str(workdir / "run.toml")


def _raw(path) -> dict:
    import zarr

    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(arr[...]) for name, arr in group.arrays()}


# ------------------------------------------------------------------------------- help
def test_every_command_has_help_with_an_example(capsys):
    assert run("--help") == 0
    top = capsys.readouterr().out
    for command in ("build", "query", "score", "explain", "inspect"):
        assert command in top
        assert run(command, "--help") == 0
        text = capsys.readouterr().out
        assert "example:" in text and f"gradalg {command}" in text, command
    assert "exit codes" in top and "3 " in top


def test_console_script_entry_point():
    """pyproject declares ``gradalg = gradalg.cli:main``, and the module runs as a program."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gradalg"] == "gradalg.cli:main"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "gradalg.cli", "--help"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: gradalg" in out.stdout


def test_usage_errors_exit_2(capsys):
    assert run("build") == 2
    assert "--config" in capsys.readouterr().err
    assert run() == 2
    assert run("frobnicate") == 2


def test_yaml_config(workdir, capsys):
    import yaml

    data = tomllib.loads((workdir / "run.toml").read_text())
    (workdir / "run.yaml").write_text(yaml.safe_dump(data))
    assert run("inspect", "-c", workdir / "run.yaml", "--json") == 0
    assert json.loads(capsys.readouterr().out)["n"] == 24


# ------------------------------------------------------------------------------ build
def test_build_equals_api_and_records_its_config(workdir, api):
    stored = ga.store.open(workdir / "gpt2_tiny" / "out" / "train.zarr", like=api["G"])
    mine, ref = stored.to_dense(), api["G"].to_dense()
    for name in ref:
        assert_close(mine[name].reshape(ref[name].shape), ref[name], rtol=1e-12, atol=1e-12)
    attrs = layout.read_attrs(workdir / "gpt2_tiny" / "out" / "train.zarr")
    prov = attrs["gradalg_cli"]
    assert prov["command"] == "gradalg build"
    assert prov["config"]["projector"] == {"kind": "kron", "k": 16, "seed": 0, "options": {}}
    assert prov["config"]["model"]["class"] == "GPT2LMHeadModel"
    assert prov["versions"]["torch"] == torch.__version__ and prov["versions"]["gradalg"] == ga.__version__
    assert prov["config_file"] == str((workdir / "run.toml").resolve())


def test_second_build_is_a_no_op_that_says_so(workdir, capsys):
    path = workdir / "gpt2_tiny" / "out" / "train.zarr"
    stamps = {p: p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()}
    assert run("build", "-c", cfg(workdir)) == 0
    err = capsys.readouterr().err
    assert "nothing to do" in err
    assert {p: p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()} == stamps


@pytest.mark.slow
def test_build_killed_then_resumed_equals_one_run(workdir):
    """SIGKILL mid-build (between a chunk's data and its flag, at any chunk), then the same
    command: the store is bitwise the one an uninterrupted build writes."""
    killed = workdir / "killed.zarr"
    sets = ["--set", f"store.path='{killed}'", "--set", "store.chunk_rows=4"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{layout.DELAY_ENV: "0.5"})
    proc = subprocess.Popen([sys.executable, "-m", "gradalg.cli", "build", "-c", cfg(workdir), "-q", *sets],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    from gradalg.cli.monitor import done_count
    while time.monotonic() < deadline and proc.poll() is None:
        if (done_count(killed) or 0) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the build finished before it could be killed: {proc.communicate()}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = done_count(killed)
    assert 2 <= done < 6, f"killed after {done} of 6 chunks"
    assert run("query", "-c", cfg(workdir), "-q", *sets, "--set", f"query.output='{workdir / 'early.csv'}'") == 4
    assert run("inspect", killed) == 0
    assert run("build", "-c", cfg(workdir), "-q", *sets) == 0
    assert done_count(killed) == 6
    whole = workdir / "whole.zarr"
    assert run("build", "-c", cfg(workdir), "-q", "--set", f"store.path='{whole}'", "--set", "store.chunk_rows=4") == 0
    a, b = _raw(killed), _raw(whole)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


# ------------------------------------------------------------------------------ query
@pytest.mark.parametrize("output,top", [("top5.csv", 5), ("all.parquet", 0), ("all.zarr", 0), ("top3.zarr", 3),
                                        ("all.csv", 0)])
def test_query_equals_api(workdir, api, output, top):
    out = workdir / "q" / output
    assert run("query", "-c", cfg(workdir), "-q", "--set", f"query.output='{out}'", "--set", f"query.top_k={top}") == 0
    with ga.options(batch_size=4):
        ref = (api["Q"] @ api["G"].T).compute()
    got = read_scores(out)
    if top:
        order = np.argsort(-ref.values, axis=1)[:, :top]
        for qi, q in enumerate(ref["query"].values):
            assert list(got["train"].sel(query=q).values) == list(ref["train"].values[order[qi]])
            assert_close(torch.from_numpy(got["score"].sel(query=q).values),
                         torch.from_numpy(ref.values[qi, order[qi]]), rtol=1e-10, atol=1e-10)
    else:
        got = got.sel(query=ref["query"], train=ref["train"])
        assert_close(torch.from_numpy(np.asarray(got.values)), torch.from_numpy(ref.values), rtol=1e-10, atol=1e-10)
    if output.endswith((".csv", ".parquet")):
        side = json.loads(Path(str(out) + ".gradalg.json").read_text())
        assert side["command"] == "gradalg query" and side["config"]["query"]["similarity"] == "dot"
    if output.endswith(".parquet"):
        import pyarrow.parquet as pq
        assert b"gradalg_cli" in pq.read_schema(out).metadata


def test_query_influence_equals_api(workdir, api):
    out = workdir / "q" / "influence.csv"
    assert run("query", "-c", cfg(workdir), "-q", "--set", f"query.output='{out}'", "--set", "query.top_k=0",
               "--set", "query.similarity='influence'", "--set", "query.damping=0.01") == 0
    G, Q = api["G"], api["Q"]
    with ga.options(batch_size=4):
        ref = (Q @ ga.fisher(G).damp(0.01).inv() @ G.T).compute()
    got = read_scores(out).sel(query=ref["query"], train=ref["train"])
    assert_close(torch.from_numpy(got.values), torch.from_numpy(ref.values), rtol=1e-9, atol=1e-9)


def test_existing_output_is_refused_without_overwrite(workdir, capsys):
    out = workdir / "q" / "again.csv"
    args = ["query", "-c", cfg(workdir), "-q", "--set", f"query.output='{out}'"]
    assert run(*args) == 0
    assert run(*args) == 3
    assert "--overwrite" in capsys.readouterr().err
    assert run(*args, "--overwrite") == 0


# ------------------------------------------------------------------------------ score
def test_score_equals_api(workdir, api):
    out = workdir / "s" / "logra.parquet"
    assert run("score", "-c", cfg(workdir), "-q", "--set", f"score.output='{out}'") == 0
    with ga.options(batch_size=4):
        ref = ga.methods.logra(api["task"], api["train"], api["queries"], layers=LAYERS, k=16,
                               damping=1e-3).compute()
    got = read_scores(out).sel(query=ref["query"], train=ref["train"])
    assert_close(torch.from_numpy(got.values), torch.from_numpy(ref.values), rtol=1e-9, atol=1e-9)
    side = json.loads(Path(str(out) + ".gradalg.json").read_text())
    assert side["config"]["method"] == {"name": "logra", "options": {"k": 16, "damping": 1e-3},
                                        "use_projector": True}


def test_score_with_projector_to_zarr(workdir, api):
    """grad_cos takes [projector]; a .zarr output is a resumable score store."""
    out = workdir / "s" / "cos.zarr"
    assert run("score", "-c", cfg(workdir), "-q", "--set", f"score.output='{out}'", "--set", "method.name='grad_cos'",
               "--set", "method.options={}") == 0
    with ga.options(batch_size=4):
        ref = (api["Q"].normalize() @ api["G"].normalize().T).compute()
    got = ga.store.open_scores(out)
    assert got.attrs["gradalg_cli"]["command"] == "gradalg score"
    assert_close(torch.from_numpy(got.values), torch.from_numpy(ref.values), rtol=1e-10, atol=1e-10)


def test_score_that_cannot_stream_to_zarr(workdir, api):
    """RelatIF divides by each training example's self-influence: computed whole, one array."""
    out = workdir / "s" / "relatif.zarr"
    assert run("score", "-c", cfg(workdir), "-q", "--set", f"score.output='{out}'", "--set", "method.name='relatif'",
               "--set", "method.options={damping=0.01}") == 0
    with ga.options(batch_size=4):
        ref = ga.methods.relatif(api["task"], api["train"], api["queries"], layers=LAYERS,
                                 projector=ga.proj.kron(16, 0), damping=0.01).compute()
    got = read_scores(out).sel(query=ref["query"], train=ref["train"])
    assert_close(torch.from_numpy(np.asarray(got.values)), torch.from_numpy(ref.values), rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------- explain
def test_explain_reads_no_data(workdir, capsys, tmp_path):
    """Data paths that do not exist: explain plans from data.<x>.n and seq_len alone."""
    nowhere = ["--set", "data.train.path='/nonexistent/train.jsonl'", "--set",
               "data.queries.path='/nonexistent/queries.jsonl'"]
    assert run("explain", "-c", cfg(workdir), *nowhere) == 0
    text = capsys.readouterr().out
    assert "physical passes" in text and "n=24" in text and "n=4" in text and "ekfac" in text
    page = tmp_path / "plan.html"
    assert run("explain", "-c", cfg(workdir), "--what", "build", "--html", page, *nowhere) == 0
    assert page.read_text().startswith("<!doctype html>") and "gradalg plan" in page.read_text()
    assert run("explain", "-c", cfg(workdir), "--json", "--what", "query", *nowhere) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["passes"]


def test_a_refusal_for_memory_names_the_flag_that_fixes_it(workdir, capsys):
    """A budget from the config's options is changed with ``--set options.memory_budget=...``
    (not ``ga.options(...)``, which a command-line user cannot type); that flag, as written,
    plans."""
    import re
    from gradalg.cli.codes import RUN_REFUSED
    nowhere = ["--set", "data.train.path='/nonexistent/train.jsonl'", "--set",
               "data.queries.path='/nonexistent/queries.jsonl'"]
    assert run("explain", "-c", cfg(workdir), "--set", "options.memory_budget=2kB", *nowhere) == RUN_REFUSED
    err = capsys.readouterr().err
    assert "ga.options(" not in err and "(--set options.memory_budget)" in err, err
    fix = re.search(r"would fit under --set (options\.memory_budget=[0-9.]+[kMG]B)", err)
    assert fix, err
    assert run("explain", "-c", cfg(workdir), "--set", fix.group(1), *nowhere) == 0


def test_explain_without_sizes_names_the_field(workdir, capsys, tmp_path):
    import re
    text = re.sub(r"(?m)^n = 24.*$", "", (workdir / "run.toml").read_text())
    (tmp_path / "gpt2_tiny").symlink_to(workdir / "gpt2_tiny")
    (tmp_path / "run.toml").write_text(text)
    assert run("explain", "-c", tmp_path / "run.toml") == 2
    assert "data.train.n" in capsys.readouterr().err


# ---------------------------------------------------------------------------- inspect
def test_inspect(workdir, capsys):
    path = workdir / "gpt2_tiny" / "out" / "train.zarr"
    assert run("inspect", path) == 0
    text = capsys.readouterr().out
    assert "gradients store" in text and "24 examples × 64 coordinates" in text and "3/3 written" in text
    assert "gradalg build -c" in text and "torch " + torch.__version__ in text
    assert run("inspect", "-c", cfg(workdir), "--json", "--verify") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "gradients" and d["n"] == 24 and d["complete"] and d["verify"] == "intact"
    assert d["provenance"]["config"]["store"]["chunk_rows"] == 8
    assert run("inspect", workdir / "nothing.zarr") == 4
    assert run("inspect", workdir / "q" / "top3.zarr") == 0      # a top-k output of query
    text = capsys.readouterr().out
    assert "top_k store" in text and "'rank': 3" in text and "gradalg query" in text


# --------------------------------------------------------------------------- refusals
def test_bad_config_exits_2_naming_the_field(workdir, capsys, tmp_path):
    text = (workdir / "run.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('dtype = "float64"', 'dtyp = "float64"').replace("k = 16\nseed", "k = -1\nseed"))
    assert run("build", "-c", bad) == 2
    err = capsys.readouterr().err
    assert "model.dtyp" in err and "unknown field" in err and "'dtype'" in err
    assert "projector.k" in err and "greater than or equal to 1" in err
    assert "Traceback" not in err
    assert run("build", "-c", cfg(workdir), "--set", "layers=['transformer.h.9.mlp']") == 2
    assert "layers" in capsys.readouterr().err
    assert run("build", "-c", cfg(workdir), "--set", "data.train.path='missing.jsonl'") == 2
    assert "data.train.path" in capsys.readouterr().err
    assert run("build", "-c", tmp_path / "absent.toml") == 2
    assert run("score", "-c", cfg(workdir), "--set", "method.options={dampin=1}") == 2
    assert "dampin" in capsys.readouterr().err
    assert run("build", "-c", cfg(workdir), "--set", "data.train.n=23") == 2
    assert "data.train.n" in capsys.readouterr().err


def test_mismatched_store_is_refused(workdir, capsys):
    assert run("build", "-c", cfg(workdir), "--set", "projector.k=4") == 3
    err = capsys.readouterr().err
    assert "projector" in err and "--overwrite" in err and "Traceback" not in err
    assert run("query", "-c", cfg(workdir), "--set", "projector.seed=1", "--set",
               f"query.output='{workdir / 'q' / 'seed1.csv'}'") == 3
    assert "projector" in capsys.readouterr().err
    assert run("build", "-c", cfg(workdir), "--set", "model.seed=1") == 3
    assert "model_fingerprint" in capsys.readouterr().err


def test_quiet_and_verbose(workdir, capsys):
    assert run("build", "-c", cfg(workdir), "-q") == 0
    assert capsys.readouterr().err == ""
    assert run("build", "-c", cfg(workdir), "-v", "--set", "projector.k=4") == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "StoreMismatchError" in err


def test_docs_page_is_current():
    """docs/cli.md holds every command's --help and the schema tables as generated now
    (python -m gradalg.cli.reference docs/cli.md rewrites them)."""
    from gradalg.cli import reference

    text = (ROOT / "docs" / "cli.md").read_text()
    assert reference.render(text) == text, "run: python -m gradalg.cli.reference docs/cli.md"
    for name in ("help", "help build", "help query", "help score", "help explain", "help inspect", "schema"):
        assert f"<!-- generated: {name} -->" in text


# ------------------------------------------------------------------- data and models
def _items(dataset):
    return [{k: v.tolist() for k, v in dataset[i].items()} for i in range(len(dataset))]


def test_data_formats_give_the_same_examples(workdir, tmp_path):
    """JSONL, parquet and a datasets folder of the same token ids load as the same items
    (an attention mask of ones added); text with a local tokenizer is tokenized."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gradalg.cli.config import load_config
    from gradalg.cli.loaders import load_data

    records = [json.loads(line) for line in (workdir / "gpt2_tiny" / "train.jsonl").read_text().splitlines()]
    for i, r in enumerate(records):
        r["name"] = f"ex{i}"
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "train.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "train_hf"))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded = {}
    for name in ("train.jsonl", "train.parquet", "train_hf"):
        (tmp_path / "c.toml").write_text(f'[data.train]\npath = "{name}"\nid_column = "name"\nmax_length = 9\n')
        data, ids = load_data(load_config(tmp_path / "c.toml"), "train")
        assert ids == [f"ex{i}" for i in range(len(records))]
        loaded[name] = _items(data)
    assert loaded["train.jsonl"] == loaded["train.parquet"] == loaded["train_hf"]
    first = loaded["train.jsonl"][0]
    assert first["input_ids"] == records[0]["input_ids"][:9] and first["attention_mask"] == [1] * len(first["input_ids"])

    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog"])}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]").save_pretrained(tmp_path / "tok")
    (tmp_path / "text.jsonl").write_text('{"text": "the cat sat on a mat"}\n{"text": "a dog"}\n')
    (tmp_path / "t.toml").write_text('[data.train]\npath = "text.jsonl"\ntext = "text"\ntokenizer = "tok"\n')
    data, _ = load_data(load_config(tmp_path / "t.toml"), "train")
    assert _items(data) == [{"input_ids": [1, 2, 3, 4, 6, 5], "attention_mask": [1] * 6},
                            {"input_ids": [6, 7], "attention_mask": [1, 1]}]


FACTORY = '''
import torch
from torch import nn


def mlp(d_in=6, hidden=8, classes=3):
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes)).double()


def points(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g, dtype=torch.float64),
                                          torch.randint(0, 3, (n,), generator=g))
'''


def test_factory_model_and_function_data(tmp_path, monkeypatch):
    """Any importable model and dataset: an MLP classifier, build + score, against the API."""
    (tmp_path / "cli_mlp.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mlp.toml").write_text('''
layers = ["0", "2"]
[model]
factory = "cli_mlp:mlp"
seed = 3
[task]
kind = "classification"
[data.train]
function = "cli_mlp:points"
kwargs = { n = 20, seed = 1 }
[data.queries]
function = "cli_mlp:points"
kwargs = { n = 3, seed = 2 }
[projector]
kind = "gaussian"
k = 12
[store]
path = "train.zarr"
chunk_rows = 7
[method]
name = "influence"
options = { damping = 0.01 }
[score]
output = "influence.csv"
''')
    assert run("build", "-c", tmp_path / "mlp.toml", "-q") == 0
    assert run("score", "-c", tmp_path / "mlp.toml", "-q") == 0
    import cli_mlp

    torch.manual_seed(3)
    task = ga.tasks.classification(cli_mlp.mlp().eval())
    train, queries = cli_mlp.points(20, 1), cli_mlp.points(3, 2)
    P = ga.proj.gaussian(12, 0)
    G = P(ga.grads(task, train, ["0", "2"]))
    stored = ga.store.open(tmp_path / "train.zarr", like=G)
    assert_close(torch.cat([v.flatten(1) for v in stored.to_dense().values()], 1),
                 torch.cat([v.flatten(1) for v in G.to_dense().values()], 1), rtol=1e-12, atol=1e-12)
    ref = ga.methods.influence(task, train, queries, layers=["0", "2"], projector=P, damping=0.01).compute()
    got = read_scores(tmp_path / "influence.csv").sel(query=ref["query"], train=ref["train"])
    assert_close(torch.from_numpy(got.values), torch.from_numpy(ref.values), rtol=1e-9, atol=1e-9)


def test_build_progress_lines_without_a_terminal(workdir, capsys, monkeypatch):
    """stderr not a terminal: plain lines with rows done, rate and ETA every --progress-interval s."""
    monkeypatch.setenv(layout.DELAY_ENV, "0.3")
    path = workdir / "progress.zarr"
    assert run("build", "-c", cfg(workdir), "--set", f"store.path='{path}'", "--set", "store.chunk_rows=4",
               "--progress-interval", "0.2") == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("build: ")]
    assert lines and all("rows/s" in line and "/6 chunks" in line for line in lines), err
    assert any("ETA" in line for line in lines), err
    assert "wrote" in err


def test_help_and_exit_codes_without_pydantic(workdir, capsys, monkeypatch):
    """`gradalg --help` needs no optional library; a command that reads a config says to
    install the `cli` extra (exit 6)."""
    monkeypatch.setitem(sys.modules, "pydantic", None)
    monkeypatch.delitem(sys.modules, "gradalg.cli.config")
    assert run("--help") == 0 and run("build", "--help") == 0
    capsys.readouterr()
    assert run("build", "-c", cfg(workdir)) == 6
    assert "pip install 'gradalg[cli]'" in capsys.readouterr().err


def test_exit_codes_follow_the_error_types_not_their_wording():
    from gradalg.cli.codes import MISSING_LIBRARY, RUN_REFUSED, STORE_UNUSABLE, exit_code

    assert exit_code(ga.errors.MissingLibraryError("x needs y: pip install 'gradalg[z]'")) == MISSING_LIBRARY
    assert exit_code(ga.errors.StoreNotFoundError("somewhere")) == STORE_UNUSABLE
    assert exit_code(FileNotFoundError("no store at x")) == 1       # a file the command did not expect: a bug
    assert exit_code(ga.errors.MemoryBudgetError("pip install more memory")) == RUN_REFUSED


def test_explain_reads_no_weights(workdir, capsys, tmp_path):
    """A checkpoint folder with a config.json and no weights: explain plans it (the model
    is built on the meta device), build says from_pretrained failed (exit 2)."""
    text = (workdir / "run.toml").read_text().replace('config = "gpt2_tiny/model"', 'checkpoint = "gpt2_tiny/model"')
    (tmp_path / "gpt2_tiny").symlink_to(workdir / "gpt2_tiny")
    (tmp_path / "ckpt.toml").write_text(text)
    assert run("explain", "-c", tmp_path / "ckpt.toml", "--what", "build", "--set",
               "data.train.path='/nonexistent.jsonl'") == 0
    assert "physical passes" in capsys.readouterr().out
    assert run("build", "-c", tmp_path / "ckpt.toml", "--set", f"store.path='{tmp_path / 'x.zarr'}'") == 2
    assert "model.checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_build_on_a_dask_cluster_equals_local(workdir):
    """[executor] kind = "dask": each chunk is a task on a local cluster; the store is
    bitwise the one built in this process."""
    pytest.importorskip("distributed")
    path = workdir / "dask.zarr"
    assert run("build", "-c", cfg(workdir), "-q", "--set", f"store.path='{path}'", "--set", "executor.kind='dask'",
               "--set", "executor.n_workers=1") == 0
    a, b = _raw(path), _raw(workdir / "gpt2_tiny" / "out" / "train.zarr")
    assert sorted(a) == sorted(b)
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_sigterm_and_ctrl_c_exit_with_the_resume_hint(workdir, capsys, monkeypatch):
    """A scheduler's SIGTERM (or Ctrl-C) mid-command: exit 143 (130) with how to resume; the
    previous SIGTERM handler is restored."""
    import gradalg.cli.build as build_cmd

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(build_cmd, "run", lambda args: signal.raise_signal(signal.SIGTERM))
    assert run("build", "-c", cfg(workdir)) == 143
    assert "SIGTERM" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(build_cmd, "run", interrupted)
    assert run("build", "-c", cfg(workdir)) == 130
    assert "run the same command again" in capsys.readouterr().err


def test_every_projector_kind_of_the_library_is_accepted(workdir, api):
    """The config's projector kinds are ga.proj's registered kinds (tensorsketch included), each with its
    constructor in ga.proj, and one scores."""
    from gradalg.cli.config import PROJECTOR_KINDS
    from gradalg.proj.kinds import REGISTRY
    assert set(PROJECTOR_KINDS) == set(REGISTRY)
    assert all(callable(getattr(ga.proj, kind)) and kind in ga.proj.__all__ for kind in REGISTRY)
    out = workdir / "s" / "ts.zarr"
    assert run("score", "-c", cfg(workdir), "-q", "--set", f"score.output='{out}'", "--set", "method.name='grad_dot'",
               "--set", "method.options={}", "--set", "projector.kind='tensorsketch'", "--set", "projector.k=32") == 0
    with ga.options(batch_size=4):
        P = ga.proj.tensorsketch(32, 0)
        G, Q = ga.grads(api["task"], api["train"], LAYERS), ga.grads(api["task"], api["queries"], LAYERS)
        ref = (P(Q) @ P(G).T).compute()
    got = read_scores(out).sel(query=ref["query"], train=ref["train"])
    assert_close(torch.from_numpy(np.asarray(got.values)), torch.from_numpy(ref.values), rtol=1e-9, atol=1e-9)
