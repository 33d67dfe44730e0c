"""Dataset ids through training, and streaming training-time rows to a store.

- HF ``Trainer`` rows carry the dataset index of their example (its shuffling sampler,
  gradient accumulation, two epochs, an index column), checked against the tokens each
  row was computed from;
- ``StoreStream``: the store read back equals the in-memory capture projected with the
  same projector, bitwise; a run resumed from a checkpoint continues the stream and ends
  with the rows of an uninterrupted run; restarting from step 0, or with another
  projector, is refused;
- peak RSS with and without streaming, measured in subprocesses.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gradalg as ga
from models import gpt2, padded_token_data

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("zarr")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from gradalg.integrations import StoreStream, open_stream, stream_steps  # noqa: E402
from gradalg.integrations.hf import GradientCallback  # noqa: E402

LAYERS = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def lm_dataset(n=12, seed=3, idx=False):
    ids, mask = padded_token_data(n=n, seed=seed)
    labels = ids.masked_fill(mask == 0, -100)
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]
    if idx:
        for i, r in enumerate(rows):
            r["idx"] = i
    return rows


def train_args(d, **kw):
    base = dict(output_dir=d, per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=2,
                learning_rate=0.1, use_cpu=True, report_to=[], logging_strategy="no", save_strategy="no",
                seed=0, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
                disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def rows_by_content(cb, ds):
    """Each row's recorded input_ids equal its dataset example's (ids tied to content)."""
    fed = cb.inputs["input_ids"]
    assert len(fed) == cb.grads.n
    for row, i in zip(fed, cb.grads.ids):
        assert torch.equal(row, ds[i]["input_ids"]), i


def test_trainer_rows_carry_dataset_indices_across_accumulation_and_epochs():
    ds = lm_dataset()
    cb = GradientCallback(layers=LAYERS, record=("input_ids",))
    with tempfile.TemporaryDirectory() as d:
        # 12 examples, 3 per micro-batch, 2 micro-batches a step: 2 steps an epoch, 2 epochs
        Trainer(model=gpt2(), args=train_args(d, max_steps=-1, num_train_epochs=2), train_dataset=ds,
                callbacks=[cb]).train()
    ids = cb.grads.ids
    assert len(ids) == 24
    assert sorted(ids[:12]) == list(range(12)) and sorted(ids[12:]) == list(range(12))
    assert list(ids[:12]) != list(range(12))                 # Trainer shuffled: the labels are not row order
    rows_by_content(cb, ds)
    steps = [c.meta["step"] for c in cb.grads.expr.store.chunks()]
    assert steps == [0, 0, 1, 1, 2, 2, 3, 3]                 # two micro-batches per optimizer step
    # an example seen in both epochs: combine its rows
    summed = ga.integrations.combine_repeats(ga.proj.kron(k=4, seed=0)(cb.grads), "sum")
    assert summed.ids == tuple(dict.fromkeys(ids)) and summed.n == 12


def test_trainer_index_column_and_refusals():
    ds = lm_dataset(idx=True)
    cb = GradientCallback(layers=LAYERS, ids="idx", record=("input_ids",))
    with tempfile.TemporaryDirectory() as d:
        Trainer(model=gpt2(), args=train_args(d, remove_unused_columns=False), train_dataset=ds,
                callbacks=[cb]).train()
    assert len(cb.grads.ids) == 12
    rows_by_content(cb, ds)
    # Trainer drops the column the model does not take: refused with the fix
    with tempfile.TemporaryDirectory() as d, pytest.raises(ga.integrations.ExampleIdsError, match="remove_unused"):
        Trainer(model=gpt2(), args=train_args(d), train_dataset=ds,
                callbacks=[GradientCallback(layers=LAYERS, ids="idx")]).train()


def test_sampler_ids_are_verified_against_the_tokens():
    """A collator that reorders the batch breaks the sampler's order: caught, not mislabelled."""
    ds = lm_dataset()

    def reversing(features):
        from transformers import default_data_collator
        return default_data_collator(features[::-1])

    with tempfile.TemporaryDirectory() as d, pytest.raises(ga.integrations.ExampleIdsError, match="tokens"):
        Trainer(model=gpt2(), args=train_args(d), train_dataset=ds, data_collator=reversing,
                callbacks=[GradientCallback(layers=LAYERS)]).train()


# ---------------------------------------------------------------------------- streaming
def test_stream_equals_in_memory_capture_projected():
    ds = lm_dataset()
    P = ga.proj.kron(k=4, seed=0)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows")
        mem = GradientCallback(layers=LAYERS)
        streamed = GradientCallback(layers=LAYERS, stream=StoreStream(path, P, flush_rows=5))
        Trainer(model=gpt2(), args=train_args(d, max_steps=4), train_dataset=ds,
                callbacks=[mem, streamed]).train()
        assert not streamed.keep                                  # streaming keeps nothing in memory
        G = open_stream(path)
        assert G.ids == mem.grads.ids and G.n == 24
        assert stream_steps(path).tolist() == [s for s in range(4) for _ in range(6)]
        a, b = G.to_dense(), P(mem.grads).to_dense()
        for name in b:
            assert torch.equal(a[name], b[name]), name          # bitwise: the same projection per step
        # scores against the stream index the training set
        S = (P(mem.grads) @ G.T).compute()
        assert S.coords["train"].values.tolist() == list(G.ids)


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True


def test_stream_resumes_with_the_run_and_refuses_a_restart():
    ds = lm_dataset()
    P = ga.proj.kron(k=4, seed=0)
    with tempfile.TemporaryDirectory() as d:
        # the uninterrupted run
        whole = os.path.join(d, "whole")
        Trainer(model=gpt2(), args=train_args(os.path.join(d, "a"), max_steps=4), train_dataset=ds,
                callbacks=[GradientCallback(layers=LAYERS, stream=StoreStream(whole, P, flush_rows=100))]).train()
        # the same run, stopped after step 3 (checkpoint at step 2), then resumed from the checkpoint
        out = os.path.join(d, "b")
        path = os.path.join(d, "resumed")
        args = train_args(out, max_steps=4, save_strategy="steps", save_steps=2)
        Trainer(model=gpt2(), args=args, train_dataset=ds, callbacks=[
            GradientCallback(layers=LAYERS, stream=StoreStream(path, P, flush_rows=100)), StopAt(3)]).train()
        assert stream_steps(path).tolist() == [s for s in range(3) for _ in range(6)]
        Trainer(model=gpt2(), args=args, train_dataset=ds, callbacks=[
            GradientCallback(layers=LAYERS, stream=StoreStream(path, P, flush_rows=100))]).train(
            resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        A, B = open_stream(whole), open_stream(path)
        assert A.ids == B.ids and stream_steps(path).tolist() == stream_steps(whole).tolist()
        a, b = A.to_dense(), B.to_dense()
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-12, atol=1e-14)
        # starting again from step 0 into the same path: refused
        with pytest.raises(ga.StoreMismatchError, match="starts again from step 0"):
            Trainer(model=gpt2(), args=train_args(os.path.join(d, "c")), train_dataset=ds, callbacks=[
                GradientCallback(layers=LAYERS, stream=StoreStream(path, P))]).train()
        # another projector: refused, naming it
        with pytest.raises(ga.StoreMismatchError, match="projector"):
            Trainer(model=gpt2(), args=train_args(os.path.join(d, "c")), train_dataset=ds, callbacks=[
                GradientCallback(layers=LAYERS, stream=StoreStream(path, ga.proj.kron(k=8, seed=0)))]).train()
        # overwrite=True starts a new stream
        Trainer(model=gpt2(), args=train_args(os.path.join(d, "c")), train_dataset=ds, callbacks=[
            GradientCallback(layers=LAYERS, stream=StoreStream(path, P, overwrite=True))]).train()
        assert open_stream(path).n == 12


def test_plain_loop_stream_refuses_to_open_unfinished():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X, Y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    with tempfile.TemporaryDirectory() as d:
        tc = ga.integrations.training_capture(model, ["0", "2"], optimizer=opt)
        stream = StoreStream(os.path.join(d, "s"), ga.proj.kron(k=2), flush_rows=2).attach(tc)
        with tc:
            for i in range(4):
                tc.ids_next([2 * i + 1, 2 * i])
                F.cross_entropy(model(X[2 * i:2 * i + 2]), Y[2 * i:2 * i + 2], reduction="sum").backward()
                opt.step()
                opt.zero_grad()
        with pytest.raises(ga.StoreIncompleteError, match="close"):
            open_stream(os.path.join(d, "s"))
        assert stream.grads.n == 8                             # flushed segments read before closing
        stream.close()
        assert open_stream(os.path.join(d, "s")).ids == (1, 0, 3, 2, 5, 4, 7, 6)
        with pytest.raises(ga.integrations.ExampleIdsError, match="3 example ids"):
            with tc:
                tc.ids_next([0, 1, 2])
                F.cross_entropy(model(X[:2]), Y[:2], reduction="sum").backward()


# ---------------------------------------------------------------------------- memory
RSS_SCRIPT = os.path.join(os.path.dirname(__file__), "store_scripts", "stream_rss.py")


@pytest.mark.slow
def test_streaming_bounds_peak_memory():
    """Peak RSS of the same training loop keeping every factored row vs streaming projected rows."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("plain", "keep", "stream"):
            proc = subprocess.run([sys.executable, RSS_SCRIPT, mode, d], capture_output=True, text=True,
                                  timeout=300, env=env)
            assert proc.returncode == 0, proc.stderr[-3000:]
            out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    grow_keep = out["keep"]["peak_mb"] - out["plain"]["peak_mb"]
    grow_stream = out["stream"]["peak_mb"] - out["plain"]["peak_mb"]
    print(json.dumps(out))
    assert out["keep"]["rows"] == out["stream"]["rows"] == 512
    assert grow_keep > 150                   # every factored row in memory: hundreds of MB
    assert grow_stream < 0.25 * grow_keep    # streaming: one step's factors and the projected buffer


# ---------------------------------------------------------------------------- TRL GRPOTrainer
def _word_tokenizer(vocab_size=101):
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t0", unk_token="t1")


@pytest.mark.parametrize("column", [None, "idx"])
def test_grpo_completion_rows_carry_their_prompts_index(column):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from gradalg.integrations.grpo import grpo_ids

    tok = _word_tokenizer()
    g = torch.Generator().manual_seed(5)
    prompts = [" ".join(f"t{int(t)}" for t in torch.randint(2, 101, (int(L),), generator=g))
               for L in torch.randint(3, 6, (6,), generator=g)]
    ds = Dataset.from_dict({"prompt": prompts, "idx": list(range(6))})
    cb = GradientCallback(layers=LAYERS[:-1], record=("input_ids",))   # TRL fuses the head: leave it out

    def reward(completions, **kw):
        return [float(len(c)) for c in completions]

    with tempfile.TemporaryDirectory() as d:
        args = trl.GRPOConfig(output_dir=d, per_device_train_batch_size=4, num_generations=2,
                              gradient_accumulation_steps=2, max_completion_length=3, max_steps=2,
                              learning_rate=0.1, use_cpu=True, report_to=[], logging_strategy="no",
                              save_strategy="no", seed=0, disable_tqdm=True, bf16=False)
        trainer = trl.GRPOTrainer(model=gpt2(), reward_funcs=reward, args=args, train_dataset=ds,
                                  processing_class=tok, callbacks=[cb])
        grpo_ids(trainer, column=column)
        trainer.train()
    ids = cb.grads.ids
    assert len(ids) == 16                                      # 2 steps × 2 micro-batches × 4 completions
    counts = {i: ids.count(i) for i in set(ids)}
    assert all(c % 2 == 0 for c in counts.values())           # num_generations completions per prompt
    # each row's prompt tokens (left-padded, before the completion) are its example's prompt
    for row, i in zip(cb.inputs["input_ids"], ids):
        want = tok(prompts[i])["input_ids"]
        text = row.tolist()
        assert any(text[s:s + len(want)] == want for s in range(len(text) - len(want) + 1)), (i, text, want)


def test_grpo_without_grpo_ids_is_refused():
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    ds = Dataset.from_dict({"prompt": ["t3 t4 t5", "t6 t7 t8"]})
    with tempfile.TemporaryDirectory() as d:
        args = trl.GRPOConfig(output_dir=d, per_device_train_batch_size=2, num_generations=2,
                              max_completion_length=2, max_steps=1, use_cpu=True, report_to=[],
                              logging_strategy="no", save_strategy="no", disable_tqdm=True, bf16=False)
        trainer = trl.GRPOTrainer(model=gpt2(), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=args, train_dataset=ds, processing_class=_word_tokenizer(),
                                  callbacks=[GradientCallback(layers=LAYERS[:-1], ids="sampler")])
        with pytest.raises(ga.integrations.ExampleIdsError, match="grpo_ids"):
            trainer.train()
        # by default: rows numbered in order, with a warning that names the fix
        trainer = trl.GRPOTrainer(model=gpt2(), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=args, train_dataset=ds, processing_class=_word_tokenizer(),
                                  callbacks=[cb := GradientCallback(layers=LAYERS[:-1])])
        with pytest.warns(UserWarning, match="grpo_ids"):
            trainer.train()
        assert cb.grads.ids == (0, 1)


# ---------------------------------------------------------------------------- OLMo-core
def test_olmo_core_rows_carry_the_batch_index_and_stream():
    pytest.importorskip("olmo_core")
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    from gradalg.integrations.olmo import InMemoryDataLoader, OLMoCoreCallback

    torch.manual_seed(0)
    model = TransformerConfig.olmo2_1M(vocab_size=64, n_layers=2).build(init_device="cpu")
    g = torch.Generator().manual_seed(0)
    seq = 8
    perm = torch.randperm(8, generator=g)
    batches = [{"input_ids": torch.randint(0, 64, (4, seq), generator=g), "index": perm[4 * s:4 * s + 4]}
               for s in range(2)]
    layers = ["blocks.0.attention.w_q", "blocks.1.feed_forward.w2", "lm_head.w_out"]
    P = ga.proj.kron(k=4, seed=0)
    with tempfile.TemporaryDirectory() as d:
        cb = OLMoCoreCallback(layers=layers)
        streamed = OLMoCoreCallback(layers=layers, stream=StoreStream(os.path.join(d, "rows"), P))
        module = TransformerTrainModuleConfig(rank_microbatch_size=2 * seq, max_sequence_length=seq,
                                              optim=AdamWConfig(lr=1e-2)).build(model)
        TrainerConfig(save_folder=d, no_checkpoints=True, max_duration=Duration.steps(2), metrics_collect_interval=1,
                      callbacks={"gradalg": cb, "stream": streamed}).build(module, InMemoryDataLoader(batches, d)).fit()
        assert cb.grads.ids == tuple(perm.tolist())             # two micro-batches a step take them in order
        G = open_stream(os.path.join(d, "rows"))
        assert G.ids == cb.grads.ids
        a, b = G.to_dense(), P(cb.grads).to_dense()
        for name in b:
            assert torch.equal(a[name], b[name]), name


# ---------------------------------------------------------------------------- DDP
@pytest.mark.slow
def test_trainer_ddp_rows_gathered_with_dataset_indices(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    script = os.path.join(os.path.dirname(__file__), "dist_scripts", "trainer_ids.py")
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
           str(out), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and out.exists(), f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert json.loads(out.read_text())["result"] == "ok", json.loads(out.read_text())["result"]


def test_self_scores_of_repeated_rows_are_refused_until_combined():
    """Rows of an example seen in two epochs share its id: a diagonal whose two sides are
    aligned by id (here two captures of one run) would pick one of the rows silently, so it
    is refused with the fix; combined rows work."""
    ds = lm_dataset()
    first, second = GradientCallback(layers=LAYERS), GradientCallback(layers=LAYERS)
    with tempfile.TemporaryDirectory() as d:
        Trainer(model=gpt2(), args=train_args(d, max_steps=-1, num_train_epochs=2), train_dataset=ds,
                callbacks=[first, second]).train()
    P = ga.proj.kron(k=4, seed=0)
    A, B = P(first.grads), P(second.grads)
    assert len(set(A.ids)) < A.n                      # every example twice
    with pytest.raises(ga.DataError, match="combine_repeats"):
        (A @ B.T).diag().compute()
    A1, B1 = (ga.integrations.combine_repeats(X, "sum") for X in (A, B))
    diag = (A1 @ B1.T).diag().compute()
    full = (A1 @ B1.T).compute()
    assert np.allclose(diag.values, np.diag(full.values), rtol=1e-5)
