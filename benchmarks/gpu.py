"""Throughput and method costs on one accelerator: one command, a JSON and a markdown table.

Models, built from transformers configs with random weights (nothing downloaded), in
bfloat16 on the first CUDA device (else the CPU), dropout off, float32 GEMMs in TF32
(``torch.backends.cuda.matmul.allow_tf32``: gradalg's float32 statistics and scores):

    gpt2-small    GPT2Config() defaults: 12 layers, width 768, 12 heads, vocab 50257   (124 M)
    pythia-160m   GPT-NeoX with Pythia-160M's dims, untied 50 k head                   (162 M)
    llama-200m    Llama-shaped: GQA 16/4 heads, SwiGLU, RMSNorm, vocab 32000           (201 M)
    qwen2-0.5b    Qwen2Config with Qwen2-0.5B's published dims: 24 layers, hidden 896,
                  intermediate 4864, 14 heads / 2 kv heads, vocab 151936, tied embeddings (494 M)

(the configs of ``benchmarks/real_scale.py``, which runs every catalogue method on them
one subprocess at a time; this script is its one-GPU, one-process, time-boxed version).

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
two columns check ``gradalg/devices/`` and the scale table of
docs/performance.md). On CUDA each timing
is bracketed by ``torch.cuda.synchronize()``. gradalg keeps curvature statistics in
float64 (also on the GPU: slow next to bfloat16, but exact enough to invert); that is
part of EK-FAC's and LoGra's cost here. Methods run cheapest first, each on every model;
those not started within ``--budget-s`` (300 s) are skipped and marked. A method that
fails is recorded with its error and the others still run.

W3 (issue 28, item 7; ``../shared/peers-bench/workloads.py``, rebuilt here when that
file is not beside the checkout): GPT-2 at GPT-2-small width with its Conv1D layers as
nn.Linear, float32 (TF32 GEMMs), random tokens, 32 training sequences × 128 and 4
queries, batches of 8, attribution over the 48 Linear layers of ``transformer.h.*``.
gradalg's variants of the peers' harness (projected Grad-Dot kron 64 × 64, full
Grad-Dot, EK-FAC influence at damping 1e-8, LoGra k = 4096, TRAK) are timed against a
plain forward+backward over the same training set, best of ``--w3-repeats`` (3) runs
after a warm-up. It runs after the models' methods, within the same budgets
(``--no-w3`` leaves it out, ``--w3-only`` runs it alone).

Time guard: ``--budget-s`` stops starting new methods; ``--hard-s`` (450 s) is a hard
limit: at that time the method running is interrupted (a SIGALRM between two Python
calls), recorded as stopped, and the report written; if a single long kernel holds the
interpreter past ``--hard-s`` + 30 s, a watchdog thread writes the report gathered so
far and ends the process. The report is also written after every method, so a run
killed from outside still leaves its table. Within 8 minutes on one H200 by
construction.

    python benchmarks/gpu.py                       # writes $OUT/gpu.json and $OUT/gpu.md (else ./)
    python benchmarks/gpu.py --out results/h200    # results/h200.json, results/h200.md
    python benchmarks/gpu.py --smoke               # tiny configs, T = 64, on the CPU: seconds
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import gradalg as ga  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_scale  # noqa: E402 - the real-size configs, one definition for both scripts

METHODS = ("grad-dot kron", "logra", "grad-dot", "trak", "ekfac")   # cheapest first
MODELS = ("gpt2-small", "pythia-160m", "llama-200m", "qwen2-0.5b")
W3_VARIANTS = ("grad-dot kron", "grad-dot", "logra", "trak", "ekfac")   # the peers harness's gradalg rows
W3_EKFAC_DAMPING = 1e-8    # run_peer.py's KRON_DAMPING (Kronfluence's default)
W3_LOGRA_DAMPING = 1e-3    # run_peer.py's LOGRA_DAMPING
W3_TRAK_DAMPING = 1e-3     # run_peer.py's TRAK_DAMPING
W3_TRAK_K = 512            # the harness's --proj-dim for TRAK rows


class HardStop(BaseException):
    """Raised by the SIGALRM of ``--hard-s`` in the method running (a BaseException, so the
    per-method ``except Exception`` records it as stopped, not as the method's failure)."""


class RandomTokens(Dataset):
    """``n`` sequences of ``T`` token ids drawn uniformly (seeded), as dict examples."""

    def __init__(self, n: int, T: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, T), generator=g)

    @classmethod
    def of(cls, ids: torch.Tensor) -> "RandomTokens":
        """The same dataset over given token ids (n, T) (the W3 workload's)."""
        data = cls.__new__(cls)
        data.ids = ids
        return data

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def model_configs(smoke: bool, T: int = 1024) -> dict:
    """{name: (model class, config, attributed layer patterns)}: real_scale.py's configs, or
    tiny ones of the same architectures with ``smoke``."""
    import transformers as tf
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if smoke:
        configs = {
            "gpt2-small": (tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                                             n_positions=64, bos_token_id=0, eos_token_id=0,
                                                             **no_dropout)),
            "pythia-160m": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(
                hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=128,
                rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False,
                max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)),
            "llama-200m": (tf.LlamaForCausalLM, tf.LlamaConfig(
                hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False, max_position_embeddings=64)),
            "qwen2-0.5b": (tf.Qwen2ForCausalLM, tf.Qwen2Config(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)),
        }
    else:
        configs = {name: real_scale.build_config(name, T) for name in MODELS}
    blocks = {"gpt2-small": ["transformer.h.*"],
              "pythia-160m": ["gpt_neox.layers.*.attention.*", "gpt_neox.layers.*.mlp.*"],
              "llama-200m": ["model.layers.*.self_attn.*", "model.layers.*.mlp.*"],
              "qwen2-0.5b": ["model.layers.*.self_attn.*", "model.layers.*.mlp.*"]}
    return {name: (cls, config, blocks[name]) for name, (cls, config) in configs.items()}


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
    speeds, ``gradalg.devices``), to set beside the measured seconds on an H200."""
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
    if report.get("w3"):
        lines += w3_markdown(report["w3"])
    if report.get("stopped"):
        lines += [f"**Stopped by the hard time limit**: {report['stopped']}", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- W3
def _conv1d_to_linear(model):
    """GPT-2's transformers Conv1D layers as the mathematically identical nn.Linear (weight
    transposed), as ``workloads.conv1d_to_linear`` of the peers harness."""
    from transformers.pytorch_utils import Conv1D
    for mod in list(model.modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, Conv1D):
                lin = torch.nn.Linear(child.weight.shape[0], child.weight.shape[1])
                with torch.no_grad():
                    lin.weight.copy_(child.weight.t())
                    lin.bias.copy_(child.bias)
                setattr(mod, cname, lin)
    return model


def _peers_workloads():
    """``workloads.py`` of ../shared/peers-bench (beside the checkout, or shared/ inside
    it), or None when neither is there (a bare GPU machine)."""
    for base in (ROOT.parent / "shared" / "peers-bench", ROOT / "shared" / "peers-bench"):
        path = base / "workloads.py"
        if path.exists():
            spec = importlib.util.spec_from_file_location("peers_workloads", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


def w3_workload(smoke: bool) -> dict:
    """W3: the peers harness's ``make_w3()`` when its file is here, else the same workload
    built here (GPT-2 12 × 768, vocab 50,257, Conv1D → Linear, seeds 0 / 1, 32 × 128
    training tokens, 4 queries, batch 8). ``smoke``: 2 layers × 64, vocab 128, 8 × 32, 2."""
    from transformers import GPT2Config, GPT2LMHeadModel
    module = None if smoke else _peers_workloads()
    if module is not None:
        wl = module.make_w3()
        wl["source"] = "../shared/peers-bench/workloads.py make_w3()"
        return wl
    n_train, n_test, seq, bs, vocab = (8, 2, 32, 4, 128) if smoke else (32, 4, 128, 8, 50257)
    dims = dict(n_positions=64, n_embd=64, n_layer=2, n_head=2) if smoke else \
        dict(n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    cfg = GPT2Config(vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab - 1,
                     eos_token_id=vocab - 1, **dims)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    _conv1d_to_linear(model).eval()
    g = torch.Generator().manual_seed(1)
    tr = torch.randint(0, vocab, (n_train, seq), generator=g)
    te = torch.randint(0, vocab, (n_test, seq), generator=g)
    return {"name": "W3_gpt2_small_width", "model": model, "train": (tr,), "test": (te,), "batch_size": bs,
            "seq_len": seq, "vocab": vocab, "layer_prefix": "transformer.h.",
            "source": "rebuilt in benchmarks/gpu.py" + (" (smoke size)" if smoke else "")}


def w3_scores(variant: str, task, train, queries, layers):
    m = ga.methods
    if variant == "grad-dot kron":
        return m.grad_dot(task, train, queries, layers=layers, projector=ga.proj.kron(4096, seed=0, k_out=64, k_in=64))
    if variant == "grad-dot":
        return m.grad_dot(task, train, queries, layers=layers)
    if variant == "logra":
        return m.logra(task, train, queries, layers=layers, k=4096, damping=W3_LOGRA_DAMPING)
    if variant == "trak":
        return m.trak(task, train, queries, layers=layers, k=W3_TRAK_K, damping=W3_TRAK_DAMPING)
    if variant == "ekfac":
        return m.influence(task, train, queries, layers=layers, curvature="ekfac", damping=W3_EKFAC_DAMPING)
    raise ValueError(f"unknown W3 variant {variant!r}: one of {W3_VARIANTS}")


def run_w3(args, device, clock, deadline, record) -> dict:
    """gradalg's variants on W3 against a plain forward+backward over its training set, in
    float32 with TF32 GEMMs: best of ``args.w3_repeats`` after a warm-up of each. ``record``
    is called with the result so far after every variant (the report is written then)."""
    wl = w3_workload(args.smoke)
    model = wl["model"].to(device)
    layers = [n for n, mod in model.named_modules()
              if isinstance(mod, torch.nn.Linear) and n.startswith(wl["layer_prefix"])]
    task = ga.tasks.causal_lm(model, name=wl["name"])
    train = [{"input_ids": r} for r in wl["train"][0]]
    queries = [{"input_ids": r} for r in wl["test"][0]]
    bs = wl["batch_size"]
    data = RandomTokens.of(wl["train"][0])
    plain_pass(task, model, data, bs, device)                      # warm-up
    plain = min(clock.time(lambda: plain_pass(task, model, data, bs, device))[0] for _ in range(args.w3_repeats))
    result = {"source": wl["source"], "layers": len(layers), "n_train": len(train), "n_query": len(queries),
              "T": wl["seq_len"], "batch": bs, "plain_seconds": plain, "variants": {},
              "precision": "float32, TF32 GEMMs" if device.type == "cuda" else "float32"}
    print(f"W3 ({wl['source']}): {len(layers)} Linear layers; plain fwd+bwd {plain:.3f} s", flush=True)
    record(result)
    with ga.options(batch_size=bs):
        for variant in args.w3_variants:
            if time.perf_counter() > deadline:
                result["variants"][variant] = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
                continue
            result["variants"][variant] = {"skipped": "stopped by --hard-s while running"}
            try:
                times = []
                for _ in range(args.w3_repeats + 1):                # the first is the warm-up
                    S = w3_scores(variant, task, train, queries, layers)
                    seconds, values = clock.time(lambda: S.compute(executor=ga.LocalExecutor()))
                    times.append(seconds)
                    if time.perf_counter() > deadline:
                        break
                best = min(times[1:] or times)
                values = torch.as_tensor(values.values)
                if values.shape != (len(queries), len(train)) or not torch.isfinite(values).all():
                    raise RuntimeError(f"scores of shape {tuple(values.shape)} or not finite")
                row = {"seconds": best, "ratio": best / plain, "runs": len(times), "peak_bytes": clock.peak()}
                print(f"  W3 {variant:14} {best:8.3f} s  {row['ratio']:6.2f}× plain", flush=True)
            except Exception as err:  # noqa: BLE001 - recorded, the other variants run
                row = {"error": f"{type(err).__name__}: {err}"}
                print(f"  W3 {variant:14} failed: {row['error'][:200]}", flush=True)
            result["variants"][variant] = row
            record(result)
    return result


def w3_markdown(w3: dict) -> list[str]:
    lines = [f"## W3: GPT-2-small width, {w3['layers']} block Linears, {w3['precision']} ({w3['source']})", "",
             f"{w3['n_train']} training sequences × {w3['T']} tokens, {w3['n_query']} queries, batches of "
             f"{w3['batch']}; plain fwd+bwd {w3['plain_seconds']:.3f} s (best of runs); each variant best of its "
             "runs after a warm-up.", "",
             "| gradalg variant | seconds | × plain fwd+bwd | peak GiB |", "|---|---|---|---|"]
    for variant, row in w3["variants"].items():
        if "seconds" in row:
            peak = f"{row['peak_bytes'] / 2**30:.2f}" if row.get("peak_bytes") else "-"
            lines.append(f"| {variant} | {row['seconds']:.3f} | {row['ratio']:.2f}× | {peak} |")
        else:
            what = f"skipped: {row['skipped']}" if "skipped" in row else f"failed: {row['error'][:120]}"
            lines.append(f"| {variant} | {what} | | |")
    return lines + [""]


# ----------------------------------------------------------------------------- main
def _out_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    return Path(os.environ.get("OUT") or ".") / "gpu"


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(report))


class HardGuard:
    """``--hard-s``: a SIGALRM that raises :class:`HardStop` in the code running, and a
    watchdog thread 30 s later that writes the report and ends the process (a kernel that
    never returns to the interpreter). ``close()`` disarms both."""

    def __init__(self, seconds: float, report: dict, out: Path):
        self.report, self.out = report, out
        self.previous = signal.signal(signal.SIGALRM, self._raise)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        self.watchdog = threading.Timer(seconds + 30.0, self._exit)
        self.watchdog.daemon = True
        self.watchdog.start()

    def _raise(self, signum, frame):
        raise HardStop(f"--hard-s reached after {time.perf_counter() - self.report['_start']:.0f} s")

    def _exit(self):
        self.report["stopped"] = "watchdog: a kernel held the interpreter past --hard-s + 30 s"
        try:   # the main thread is inside a kernel: the report is as the last method left it
            write_report(json.loads(json.dumps({k: v for k, v in self.report.items() if not k.startswith("_")},
                                               default=str)), self.out)
            print("hard time limit: report written, exiting", flush=True)
        finally:
            os._exit(3)

    def close(self):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)
        self.watchdog.cancel()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny configs, T = 64, CPU unless --device")
    parser.add_argument("--out", default=None, help="path without suffix: writes .json and .md "
                        "(default $OUT/gpu, else ./gpu)")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--tokens", type=int, default=None, help="T (default 1024; 64 with --smoke)")
    parser.add_argument("--n-train", type=int, default=None)
    parser.add_argument("--n-query", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--device", default=None, help="default: cuda if available (cpu with --smoke)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip the methods not started once this is spent")
    parser.add_argument("--hard-s", type=float, default=450.0, help="interrupt the method running at this time "
                        "and write the report (a watchdog ends the process 30 s later)")
    parser.add_argument("--memory-fraction", type=float, default=0.5,
                        help="gradalg's memory budget: this fraction of the free device memory (CUDA)")
    parser.add_argument("--no-w3", action="store_true", help="leave out the W3 workload")
    parser.add_argument("--w3-only", action="store_true", help="run the W3 workload only")
    parser.add_argument("--w3-variants", nargs="+", default=list(W3_VARIANTS), choices=W3_VARIANTS)
    parser.add_argument("--w3-repeats", type=int, default=2, help="timed runs of each W3 variant (after a warm-up)")
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (64 if args.smoke else 1024)
    args.n_train = args.n_train or (16 if args.smoke else 128)
    args.n_query = args.n_query or (4 if args.smoke else 8)
    args.batch = args.batch or (8 if args.smoke else 8)
    if args.w3_only:
        args.models = []
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    clock = Clock(device)
    options = {"batch_size": args.batch, "progress": False}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True      # float32 GEMMs (statistics, scores, W3) in TF32
        torch.backends.cudnn.allow_tf32 = True
        free, _ = torch.cuda.mem_get_info(device)
        options["memory_budget"] = int(args.memory_fraction * free)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    # one-time costs kept out of the first method's time: this machine's CPU profile
    # (measured once, cached on disk) and torch's lazily imported DTensor module
    from gradalg.devices import local_profile
    local_profile()
    try:
        importlib.import_module("torch.distributed.tensor")
    except ImportError:
        pass
    start = time.perf_counter()
    deadline = start + args.budget_s
    out = _out_path(args.out)
    report = {"device": name, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
              "gradalg": getattr(ga, "__version__", "?"), "tokens": args.tokens, "n_train": args.n_train,
              "n_query": args.n_query, "batch": args.batch, "dtype": "bfloat16", "smoke": args.smoke,
              "tf32": device.type == "cuda", "memory_budget": options.get("memory_budget"), "models": {},
              "w3": None, "_start": start}

    def save():
        report["seconds"] = time.perf_counter() - start
        write_report({k: v for k, v in report.items() if not k.startswith("_")}, out)

    guard = HardGuard(args.hard_s, report, out)
    try:
        with ga.options(**options):
            if not args.no_w3:      # W3 first: small, and the peers' comparison (issue 28, item 7)
                def record(w3):
                    report["w3"] = w3
                    save()
                report["w3"] = run_w3(args, device, clock, deadline, record)
            configs = model_configs(args.smoke, args.tokens)
            benches = {}
            for m in args.models:
                benches[m] = prepare(m, *configs[m], args, device, clock)
                report["models"][m] = benches[m]["result"]
            save()
            # method by method over the models, cheapest first: what the time budget cuts is
            # the most expensive methods, for every model alike
            for method in args.methods:
                for model_name, bench in benches.items():
                    if time.perf_counter() > deadline:
                        row = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
                        print(f"  {model_name:12} {method:14} skipped (time budget)", flush=True)
                    else:
                        bench["result"]["methods"][method] = {"skipped": "stopped by --hard-s while running"}
                        row = run_method(model_name, bench, method, args, clock)
                    bench["result"]["methods"][method] = row
                    save()
    except HardStop as stop:
        report["stopped"] = str(stop)
        print(f"hard time limit: {stop}", flush=True)
    finally:
        guard.close()
    save()
    report.pop("_start", None)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')} ({report['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
