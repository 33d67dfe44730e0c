"""Capture overhead inside ``transformers.Trainer`` on a GPT-2 and a Llama config, as a
multiple of plain training: ids from the sampler, rows projected (kron) and streamed to a
store on disk.

    python benchmarks/trainer_capture.py                 # both models, 3 rounds, ~3 min on 1 core
    python benchmarks/trainer_capture.py --rounds 5 --steps 16 --threads 2

Each measurement is one fresh process (``--worker``) that trains ``--steps`` optimizer
steps and reports the step times (``on_step_begin`` to ``on_step_end``: forward, backward,
callbacks, optimizer) after ``--warmup`` steps. Processes alternate between the modes
(plain, capture, stream, plain, capture, ...) so that a busy machine slows each alike;
the ratio is median(step time with capture) / median(plain step time) over all rounds.
A second line compares the whole ``trainer.train()`` (warm-up steps, segment writes and the
stream's final flush and close included), median over the rounds.

Modes:
- ``plain``    no callback;
- ``capture``  ``GradientCallback(keep=False)`` on every attention and MLP linear and the
               head, ids from the sampler (checked against the tokens): factors recorded
               and dropped after each step;
- ``stream``   the same plus ``StoreStream(path, ga.proj.kron(k))``: every step's rows
               projected and appended to a Zarr store (segments of ``--flush`` rows; the
               default, StoreStream's, writes once at the end of these short runs).
Target: ``stream`` ≤ 1.2× plain.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = {
    "gpt2": ["transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_*", "lm_head"],
    "llama": ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj", "lm_head"],
}


def build(name, args):
    import torch

    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=args.vocab,
                         n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.width, intermediate_size=int(2.75 * args.width),
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=args.vocab,
                      max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def worker(args) -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import gradalg as ga
    from gradalg.integrations.hf import GradientCallback

    torch.set_num_threads(args.threads)

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    g = torch.Generator().manual_seed(1)
    n = args.batch * (args.steps + args.warmup)
    ids = torch.randint(1, args.vocab, (n, args.seq), generator=g)
    ds = [{"input_ids": ids[i], "attention_mask": torch.ones(args.seq, dtype=torch.long), "labels": ids[i]}
          for i in range(n)]
    timer = Timer()
    callbacks = [timer]
    with tempfile.TemporaryDirectory() as d:
        if args.mode != "plain":
            stream = None
            if args.mode == "stream":
                stream = ga.integrations.StoreStream(os.path.join(d, "rows"), ga.proj.kron(k=args.k, seed=0),
                                                     flush_rows=args.flush)
            callbacks.append(GradientCallback(layers=MODELS[args.model], keep=False, stream=stream))
        targs = TrainingArguments(output_dir=d, per_device_train_batch_size=args.batch, max_steps=args.steps + args.warmup,
                                  learning_rate=1e-3, use_cpu=True, report_to=[], logging_strategy="no",
                                  save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=build(args.model, args), args=targs, train_dataset=ds, callbacks=callbacks)
        t0 = time.perf_counter()
        trainer.train()                      # ends with the stream's last flush and close
        total = time.perf_counter() - t0
    print(json.dumps({"times": timer.times[args.warmup:], "total": total}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=32, help="kron projection: k coordinates per block")
    p.add_argument("--flush", type=int, default=4096,
                   help="rows per store segment (StoreStream's default; --flush 32 writes one every 4 steps)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="gpt2", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.environ.get("PYTHONPATH", "")]))
    modes = ("plain", "capture", "stream")
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "threads", "layers", "width", "vocab",
                                                          "seq", "batch", "k", "flush")]
    print(f"load average at start: {os.getloadavg()}")
    for model in args.models.split(","):
        times = {m: [] for m in modes}
        totals = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes:
                out = subprocess.run([sys.executable, __file__, "--worker", f"--model={model}", f"--mode={mode}",
                                      *passthrough], capture_output=True, text=True, env=env, check=False)
                if out.returncode != 0:
                    raise SystemExit(f"{model}/{mode} failed:\n{out.stderr[-3000:]}")
                result = json.loads(out.stdout.strip().splitlines()[-1])
                times[mode] += result["times"]
                totals[mode].append(result["total"])
        base = statistics.median(times["plain"])
        parts = [f"{m} {statistics.median(times[m]) * 1e3:7.1f} ms ({statistics.median(times[m]) / base:.2f}x)"
                 for m in modes]
        print(f"{model:6s} step  " + " | ".join(parts) + f"   [{len(times['plain'])} steps per mode]")
        tbase = statistics.median(totals["plain"])
        parts = [f"{m} {statistics.median(totals[m]):7.2f} s ({statistics.median(totals[m]) / tbase:.2f}x)"
                 for m in modes]
        print(f"{model:6s} train " + " | ".join(parts) + f"   [train() incl. warm-up and the final flush; "
              f"{len(totals['plain'])} runs per mode]")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
