"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): HF Trainer under DDP, rows labelled with
dataset indices and streamed per rank. Writes {"ok": true} or the failure to argv[1] (rank 0).

Checks: each rank's rows hold the tokens of the examples their ids name; the two ranks'
ids together cover the epoch exactly once; ``gather`` keeps the ids; the per-rank
streams, opened together, equal the projected gathered rows (rank order), bitwise.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import torch
import torch.distributed as dist

import gradalg as ga
from gradalg.integrations import StoreStream, gather, open_stream
from models import gpt2, padded_token_data

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
R, W = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)


def run(shared: str) -> None:
    from transformers import Trainer, TrainingArguments

    from gradalg.integrations.hf import GradientCallback

    layers = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"]
    ids, mask = padded_token_data(n=12, seed=13)
    labels = ids.masked_fill(mask == 0, -100)
    ds = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(12)]
    P = ga.proj.kron(k=4, seed=0)
    mem = GradientCallback(layers=layers, record=("input_ids",))
    streamed = GradientCallback(layers=layers, stream=StoreStream(os.path.join(shared, "rows"), P, flush_rows=4))
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(output_dir=d, per_device_train_batch_size=3, gradient_accumulation_steps=1,
                                 max_steps=2, learning_rate=0.1, use_cpu=True, report_to=[], logging_strategy="no",
                                 save_strategy="no", seed=0, optim="sgd", lr_scheduler_type="constant",
                                 max_grad_norm=0.0, disable_tqdm=True, ddp_backend="gloo")
        Trainer(model=gpt2(), args=args, train_dataset=ds, callbacks=[mem, streamed]).train()
    assert args.world_size == W == 2
    mine = mem.grads
    assert mine.n == 6, mine.n
    for row, i in zip(mem.inputs["input_ids"], mine.ids):
        assert torch.equal(row, ds[i]["input_ids"]), f"rank {R}: row labelled {i} holds other tokens"
    everyone = [None] * W
    dist.all_gather_object(everyone, list(mine.ids))
    assert sorted(everyone[0] + everyone[1]) == list(range(12)), everyone   # one epoch, each example once
    g_step, g_rank = gather(mine), gather(mine, order="rank")
    assert list(g_rank.ids) == everyone[0] + everyone[1]
    assert sorted(g_step.ids) == list(range(12))
    dist.barrier()
    if R == 0:
        G = open_stream(os.path.join(shared, "rows"))
        assert list(G.ids) == list(g_rank.ids), (G.ids, g_rank.ids)
        a, b = G.to_dense(), P(g_rank).to_dense()
        for name in b:
            assert torch.equal(a[name], b[name]), name


if __name__ == "__main__":
    out = sys.argv[1]
    shared = sys.argv[2]
    try:
        run(shared)
        result = "ok"
    except Exception:  # noqa: BLE001 - reported to the test
        result = traceback.format_exc(limit=8)
    everyone = [None] * W
    dist.all_gather_object(everyone, result)
    if R == 0:
        with open(out, "w") as f:
            json.dump({"result": next((r for r in everyone if r != "ok"), "ok")}, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
