"""Training-time capture with streaming data, gradient accumulation and evaluation steps.

Every run records the inputs the model received and the parameters at each optimizer
step's start; the captured rows are checked against a **loop of backwards**: one backward
per example, at that step's parameters, of that example's share of the loss Trainer
backpropagated (``Σ_t ce_it / N``, ``N`` the step's ``num_items_in_batch``), read from
``p.grad``. Ids are checked against the content each row was computed from.

- HF ``Trainer`` with a torch ``IterableDataset`` (with and without ``__len__``), a
  ``datasets.IterableDataset``, ``max_steps`` shorter than the stream, gradient
  accumulation, ``dataloader_drop_last``, a padding collator, evaluation steps under
  ``no_grad``, an index column, a resumed run streaming to a store, collators that pad,
  drop examples or drop an index column, TRL's ``SFTTrainer`` over a stream;
- combinations that cannot work are refused at ``on_train_begin``, before any forward,
  and the suggested fix runs;
- the plain-loop helper (``training_capture``) over a streaming ``DataLoader``;
- DDP (torchrun, 2 ranks) over a streaming dataset.
"""
from __future__ import annotations

import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(__file__))

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

import gradalg as ga
from models import gpt2, padded_token_data

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator  # noqa: E402

from gradalg.integrations import StoreStream, open_stream, stream_steps  # noqa: E402
from gradalg.integrations.hf import GradientCallback  # noqa: E402

LAYERS = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"]
MODEL_KEYS = ("input_ids", "attention_mask", "labels", "num_items_in_batch")


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------- data
def lm_rows(n=12, seed=3, idx=False, lists=False):
    ids, mask = padded_token_data(n=n, seed=seed)
    labels = ids.masked_fill(mask == 0, -100)
    if lists:   # unpadded token lists: the collator pads
        rows = [{"input_ids": ids[i][mask[i].bool()].tolist()} for i in range(n)]
    else:
        rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]
    if idx:
        for i, r in enumerate(rows):
            r["idx"] = i
    return rows


class Stream(IterableDataset):
    """A streaming dataset: items come from iteration only (no ``__getitem__``, no ``__len__``)."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


class SizedStream(Stream):
    def __len__(self):
        return len(self.rows)


def pad_collator(features):
    """Right-pads token lists; labels are the tokens, -100 on padding; keeps an ``idx`` column."""
    T = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    out = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if "idx" in features[0]:
        out["idx"] = torch.tensor([f["idx"] for f in features])
    return out


def train_args(d, **kw):
    base = dict(output_dir=d, per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=2,
                learning_rate=0.1, use_cpu=True, report_to=[], logging_strategy="no", save_strategy="no",
                seed=0, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
                disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


# ---------------------------------------------------------------------------- the reference
class Recorder(TrainerCallback):
    """Parameters at each optimizer step's start; each training forward's inputs (and its step)."""

    def __init__(self):
        self.states, self.inputs, self.step_of, self.eval_forwards = [], [], [], 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def pre(module, a, kw):
            if torch.is_grad_enabled() and module.training:
                self.inputs.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kw.items()})
                self.step_of.append(len(self.states) - 1)
            else:
                self.eval_forwards += 1
        self.handle = model.register_forward_pre_hook(pre, with_kwargs=True)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.states.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    def on_train_end(self, args, state, control, **kwargs):
        self.handle.remove()


def loop_reference(rec: Recorder, layers, scale="loss"):
    """One backward per example at its step's parameters: {param name: (n, *shape)}, rows in
    the order of the recorded forwards. ``scale``: "loss" (``Σ_t ce_it / N``, what Trainer
    backpropagates) or "sum" (``Σ_t ce_it``)."""
    model = gpt2()
    model.train()
    names = [n for n, _ in model.named_parameters() if n.rsplit(".", 1)[0] in layers]
    params = dict(model.named_parameters())
    out = {n: [] for n in names}
    for kw, step in zip(rec.inputs, rec.step_of):
        model.load_state_dict(rec.states[step])
        N = kw["num_items_in_batch"]
        N = float(N.reshape(-1)[0]) if torch.is_tensor(N) else float(N)
        B = kw["input_ids"].shape[0]
        for r in range(B):
            model.zero_grad()
            one = {k: kw[k][r:r + 1] for k in ("input_ids", "attention_mask", "labels")}
            # Σ_t ce_rt / N, or Σ_t ce_rt (the model's own loss, which GPT-2 computes in float32)
            model(**one, num_items_in_batch=1.0 if scale == "sum" else N).loss.backward()
            for n in names:
                out[n].append(params[n].grad.detach().clone())
    return {n: torch.stack(v) for n, v in out.items()}


def captured_params(G: ga.GradientSet) -> dict:
    """The captured rows as per-parameter gradients {param name: (n, *shape)}."""
    from gradalg.capture import resolve_layers

    model = gpt2()
    out = {}
    dense = G.to_dense()
    for ref in resolve_layers(model, list(G.layers)):
        for pname, value in ref.rule.to_params(ref.module, dense[ref.name]).items():
            out[f"{ref.name}.{pname}"] = value
    return out


def assert_rows_match_loop(G: ga.GradientSet, rec: Recorder, layers=LAYERS, scale="loss", tol=1e-9):
    ref = loop_reference(rec, layers, scale)
    got = captured_params(G)
    assert sorted(got) == sorted(ref)
    for name in ref:
        x, y = got[name].flatten(1), ref[name].flatten(1)
        assert x.shape == y.shape, (name, x.shape, y.shape)
        err = float(((x - y).norm(dim=1) / y.norm(dim=1).clamp_min(1e-30)).max())
        assert err <= tol, f"{name}: per-example relative error {err:.3g}"


def fed_tokens(rec: Recorder):
    """The input_ids row of each recorded training example, padding removed."""
    rows = []
    for kw in rec.inputs:
        for i, m in zip(kw["input_ids"], kw["attention_mask"]):
            rows.append(i[m.bool()])
    return rows


def tokens_of(row):
    ids = torch.as_tensor(row["input_ids"])
    mask = torch.as_tensor(row.get("attention_mask", torch.ones_like(ids)))
    return ids[mask.bool()]


def train(ds, cb, rec=None, extra=(), trainer_kw=None, **kw):
    with tempfile.TemporaryDirectory() as d:
        trainer = Trainer(model=gpt2(), args=train_args(d, **kw), train_dataset=ds,
                          callbacks=[c for c in (rec, cb, *extra) if c is not None], **(trainer_kw or {}))
        trainer.train()
    return trainer


# ---------------------------------------------------------------------------- streaming datasets
@pytest.mark.parametrize("dataset", [Stream, SizedStream])
def test_streaming_dataset_rows_equal_loop_of_backwards(dataset):
    """The case of issue 29: a streaming IterableDataset raised at the first forward. Now
    ids='auto' warns before training (rows numbered in the order the stream yields them)
    and the rows equal a loop of backwards; accumulation of 2 micro-batches a step;
    max_steps shorter than the stream (30 examples, 3 steps of 6)."""
    rows = lm_rows(n=30)
    rec, cb = Recorder(), GradientCallback(layers=LAYERS)
    steps = []
    cb.on_step(lambda s: steps.append((s.index, s.n, s.micro_batches)))
    with pytest.warns(UserWarning, match="numbered in the order seen"):
        train(dataset(rows), cb, rec, max_steps=3)
    G = cb.grads
    assert steps == [(0, 6, 2), (1, 6, 2), (2, 6, 2)]      # rows per example, not per micro-batch
    assert G.ids == tuple(range(18))
    fed = fed_tokens(rec)
    assert all(torch.equal(fed[i], tokens_of(rows[i])) for i in G.ids)   # row i is the stream's i-th item
    assert_rows_match_loop(G, rec)


def test_map_dataset_max_steps_shorter_than_an_epoch():
    """30 examples, 2 steps of 2 micro-batches of 3: 12 shuffled examples, each row labelled with
    its dataset index (checked by tokens); the sampler's prefetched batches are never used."""
    rows = lm_rows(n=30)
    rec, cb = Recorder(), GradientCallback(layers=LAYERS)
    train(rows, cb, rec, max_steps=2)
    G = cb.grads
    assert G.n == 12 and len(set(G.ids)) == 12 and set(G.ids) <= set(range(30))
    assert all(torch.equal(f, tokens_of(rows[i])) for f, i in zip(fed_tokens(rec), G.ids))
    assert_rows_match_loop(G, rec)


def test_streaming_dataset_with_index_column_and_true_scales():
    """ids='<column>' on a stream: each row carries its example's index (checked by content);
    scale='sum' / 'mean' rows equal the loop of backwards of each example's summed token
    loss / that divided by its loss tokens."""
    rows = lm_rows(n=12, idx=True)
    rec = Recorder()
    cb = GradientCallback(layers=LAYERS, ids="idx", scale="sum", record=("input_ids",))
    mean = GradientCallback(layers=LAYERS, ids="idx", scale="mean")
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # a column names the examples: no warning
        train(Stream(rows), cb, rec, extra=(mean,), remove_unused_columns=False, max_steps=2)
    assert mean.grads.ids == cb.grads.ids
    ref = loop_reference(rec, LAYERS, "sum")
    tokens = torch.cat([(kw["labels"][:, 1:] != -100).sum(1) for kw in rec.inputs]).double()
    got = captured_params(mean.grads)
    for name in ref:
        want = ref[name] / tokens.view(-1, *[1] * (ref[name].dim() - 1))
        err = float(((got[name] - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)).max())
        assert err <= 1e-6, f"scale='mean' {name}: {err:.3g}"
    G = cb.grads
    assert G.ids == tuple(range(12))
    for row, i in zip(cb.inputs["input_ids"], G.ids):
        assert torch.equal(row, rows[i]["input_ids"])
    # transformers computes the cross-entropy in float32 (logits.float()): the Trainer's rows,
    # scaled by N afterwards, and the reference's differ by float32 rounding
    assert_rows_match_loop(G, rec, scale="sum", tol=1e-6)


@pytest.mark.parametrize("streaming", [True, False])
def test_two_epochs_with_dataloader_drop_last(streaming):
    """13 examples, batch 3, two epochs, dataloader_drop_last=True. A map-style dataset's
    sampler drops the 13th example (4 batches an epoch); Trainer builds a streaming dataset's
    loader without drop_last, so its last batch has 1 row. Either way each row carries its
    example's index, and the repeated examples of the second epoch the same index."""
    rows = lm_rows(n=13, idx=True)
    rec, cb = Recorder(), GradientCallback(layers=LAYERS, ids="idx" if streaming else "auto")
    train(SizedStream(rows) if streaming else rows, cb, rec, max_steps=-1, num_train_epochs=2,
          dataloader_drop_last=True, remove_unused_columns=False)
    G = cb.grads
    if streaming:
        assert G.ids == tuple(range(13)) * 2
    else:
        assert len(G.ids) == 24 and len(set(G.ids[:12])) == len(set(G.ids[12:])) == 12
    assert all(torch.equal(f, tokens_of(rows[i])) for f, i in zip(fed_tokens(rec), G.ids))
    assert_rows_match_loop(G, rec)


def test_padding_collator_on_a_stream_and_on_a_map_dataset():
    """Token lists padded by the collator: the stream's rows (index column) and the map-style
    dataset's rows (ids from the sampler, verified against the tokens) equal the loop."""
    rows = lm_rows(n=12, idx=True, lists=True)
    rec, cb = Recorder(), GradientCallback(layers=LAYERS, ids="idx")
    train(Stream(rows), cb, rec, trainer_kw=dict(data_collator=pad_collator), remove_unused_columns=False)
    assert cb.grads.ids == tuple(range(12))
    assert_rows_match_loop(cb.grads, rec)
    plain = [{"input_ids": r["input_ids"]} for r in rows]
    rec, cb = Recorder(), GradientCallback(layers=LAYERS)       # ids from the sampler
    train(plain, cb, rec, trainer_kw=dict(data_collator=pad_collator))
    fed = fed_tokens(rec)
    assert sorted(cb.grads.ids) == list(range(12)) and cb.grads.ids != tuple(range(12))
    assert all(torch.equal(fed[r], torch.tensor(plain[i]["input_ids"])) for r, i in enumerate(cb.grads.ids))
    assert_rows_match_loop(cb.grads, rec)


def test_collator_that_drops_examples():
    """A collator that drops the last example of each batch: the sampler's indices of the rows
    left are found by their tokens (with a warning naming the dropped ones); rows equal the
    loop. Two identical examples in a batch make the drop ambiguous: refused, naming the fix,
    which (an index column) then runs."""
    rows = lm_rows(n=12, idx=True)

    def dropping(features):
        return default_data_collator(features[:-1])

    rec, cb = Recorder(), GradientCallback(layers=LAYERS)
    with pytest.warns(UserWarning, match="collator dropped 1 of the 3"):
        train([{k: v for k, v in r.items() if k != "idx"} for r in rows], cb, rec,
              trainer_kw=dict(data_collator=dropping))
    G = cb.grads
    assert G.n == 8 and len(set(G.ids)) == 8
    assert all(torch.equal(f, tokens_of(rows[i])) for f, i in zip(fed_tokens(rec), G.ids))
    assert_rows_match_loop(G, rec)
    same = [dict(rows[i % 2], idx=i) for i in range(12)]    # examples 0, 2, 4... identical
    with pytest.raises(ga.integrations.ExampleIdsError, match="ids='<column>'"):
        train([{k: v for k, v in r.items() if k != "idx"} for r in same], GradientCallback(layers=LAYERS),
              trainer_kw=dict(data_collator=dropping))
    cb = GradientCallback(layers=LAYERS, ids="idx")
    train(same, cb, trainer_kw=dict(data_collator=dropping), remove_unused_columns=False)
    assert cb.grads.n == 8


def test_datasets_iterable_dataset():
    datasets = pytest.importorskip("datasets")
    rows = lm_rows(n=12, idx=True)
    base = datasets.Dataset.from_list([{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in r.items()}
                                       for r in rows])
    # ids from an index column
    rec, cb = Recorder(), GradientCallback(layers=LAYERS, ids="idx")
    train(base.to_iterable_dataset(), cb, rec, remove_unused_columns=False)
    assert cb.grads.ids == tuple(range(12))
    assert all(torch.equal(f, tokens_of(rows[i])) for f, i in zip(fed_tokens(rec), cb.grads.ids))
    assert_rows_match_loop(cb.grads, rec)
    # shuffled shards: the column still names each row's example
    rec, cb = Recorder(), GradientCallback(layers=LAYERS, ids="idx")
    train(base.to_iterable_dataset(num_shards=3).shuffle(seed=0, buffer_size=4), cb, rec,
          remove_unused_columns=False)
    assert sorted(cb.grads.ids) == list(range(12)) and cb.grads.ids != tuple(range(12))
    assert all(torch.equal(f, tokens_of(rows[i])) for f, i in zip(fed_tokens(rec), cb.grads.ids))
    # the default ids='auto' (Trainer removes the idx column): rows in the order seen
    rec, cb = Recorder(), GradientCallback(layers=LAYERS)
    with pytest.warns(UserWarning, match="numbered in the order seen"):
        train(base.to_iterable_dataset(), cb, rec)
    assert cb.grads.ids == tuple(range(12))
    assert_rows_match_loop(cb.grads, rec)


# ---------------------------------------------------------------------------- evaluation steps
@pytest.mark.parametrize("streaming", [False, True])
def test_evaluation_steps_under_no_grad_capture_nothing(streaming):
    """eval_strategy='steps' (evaluation under no_grad after every step): no crash, no row from
    evaluation, the training rows equal the loop of backwards."""
    rows = lm_rows(n=12, idx=True)
    ds = Stream(rows) if streaming else rows
    rec, cb = Recorder(), GradientCallback(layers=LAYERS, ids="idx")
    trainer = train(ds, cb, rec, max_steps=3, eval_strategy="steps", eval_steps=1, remove_unused_columns=False,
                    per_device_eval_batch_size=3,
                    trainer_kw=dict(eval_dataset=lm_rows(n=6, seed=5, idx=streaming)))  # idx taken out, or absent
    assert rec.eval_forwards >= 3 * 2                       # three evaluations of 2 batches ran
    assert sum("eval_loss" in e for e in trainer.state.log_history) == 3
    G = cb.grads
    assert G.n == 18 and len(rec.inputs) == 6               # 3 steps x 2 micro-batches x 3 examples
    assert all(torch.equal(f, tokens_of(rows[i])) for f, i in zip(fed_tokens(rec), G.ids))
    assert_rows_match_loop(G, rec)


# ---------------------------------------------------------------------------- refused up front
class Forwards(TrainerCallback):
    """Counts training forwards: a refusal before training leaves it at 0."""

    def __init__(self):
        self.n = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def pre(module, a, kw):
            self.n += 1
        model.register_forward_pre_hook(pre, with_kwargs=True)


def test_sampler_ids_on_a_stream_refused_before_training_and_the_fix_runs():
    rows = lm_rows(n=12, idx=True)
    count = Forwards()
    with pytest.raises(ga.integrations.ExampleIdsError, match="IterableDataset.*ids='<column>'"):
        train(Stream(rows), GradientCallback(layers=LAYERS, ids="sampler"), extra=(count,))
    assert count.n == 0
    cb = GradientCallback(layers=LAYERS, ids="idx")           # the fix: an index column
    train(Stream(rows), cb, remove_unused_columns=False)
    assert cb.grads.ids == tuple(range(12))
    cb = GradientCallback(layers=LAYERS, ids=None)            # or rows numbered in order, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(Stream(rows), cb)
    assert cb.grads.ids == tuple(range(12))


@pytest.mark.parametrize("kind", ["stream", "list", "datasets"])
def test_index_column_dropped_by_trainer_refused_before_training(kind):
    rows = lm_rows(n=12, idx=True)
    if kind == "datasets":
        datasets = pytest.importorskip("datasets")
        ds = datasets.Dataset.from_list([{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in r.items()}
                                         for r in rows])
    else:
        ds = Stream(rows) if kind == "stream" else rows
    count = Forwards()
    with pytest.raises(ga.integrations.ExampleIdsError, match="remove_unused_columns=False"):
        train(ds, GradientCallback(layers=LAYERS, ids="idx"), extra=(count,))
    assert count.n == 0
    cb = GradientCallback(layers=LAYERS, ids="idx")
    train(ds, cb, remove_unused_columns=False)                # the fix
    assert sorted(cb.grads.ids) == list(range(12))


def test_scale_and_record_that_cannot_work_refused_before_training():
    count = Forwards()
    rows = lm_rows(n=6)
    with pytest.raises(ga.LossReductionError, match="label_smoothing"):
        train(Stream(rows), GradientCallback(layers=LAYERS, scale="mean", ids=None), extra=(count,),
              label_smoothing_factor=0.1)
    assert count.n == 0

    class Tiny(torch.nn.Module):      # a forward without loss kwargs: Trainer passes no token count
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, labels):
            return {"loss": F.cross_entropy(self.fc(x), labels, reduction="sum")}

    ds = [{"x": torch.randn(4), "labels": torch.tensor(i % 3)} for i in range(6)]
    for cb, err in ((GradientCallback(scale="sum"), ga.LossReductionError),
                    (GradientCallback(record=("input_ids",)), ga.DataError)):
        count = Forwards()
        with tempfile.TemporaryDirectory() as d, pytest.raises(err):
            Trainer(model=Tiny(), args=train_args(d, gradient_accumulation_steps=1), train_dataset=ds,
                    callbacks=[count, cb]).train()
        assert count.n == 0
    cb = GradientCallback(record=("x",))                      # the fix: record an input the model takes
    with tempfile.TemporaryDirectory() as d:
        Trainer(model=Tiny(), args=train_args(d, gradient_accumulation_steps=1), train_dataset=ds,
                callbacks=[cb]).train()
    assert cb.grads.n == 6 and len(cb.inputs["x"]) == 6


# ---------------------------------------------------------------------------- resumed runs
class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("ids", ["auto", "idx"])
def test_resumed_streaming_run_continues_the_stream(ids):
    """A stream dataset, stopped after step 3, resumed from its step-2 checkpoint: the store
    has the rows and ids of an uninterrupted run (rows numbered in order used to restart at 0
    after the checkpoint, giving two examples the same id)."""
    rows = lm_rows(n=30, idx=True)
    P = ga.proj.kron(k=4, seed=0)
    extra = dict(remove_unused_columns=False) if ids == "idx" else {}
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = os.path.join(d, "whole")
        Trainer(model=gpt2(), args=train_args(os.path.join(d, "a"), max_steps=4, **extra),
                train_dataset=Stream(rows),
                callbacks=[GradientCallback(layers=LAYERS, ids=ids, stream=StoreStream(whole, P))]).train()
        out, path = os.path.join(d, "b"), os.path.join(d, "resumed")
        args = train_args(out, max_steps=4, save_strategy="steps", save_steps=2, **extra)
        Trainer(model=gpt2(), args=args, train_dataset=Stream(rows), callbacks=[
            GradientCallback(layers=LAYERS, ids=ids, stream=StoreStream(path, P)), StopAt(3)]).train()
        Trainer(model=gpt2(), args=args, train_dataset=Stream(rows), callbacks=[
            GradientCallback(layers=LAYERS, ids=ids, stream=StoreStream(path, P))]).train(
            resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        A, B = open_stream(whole), open_stream(path)
        assert A.ids == B.ids == tuple(range(24))
        assert stream_steps(path).tolist() == stream_steps(whole).tolist()
        a, b = A.to_dense(), B.to_dense()
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------- the plain loop
def test_plain_loop_over_a_streaming_loader_with_accumulation_and_evaluation():
    """training_capture around a plain loop over DataLoader(IterableDataset): 2 micro-batches
    a step, an evaluation under no_grad after each step; rows equal one backward per example
    at the step's parameters, ids from tc.ids_next."""
    torch.manual_seed(0)
    X, Y = torch.randn(12, 4, dtype=torch.float64), torch.randint(0, 3, (12,))

    class Items(IterableDataset):
        def __iter__(self):
            for i in range(12):
                yield 100 + i, X[i], Y[i]

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tc = ga.integrations.training_capture(model, optimizer=opt, keep=True)
    seen = []
    with tc:
        for k, (i, x, y) in enumerate(DataLoader(Items(), batch_size=3)):
            if k % 2 == 0:
                state = {a: b.clone() for a, b in model.state_dict().items()}
            seen.append((state, x, y))
            tc.ids_next(i)
            F.cross_entropy(model(x), y, reduction="sum").backward()
            if k % 2 == 1:
                opt.step()
                opt.zero_grad()
                model.eval()
                with torch.no_grad():
                    model(X)                     # evaluation: not recorded
                model.train()
    assert tc.steps == 2 and tc.grads.ids == tuple(range(100, 112))
    ref, ref_model = [], make()
    for state, x, y in seen:
        ref_model.load_state_dict(state)
        for r in range(len(x)):
            ref_model.zero_grad()
            F.cross_entropy(ref_model(x[r:r + 1]), y[r:r + 1], reduction="sum").backward()
            ref.append(torch.cat([torch.cat([ref_model[j].weight.grad, ref_model[j].bias.grad[:, None]], 1).flatten()
                                  for j in (0, 2)]))
    dense = tc.grads.to_dense()
    got = torch.cat([dense[n].flatten(1) for n in tc.grads.layers], 1)
    torch.testing.assert_close(got, torch.stack(ref), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("make", [
    lambda: GradientCallback(scale="avg"),
    lambda: GradientCallback(scale=None),
    lambda: GradientCallback(ids=3),
    lambda: GradientCallback(ids=""),
    lambda: GradientCallback(record=(1,)),
    lambda: GradientCallback(selection="drop"),
    lambda: GradientCallback(stream="run.grads"),
    lambda: GradientCallback(scale="sum", selection=ga.integrations.OnlineSelection(
        ga.integrations.BatchMean(), ga.integrations.KeepAll())),
    lambda: StoreStream("x", ga.proj.kron(k=4), flush_rows=0),
    lambda: StoreStream("x", ga.proj.kron(k=4), flush_rows=True),
    lambda: StoreStream("x", ga.proj.kron(k=4), flush_rows=2.5),
    lambda: StoreStream("x", "kron"),
    lambda: ga.integrations.training_capture(torch.nn.Linear(2, 2), step_on="epoch"),
    lambda: ga.integrations.training_capture(torch.nn.Linear(2, 2), step_on="optimizer"),
    lambda: ga.integrations.training_capture(torch.nn.Linear(2, 2), optimizer="sgd"),
])
def test_bad_arguments_raise_option_errors(make):
    with pytest.raises(ga.OptionError):
        make()


def test_numpy_integers_and_reading_rows_out_of_order():
    import numpy as np

    assert StoreStream("x", ga.proj.kron(k=4), flush_rows=np.int64(8)).flush_rows == 8
    with pytest.raises(ga.integrations.CaptureStateError, match="no training has run"):
        GradientCallback().grads
    tc = ga.integrations.training_capture(torch.nn.Linear(2, 2).double())
    with pytest.raises(ga.integrations.CaptureStateError, match="keep=True"):
        tc.grads
    with tc, pytest.raises(ga.integrations.CaptureStateError, match="entered twice"):
        tc.__enter__()


def test_string_ids_dropped_by_the_default_collator_are_refused_with_the_fix():
    """transformers' default collator keeps numbers only: string ids never reach the model.
    Refused at the first forward, naming the collator; a collator that keeps them runs."""
    rows = [dict(r, idx=f"doc-{r['idx']}") for r in lm_rows(n=6, idx=True)]
    with pytest.raises(ga.integrations.ExampleIdsError, match="string values"):
        train(Stream(rows), GradientCallback(layers=LAYERS, ids="idx"), remove_unused_columns=False,
              gradient_accumulation_steps=1)

    def keeping(features):
        names = [f["idx"] for f in features]
        out = default_data_collator([{k: v for k, v in f.items() if k != "idx"} for f in features])
        out["idx"] = names
        return out

    cb = GradientCallback(layers=LAYERS, ids="idx")
    train(Stream(rows), cb, remove_unused_columns=False, gradient_accumulation_steps=1,
          trainer_kw=dict(data_collator=keeping))
    assert cb.grads.ids == tuple(f"doc-{i}" for i in range(6))


def test_trl_sft_trainer_on_a_streaming_dataset():
    """TRL's SFTTrainer over a streaming datasets.IterableDataset: rows in the order seen, each
    holding its text's tokens; an index column (which TRL's collator never passes on) is
    refused before the first forward."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from test_training_ids import _word_tokenizer

    tok = _word_tokenizer()
    g = torch.Generator().manual_seed(5)
    texts = [" ".join(f"t{int(t)}" for t in torch.randint(2, 101, (int(L),), generator=g))
             for L in torch.randint(3, 8, (12,), generator=g)]
    stream = datasets.Dataset.from_dict({"text": texts, "idx": list(range(12))}).to_iterable_dataset()

    def run(cb, extra=()):
        with tempfile.TemporaryDirectory() as d:
            args = trl.SFTConfig(output_dir=d, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                                 max_steps=2, learning_rate=0.1, use_cpu=True, report_to=[], logging_strategy="no",
                                 save_strategy="no", seed=0, disable_tqdm=True, bf16=False,
                                 remove_unused_columns=False)
            trl.SFTTrainer(model=gpt2(), args=args, train_dataset=stream, processing_class=tok,
                           callbacks=[*extra, cb]).train()

    count = Forwards()
    with pytest.raises(ga.integrations.ExampleIdsError, match="TRL's"):
        run(GradientCallback(layers=LAYERS[:-1], ids="idx"), (count,))
    assert count.n == 0
    cb = GradientCallback(layers=LAYERS[:-1], record=("input_ids",))   # TRL fuses the head: leave it out
    with pytest.warns(UserWarning, match="numbered in the order seen"):
        run(cb)
    assert cb.grads.ids == tuple(range(12))
    for row, i in zip(cb.inputs["input_ids"], cb.grads.ids):
        want = tok(texts[i])["input_ids"]
        assert row.tolist()[:len(want)] == want


# ---------------------------------------------------------------------------- DDP
@pytest.mark.slow
def test_trainer_ddp_over_a_streaming_dataset(tmp_path):
    """torchrun, 2 ranks (gloo): accelerate dispatches slices of each streamed global batch;
    index-column rows hold their examples' tokens and cover the stream once over the ranks;
    ids='auto' runs and gathers to 0..n-1 (tests/dist_scripts/trainer_stream.py)."""
    import json
    import subprocess

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    script = os.path.join(os.path.dirname(__file__), "dist_scripts", "trainer_stream.py")
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and out.exists(), f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert json.loads(out.read_text())["result"] == "ok", json.loads(out.read_text())["result"]


def test_one_callback_for_two_runs_describes_the_last():
    """A callback reused for a second run (e.g. a resumed one): its rows, recorded inputs and
    ids are the second run's, aligned (recorded inputs used to pile up over runs)."""
    rows = lm_rows(n=12)
    cb = GradientCallback(layers=LAYERS, record=("input_ids",))
    with pytest.warns(UserWarning, match="numbered in the order seen"):
        train(Stream(rows), cb)
    train(rows, cb, max_steps=1)
    assert cb.grads.n == 6 and len(cb.inputs["input_ids"]) == 6
    for row, i in zip(cb.inputs["input_ids"], cb.grads.ids):
        assert torch.equal(row, rows[i]["input_ids"])


def test_fp16_loss_scaling_refused_before_training():
    """fp16 training multiplies the loss by a GradScaler factor that changes between steps (and
    skips overflowing steps): captured rows would carry it. Refused before the first forward
    (Trainer refuses fp16 on CPU itself, so the check is called as on_train_begin calls it)."""
    from types import SimpleNamespace

    cb = GradientCallback(layers=LAYERS, ids=None)
    loader = DataLoader(lm_rows(n=4), batch_size=2, collate_fn=default_data_collator)
    args = SimpleNamespace(fp16=True, bf16=False, remove_unused_columns=True, label_smoothing_factor=0.0)
    with pytest.raises(ga.OptionError, match="bf16=True"):
        cb._refuse_up_front(args, gpt2(), loader)
    cb._refuse_up_front(SimpleNamespace(**{**vars(args), "fp16": False, "bf16": True}), gpt2(), loader)
