"""benchmarks/real_scale.py runs end to end in a tiny mode (a 2-layer GPT-2, T = 32, one
method, one subprocess), records a resumable JSON and prints its markdown table; the
parent's time guard kills a run and records it. The real-size numbers come from running
the script itself (docs/performance.md)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_scale.py"


def _load():
    spec = importlib.util.spec_from_file_location("real_scale_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_records_a_resumable_result_and_its_table(tmp_path, capsys, monkeypatch):
    rs = _load()
    results = tmp_path / "rs.json"
    argv = ["--models", "tiny-gpt2", "--T", "32", "--methods", "grad_dot", "--train", "4", "--queries", "2",
            "--results", str(results), "--timeout", "300"]
    runs = rs.main(argv)
    (rec,) = json.loads(results.read_text())["runs"]
    assert runs == [rec]
    assert rec["status"] == "ok", rec
    assert (rec["model"], rec["T"], rec["method"], rec["train"], rec["queries"]) == ("tiny-gpt2", 32, "grad_dot", 4, 2)
    assert rec["tokens"] == 6 * 32 and rec["parameters"] > 0
    assert math.isclose(rec["ratio"], rec["seconds"] / rec["plain_seconds"])
    assert math.isclose(rec["seconds_per_1k_tokens"], 1000 * rec["seconds"] / rec["tokens"])
    assert rec["peak_rss_bytes"] > 0 and rec["memory_budget"] > 0
    assert rec["passes"] and all(p["estimated"] > 0 and p["measured"] > 0 for p in rec["passes"])
    # a rerun skips what is recorded: no subprocess is started
    monkeypatch.setattr(rs, "launch", lambda *a, **k: pytest.fail("a recorded run was started again"))
    assert rs.main(argv) == [rec]
    capsys.readouterr()
    rs.main(["--table", "--results", str(results)])
    table = capsys.readouterr().out
    assert "| tiny-gpt2 (" in table and "| 32 | grad_dot |" in table
    # old beside new: the same run found in the other file
    rs.main(["--table", "--results", str(results), "--before", str(results)])
    table = capsys.readouterr().out
    assert "before: × fwd+bwd (CPU), peak" in table and f"| {rec['cpu_ratio']:.2f}, " in table


def test_time_guard_kills_and_records_and_refusals_print():
    rs = _load()
    spec = {"model": "tiny-gpt2", "T": 32, "method": "grad_dot", "train": 4, "queries": 2, "data": "random",
            "dtype": "float32", "device": "cpu", "threads": 1, "memory_budget_arg": None, "cache": "/tmp"}
    rec = rs.launch(spec, timeout=0.5, max_rss=6e9)
    assert rec["status"] == "killed" and "timeout" in rec["message"]
    refused = {**spec, "status": "refused", "message": "MemoryBudgetError: too big | raise the budget"}
    assert "refused: MemoryBudgetError: too big" in rs.line_of(refused)
    assert "refused: MemoryBudgetError: too big \\| raise the budget" in rs.markdown([refused])


def test_gpt2_byte_mapping_is_gpt2s():
    rs = _load()
    ids = rs.gpt2_byte_ids()
    assert sorted(ids) == list(range(256))
    assert ids[ord("!")] == 0 and ids[ord(" ")] == 220 and ids[ord("\n")] == 198   # "Ġ", "Ċ" in GPT-2's vocab


def test_check_table_judges_each_condition_and_merges_files(tmp_path, capsys):
    rs = _load()
    base = {"T": 128, "train": 8, "queries": 2, "data": "random", "dtype": "float32", "device": "cpu", "threads": 1,
            "memory_budget_arg": None, "status": "ok", "cpu_ratio": 1.5}

    def ok(model, method, peak, cpu, passes):
        return {**base, "model": model, "method": method, "peak_rss_bytes": peak * 1e9, "memory_budget": 4e9,
                "cpu_seconds": cpu, "passes": [{"estimated": 1.0, "measured": 9.0, "measured_cpu": p} for p in passes]}

    logra = ok("opt-125m", "logra", 2.0, 10.0, [1.0, 2.9])
    trak = ok("opt-125m", "trak", 6.1, 21.0, [0.9])                 # 1.525× the budget, 2.1× LoGra
    slow = ok("olmoe-2l", "influence_ekfac", 5.0, 50.0, [1.0, 3.3])
    killed = {**base, "model": "gemma3-270m", "method": "less", "status": "killed",
              "message": "killed: resident memory 8.0 GB over --max-rss-gb 8.0"}
    assert rs.check_cells(logra, [logra]) == ("scores ✓", "0.50 ✓", "2.9 ✓", "")
    assert rs.check_cells(trak, [logra, trak]) == ("scores ✓", "1.52 ✗", "0.9 ✓", "2.10 ✗")
    assert rs.check_cells(slow, [slow])[2] == "3.3 ✗"
    assert rs.check_cells(killed, [killed]) == ("killed", "", "", "")
    # the older file's record of the same key gives way to the newer one's
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    rs.save_results(old, [logra, killed])
    rs.save_results(new, [{**killed, **ok("gemma3-270m", "less", 3.0, 5.0, [1.0])}, trak])
    rs.main(["--table", "--check", "--results", str(new), "--merge", str(old)])
    table = capsys.readouterr().out
    assert "| gemma3-270m | 128 | less | scores ✓ |" in table and "killed" not in table
    assert "| opt-125m | 128 | trak | scores ✓ | 1.50 | 6.10 / 4.00 | 1.52 ✗ | 0.9 ✓ | 2.10 ✗ |  |" in table


def test_every_model_builds_with_the_parameter_count_its_docstring_states():
    """Each ``--models`` key builds from its ``transformers`` config (on the meta device:
    nothing allocated), and its parameter count rounds to the "(N M)" the module's
    docstring gives for it (the sizes the performance tables quote)."""
    import re

    import torch
    rs = _load()
    stated = {m: int(n) for m, n in re.findall(r"^    ([a-z0-9.-]+) .*?(?:\n {17}.*?)*\((\d+) M", rs.__doc__, re.M)}
    assert {"phi-160m", "bloom-250k", "falcon-mq", "mistral-swa", "qwen2moe-2l"} <= set(stated)
    for name in stated:
        cls, config = rs.build_config(name, 128)
        with torch.device("meta"):
            model = cls(config)
        assert round(sum(p.numel() for p in model.parameters()) / 1e6) == stated[name], name
