"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): HF Trainer under DDP over a streaming
``IterableDataset`` (accelerate dispatches slices of each global batch to the ranks). Writes
{"result": "ok"} or the failure to argv[1] (rank 0).

Checks: with an index column, each rank's rows hold the tokens of the examples their ids
name and the ranks' ids together cover the stream once; with ``ids="auto"`` (rows numbered
in order) nothing fails and ``gather`` numbers the global rows 0..n-1.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from gradalg.integrations import gather
from models import gpt2, padded_token_data

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
R, W = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)


class Stream(IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def run() -> None:
    from transformers import Trainer, TrainingArguments

    from gradalg.integrations.hf import GradientCallback

    layers = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"]
    ids, mask = padded_token_data(n=12, seed=13)
    labels = ids.masked_fill(mask == 0, -100)
    ds = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i], "idx": i} for i in range(12)]
    column = GradientCallback(layers=layers, ids="idx", record=("input_ids",))
    auto = GradientCallback(layers=layers)
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(output_dir=d, per_device_train_batch_size=3, gradient_accumulation_steps=1,
                                 max_steps=2, learning_rate=0.1, use_cpu=True, report_to=[], logging_strategy="no",
                                 save_strategy="no", seed=0, optim="sgd", lr_scheduler_type="constant",
                                 max_grad_norm=0.0, disable_tqdm=True, ddp_backend="gloo",
                                 remove_unused_columns=False)
        Trainer(model=gpt2(), args=args, train_dataset=Stream(ds), callbacks=[column, auto]).train()
    mine = column.grads
    assert mine.n == 6, mine.n
    for row, i in zip(column.inputs["input_ids"], mine.ids):
        assert torch.equal(row, ds[i]["input_ids"]), f"rank {R}: row labelled {i} holds other tokens"
    everyone = [None] * W
    dist.all_gather_object(everyone, list(mine.ids))
    assert sorted(everyone[0] + everyone[1]) == list(range(12)), everyone   # the stream, each example once
    assert auto.grads.n == 6
    assert sorted(gather(auto.grads).ids) == list(range(12))


if __name__ == "__main__":
    out = sys.argv[1]
    try:
        run()
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
