"""Independent references for the tests: per-example gradients from ``ga.per_example_grads``
(torch.func) laid out as gradalg's blocks, written without gradalg's layer rules."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradalg as ga

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread while a module's tests run: their tensors are tiny, and with
    ``-n 2`` on two cores more threads only contend (measured: 4-10× slower under load).
    Import it into a test module to apply it there; restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def block_rows(model: nn.Module, layers, grads: dict) -> torch.Tensor:
    """Reference per-example gradients ``{param: (n, *shape)}`` laid out as hook blocks.

    Canonical (out, in) orientation with the bias as the last input column: Linear
    ``[W | b]``, HF Conv1D ``[Wᵀ | b]``, Conv2d ``[W.flatten | b]``, Embedding ``Wᵀ``; a
    fused experts module's ``<module>.<matrix>.<e>``: ``grads["<module>.<matrix>"][:, e]``.
    Returns (n, dim) in the order of ``layers``.
    """
    from transformers.pytorch_utils import Conv1D

    modules = dict(model.named_modules())
    parts = []
    for name in layers:
        if name not in modules:     # one expert's matrix of a fused experts module: "<module>.<matrix>.<e>"
            owner, matrix, e = name.rsplit(".", 2)
            parts.append(grads[f"{owner}.{matrix}"][:, int(e)].flatten(1))
            continue
        m = modules[name]
        W = grads[f"{name}.weight"]
        bias = grads.get(f"{name}.bias")
        if isinstance(m, (nn.Embedding, Conv1D)):
            block = W.transpose(1, 2)
        elif isinstance(m, nn.Conv2d):
            block = W.flatten(2)
        else:
            block = W
        if bias is not None:
            block = torch.cat([block, bias.unsqueeze(-1)], dim=-1)
        parts.append(block.flatten(1))
    return torch.cat(parts, dim=1).to(F64)


def reference_rows(task, batch, layers) -> torch.Tensor:
    names = [f"{layer}.{p}" for layer in layers
             for p, _ in dict(task.model.named_modules())[layer].named_parameters(recurse=False)]
    return block_rows(task.model, layers, ga.per_example_grads(task, batch, names))


def func_rows(task, batch, layers) -> torch.Tensor:
    """Reference of ``backend="func"``: each layer's parameters flattened in module order."""
    modules = dict(task.model.named_modules())
    names = [f"{layer}.{p}" for layer in layers for p, _ in modules[layer].named_parameters(recurse=False)]
    grads = ga.per_example_grads(task, batch, names)
    return torch.cat([grads[n].flatten(1) for n in names], dim=1).to(F64)


def vocabulary_names(model: nn.Module) -> list[str]:
    """The module names of ``model.get_input_embeddings()`` and ``get_output_embeddings()``
    in model order: the vocabulary layers the ``ga.tasks`` language tasks add to the block
    linears when the vocabulary is at most ``ga.options().vocabulary_layers_max`` (found
    here from HF's accessors, not from gradalg's rule)."""
    modules = dict(model.named_modules())
    by_id = {id(m): n for n, m in modules.items()}
    found = [model.get_input_embeddings(), model.get_output_embeddings()]
    names = {by_id[id(m)] for m in found if m is not None and id(m) in by_id}
    return sorted(names, key=list(modules).index)


def lm_default_names(model: nn.Module, blocks) -> list[str]:
    """The language tasks' default layers at a small vocabulary: the block linears ``blocks``
    and the vocabulary layers, as blocks (a tied embedding/head once, by its first name)."""
    from gradalg.capture.hooks import resolve_layers
    return [r.name for r in resolve_layers(model, list(blocks) + vocabulary_names(model))]


def run_one_rank(source: str, tmp_path, name: str = "one_rank.py", timeout: int = 300):
    """Run ``source`` as a script in a fresh process, one thread, with this checkout on
    ``PYTHONPATH`` and a free local port as ``sys.argv[1]`` (for a one-rank gloo group:
    ``MASTER_PORT``). Returns the ``subprocess.CompletedProcess`` (stdout and stderr as text)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(tmp_path) / name
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, env=env,
                          timeout=timeout)
