"""Architectures nobody tuned on: every catalogue method at its defaults on real-size
transformers configs that ``benchmarks/real_scale.py`` does not name.

It reuses ``real_scale.py``'s run (one subprocess per (model, T, method): the method's
``explain(analyze=True)``, its peak resident memory against the budget, each pass's
measured / estimated seconds, then a plain forward+backward over the same tokens as the
unit) and adds, per run, the coverage line the plan states and a count of the same by hand.

Models, from ``transformers`` configs with random weights (nothing is downloaded), dropout
off, float32 on CPU. Real widths and vocabularies; where a whole model would not fit the
shared machine (≤ 8 GB per process) it keeps the real layer shapes with fewer layers, as
the name says (``-2l``: 2 of its layers):

    opt-125m          OPTConfig() defaults: 12 layers × 768, ReLU MLP, learned positions
                      (offset 2), vocab 50,272, tied head (125 M)
    gpt-neo-125m      GPTNeoConfig with GPT-Neo-125M's dims: 12 layers × 768, global/local
                      attention alternating (window 256), vocab 50,257, tied (125 M)
    gemma3-270m       Gemma3TextConfig with Gemma-3-270M's dims: 18 layers × 640, 4 heads /
                      1 kv head of 256, sliding window 512 on 5 of 6 layers, q/k norms,
                      vocab 262,144, tied, embedding scaled by √d (268 M)
    bloom-560m-4l     BloomConfig with BLOOM-560M's dims: 4 of 24 layers × 1024, fused
                      query_key_value, ALiBi, vocab 250,880, tied (307 M)
    phi3-mini-2l      Phi3Config with Phi-3-mini's dims: 2 of 32 layers × 3072, fused qkv_proj
                      (3072 → 9216) and gate_up_proj (3072 → 16384), vocab 32,064, untied (424 M)
    olmoe-1b-7b-1l    OlmoeConfig with OLMoE-1B-7B's dims: 1 of 16 layers × 2048, 64 experts,
                      top-8, expert width 1024 (fused 3-D expert weights), vocab 50,304,
                      untied (626 M)
    t5-small          T5Config() defaults (encoder–decoder, vocab 32,128, tied; 61 M): with
                      ``ga.tasks.causal_lm`` a refusal naming ``ga.tasks.seq2seq`` is expected

T = 128, ``--train`` (4) / ``--queries`` (2) sequences of random token ids. Methods as in
``real_scale.py`` (``--methods``; default: every method of its table).

Per run the record adds ``coverage`` (``explain()``'s coverage line of the default layers:
``ga.capture.coverage.layer_coverage`` of the task's ``TransformerBlocks``) and
``coverage_by_hand`` (the trainable parameters of the ``nn.Linear`` / HF ``Conv1D``
modules inside ``model.layers`` / ``transformer.h`` / ... over every trainable parameter,
each counted once), and the checks of issue 28: ``peak ≤ 1.5 × budget``, every pass's
measured / estimated in [1/3, 3], and (per model) TRAK's seconds ≤ 2 × LoGra's.

Every run, as the issue's checks were run (``flock`` serializes heavy runs on a shared
machine; ``--max-rss-gb 8``)::

    flock /work/bigmem.lock nice -n 10 env PYTHONPATH=. OMP_NUM_THREADS=1 \\
        .venv/bin/python benchmarks/arch_probe.py --max-rss-gb 8
    ... benchmarks/arch_probe.py --models opt-125m --methods grad_dot logra trak
    ... benchmarks/arch_probe.py --table      # the markdown table in docs/performance.md

Results: ``benchmarks/results/arch_probe.json`` (resumable, as ``real_scale.py``'s).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_scale  # noqa: E402 - the benchmark beside this one

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = ROOT / "benchmarks" / "results" / "arch_probe.json"
MODELS = ("opt-125m", "gpt-neo-125m", "gemma3-270m", "bloom-560m-4l", "phi3-mini-2l", "olmoe-1b-7b-1l", "t5-small")
#: the order runs are made in: the catalogue's defaults the issue's checks name first
METHODS = ("grad_dot", "influence_gn", "logra", "trak", "influence_ekfac", "influence_kfac", "less", "grad_cos",
           "relatif", "grass", "trackstar", "tracin", "self_influence", "influence_datainf")
PEAK_LIMIT, ESTIMATE_LIMIT, TRAK_LIMIT = 1.5, 3.0, 2.0


def build_config(name: str, T: int):
    """(model class, config) of ``name`` (see the module docstring), dropout off."""
    import transformers as tf
    if name == "opt-125m":
        return tf.OPTForCausalLM, tf.OPTConfig(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                               layerdrop=0.0, max_position_embeddings=max(2048, T))
    if name == "gpt-neo-125m":
        return tf.GPTNeoForCausalLM, tf.GPTNeoConfig(
            hidden_size=768, num_layers=12, num_heads=12, attention_types=[[["global", "local"], 6]],
            window_size=256, vocab_size=50257, max_position_embeddings=max(2048, T), embed_dropout=0.0,
            attention_dropout=0.0, resid_dropout=0.0)
    if name == "gemma3-270m":
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512, query_pre_attn_scalar=256,
            max_position_embeddings=max(32768, T), tie_word_embeddings=True, attention_dropout=0.0)
    if name == "bloom-560m-4l":
        return tf.BloomForCausalLM, tf.BloomConfig(hidden_size=1024, n_layer=4, n_head=16, vocab_size=250880,
                                                   hidden_dropout=0.0, attention_dropout=0.0)
    if name == "phi3-mini-2l":
        return tf.Phi3ForCausalLM, tf.Phi3Config(
            hidden_size=3072, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=32, vocab_size=32064, max_position_embeddings=max(4096, T),
            tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    if name == "olmoe-1b-7b-1l":
        return tf.OlmoeForCausalLM, tf.OlmoeConfig(
            hidden_size=2048, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=16,
            num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
            max_position_embeddings=max(4096, T), tie_word_embeddings=False)
    if name == "t5-small":
        return tf.T5ForConditionalGeneration, tf.T5Config(dropout_rate=0.0)
    if name in real_scale.MODELS:     # real_scale.py's models (--plan-only on them)
        return real_scale.build_config(name, T)
    raise SystemExit(f"unknown model {name!r}: one of {', '.join(MODELS + real_scale.MODELS)}")


def coverage_by_hand(model) -> dict:
    """The default layers' share written out without gradalg: trainable parameters of the
    ``nn.Linear`` / HF ``Conv1D`` modules and of the fused experts (3-D ``gate_up_proj`` /
    ``down_proj``) inside the outermost ``nn.ModuleList`` of the model's repeated blocks
    (names from ``named_modules``), over every trainable parameter (each tensor once)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D
    lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)
             and n.split(".")[-1] in ("layers", "h", "block", "layer")]      # a 1-layer model's list too
    lists = [n for n in lists if not any(n.startswith(o + ".") for o in lists if o != n)]
    seen, attributed = set(), 0
    for name, module in model.named_modules():
        fused = isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and module.gate_up_proj.dim() == 3
        if (isinstance(module, (nn.Linear, Conv1D)) or fused) and any(name.startswith(o + ".") for o in lists):
            for p in module.parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    attributed += p.numel()
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"attributed": attributed, "total": total, "lists": lists}


def child(spec: dict) -> dict:
    """One run (``real_scale.run_one`` with this file's models), plus the coverage records."""
    import gradalg as ga
    built = {}

    def config_of(name, T):
        cls, config = build_config(name, T)

        def make(cfg):
            built["model"] = cls(cfg)
            return built["model"]
        return make, config

    real_scale.build_config = config_of
    try:
        rec = real_scale.run_one(spec)
    except ga.GradalgError as err:        # refused before the method started (the task itself)
        rec = {"status": "refused", "message": f"{type(err).__name__}: {err}"}
    model = built.get("model")
    if model is not None:
        rec["parameters"] = sum(p.numel() for p in model.parameters())
        rec["coverage_by_hand"] = coverage_by_hand(model)
        try:
            from gradalg.capture.blocks import select_block_layers
            from gradalg.capture.coverage import layer_coverage
            names = select_block_layers(model).names
            cov = layer_coverage(model, names, selection=ga.TransformerBlocks())
            rec["coverage"] = cov.to_dict()
            rec["coverage_line"] = cov.describe()
        except ga.GradalgError as err:
            rec["coverage_line"] = f"{type(err).__name__}: {err}"
    return rec


def launch(spec: dict, timeout: float, max_rss: float) -> dict:
    """Run ``spec`` in a child process of this file (``real_scale.launch``'s guard: killed
    past ``timeout`` s or ``max_rss`` resident bytes)."""
    return real_scale.launch(spec, timeout, max_rss, script=__file__)


# ----------------------------------------------------------------------------- plans only
PLAN_METHODS = ("grad_dot", "grad_cos", "influence_gn", "influence_ekfac", "influence_kfac", "influence_datainf",
                "relatif", "logra", "grass", "trak", "self_influence")   # (LESS, TrackStar, TracIn need a state)
PROJECTABLE = ("grad_dot", "grad_cos", "influence_gn", "influence_ekfac", "influence_kfac", "influence_datainf",
               "relatif", "self_influence")


def _fixes(message: str) -> list[tuple[str, dict, dict]]:
    """The fixes a refusal names, as written: ``(label, ga.options, method keywords)``."""
    import re
    out = []
    for key, value in re.findall(r"ga\.options\((memory_budget|kron_diagonal_width)=('[^']+'|\d+)\)", message):
        if key == "memory_budget" and value.startswith("'"):
            out.append((f"ga.options(memory_budget={value})", {"memory_budget": value.strip("'")}, {}))
        elif key == "kron_diagonal_width":
            out.append((f"ga.options(kron_diagonal_width={value})", {"kron_diagonal_width": int(value)}, {}))
    if "ga.tasks.seq2seq(model)" in message:
        out.append(("ga.tasks.seq2seq(model), items with labels", {}, {"task": "seq2seq"}))
    if "ga.proj.kron" in message:
        out.append(("projector=ga.proj.kron(64)", {}, {"projector": "kron64"}))
    seen, unique = set(), []
    for fix in out:
        if fix[0] not in seen:
            seen.add(fix[0])
            unique.append(fix)
    return unique


def plan_one(model, name: str, method: str, T: int, n_train: int, n_query: int, options: dict,
             keywords: dict) -> dict:
    """explain() (a plan, no pass) of ``method`` at its defaults (plus ``keywords``) on a
    ``meta``-device model under ``ga.options(**options)``: the plan's estimated seconds and
    peak against its budget, or the refusal."""
    import torch

    import gradalg as ga
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    train = [{"input_ids": torch.randint(0, vocab, (T,), generator=g)} for _ in range(n_train)]
    queries = [{"input_ids": torch.randint(0, vocab, (T,), generator=g)} for _ in range(n_query)]
    rec = {"model": name, "method": method, "T": T, "train": n_train, "queries": n_query,
           "options": {k: v for k, v in options.items()}, "keywords": dict(keywords)}
    try:
        if keywords.get("task") == "seq2seq":   # the encoder-decoder's fix: labels of T / 4 tokens
            task = ga.tasks.seq2seq(model, name=name)
            train, queries = ([{**x, "labels": x["input_ids"][: T // 4]} for x in xs] for xs in (train, queries))
        else:
            task = ga.tasks.causal_lm(model, name=name)
        if keywords.get("projector") == "kron64":
            kw = {"projector": ga.proj.kron(64)}
            m = ga.methods
            if method == "self_influence":
                S = m.self_influence(m.influence, task, train, curvature="ekfac", **kw)
            elif method.startswith("influence_"):
                curvature = {"gn": "auto"}.get(method.split("_", 1)[1], method.split("_", 1)[1])
                S = m.influence(task, train, queries, curvature=curvature, **kw)
            else:
                S = getattr(m, method)(task, train, queries, **kw)
        else:
            S = real_scale.build_scores(method, task, train, queries, {})
        with ga.options(**options):
            e = S.explain()
        rec.update(status="planned", estimated_seconds=float(e.plan.seconds),
                   estimated_peak_bytes=float(e.plan.peak_bytes), memory_budget=int(e.plan.options.memory_budget))
    except ga.GradalgError as err:
        rec.update(status="refused", message=f"{type(err).__name__}: {err}")
    return rec


def plan_all(models, methods, T, n_train, n_query, budget: str, results: Path) -> list[dict]:
    """Every (model, method) planned on ``meta`` models under ``memory_budget=budget``; each
    refusal's named fixes applied as written and planned again (``fix_of`` names the run)."""
    import torch
    runs = [r for r in real_scale.load_results(results) if r["model"] not in models]   # other models' kept
    for name in models:
        cls, config = build_config(name, T)
        with torch.device("meta"):
            model = cls(config).eval()
        for method in methods:
            rec = plan_one(model, name, method, T, n_train, n_query, {"memory_budget": budget}, {})
            runs.append(rec)
            print(_plan_line(rec), flush=True)
            if rec["status"] != "refused":
                continue
            for label, options, keywords in _fixes(rec["message"]):
                if "projector" in keywords and method not in PROJECTABLE:
                    continue
                fixed = plan_one(model, name, method, T, n_train, n_query, {"memory_budget": budget, **options},
                                 keywords)
                fixed["fix_of"] = label
                runs.append(fixed)
                print("   fix " + _plan_line(fixed), flush=True)
        real_scale.save_results(results, runs)
    return runs


def _plan_line(rec: dict) -> str:
    head = f"{rec['model']:15} {rec['method']:18} {rec.get('fix_of', ''):38}"
    if rec["status"] == "planned":
        return (f"{head} plan: {rec['estimated_seconds']:.1f} s, peak {rec['estimated_peak_bytes'] / 1e9:.2f} GB "
                f"/ budget {rec['memory_budget'] / 1e9:.2f} GB")
    return f"{head} refused: {rec['message'][:240]}"


def plan_markdown(runs: list[dict]) -> str:
    """Per model and method: planned (estimated seconds, peak / budget), or the refusal and
    which of its named fixes plan."""
    rows = ["| model | method | at the defaults | the refusal's fixes, applied as written |", "|---|---|---|---|"]
    for r in runs:
        if r.get("fix_of"):
            continue
        fixes = [f for f in runs if f.get("fix_of") and f["model"] == r["model"] and f["method"] == r["method"]]
        if r["status"] == "planned":
            cell = (f"plans: {r['estimated_seconds']:.0f} s, peak {r['estimated_peak_bytes'] / 1e9:.2f} / "
                    f"{r['memory_budget'] / 1e9:.2f} GB")
        else:
            cell = "refused: " + real_scale._cell(r["message"].split(":")[0])
        fix_cell = "; ".join(f"`{f['fix_of']}` " + ("plans" if f["status"] == "planned" else "refused")
                             for f in fixes) or ("-" if r["status"] == "planned" else "none named")
        rows.append(f"| {r['model']} | {r['method']} | {cell} | {fix_cell} |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- checks
def checks(rec: dict, runs: list[dict]) -> dict:
    """Issue 28's checks of one run: {name: (passed, detail)} (only those that apply)."""
    out = {}
    cov, hand = rec.get("coverage"), rec.get("coverage_by_hand")
    if cov and hand:
        out["coverage"] = (cov["attributed_parameters"] == hand["attributed"]
                           and cov["trainable_parameters"] == hand["total"],
                           f"{cov['attributed_parameters']:,} / {cov['trainable_parameters']:,} vs by hand "
                           f"{hand['attributed']:,} / {hand['total']:,}")
    if rec.get("status") != "ok":
        return out
    peak = rec["peak_rss_bytes"] / rec["memory_budget"]
    out["peak"] = (peak <= PEAK_LIMIT, f"{peak:.2f}× budget")
    ratios = [(p.get("measured_cpu") or p["measured"]) / p["estimated"] for p in rec.get("passes", [])
              if p["estimated"] > 0]
    out["estimates"] = (all(1 / ESTIMATE_LIMIT <= r <= ESTIMATE_LIMIT for r in ratios),
                        ", ".join(f"{r:.2g}" for r in ratios) or "-")
    if rec["method"] == "trak":
        logra = next((r for r in runs if r.get("model") == rec["model"] and r.get("method") == "logra"
                      and r.get("status") == "ok" and r.get("T") == rec["T"]
                      and r.get("memory_budget_arg") == rec.get("memory_budget_arg")), None)
        if logra is not None:
            ratio = rec["cpu_seconds"] / logra["cpu_seconds"]
            out["trak_vs_logra"] = (ratio <= TRAK_LIMIT, f"{ratio:.2f}× LoGra (CPU time)")
    return out


def markdown(runs: list[dict]) -> str:
    """The table of docs/performance.md's "Architectures nobody tuned on"."""
    lines = ["| model | method | budget | × fwd+bwd (CPU) | peak RSS / budget (GB) | measured / estimated, per pass "
             "| checks | note |",
             "|---|---|---|---:|---|---|---|---|"]
    order = lambda r: (MODELS.index(r["model"]) if r["model"] in MODELS else 99,  # noqa: E731
                       METHODS.index(r["method"]) if r["method"] in METHODS else 99)
    for r in sorted(runs, key=order):
        params = f" ({r['parameters'] / 1e6:.0f} M)" if r.get("parameters") else ""
        failed = [k for k, (ok, _) in checks(r, runs).items() if not ok]
        tick = "ok" if not failed else "**" + ", ".join(failed) + "**"
        extra = "; ".join(d for k, (ok, d) in checks(r, runs).items() if k == "trak_vs_logra")
        budget = f"`{r['memory_budget_arg']}`" if r.get("memory_budget_arg") else "machine's"
        if r.get("status") == "ok":
            own = (r["peak_rss_bytes"] - r.get("rss_before_method_bytes", 0)) / r["memory_budget"]
            peak = f"{real_scale._gb(r['peak_rss_bytes'])} / {real_scale._gb(r['memory_budget'])} " \
                   f"({r['peak_rss_bytes'] / r['memory_budget']:.2f}×; the method's own {own:.2f}×)"
            lines.append(f"| {r['model']}{params} | {r['method']} | {budget} | {r.get('cpu_ratio', 0):.2f} | {peak} | "
                         f"{real_scale.pass_ratios(r)} | {tick} | {extra} |")
        else:
            msg = real_scale._cell(r.get("message", ""))
            msg = msg if len(msg) <= 300 else f"{msg[:110]} … {msg[-180:]}"   # the fixes are at the end
            lines.append(f"| {r['model']}{params} | {r['method']} | {budget} | | | | {tick} | {r.get('status')}: {msg} |")
    return "\n".join(lines)


def coverage_lines(runs: list[dict]) -> str:
    """One coverage line per model (the plan's, and the count by hand)."""
    out, seen = [], set()
    for r in runs:
        if r.get("model") in seen or "coverage_line" not in r:
            continue
        seen.add(r["model"])
        hand = r.get("coverage_by_hand") or {}
        out.append(f"- {r['model']}: {r['coverage_line'].splitlines()[0]} (by hand: "
                   f"{hand.get('attributed', 0):,} of {hand.get('total', 0):,})")
    return "\n".join(out)


def record(results: Path, rec: dict) -> list[dict]:
    """Add ``rec`` to the results file (replacing the run of its key), re-read under a lock
    (a file in the temporary directory named after it): several drivers may write one file."""
    import fcntl
    import hashlib
    results.parent.mkdir(parents=True, exist_ok=True)
    tag = hashlib.sha1(str(results.resolve()).encode()).hexdigest()[:12]
    with open(Path(tempfile.gettempdir()) / f"arch_probe_{tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        runs = [r for r in real_scale.load_results(results) if real_scale.key_of(r) != real_scale.key_of(rec)]
        runs.append(rec)
        real_scale.save_results(results, runs)
    return runs


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS),
                   choices=MODELS + tuple(m for m in real_scale.MODELS if m not in MODELS),
                   help="this probe's models, or real_scale.py's")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--train", type=int, default=4)
    p.add_argument("--queries", type=int, default=2)
    p.add_argument("--memory-budget", default=None, help="ga.options(memory_budget=...) (a refusal's fix)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it is killed (a shared, loaded machine)")
    p.add_argument("--max-rss-gb", type=float, default=8.0)
    p.add_argument("--results", default=str(DEFAULT_RESULTS))
    p.add_argument("--force", action="store_true")
    p.add_argument("--table", action="store_true")
    p.add_argument("--plan-only", action="store_true", help="plan every method on meta-device models (no pass, "
                   "no memory), apply each refusal's fixes, write --plan-results")
    p.add_argument("--plan-results", default=str(ROOT / "benchmarks" / "results" / "arch_probe_plans.json"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        rec = child(json.loads(args.child))
        Path(args.child_out).write_text(json.dumps(rec))
        return [rec]
    if args.plan_only:
        return plan_all(args.models, [m for m in args.methods if m in PLAN_METHODS], args.T, args.train, args.queries,
                        args.memory_budget or "8GB", Path(args.plan_results))
    results = Path(args.results)
    runs = real_scale.load_results(results)
    if args.table:
        print(markdown(runs))
        print()
        print(coverage_lines(runs))
        plans = real_scale.load_results(Path(args.plan_results))
        if plans:
            print()
            print(plan_markdown(plans))
        return runs
    print(f"# gradalg arch probe — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
          f"{os.cpu_count()} cores, 1 thread; load average {os.getloadavg()[0]:.1f}; T={args.T}, "
          f"{args.train} training sequences, {args.queries} queries", flush=True)
    done = {real_scale.key_of(r): i for i, r in enumerate(runs)}
    for model in args.models:
        for method in args.methods:
            spec = {"model": model, "T": args.T, "method": method, "train": args.train, "queries": args.queries,
                    "data": "random", "dtype": "float32", "device": "cpu", "threads": 1,
                    "memory_budget_arg": real_scale._budget(args.memory_budget), "cache": str(results.parent)}
            key = real_scale.key_of(spec)
            if key in done and not args.force:
                print(f"{real_scale.line_of(runs[done[key]])}   (recorded)", flush=True)
                continue
            rec = {**spec, **launch(spec, args.timeout, args.max_rss_gb * 1e9),
                   "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": os.getloadavg()[0]}
            rec.pop("cache", None)
            runs = record(results, rec)
            print(real_scale.line_of(rec), "|", "; ".join(f"{k} {'ok' if ok else 'FAIL'} ({d})"
                                                          for k, (ok, d) in checks(rec, runs).items()), flush=True)
    return runs


if __name__ == "__main__":
    main()
