"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): DDP / FSDP2 / FSDP1 capture and online
selection against single-process references. Rank 0 writes ``{case: "ok" | error}`` as JSON to
the path given as the first argument. Every collective of a case runs before its assertions, so
a failing check on one rank cannot leave the other waiting.
"""
from __future__ import annotations

import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import gradalg as ga
from gradalg.capture import resolve_layers
from gradalg.integrations import BatchMean, DropFraction, OnlineSelection, ValidationTarget, gather
from cases import run_and_report  # noqa: E402 - the script folder is on sys.path
from models import classification_data, gpt2, mlp, padded_token_data

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
R, W = dist.get_rank(), dist.get_world_size()
ALONE = [dist.new_group([r]) for r in range(W)][R]   # a one-rank group: single-process references
MLP_LAYERS = ["0", "2"]
MLP_PARAMS = ["0.weight", "0.bias", "2.weight", "2.bias"]


def sum_ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum")


def steps_of(data, n_steps, per_rank):
    """Global batches of W·per_rank rows; this rank's shard is rows [R·per_rank, (R+1)·per_rank)."""
    out = []
    for s in range(n_steps):
        lo = s * W * per_rank
        glob = tuple(t[lo:lo + W * per_rank] for t in data)
        out.append((glob, tuple(t[R * per_rank:(R + 1) * per_rank] for t in glob)))
    return out


def full_state(model):
    """Full (unsharded) parameters by name, for DDP, FSDP1 (use_orig_params) or FSDP2."""
    out = {}
    if isinstance(model, FSDP1):
        with FSDP1.summon_full_params(model):
            return {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                    for k, v in model.named_parameters()}
    for k, v in model.named_parameters():
        v = v.detach()
        out[k.removeprefix("module.")] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    return out


def params_of(model, layers, dense):
    out = {}
    for ref in resolve_layers(model, list(layers)):
        for pname, value in ref.rule.to_params(ref.module, dense[ref.name]).items():
            out[f"{ref.name}.{pname}"] = value
    return out


def close(a, b, tol, what):
    a, b = a.detach().double(), b.detach().double()
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    assert err <= tol, f"{what}: relative error {err:.3g}"


def reference_rows(make, state, task_of, batch, names, method="vmap"):
    m = make()
    m.load_state_dict(state, strict=False)
    return ga.per_example_grads(task_of(m), batch, names, method=method)


def single_process_capture(make, data_steps, lr, reduction="sum"):
    """ga.capture around a plain single-process loop over the global batches."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with ga.capture(model, layers=MLP_LAYERS, reduction=reduction) as cap:
        for glob, _ in data_steps:
            opt.zero_grad()
            F.cross_entropy(model(glob[0]), glob[1], reduction=reduction).backward()
            opt.step()
    return cap.grads.to_dense()


# ------------------------------------------------------------------------------------ cases
def case_ddp_sum():
    """DDP, sum loss: every rank's rows = the oracle on its shard; gathered = single process."""
    model = mlp()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    data = steps_of(classification_data(n=16), 2, 4)
    refs = []
    tc = ga.integrations.training_capture(ddp, layers=MLP_LAYERS, optimizer=opt, keep=True)
    with tc:
        for _, local in data:
            refs.append(reference_rows(mlp, full_state(ddp), ga.tasks.classification, local, MLP_PARAMS))
            opt.zero_grad()
            sum_ce(ddp, local).backward()
            opt.step()
    gathered = gather(tc).to_dense()
    single = single_process_capture(mlp, data, lr=0.5 / W)   # DDP averages: lr/W on the summed loss
    local = params_of(model, MLP_LAYERS, tc.grads.to_dense())
    for name in MLP_PARAMS:
        close(local[name], torch.cat([r[name] for r in refs]), 1e-9, f"rank {R} {name}")
    for name in MLP_LAYERS:
        close(gathered[name], single[name], 1e-9, f"gathered {name}")
    assert tc.steps == 2 and gather(tc).n == 16


def case_ddp_mean():
    """DDP with F.cross_entropy's mean: ga.capture(reduction='mean') undoes the local 1/B."""
    model = mlp()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    data = steps_of(classification_data(n=16, seed=4), 2, 4)
    with ga.capture(model, layers=MLP_LAYERS, reduction="mean") as cap:
        for _, (x, y) in data:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
    gathered = gather(cap.grads).to_dense()
    single = single_process_capture(mlp, data, lr=0.5, reduction="mean")  # mean of means = global mean
    for name in MLP_LAYERS:
        close(gathered[name], single[name], 1e-9, f"gathered {name}")


def _fsdp2_mlp():
    model = mlp()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model


def case_fsdp2():
    """FSDP2 fully_shard: hooks see whole activations; rows equal the oracle; gathered = single."""
    model = _fsdp2_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = steps_of(classification_data(n=16, seed=6), 2, 4)
    refs = []
    tc = ga.integrations.training_capture(model, layers=MLP_LAYERS, optimizer=opt, keep=True)
    with tc:
        for _, local in data:
            refs.append(reference_rows(mlp, full_state(model), ga.tasks.classification, local, MLP_PARAMS))
            opt.zero_grad()
            sum_ce(model, local).backward()
            opt.step()
    gathered = gather(tc).to_dense()
    single = single_process_capture(mlp, data, lr=0.5 / W)
    local = params_of(model, MLP_LAYERS, tc.grads.to_dense())
    for name in MLP_PARAMS:
        close(local[name], torch.cat([r[name] for r in refs]), 1e-9, f"rank {R} {name}")
    for name in MLP_LAYERS:
        close(gathered[name], single[name], 1e-9, f"gathered {name}")


def case_fsdp2_gpt2():
    """FSDP2 on a GPT-2 (each block sharded): Conv1D, Embedding and the LM head per example."""
    model = gpt2()
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    ids, mask = padded_token_data(n=2 * W, seed=7)
    local = (ids[2 * R:2 * R + 2], mask[2 * R:2 * R + 2])
    layers = ["transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"]
    from models import lm_loss, lm_task

    with ga.capture(model, layers=layers) as cap:
        lm_loss(model, local).backward()
    dense = cap.grads.to_dense()
    names = [n for n in state if n.rsplit(".", 1)[0] in layers and "attn.bias" not in n]
    ref = reference_rows(gpt2, state, lm_task, local, names, method="loop")
    gathered = gather(cap.grads)
    plain = gpt2()
    plain.train()
    with ga.capture(plain, layers=layers) as cap1:
        lm_loss(plain, (ids, mask)).backward()
    single = cap1.grads.to_dense()
    ref_model = gpt2()
    captured = params_of(ref_model, layers, dense)
    for name in names:
        close(captured[name], ref[name], 1e-9, f"rank {R} {name}")
    g = gathered.to_dense()
    for name in layers:
        close(g[name], single[name], 1e-9, f"gathered {name}")


def case_fsdp1():
    """FSDP1 (FullyShardedDataParallel, use_orig_params=True): capture works the same."""
    model = mlp()
    fsdp = FSDP1(model, use_orig_params=True, device_id=torch.device("cpu"))
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.5)
    data = steps_of(classification_data(n=16, seed=8), 2, 4)
    refs = []
    tc = ga.integrations.training_capture(fsdp, layers=MLP_LAYERS, optimizer=opt, keep=True)
    with tc:
        for _, local in data:
            refs.append(reference_rows(mlp, full_state(fsdp), ga.tasks.classification, local, MLP_PARAMS))
            opt.zero_grad()
            sum_ce(fsdp, local).backward()
            opt.step()
    gathered = gather(tc).to_dense()
    single = single_process_capture(mlp, data, lr=0.5 / W)
    local = params_of(mlp(), MLP_LAYERS, tc.grads.to_dense())
    for name in MLP_PARAMS:
        close(local[name], torch.cat([r[name] for r in refs]), 1e-9, f"rank {R} {name}")
    for name in MLP_LAYERS:
        close(gathered[name], single[name], 1e-9, f"gathered {name}")
    try:  # selection needs per-parameter gradient shards: refused with the fix
        OnlineSelection().attach(fsdp)
        raise AssertionError("online selection under FSDP1 was not refused")
    except ga.UnsupportedLayerError as err:
        assert "fully_shard" in str(err)


def _selection_case(wrap, target_of):
    """The corrected step on every rank = (1/W) Σ_{kept, global} ∇ℓ_i, the single-process answer."""
    model = mlp()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = wrap(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    (glob, local), = steps_of(classification_data(n=12, seed=10), 1, 6)
    val = classification_data(n=5, seed=11)
    sel = OnlineSelection(target_of(val), DropFraction(0.25))
    seen = {}
    with sel.attach(wrapped, optimizer=opt):
        opt.register_step_pre_hook(lambda *_: seen.update(full_grads(wrapped)))  # after the correction
        opt.zero_grad()
        sum_ce(wrapped, local).backward()
        opt.step()
    rec = sel.last
    # single process: the same selection on the global batch
    single = mlp()
    single.load_state_dict(start)
    sel1 = OnlineSelection(target_of(val), DropFraction(0.25), group=ALONE)
    with sel1.attach(single):
        sum_ce(single, glob).backward()
        sel1.apply()
    fresh = mlp()
    fresh.load_state_dict(start)
    per = F.cross_entropy(fresh(glob[0]), glob[1], reduction="none")
    ((per * rec.weights.double()).sum() / W).backward()   # DDP/FSDP average the ranks' gradients
    assert rec.scores.shape == (12,) and rec.kept == 9
    close(rec.scores, sel1.last.scores, 1e-9, "scores")
    assert torch.equal(rec.weights, sel1.last.weights)
    for name, p in fresh.named_parameters():
        close(seen[name], p.grad, 1e-9, f"rank {R} corrected {name}")


def full_grads(model):
    out = {}
    for k, p in model.named_parameters():
        g = p.grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        out[k.removeprefix("module.")] = g.detach().clone()
    return out


def case_ddp_selection():
    _selection_case(DDP, lambda val: BatchMean())


def case_fsdp2_selection():
    def wrap(model):
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        return model
    _selection_case(wrap, lambda val: BatchMean())


def case_fsdp2_selection_validation_target():
    def wrap(model):
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        return model
    _selection_case(wrap, lambda val: ValidationTarget(sum_ce, val))


def case_fsdp2_selection_gpt2_layernorms():
    """Every GPT-2 parameter corrected under FSDP2, LayerNorms (sharded DTensor grads) included."""
    model = gpt2()
    model.train()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    ids, mask = padded_token_data(n=4 * W, seed=12)
    local = (ids[4 * R:4 * R + 4], mask[4 * R:4 * R + 4])

    def per_example(m, b):
        i, a = b
        pos = torch.arange(i.shape[1]).expand_as(i)
        logits = m(input_ids=i, attention_mask=a, position_ids=pos).logits[:, :-1]
        t = i[:, 1:].masked_fill(a[:, 1:] == 0, -100)
        tok = F.cross_entropy(logits.transpose(1, 2), t, reduction="none", ignore_index=-100)
        return tok.sum(1) / a[:, 1:].sum(1).clamp_min(1)

    # position_ids are passed per row, so the position embedding is recorded too (the
    # default layers leave it out: HF models usually share positions across the batch)
    layers = ["transformer.wte", "transformer.wpe", "transformer.h.*", "lm_head"]
    sel = OnlineSelection(BatchMean(), DropFraction(0.5), layers=layers)
    with sel.attach(model):
        per_example(model, local).sum().backward()
        sel.apply()
    seen = full_grads(model)
    fresh = gpt2()
    fresh.load_state_dict(start)
    fresh.train()
    ((per_example(fresh, (ids, mask)) * sel.last.weights.double()).sum() / W).backward()
    assert sel.last.kept == 4 * W // 2
    for name, p in fresh.named_parameters():
        close(seen[name], p.grad, 1e-8, f"rank {R} corrected {name}")


def case_hf_trainer_ddp():
    """HF Trainer under torchrun (DDP on CPU): scale="loss" undoes the world-size factor Trainer puts on
    the loss, so each rank's rows equal ga.capture around a plain replay of its micro-batches."""
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradalg.integrations.hf import GradientCallback

    layers = ["transformer.wte", "transformer.h.0.attn.c_attn", "lm_head"]
    ids, mask = padded_token_data(n=12, seed=13)
    labels = ids.masked_fill(mask == 0, -100)
    ds = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(12)]

    class Record(TrainerCallback):
        inputs, states = [], []

        def on_train_begin(self, args, state, control, model=None, **kw):
            def pre(module, a, k):
                if torch.is_grad_enabled() and module.training:
                    self.inputs.append(({n: v.detach().clone() if torch.is_tensor(v) else v for n, v in k.items()},
                                        len(self.states) - 1))
            model.register_forward_pre_hook(pre, with_kwargs=True)

        def on_step_begin(self, args, state, control, model=None, **kw):
            self.states.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    rec, cb = Record(), GradientCallback(layers=layers)
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(output_dir=d, per_device_train_batch_size=3, gradient_accumulation_steps=1,
                                 max_steps=2, learning_rate=0.1, use_cpu=True, report_to=[], logging_strategy="no",
                                 save_strategy="no", seed=0, optim="sgd", lr_scheduler_type="constant",
                                 max_grad_norm=0.0, disable_tqdm=True, ddp_backend="gloo")
        Trainer(model=gpt2(), args=args, train_dataset=ds, callbacks=[rec, cb]).train()
    assert args.world_size == W
    plain = gpt2()
    plain.train()
    with ga.capture(plain, layers=layers) as cap:
        for kw, step in rec.inputs:
            plain.load_state_dict(rec.states[step])
            plain(**kw).loss.backward()
    gathered = gather(cb.grads)
    assert cb.grads.n == 6 and gathered.n == 12
    mine, ref = cb.grads.to_dense(), cap.grads.to_dense()
    for name in layers:
        close(mine[name], ref[name], 1e-6, f"rank {R} {name}")

    # online selection inside the DDP Trainer: the gradient the optimizer gets is the kept examples'
    # gradient over the global batch, with Trainer's normalization
    class Grads(TrainerCallback):
        seen = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            self.seen.update({n: p.grad.detach().clone() for n, p in model.named_parameters()
                              if p.grad is not None})

    model = gpt2()
    model.transformer.wpe.weight.requires_grad_(False)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    sel = OnlineSelection(BatchMean(), DropFraction(0.5), layers=["transformer.wte", "transformer.h.*.*.c_*",
                                                                  "lm_head"])
    rec2, grads = Record(), Grads()
    rec2.inputs, rec2.states, grads.seen = [], [], {}
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(output_dir=d, per_device_train_batch_size=3, max_steps=1, learning_rate=0.1,
                                 use_cpu=True, report_to=[], logging_strategy="no", save_strategy="no", seed=0,
                                 optim="sgd", max_grad_norm=0.0, disable_tqdm=True, ddp_backend="gloo")
        Trainer(model=model, args=args, train_dataset=ds, callbacks=[rec2, GradientCallback(selection=sel), grads]
                ).train()
    everyone = [None] * W
    dist.all_gather_object(everyone, [kw for kw, _ in rec2.inputs])
    fresh = gpt2()
    fresh.load_state_dict(start)
    fresh.transformer.wpe.weight.requires_grad_(False)
    fresh.train()
    w, at = sel.last.weights, 0
    for kws in everyone:                                  # rank order = the order of the gathered scores
        for kw in kws:
            n = kw["input_ids"].shape[0]
            logits = fresh(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"]).logits[:, :-1]
            tok = F.cross_entropy(logits.transpose(1, 2), kw["labels"][:, 1:], reduction="none", ignore_index=-100)
            ((tok.sum(1) * w[at:at + n].to(tok.dtype)).sum() / kw["num_items_in_batch"]).backward()
            at += n
    assert sel.last.kept == 3 and at == 6
    for name, p in fresh.named_parameters():
        if p.grad is not None:
            close(grads.seen[name.removeprefix("module.")], p.grad, 1e-6, f"rank {R} selected {name}")


CASES = [case_ddp_sum, case_ddp_mean, case_fsdp2, case_fsdp2_gpt2, case_fsdp1, case_ddp_selection,
         case_fsdp2_selection, case_fsdp2_selection_validation_target, case_fsdp2_selection_gpt2_layernorms,
         case_hf_trainer_ddp]

if __name__ == "__main__":
    run_and_report({case.__name__.removeprefix("case_"): case for case in CASES}, traceback_limit=6)
