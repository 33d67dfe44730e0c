"""The planner: cost formulas, device profiles, the rule registry, hand-built expected
plans, kernel routing proven by a wrapped kernel, differential tests (optimized plan =
rewrites disabled = dense reference), the memory budget, explain, the plan explorer,
and planning a 7B-parameter model on PyTorch's meta device without allocating it."""
from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import time
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

import gradalg as ga
from gradalg.plan.jobs import scores as score_jobs
from gradalg.expr import Damp, Identity, Inner, Normalize, Project, ScoreSum, SumOp
from gradalg.plan import cost as C
from gradalg.plan import shapes as S
from gradalg import devices
from gradalg.devices import accelerators, lookup, measure
from gradalg.plan import DecisionKind, rules
from gradalg.plan.explain import Explain
from gradalg.plan.planner import PlanError, plan
from gradalg.plan.rules import simplify_until_fixpoint
from gradalg.testing import assert_close
from gradalg.testing.conformance import project_dense

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from references import block_rows, reference_rows  # noqa: E402

F64 = torch.float64
TOL = dict(rtol=1e-7, atol=1e-9)
MLP_LAYERS = ("0", "2")


# ------------------------------------------------------------------------------ setups
@functools.cache
def mlp_setup():
    model = models.mlp()
    task = ga.tasks.classification(model)
    x, y = models.classification_data(20, seed=1)
    xq, yq = models.classification_data(4, seed=2)
    return dict(model=model, task=task, train=TensorDataset(x, y), query=TensorDataset(xq, yq),
                R=reference_rows(task, (x, y), MLP_LAYERS), RQ=reference_rows(task, (xq, yq), MLP_LAYERS),
                batch=(x, y), qbatch=(xq, yq))


@functools.cache
def gpt2_setup(min_len=3, max_len=9):
    model = models.gpt2()
    task = models.lm_task(model)
    train = models.padded_token_data(n=6, min_len=min_len, max_len=max_len, seed=3)
    query = models.padded_token_data(n=2, min_len=min_len, max_len=max_len, seed=5)
    layers = ga.grads(task, train, ["transformer.h.*"]).layers
    return dict(model=model, task=task, train=train, query=query, layers=layers,
                R=loop_rows(task, train, layers), RQ=loop_rows(task, query, layers))


def loop_rows(task, batch, layers):
    """Dense reference rows, one example at a time (padded batches defeat vmap)."""
    modules = dict(task.model.named_modules())
    names = [f"{layer}.{p}" for layer in layers for p, _ in modules[layer].named_parameters(recurse=False)]
    return block_rows(task.model, layers, ga.per_example_grads(task, batch, names, method="loop"))


def values(x) -> torch.Tensor:
    """Numbers of a computed DataArray (or a tensor, as it is)."""
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x.values)


class Counting:
    """Counts the model's forward calls and the examples they saw (reads of the data)."""

    def __init__(self, model):
        self.model, self.calls, self.examples, self.batch_sizes = model, 0, 0, []

    def __enter__(self):
        def hook(module, args, kwargs, output):
            first = args[0] if args else next(iter(kwargs.values()))
            if first.device.type == "meta":   # the planner's shape probe: no data, no numbers
                return
            self.calls += 1
            self.examples += first.shape[0]
            self.batch_sizes.append(first.shape[0])
        self.handle = self.model.register_forward_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def passes_of(p):
    """A plan as plain data: per pass (what it reads, sorted (job kind, target token))."""
    out = []
    for q in p.passes:
        reads = ("data", q.key.data_token) if q.reads_data else (q.key.kind, q.key.rows)
        out.append((reads, sorted((j.kind, j.target.token) for j in q.jobs)))
    return out


# ====================================================================== cost formulas
def test_kernel_flop_formulas_exact():
    # nL=2, nR=3, TL=4, TR=5, in=6, out=7
    g = C.ghost_cost(2, 3, 4, 5, 6, 7)
    assert g.flops == 2.0 * 2 * 3 * 4 * 5 * (6 + 7 + 1) == 3360
    # the two Grams are GEMMs over flattened positions; the (nL, nR, TL, TR) product is traffic
    assert g.gemms == ((8, 15, 6, 1, 4), (8, 15, 7, 1, 4)) and g.bytes == 3 * 4 * 120
    # materialize L (2·4·42) + R (3·5·42) + GEMM (2·3·42) multiply-adds, 2 FLOPs each
    d = C.dense_cost(2, 3, 4, 5, 6, 7, left_ready=False)
    assert d.flops == 2436.0 and d.bytes == 4.0 * 3 * 42
    assert d.gemms == ((2, 3, 42, 1, 4),)
    assert d.bmms == ((3, 7, 6, 5, 1, 4), (2, 7, 6, 4, 1, 4))   # per-example (out, in, T) GEMMs, one batched call a side
    assert C.dense_cost(2, 3, 4, 5, 6, 7).flops == 2.0 * (630 + 252) == 1764
    assert C.kron_project_cost(3, 5, 6, 7, 2, 3).flops == 2.0 * 3 * 5 * (6 * 2 + 7 * 3) == 990
    assert C.kron_project_cost(3, 5, 6, 7, 2, 3).gemms == ((15, 2, 6, 1, 4), (15, 3, 7, 1, 4))
    f = C.fisher_cost(5, [3, 4], "dense")
    assert (f.flops, f.peak_bytes, f.gemms, f.bytes) == (490.0, 392.0, ((7, 7, 5, 1, 8),), 12.0 * 5 * 7)
    f = C.fisher_cost(5, [3, 4], "block")
    assert (f.flops, f.peak_bytes, f.gemms) == (250.0, 200.0, ((3, 3, 5, 1, 8), (4, 4, 5, 1, 8)))
    assert C.fisher_cost(5, [3, 4], "diag").flops == 70.0 and C.fisher_cost(5, [3, 4], "diag").peak_bytes == 56.0
    assert C.eigh_cost(10) == C.Cost(flops=9000.0, peak_bytes=1600.0, eighs=((10, 1),))
    # the blocked symmetric Gram: one GEMM per 128-column block row, upper triangle only
    assert C.gram_cost(50, 100).gemms == ((100, 100, 50, 1, 4),)
    assert C.gram_cost(50, 300).gemms == ((128, 300, 50, 1, 4), (128, 172, 50, 1, 4), (44, 44, 50, 1, 4))
    assert C.materialize_cost(3, 5, 6, 7) == C.Cost(flops=2.0 * 3 * 5 * 42, bytes=4.0 * 3 * 42,
                                                    bmms=((3, 7, 6, 5, 1, 4),))


def test_cost_algebra():
    a, b = C.Cost(1, 2, 30, 1), C.Cost(10, 20, 5, 2)
    assert a + b == C.Cost(11, 22, 30, 3)                  # peaks do not add, passes do
    assert b.scaled(3) == C.Cost(30, 60, 5, 6)
    g = C.gemm_cost(4, 5, 6, count=2)
    assert (g + g).gemms == ((4, 5, 6, 2, 4), (4, 5, 6, 2, 4)) and g.scaled(0.5).gemms == ((4, 5, 6, 1.0, 4),)
    prof = devices.DeviceProfile("toy", 1e9, 4e9, 1e10, 1e9)
    assert C.Cost(flops=2e9, bytes=1e10).seconds(prof) == pytest.approx(3.0)
    assert C.Cost(flops=4e9).seconds(prof, torch.bfloat16) == pytest.approx(1.0)
    assert "FLOP" in a.describe() and "pass" in a.describe()


def test_device_profile_prices_gemms_by_shape_and_fixed_costs():
    """Small GEMMs at the rate measured for their size (log-log between sizes), never
    faster than moving their matrices; eigh by size; fixed costs per call, op, batch."""
    prof = devices.DeviceProfile("toy", 1e10, 1e10, 1e9, 1e9, gemm_rates=((16, 1e8), (256, 1e10)),
                                 eigh_times=((10, 1e-3), (100, 1.0)), call_seconds=1e-5, op_seconds=1e-6,
                                 batch_seconds=1e-3, layer_seconds=1e-4)
    assert prof.gemm_seconds(256, 256, 256) == pytest.approx(2 * 256 ** 3 / 1e10)
    assert prof.gemm_seconds(16, 16, 16) == pytest.approx(2 * 16 ** 3 / 1e8)
    assert prof.gemm_seconds(64, 64, 64) == pytest.approx(2 * 64 ** 3 / 1e9)       # halfway in log-log
    assert prof.gemm_seconds(4, 4, 4) == pytest.approx(2 * 4 ** 3 / (1e8 / 4))      # rate ∝ size below the table
    assert prof.gemm_seconds(1000, 1000, 1) == pytest.approx(4 * (1000 + 1000 + 1e6) / 1e9)  # outer product: traffic
    assert prof.gemm_seconds(256, 256, 256, elem=8) == pytest.approx(2 * 2 * 256 ** 3 / 1e10)
    assert prof.eigh_seconds(100) == pytest.approx(1.0) and prof.eigh_seconds(200) == pytest.approx(8.0)
    assert prof.eigh_seconds(math.sqrt(1000)) == pytest.approx(math.sqrt(1e-3 * 1.0), rel=1e-6)
    c = C.Cost(ops=10, calls=3, batches=2, layer_batches=4) + C.gemm_cost(16, 16, 16, 5) + C.eigh_cost(10, 2)
    assert c.seconds(prof) == pytest.approx(10e-6 + 3e-5 + 2e-3 + 4e-4 + 5 * 2 * 16 ** 3 / 1e8 + 2e-3)
    # FLOPs not in a shaped term run at the profile's large-GEMM rate
    assert (c + C.Cost(flops=1e10)).seconds(prof) == pytest.approx(c.seconds(prof) + 1.0)


def test_block_fixed_costs_are_priced_at_the_measured_seconds_per_block_of_their_kind():
    """A block of gradalg's per-block work costs the profile's measured seconds for its
    kind (``block_seconds``), else its small ops at ``op_seconds``; counts scale per chunk;
    a measured profile has every kind the estimates use."""
    b = C.block_cost("ekfac", 3, ops=10) + C.block_cost("resolve", 2)
    assert b.blocks == (("ekfac", 3.0, 10.0), ("resolve", 2.0, 0.0)) and b.scaled(4).blocks[0] == ("ekfac", 12.0, 10.0)
    assert C.block_cost("ekfac", 0, 10) == C.Cost()
    plain = devices.DeviceProfile("toy", 1e10, 1e10, 1e9, 1e9, op_seconds=1e-6)
    assert b.seconds(plain) == pytest.approx(3 * 10 * 1e-6)           # unmeasured: ops, and nothing for resolve
    timed = replace(plain, block_seconds=(("ekfac", 4e-5), ("resolve", 2e-5)))
    assert b.seconds(timed) == pytest.approx(3 * 4e-5 + 2 * 2e-5)
    assert devices.DeviceProfile.from_json(timed.to_json()) == timed
    measured = dict(measure._measure_blocks())
    assert set(measured) == {"ekfac", "kfac", "scores", "ghost", "precondition", "resolve"}
    assert all(0 < s < 0.05 for s in measured.values())


def test_batched_gemms_are_priced_by_their_total_size_plus_one_call():
    """b products in one call: op_seconds plus b·2mnk FLOPs at the batched rate of
    their size (the single-GEMM rate where faster), not b single calls; without batched
    rates (presets), b single GEMMs."""
    single = ((16, 1e8), (256, 1e10))
    prof = devices.DeviceProfile("toy", 1e10, 1e10, 1e11, 1e9, gemm_rates=single, op_seconds=1e-6,
                                 elementwise_bandwidth=1e8, bmm_rates=((4, 1e8), (16, 4e9), (64, 5e9)))
    assert prof.bmm_seconds(100, 16, 16, 16) == pytest.approx(1e-6 + 100 * 2 * 16 ** 3 / 4e9)
    assert prof.bmm_seconds(100, 8, 8, 8) == pytest.approx(1e-6 + 100 * 2 * 8 ** 3 / (1e8 * 4e9) ** 0.5)  # log-log
    assert prof.bmm_seconds(10, 1, 1, 8) == pytest.approx(1e-6 + 10 * 2 * 8 / 5e7)            # ∝ size (2) below
    # above the largest batched size the single-GEMM rate takes over once it is faster
    assert prof.bmm_seconds(3, 256, 256, 256) == pytest.approx(1e-6 + 3 * 2 * 256 ** 3 / 1e10)
    assert prof.bmm_seconds(3, 100, 100, 100) == pytest.approx(1e-6 + 3 * 2 * 100 ** 3 / 5e9)
    # a batch of outer products (k = 1) moves its matrices at the elementwise rate: traffic
    assert prof.bmm_seconds(50, 100, 100, 1) == pytest.approx(1e-6 + 50 * 4 * (100 + 100 + 1e4) / 1e8)
    # a Cost's batched GEMMs: count calls each; equal shapes summed, scaled per chunk
    b = C.bmm_cost(100, 16, 16, 16, count=3)
    assert b.flops == 3 * 100 * 2.0 * 16 ** 3 and b.gemms == () and b.bmms == ((100, 16, 16, 16, 3, 4),)
    assert (b + b).bmms == ((100, 16, 16, 16, 3, 4),) * 2 and b.scaled(2).bmms == ((100, 16, 16, 16, 6, 4),)
    assert (b + b).seconds(prof) == pytest.approx(6 * prof.bmm_seconds(100, 16, 16, 16))
    assert C.bmm_cost(1, 4, 5, 6, 2) == C.gemm_cost(4, 5, 6, 2)           # a batch of one: a plain GEMM
    assert C.bmm_cost(0, 4, 5, 6) == C.Cost()
    # the same products as 100 separate calls, each at the single-call rate of its size: 25× slower
    assert C.gemm_cost(16, 16, 16, 300).seconds(prof) == pytest.approx(300 * 2 * 16 ** 3 / 1e8)
    plain = devices.DeviceProfile("preset-like", 1e10, 1e10, 1e9, 1e9, gemm_rates=single, op_seconds=1e-6)
    assert plain.bmm_seconds(100, 16, 16, 16) == pytest.approx(100 * plain.gemm_seconds(16, 16, 16))
    assert devices.DeviceProfile.from_json(prof.to_json()) == prof        # rates read back as tuples
    # a measured call (an einsum's parsing) replaces op_seconds as the call's fixed cost
    einsum = replace(prof, bmm_call_seconds=1.5e-5)
    assert einsum.bmm_seconds(100, 16, 16, 16) == pytest.approx(prof.bmm_seconds(100, 16, 16, 16) - 1e-6 + 1.5e-5)


def test_model_shapes_exact():
    mlp = models.mlp()   # Linear(8, 16), Linear(16, 3)
    assert S.weight_layers(mlp) == [(8, 16), (16, 3)]
    assert S.activation_bytes(mlp, 1) == 4.0 * ((16 + 8) + (3 + 16))
    # the loss's copies of the output: OUTPUT_COPIES × the last Linear's width (the head) × T
    assert S.output_bytes(mlp, 5) == S.OUTPUT_COPIES * 3 * 5 * 4.0
    assert S.output_bytes(models.gpt2(), 9, 2) == S.OUTPUT_COPIES * 101 * 9 * 2.0   # lm_head 101×64
    gpt = models.gpt2()  # 2 layers, width 64, untied lm_head 101×64, 4 Conv1D per layer (weights (in, out))
    assert S.weight_layers(gpt) == [(64, 192), (64, 64), (64, 256), (256, 64)] * 2 + [(64, 101)]
    assert S.attention_shape(gpt) == (2, 64, 4)


def test_tokens_hint():
    s = mlp_setup()
    assert C.tokens_hint(ga.grads(s["task"], s["train"]).expr) == 1
    g = gpt2_setup()
    assert C.tokens_hint(ga.grads(g["task"], g["train"], g["layers"]).expr) == 9


# ====================================================================== device profiles
def test_device_profile_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADALG_CACHE", str(tmp_path))
    fake = devices.DeviceProfile("fake cpu", 1e9, 2e9, 1e10, 8e9, measured=True)
    calls = []
    monkeypatch.setattr(measure, "measure_cpu", lambda: calls.append(1) or fake)
    first = devices.local_profile()
    second = devices.local_profile()
    assert first == second == fake
    assert calls == [1], "the second call must read the cache, not measure again"
    cached = json.loads((tmp_path / "devices.json").read_text())
    entry = next(iter(cached.values()))
    assert entry["version"] == devices.PROFILE_VERSION and entry["flops_fp32"] == 1e9 and entry["call_seconds"] == 2e-5
    assert devices.DeviceProfile.from_json(entry) == fake
    # a cache written by an older cost model (no version, fewer numbers) is measured again
    key = next(iter(cached))
    (tmp_path / "devices.json").write_text(json.dumps({key: {k: v for k, v in cached[key].items()
                                                              if k != "version"}}))
    assert devices.cached_local_profile() is devices.UNMEASURED_CPU   # displays never measure
    assert devices.local_profile() == fake and calls == [1, 1]
    del calls[1:]
    assert devices.profile("cpu") == fake and devices.profile() == fake
    assert len(calls) == 1
    devices.local_profile(refresh=True)
    assert len(calls) == 2


def test_device_profile_real_measurement_and_presets(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADALG_CACHE", str(tmp_path / "nested"))
    start = time.perf_counter()
    prof = devices.local_profile()
    took = time.perf_counter() - start
    assert prof.measured and prof.flops_fp32 > 1e7 and prof.bandwidth > 1e7 and prof.memory > 0
    assert took < 30, f"measuring the profile took {took:.1f} s (about 2 s on an idle core)"
    sizes = [s for s, _ in prof.gemm_rates]
    assert sizes == list(measure.GEMM_SIZES) and [d for d, _ in prof.eigh_times] == list(measure.EIGH_SIZES)
    assert [s for s, _ in prof.bmm_rates] == list(measure.BMM_SIZES) and all(r > 0 for _, r in prof.bmm_rates)
    assert prof.bmm_call_seconds > 0
    assert all(t > 0 for _, t in prof.eigh_times) and prof.batch_seconds > 0 and prof.op_seconds > 0
    assert (tmp_path / "nested" / "devices.json").is_file()
    assert devices.local_profile() == prof        # read back from the cache, tuples and all
    assert devices.profile("H100") is devices.PRESETS["h100"]
    assert devices.profile(prof) is prof
    h = devices.PRESETS["h200"]
    assert h.flops(torch.bfloat16) > h.flops(torch.float32) > h.flops(torch.float64)
    with pytest.raises(ValueError, match="unknown device"):
        devices.profile("tpu-v9")



class _FakeProps:
    total_memory = 80 * 10**9


def _fake_cuda(monkeypatch, name="NVIDIA H100 80GB HBM3"):
    """A CUDA device that is not there: its name, memory and free memory, faked."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: _FakeProps())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (50 * 10**9, 80 * 10**9))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_model_device_is_where_its_parameters_are():
    from gradalg.plan.planner import model_device
    s = mlp_setup()
    G = ga.grads(s["task"], s["train"])
    assert model_device(G.expr) == torch.device("cpu")
    with torch.device("meta"):
        meta = models.mlp()
    assert model_device(ga.grads(ga.tasks.classification(meta), s["train"]).expr) is None   # planned as the CPU


def test_a_cuda_model_is_planned_with_a_measured_cuda_profile(tmp_path, monkeypatch):
    """A model on CUDA: its device's profile, measured once when a run is planned and
    cached; its budget a fraction of the device's free memory (the GPU is faked)."""
    from gradalg.plan import planner
    monkeypatch.setenv("GRADALG_CACHE", str(tmp_path))
    _fake_cuda(monkeypatch)
    fake = replace(devices.PRESETS["h100"], name="NVIDIA H100 80GB HBM3 (cuda:0, measured)", measured=True,
                   flops_fp32=5e13)
    calls = []
    monkeypatch.setattr(measure, "measure_profile", lambda device: calls.append(device) or fake)
    monkeypatch.setattr(planner, "model_device", lambda root: torch.device("cuda", 0))
    s = mlp_setup()
    S = ga.grads(s["task"], s["query"]) @ ga.grads(s["task"], s["train"]).T
    shown = plan(S.expr)                         # a display measures nothing: the nominal profile
    assert not calls and not shown.device.measured
    assert "nominal H100 spec sheet" in shown.device.name and "not measured" in shown.device.name
    ran = plan(S.expr, measure_shapes=True)      # an executor about to run measures the device once
    assert calls == [torch.device("cuda", 0)] and ran.device == fake
    assert plan(S.expr, measure_shapes=True).device == fake and len(calls) == 1     # cached
    e = S.explain()
    assert "device NVIDIA H100 80GB HBM3 (cuda:0, measured)" in str(e)
    assert e.to_dict()["device_measured"] is True
    with ga.options(memory_budget=None):
        p = plan(S.expr)
    assert p.options.memory_budget == 25 * 10**9
    assert p.budget.describe() == ("25 GB = 0.5 × 50 GB available (free memory of cuda:0 "
                                   "(torch.cuda.mem_get_info); memory_fraction)")
    assert devices.profile("cuda:0") == fake and devices.profile(torch.device("cuda", 0)) == fake
    with pytest.raises(ValueError, match="unknown device"):
        devices.profile("cuda:x")


@pytest.mark.parametrize("name,preset", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                         ("NVIDIA A100-SXM4-80GB", "a100"), ("Tesla T4", "a100")])
def test_a_cuda_model_gets_a_nominal_profile_when_measuring_fails_or_is_off(tmp_path, monkeypatch, name, preset):
    from gradalg.plan import planner
    monkeypatch.setenv("GRADALG_CACHE", str(tmp_path))
    monkeypatch.setattr(accelerators, "_FAILED", {})
    _fake_cuda(monkeypatch, name)
    monkeypatch.setattr(planner, "model_device", lambda root: torch.device("cuda", 0))

    def broken(device):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(measure, "measure_profile", broken)
    s = mlp_setup()
    S = ga.grads(s["task"], s["query"]) @ ga.grads(s["task"], s["train"]).T
    p = plan(S.expr, measure_shapes=True)
    nominal = devices.PRESETS[preset]
    assert not p.device.measured and p.device.flops_fp32 == nominal.flops_fp32
    assert p.device.memory == _FakeProps.total_memory * devices.nominal._MEM_EFF       # the device's own memory
    assert f"nominal {nominal.name} spec sheet" in p.device.name and "measuring failed" in p.device.name
    assert ("not a preset" in p.device.name) == (name == "Tesla T4")
    assert f"nominal {nominal.name} spec sheet" in str(S.explain())     # explain() names the profile
    assert plan(S.expr, measure_shapes=True).device == p.device          # a failure is not retried
    monkeypatch.setattr(measure, "measure_profile", lambda device: pytest.fail("measured while switched off"))
    with ga.options(measure_devices=False):
        off = plan(S.expr, measure_shapes=True)
    assert not off.device.measured and "measure_devices=False" in off.device.name
    # planning for hardware one does not have still works, budget and all
    e = S.explain(device="h200")
    assert e.plan.device is devices.PRESETS["h200"]
    assert "(device_memory_fraction)" in str(e)


def test_measure_profile_on_a_torch_device(tmp_path, monkeypatch):
    """The accelerator measurement, run on the CPU with small sizes (no GPU here): every
    number of the profile is measured and positive."""
    monkeypatch.setenv("GRADALG_CACHE", str(tmp_path))
    prof = measure.measure_profile(torch.device("cpu"), gemm_sizes=(16, 32), bmm_sizes=(4, 8),
                                        eigh_sizes=(8, 16), copy_bytes=2**20, batch_elements=2**12,
                                        seconds=0.005)
    assert prof.measured and "measured" in prof.name
    assert [n for n, _ in prof.gemm_rates] == [16, 32] and [n for n, _ in prof.bmm_rates] == [4, 8]
    assert [d for d, _ in prof.eigh_times] == [8, 16]
    for value in (prof.flops_fp32, prof.flops_bf16, prof.bandwidth, prof.elementwise_bandwidth, prof.call_seconds,
                  prof.op_seconds, prof.batch_seconds, prof.layer_seconds, prof.bmm_call_seconds, prof.memory,
                  *prof.product_seconds, prof.product_work, prof.ts_bytes_per_bin, *prof.ts_flat_bytes):
        assert value > 0
    assert devices.DeviceProfile.from_json(json.loads(json.dumps(prof.to_json()))) == prof

# ====================================================================== the rule registry
def _rule_examples():
    s = mlp_setup()
    task, train = s["task"], s["train"]
    G, Q = ga.grads(task, train), ga.grads(task, s["query"])
    Fi = ga.fisher(G)
    P = ga.proj.kron(4, seed=0)
    S = Q @ G.T
    H = Fi.damp(1.0).inv()
    return {  # rule -> (expression, the simplified node expected)
        "absorb_precondition": ((Q @ H) @ G.T, Inner(Q.expr, H.expr, G.expr)),
        "identity_precondition": (Q @ ga.identity(Q), Q.expr),
        "zero_damping": (Fi.damp(0.0), Fi.expr),
        "merge_damping": (Fi.damp(1.0).damp(2.0), Damp(Fi.expr, 3.0)),
        "unit_scale": (Fi * 1.0, Fi.expr),
        "double_inverse": (H.inv(), Damp(Fi.expr, 1.0)),
        "inverse_identity": (ga.identity(G).inv(), Identity(G.space)),
        "flatten_operator_sums": ((Fi + Fi.damp(1.0)) + Fi.damp(2.0),
                                  SumOp((Fi.expr, Damp(Fi.expr, 1.0), Damp(Fi.expr, 2.0)))),
        "flatten_score_sums": ((S + S) + S, ScoreSum((S.expr,) * 3, (1.0, 1.0, 1.0))),
        "double_normalize": (G.normalize().normalize(), Normalize(G.expr)),
        "full_rank_approximation": (Q.low_rank(9), Q.expr),     # blocks 16×9 and 3×17: nothing to truncate
        "select_everything": (G.select(["0", "2"]), G.expr),
        "select_into_source": (G.select(["2"]), ga.grads(task, train, ["2"]).expr),
        "select_before_project": (P(G).select(["2"]), Project(ga.grads(task, train, ["2"]).expr, P)),
    }


def test_registry_is_named_documented_and_ordered():
    names = [r.name for r in rules.RULES]
    assert len(names) == len(set(names))
    assert all(r.doc and r.types for r in rules.RULES)
    assert [r.priority for r in rules.RULES] == sorted(r.priority for r in rules.RULES)


@pytest.mark.parametrize("name", [r.name for r in rules.RULES])
def test_each_rule_fires_on_a_minimal_example(name):
    examples = _rule_examples()
    assert name in examples, f"rule {name!r} has no minimal example here: add one to _rule_examples"
    expr, expected = examples[name]
    out, fired = simplify_until_fixpoint(expr.expr)
    assert name in [f.rule for f in fired]
    firing = next(f for f in fired if f.rule == name)
    assert firing.before and firing.after and firing.why
    assert out == expected, f"{name}: {out.label} != {expected.label}"
    # the plan records it, and rewrites=False records nothing
    assert name in [f.rule for f in plan(expr.expr).fired]
    assert plan(expr.expr, rewrites=False).fired == []


def test_rules_preserve_values():
    """Every rewritten expression in the examples computes what the original does."""
    examples = _rule_examples()
    for name in ("absorb_precondition", "merge_damping", "double_inverse", "flatten_score_sums"):
        expr = examples[name][0]
        on = expr.compute() if hasattr(expr, "compute") else expr.to_dense()
        ex = ga.LocalExecutor(rewrites=False)
        off = expr.compute(ex) if hasattr(expr, "compute") else expr.to_dense(ex)
        assert_close(values(on), values(off), what=name, **TOL)


def test_non_converging_rewrites_raise():
    Fi = ga.fisher(ga.grads(mlp_setup()["task"], mlp_setup()["train"]))
    expr = Fi.damp(1.0).expr

    @rules.rule("flip_flop_for_test", [Damp], priority=0)
    def flip_flop(node):
        """λ = 1 ↔ λ = 2 forever."""
        return Damp(node.op, 2.0 if node.damping == 1.0 else 1.0)

    try:
        with pytest.raises(PlanError, match="did not converge") as info:
            simplify_until_fixpoint(expr, max_rounds=7)
        assert "flip_flop_for_test" in str(info.value) and "rewrites=False" in str(info.value)
        with pytest.raises(PlanError):
            plan(expr)
        assert plan(expr, rewrites=False).simplified == expr   # the way out the error names
    finally:
        rules.RULES[:] = [r for r in rules.RULES if r.name != "flip_flop_for_test"]
    assert "flip_flop_for_test" not in [r.name for r in rules.RULES]
    assert plan(expr).fired == []


# ====================================================================== hand-built plans
def big_mlp_data(n=200, seed=7):
    x, y = models.classification_data(n, seed=seed)
    return TensorDataset(x, y)


def test_grad_dot_plan_is_one_query_pass_then_one_scoring_pass():
    s = mlp_setup()
    G, Q = ga.grads(s["task"], s["train"]), ga.grads(s["task"], s["query"])
    S = Q @ G.T
    p = plan(S.expr)
    assert passes_of(p) == [
        (("data", Q.expr.data.token), [("collect", Q.expr.token)]),
        (("data", G.expr.data.token), [("scores", S.expr.token)]),
    ]
    scores = p.passes[1].jobs[0]
    assert scores.held == Q.expr and scores.streams == (G.expr,) and not scores.transposed
    assert p.decisions.one(DecisionKind.HELD_SIDE).chosen.startswith("left")
    assert p.data_passes == 2 and p.stored == set() and p.fired == []
    # T = 1: ghost products are cheaper than materializing, for every block
    for name in MLP_LAYERS:
        d = p.decisions.one(DecisionKind.KERNEL, block=name)
        assert d.chosen == "ghost" and d.alternatives["ghost"] < d.alternatives["dense"]
    assert p.passes[1].batch_size == min(ga.get_options().batch_size, G.expr.data.n)   # its largest real batch
    assert p.total.passes == 2


def test_smaller_side_is_held_and_scores_transposed():
    s = mlp_setup()
    G, Q = ga.grads(s["task"], s["query"]), ga.grads(s["task"], s["train"])   # 20 queries, 4 train
    S = Q @ G.T
    p = plan(S.expr)
    assert passes_of(p) == [
        (("data", G.expr.data.token), [("collect", G.expr.token)]),
        (("data", Q.expr.data.token), [("scores", S.expr.token)]),
    ]
    assert p.passes[1].jobs[0].transposed and p.decisions.one(DecisionKind.HELD_SIDE).chosen.startswith("right")
    assert_close(values(S.compute()), s["R"] @ s["RQ"].T, what="transposed", **TOL)


def projected_influence(task, train, query, k=4, damping=1e-3):
    P = ga.proj.kron(k, seed=0)
    G, Q = P(ga.grads(task, train)), P(ga.grads(task, query))
    return Q @ ga.fisher(G).damp(damping).inv() @ G.T, G, Q


def test_influence_stores_projected_rows_in_the_fisher_pass():
    s = mlp_setup()
    train = big_mlp_data()
    S, G, Q = projected_influence(s["task"], train, s["query"])
    p = plan(S.expr)
    inner = p.simplified
    fisher_node = inner.op.op.op
    assert isinstance(inner, Inner) and inner.left == Q.expr and inner.right == G.expr
    assert passes_of(p) == [
        (("data", Q.expr.source.data.token), [("collect", Q.expr.token)]),
        (("data", G.expr.source.data.token), sorted([("fisher", fisher_node.token), ("store", G.expr.token)])),
        (("memory", G.expr.token), [("scores", inner.token)]),
    ]
    assert p.stored == {G.expr.token} and p.data_passes == 2
    assert p.decisions.one(DecisionKind.STORE, subject=G.expr.token).chosen == "store"
    assert [f.rule for f in p.fired] == ["absorb_precondition"]


def test_tiny_budget_recomputes_with_a_second_data_pass():
    s = mlp_setup()
    train = big_mlp_data()
    S, G, Q = projected_influence(s["task"], train, s["query"])
    rows_bytes = G.n * G.space.dim * 4
    with ga.options(memory_budget=3 * rows_bytes, check_reduction=False):   # a quarter of it is too small
        p = plan(S.expr)
        inner = p.simplified
        assert passes_of(p) == [
            (("data", Q.expr.source.data.token), [("collect", Q.expr.token)]),
            (("data", G.expr.source.data.token), [("fisher", inner.op.op.op.token)]),
            (("data", G.expr.source.data.token), [("scores", inner.token)]),
        ]
        assert p.stored == set() and p.data_passes == 3
        d = p.decisions.one(DecisionKind.STORE)
        assert d.chosen == "recompute" and set(d.alternatives) == {"store", "recompute"}
        assert p.peak_bytes <= 3 * rows_bytes
        with Counting(s["model"]) as recompute:
            low = S.compute()
    with ga.options(check_reduction=False), Counting(s["model"]) as stored:
        high = S.compute()
    # the data is read once per pass: the training set twice when recomputing, once when stored
    assert stored.examples == Q.n + G.n and recompute.examples == Q.n + 2 * G.n
    assert_close(values(low), values(high), what="store vs recompute", **TOL)


def test_two_sources_over_the_same_data_share_one_pass():
    s = mlp_setup()
    task, train, query = s["task"], s["train"], s["query"]
    G, Q = ga.grads(task, train), ga.grads(task, query)
    Go, Qo = ga.grads(task, train, objective="output"), ga.grads(task, query, objective="output")
    S = Q @ G.T + Qo @ Go.T
    p = plan(S.expr)
    t1, t2 = S.expr.terms
    assert passes_of(p) == [
        (("data", Q.expr.data.token), sorted([("collect", Q.expr.token), ("collect", Qo.expr.token)])),
        (("data", G.expr.data.token), sorted([("scores", t1.token), ("scores", t2.token)])),
    ]
    with ga.options(check_reduction=False), Counting(s["model"][0]) as seen:
        got = S.compute()
    # one pass per dataset; the two objectives share each batch's forward
    assert seen.examples == Q.n + G.n
    with ga.options(check_reduction=False, share_forward=False), Counting(s["model"][0]) as apart:
        separate = S.compute()
    assert apart.examples == 2 * (Q.n + G.n)
    assert_close(values(got), values(separate), what="shared vs separate forwards", rtol=0, atol=1e-12)
    out = {n: p for n, p in s["model"].named_parameters()}
    ref_out = block_rows(s["model"], MLP_LAYERS, ga.per_example_grads(task, s["batch"], list(out), loss_fn=task.output))
    refq_out = block_rows(s["model"], MLP_LAYERS, ga.per_example_grads(task, s["qbatch"], list(out),
                                                                       loss_fn=task.output))
    assert_close(values(got), s["RQ"] @ s["R"].T + refq_out @ ref_out.T, what="two sources", **TOL)


def test_relatif_keeps_the_projected_rows_of_the_curvature_pass():
    """RelatIF's training side P(G).normalize(metric=H⁻¹) needs H from the pass over the
    same data: the planner stores P(G) in that pass (the prefix of the row-wise chain that
    does not need H) and normalizes from memory. The training data is forwarded once."""
    s = mlp_setup()
    task, train, query = s["task"], big_mlp_data(), s["query"]
    P = ga.proj.kron(4, seed=0)
    S = ga.methods.relatif(task, train, query, projector=P, damping=1e-2)
    p = plan(S.expr)
    G = P(ga.grads(task, train))
    assert p.decisions.one(DecisionKind.STORE, subject=G.expr.token).chosen == "store"
    assert p.data_passes == 2      # the queries, then the training data once
    with ga.options(check_reduction=False), Counting(s["model"][0]) as seen:
        got = values(S.compute())
    assert seen.examples == len(query) + len(train)
    Q = P(ga.grads(task, query))
    from gradalg.methods.influence import curvature_operator   # its numbers are tested in test_curvature
    Hinv = curvature_operator(task, train, projector=P, damping=1e-2).to_dense()
    flat = lambda X: torch.cat([v.flatten(1) for v in X.to_dense().values()], 1)  # noqa: E731
    Rq, Rg = flat(Q), flat(G)
    want = (Rq @ Hinv @ Rg.T) / ((Rg @ Hinv) * Rg).sum(1).sqrt()
    assert_close(got, want, what="RelatIF from stored projected rows", rtol=1e-6, atol=1e-9)


def test_shared_gradient_set_is_captured_once():
    """P(G) feeds the Fisher and the scores: with rows stored, the training data is read once."""
    s = mlp_setup()
    S, G, Q = projected_influence(s["task"], s["train"], s["query"])
    with ga.options(check_reduction=False), Counting(s["model"]) as seen:
        S.compute()
    assert seen.examples == Q.n + G.n


# ====================================================================== the ghost kernel ran (or not)
@pytest.fixture
def ghost_calls(monkeypatch):
    calls = []
    real = score_jobs.ghost_inner

    def wrapped(L, R, *args, **kwargs):
        calls.append((L.n, R.n, L.T, R.T))
        return real(L, R, *args, **kwargs)

    monkeypatch.setattr(score_jobs, "ghost_inner", wrapped)
    return calls


@pytest.mark.parametrize("mode", ["always", "never", "auto"])
def test_ghost_option_decides_the_kernel_mlp(mode, ghost_calls):
    s = mlp_setup()
    S = ga.grads(s["task"], s["query"]) @ ga.grads(s["task"], s["train"]).T
    with ga.options(ghost=mode):
        ex = ga.LocalExecutor()            # an executor takes the options in force when it is made
        got = S.compute(ex)
    ran_ghost = mode in ("always", "auto")      # auto: T = 1, ghost is cheaper
    assert bool(ghost_calls) == ran_ghost
    assert (ex.trace["ghost"] > 0) == ran_ghost and (ex.trace["dense"] > 0) == (not ran_ghost)
    assert_close(values(got), s["RQ"] @ s["R"].T, what=f"ghost={mode}", **TOL)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_cosine_normalizes_the_streamed_columns_late(mode):
    """Grad-Cos streams unnormalized rows and divides each score column by the row's norm,
    taken from the materialized rows (dense kernel) or the ghost identity (ghost kernel)."""
    g = gpt2_setup(min_len=5, max_len=12)
    G, Q = ga.grads(g["task"], g["train"], g["layers"]), ga.grads(g["task"], g["query"], g["layers"])
    with ga.options(ghost=mode):
        ex = ga.LocalExecutor()
        got = values((Q.normalize() @ G.normalize().T).compute(ex))
    assert ex.trace["ghost" if mode == "always" else "dense"] > 0
    R, RQ = g["R"], g["RQ"]
    want = (RQ / RQ.norm(dim=1, keepdim=True)) @ (R / R.norm(dim=1, keepdim=True)).T
    assert_close(got, want, what=f"cosine, ghost={mode}", **TOL)


@pytest.fixture
def one_rate_profile(monkeypatch):
    """Plans (and runs) priced with UNMEASURED_CPU, one rate for every GEMM: which kernel
    is faster depends on the device profile (tests/test_estimates.py pins the choice on
    a measured CPU, where the small per-example GEMMs of the dense kernel are slow)."""
    monkeypatch.setattr(lookup, "local_profile", lambda refresh=False: devices.UNMEASURED_CPU)
    monkeypatch.setattr(lookup, "cached_local_profile", lambda: devices.UNMEASURED_CPU)


def test_auto_routes_short_sequences_to_ghost(ghost_calls, one_rate_profile):
    g = gpt2_setup()                            # T = 9, width 64
    G, Q = ga.grads(g["task"], g["train"], g["layers"]), ga.grads(g["task"], g["query"], g["layers"])
    S = Q @ G.T
    p = plan(S.expr)
    assert all(p.decisions.one(DecisionKind.KERNEL, block=b).chosen == "ghost" for b in g["layers"])
    ex = ga.LocalExecutor()
    got = S.compute(ex)
    assert len(ghost_calls) == len(g["layers"]) and ex.trace["dense"] == 0
    assert {c[2] for c in ghost_calls} == {9}
    assert_close(values(got), g["RQ"] @ g["R"].T, what="gpt2 ghost", **TOL)


def test_auto_routes_long_sequences_to_dense(ghost_calls, one_rate_profile):
    g = gpt2_setup(min_len=36, max_len=40)      # T = 40: materializing is cheaper at one GEMM rate
    G, Q = ga.grads(g["task"], g["train"], g["layers"]), ga.grads(g["task"], g["query"], g["layers"])
    S = Q @ G.T
    p = plan(S.expr)
    d = p.decisions.one(DecisionKind.KERNEL, block="transformer.h.0.attn.c_attn")
    assert d.chosen == "dense" and d.alternatives["dense"] < d.alternatives["ghost"]
    ex = ga.LocalExecutor()
    auto = S.compute(ex)
    assert ghost_calls == [] and ex.trace["ghost"] == 0 and ex.trace["dense"] > 0
    assert_close(values(auto), g["RQ"] @ g["R"].T, what="gpt2 dense", **TOL)
    with ga.options(ghost="always"):          # forcing ghost changes the kernel, not the numbers
        forced = S.compute()
    assert len(ghost_calls) == len(g["layers"])
    assert_close(values(forced), values(auto), what="forced ghost", **TOL)


# ====================================================================== differential tests
def three_ways(expr_fn):
    """(optimized plan, rewrites disabled) results of the lazy expression ``expr_fn()``."""
    S = expr_fn()
    on, off = ga.LocalExecutor(), ga.LocalExecutor(rewrites=False)
    return values(S.compute(on)), values(S.compute(off)), on, off


def influence_reference(RQ, RG, C_rows, damping):
    H = C_rows.T @ C_rows / C_rows.shape[0] + damping * torch.eye(C_rows.shape[1], dtype=F64)
    return RQ @ torch.linalg.solve(H, RG.T)


DIFF_CASES = ["grad_dot", "influence", "influence_kron", "influence_gaussian", "trak", "self_influence",
              "self_grad_dot"]


@pytest.mark.parametrize("case", DIFF_CASES)
def test_differential_mlp(case):
    s = mlp_setup()
    task, train, query, R, RQ = s["task"], s["train"], s["query"], s["R"], s["RQ"]
    space = ga.grads(task, train).space
    lam = 1e-2
    if case == "grad_dot":
        fn, ref = (lambda: ga.methods.grad_dot(task, train, query)), RQ @ R.T
    elif case.startswith("influence"):
        P = {"influence": None, "influence_kron": ga.proj.kron(8, seed=5),
             "influence_gaussian": ga.proj.gaussian(12, seed=4)}[case]
        PR, PQ = (R, RQ) if P is None else (project_dense(R, space, P), project_dense(RQ, space, P))
        fn = lambda: ga.methods.influence(task, train, query, curvature="empirical", damping=lam,  # noqa: E731
                                          projector=P)
        ref = influence_reference(PQ, PR, PR, lam)
    elif case == "trak":
        P = ga.proj.gaussian(16, seed=3)
        names = [n for n, _ in s["model"].named_parameters()]
        Phi = project_dense(block_rows(s["model"], MLP_LAYERS, ga.per_example_grads(
            task, s["batch"], names, loss_fn=task.output)), space, P)
        phi = project_dense(block_rows(s["model"], MLP_LAYERS, ga.per_example_grads(
            task, s["qbatch"], names, loss_fn=task.output)), space, P)
        w = task.output_weight(s["model"], s["batch"]).detach()
        fn = lambda: ga.methods.trak(task, train, query, projector=P, damping=lam)  # noqa: E731
        ref = phi @ torch.linalg.solve(Phi.T @ Phi + lam * torch.eye(16, dtype=F64), Phi.T) * w
    elif case == "self_influence":
        fn = lambda: ga.methods.self_influence(ga.methods.influence, task, train,  # noqa: E731
                                               curvature="empirical", damping=lam)
        ref = torch.diagonal(influence_reference(R, R, R, lam))
    else:
        fn, ref = (lambda: ga.methods.self_influence(ga.methods.grad_dot, task, train)), (R * R).sum(1)
    opt, raw, on, off = three_ways(fn)
    assert_close(opt, ref, what=f"{case}: optimized plan vs dense reference", **TOL)
    assert_close(raw, ref, what=f"{case}: rewrites disabled vs dense reference", **TOL)
    assert off.last_plan.fired == []
    if case in ("influence", "influence_kron", "trak"):
        assert on.last_plan.fired, "the rewrites should change this plan"
    if case == "influence_kron":   # projected before materializing: the factors were projected
        assert on.trace["kron_factored"] > 0


@pytest.mark.parametrize("case", ["grad_dot", "influence_kron"])
def test_differential_gpt2(case):
    g = gpt2_setup()
    task, train, query, layers, R, RQ = g["task"], g["train"], g["query"], g["layers"], g["R"], g["RQ"]
    if case == "grad_dot":
        fn, ref = (lambda: ga.methods.grad_dot(task, train, query, layers=layers)), RQ @ R.T
    else:
        P = ga.proj.kron(16, seed=1)
        space = ga.grads(task, train, layers).space
        PR, PQ = project_dense(R, space, P), project_dense(RQ, space, P)
        fn = lambda: ga.methods.influence(task, train, query, layers=layers, curvature="empirical",  # noqa: E731
                                          damping=1e-3, projector=P)
        ref = influence_reference(PQ, PR, PR, 1e-3)
    opt, raw, _, _ = three_ways(fn)
    assert_close(opt, ref, what=f"gpt2 {case} optimized", **TOL)
    assert_close(raw, ref, what=f"gpt2 {case} rewrites off", **TOL)


def test_dense_kernel_on_large_blocks_matches_reference():
    """Blocks over 1 MiB per chunk are materialized into one reused buffer: blocks of two
    sizes, a last chunk shorter than the others, both must still give the exact scores."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64)).double()
    task = ga.tasks.classification(model)
    x, y = models.classification_data(20, d_in=128, classes=64, seed=3)
    xq, yq = models.classification_data(3, d_in=128, classes=64, seed=4)
    S = ga.grads(task, (xq, yq)) @ ga.grads(task, (x, y)).T
    with ga.options(ghost="never", batch_size=8):
        ex = ga.LocalExecutor()
        got = values(S.compute(ex))
    assert ex.trace["dense"] == 2 * 3 and ex.trace["ghost"] == 0          # 2 blocks × 3 chunks
    ref = reference_rows(task, (xq, yq), MLP_LAYERS) @ reference_rows(task, (x, y), MLP_LAYERS).T
    assert_close(got, ref, what="large dense blocks", **TOL)


# ====================================================================== memory budget
def test_smaller_budget_lowers_the_batch_size():
    s = mlp_setup()
    train = big_mlp_data()
    S = ga.grads(s["task"], s["query"]) @ ga.grads(s["task"], train).T
    base = plan(S.expr)
    scoring = base.passes[1]
    assert scoring.batch_size == 32 and scoring.note == ""
    budget = int(scoring.fixed_bytes + 5 * scoring.per_example_bytes) + 1
    with ga.options(memory_budget=budget, check_reduction=False):
        small = plan(S.expr)
        assert small.passes[1].batch_size == 5 and "memory budget" in small.passes[1].note
        assert small.peak_bytes <= budget < base.peak_bytes
        with Counting(s["model"]) as seen:
            got = S.compute()
    assert max(seen.batch_sizes) == 5                       # the executor ran the planned chunks
    assert_close(values(got), values(S.compute()), what="chunked", **TOL)


def test_budget_too_small_names_the_fix():
    s = mlp_setup()
    S = ga.grads(s["task"], s["query"]) @ ga.grads(s["task"], s["train"]).T
    with ga.options(memory_budget=200):
        with pytest.raises(ga.MemoryBudgetError, match=r"memory_budget=") as info:
            plan(S.expr)
    assert "ga.proj.kron" in str(info.value)
    with pytest.raises(ga.MemoryBudgetError):
        S.explain(memory_budget=200)
    assert ga.get_options().memory_budget == 2 * 2**30    # the context manager restored it


def test_budget_option_parses_and_is_scoped():
    with ga.options(memory_budget="1.5MB") as opts:
        assert opts.memory_budget == 1_500_000                 # decimal, as printed (tests/test_units.py)
    with pytest.raises(ValueError):
        ga.options(memory_budget=-1)



def _fake_meminfo(tmp_path, available_kb: int) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       24000000 kB\nMemFree:          1000000 kB\n"
                    f"MemAvailable:   {available_kb:>10} kB\nBuffers:          100000 kB\n")
    return str(path)


def test_default_budget_is_a_fraction_of_available_memory(tmp_path, monkeypatch):
    """memory_budget=None: memory_fraction of MemAvailable when the plan is made, shown
    with its source in explain() (text, HTML, to_dict); an explicit budget still wins."""
    from gradalg.plan import budget as B
    monkeypatch.setattr(B, "MEMINFO", _fake_meminfo(tmp_path, 8_000_000))       # 8.19 GB
    s = mlp_setup()
    S = ga.grads(s["task"], s["query"]) @ ga.grads(s["task"], s["train"]).T
    with ga.options(memory_budget=None):
        assert ga.get_options().memory_budget is None and ga.get_options().memory_fraction == 0.5
        p = plan(S.expr)
        assert p.options.memory_budget == int(0.5 * 8_000_000 * 1024)
        assert (p.budget.source, p.budget.fraction, p.budget.available) == ("MemAvailable", 0.5, 8_000_000 * 1024)
        e = S.explain()
        assert "memory budget 4.1 GB = 0.5 × 8.19 GB available (MemAvailable; memory_fraction)" in str(e)
        assert "0.5 × 8.19 GB available (MemAvailable; memory_fraction)" in e._repr_html_()
        d = e.to_dict()
        assert d["memory_budget"] == p.options.memory_budget
        assert d["memory_budget_source"]["source"] == "MemAvailable"
        assert d["memory_budget_source"]["fraction"] == 0.5
        with ga.options(memory_fraction=0.25):
            assert plan(S.expr).options.memory_budget == int(0.25 * 8_000_000 * 1024)
        # measured when the plan is made, not when the options were set
        monkeypatch.setattr(B, "MEMINFO", _fake_meminfo(tmp_path, 4_000_000))
        assert plan(S.expr).options.memory_budget == int(0.5 * 4_000_000 * 1024)
    with ga.options(memory_budget="3MB"):
        p = plan(S.expr)
        assert p.options.memory_budget == 3_000_000
        assert p.budget.source == "ga.options(memory_budget=...)"
        assert "memory budget 3 MB (ga.options(memory_budget=...))" in str(S.explain())
    with pytest.raises(ga.OptionError, match="memory_fraction"):
        ga.options(memory_fraction=1.5)


def test_budget_without_meminfo_falls_back(tmp_path, monkeypatch):
    from gradalg.plan import budget as B
    monkeypatch.setattr(B, "MEMINFO", str(tmp_path / "missing"))
    monkeypatch.setitem(sys.modules, "psutil", None)      # not installed
    with ga.options(memory_budget=None):
        found = B.resolve_budget(ga.get_options())
    assert (found.available, found.bytes) == (B.FALLBACK_BYTES, B.FALLBACK_BYTES // 2)
    assert "free memory unknown" in found.describe()


def test_default_budget_on_cuda_is_a_fraction_of_the_devices_free_memory(monkeypatch):
    """A model on CUDA: memory_fraction of torch.cuda.mem_get_info's free bytes (no GPU
    here: the device is faked)."""
    from gradalg.plan import budget as B
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (60 * 10**9, 80 * 10**9))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with ga.options(memory_budget=None, memory_fraction=0.5):
        found = B.resolve_budget(ga.get_options(), torch.device("cuda", 0))
    assert found.bytes == 30 * 10**9
    assert found.describe() == ("30 GB = 0.5 × 60 GB available (free memory of cuda:0 "
                                "(torch.cuda.mem_get_info); memory_fraction)")


def test_refusal_names_the_budgets_source_and_its_fix_works(tmp_path, monkeypatch):
    """A refusal for memory says where the budget came from and a budget that fits; the
    suggested ga.options(...) plans as written (explicit budget and fraction alike)."""
    from gradalg.plan import budget as B
    s = mlp_setup()
    S = ga.grads(s["task"], s["query"]) @ ga.grads(s["task"], s["train"]).T
    with ga.options(memory_budget=200):
        with pytest.raises(ga.MemoryBudgetError) as info:
            plan(S.expr)
    msg = str(info.value)
    assert "The memory budget is 200 B (ga.options(memory_budget=...))" in msg, msg
    fix = re.search(r"ga\.options\(memory_budget=('[0-9.]+[kMG]?B')\)", msg.split("The memory budget is")[1])
    assert fix, msg
    with ga.options(memory_budget=eval(fix.group(1))):
        plan(S.expr)                                          # the fix, as written, plans
    with pytest.raises(ga.MemoryBudgetError) as info:         # a budget given to explain() is changed there
        S.explain(memory_budget=200)
    fix = re.search(r"explain\(memory_budget=('[0-9.]+[kMG]?B')\)", str(info.value))
    assert fix and "(explain(memory_budget=...))" in str(info.value), str(info.value)
    S.explain(memory_budget=eval(fix.group(1)))
    # a budget from the machine: the message names MemAvailable and a fraction that fits
    monkeypatch.setattr(B, "MEMINFO", _fake_meminfo(tmp_path, 1))            # 1 kB available
    with ga.options(memory_budget=None):
        with pytest.raises(ga.MemoryBudgetError) as info:
            plan(S.expr)
    msg = str(info.value)
    assert "= 0.5 × 1.02 kB available (MemAvailable; memory_fraction)" in msg, msg
    assert "more than the 1.02 kB available" in msg
    monkeypatch.setattr(B, "MEMINFO", _fake_meminfo(tmp_path, 8_000))         # 8.19 MB available
    with ga.options(memory_budget=None, memory_fraction=0.0001):
        with pytest.raises(ga.MemoryBudgetError) as info:
            plan(S.expr)
    fraction = re.search(r"ga\.options\(memory_fraction=([0-9.]+)\)", str(info.value))
    assert fraction, str(info.value)
    with ga.options(memory_budget=None, memory_fraction=float(fraction.group(1))):
        plan(S.expr)                                          # the suggested fraction plans


def test_torch_distributed_ranks_plan_under_the_smallest_budget(tmp_path, monkeypatch):
    """Budgets from each rank's free memory differ, and so would the ranks' batch sizes
    (refused by the plan check): every rank plans under the smallest (a faked group)."""
    from gradalg.exec import distributed
    from gradalg.plan import budget as B

    class FakeDist:
        def is_initialized(self):
            return True

        def get_rank(self, group=None):
            return 0

        def get_world_size(self, group=None):
            return 2

        def all_gather_object(self, out, obj, group=None):
            out[0], out[1] = obj, replace(obj, bytes=obj.bytes // 2, available=obj.available / 2)

    monkeypatch.setattr(distributed, "_dist", lambda: FakeDist())
    monkeypatch.setattr(B, "MEMINFO", _fake_meminfo(tmp_path, 8_000_000))
    s = mlp_setup()
    S = ga.grads(s["task"], s["query"]) @ ga.grads(s["task"], s["train"]).T
    with ga.options(memory_budget=None):
        p = ga.exec.TorchDistributed().plan(S.expr)
    assert p.options.memory_budget == int(0.5 * 8_000_000 * 1024) // 2
    assert p.budget.source == "MemAvailable, the smallest of 2 ranks"
    with ga.options(memory_budget="1GB"):                 # an explicit budget: nothing to agree on
        assert ga.exec.TorchDistributed().plan(S.expr).options.memory_budget == 10**9

def test_a_dense_fisher_refusal_names_the_budgets_source():
    s = mlp_setup()
    G = ga.grads(s["task"], s["train"])
    with ga.options(memory_budget=1000):
        with pytest.raises(ga.MemoryBudgetError, match=r"The memory budget is 1 kB \(ga.options\(memory_budget"):
            plan((G @ ga.fisher(G).damp(1e-3).inv() @ G.T).expr)

# ====================================================================== explain
def test_explain_text_and_html():
    s = mlp_setup()
    S, _, _ = projected_influence(s["task"], s["train"], s["query"])
    with Counting(s["model"]) as seen:
        e = S.explain()
        text = str(e)
        html = e._repr_html_()
    assert seen.calls == 0, "explaining must not run the model"
    assert isinstance(e, Explain) and repr(e) == text
    for stage in ("1. logical", "2. simplified", "3. costed decisions", "4. physical passes"):
        assert stage in text
    assert "absorb_precondition" in text and "held side" in text and "second use" in text
    assert "store:" in text and "recompute:" in text           # rejected alternative, with its cost
    assert "2 pass(es) over data" in text and "peak" in text
    assert "fisher" in text and "scores" in text
    for piece in ("<table", "costed decisions", "physical passes", "alternatives", "absorb_precondition"):
        assert piece in html
    assert "<details" in html and "<script" not in html
    only = str(S.explain(stage="costed"))
    assert "3. costed decisions" in only and "1. logical" not in only and "4. physical" not in only
    assert "rules fired: none" in str(S.explain(rewrites=False))
    data = e.to_dict()
    assert data["passes_over_data"] == 2 and len(data["passes"]) == 3 and data["decisions"]
    json.dumps(data, default=str)


def test_explain_shows_ghost_alternatives():
    s = mlp_setup()
    text = str((ga.grads(s["task"], s["query"]) @ ga.grads(s["task"], s["train"]).T).explain())
    assert "kernel for block 0 (linear " in text and "chose ghost" in text and "ghost:" in text and "dense:" in text


def test_explain_analyze_adds_measurements():
    s = mlp_setup()
    S, _, _ = projected_influence(s["task"], s["train"], s["query"])
    e = S.explain(analyze=True)
    assert len(e.analyzed) == len(e.plan.passes) == 3
    assert all(a["seconds"] > 0 for a in e.analyzed)
    text = str(e)
    assert "measured" in text and "held" in text
    assert "measured_seconds" in e.passes()[0]
    assert "measured time" in e._repr_html_()


def test_explain_for_another_device_has_scale_table():
    s = mlp_setup()
    S = ga.grads(s["task"], s["query"]) @ ga.grads(s["task"], s["train"]).T
    e = S.explain(device="h100", gpus=(1, 2))
    assert "H100" in str(e) and "1 GPU(s)" in str(e) and "2 GPU(s)" in str(e)
    assert [r["gpus"] for r in e.to_dict()["scale"]] == [1, 2]
    assert e.plan.device is devices.PRESETS["h100"]


def test_capture_is_costed_with_a_fixed_overhead_per_module_call():
    """Small models are dominated by per-call overhead, not FLOPs: each batch calls every
    module once forward and once backward, and the device profile prices a call."""
    s = mlp_setup()                                   # 3 modules (Linear, Tanh, Linear)
    G, Q = ga.grads(s["task"], s["train"]), ga.grads(s["task"], s["query"])
    with ga.options(batch_size=8):
        p = plan((Q @ G.T).expr)
    query_pass, train_pass = p.passes
    assert query_pass.cost.calls == 1 * 3 * 2          # 4 queries: one batch
    assert train_pass.cost.calls == 3 * 3 * 2          # 20 examples in batches of 8: three batches
    c = train_pass.cost
    assert train_pass.seconds == pytest.approx(p.device.time_of(c, p.dtype))
    assert c.batches == 3 and c.layer_batches == 3 * 2        # two recorded Linear layers per batch
    assert 1e-7 < devices.local_profile().call_seconds < 1e-2
    assert devices.PRESETS["h200"].call_seconds == 1e-5


def test_applying_the_operator_is_costed_by_its_structure():
    """The held side's preconditioning in a scores pass: Kronecker rotations for (E)K-FAC,
    per-block products for a block Fisher, a scaling for a diagonal — not a dense d²."""
    from gradalg.plan.estimates import apply_cost
    apply_flops = lambda op, space, n: apply_cost(op, space, n).flops  # noqa: E731
    g = gpt2_setup()
    G, Q = ga.grads(g["task"], g["train"], g["layers"]), ga.grads(g["task"], g["query"], g["layers"])
    space, n, d = Q.space, Q.n, Q.space.dim
    kron = sum(4.0 * n * o * i * (o + i) for o, i in (b.shape for b in space.blocks))
    assert apply_flops(ga.ekfac(G).damp(0.1).inv().expr, space, n) == kron
    assert apply_flops(ga.fisher(G, "block").damp(0.1).inv().expr, space, n) == \
        2.0 * n * sum(b.dim ** 2 for b in space.blocks)
    assert apply_flops(ga.fisher(G, "diag").damp(0.1).inv().expr, space, n) == n * d
    assert apply_flops(ga.identity(G).expr, space, n) == 0
    assert kron < 0.05 * 2.0 * n * d * d
    S = Q @ ga.ekfac(G).damp(0.1).inv() @ G.T
    scores = [j for step in plan(S.expr).passes for j in step.jobs if j.kind == "scores"]
    assert scores and all(step.cost.flops < 2.0 * n * d * d for step in plan(S.expr).passes)


def test_explain_for_another_device_says_what_does_not_fit():
    """Planning for hardware one does not have never raises for memory: the plan for all
    the GPUs asked about is shown, with the reason one GPU's budget is not enough."""
    s = mlp_setup()
    S = ga.grads(s["task"], s["query"]) @ ga.grads(s["task"], s["train"]).T
    with pytest.raises(ga.MemoryBudgetError):
        S.explain(memory_budget=64)
    e = S.explain(device="h100", gpus=(1, 2), memory_budget=64)
    assert "does not fit a memory budget of 64 B on one" in e.warning and "H100" in e.warning
    assert e.warning in str(e) and "ga-warning" in e._repr_html_()
    assert e.to_dict()["warning"] == e.warning and len(e.plan.passes) == 2


# ====================================================================== plan explorer
def test_with_settings_changes_k_and_damping():
    from gradalg.widgets.explorer import with_settings

    s = mlp_setup()
    S, _, _ = projected_influence(s["task"], s["train"], s["query"], k=4, damping=1e-3)
    node = with_settings(S.expr, k=16, damping=0.5)
    assert {x.projector.k for x in node.walk() if isinstance(x, Project)} == {16}
    assert {x.damping for x in node.walk() if isinstance(x, Damp)} == {0.5}
    assert with_settings(S.expr) == S.expr
    # a relative damping (TRAK's and GraSS's defaults) stays relative
    G = ga.grads(s["task"], s["train"])
    H = ga.fisher(G).damp(0.1, relative=True)
    changed = with_settings(H.expr, damping=0.5)
    assert isinstance(changed, Damp) and changed.damping == 0.5 and changed.relative


def test_plan_explorer_updates_the_plan():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    g = gpt2_setup()
    P = ga.proj.kron(4, seed=0)
    G, Q = P(ga.grads(g["task"], g["train"], g["layers"])), P(ga.grads(g["task"], g["query"], g["layers"]))
    S = Q @ ga.fisher(G).damp(1e-3).inv() @ G.T
    explorer = ga.widgets.PlanExplorer(S)
    node, p = explorer.current()
    assert node == S.expr and passes_of(p) == passes_of(plan(S.expr))
    assert "costed decisions" in explorer.html.value
    explorer.k.value = 16
    node16, p16 = explorer.current()
    assert {x.projector.k for x in node16.walk() if isinstance(x, Project)} == {16}
    assert p16.total.flops > p.total.flops
    explorer.damping.value = 0.1
    node_d, _ = explorer.current()
    assert [x.damping for x in node_d.walk() if isinstance(x, Damp)] == [pytest.approx(0.1)]
    explorer.budget.value = 1.0                              # 1 MB: smaller chunks
    _, p_small = explorer.current()
    assert p_small.options.memory_budget == 10**6
    assert max(q.batch_size or 0 for q in p_small.passes) < 32
    assert "local" in explorer.executor.options


def test_cost_chart():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from gradalg.widgets.explorer import cost_chart

    s = mlp_setup()
    S, _, _ = projected_influence(s["task"], s["train"], s["query"])
    ax = cost_chart(plan(S.expr))
    assert len(ax.patches) == 3 and "pass" in ax.get_title()
    import matplotlib.pyplot as plt
    plt.close(ax.figure)


# ====================================================================== planning at scale
class Zeros(Dataset):
    """n token sequences of length T (all zeros): a shape for the planner, never read."""

    def __init__(self, n, T):
        self.n, self.T = n, T

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.zeros(self.T, dtype=torch.long)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_meta_device_7b_explains_in_seconds_without_allocating():
    transformers = pytest.importorskip("transformers")
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs /proc to read the resident set size")
    rss0 = _rss_bytes()
    start = time.perf_counter()
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, vocab_size=32000)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params >= 6.5e9

    def loss(m, ids):
        logits = m(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")

    task = ga.Task(model, loss, name="llama-7b")
    layers = ["model.layers.*.mlp.*"]
    G = ga.grads(task, Zeros(1_000_000, 2048), layers)
    Q = ga.grads(task, Zeros(256, 2048), layers)
    P = ga.proj.kron(k=256)
    S = P(Q) @ ga.fisher(P(G)).damp(1e-3).inv() @ P(G).T
    e = S.explain(device="h200", gpus=(1, 4, 8))
    text = str(e)
    seconds = time.perf_counter() - start
    assert seconds < 30, f"planning a 7B model took {seconds:.1f} s"
    scale = e.to_dict()["scale"]
    assert [r["gpus"] for r in scale] == [1, 4, 8]
    assert scale[0]["seconds"] > scale[1]["seconds"] > scale[2]["seconds"] > 0
    assert scale[0]["memory_per_gpu"] > scale[2]["memory_per_gpu"] > 0
    assert all(r["passes_over_data"] == e.plan.data_passes >= 2 for r in scale)
    for g in (1, 4, 8):
        assert f"{g} GPU(s)" in text
    assert "H200" in text and "1,000,000 examples" in text
    # weights never materialized, and the process did not grow by anything like them
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert _rss_bytes() - rss0 < 500 * 2**20
    # a forward+backward over a million sequences of 2048 tokens is hours, even on 8 GPUs
    assert scale[2]["seconds"] > 3600


def test_long_sequences_are_read_in_batches_of_batch_tokens_positions_with_the_same_scores():
    """On the CPU a pass over sequences of T positions reads ⌈batch_tokens / T⌉ examples
    per batch (default 512 positions: 8 sequences of 64), fewer than ``batch_size``; the
    decision names it, the runner reads exactly those batches, and the scores equal a run
    at the full batch (``batch_tokens=0``) and a loop of single-example backward passes."""
    model = models.gpt2(dtype=torch.float64, n_layer=1, n_embd=32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 101, (20, 64), generator=g)
    data = (ids, torch.ones_like(ids))
    task = models.lm_task(model)
    layer = model.transformer.h[0].mlp.c_fc
    G = ga.grads(task, data, layers=["transformer.h.0.mlp.c_fc"])
    Q = ga.grads(task, (ids[:3], torch.ones_like(ids[:3])), layers=["transformer.h.0.mlp.c_fc"])
    S = Q @ G.T
    calls = []
    hook = model.register_forward_hook(lambda m, args, kwargs, out: calls.append(kwargs["input_ids"].shape[0]),
                                       with_kwargs=True)
    try:
        with ga.options(batch_size=16, progress=False):
            ex = ga.exec.LocalExecutor()
            p = ex.plan(S.expr)
            assert [s.batch_size for s in p.passes if s.reads_data] == [3, 8]   # the 3 queries: one batch of 3
            decision = next(d for d in p.decisions.of(DecisionKind.BATCH_SIZE) if d.subject.n == 20)
            assert decision.alternatives["batch_tokens 512 / T 64"] == "8" and "512 positions" in str(S.explain())
            small = S.compute(executor=ex).values
            # the loss check's probes (1, 2) follow the first batch, whose loss L(batch) they reuse
            assert calls[-6:] == [3, 1, 2, 8, 8, 4] and max(calls) == 8, calls
            calls.clear()
            with ga.options(batch_tokens=0):
                full = S.compute().values
            assert calls[-5:] == [3, 1, 2, 16, 4], calls
            with ga.options(batch_tokens=128):
                assert [s.batch_size for s in ga.exec.LocalExecutor().plan(S.expr).passes if s.reads_data] == [2, 2]
    finally:
        hook.remove()
    reference = torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
        models.lm_loss(model, (ids[i:i + 1], torch.ones_like(ids[i:i + 1]))), [layer.weight, layer.bias])])
        for i in range(20)])
    assert torch.allclose(torch.as_tensor(small), torch.as_tensor(full), rtol=1e-12, atol=0)
    assert torch.allclose(torch.as_tensor(small), reference[:3] @ reference.T, rtol=1e-9)
    with pytest.raises(ga.OptionError, match="batch_tokens"):
        ga.options(batch_tokens=-1)
