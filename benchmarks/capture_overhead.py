"""Step-time overhead of per-example gradient capture inside ``transformers.Trainer``.

    python benchmarks/capture_overhead.py                       # GPT-2 (4 x 256), seq 128, batch 8
    python benchmarks/capture_overhead.py --steps 30 --threads 2 --seq 256

The same Trainer run (same model, data, seed, optimizer) is timed step by step, with
the configurations interleaved round-robin so that a busy machine slows all of them alike:

- ``baseline``   no callback;
- ``capture``    ``GradientCallback(keep=False)`` on wte, every Conv1D and lm_head: factors
                 recorded and handed to an on_step callback that does nothing;
- ``norms``      the same plus ‖g_i‖² of every example at every step (ghost products);
- ``selection``  online selection: batch-mean scores, drop 25%, exact correction of p.grad.

Step time = ``on_step_begin`` to ``on_step_end`` (forward, backward, callbacks, optimizer),
median over the measured steps (after warm-up). Prints each configuration's median and its
ratio to the baseline; the target for ``capture`` is ≤ 1.3×.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

LAYERS = ["transformer.wte", "transformer.h.*.attn.c_*", "transformer.h.*.mlp.c_*", "lm_head"]


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=args.vocab,
                        n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def dataset(args, n):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (n, args.seq), generator=g)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(args.seq, dtype=torch.long), "labels": ids[i]}
            for i in range(n)]


def run(config: str, args) -> list[float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import gradalg as ga
    from gradalg.integrations.hf import GradientCallback

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    timer = Timer()
    callbacks = [timer]
    if config == "capture":
        cb = GradientCallback(layers=LAYERS, keep=False)
        cb.on_step(lambda step: None)
        callbacks.insert(0, cb)
    elif config == "norms":
        cb = GradientCallback(layers=LAYERS, keep=False)
        norms = []
        cb.on_step(lambda step: norms.append(step.sq_norms()))
        callbacks.insert(0, cb)
    elif config == "selection":
        model_layers = LAYERS
        sel = ga.integrations.OnlineSelection(ga.integrations.BatchMean(), ga.integrations.DropFraction(0.25),
                                              layers=model_layers, uncovered="ignore")
        callbacks.insert(0, GradientCallback(selection=sel, keep=False))
    steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as d:
        targs = TrainingArguments(output_dir=d, per_device_train_batch_size=args.batch, max_steps=steps,
                                  learning_rate=1e-4, use_cpu=True, report_to=[], logging_strategy="no",
                                  save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
        Trainer(model=build(args), args=targs, train_dataset=dataset(args, steps * args.batch),
                callbacks=callbacks).train()
    return timer.times[args.warmup:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every configuration")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default="baseline,capture,norms,selection")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    configs = args.configs.split(",")
    times = {c: [] for c in configs}
    for _ in range(args.rounds):
        for c in configs:
            times[c].extend(run(c, args))
    base = statistics.median(times["baseline"]) if "baseline" in times else None
    print(f"GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}, "
          f"{args.threads} thread(s); median of {args.steps * args.rounds} steps")
    print(f"{'config':>10} {'median s/step':>14} {'ratio':>7}")
    result = {}
    for c in configs:
        med = statistics.median(times[c])
        ratio = med / base if base else float("nan")
        result[c] = ratio
        print(f"{c:>10} {med:14.4f} {ratio:7.3f}")
    return result


if __name__ == "__main__":
    main()
