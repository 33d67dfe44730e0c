"""Routed tokens per expert at real MoE widths: what ``ga.grads`` pads each expert's block to
against what the planner prices (``gradalg.capture.experts``).

For each model (real widths, a few layers, random init, bf16) it runs the forward of ``n``
sequences of T tokens (two data kinds: bytes of the Python standard library's sources as
token ids, and uniform random ids), records every fused experts module's routing
(``top_k_index``, (T, k) per sequence), and compares, per chunk of B consecutive sequences
and per layer, the padded positions capture allocates, ``Σ_e max_{i ∈ chunk} c_{i,e}``
(``c_{i,e}``: tokens of sequence i routed to expert e), with the plan's priced positions
(the blocks' ``T_b`` of ``measure_forward_shapes``, summed over the experts), and with the old
price ``E ⌈T k / E⌉``.

    flock /work/bigmem.lock nice -n 10 env PYTHONPATH=$PWD OMP_NUM_THREADS=1 \\
        python benchmarks/moe_positions.py --models olmoe qwen2-moe mixtral --T 128 --n 16 --B 4 \\
        --results benchmarks/results/moe_positions_T128_2026-12-05.json
    python benchmarks/moe_positions.py --table benchmarks/results/moe_positions_T128_2026-12-05.json

The plan's price is measured on the first chunk, so its own chunk matches by construction (up
to bf16 differences between a batched and a one-sequence forward); the other chunks say how
well one chunk stands for the rest.

``--pad F``: each sequence keeps its first L tokens, L seeded uniform in [⌈(1 − F)·T⌉, T];
each chunk of B is then run batched, right-padded (``attention_mask``), and each row also
gets capture's padded positions with the padding tokens counted (``padded_with_padding``:
what capture allocated before session 39, when padding tokens kept their routed rows)
beside the real tokens' (``padded``, what it allocates now)::

    flock /work/bigmem.lock nice -n 10 env PYTHONPATH=$PWD OMP_NUM_THREADS=1 \\
        python benchmarks/moe_positions.py --models olmoe qwen2-moe mixtral --T 128 --n 16 --B 4 --pad 0.5 \\
        --results benchmarks/results/moe_positions_T128_pad0.5_2026-12-06.json
    python benchmarks/moe_positions.py --table benchmarks/results/moe_positions_T128_pad0.5_2026-12-06.json
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

import torch

MODELS = ("olmoe", "qwen2-moe", "mixtral")


def build(name: str, T: int):
    import transformers as tf
    torch.manual_seed(0)
    if name == "olmoe":        # OLMoE-1B-7B: 2 of 16 layers
        cfg = tf.OlmoeConfig(hidden_size=2048, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=16,
                             num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
                             max_position_embeddings=max(4096, T))
        cls = tf.OlmoeForCausalLM
    elif name == "qwen2-moe":  # Qwen1.5-MoE-A2.7B: 2 of 24 layers
        cfg = tf.Qwen2MoeConfig(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                                shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                                num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16,
                                vocab_size=151936, decoder_sparse_step=1, max_position_embeddings=max(8192, T))
        cls = tf.Qwen2MoeForCausalLM
    elif name == "mixtral":    # Mixtral-8x7B: 1 of 32 layers
        cfg = tf.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
                               num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                               max_position_embeddings=max(4096, T))
        cls = tf.MixtralForCausalLM
    else:
        raise SystemExit(f"unknown model {name!r}: one of {', '.join(MODELS)}")
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = cls(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return model


def sequences(kind: str, n: int, T: int, vocab: int) -> list[dict]:
    """``n`` token-id rows of length T: ``stdlib`` (bytes of the standard library's sources, +3,
    consecutive windows) or ``random`` (uniform ids)."""
    if kind == "random":
        g = torch.Generator().manual_seed(1)
        return [{"input_ids": torch.randint(3, vocab, (T,), generator=g)} for _ in range(n)]
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    text = b"".join(open(f, "rb").read() for f in files[:40])
    ids = torch.tensor(list(text[: n * T]), dtype=torch.long) + 3
    return [{"input_ids": ids[i * T:(i + 1) * T]} for i in range(n)]


def trimmed(data: list[dict], T: int, pad: float) -> list[dict]:
    """``--pad``: each sequence's first L tokens, L seeded uniform in [⌈(1 − pad)·T⌉, T]."""
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(max(2, math.ceil((1 - pad) * T)), T + 1, (len(data),), generator=g).tolist()
    return [{"input_ids": x["input_ids"][:n]} for x, n in zip(data, lengths)]


def padded_batched(model, data, E: int, B: int) -> dict[str, tuple[list[int], list[int]]]:
    """``{experts module: (with padding, real tokens only)}``: per chunk of B sequences run
    batched and right-padded (gradalg's collate), ``Σ_e max_i c_{i,e}`` counting the padding
    tokens' routing too, and counting real tokens only (:func:`routed_counts` with the mask)."""
    from gradalg.capture.experts import FusedExpertsRule, routed_counts
    from gradalg.capture.layers import rule_class
    from gradalg.collate import pad_collate
    mods = {n: m for n, m in model.named_modules() if rule_class(m) is FusedExpertsRule}
    out = {n: ([], []) for n in mods}
    for s in range(0, len(data), B):
        batch = pad_collate(data[s:s + B])
        seen = {}

        def keep(mod, args, n):
            seen.setdefault(n, args[1].clone())     # (returns None: the call's arguments unchanged)
        hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: keep(mod, args, n)) for n, m in mods.items()]
        try:
            with torch.no_grad():
                model(**batch)
        finally:
            for h in hooks:
                h.remove()
        b = batch["input_ids"].shape[0]
        for n, index in seen.items():
            every = routed_counts(mods[n], index, b).max(0).values.clamp_min(1).sum()
            real = routed_counts(mods[n], index, b, batch["attention_mask"]).max(0).values.clamp_min(1).sum()
            out[n][0].append(int(every))
            out[n][1].append(int(real))
    return out


def routing(model, data) -> dict[str, torch.Tensor]:
    """``{experts module: [(T_i, k)]}`` routed experts of each sequence (each run alone)."""
    from gradalg.capture.experts import FusedExpertsRule
    from gradalg.capture.layers import rule_class
    mods = {n: m for n, m in model.named_modules() if rule_class(m) is FusedExpertsRule}
    out = {n: [] for n in mods}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: out[n].append(args[1].clone())) for n, m in mods.items()]
    try:
        with torch.no_grad():
            for item in data:
                model(input_ids=item["input_ids"][None])
    finally:
        for h in hooks:
            h.remove()
    return {n: v for n, v in out.items()}


def padded(index: list[torch.Tensor], E: int, B: int) -> list[int]:
    """Per chunk of B sequences: ``Σ_e max_i c_{i,e}`` (what capture pads, at least 1 per expert)."""
    counts = torch.stack([torch.bincount(r.flatten(), minlength=E) for r in index])      # (n, E)
    return [int(counts[s:s + B].max(0).values.clamp_min(1).sum()) for s in range(0, len(counts), B)]


def priced(model, data, B: int) -> dict[str, int]:
    """``{experts module: Σ_e T_b}`` of the plan's measured shapes (one block per expert and
    matrix: the gate_up blocks), for chunks of B."""
    import gradalg as ga
    from gradalg.plan.shapes import measure_forward_shapes
    from gradalg.plan.shapes import chunk_examples, forward_shapes
    with ga.options(batch_size=B, batch_tokens=B * max(len(x["input_ids"]) for x in data)):
        src = ga.grads(ga.tasks.causal_lm(model), data).expr.source
        assert chunk_examples(src) == B
        shapes = measure_forward_shapes(src)
        hinted = forward_shapes(src, {}).positions
    out: dict[str, int] = {}
    balanced: dict[str, int] = {}
    for name, T in shapes.positions.items():
        if ".gate_up_proj." in name:
            module = name.rsplit(".gate_up_proj.", 1)[0]
            out[module] = out.get(module, 0) + T
            balanced[module] = balanced.get(module, 0) + hinted[name]
    return out, balanced, shapes.measured


def table(rows) -> str:
    """The markdown table of docs/layers.md: per experts module, Σ_e positions per example."""
    out = ["| model (E, k) | data | layer | T, B | mean ⌈Tk/E⌉·E | balanced (display) | priced (run) "
           "| padded: mean of the chunks (range) | padded ÷ mean | padded ÷ priced |", "|---" * 10 + "|"]
    for r in rows:
        out.append(f"| {r['model']} ({r['E']}, {r['k']}) | {r['data']} | {r['module'].split('.')[2]} | {r['T']}, {r['B']} "
                   f"| {r['old']} | {r['balanced']} | {r['priced']} | {r['padded_mean']:.0f} ({min(r['padded'])}–"
                   f"{max(r['padded'])}) | {r['old_ratio']:.2f} | {r['priced_ratio']:.2f} |")
    pads = [r for r in rows if "padded_with_padding" in r]
    if pads:
        out += ["", "| model (E, k) | data | layer | T, B | real tokens / n·T | padded, padding counted (before) "
                "| padded, real tokens (now) | now ÷ before | priced (run) ÷ first chunk (now) |", "|---" * 9 + "|"]
        for r in pads:
            before, now = r["padded_with_padding"], r["padded"]
            out.append(f"| {r['model']} ({r['E']}, {r['k']}) | {r['data']} | {r['module'].split('.')[2]} | {r['T']}, "
                       f"{r['B']} | {r['tokens'] / (r['n'] * r['T']):.2f} | {sum(before) / len(before):.0f} | "
                       f"{sum(now) / len(now):.0f} | {sum(now) / sum(before):.2f} | {r['priced'] / now[0]:.2f} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--data", nargs="+", default=["stdlib", "random"])
    ap.add_argument("--pad", type=float, default=0.0, help="sequences of seeded lengths in [(1 - PAD)·T, T], "
                    "chunks run batched and right-padded (module docstring)")
    ap.add_argument("--results", default=None)
    ap.add_argument("--table", default=None, help="print the markdown table of a results file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.load(open(args.table))))
        return
    rows = []
    for name in args.models:
        t0 = time.time()
        model = build(name, args.T)
        E = model.config.num_local_experts if hasattr(model.config, "num_local_experts") else model.config.num_experts
        k = model.config.num_experts_per_tok
        for kind in args.data:
            data = sequences(kind, args.n, args.T, model.config.vocab_size)
            if args.pad:
                data = trimmed(data, args.T, args.pad)
                batched = padded_batched(model, data, E, args.B)
            routes = routing(model, data)
            plan, balanced, measured = priced(model, data, args.B)
            for module, index in routes.items():
                pad = padded(index, E, args.B) if not args.pad else batched[module][1]
                extra = {}
                if args.pad:
                    extra = dict(pad=args.pad, tokens=sum(len(x["input_ids"]) for x in data),
                                 padded_alone=padded(index, E, args.B), padded_with_padding=batched[module][0])
                row = dict(model=name, data=kind + (f"+pad{args.pad:g}" if args.pad else ""), T=args.T, n=args.n,
                           B=args.B, E=E, k=k, module=module, **extra,
                           old=E * math.ceil(args.T * k / E), balanced=balanced.get(module), priced=plan.get(module),
                           measured_shapes=measured,
                           padded=pad, padded_mean=sum(pad) / len(pad))
                row["old_ratio"] = row["padded_mean"] / row["old"]
                row["priced_ratio"] = row["padded_mean"] / row["priced"] if row["priced"] else None
                row["balanced_ratio"] = row["padded_mean"] / row["balanced"] if row["balanced"] else None
                rows.append(row)
                print(json.dumps(row), flush=True)
        print(f"# {name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        del model
        import gc
        gc.collect()
    if args.results:
        with open(args.results, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
