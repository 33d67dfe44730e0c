"""``ga.adam_state`` reads the optimizer's moments a block at a time instead of copying them
whole (session 38, issue 28's check on unseen architectures: on Gemma-3-270m and a 2-layer
OLMoE-width MoE, LESS's flat copies of ``exp_avg`` and ``exp_avg_sq`` were 0.8–1.1 GB that
no plan counted; on a 1-layer OLMoE-width probe LESS grew 1.36 GB against a planned 0.88).

Checked on small float64 models: every block's slice equals ``block_rows`` of the
optimizer's tensors (biased Linears, whose block concatenates weight and bias, and fused
MoE experts), a bias-free block's slice is a view of the optimizer's own storage (no
copy), LESS's scores are unchanged, and a step taken after ``adam_state`` is refused
rather than read silently."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradalg as ga
from gradalg.errors import OptionError
from references import block_rows, one_thread, run_one_rank  # noqa: F401 - fixture

F64 = torch.float64


def mlp(bias: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 3, bias=bias)).to(F64)


def classification_setup(bias: bool):
    model = mlp(bias)
    task = ga.tasks.classification(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 5, generator=g, dtype=F64), torch.randint(0, 3, (6,), generator=g)
    data = list(zip(x, y))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    opt.zero_grad()
    return model, task, data, opt, x, y


def expected(model, opt, layers, key):
    return block_rows(model, layers, {n: opt.state[p][key].unsqueeze(0) for n, p in model.named_parameters()})[0]


@pytest.mark.parametrize("bias", [True, False])
def test_every_block_slice_equals_the_optimizer_moments(bias):
    model, task, data, opt, *_ = classification_setup(bias)
    G = ga.grads(task, data)
    st = ga.adam_state(opt, G)
    layers = ["0", "2"]
    for key, moment in (("exp_avg", st.exp_avg), ("exp_avg_sq", st.exp_avg_sq)):
        full = expected(model, opt, layers, key)
        assert tuple(moment.shape) == (G.space.dim,) == tuple(full.shape)
        start = 0
        for b in G.space.blocks:
            torch.testing.assert_close(moment[start:start + b.dim], full[start:start + b.dim], rtol=0, atol=0)
            start += b.dim
        torch.testing.assert_close(moment[3:start - 2], full[3:start - 2], rtol=0, atol=0)   # across blocks
        torch.testing.assert_close(moment.to(F64), full, rtol=0, atol=0)


def test_a_bias_free_block_is_read_in_place_not_copied():
    model, task, data, opt, *_ = classification_setup(bias=False)
    G = ga.grads(task, data)
    st = ga.adam_state(opt, G)
    first = G.space.blocks[0]
    block = st.exp_avg[0:first.dim]
    weight = model[0].weight
    assert block.untyped_storage().data_ptr() == opt.state[weight]["exp_avg"].untyped_storage().data_ptr()


def test_a_step_after_adam_state_is_refused_and_reading_again_works():
    model, task, data, opt, x, y = classification_setup(bias=True)
    G = ga.grads(task, data)
    st = ga.adam_state(opt, G)
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    with pytest.raises(OptionError, match="call ga.adam_state"):
        st.exp_avg[0:4]
    st2 = ga.adam_state(opt, G)
    torch.testing.assert_close(st2.exp_avg.to(F64), expected(model, opt, ["0", "2"], "exp_avg"), rtol=0, atol=0)


def test_fused_experts_blocks_equal_the_optimizer_moments():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.OlmoeForCausalLM(tf.OlmoeConfig(hidden_size=16, num_attention_heads=2, vocab_size=37, num_hidden_layers=1,
                                               intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                                               max_position_embeddings=32, experts_implementation="eager")).to(F64).eval()
    task = ga.tasks.causal_lm(model)
    g = torch.Generator().manual_seed(2)
    data = [{"input_ids": torch.randint(0, 37, (6,), generator=g)} for _ in range(3)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    task.summed_loss(model, {"input_ids": torch.stack([d["input_ids"] for d in data])}).backward()
    opt.step()
    opt.zero_grad()
    G = ga.grads(task, data)
    st = ga.adam_state(opt, G)
    from gradalg.curvature.hvp import ParamCoords
    src = G.expr.source
    coords = ParamCoords(model, src.layers, src.backend)
    params = dict(model.named_parameters())
    for key, moment in (("exp_avg", st.exp_avg), ("exp_avg_sq", st.exp_avg_sq)):
        full = coords.from_params({n: opt.state[params[n]][key].unsqueeze(0) for n in coords.param_names})[0]
        start = 0
        for b in G.space.blocks:
            torch.testing.assert_close(moment[start:start + b.dim], full[start:start + b.dim], rtol=0, atol=0)
            start += b.dim
        assert start == full.numel()


def test_a_moment_works_as_the_tensor_it_was():
    """Before the block views, ``exp_avg_sq`` was a (dim,) tensor: every tensor use of it
    (notebook 11's ``v.double().sqrt()``, torch functions, arithmetic, numpy) still works,
    on a copy of the whole vector, with the tensor's numbers."""
    import numpy as np
    model, task, data, opt, *_ = classification_setup(True)
    G = ga.grads(task, data)
    v = ga.adam_state(opt, G).exp_avg_sq
    full = expected(model, opt, ["0", "2"], "exp_avg_sq")
    cases = {"v.double().sqrt()": (v.double().sqrt(), full.sqrt()), "torch.sqrt(v)": (torch.sqrt(v), full.sqrt()),
             "v + eps": (v + 1e-8, full + 1e-8), "eps + v": (1e-8 + v, full + 1e-8),
             "1 / (v + 1)": (1.0 / (v + 1), 1.0 / (full + 1)), "-v": (-v, -full), "v ** 2": (v ** 2, full ** 2),
             "np.asarray(v)": (torch.as_tensor(np.asarray(v)), full), "v.sum()": (v.sum(), full.sum())}
    for name, (got, want) in cases.items():
        assert isinstance(got, torch.Tensor), name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


_FSDP2_MOMENT_WRITE = r'''
import os, sys, torch, torch.distributed as dist
from torch import nn
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import fully_shard
import gradalg as ga
from gradalg.errors import OptionError
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
fully_shard(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
opt.step()
opt.zero_grad()
G = ga.grads(ga.tasks.classification(model), list(zip(x, y)))
st = ga.adam_state(opt, G)
before = st.exp_avg[0:4].clone()
with torch.no_grad():
    opt.state[model[0].weight]["exp_avg"].to_local().add_(1.0)   # a loader writing this rank's shard
try:
    st.exp_avg[0:4]
except OptionError as e:
    assert "call ga.adam_state" in str(e), e
    print("refused")
dist.destroy_process_group()
'''


def test_a_write_into_an_fsdp2_moments_local_shard_is_refused(tmp_path):
    """FSDP2's Adam moments are DTensors. A write into the optimizer's moment through its
    local shard (``to_local().add_``, as a checkpoint loader does) bumped no counter the
    check read (the DTensor view's counters are its own), so the moments read afterwards
    were the new ones under a plan made for the old (a silently wrong number). One rank,
    gloo, in a fresh process."""
    out = run_one_rank(_FSDP2_MOMENT_WRITE, tmp_path, "moment_write.py")
    assert out.returncode == 0 and out.stdout.strip().endswith("refused"), (out.stdout[-500:], out.stderr[-2000:])
