"""What the vocabulary layers cost: methods with and without the embedding / LM head, by vocabulary size.

The measurement behind ``ga.options(vocabulary_layers_max)`` (the largest vocabulary whose
input embedding and LM head the ``ga.tasks`` language tasks attribute by default). A tied
GPT-2 of the fidelity suite's real-text shape (``benchmarks/fidelity_text.py``: 2 layers,
n_embd 32, 2 heads; random init) with vocabulary V ∈ ``--vocab`` (default 1k, 4k, 8k, 16k,
32k), ``--n-train`` (256) random sequences of 40 tokens and ``--n-query`` (64) queries. Per
V and method (at its defaults otherwise), two layer sets:

    blocks      ga.TransformerBlocks()                       the linear layers in the blocks
    + vocab     ga.TransformerBlocks(vocabulary=True)        + transformer.wte (tied to lm_head)

Each row is the **CPU time** (``time.process_time``, one thread) of ``Scores.compute()`` and
its ratio to one plain forward + backward over the training set in batches of 32 (measured
in the same process), and the plan's counted peak bytes. The two layer sets alternate in one
process, so load moves both. The curvature methods at V = 16,384 (a dense float32 V × V
factor of 4.3 GB at its eigendecomposition) are skipped unless ``--wide-curvature``: their
cost is the eigendecomposition's, given beside the table by ``--eigh`` (float64 up to
``kron_float64_width`` = 8192, float32 above; cubic in V). Above ``kron_diagonal_width``
(16,384) the factor is kept diagonal, with no eigendecomposition.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 python benchmarks/vocabulary_layers.py
    ... --vocab 1024,4096 --methods grad_dot,ekfac
    ... --eigh 1024,2048,4096,8192            # the V × V eigendecomposition alone
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import gradalg as ga

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "grad_dot": lambda t, tr, qu, L: ga.methods.grad_dot(t, tr, qu, layers=L),
    "logra": lambda t, tr, qu, L: ga.methods.logra(t, tr, qu, layers=L),
    "trak": lambda t, tr, qu, L: ga.methods.trak(t, tr, qu, layers=L),
    "ekfac": lambda t, tr, qu, L: ga.methods.influence(t, tr, qu, layers=L, curvature="ekfac"),
    "kfac": lambda t, tr, qu, L: ga.methods.influence(t, tr, qu, layers=L, curvature="kfac"),
}
CURVATURE = ("ekfac", "kfac")
LAYER_SETS = {"blocks": ga.TransformerBlocks(), "+ vocab": ga.TransformerBlocks(vocabulary=True)}


def setting(vocab: int, n_train: int, n_query: int, length: int = 40, seed: int = 0):
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    items = [{"input_ids": torch.randint(1, vocab, (length,), generator=g)} for _ in range(n_train + n_query)]
    return model, items[:n_train], items[n_train:]


def forward_backward_seconds(model, items, batch=32) -> float:
    """CPU seconds of one plain forward + backward of the summed loss over ``items``."""
    t0 = time.process_time()
    for s in range(0, len(items), batch):
        ids = torch.stack([d["input_ids"] for d in items[s:s + batch]])
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - t0


def peak_bytes(scores) -> int | None:
    try:
        return int(scores.explain().to_dict()["estimated_peak_bytes"])
    except Exception:   # noqa: BLE001 - a plan without the field: not shown
        return None


def run(vocabs, methods, n_train, n_query, wide_curvature=False):
    rows = []
    model, train, queries = setting(64, 8, 2)      # warm-up: the device profile, first-call costs
    for method in methods:
        METHODS[method](ga.tasks.causal_lm(model), train, queries, LAYER_SETS["+ vocab"]).compute()
    for vocab in vocabs:
        model, train, queries = setting(vocab, n_train, n_query)
        task = ga.tasks.causal_lm(model)
        fb = forward_backward_seconds(model, train)
        dims = {label: coordinates(model, sel) for label, sel in LAYER_SETS.items()}
        for method in methods:
            if method in CURVATURE and 8192 < vocab <= ga.get_options().kron_diagonal_width and not wide_curvature:
                print(f"V={vocab:>6} {method:>8}: skipped (a dense float32 {vocab}×{vocab} factor; --wide-curvature)",
                      flush=True)
                continue
            for label, sel in LAYER_SETS.items():
                S = METHODS[method](task, train, queries, sel)
                t0 = time.process_time()
                S.compute()
                cpu = time.process_time() - t0
                row = {"vocab": vocab, "method": method, "layers": label, "cpu_s": round(cpu, 3),
                       "forward_backward_cpu_s": round(fb, 4), "x_forward_backward": round(cpu / fb, 2),
                       "coordinates": dims[label], "planned_peak_bytes": peak_bytes(S)}
                rows.append(row)
                print(f"V={vocab:>6} {method:>8} {label:>8}: {cpu:8.2f} CPU s = {cpu / fb:7.1f}× fwd+bwd "
                      f"({dims[label]:,} coordinates)", flush=True)
    return rows


def coordinates(model, selection) -> int:
    """Gradient coordinates of the blocks ``selection`` resolves to (a tied matrix once)."""
    from gradalg.capture.hooks import resolve_layers
    total = 0
    for ref in resolve_layers(model, selection):
        own = dict(ref.module.named_parameters())
        total += sum(own[n].numel() for n in ref.param_names() if n in own)
    return total


def eigh_seconds(widths):
    """CPU seconds of torch.linalg.eigh of a dense width × width PSD matrix, in the dtype the
    K-FAC factor would use (float64 up to kron_float64_width, float32 above)."""
    out = []
    limit = ga.get_options().kron_float64_width
    for w in widths:
        dtype = torch.float64 if w <= limit else torch.float32
        a = torch.randn(w, w // 4, dtype=dtype)
        S = a @ a.T
        t0 = time.process_time()
        torch.linalg.eigh(S)
        cpu = time.process_time() - t0
        out.append({"width": w, "dtype": str(dtype), "eigh_cpu_s": round(cpu, 2), "bytes": S.numel() * S.element_size()})
        print(f"eigh {w:>6} {dtype}: {cpu:8.2f} CPU s, factor {S.numel() * S.element_size() / 2**20:.0f} MiB",
              flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="1024,4096,8192,16384,32768")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--n-train", type=int, default=256)
    ap.add_argument("--n-query", type=int, default=64)
    ap.add_argument("--wide-curvature", action="store_true")
    ap.add_argument("--eigh", default="", help="comma-separated widths: time the V×V eigendecomposition alone")
    ap.add_argument("--results", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ga.options(progress=False)
    result = {"load_average": os.getloadavg(), "threads": 1}
    if args.eigh:
        result["eigh"] = eigh_seconds([int(v) for v in args.eigh.split(",")])
    if args.vocab:
        result["rows"] = run([int(v) for v in args.vocab.split(",")], args.methods.split(","), args.n_train,
                             args.n_query, args.wide_curvature)
    result["load_average_end"] = os.getloadavg()
    if args.results:
        Path(args.results).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
