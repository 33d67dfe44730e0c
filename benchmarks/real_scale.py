"""Every catalogue method at its defaults on real-size language models: time, memory, estimates.

Models, built from ``transformers`` configs with random weights (nothing is downloaded),
dropout off, in ``--dtype`` (default: the model's own, below) on ``--device``:

    gpt2-small   GPT2Config() defaults: 12 layers, width 768, 12 heads, vocab 50,257,
                 tied head (124 M)
    pythia-160m  GPTNeoXConfig with Pythia-160M's dims: 12 layers, width 768, 12 heads,
                 rotary on a quarter of each head, parallel residual, vocab 50,304,
                 untied 50 k head (162 M)
    llama-200m   LlamaConfig: 12 layers, width 1024, 16 heads / 4 kv heads (GQA), SwiGLU
                 (intermediate 2816), RMSNorm, vocab 32,000, untied head (201 M)
    qwen2-0.5b   Qwen2Config with Qwen2-0.5B's dims: 24 layers, hidden 896, 14 heads / 2 kv
                 heads, intermediate 4864, vocab 151,936, tied; bfloat16 (494 M)
    tiny-gpt2    2 layers × 64, vocab 128 (the smoke test's model)

Architectures added in session 38 to play issue 28's check on models it does not name
(real widths; layers reduced only where the full depth would pass 1.2 GB in float32):

    opt-125m     OPTConfig with OPT-125m's dims: 12 layers, width 768, 12 heads, ReLU MLP
                 (3,072), learned positions (offset 2), biases, vocab 50,272, tied (125 M)
    gemma3-270m  Gemma3TextConfig with Gemma-3-270m's dims: 18 layers, hidden 640, 4 heads
                 / 1 kv head of 256, GeGLU (2,048), q/k norms, sliding-window layers, scaled
                 embedding, vocab 262,144, tied (268 M: 63% of it the embedding/head)
    olmoe-2l     OlmoeConfig at OLMoE-1B-7B's width (hidden 2048, 16 heads, expert
                 intermediate 1,024, q/k norms, vocab 50,304, untied) with 2 layers and 8
                 experts, top-2 (Mixtral's routing; OLMoE's 64 experts would be 1.6 GB a
                 layer): fused experts (340 M)

Added in session 41, shapes that neither issue 28 nor the models above have (random
init, float32; widths chosen so that each is ~10⁸ parameters):

    phi-160m     PhiConfig at GPT-2-small width: 12 layers, width 768, 12 heads, parallel
                 attention + MLP from one LayerNorm, rotary on half of each head, biases,
                 vocab 51,200, untied head with a bias (164 M)
    bloom-250k   BloomConfig with BLOOM's 250,880 vocabulary at width 512 (6 layers, 8
                 heads): ALiBi, fused query_key_value, embedding LayerNorm, tied (147 M:
                 87% of it the embedding)
    falcon-mq    FalconConfig in Falcon-7B's layout at width 1024 (8 layers, 16 heads):
                 multi-query attention (one kv head, fused query_key_value → 1,152),
                 parallel attention + MLP, no biases, vocab 65,024, tied (152 M)
    mistral-swa  MistralConfig: 12 layers, width 768, 12 heads / 4 kv heads, SwiGLU
                 (2,048), sliding window 64 (< T), vocab 32,768, untied (126 M)
    qwen2moe-2l  Qwen2MoeConfig (Qwen1.5-MoE's layout) with 2 layers at width 768: 8
                 fused experts top-2 (intermediate 768) beside a shared expert (2,048)
                 whose sigmoid gate is a 768 → 1 linear, q/k/v biases, vocab 151,936,
                 untied (276 M: 85% of it the embedding and head)

T ∈ {128, 512, 2048} (``--T``); ``--train N --queries M`` sequences of T tokens.
Data (``--data``): ``random`` token ids (default); ``stdlib-bpe``: the Python standard
library's own sources (``sysconfig``'s stdlib folder, files in sorted order), tokenized
with a byte-level BPE trained on them with the ``tokenizers`` package (vocabulary
min(model's, 16,384), cached beside the results); ``stdlib-bytes``: the same text,
one token per byte through GPT-2's byte-to-token mapping (ids < 256). The model is not
trained: scores are of a random-init model, the costs are those of real-size shapes.

Methods (``--methods``, keys below, or ``all``), each with the catalogue's defaults and
the public API only (``ga.methods``; ``layers`` left to the default, so whatever layers
the library picks for a causal LM are the ones timed):

    grad_dot, grad_cos          Grad-Dot / Grad-Cos
    influence_gn                influence, curvature="gauss_newton" (the default)
    influence_ekfac / _kfac     influence with EK-FAC / K-FAC
    influence_datainf           influence with DataInf
    relatif                     RelatIF (its default curvature)
    logra, grass, trak          LoGra, FactGraSS, TRAK (one model)
    less                        LESS, one checkpoint: an Adam optimizer after one step on
                                a batch of the training set (weights put back); each
                                query is its own target group
    trackstar                   TrackStar with the same Adam state
    tracin                      TracIn-CP over 2 checkpoints (the model and a copy with
                                weights moved by 1e-3 · N(0, 1)): two models in memory
    (the Adam state and the second checkpoint are built before the method's clock and
    memory peak start: a user has them already)
    perturbed_<m>               ga.methods.ensemble of <m> (logra, relatif) over
                                ga.methods.perturbed(task) at its defaults (6 copies, s = 0.3;
                                the copies made inside the clock and the memory peak: M + 1
                                models in memory)
    self_influence              self_influence(influence, curvature="ekfac") on the
                                training set (the default Gauss-Newton is influence_gn's)

Not run: ``magic`` and ``source`` replay a training run (``ga.unroll.TrainingRun``),
which a model built from a config does not have; ``ensemble`` is a combinator (its cost
is its member's times the number of models).

Each (model, T, method) runs in its own subprocess, so that its peak resident memory is
that run's alone. In that process, after building the model and a
one-sequence warm-up forward+backward, the resident high-water mark is reset (Linux
``/proc/self/clear_refs``, to the RSS of the model, its data and what the user holds
already, e.g. the Adam state; the allocator's free pages are returned first), then the method's ``Scores.explain(analyze=True)``, which
plans, runs every pass and keeps each pass's estimated and measured seconds; its peak is
``VmHWM`` (``ru_maxrss`` since the reset; the process's ``ru_maxrss`` is kept beside it,
and is the peak where the reset is not possible; on CUDA also the device's peak). Then,
the unit: a plain forward+backward over the same tokens (training set and queries,
batches of ``max(1, 2048 // T)`` sequences), after the method so that its activations
are not in the method's peak. Printed per
method: seconds per 1,000 tokens (training + query tokens), the multiple of the plain
pass (wall time, and process CPU time: with one thread, the work without the waits for a
core that other processes of a shared machine cause), peak RSS against
``ga.get_options().memory_budget`` (the budget in force in that
process: the library's default unless ``--memory-budget``), and measured / estimated
seconds per pass; a refusal (a ``ga.GradalgError``) prints ``refused: <message>``.
The parent kills a run past ``--timeout`` seconds (900) or above ``--max-rss-gb`` resident
GB (6: the machine is shared) and records that.

Results go to ``--results`` (JSON, default ``benchmarks/results/real_scale.json``), one
record per run, written after each; a rerun skips the (model, T, method, train, queries,
data, dtype, device, threads, budget) already recorded (``--force`` reruns them).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_scale.py     # gpt2-small, T=128, 8/2
    ... benchmarks/real_scale.py --models gpt2-small pythia-160m --T 128 \\
            --methods grad_dot logra trak influence_ekfac influence_kfac less
    ... benchmarks/real_scale.py --methods all --T 128 512 --data stdlib-bpe
    ... benchmarks/real_scale.py --table          # the markdown table for docs/performance.md
    ... benchmarks/real_scale.py --table --before benchmarks/results/real_scale_before.json   # old beside new
    ... benchmarks/real_scale.py --table --check --results NEW.json --merge OLD.json
        # issue 28's check per run (scores, peak ≤ 1.5× budget, passes ≤ 3× estimate,
        # TRAK ≤ 2× LoGra), NEW's records over OLD's of the same key
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = ROOT / "benchmarks" / "results" / "real_scale.json"
MODELS = ("gpt2-small", "pythia-160m", "llama-200m", "qwen2-0.5b", "tiny-gpt2", "opt-125m", "gemma3-270m",
          "olmoe-2l", "phi-160m", "bloom-250k", "falcon-mq", "mistral-swa", "qwen2moe-2l")
DEFAULT_DTYPE = {"qwen2-0.5b": "bfloat16"}        # the others: float32
METHODS = ("grad_dot", "grad_cos", "influence_gn", "influence_ekfac", "influence_kfac", "influence_datainf",
           "relatif", "logra", "grass", "trak", "less", "trackstar", "tracin", "self_influence",
           "perturbed_logra", "perturbed_relatif")
DEFAULT_METHODS = ("grad_dot", "logra", "trak", "influence_ekfac", "influence_kfac", "less")
NOT_APPLICABLE = {
    "magic": "replays a training run (ga.unroll.TrainingRun); a model built from a config has none",
    "source": "replays a training run in segments (ga.unroll.TrainingRun); a model built from a config has none",
    "ensemble": "a combinator over several models: its cost is a member's times their number",
}
KEY_FIELDS = ("model", "T", "method", "train", "queries", "data", "dtype", "device", "threads", "memory_budget_arg")


# ----------------------------------------------------------------------------- models
def build_config(name: str, T: int):
    """(model class, config) of ``name``, with room for T positions and dropout off."""
    import transformers as tf
    if name == "gpt2-small":
        return tf.GPT2LMHeadModel, tf.GPT2Config(n_positions=max(1024, T), resid_pdrop=0.0, embd_pdrop=0.0,
                                                 attn_pdrop=0.0)
    if name == "tiny-gpt2":
        return tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=max(64, T),
                                                 bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                 attn_pdrop=0.0)
    if name == "pythia-160m":
        return tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(
            hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
            vocab_size=50304, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False,
            max_position_embeddings=max(2048, T), hidden_dropout=0.0, attention_dropout=0.0)
    if name == "llama-200m":
        return tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
            num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=max(2048, T))
    if name == "qwen2-0.5b":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
            max_position_embeddings=max(32768, T), rope_theta=1e6)
    if name == "opt-125m":
        return tf.OPTForCausalLM, tf.OPTConfig(
            vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12,
            word_embed_proj_dim=768, activation_function="relu", max_position_embeddings=max(2048, T),
            tie_word_embeddings=True, dropout=0.0, attention_dropout=0.0, layerdrop=0.0)
    if name == "gemma3-270m":
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512, rope_theta=1e6,
            max_position_embeddings=max(32768, T), tie_word_embeddings=True, attention_dropout=0.0)
    if name == "olmoe-2l":
        return tf.OlmoeForCausalLM, tf.OlmoeConfig(
            vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=max(4096, T),
            tie_word_embeddings=False, attention_dropout=0.0)
    if name == "phi-160m":
        return tf.PhiForCausalLM, tf.PhiConfig(
            vocab_size=51200, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
            partial_rotary_factor=0.5, max_position_embeddings=max(2048, T), tie_word_embeddings=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    if name == "bloom-250k":
        return tf.BloomForCausalLM, tf.BloomConfig(
            vocab_size=250880, hidden_size=512, n_layer=6, n_head=8, tie_word_embeddings=True,
            hidden_dropout=0.0, attention_dropout=0.0)
    if name == "falcon-mq":
        return tf.FalconForCausalLM, tf.FalconConfig(
            vocab_size=65024, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, multi_query=True,
            parallel_attn=True, new_decoder_architecture=False, bias=False, alibi=False,
            max_position_embeddings=max(2048, T), tie_word_embeddings=True, hidden_dropout=0.0,
            attention_dropout=0.0)
    if name == "mistral-swa":
        return tf.MistralForCausalLM, tf.MistralConfig(
            vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=4, sliding_window=64, max_position_embeddings=max(4096, T),
            tie_word_embeddings=False, attention_dropout=0.0)
    if name == "qwen2moe-2l":
        return tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
            vocab_size=151936, hidden_size=768, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=12,
            num_key_value_heads=12, moe_intermediate_size=768, shared_expert_intermediate_size=2048, num_experts=8,
            num_experts_per_tok=2, max_position_embeddings=max(4096, T), tie_word_embeddings=False,
            attention_dropout=0.0)
    raise SystemExit(f"unknown model {name!r}: one of {', '.join(MODELS)}")


# ----------------------------------------------------------------------------- data
def _stdlib_text(max_bytes: int) -> str:
    """The standard library's own .py sources, in sorted path order, up to max_bytes."""
    import sysconfig
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "\n".join(parts)


def gpt2_byte_ids() -> list[int]:
    """GPT-2's byte → token id of its single-byte token (``bytes_to_unicode``'s order:
    the printable bytes ! … ~, ¡ … ¬, ® … ÿ first, the others after)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    order = printable + [b for b in range(256) if b not in printable]
    ids = [0] * 256
    for token_id, b in enumerate(order):
        ids[b] = token_id
    return ids


def stdlib_tokens(kind: str, vocab: int, n_tokens: int, cache: Path):
    """A 1-D LongTensor of at least ``n_tokens`` ids < vocab from the stdlib sources."""
    import torch
    text = _stdlib_text(max_bytes=max(4 * n_tokens + 2**20, 2**22))
    if kind == "stdlib-bytes":
        table = gpt2_byte_ids()
        ids = [table[b] for b in text.encode("utf-8")]
        if vocab < 256:
            ids = [i % vocab for i in ids]
    else:
        from tokenizers import ByteLevelBPETokenizer, Tokenizer
        if vocab < 512:
            raise SystemExit(f"a byte-level BPE needs a vocabulary of at least 512 (256 bytes and merges); "
                             f"this model has {vocab}: use --data stdlib-bytes")
        size = min(vocab, 16384)
        path = cache / f"stdlib_bpe_{size}.json"
        if path.exists():
            tok = Tokenizer.from_file(str(path))
        else:
            bpe = ByteLevelBPETokenizer()
            bpe.train_from_iterator([text[i:i + 2**16] for i in range(0, len(text), 2**16)], vocab_size=size,
                                    min_frequency=2, show_progress=False)
            path.parent.mkdir(parents=True, exist_ok=True)
            bpe.save(str(path))
            tok = Tokenizer.from_file(str(path))
        ids = tok.encode(text).ids
        assert max(ids) < vocab, (max(ids), vocab)
    if len(ids) < n_tokens:
        raise SystemExit(f"the stdlib text gives {len(ids):,} tokens, {n_tokens:,} needed: fewer sequences or a smaller T")
    return torch.tensor(ids, dtype=torch.long)


def make_data(kind: str, vocab: int, T: int, n_train: int, n_query: int, cache: Path):
    """(train, queries): lists of {"input_ids": (T,)} dict items. Random: seeded uniform ids;
    stdlib: consecutive T-token chunks, the training set from the start of the text and the
    queries from its end (other files). ``kind`` ending in ``+padF`` (``--pad F``): each
    sequence keeps its first L tokens, L seeded uniform in [⌈(1 − F)·T⌉, T] (gradalg's
    collate right-pads each chunk to its longest)."""
    import torch
    kind, _, pad = kind.partition("+pad")
    if pad:
        train, queries = make_data(kind, vocab, T, n_train, n_query, cache)
        g = torch.Generator().manual_seed(1)
        low = max(2, math.ceil((1 - float(pad)) * T))
        lengths = torch.randint(low, T + 1, (len(train) + len(queries),), generator=g).tolist()
        cut = [{"input_ids": x["input_ids"][:n]} for x, n in zip(train + queries, lengths)]
        return cut[:len(train)], cut[len(train):]
    if kind == "random":
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (n_train + n_query, T), generator=g)
        train, queries = ids[:n_train], ids[n_train:]
    else:
        stream = stdlib_tokens(kind, vocab, (n_train + n_query) * T, cache)
        train = stream[:n_train * T].view(n_train, T)
        queries = stream[len(stream) - n_query * T:].view(n_query, T)
    return [{"input_ids": r} for r in train], [{"input_ids": r} for r in queries]


# ----------------------------------------------------------------------------- methods
def _adam_after_one_step(task, model, train):
    """An Adam optimizer over ``model`` after one step on (up to) 4 training sequences,
    the checkpoint unchanged (LESS and TrackStar read its moments). The step is taken at
    learning rate 0 (the moments are those of any learning rate; the weights do not
    move), then the rate is set to 1e-4: no copy of the weights, and the sequences'
    gradients accumulate one at a time, so that this set-up (a user has it already)
    holds the model, its gradients and the Adam state, never more (before, a copy of the
    weights and a 4-sequence batch took a 340 M model past 8 GB here)."""
    import torch
    device = next(model.parameters()).device
    opt = torch.optim.Adam(model.parameters(), lr=0.0)
    for x in train[:4]:
        task.summed_loss(model, {"input_ids": x["input_ids"].unsqueeze(0).to(device)}).backward()
    opt.step()
    for group in opt.param_groups:
        group["lr"] = 1e-4
    model.zero_grad(set_to_none=True)
    return opt


def method_inputs(method: str, task, model, train) -> dict:
    """What a method needs besides the model and the data, built before its clock and its
    memory peak start (a user has them already): the Adam state of LESS and TrackStar,
    TracIn's second checkpoint."""
    import torch

    import gradalg as ga
    if method in ("less", "trackstar"):
        return {"optimizer": _adam_after_one_step(task, model, train)}
    if method == "tracin":
        other = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=g).to(p))
        return {"second": ga.tasks.causal_lm(other.eval(), name=f"{task.name}-ckpt2")}
    return {}


def build_scores(method: str, task, train, queries, inputs: dict):
    """The lazy Scores of ``method`` at the catalogue's defaults (``inputs``: :func:`method_inputs`)."""
    import torch

    import gradalg as ga
    m = ga.methods
    if method in ("grad_dot", "grad_cos", "relatif", "logra", "grass", "trak"):    # (task, train, queries)
        return getattr(m, method)(task, train, queries)
    if method == "influence_gn":
        return m.influence(task, train, queries)
    if method.startswith("influence_"):
        return m.influence(task, train, queries, curvature=method.split("_", 1)[1])
    if method == "less":
        return m.less([task], [inputs["optimizer"]], [1.0], train, queries, torch.arange(len(queries)))
    if method == "trackstar":
        return m.trackstar(task, train, queries, optimizer=inputs["optimizer"])
    if method == "tracin":
        return m.tracin([task, inputs["second"]], [1.0, 1.0], train, queries)
    if method == "self_influence":
        return m.self_influence(m.influence, task, train, curvature="ekfac")
    if method.startswith("perturbed_"):
        return m.ensemble(getattr(m, method.split("_", 1)[1]), m.perturbed(task), train, queries)
    raise SystemExit(f"unknown method {method!r}: one of {', '.join(METHODS)}")


# ----------------------------------------------------------------------------- one run (child)
def _peak_rss_bytes() -> int:
    """The process's peak resident memory: ``ru_maxrss`` (Linux: KiB), or the high-water
    mark ``VmHWM`` since :func:`_reset_peak_rss` where that worked."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> bool:
    """Reset the resident high-water mark to the current RSS (Linux ≥ 4.0: ``5`` to
    /proc/self/clear_refs), so that the method's peak is not the plain pass's. False
    where it cannot (then the peak is the whole process's, ``ru_maxrss``). The
    allocator's free pages are returned first (``malloc_trim``, as the library does
    after each pass): the warm-up's and the Adam step's freed gradients (a model's
    size) are not the method's."""
    import gc

    from gradalg.exec.allocator import release_free_memory
    gc.collect()
    release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _plan_numbers(explained) -> dict:
    """Each pass's estimated and measured seconds, and the plan's estimates, from
    ``explain(analyze=True)``; a plan that reads otherwise leaves a note, not a lost run."""
    try:
        passes = [{"reads": r.get("reads"), "estimated": r["seconds"], "measured": r["measured_seconds"],
                   "measured_cpu": r.get("measured_cpu_seconds"), "batch_size": r.get("batch_size"),
                   "estimated_peak_bytes": r.get("peak_bytes")}
                  for r in explained.passes() if "measured_seconds" in r]
        return {"passes": passes, "estimated_seconds": float(explained.plan.seconds),
                "estimated_peak_bytes": float(explained.plan.peak_bytes)}
    except Exception as err:  # noqa: BLE001 - the timing stands without the plan's numbers
        return {"passes": [], "plan_note": f"plan numbers not read: {type(err).__name__}: {err}"}


def plain_pass(task, model, items, batch: int, device) -> None:
    """Forward and ``loss.backward()`` over ``items`` (all parameter gradients), in batches."""
    from gradalg.collate import pad_collate
    model.zero_grad(set_to_none=True)
    for start in range(0, len(items), batch):      # (unequal lengths, --pad: right-padded as gradalg does)
        chunk = {k: v.to(device) for k, v in pad_collate(items[start:start + batch]).items()}
        task.summed_loss(model, chunk).backward()
    model.zero_grad(set_to_none=True)


def run_one(spec: dict) -> dict:
    """One (model, T, method) in this process: the method's ``explain(analyze=True)``, then
    (when it ran) the plain pass. Returns the record (status "ok", "refused" or "error")."""
    import torch
    torch.set_num_threads(spec["threads"])
    import gradalg as ga
    from gradalg.plan.budget import budget_bytes
    from gradalg.devices import local_profile
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    local_profile()   # measured once per machine and cached: kept out of the method's time
    cls, config = build_config(spec["model"], spec["T"])
    torch.manual_seed(0)
    model = cls(config).to(device=device, dtype=getattr(torch, spec["dtype"])).eval()
    n_params = sum(p.numel() for p in model.parameters())
    task = ga.tasks.causal_lm(model, name=spec["model"])
    train, queries = make_data(spec["data"], config.vocab_size, spec["T"], spec["train"], spec["queries"],
                               Path(spec["cache"]))
    tokens = sum(len(x["input_ids"]) for x in train + queries)     # real tokens (--pad: fewer than n·T)
    rec = {"parameters": n_params, "tokens": tokens, "status": None}

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    batch = max(1, 2048 // spec["T"])
    plain_pass(task, model, train[:1], 1, device)                      # warm-up: allocator, kernels
    inputs = method_inputs(spec["method"], task, model, train)
    sync()
    rec["peak_rss_reset"] = _reset_peak_rss()
    rec["rss_before_method_bytes"] = _peak_rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    options = {"progress": False}
    if spec.get("memory_budget_arg"):
        options["memory_budget"] = spec["memory_budget_arg"]
    with ga.options(**options):
        # the budget a plan made now gets (ga.options(memory_budget=None): a fraction of the
        # memory available; the plan's own, read below, is the one it ran under)
        rec["memory_budget"] = budget_bytes(ga.get_options(), next(model.parameters()).device)
        start, cpu = time.perf_counter(), time.process_time()
        try:
            S = build_scores(spec["method"], task, train, queries, inputs)
            explained = S.explain(analyze=True)
            sync()
        except ga.GradalgError as err:
            rec.update(status="refused", message=f"{type(err).__name__}: {err}",
                       seconds_to_refusal=time.perf_counter() - start)
        except Exception as err:  # noqa: BLE001 - recorded in the table, the other runs go on
            rec.update(status="error", message=f"{type(err).__name__}: {err}")
        else:
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
            rec.update(status="ok", seconds=seconds, cpu_seconds=cpu_seconds, **_plan_numbers(explained))
            rec["memory_budget"] = int(explained.plan.options.memory_budget)
    rec["peak_rss_bytes"] = _peak_rss_bytes()
    rec["process_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if cuda:
        rec["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(device))
    S = explained = inputs = None
    if rec["status"] != "ok":
        return rec
    # the unit, after the method (so that its activations are not in the method's peak)
    sync()
    start, cpu = time.perf_counter(), time.process_time()
    plain_pass(task, model, train + queries, batch, device)
    sync()
    rec["plain_seconds"], rec["plain_cpu_seconds"] = time.perf_counter() - start, time.process_time() - cpu
    rec.update(ratio=rec["seconds"] / rec["plain_seconds"], cpu_ratio=rec["cpu_seconds"] / rec["plain_cpu_seconds"],
               seconds_per_1k_tokens=1000 * rec["seconds"] / tokens)
    return rec


# ----------------------------------------------------------------------------- the parent
def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def launch(spec: dict, timeout: float, max_rss: float, script: str | Path | None = None) -> dict:
    """Run ``spec`` in a child process of ``script`` (default: this file; it must take
    ``--child SPEC --child-out FILE``); kill it past ``timeout`` s or ``max_rss`` bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, str(Path(script or __file__).resolve()), "--child", json.dumps(spec), "--child-out", str(out)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killed, peak = None, 0
        while proc.poll() is None:
            peak = max(peak, _rss_bytes(proc.pid))
            if time.perf_counter() - start > timeout:
                killed = f"timeout: killed after {timeout:.0f} s"
            elif peak > max_rss:
                killed = f"killed: resident memory {peak / 1e9:.1f} GB over --max-rss-gb {max_rss / 1e9:.1f}"
            if killed:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.25)
        output = proc.stdout.read()
        if killed:
            return {"status": "killed", "message": killed, "peak_rss_bytes": peak,
                    "wall_seconds": time.perf_counter() - start}
        if proc.returncode != 0 or not out.exists():
            tail = " | ".join(output.strip().splitlines()[-3:])
            return {"status": "error", "message": f"exit {proc.returncode}: {tail[-400:]}"}
        rec = json.loads(out.read_text())
        rec["wall_seconds"] = time.perf_counter() - start
        return rec


def load_results(path: Path) -> list[dict]:
    return json.loads(path.read_text())["runs"] if path.exists() else []


def save_results(path: Path, runs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"runs": runs}, indent=1))
    tmp.replace(path)


def key_of(rec: dict) -> tuple:
    return tuple(rec.get(k) for k in KEY_FIELDS)


# ----------------------------------------------------------------------------- printing
def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def pass_ratios(rec: dict) -> str:
    """measured / estimated seconds of each pass (CPU seconds where measured: the pass's
    own work on a shared machine), e.g. ``1.3, 0.8``."""
    out = []
    for p in rec.get("passes", []):
        measured = p["measured_cpu"] if p.get("measured_cpu") is not None else p["measured"]
        out.append(f"{measured / p['estimated']:.2g}" if p["estimated"] > 0 else "∞")
    return ", ".join(out) or "-"


def _cpu_ratio(rec: dict) -> str:
    return f"{rec['cpu_ratio']:.2f}" if rec.get("cpu_ratio") is not None else "-"


def line_of(rec: dict) -> str:
    head = f"{rec['model']:12} T={rec['T']:<5} {rec['method']:18}"
    status = rec.get("status")
    if status == "ok":
        budget = rec["memory_budget"]
        return (f"{head} {rec['seconds_per_1k_tokens']:8.2f} s/1k tokens  {rec['ratio']:6.2f}× fwd+bwd "
                f"({_cpu_ratio(rec)}× in CPU time)  "
                f"peak {_gb(rec['peak_rss_bytes'])} GB / budget {_gb(budget)} GB "
                f"({rec['peak_rss_bytes'] / budget:.2f}×)  measured/estimated per pass: {pass_ratios(rec)}")
    return f"{head} {_status_label(rec)}{rec.get('message', '')[:300]}"


def _status_label(rec: dict) -> str:
    """"refused: " / "error: "; nothing for a killed run (its message says timeout or memory)."""
    return "" if rec.get("status") == "killed" else f"{rec.get('status')}: "


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _order(rec: dict) -> tuple:
    model, method = rec.get("model"), rec.get("method")
    return (MODELS.index(model) if model in MODELS else len(MODELS), rec.get("T") or 0,
            METHODS.index(method) if method in METHODS else len(METHODS))


def _own(rec: dict) -> str:
    """``; own 0.4×``: the method's own resident growth (peak − the RSS at the reset: the
    model, data and what the user held before, e.g. an Adam state, excluded) over the
    budget, which bounds what the run adds (``gradalg.plan.budget``); empty where the
    peak mark was not reset."""
    if not rec.get("peak_rss_reset") or rec.get("rss_before_method_bytes") is None:
        return ""
    return f"; own {(rec['peak_rss_bytes'] - rec['rss_before_method_bytes']) / rec['memory_budget']:.2f}×"


def _before_cell(rec: dict | None) -> str:
    if rec is None:
        return "-"
    if rec.get("status") == "ok":
        return f"{_cpu_ratio(rec)}, {_gb(rec['peak_rss_bytes'])} GB"
    return "killed" if rec.get("status") == "killed" else rec.get("status", "?")


def markdown(runs: list[dict], before: list[dict] | None = None) -> str:
    """The table for docs/performance.md: one row per run, by model, T and method; with
    ``before`` (the records of another checkout), a column of its × fwd+bwd (CPU) and peak
    for the same (model, T, method, data, sizes), or its refusal."""
    earlier = {key_of(r): r for r in before or []}
    extra = " before: × fwd+bwd (CPU), peak |" if before is not None else ""
    lines = ["| model | T | method | s / 1k tokens | × fwd+bwd (wall) | × fwd+bwd (CPU) | peak RSS / budget (GB; own: the method's growth) "
             "| measured / estimated, per pass | note |" + extra,
             "|---|---:|---|---:|---:|---:|---|---|---|" + ("---|" if extra else "")]
    for r in sorted(runs, key=_order):
        model = f"{r['model']} ({r['parameters'] / 1e6:.0f} M, {r['dtype']})" if r.get("parameters") else r["model"]
        tail = f" {_before_cell(earlier.get(key_of(r)))} |" if extra else ""
        if r.get("status") == "ok":
            peak = f"{_gb(r['peak_rss_bytes'])} / {_gb(r['memory_budget'])} ({r['peak_rss_bytes'] / r['memory_budget']:.1f}×{_own(r)})"
            lines.append(f"| {model} | {r['T']} | {r['method']} | {r['seconds_per_1k_tokens']:.2f} | "
                         f"{r['ratio']:.2f} | {_cpu_ratio(r)} | {peak} | {pass_ratios(r)} | |" + tail)
        else:
            lines.append(f"| {model} | {r['T']} | {r['method']} | | | | | | {_status_label(r)}"
                         f"{_cell(r.get('message', ''))[:200]} |" + tail)
    return "\n".join(lines)


# The hidden check of issue 28, per run: scores (or a refusal whose fix works), peak within
# PEAK_LIMIT × the budget, each pass within PASS_LIMIT × its estimate (CPU seconds), TRAK
# within TRAK_LIMIT × LoGra's time (CPU seconds, same model and sizes).
PEAK_LIMIT, PASS_LIMIT, TRAK_LIMIT = 1.5, 3.0, 2.0


def _worst_pass(rec: dict) -> float | None:
    """The largest measured / estimated seconds over the run's passes (CPU seconds where measured)."""
    ratios = [(p["measured_cpu"] if p.get("measured_cpu") is not None else p["measured"]) / p["estimated"]
              for p in rec.get("passes", []) if p["estimated"] > 0]
    return max(ratios) if ratios else None


def _mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def check_cells(rec: dict, runs: list[dict]) -> tuple[str, str, str, str]:
    """The check's four conditions for one record: (outcome, peak ÷ budget, worst pass ÷
    its estimate, TRAK ÷ LoGra in CPU seconds: TRAK's rows only, against the LoGra record
    of the same model, T, sizes, data and dtype in ``runs``). A killed run is not judged
    (its message says whether the harness's time or memory cap stopped it); a refusal is
    judged by hand (apply its fix as written, record the rerun)."""
    status = rec.get("status")
    if status != "ok":
        outcome = {"refused": "refused", "error": "✗ error", "killed": "killed"}.get(status, str(status))
        return outcome, "", "", ""
    peak = rec["peak_rss_bytes"] / rec["memory_budget"]
    worst = _worst_pass(rec)
    passes = "-" if worst is None else f"{worst:.2g} {_mark(worst <= PASS_LIMIT)}"
    trak = ""
    if rec["method"] == "trak":
        same = ("model", "T", "train", "queries", "data", "dtype", "device", "threads")
        logra = [r for r in runs if r.get("method") == "logra" and r.get("status") == "ok"
                 and all(r.get(k) == rec.get(k) for k in same)]
        if logra:
            ratio = rec["cpu_seconds"] / logra[-1]["cpu_seconds"]
            trak = f"{ratio:.2f} {_mark(ratio <= TRAK_LIMIT)}"
    return "scores ✓", f"{peak:.2f} {_mark(peak <= PEAK_LIMIT)}", passes, trak


def check_markdown(runs: list[dict]) -> str:
    """One row per run with the hidden check's four conditions (``check_cells``)."""
    lines = ["| model | T | method | outcome | × fwd+bwd (CPU) | peak / budget (GB) | peak ÷ budget (≤ 1.5) "
             "| worst pass ÷ estimate (≤ 3, CPU) | TRAK ÷ LoGra (≤ 2, CPU) | run (UTC, load average) or note |",
             "|---|---:|---|---|---:|---|---:|---:|---:|---|"]
    for r in sorted(runs, key=_order):
        outcome, peak, passes, trak = check_cells(r, runs)
        method = r["method"] + (f" (--memory-budget {r['memory_budget_arg']})" if r.get("memory_budget_arg") else "")
        if r.get("status") == "ok":
            gb = f"{_gb(r['peak_rss_bytes'])} / {_gb(r['memory_budget'])}"
            when = f"{r['when']}, load {r['load_average']:.1f}" if r.get("when") and r.get("load_average") else ""
            lines.append(f"| {r['model']} | {r['T']} | {method} | {outcome} | {_cpu_ratio(r)} | {gb} | {peak} "
                         f"| {passes} | {trak} | {when} |")
        else:
            lines.append(f"| {r['model']} | {r['T']} | {method} | {outcome} | | | | | | "
                         f"{_cell(r.get('message', ''))[:200]} |")
    return "\n".join(lines)


def merged_results(paths: list[Path]) -> list[dict]:
    """The records of several results files, a later file's record replacing an earlier
    one's of the same key (``KEY_FIELDS``)."""
    out: dict[tuple, dict] = {}
    for path in paths:
        for rec in load_results(path):
            out[key_of(rec)] = rec
    return list(out.values())


# ----------------------------------------------------------------------------- main
def _budget(text: str | None):
    if text is None:
        return None
    return int(text) if text.isdigit() else text   # "8GB" is parsed by ga.options


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt2-small"], choices=MODELS)
    p.add_argument("--T", nargs="+", type=int, default=[128])
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help=f"keys of {', '.join(METHODS)}, or 'all'")
    p.add_argument("--train", type=int, default=8)
    p.add_argument("--queries", type=int, default=2)
    p.add_argument("--data", default="random", choices=("random", "stdlib-bpe", "stdlib-bytes"))
    p.add_argument("--pad", type=float, default=0.0, help="sequences of seeded lengths in [(1 - PAD)·T, T] "
                   "(right-padded in each chunk); recorded as data '<data>+pad<PAD>'")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: float32, qwen2-0.5b bfloat16)")
    p.add_argument("--memory-budget", default=None, help="ga.options(memory_budget=...) for the runs "
                   "(default: the library's own)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed")
    p.add_argument("--max-rss-gb", type=float, default=6.0, help="kill a run above this resident memory")
    p.add_argument("--results", default=str(DEFAULT_RESULTS))
    p.add_argument("--force", action="store_true", help="rerun what the results file already has")
    p.add_argument("--table", action="store_true", help="print the markdown table of the results file and exit")
    p.add_argument("--before", default=None, help="with --table: another results file (e.g. the code before a "
                   "change), shown in a column beside each run")
    p.add_argument("--check", action="store_true", help="with --table: the hidden check's four conditions per "
                   "run (scores, peak ≤ 1.5× budget, each pass ≤ 3× its estimate, TRAK ≤ 2× LoGra)")
    p.add_argument("--merge", nargs="+", default=[], help="with --table: earlier results files, their records "
                   "shown where --results has none of the same key")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        rec = run_one(json.loads(args.child))
        Path(args.child_out).write_text(json.dumps(rec))
        return [rec]
    results = Path(args.results)
    runs = load_results(results)
    if args.table:
        runs = merged_results([Path(m) for m in args.merge] + [results])
        if args.check:
            print(check_markdown(runs))
            return runs
        print(markdown(runs, load_results(Path(args.before)) if args.before else None))
        return runs
    methods = list(METHODS) if args.methods == ["all"] else args.methods
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}: one of {', '.join(METHODS)} or 'all'"
                             + (f" ({m}: {NOT_APPLICABLE[m]})" if m in NOT_APPLICABLE else ""))
    print(f"# gradalg real-scale benchmark — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} thread(s), device {args.device}; "
          f"load average {os.getloadavg()[0]:.1f}; {args.train} training sequences, {args.queries} queries, "
          f"data {args.data}", flush=True)
    print("# not run: " + "; ".join(f"{k}: {v}" for k, v in NOT_APPLICABLE.items()), flush=True)
    done = {key_of(r): i for i, r in enumerate(runs)}
    for model in args.models:
        for T in args.T:
            for method in methods:
                spec = {"model": model, "T": T, "method": method, "train": args.train, "queries": args.queries,
                        "data": args.data + (f"+pad{args.pad:g}" if args.pad else ""), "dtype": args.dtype or DEFAULT_DTYPE.get(model, "float32"),
                        "device": args.device, "threads": args.threads,
                        "memory_budget_arg": _budget(args.memory_budget), "cache": str(results.parent)}
                key = key_of(spec)
                if key in done and not args.force:
                    print(f"{line_of(runs[done[key]])}   (recorded)", flush=True)
                    continue
                rec = {**spec, **launch(spec, args.timeout, args.max_rss_gb * 1e9),
                       "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "load_average": os.getloadavg()[0]}
                rec.pop("cache", None)
                if key in done:
                    runs[done[key]] = rec
                else:
                    done[key] = len(runs)
                    runs.append(rec)
                save_results(results, runs)
                print(line_of(rec), flush=True)
    return runs


if __name__ == "__main__":
    main()
