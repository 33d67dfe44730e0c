"""Bytes a Dask pass ships: the model pickled with every pass vs. built on the workers.

GPT-2 built from a config (4 layers, width 256, the GPT-2 vocabulary of 50,257, tied
embeddings), N training sequences of T tokens, 4 queries, on a 2-process LocalCluster:

* **pickled**: ``DaskExecutor(client)``: the pass's payload (jobs, held rows and the
  model) is pickled on the client and scattered to every worker, once per pass;
* **factory**: ``DaskExecutor(client, model_fn=WorkerModel(build_gpt2))``: the model
  travels as a reference (the factory and the client's fingerprints) and each worker
  builds it once;
* **meta client**: the same factory, with the client holding ``spec.meta()`` (no weights
  anywhere but on the workers; the 4-query pass runs on a worker too).

For Grad-Dot and LoGra-style projected influence (``ga.proj.kron(k=64)``, a Fisher in
projected space) it prints, per pass: the payload each worker receives (the rest of a
factory's payload is the jobs and held rows: Grad-Dot holds the 4 queries' factored
gradients), what the shard tasks send back, and the wall time of the whole compute
(shown on its first pass; a factory's first compute includes each worker's one build),
side by side in one run. Scores of the three equal the local executor's (largest
difference printed).

Last, the size of the reference a task ships for a Llama-70B configuration (meta device).

    python benchmarks/dask_payload.py [--n 32] [--T 32]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F


def build_gpt2(n_layer: int = 4, n_embd: int = 256, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, n_positions=128,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).eval()


def lm_loss(model, batch):
    (ids,) = batch
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="sum")


def methods(model, n: int, T: int):
    import gradalg as ga

    gen = torch.Generator().manual_seed(1)
    train = (torch.randint(0, 50257, (n, T), generator=gen),)
    queries = (torch.randint(0, 50257, (4, T), generator=gen),)
    task = ga.Task(model, lm_loss, name="gpt2-4x256")
    layers = "transformer.h.*.mlp.*"
    G, Q = ga.grads(task, train, layers, batch_size=8), ga.grads(task, queries, layers)
    P = ga.proj.kron(k=64, seed=0)
    yield "grad_dot", Q @ G.T
    yield "projected influence", P(Q) @ ga.fisher(P(G)).damp(1e-3).inv() @ P(G).T


def build_llama_70b():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=128256, torch_dtype=torch.bfloat16)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def reference_of_a_70b_model() -> None:
    """The ModelRef a task ships for a Llama-70B configuration held on the meta device."""
    import pickle

    import gradalg as ga
    from gradalg.exec.models import make_ref

    spec = ga.exec.WorkerModel(build_llama_70b)
    model = spec.meta()
    ref = make_ref(model, spec)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"Llama-70B configuration on the meta device: {sum(p.numel() for p in model.parameters()) / 1e9:.1f} B "
          f"parameters, {weights / 1e9:.0f} GB in bfloat16; its ModelRef pickles to "
          f"{len(pickle.dumps(ref)) / 1024:.0f} kB ({len(ref.structure)} architecture lines)")


def _warm_up():
    import transformers  # noqa: F401

    import gradalg  # noqa: F401


def main():
    import gradalg as ga
    from distributed import Client, LocalCluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--T", type=int, default=32)
    args = parser.parse_args()

    spec = ga.exec.WorkerModel(build_gpt2)
    model = spec.build()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"GPT-2 4x256: {sum(p.numel() for p in model.parameters()):,} parameters, {weights / 2**20:.1f} MiB; "
          f"n={args.n}, T={args.T}, 4 queries, 2 worker processes\n")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client, ga.options(progress=False):
        client.run(_warm_up)     # imports on the workers: not counted in the first executor's time
        runs = {"pickled": (ga.exec.DaskExecutor(client, min_shard_examples=8), model),
                "factory": (ga.exec.DaskExecutor(client, min_shard_examples=8, model_fn=spec), model),
                "meta client": (ga.exec.DaskExecutor(client, min_shard_examples=8, model_fn=spec), spec.meta())}
        rows = []
        for (name, S_local) in methods(model, args.n, args.T):
            local = S_local.compute().values
            for how, (ex, client_model) in runs.items():
                S = dict(methods(client_model, args.n, args.T))[name]
                first = len(ex.transfers)
                start = time.perf_counter()
                got = S.compute(executor=ex).values
                seconds = time.perf_counter() - start
                for t in ex.transfers[first:]:
                    rows.append((name, how, t["pass"], t["payload_bytes"], sum(t["result_bytes"]),
                                 len(t["result_bytes"]), seconds, float(np.abs(got - local).max())))
                    seconds = float("nan")       # the time is the whole compute's: shown on its first pass
        print(f"{'method':<20} {'executor':<12} {'pass':<34} {'payload/worker':>15} {'returned':>11} "
              f"{'tasks':>5} {'seconds':>8} {'max |diff|':>10}")
        for name, how, label, payload, back, tasks, seconds, diff in rows:
            print(f"{name:<20} {how:<12} {label:<34} {payload / 1024:>12.1f} kB {back / 1024:>8.1f} kB "
                  f"{tasks:>5} {seconds:>8.2f} {diff:>10.1e}")
        by = {}
        for name, how, label, payload, *_ in rows:
            by.setdefault((name, label), {})[how] = payload
        print()
        for (name, label), sizes in by.items():
            if "pickled" in sizes and "factory" in sizes:
                print(f"{name}, {label}: the pickled payload is {sizes['pickled'] / sizes['factory']:,.1f}x the "
                      f"factory's ({(sizes['pickled'] - sizes['factory']) / 2**20:.1f} MiB less per worker per pass)")


if __name__ == "__main__":
    main()
    reference_of_a_70b_model()
