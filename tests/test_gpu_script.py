"""benchmarks/gpu.py runs end to end on the CPU with ``--smoke`` (tiny GPT-2 and Qwen2
configs, T = 64): every method family's scores are computed through the same code path
the GPU run takes, checked finite and of shape (query, train), and written as JSON and
markdown. The GPU numbers themselves come from running the script on a GPU machine."""
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


def test_gpu_script_smoke_run_writes_every_method_for_both_models(tmp_path):
    gpu = _load()
    out = tmp_path / "smoke"
    report = gpu.main(["--smoke", "--out", str(out), "--n-train", "8", "--n-query", "2", "--batch", "4"])
    written = json.loads(out.with_suffix(".json").read_text())
    assert written["models"].keys() == {"gpt2-small", "qwen2-0.5b"} == report["models"].keys()
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


def test_gpu_script_default_out_is_under_OUT(monkeypatch, tmp_path):
    gpu = _load()
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu._out_path(None) == tmp_path / "gpu"
    assert gpu._out_path("x/y") == Path("x/y")
