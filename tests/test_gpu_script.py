"""benchmarks/gpu.py runs end to end on the CPU with ``--smoke`` (tiny GPT-2, GPT-NeoX,
Llama and Qwen2 configs, T = 64, and a tiny W3): every method family's scores are computed
through the same code path the GPU run takes, checked finite and of shape (query, train),
and written as JSON and markdown; the hard time limit stops a run and still writes its
report. The GPU numbers themselves come from running the script on a GPU machine."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_script_smoke_run_writes_every_method_for_every_model_and_w3(tmp_path):
    gpu = _load()
    out = tmp_path / "smoke"
    report = gpu.main(["--smoke", "--out", str(out), "--n-train", "8", "--n-query", "2", "--batch", "4",
                       "--w3-repeats", "1"])
    written = json.loads(out.with_suffix(".json").read_text())
    assert written["models"].keys() == set(gpu.MODELS) == report["models"].keys()
    assert "stopped" not in written
    w3 = written["w3"]
    assert w3["layers"] == 8 and w3["plain_seconds"] > 0           # 2 blocks × 4 Linear (Conv1D swapped)
    assert list(w3["variants"]) == list(gpu.W3_VARIANTS)
    for variant, row in w3["variants"].items():
        assert "skipped" not in row and "error" not in row, (variant, row)
        assert row["seconds"] > 0 and math.isclose(row["ratio"], row["seconds"] / w3["plain_seconds"])
    assert written["tokens"] == 64 and written["dtype"] == "bfloat16"
    for name, res in written["models"].items():
        assert res["plain"]["seconds"] > 0 and res["plain"]["tokens_per_s"] > 0
        assert list(res["methods"]) == list(gpu.METHODS)
        for method, row in res["methods"].items():
            assert "skipped" not in row and "error" not in row, (name, method, row)
            assert row["seconds"] > 0 and math.isclose(row["ratio"], row["seconds"] / res["plain"]["seconds"])
            assert row["passes_over_data"] >= 1 and row["estimated_h200_seconds"] > 0
    table = out.with_suffix(".md").read_text()
    for method in gpu.METHODS:
        assert f"| {method} |" in table
    assert "## W3: GPT-2-small width, 8 block Linears" in table


def test_gpu_script_hard_limit_stops_and_writes_the_report(tmp_path, monkeypatch):
    import time
    gpu = _load()
    out = tmp_path / "stopped"
    # the method runs past the limit in Python (where the alarm lands for certain); a limit of
    # a fraction of a second could land in the model's preparation, a race on a loaded machine
    monkeypatch.setattr(gpu, "run_method", lambda *args, **kwargs: time.sleep(120))
    report = gpu.main(["--smoke", "--out", str(out), "--models", "gpt2-small", "--methods", "trak", "--no-w3",
                       "--n-train", "8", "--n-query", "2", "--batch", "4", "--hard-s", "8"])
    written = json.loads(out.with_suffix(".json").read_text())
    assert "--hard-s reached" in written["stopped"] == report["stopped"]
    assert "Stopped by the hard time limit" in out.with_suffix(".md").read_text()


def test_gpu_script_default_out_is_under_OUT(monkeypatch, tmp_path):
    gpu = _load()
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu._out_path(None) == tmp_path / "gpu"
    assert gpu._out_path("x/y") == Path("x/y")
