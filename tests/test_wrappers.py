"""Wrapped models name blocks as the model they wrap, so their gradients combine.

DDP, FSDP2 and ``torch.compile`` run in one subprocess (gloo, world size 1:
``tests/dist_scripts/wrapped_names.py``), so this process's default group is left alone.
PEFT wrappers are tested in tests/test_peft.py.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradalg.capture.wrappers import display_name, strip_prefixes, unwrap

SCRIPT = os.path.join(os.path.dirname(__file__), "dist_scripts", "wrapped_names.py")
CASES = ["ddp_mlp", "ddp_gpt2_tied", "fsdp2_mlp", "compile_mlp", "prefixed_names"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("wrapped") / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, SCRIPT, str(out)], capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"the script exited with {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_wrapped_model_has_the_plain_models_blocks(results, case):
    assert results.get(case) == "ok", results.get(case, f"{case} did not run")


def test_unwrap_and_prefixes():
    inner = nn.Sequential(nn.Linear(2, 2))
    compiled = torch.compile(inner)
    assert unwrap(compiled) == (inner, ("_orig_mod.",))
    assert strip_prefixes("module._orig_mod.0", ("module.", "_orig_mod.")) == "0"
    assert strip_prefixes("0", ("module.",)) == "0"
    # a name the inner model has is its own, even when it looks like a prefix (Llama's "model.")
    assert strip_prefixes("model.layers.0", ("model.",), known={"model.layers.0": None}) == "model.layers.0"
    assert strip_prefixes("base_model.model.model.layers.0", ("base_model.", "model.")) == "model.layers.0"
    assert display_name("h.0.attn.c_attn.base_layer") == "h.0.attn.c_attn"
