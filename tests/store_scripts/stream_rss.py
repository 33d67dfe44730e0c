"""Peak RSS of a training loop: no capture ("plain"), every factored row kept ("keep"), or
rows projected and streamed to a store ("stream"). Prints one JSON line.

    python stream_rss.py MODE WORKDIR

A GPT-2 of about 0.46 M parameters (2 layers, width 64, vocab 2000, 64 positions),
512 sequences of 64 tokens, batch 16 (32 steps), capture on every attention and MLP
Conv1D and the head, float32.
"""
import json
import os
import resource
import sys

import torch
import torch.nn.functional as F

import gradalg as ga


def peak_mb() -> float:
    """This process's peak resident memory in MB: the kernel's VmHWM of its own address
    space. (``ru_maxrss`` survives exec on Linux: a child of a large pytest worker would
    report the worker's peak.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(mode, workdir):
    import dask.array  # noqa: F401 - the store's libraries, imported in every mode so that only rows differ
    import xarray  # noqa: F401
    import zarr  # noqa: F401
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=2000, n_positions=64, tie_word_embeddings=False,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    layers = ["transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_*", "lm_head"]
    data = torch.randint(0, 2000, (512, 64), generator=torch.Generator().manual_seed(1))
    tc = None
    if mode != "plain":
        tc = ga.integrations.training_capture(model, layers, optimizer=opt, keep=(mode == "keep"))
    stream = None
    if mode == "stream":
        stream = ga.integrations.StoreStream(os.path.join(workdir, "rss.grads"), ga.proj.kron(k=64, seed=0),
                                             flush_rows=128, overwrite=True).attach(tc)
    ctx = tc if tc is not None else open(os.devnull)
    with ctx:
        for s in range(32):
            ids = data[16 * s:16 * (s + 1)]
            if tc is not None:
                tc.ids_next(range(16 * s, 16 * (s + 1)))
            logits = model(input_ids=ids).logits[:, :-1]
            F.cross_entropy(logits.reshape(-1, 2000), ids[:, 1:].reshape(-1), reduction="sum").backward()
            opt.step()
            opt.zero_grad()
    rows = 0
    if mode == "keep":
        rows = tc.grads.n
    if stream is not None:
        stream.close()
        rows = ga.integrations.open_stream(stream.path).n
    peak = peak_mb()
    print(json.dumps({"mode": mode, "peak_mb": round(peak, 1), "rows": rows, "params": n_params}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
