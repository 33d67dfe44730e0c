"""Model-sharded attribution with torch.distributed.

    torchrun --nproc_per_node 2 examples/torch_distributed.py            # CPU, gloo
    torchrun --nproc_per_node 8 examples/torch_distributed.py --ddp      # replicated instead of sharded

On GPUs (one process per GPU) the script picks NCCL and ``cuda:<LOCAL_RANK>``. The model is
a GPT-2 built from a config (random weights: nothing is downloaded), sharded with FSDP2
``fully_shard`` one block at a time; every rank computes EK-FAC influence over its part of
the training set and holds the same full (query, train) DataArray at the end.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel

import gradalg as ga


def sequences(n: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(8, 33, (1,), generator=g))
        ids = torch.randint(1, vocab, (length,), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp", action="store_true", help="replicate the model (DDP) instead of sharding it")
    parser.add_argument("--n-train", type=int, default=101)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))   # NCCL's object collectives use it
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(0)   # the same weights on every rank before sharding
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(device).eval()
    if args.ddp:
        model = DDP(model)
    else:
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)

    train, queries = sequences(args.n_train, 500, seed=1), sequences(4, 500, seed=2)
    task = ga.tasks.causal_lm(model)
    with ga.options(progress=False, batch_size=8):
        ex = ga.exec.TorchDistributed()
        S = ga.methods.influence(task, train, queries, curvature="ekfac",
                                 layers=["transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"])
        if dist.get_rank() == 0 and os.environ.get("EXPLAIN"):
            print(S.explain(executor=ex))
        scores = S.compute(executor=ex)      # every rank: the same (4, n_train) DataArray
    if dist.get_rank() == 0:
        print(scores.shape, "top training examples per query:", scores.argmax("train").values)
        for t in ex.traffic:   # what rank 0 sent and received per pass over data
            print(f"{t['pass']}: sent {t['part_bytes'] / 2**20:.2f} MiB of partial states, "
                  f"received {t['result_bytes'] / 2**20:.2f} MiB of results")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
