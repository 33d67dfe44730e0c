"""What the old-tree-against-new benchmarks share: the small GPT-2 they measure, and the
runs in alternating processes.

:func:`tiny_gpt2` builds a 2-layer GPT-2 (n_embd 64, 2 heads, random weights, nothing
downloaded) and its summed next-token loss; :func:`alternate` runs a benchmark script's
``--child TREE`` once per tree per round, each in a fresh process with ``PYTHONPATH=TREE``
(one thread), the trees in alternation, printing each run's JSON line. Used by
``exec_overhead.py``, ``window_rows.py`` and ``diag_held.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


def tiny_gpt2(T: int = 32, vocab: int = 256, seed: int = 0):
    """``(model, lm_loss)``: a GPT-2 of 2 layers, n_embd 64, 2 heads, positions ``T``, in
    eval mode with every dropout 0, weights drawn with ``torch.manual_seed(seed)``;
    ``lm_loss(model, batch)`` is Σ over the (n, T) ids ``batch[0]`` of the next-token
    cross-entropy."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=vocab, n_positions=T, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()

    def lm_loss(model, batch):
        ids = batch[0]
        logits = model(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    return model, lm_loss


def alternate(script: str, trees, rounds: int, child_args=()) -> dict:
    """``{tree: [the child's JSON result per round]}``: ``script --child TREE *child_args``
    run ``rounds`` times per tree, alternating, each in a fresh one-thread process."""
    runs = {tree: [] for tree in trees}
    for _ in range(rounds):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            out = subprocess.run([sys.executable, os.path.abspath(script), "--child", tree, *map(str, child_args)],
                                 env=env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            print(out, flush=True)
            runs[tree].append(json.loads(out))
    return runs
