"""One process (gloo, world size 1): block names and gradients of a model and its wrappers.

For each wrapper (DDP, FSDP2 ``fully_shard``, ``torch.compile``) on an MLP and a tied
GPT-2: ``ga.grads`` of the wrapped model and ``ga.capture`` around it give the blocks of
the plain model (same names), and captured @ post-hoc equals the plain model's Gram
matrix. Writes {case: "ok" | reason} as JSON to argv[1].
"""
import copy
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import gradalg as ga  # noqa: E402
from models import lm_loss, padded_token_data  # noqa: E402

F64 = torch.float64


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(F64)


def mlp_loss(m, b):
    return F.cross_entropy(m(b[0]), b[1], reduction="sum")


def tied_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=29, n_positions=16, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).to(F64).eval()


def gram(A, B):
    return torch.as_tensor((A @ B.T).compute().values)


def check(make, loss, data, wrap, token_mask=None):
    plain = make()
    wrapped = wrap(copy.deepcopy(plain))
    G0 = ga.grads(ga.Task(plain, loss, token_mask=token_mask), data)
    ref = gram(G0, G0)
    G1 = ga.grads(ga.Task(wrapped, loss, token_mask=token_mask), data)
    assert G1.space.names == G0.space.names, (G1.space.names, G0.space.names)
    with ga.capture(wrapped) as cap:
        n = data[0].shape[0]
        for i in range(0, n, 3):
            wrapped.zero_grad()
            loss(wrapped, tuple(t[i:i + 3] for t in data)).backward()
    assert cap.grads.space.names == G0.space.names, (cap.grads.space.names, G0.space.names)
    for what, S in (("grads", gram(G1, G0)), ("capture x grads", gram(cap.grads, G1)),
                    ("capture x plain", gram(cap.grads, G0))):
        err = float((S - ref).norm() / ref.norm())
        assert err < 1e-10, f"{what}: relative error {err:.2e}"


def ddp(m):
    return nn.parallel.DistributedDataParallel(m)


def fsdp2(m):
    from torch.distributed.fsdp import fully_shard
    for sub in list(m.modules())[1:]:
        if isinstance(sub, nn.Linear):
            fully_shard(sub)
    fully_shard(m)
    return m


def compiled(m):
    return torch.compile(m)


def main(out):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    x, y = torch.randn(6, 5, dtype=F64, generator=torch.Generator().manual_seed(1)), torch.arange(6) % 3
    ids, mask = padded_token_data(n=5, vocab=29, min_len=3, max_len=7, seed=1)
    tm = lambda b: b[1].bool()  # noqa: E731
    results = {}
    cases = {
        "ddp_mlp": lambda: check(mlp, mlp_loss, (x, y), ddp),
        "ddp_gpt2_tied": lambda: check(tied_gpt2, lm_loss, (ids, mask), ddp, tm),
        "fsdp2_mlp": lambda: check(mlp, mlp_loss, (x, y), fsdp2),
        "compile_mlp": lambda: check(mlp, mlp_loss, (x, y), compiled),
        "prefixed_names": lambda: _prefixed(),
    }
    for name, fn in cases.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = traceback.format_exc()[-2000:]
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


def _prefixed():
    m = ddp(mlp())
    task = ga.Task(m, mlp_loss)
    data = (torch.randn(4, 5, dtype=F64), torch.arange(4) % 3)
    assert ga.grads(task, data, layers=["module.0"]).space.names == ("0",)
    assert ga.grads(task, data, layers=["module.*"]).space.names == ("0", "2")
    c = compiled(mlp())
    assert ga.grads(ga.Task(c, mlp_loss), data, layers=["_orig_mod.2"]).space.names == ("2",)


if __name__ == "__main__":
    main(sys.argv[1])
