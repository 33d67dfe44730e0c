"""Trainer integrations: HF ``Trainer``, TRL ``SFTTrainer`` and OLMo-core's ``Trainer``.

Each test runs the real trainer with the gradalg callback, records the inputs the model
received and the parameters at the start of each optimizer step, then replays the same
micro-batches in a plain loop under ``ga.capture`` at the same parameters: the rows must
agree. Scales other than the loss's own are checked against the torch.func/loop oracle.
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

import pytest
import torch
import torch.nn.functional as F

import gradalg as ga
from models import gpt2, padded_token_data

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install 'gradalg[hf]')")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from gradalg.integrations import BatchMean, DropFraction, OnlineSelection  # noqa: E402
from gradalg.integrations.hf import GradientCallback  # noqa: E402

LAYERS = ["transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: intra-op threads only add contention on a loaded 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Recorder(TrainerCallback):
    """Parameters at each step's start and every micro-batch's model inputs."""

    def __init__(self):
        self.states, self.inputs, self.step_of = [], [], []
        self.grads_seen = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def pre(module, a, kw):
            if torch.is_grad_enabled() and module.training:
                self.inputs.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kw.items()})
                self.step_of.append(len(self.states) - 1)
        self.handle = model.register_forward_pre_hook(pre, with_kwargs=True)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.states.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads_seen.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                if p.grad is not None})

    def on_train_end(self, args, state, control, **kwargs):
        self.handle.remove()


def lm_dataset(n=12, seed=3):
    ids, mask = padded_token_data(n=n, seed=seed)
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def train_args(d, **kw):
    base = dict(output_dir=d, per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=2,
                learning_rate=0.1, use_cpu=True, report_to=[], logging_strategy="no", save_strategy="no",
                seed=0, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
                disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def replay(make_model, rec: Recorder, layers, autocast=False, checkpointing=False, loss_of=None):
    """``ga.capture`` around a plain loop over the recorded micro-batches, at the recorded params."""
    model = make_model()
    model.train()
    if checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with ga.capture(model, layers=layers) as cap:
        for kw, step in zip(rec.inputs, rec.step_of):
            model.load_state_dict(rec.states[step])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(**kw)
                loss = out.loss if loss_of is None else loss_of(out, kw)
            loss.backward()
    return cap.grads


def dense64(G: ga.GradientSet) -> dict:
    """Rows of a captured set materialized in float64 (bf16 factors would round in bf16)."""
    from gradalg.capture import Factors, OneHot, materialize

    out = {}
    for name in G.layers:
        rows = []
        for chunk in G.expr.store.chunks():
            F_ = chunk.blocks[name]
            A = F_.A if isinstance(F_.A, OneHot) else F_.A.double()
            rows.append(materialize(Factors(A, F_.D.double())).flatten(1))
        out[name] = torch.cat(rows)
    return out


def assert_sets_close(a: ga.GradientSet, b: ga.GradientSet, tol):
    da, db = dense64(a), dense64(b)
    assert sorted(da) == sorted(db)
    for name in da:
        x, y = da[name], db[name]
        assert x.shape == y.shape, name
        err = float(((x - y).norm(dim=1) / y.norm(dim=1).clamp_min(1e-12)).max())
        assert err <= tol, f"{name}: per-example relative error {err:.3g}"


# ---------------------------------------------------------------------------- HF Trainer
def test_trainer_matches_capture_around_plain_loop_and_true_scales():
    model = gpt2()
    rec = Recorder()
    loss_cb = GradientCallback(layers=LAYERS, record=("input_ids",))
    sum_cb = GradientCallback(layers=LAYERS, scale="sum")
    mean_cb = GradientCallback(layers=LAYERS, scale="mean")
    steps = []
    loss_cb.on_step(lambda step: steps.append((step.index, step.n, step.micro_batches)))
    with tempfile.TemporaryDirectory() as d:
        Trainer(model=model, args=train_args(d), train_dataset=lm_dataset(),
                callbacks=[rec, loss_cb, sum_cb, mean_cb]).train()
    assert steps == [(0, 6, 2), (1, 6, 2)]                 # gradient accumulation: 2 micro-batches a step
    assert loss_cb.grads.n == 12 and len(rec.inputs) == 4
    fed = torch.cat([kw["input_ids"] for kw in rec.inputs])      # which example each row is
    assert torch.equal(torch.stack(loss_cb.inputs["input_ids"]), fed)
    # 1. the callback's rows are ga.capture's around the same plain loop
    assert_sets_close(loss_cb.grads, replay(gpt2, rec, LAYERS), 1e-9)
    # 2. scale="sum" / "mean": the gradient of each example's summed / mean token loss
    oracle_sum, oracle_mean = [], []
    for kw, step in zip(rec.inputs, rec.step_of):
        m = gpt2()
        m.load_state_dict(rec.states[step])
        ids, mask = kw["input_ids"], kw["attention_mask"]

        def token_sum(mod, batch):
            i, a = batch
            logits = mod(input_ids=i, attention_mask=a).logits[:, :-1]
            t = i[:, 1:].masked_fill(a[:, 1:] == 0, -100)
            return F.cross_entropy(logits.transpose(1, 2), t, reduction="sum", ignore_index=-100)

        task = ga.Task(m, token_sum)
        names = [n for n, _ in m.named_parameters() if n.rsplit(".", 1)[0] in LAYERS]
        g = ga.per_example_grads(task, (ids, mask), names, method="loop")
        counts = mask[:, 1:].sum(1).double()
        oracle_sum.append(g)
        oracle_mean.append({k: v / counts.view(-1, *[1] * (v.dim() - 1)) for k, v in g.items()})
    for cb, oracle in ((sum_cb, oracle_sum), (mean_cb, oracle_mean)):
        captured = _to_params(model, cb.grads)
        for name in captured:
            ref = torch.cat([o[name] for o in oracle])
            err = float(((captured[name] - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max())
            assert err <= 1e-7, f"scale={cb.scale} {name}: {err:.3g}"


def _to_params(model, G):
    from gradalg.capture import resolve_layers

    out = {}
    dense = G.to_dense()
    for ref in resolve_layers(model, list(G.layers)):
        for pname, value in ref.rule.to_params(ref.module, dense[ref.name]).items():
            out[f"{ref.name}.{pname}"] = value
    return out


def test_trainer_bf16_autocast_and_gradient_checkpointing():
    make = lambda: gpt2(dtype=torch.float32)  # noqa: E731
    rec = Recorder()
    cb = GradientCallback(layers=LAYERS)
    with tempfile.TemporaryDirectory() as d:
        ckpt = ("activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
                else "gradient_checkpointing")   # renamed in transformers 5
        args = train_args(d, bf16=True, max_steps=1, **{ckpt: True})
        Trainer(model=make(), args=args, train_dataset=lm_dataset(n=6), callbacks=[rec, cb]).train()
    G = cb.grads
    assert G.n == 6
    assert {v.dtype for v in G.to_dense().values()} == {torch.float32}
    reference = replay(make, rec, LAYERS, autocast=True, checkpointing=True)
    assert_sets_close(G, reference, 1e-5)


def test_trainer_refuses_scale_sum_without_token_count():
    class NoKwargs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, labels):
            return {"loss": F.cross_entropy(self.fc(x), labels)}

    ds = [{"x": torch.randn(4), "labels": torch.tensor(i % 3)} for i in range(6)]
    cb = GradientCallback(scale="sum")
    with tempfile.TemporaryDirectory() as d:
        trainer = Trainer(model=NoKwargs(), args=train_args(d, max_steps=1, gradient_accumulation_steps=1),
                          train_dataset=ds, callbacks=[cb])
        with pytest.raises(ga.LossReductionError, match="num_items_in_batch"):
            trainer.train()


def test_trainer_online_selection_corrects_before_clipping():
    """Selection inside Trainer: the gradient the optimizer gets is the kept examples' gradient
    (with the Trainer's normalization), clipped after the correction."""
    model = gpt2()
    model.transformer.wpe.weight.requires_grad_(False)  # shared position ids: not separable per example
    rec = Recorder()
    sel = OnlineSelection(BatchMean(), DropFraction(0.5),
                          layers=["transformer.wte", "transformer.h.*.*.c_*", "lm_head"])
    cb = GradientCallback(selection=sel, keep=False)
    with tempfile.TemporaryDirectory() as d:
        Trainer(model=model, args=train_args(d, max_steps=1, max_grad_norm=0.5), train_dataset=lm_dataset(n=6),
                callbacks=[cb, rec]).train()                      # rec after cb: sees the corrected grads
    weights = sel.last.weights
    assert sel.last.kept == 3
    # fresh: Σ over kept examples of their token losses / N, at the step's starting parameters
    fresh = gpt2()
    fresh.load_state_dict(rec.states[0])
    fresh.transformer.wpe.weight.requires_grad_(False)
    fresh.train()
    start = 0
    for kw in rec.inputs:
        n = kw["input_ids"].shape[0]
        logits = fresh(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"]).logits[:, :-1]
        t = kw["labels"][:, 1:]
        tok = F.cross_entropy(logits.transpose(1, 2), t, reduction="none", ignore_index=-100)
        w = weights[start:start + n].to(tok.dtype)
        ((tok.sum(1) * w).sum() / kw["num_items_in_batch"]).backward()
        start += n
    grads = {n: p.grad for n, p in fresh.named_parameters() if p.grad is not None}
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    clip = min(1.0, 0.5 / (float(total) + 1e-6))
    for name, g in rec.grads_seen[0].items():
        ref = grads[name] * clip
        err = float((g - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err <= 1e-6, f"{name}: {err:.3g}"   # Trainer's loss upcasts logits to float32


# ---------------------------------------------------------------------------- TRL SFTTrainer
def test_sft_trainer_matches_capture_around_plain_loop():
    trl = pytest.importorskip("trl", reason="TRL not installed (pip install 'gradalg[hf]')")
    from datasets import Dataset
    from tokenizers import Tokenizer, models as tok_models
    from transformers import PreTrainedTokenizerFast
    from trl.trainer.utils import add_fused_lm_head

    vocab = {f"t{i}": i for i in range(101)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel(vocab, unk_token="t1")),
                                  pad_token="t0", eos_token="t0", unk_token="t1")
    ids, mask = padded_token_data(n=6, seed=4)
    ds = Dataset.from_dict({"input_ids": [row[m.bool()].tolist() for row, m in zip(ids, mask)]})
    layers = LAYERS[:-1]            # TRL's fused LM head never runs the lm_head module (refused below)

    def run(layers):
        rec, cb = Recorder(), GradientCallback(layers=layers)
        with tempfile.TemporaryDirectory() as d:
            args = trl.SFTConfig(output_dir=d, per_device_train_batch_size=3, gradient_accumulation_steps=1,
                                 max_steps=2, learning_rate=0.1, use_cpu=True, report_to=[],
                                 logging_strategy="no", save_strategy="no", seed=0, optim="sgd",
                                 lr_scheduler_type="constant", max_grad_norm=0.0, disable_tqdm=True,
                                 max_length=16, packing=False)
            trl.SFTTrainer(model=gpt2(), args=args, train_dataset=ds, processing_class=tok,
                           callbacks=[rec, cb]).train()
        return rec, cb

    rec, cb = run(layers)
    assert cb.grads.n == 6 and cb.capture.steps == 2

    def patched():
        model = gpt2()
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
        return model

    # SFTTrainer's loss: -Σ log p / N, N = the step's label tokens as Trainer counts them (unshifted
    # for GPT-2, whose loss_type is unset), computed outside the model
    def sft_loss(out, kw):
        return -out.log_probs.sum() / (kw["labels"] != -100).sum()

    # SFTConfig defaults to bf16=True: the replay runs under the same autocast
    assert_sets_close(cb.grads, replay(patched, rec, layers, loss_of=sft_loss, autocast=True), 1e-9)
    with pytest.raises(ga.UnsupportedLayerError, match="fused LM head"):
        run(["lm_head"])


# ---------------------------------------------------------------------------- OLMo-core
def test_olmo_core_trainer_matches_capture_around_plain_loop():
    pytest.importorskip("olmo_core", reason="OLMo-core not installed (pip install 'gradalg[olmo]')")
    from olmo_core.data.utils import get_labels
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    from gradalg.integrations.olmo import InMemoryDataLoader, OLMoCoreCallback

    def make():
        torch.manual_seed(0)
        return TransformerConfig.olmo2_1M(vocab_size=64, n_layers=2).build(init_device="cpu")

    class Snapshots(Callback):
        states: list = []

        def pre_step(self, batch):
            self.states.append(copy.deepcopy(self.trainer.train_module.model.state_dict()))

    g = torch.Generator().manual_seed(0)
    seq = 8
    batches = [{"input_ids": torch.randint(0, 64, (4, seq), generator=g)} for _ in range(2)]
    layers = ["embeddings", "blocks.0.attention.w_q", "blocks.1.feed_forward.w2", "lm_head.w_out"]
    cb = OLMoCoreCallback(layers=layers)
    seen = []
    cb.on_step(lambda step: seen.append((step.index, step.n, step.micro_batches)))
    snaps = Snapshots()
    snaps.states = []
    module = TransformerTrainModuleConfig(rank_microbatch_size=2 * seq, max_sequence_length=seq,
                                          optim=AdamWConfig(lr=1e-2)).build(make())
    with tempfile.TemporaryDirectory() as d:
        trainer = TrainerConfig(save_folder=d, no_checkpoints=True, max_duration=Duration.steps(2),
                                metrics_collect_interval=1,
                                callbacks={"snapshots": snaps, "gradalg": cb}).build(module,
                                                                                     InMemoryDataLoader(batches, d))
        trainer.fit()
    assert seen == [(0, 4, 2), (1, 4, 2)]          # 2 micro-batches of 2 sequences per step
    # plain loop: OLMo-core's loss, Σ token CE / (loss tokens of the whole step), per micro-batch
    ref_model = make()
    with ga.capture(ref_model, layers=layers) as cap:
        for state, batch in zip(snaps.states, batches):
            ref_model.load_state_dict(state)
            labels = get_labels(batch)
            n_tokens = (labels != -100).sum()
            for half in (slice(0, 2), slice(2, 4)):
                logits = ref_model(batch["input_ids"][half])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[half].reshape(-1),
                                       ignore_index=-100, reduction="sum") / n_tokens
                loss.backward()
    assert_sets_close(cb.grads, cap.grads, 1e-4)


def test_olmo_core_online_selection_covers_rmsnorms():
    """Selection inside OLMo-core: every parameter (RMSNorms, q/k norms included) is corrected in
    pre_optim_step, i.e. before OLMo-core clips and steps."""
    pytest.importorskip("olmo_core", reason="OLMo-core not installed (pip install 'gradalg[olmo]')")
    from olmo_core.data.utils import get_labels
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    from gradalg.integrations.olmo import InMemoryDataLoader, OLMoCoreCallback

    def make():
        torch.manual_seed(0)
        return TransformerConfig.olmo2_1M(vocab_size=64, n_layers=2).build(init_device="cpu")

    class Grads(Callback):
        priority = -10                               # after the gradalg callback
        seen: dict = {}
        state: dict = {}

        def pre_step(self, batch):
            self.state.update(copy.deepcopy(self.trainer.train_module.model.state_dict()))

        def pre_optim_step(self):
            self.seen.update({n: p.grad.detach().clone()
                              for n, p in self.trainer.train_module.model.named_parameters()})

    seq = 8
    batch = {"input_ids": torch.randint(0, 64, (4, seq), generator=torch.Generator().manual_seed(1))}
    sel = OnlineSelection(BatchMean(), DropFraction(0.5))
    grads = Grads()
    grads.seen, grads.state = {}, {}
    module = TransformerTrainModuleConfig(rank_microbatch_size=2 * seq, max_sequence_length=seq,
                                          optim=AdamWConfig(lr=1e-2)).build(make())
    with tempfile.TemporaryDirectory() as d:
        TrainerConfig(save_folder=d, no_checkpoints=True, max_duration=Duration.steps(1),
                      callbacks={"gradalg": OLMoCoreCallback(selection=sel, keep=False), "grads": grads}
                      ).build(module, InMemoryDataLoader([batch], d)).fit()
    assert sel.last.kept == 2 and {"blocks.0.attention.q_norm", "lm_head.norm"} <= set(sel._affine.modules)
    fresh = make()
    fresh.load_state_dict(grads.state)
    labels = get_labels(batch)
    logits = fresh(batch["input_ids"])
    tok = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    ((tok.sum(1) * sel.last.weights.to(tok.dtype)).sum() / (labels != -100).sum()).backward()
    for name, p in fresh.named_parameters():
        err = float((grads.seen[name] - p.grad).norm() / p.grad.norm().clamp_min(1e-12))
        assert err <= 1e-4, f"{name}: {err:.3g}"
