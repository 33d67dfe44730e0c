"""Planning LLMs on PyTorch's meta device: what the speed-ups keep exact (Kronecker
splits, model fingerprints, GEMM pricing), what a meta model's identity is, that planning
reads no weights and one example's shape per dataset, and the per-GPU scale model
(weights sharded over g GPUs, held rows replicated, refusal with the arithmetic).

Small configurations only (a 2-layer Qwen2 of width 64): the arithmetic is the same as at
70B; benchmarks/plan_scale.py times the large ones."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch.utils.data import Dataset

import gradalg as ga
from gradalg import fingerprint
from gradalg.expr import projection
from gradalg import devices
from gradalg.plan.cost import Cost
from gradalg.plan.jobs.kron import kron_bytes
from gradalg.plan.scale import check_fits, fsdp_unit_bytes, model_bytes, scale_estimates

transformers = pytest.importorskip("transformers")

HIDDEN, INTER, LAYERS, HEADS, KV, VOCAB, T = 64, 96, 2, 4, 2, 128, 16
LINEARS = ["model.layers.*.self_attn.*", "model.layers.*.mlp.*"]


class TokenShapes(Dataset):
    """n sequences of T token ids that count how often they are read."""

    def __init__(self, n, T):
        self.n, self.T, self.reads = n, T, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        return {"input_ids": torch.zeros(self.T, dtype=torch.long)}


def meta_qwen2(dtype=torch.bfloat16):
    config = transformers.Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV, vocab_size=VOCAB)
    with torch.device("meta"):
        return transformers.Qwen2ForCausalLM(config).to(dtype)


def linear_shapes():
    """(out, in + bias) of the attributed Linear layers of one decoder layer, from the config."""
    head = HIDDEN // HEADS
    return [(HIDDEN, HIDDEN + 1), (KV * head, HIDDEN + 1), (KV * head, HIDDEN + 1), (HIDDEN, HIDDEN),   # q k v (bias), o
            (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]                                            # gate up down


# ---------------------------------------------------------------- exact speed-ups
def _split_by_search(k, out, n_in):
    """Every (a, b) with a ≤ out, b ≤ in, a·b ≤ k: most coordinates, then most even."""
    pairs = [(a, b) for a in range(1, min(k, out) + 1) for b in range(1, min(k, n_in) + 1) if a * b <= k]
    return max(pairs, key=lambda p: (p[0] * p[1], -abs(math.log(p[0]) - math.log(p[1])), -p[0]))


@pytest.mark.parametrize("k,out,n_in", [(256, 10, 100), (4096, 8192, 28672), (64, 3, 3), (1000, 37, 53),
                                        (4096, 1024, 8193)])
def test_cached_kronecker_split_is_the_best_split(k, out, n_in):
    a, b = ga.proj.kron(k=k).kron_shape(out, n_in)
    best = _split_by_search(k, out, n_in)
    assert a * b == best[0] * best[1] and abs(math.log(a) - math.log(b)) == abs(math.log(best[0]) - math.log(best[1]))
    assert projection._even_kron_split(k, out, n_in) == (a, b)


def _digest_three_walks(model):
    """The model digest as gradalg wrote it before: modules, then named_parameters, then
    named_buffers (three walks of the module tree)."""
    parts = []
    for name, m in model.named_modules():
        cls = fingerprint._unsharded_class(type(m))
        parts.append(f"{name}:{cls.__module__}.{cls.__qualname__}({m.extra_repr()})")
    for kind, named in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in named:
            parts.append(f"{kind}:{name}:{fingerprint.tensor_digest(t)}")
    return "model-" + fingerprint._h(*parts)


def test_model_digest_in_one_walk_equals_the_three_walk_digest():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                bos_token_id=0, eos_token_id=0))  # tied lm_head
    bn = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))   # buffers
    shared = torch.nn.Linear(4, 4)
    reused = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)                                       # a module twice
    for model in (gpt2, bn, reused):
        assert fingerprint.model_digest(model) == _digest_three_walks(model)


def test_gemms_of_one_shape_are_priced_once_with_their_total_count():
    prof = devices.PRESETS["h200"]
    gemms = ((64, 64, 64, 3, 2), (64, 64, 64, 5, 2), (128, 4, 512, 2, 4))
    cost = Cost(flops=sum(2.0 * m * n * k * c for m, n, k, c, _ in gemms), gemms=gemms)
    expected = sum(c * prof.gemm_seconds(m, n, k, e) for m, n, k, c, e in gemms)
    assert prof.time_of(cost) == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------- meta models: identity, no reads
def test_a_meta_model_is_equal_only_to_itself():
    """A meta model has no values: its fingerprint cannot say which weights it stands
    for, so it is named per object (equal to itself, never to another model, meta or
    real, of the same shapes)."""
    a, b = meta_qwen2(), meta_qwen2()
    real = transformers.Qwen2ForCausalLM(a.config).to(torch.bfloat16)
    digest = fingerprint.model_digest(a)
    assert fingerprint.model_digest(a) == digest
    assert fingerprint.model_digest(b) != digest
    assert fingerprint.model_digest(real) != digest
    assert ga.Task(a, lambda m, x: m(x).sum()).token != ga.Task(b, lambda m, x: m(x).sum()).token


def test_planning_a_meta_model_reads_no_weights_runs_no_forward_and_one_example_per_dataset(monkeypatch):
    model = meta_qwen2()

    def no_hash(t):
        raise AssertionError("a meta tensor was hashed")

    def no_forward(module, args):
        raise AssertionError("planning ran the model")

    monkeypatch.setattr(fingerprint, "_hash_tensor", no_hash)
    handle = model.register_forward_pre_hook(no_forward)
    train, queries = TokenShapes(1000, T), TokenShapes(8, T)
    task = ga.tasks.causal_lm(model, name="qwen2-tiny")
    for S in (ga.methods.logra(task, train, queries, layers=LINEARS, k=16),
              ga.methods.influence(task, train, queries, layers=LINEARS, curvature="ekfac"),
              ga.methods.trak(task, train, queries, layers=LINEARS, k=32)):
        str(S.explain(device="h200", gpus=(1, 2)))
    handle.remove()
    assert train.reads == 1 and queries.reads == 1      # the first example's shape, once
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


# ---------------------------------------------------------------- blocks and bytes of a small config
def test_meta_plan_has_every_linear_block_and_kfac_statistics_bytes_from_the_config():
    model = meta_qwen2()
    task = ga.tasks.causal_lm(model, name="qwen2-tiny")
    G = ga.grads(task, TokenShapes(1000, T), LINEARS)
    shapes = linear_shapes() * LAYERS
    assert len(G.space.blocks) == len(shapes) == 14
    assert [tuple(b.shape) for b in G.space.blocks] == shapes
    # float64 factors: the larger of their sums 8·(o² + i²) per block with one chunk's update
    # (12·w², w the widest factor), and finishing block by block: each block's sums or its
    # eigenbases (the same 8·(o² + i²) in float64), every block's two eigenvalue vectors
    # 8·(o + i) (K-FAC's Λ = λ_S λ_Aᵀ is never a grid), and the larger of one block's
    # covariance copies and the largest eigendecomposition's 24·w²
    sums = sum(8.0 * (o ** 2 + i ** 2) for o, i in shapes)
    widest = max(max(o, i) for o, i in shapes)
    finish = sums + sum(8.0 * (o + i) for o, i in shapes) + max(
        24.0 * widest ** 2, max(8.0 * (o ** 2 + i ** 2) for o, i in shapes))
    expected = max(sums + 12.0 * widest ** 2, finish)
    assert kron_bytes(G.space) == expected
    S = ga.methods.influence(task, TokenShapes(1000, T), TokenShapes(8, T), layers=LINEARS, curvature="ekfac")
    p = S.explain(device="h200").plan
    kfac_pass = next(p_ for p_ in p.passes if any(j.kind == "kfac" for j in p_.jobs))
    assert kfac_pass.fixed_bytes >= expected                   # the statistics are held during their pass
    # the queries' held rows: 8 flat bf16 gradients of every attributed coordinate
    held = next(p_ for p_ in p.passes if p_.label.startswith("pass over rows in memory") or
                any(j.kind == "scores" for j in p_.jobs))
    assert held.fixed_bytes >= 8 * sum(o * i for o, i in shapes) * 2


# ---------------------------------------------------------------- the scale model
def _plan(model, device="h200"):
    task = ga.tasks.causal_lm(model, name="qwen2-tiny")
    S = ga.methods.logra(task, TokenShapes(1000, T), TokenShapes(8, T), layers=LINEARS, k=16)
    return S.explain(device=device, gpus=(1, 2, 4), memory_budget=2**30).plan   # the budget of each GPU's plan


def test_scale_rows_are_the_stated_sum():
    model = meta_qwen2()
    plan = _plan(model)
    W = sum(p.numel() * 2 for p in model.parameters())                      # bfloat16
    U = sum(p.numel() * 2 for p in model.model.layers[0].parameters())     # one decoder layer
    assert model_bytes(model) == W and fsdp_unit_bytes(model) == U
    rows = scale_estimates(plan, (1, 2, 4), "h200")
    for r in rows:
        g = r["gpus"]
        assert r["weights"] == W / g
        assert r["gathered"] == min(2 * U, W - W / g)
        assert r["memory_per_gpu"] == pytest.approx(r["weights"] + r["gathered"] + r["held"]
                                                     + r["batch_per_gpu"] * r["per_example"])
        assert r["fits"] and r["memory_per_gpu"] <= devices.PRESETS["h200"].memory
    one, two, four = (r["seconds"] for r in rows)
    assert one > two > four > 0
    # no link, no communication: the compute splits exactly over the GPUs
    quiet = replace(devices.PRESETS["h200"], link_bandwidth=0.0)
    t1, t4 = (r["seconds"] for r in scale_estimates(plan, (1, 4), quiet))
    assert t4 == pytest.approx(t1 / 4, rel=1e-9)


def test_a_configuration_that_does_not_fit_is_refused_with_the_arithmetic():
    model = meta_qwen2()
    W, U = model_bytes(model), fsdp_unit_bytes(model)
    plan = _plan(model)
    worst = max(plan.passes, key=lambda p: p.fixed_bytes + p.per_example_bytes)
    # a GPU with room for 1/8 of the weights, two unsharded layers and one example, not more
    memory = W / 8 + min(2 * U, W - W / 8) + worst.fixed_bytes + worst.per_example_bytes + 1
    assert memory < W + worst.fixed_bytes + worst.per_example_bytes
    small = replace(devices.PRESETS["h200"], name="small GPU", memory=memory)
    row = scale_estimates(plan, (1,), small)[0]
    assert not row["fits"] and "weights / 1" in row["why"] and "> " in row["why"]
    with pytest.raises(ga.errors.MemoryBudgetError, match=r"each GPU of 1 × small GPU needs .*its share of the "
                                                          r"weights \(W / 1\) .*over the memory of one small GPU") as info:
        check_fits(plan, 1, small)
    err = info.value      # the numbers are fields: what one GPU needs, and its memory
    assert (err.subject, err.needed, err.budget, err.fits_under) == ("each GPU of 1 × small GPU",
                                                                     row["memory_per_gpu"], memory, None)
    assert err.needed == pytest.approx(sum(n for _, n in err.parts)) and err.needed > err.budget
    task = ga.tasks.causal_lm(model, name="qwen2-tiny")
    S = ga.methods.logra(task, TokenShapes(1000, T), TokenShapes(8, T), layers=LINEARS, k=16)
    with pytest.raises(ga.errors.MemoryBudgetError, match="weights \\(W / 1\\)"):
        S.explain(device=small, n_devices=1, memory_budget=2**30)
    # eight of them hold an eighth of the weights each: it fits, and only that count is shown
    e = S.explain(device=devices.profile(small, count=8), memory_budget=2**30)
    assert [r["gpus"] for r in e.to_dict()["scale"]] == [8] and e.scale()[0]["fits"], e.scale()[0]["why"]
    assert e.scale()[0]["batch_per_gpu"] == 1 and "8 GPU(s)" in str(e)
    # a table of several counts shows the arithmetic of those that do not fit, text and HTML
    table = S.explain(device=small, gpus=(1, 8), memory_budget=2**30)
    assert [r["fits"] for r in table.scale()] == [False, True]
    assert "(does not fit)" in str(table) and "weights / 1" in str(table) and "weights / 1" in table._repr_html_()


def test_device_profile_counts():
    four = devices.profile("h200", count=4)
    assert four.count == 4 and four.memory == devices.PRESETS["h200"].memory
    assert devices.profile("h200") is devices.PRESETS["h200"]
    with pytest.raises(ValueError, match="count"):
        devices.profile("h200", count=0)
