"""Throughput and method costs on one accelerator: one command, a JSON and a markdown table.

Models, built from transformers configs with random weights (nothing downloaded), in
bfloat16 on the first CUDA device (else the CPU), dropout off:

    gpt2-small    GPT2Config() defaults: 12 layers, width 768, 12 heads, vocab 50257   (124 M)
    qwen2-0.5b    Qwen2Config with Qwen2-0.5B's published dims: 24 layers, hidden 896,
                  intermediate 4864, 14 heads / 2 kv heads, vocab 151936, tied embeddings (494 M)

Data: random token ids, T = 1024; ``--n-train`` training sequences (128) and
``--n-query`` queries (8); batches of ``--batch`` (8). Attributed layers: every Linear /
Conv1D of the transformer blocks (attention and MLP). Loss: next-token cross-entropy
summed over tokens and sequences (``ga.tasks.causal_lm``).

Measured, each end to end (``Scores.compute()``: planning, the query pass, every pass
over the training set, gradalg's checks), after one warm-up batch of the plain pass:

    plain fwd+bwd     forward and ``loss.backward()`` over the training set (all
                      parameter gradients): the unit, and its tokens/s
    grad-dot          ga.methods.grad_dot (full per-example gradients)
    grad-dot kron     grad_dot with ga.proj.kron(k=4096): capture and Kronecker projection;
                      its training tokens/s is the capture throughput
    logra             ga.methods.logra (k = 4096, EK-FAC in the projected space)
    ekfac             ga.methods.influence(curvature="ekfac") (parameter coordinates)
    trak              ga.methods.trak (k = 2048, sparse JL projection)

Every cost is given as a multiple of the plain pass over the same training set, with
the method's training tokens per second, the peak device memory, and the planner's
estimate of the same expression on the H200 preset (spec-sheet speeds: on an H200 the
two columns check ``gradalg/plan/devices.py`` and the scale table of
docs/performance.md). On CUDA each timing
is bracketed by ``torch.cuda.synchronize()``. gradalg keeps curvature statistics in
float64 (also on the GPU: slow next to bfloat16, but exact enough to invert); that is
part of EK-FAC's and LoGra's cost here. Methods run cheapest first, each on both models;
those not started within ``--budget-s`` (300 s) are skipped and marked, so the script
should end within 8 minutes on one H200 (a method started just before the budget runs to
its end: EK-FAC's float64 eigendecompositions of Qwen2-0.5B's 4864-wide factors are the
longest). A method that fails is recorded with its error and the others still run.

    python benchmarks/gpu.py                       # writes $OUT/gpu.json and $OUT/gpu.md (else ./)
    python benchmarks/gpu.py --out results/h200    # results/h200.json, results/h200.md
    python benchmarks/gpu.py --smoke               # tiny configs, T = 64, on the CPU: seconds
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gradalg as ga  # noqa: E402

METHODS = ("grad-dot kron", "logra", "grad-dot", "trak", "ekfac")   # cheapest first


class RandomTokens(Dataset):
    """``n`` sequences of ``T`` token ids drawn uniformly (seeded), as dict examples."""

    def __init__(self, n: int, T: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, T), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def model_configs(smoke: bool) -> dict:
    """{name: (model class, config, attributed layer patterns)}."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if smoke:
        gpt2 = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                          bos_token_id=0, eos_token_id=0, **no_dropout)
        qwen = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    else:
        gpt2 = GPT2Config(**no_dropout)
        qwen = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                           num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                           max_position_embeddings=32768, rope_theta=1e6)
    return {
        "gpt2-small": (GPT2LMHeadModel, gpt2, ["transformer.h.*"]),
        "qwen2-0.5b": (Qwen2ForCausalLM, qwen, ["model.layers.*.self_attn.*", "model.layers.*.mlp.*"]),
    }


def scores_of(method: str, task, train, queries, layers):
    m = ga.methods
    if method == "grad-dot":
        return m.grad_dot(task, train, queries, layers=layers)
    if method == "grad-dot kron":
        return m.grad_dot(task, train, queries, layers=layers, projector=ga.proj.kron(k=4096))
    if method == "logra":
        return m.logra(task, train, queries, layers=layers)
    if method == "ekfac":
        return m.influence(task, train, queries, layers=layers, curvature="ekfac")
    if method == "trak":
        return m.trak(task, train, queries, layers=layers)
    raise ValueError(f"unknown method {method!r}: one of {METHODS}")


class Clock:
    """Wall seconds of a region, with the device's queue drained at both ends (CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_peak(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> float | None:
        return float(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None

    def time(self, fn):
        self.reset_peak()
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - start, out


def plain_pass(task, model, data: RandomTokens, batch: int, device) -> None:
    """Forward and ``loss.backward()`` over ``data`` in batches (all parameter gradients)."""
    model.zero_grad(set_to_none=True)
    for start in range(0, len(data), batch):
        ids = data.ids[start:start + batch].to(device)
        task.summed_loss(model, {"input_ids": ids}).backward()
    model.zero_grad(set_to_none=True)


def prepare(name, cls, config, layers, args, device, clock) -> dict:
    """Build one model on the device and time its plain pass (after a warm-up batch)."""
    torch.manual_seed(0)
    model = cls(config).to(device=device, dtype=torch.bfloat16).eval()
    n_params = sum(p.numel() for p in model.parameters())
    task = ga.tasks.causal_lm(model, name=name)
    train = RandomTokens(args.n_train, args.tokens, config.vocab_size, seed=1)
    queries = RandomTokens(args.n_query, args.tokens, config.vocab_size, seed=2)
    tokens = args.n_train * args.tokens
    warm = RandomTokens(args.batch, args.tokens, config.vocab_size, seed=3)
    plain_pass(task, model, warm, args.batch, device)            # kernels, allocator, cuBLAS handles
    plain_s, _ = clock.time(lambda: plain_pass(task, model, train, args.batch, device))
    print(f"{name}: {n_params / 1e6:.1f} M parameters; plain fwd+bwd {plain_s:.2f} s, "
          f"{tokens / plain_s:,.0f} tokens/s", flush=True)
    return {"task": task, "train": train, "queries": queries, "layers": layers, "tokens": tokens, "result": {
        "parameters": n_params, "layers": layers, "methods": {},
        "plain": {"seconds": plain_s, "tokens_per_s": tokens / plain_s, "peak_bytes": clock.peak()}}}


def _h200_estimate(S) -> float | None:
    """The planner's estimate of the same expression on the H200 preset (spec-sheet
    speeds, ``gradalg.plan.devices``), to set beside the measured seconds on an H200."""
    try:
        return float(S.explain(device="h200").plan.seconds)
    except ga.errors.MemoryBudgetError:
        return None


def run_method(name, bench: dict, method: str, args, clock) -> dict:
    """One method end to end on one model: seconds, × plain, tokens/s, peak memory. An
    error is recorded (the run goes on to the next method: a GPU run is one shot)."""
    plain_s, tokens = bench["result"]["plain"]["seconds"], bench["tokens"]
    executor = ga.LocalExecutor()
    try:
        S = scores_of(method, bench["task"], bench["train"], bench["queries"], bench["layers"])
        seconds, values = clock.time(lambda: S.compute(executor=executor))
        values = torch.as_tensor(values.values)
        if values.shape != (args.n_query, args.n_train) or not torch.isfinite(values).all():
            raise RuntimeError(f"scores of shape {tuple(values.shape)} (expected "
                               f"{(args.n_query, args.n_train)}) or not finite")
    except Exception as err:  # noqa: BLE001 - recorded in the report, the other methods still run
        print(f"  {name:12} {method:14} failed: {type(err).__name__}: {err}", flush=True)
        return {"error": f"{type(err).__name__}: {err}"}
    plan = executor.last_plan
    row = {"seconds": seconds, "ratio": seconds / plain_s, "train_tokens_per_s": tokens / seconds,
           "peak_bytes": clock.peak(), "passes_over_data": plan.data_passes if plan else None,
           "estimated_h200_seconds": _h200_estimate(S)}
    print(f"  {name:12} {method:14} {seconds:8.2f} s  {row['ratio']:6.2f}× plain  "
          f"{row['train_tokens_per_s']:12,.0f} tokens/s", flush=True)
    return row


def markdown(report: dict) -> str:
    lines = [f"# gradalg on {report['device']}", "",
             f"{report['when']}; torch {report['torch']}, gradalg {report['gradalg']}; bfloat16 models, random "
             f"init and tokens; T = {report['tokens']}, {report['n_train']} training sequences, "
             f"{report['n_query']} queries, batches of {report['batch']}. Cost = seconds of the method "
             "(end to end) / seconds of a plain forward+backward over the same training set.", ""]
    for name, res in report["models"].items():
        plain = res["plain"]
        lines += [f"## {name} ({res['parameters'] / 1e6:.1f} M parameters)", "",
                  f"plain fwd+bwd: {plain['seconds']:.2f} s, {plain['tokens_per_s']:,.0f} tokens/s"
                  + (f", peak {plain['peak_bytes'] / 2**30:.1f} GiB" if plain["peak_bytes"] else ""), "",
                  "| method | seconds | × plain fwd+bwd | training tokens/s | passes over data | peak GiB "
                  "| H200 estimate s |",
                  "|---|---|---|---|---|---|---|"]
        for method, row in res["methods"].items():
            if "skipped" in row or "error" in row:
                what = f"skipped: {row['skipped']}" if "skipped" in row else f"failed: {row['error'][:120]}"
                lines.append(f"| {method} | {what} | | | | | |")
                continue
            peak = f"{row['peak_bytes'] / 2**30:.1f}" if row["peak_bytes"] else "-"
            est = row.get("estimated_h200_seconds")
            lines.append(f"| {method} | {row['seconds']:.2f} | {row['ratio']:.2f}× | "
                         f"{row['train_tokens_per_s']:,.0f} | {row['passes_over_data']} | {peak} | "
                         f"{'-' if est is None else f'{est:.3g}'} |")
        lines.append("")
    return "\n".join(lines)


def _out_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    return Path(os.environ.get("OUT") or ".") / "gpu"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny configs, T = 64, CPU unless --device")
    parser.add_argument("--out", default=None, help="path without suffix: writes .json and .md "
                        "(default $OUT/gpu, else ./gpu)")
    parser.add_argument("--models", nargs="+", default=["gpt2-small", "qwen2-0.5b"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--tokens", type=int, default=None, help="T (default 1024; 64 with --smoke)")
    parser.add_argument("--n-train", type=int, default=None)
    parser.add_argument("--n-query", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--device", default=None, help="default: cuda if available (cpu with --smoke)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip the methods not started once this is spent")
    parser.add_argument("--memory-fraction", type=float, default=0.5,
                        help="gradalg's memory budget: this fraction of the free device memory (CUDA)")
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (64 if args.smoke else 1024)
    args.n_train = args.n_train or (16 if args.smoke else 128)
    args.n_query = args.n_query or (4 if args.smoke else 8)
    args.batch = args.batch or (8 if args.smoke else 8)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    clock = Clock(device)
    options = {"batch_size": args.batch}
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        options["memory_budget"] = int(args.memory_fraction * free)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    configs = model_configs(args.smoke)
    # one-time costs kept out of the first method's time: this machine's CPU profile
    # (measured once, cached on disk) and torch's lazily imported DTensor module
    from gradalg.plan.devices import local_profile
    local_profile()
    try:
        importlib.import_module("torch.distributed.tensor")
    except ImportError:
        pass
    start = time.perf_counter()
    deadline = start + args.budget_s
    report = {"device": name, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
              "gradalg": getattr(ga, "__version__", "?"), "tokens": args.tokens, "n_train": args.n_train,
              "n_query": args.n_query, "batch": args.batch, "dtype": "bfloat16", "smoke": args.smoke,
              "memory_budget": options.get("memory_budget"), "models": {}}
    with ga.options(**options):
        benches = {m: prepare(m, *configs[m], args, device, clock) for m in args.models}
        # method by method over the models, cheapest first: what the time budget cuts is
        # the most expensive methods, for every model alike
        for method in args.methods:
            for model_name, bench in benches.items():
                if time.perf_counter() > deadline:
                    row = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
                    print(f"  {model_name:12} {method:14} skipped (time budget)", flush=True)
                else:
                    row = run_method(model_name, bench, method, args, clock)
                bench["result"]["methods"][method] = row
        report["models"] = {m: b["result"] for m, b in benches.items()}
    report["seconds"] = time.perf_counter() - start
    out = _out_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')} ({report['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
