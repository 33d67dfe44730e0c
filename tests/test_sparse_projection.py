"""Sparse projectors (``sparse`` / SJLT, ``mask``, ``grass``, ``factgrass``) against dense matrices.

Each projector's index tables are turned, in this file, into the explicit (k, dim) matrix
it stands for; that matrix applied to reference per-example gradients
(``ga.per_example_grads``, laid out in canonical (out, in) blocks) must give the
projected rows and scores that the executor computes from factors, to float64 rounding.
"""
from __future__ import annotations

import functools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest
import torch
import torch.nn.functional as F

import gradalg as ga
import gradalg.proj.sparse_tables as tables
from gradalg.capture import Factors, OneHot
from gradalg.capture import factors as factors_module
from gradalg.capture.hooks import resolve_layers
from gradalg.capture.session import CaptureStore
from gradalg.expr import Captured
from gradalg.space import Block
from gradalg.proj.kinds import project_block
from models import classification_data, cnn, gpt2, image_data, lm_task, mlp, padded_token_data

F64 = torch.float64
GPT2_LAYERS = ["transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"]


# ---------------------------------------------------------------------------- explicit matrices
def sjlt_matrix(S) -> torch.Tensor:
    """(k, d) from the index tables: column j gets signs[j, c]/√s at row rows[j, c]."""
    M = torch.zeros(S.k, S.d, dtype=F64)
    for c in range(S.s):
        M[S.rows[:, c], torch.arange(S.d)] += S.signs[:, c].to(F64) / math.sqrt(S.s)
    return M


def selection_matrix(coords: torch.Tensor, dim: int, scale: float) -> torch.Tensor:
    """(m, dim): row r picks coordinate coords[r], times ``scale``."""
    M = torch.zeros(coords.numel(), dim, dtype=F64)
    M[torch.arange(coords.numel()), coords] = scale
    return M


@functools.cache
def explicit_matrix(P, name: str, shape: tuple, space_blocks=None) -> torch.Tensor:
    """The (k_b, dim) matrix of projector ``P`` on block ``name`` of ``shape``."""
    dim = math.prod(shape)
    if P.kind == "sparse":
        return sjlt_matrix(ga.proj.sjlt(P, name, dim))
    if P.kind == "mask" and not P.per_block:
        total = sum(d for _, d in space_blocks)
        k = min(P.k, total)
        positions, coords = ga.proj.global_mask(P, space_blocks, name)
        M = torch.zeros(k, dim, dtype=F64)
        M[positions, coords] = math.sqrt(total / k)
        return M
    if P.kind == "mask":
        m = min(P.k, dim)
        return selection_matrix(ga.proj.mask_indices(P, name, dim, m), dim, math.sqrt(dim / m))
    if P.kind == "grass":
        coords, S = ga.proj.grass_tables(P, name, dim)
        return sjlt_matrix(S) @ selection_matrix(coords, dim, math.sqrt(dim / coords.numel()))
    if P.kind == "factgrass":
        out_idx, in_idx, S = ga.proj.factgrass_tables(P, name, *shape)
        coords = (out_idx[:, None] * shape[1] + in_idx[None, :]).flatten()   # row-major (k_out, k_in)
        scale = math.sqrt(dim / coords.numel())
        return sjlt_matrix(S) @ selection_matrix(coords, dim, scale)
    if P.kind == "tensorsketch":
        return tensorsketch_matrix(P, name, shape if len(shape) == 2 else (1, dim))
    raise AssertionError(P.kind)


def tensorsketch_matrix(P, name: str, shape: tuple) -> torch.Tensor:
    """(k, out·in): column (o, i) is σ_out[o]·σ_in[i] at row (h_out[o] + h_in[i]) mod k."""
    h_out, s_out, h_in, s_in = ga.proj.tensorsketch_tables(P, name, *shape)
    M = torch.zeros(P.k, math.prod(shape), dtype=F64)
    rows = ((h_out[:, None] + h_in[None, :]) % P.k).flatten()
    M[rows, torch.arange(M.shape[1])] = (s_out[:, None].to(F64) * s_in[None, :].to(F64)).flatten()
    return M


def project_reference(P, rows: dict, shapes: dict) -> torch.Tensor:
    """Dense projection of reference rows {block: (n, dim)}, in projected-space column order."""
    space_blocks = tuple((name, math.prod(shapes[name])) for name in rows)
    parts = [rows[name] @ explicit_matrix(P, name, shapes[name], space_blocks).T for name in rows]
    return torch.cat(parts, 1) if P.per_block else sum(parts)


# ---------------------------------------------------------------------------- models and references
def reference_rows(task, data, layers, method="auto") -> dict:
    """{layer: (n, out·in)} per-example gradients from torch.func, canonical (out, in) layout."""
    refs = resolve_layers(task.model, layers)
    names = [f"{r.name}.{p}" for r in refs for p in r.rule.param_names(r.module)]
    grads = ga.per_example_grads(task, data, names, method=method)
    out = {}
    for r in refs:
        params = {p: grads[f"{r.name}.{p}"] for p in r.rule.param_names(r.module)}
        out[r.name] = r.rule.from_params(r.module, params).flatten(1).to(F64)
    return out


def _mlp_case():
    model = mlp()
    x, y = classification_data(n=12)
    task = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum"), name="mlp")
    train, query = (x[:9], y[:9]), (x[9:], y[9:])
    return task, train, query, ["0", "2"], "auto"


def _gpt2_case():
    model = gpt2()
    ids, mask = padded_token_data(n=7)
    train, query = (ids[:5], mask[:5]), (ids[5:], mask[5:])
    return lm_task(model), train, query, GPT2_LAYERS, "loop"


def _cnn_case():
    model = cnn()
    x, y = image_data(n=7)
    task = ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum"), name="cnn")
    return task, (x[:5], y[:5]), (x[5:], y[5:]), ["conv1", "conv2", "fc"], "auto"


def _captured_once(G):
    """The factored chunks of ``G`` (chunks of 3, the last one shorter), captured once and
    replayed, so every projector below reads the same factors without another backward."""
    ex, n = ga.LocalExecutor(), G.expr.n
    with ga.options(row_storage="factors"):
        chunks = [ex.window(G.expr, a, min(a + 3, n)) for a in range(0, n, 3)]
    assert all(isinstance(v, Factors) for c in chunks for v in c.blocks.values())
    return ga.GradientSet(Captured(CaptureStore(chunks), G.space))


@pytest.fixture(scope="module", params=["mlp", "gpt2", "cnn"])
def case(request):
    task, train, query, layers, method = {"mlp": _mlp_case, "gpt2": _gpt2_case, "cnn": _cnn_case}[request.param]()
    G = _captured_once(ga.grads(task, train, layers=layers, batch_size=3))
    Q = _captured_once(ga.grads(task, query, layers=layers, batch_size=3))
    shapes = {b.name: b.shape for b in G.space.blocks}
    return dict(name=request.param, G=G, Q=Q, shapes=shapes,
                G_ref=reference_rows(task, train, layers, method),
                Q_ref=reference_rows(task, query, layers, method))


PROJECTORS = {
    "sparse": ga.proj.sparse(24, seed=1),
    "sparse-pb-s3": ga.proj.sparse(24, seed=2, s=3, per_block=True),
    "mask": ga.proj.mask(40, seed=3),
    "mask-global": ga.proj.mask(40, seed=4, per_block=False),
    "grass": ga.proj.grass(12, seed=5),
    "grass-mk-s2": ga.proj.grass(12, seed=6, mask_k=30, s=2),
    "factgrass": ga.proj.factgrass(16, seed=7),
    "factgrass-given-s2": ga.proj.factgrass(16, seed=8, k_out=3, k_in=9, s=2),
    "tensorsketch": ga.proj.tensorsketch(24, seed=9),
    "tensorsketch-pb": ga.proj.tensorsketch(10, seed=10, per_block=True),
}


def _rows(GS) -> torch.Tensor:
    dense = GS.to_dense()
    return torch.cat([dense[b.name].reshape(dense[b.name].shape[0], -1) for b in GS.space.blocks], 1).to(F64)


def _close(actual, expected, what, rtol=1e-9):
    scale = max(1e-30, float(expected.abs().max()))
    err = float((actual.to(F64) - expected).abs().max())
    assert err <= rtol * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


# ---------------------------------------------------------------------------- equal to explicit matrices
@pytest.mark.parametrize("key", list(PROJECTORS))
def test_rows_and_scores_equal_explicit_matrix(case, key):
    P = PROJECTORS[key]
    G, Q = case["G"], case["Q"]
    expected_G = project_reference(P, case["G_ref"], case["shapes"])
    expected_Q = project_reference(P, case["Q_ref"], case["shapes"])
    PG = P(G)
    assert PG.space.dim == expected_G.shape[1]
    assert all(b.basis == P.token and b.kind == "projected" for b in PG.space.blocks)
    _close(_rows(PG), expected_G, f"{case['name']} {P!r} rows")
    S = (P(Q) @ P(G).T).compute()
    _close(torch.as_tensor(S.values), expected_Q @ expected_G.T, f"{case['name']} {P!r} scores")


def test_masks_really_select(case):
    """The cases exercise real masking: blocks larger than the mask (and the GPT-2 embedding)."""
    P = PROJECTORS["factgrass"]
    shrunk = [n for n, s in case["shapes"].items() if math.prod(P.factgrass_shape(*s)) < math.prod(s)]
    assert shrunk, case["shapes"]
    if case["name"] == "gpt2":
        assert "transformer.wte" in shrunk
        k_out, k_in = P.factgrass_shape(*case["shapes"]["transformer.wte"])
        assert k_in < 101 and k_out < 64


def test_space_shapes_and_tokens(case):
    G = case["G"]
    for key, P in PROJECTORS.items():
        space = P(G).space
        if not P.per_block:
            total = sum(math.prod(s) for s in case["shapes"].values())
            assert space.names == ("projected",)
            assert space.blocks[0].shape == ((min(P.k, total),) if P.kind == "mask" else (P.k,))
        else:
            assert space.names == G.space.names
            for b in space.blocks:
                dim = math.prod(case["shapes"][b.name])
                assert b.shape == ((min(P.k, dim),) if P.kind == "mask" else (P.k,)), (key, b)
    tokens = {P.token for P in PROJECTORS.values()}
    assert len(tokens) == len(PROJECTORS)


# ---------------------------------------------------------------------------- kernels: flat = factored
def _random_factors(n=4, T=5, n_out=7, n_in=11, onehot=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(n, T, n_out, generator=g, dtype=F64)
    if onehot:
        idx = torch.randint(0, n_in, (n, T), generator=g)
        valid = torch.rand(n, T, generator=g) > 0.3
        return Factors(OneHot(idx, n_in, valid), D)
    return Factors(torch.randn(n, T, n_in, generator=g, dtype=F64), D)


@pytest.mark.parametrize("onehot", [False, True])
@pytest.mark.parametrize("key", [k for k in PROJECTORS if PROJECTORS[k].per_block])
def test_factored_and_flat_blocks_agree(key, onehot):
    P = PROJECTORS[key]
    Fa = _random_factors(onehot=onehot)
    block = Block("layer", (7, 11), "linear")
    flat = factors_module.materialize(Fa).flatten(1)
    from_factors = project_block(P, block, Fa)
    from_flat = project_block(P, block, flat)
    _close(from_factors, from_flat, f"{P!r} factored vs flat")
    _close(from_flat, flat @ explicit_matrix(P, "layer", (7, 11)).T, f"{P!r} flat vs explicit")


def test_sliced_kernels_match_unsliced():
    """Small ``max_elements`` slices the SJLT's materialization and the mask's gathers."""
    Fa = _random_factors(n_out=9, n_in=13, onehot=False)
    block = Block("layer", (9, 13), "linear")
    for P in (ga.proj.sparse(10, s=2, per_block=True), ga.proj.mask(50), ga.proj.grass(6)):
        big = project_block(P, block, Fa)
        small = project_block(P, block, Fa, max_elements=7)
        _close(small, big, f"{P!r} sliced")


@pytest.mark.parametrize("s", [1, 3])
def test_sjlt_product_equals_scatter_adds_and_explicit_matrix(s):
    """The CPU kernel (weighted bincounts summed in float64) gives the explicit matrix's
    numbers (float64 exactly, float32 to its rounding), as do the scatter-adds and the CSR
    form; dtypes bincount lacks (bfloat16) take the scatter-adds."""
    from gradalg.proj.kernels import sjlt_apply, sjlt_scatter_add
    P = ga.proj.sparse(16, s=s, per_block=True)
    S = tables.sjlt(P, "layer", 300)
    assert tables.sjlt(P, "layer", 300) is S                       # cached table
    x = torch.randn(5, 300)
    scatter = functools.partial(sjlt_scatter_add, S=S)
    torch.testing.assert_close(scatter(x.double()), x.double() @ sjlt_matrix(S).T, rtol=1e-12, atol=1e-12)

    got = sjlt_apply(x, S)                  # weighted bincounts, summed in float64
    assert got.is_contiguous() and got.shape == (5, 16) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ sjlt_matrix(S).T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, scatter(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((S.csr(torch.float32) @ x.T).T, got, rtol=1e-5, atol=1e-5)   # the CSR form, for reference
    assert S.csr(torch.float32) is S.csr(torch.float32)
    torch.testing.assert_close(sjlt_apply(x.double(), S), x.double() @ sjlt_matrix(S).T, rtol=1e-12, atol=1e-12)
    xb = x.bfloat16()
    assert torch.equal(sjlt_apply(xb, S), scatter(xb))
    xs = x[:, 100:200].double()                                   # a column slice's own CSR
    torch.testing.assert_close(sjlt_apply(xs, S.columns(100, 200)), xs @ sjlt_matrix(S)[:, 100:200].T,
                               rtol=1e-12, atol=1e-12)


def test_dense_backend_blocks_for_flat_kinds():
    """torch.func gradients (flat (dim,) blocks) project the same way; FactGraSS refuses them."""
    task, train, _, layers, _ = _mlp_case()
    G = ga.grads(task, train, layers=layers, backend="func")
    rows = {}
    dense = G.to_dense()
    for b in G.space.blocks:
        rows[b.name] = dense[b.name].reshape(dense[b.name].shape[0], -1).to(F64)
    shapes = {b.name: b.shape for b in G.space.blocks}
    for key in ("sparse", "sparse-pb-s3", "mask", "mask-global", "grass"):
        P = PROJECTORS[key]
        _close(_rows(P(G)), project_reference(P, rows, shapes), f"func {P!r}")
    with pytest.raises(ValueError, match="FactGraSS projection needs \\(out, in\\)"):
        ga.proj.factgrass(8)(G).space  # noqa: B018


# ---------------------------------------------------------------------------- no full materialization
@pytest.fixture
def materialize_calls(monkeypatch):
    """Record the (out, in) of every materialize() call, wherever gradalg imported it from."""
    calls = []
    original = factors_module.materialize

    def spy(F_, *args, **kwargs):
        calls.append((F_.out_features, F_.in_features))
        return original(F_)

    for name, module in list(sys.modules.items()):
        if name.startswith("gradalg") and getattr(module, "materialize", None) is original:
            monkeypatch.setattr(module, "materialize", spy)
    return calls


def test_factgrass_never_materializes_full_blocks(materialize_calls):
    task, train, query, layers, _ = _gpt2_case()
    G = ga.grads(task, train, layers=layers, batch_size=3)
    Q = ga.grads(task, query, layers=layers, batch_size=3)
    P = ga.proj.factgrass(16, seed=0)
    ex = ga.LocalExecutor()
    ex.scores((P(Q) @ P(G).T).expr)
    assert ex.trace["factgrass_factored"] > 0 and ex.trace["factgrass_flat"] == 0
    small = {P.factgrass_shape(*b.shape) for b in G.space.blocks}
    assert materialize_calls, "the masked (k_out, k_in) gradients are formed by materialize()"
    assert set(materialize_calls) <= small, (materialize_calls, small)
    assert all(o * i <= 4 * 16 for o, i in materialize_calls)


def test_grass_and_mask_never_materialize(materialize_calls):
    task, train, _, layers, _ = _gpt2_case()
    G = _captured_once(ga.grads(task, train, layers=layers, batch_size=3))
    for P in (ga.proj.grass(16), ga.proj.mask(40), ga.proj.mask(40, per_block=False)):
        P(G).to_dense()
    assert materialize_calls == []


def test_sparse_on_factors_materializes_in_slices(materialize_calls):
    """A block of at most ``projection_slice_elements`` coordinates is formed a slice of
    examples at a time; a larger one one example at a time, in slices of output rows."""
    task, train, *_ = _gpt2_case()
    G = ga.grads(task, train, layers=["transformer.wte"], batch_size=5)
    P = ga.proj.sparse(16)
    whole = P(G).to_dense()["projected"]
    assert materialize_calls and set(materialize_calls) == {(64, 101)}   # whole blocks, slices of examples
    materialize_calls.clear()
    with ga.options(projection_slice_elements=101 * 8):   # slices of 8 rows of the (64, 101) block
        sliced = P(G).to_dense()["projected"]
    assert materialize_calls and all(o <= 8 and i == 101 for o, i in materialize_calls)
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)


def test_sparse_slices_of_examples_use_one_table_and_build_no_csr(monkeypatch):
    """The CPU kernel reads the SJLT's tables as drawn: no CSR form is built (it was
    rebuilt for every chunk: an argsort of the block's d non-zeros, most of TRAK's time
    on GPT-2 small); slices of examples and of rows give the unsliced numbers."""
    built = []
    original = tables._csr

    def spy(crow, col, values, shape):
        built.append(shape)
        return original(crow, col, values, shape)

    monkeypatch.setattr(tables, "_csr", spy)
    F64a = _random_factors(n=6, n_out=9, n_in=13)
    Fa = Factors(F64a.A.float(), F64a.D.float())                                  # the float32 CSR only
    block = Block("layer-csr-once", (9, 13), "linear")
    P = ga.proj.sparse(10, seed=11, per_block=True)
    whole = project_block(P, block, Fa)
    by_two = project_block(P, block, Fa, max_elements=2 * 9 * 13)          # slices of 2 examples
    fewer = project_block(P, block, Fa[:5], max_elements=2 * 9 * 13)
    rows = project_block(P, block, Fa, max_elements=3 * 13)                # 3 rows, one example at a time
    again = project_block(P, block, Fa[:4], max_elements=3 * 13)
    assert built == []
    M = explicit_matrix(P, "layer-csr-once", (9, 13))
    dense = factors_module.materialize(F64a).flatten(1) @ M.T
    for got, n in ((whole, 6), (by_two, 6), (fewer, 5), (rows, 6), (again, 4)):
        _close(got, dense[:n], "sliced SJLT", rtol=1e-5)


def test_plans_count_the_sparse_tables_each_pass_keeps():
    """A pass that applies a sparse projection holds its cached tables: an SJLT of d
    coordinates 5·d·s bytes (int32 rows, int8 signs), once per (projector, block);
    a Kronecker projection has none."""
    from gradalg.plan.size import table_bytes
    task = ga.tasks.classification(mlp(dtype=torch.float32))
    data, queries = classification_data(n=24, dtype=torch.float32), classification_data(n=4, seed=5,
                                                                                         dtype=torch.float32)
    dims = sum(b.dim for b in ga.grads(task, data).expr.space.blocks)

    def tables(projector):
        S = ga.methods.grad_dot(task, data, queries, projector=projector)
        p = ga.exec.LocalExecutor().plan(S.expr)
        return max(table_bytes(step.jobs) for step in p.passes), p

    for s_ in (1, 3):
        got, p = tables(ga.proj.sparse(16, s=s_, seed=0))
        assert got == 5.0 * s_ * dims
        step = next(step for step in p.passes if table_bytes(step.jobs))
        assert step.fixed_bytes >= got and step.cost.peak_bytes >= got
    assert tables(ga.proj.kron(16, seed=0))[0] == 0.0


# ---------------------------------------------------------------------------- determinism
def test_same_seed_same_numbers_other_seed_different():
    task, train, _, layers, _ = _mlp_case()
    G = ga.grads(task, train, layers=layers)
    for make in (lambda s: ga.proj.sparse(16, s), lambda s: ga.proj.mask(16, s),
                 lambda s: ga.proj.grass(8, s), lambda s: ga.proj.factgrass(8, s)):
        first = _rows(make(0)(G))
        tables._sjlt_cpu.cache_clear()
        tables._subset_cpu.cache_clear()
        again = _rows(make(0)(G))
        assert torch.equal(first, again)
        assert not torch.allclose(first, _rows(make(1)(G)))


def test_tables_depend_on_block_name_and_are_well_formed():
    P = ga.proj.sparse(12, seed=0, s=3)
    a, b = ga.proj.sjlt(P, "fc1", 500), ga.proj.sjlt(P, "fc2", 500)
    assert not torch.equal(a.rows, b.rows)
    assert a.rows.shape == (500, 3) and set(a.signs.unique().tolist()) == {-1, 1}
    for c in range(3):   # band c of the rows holds column j's c-th non-zero: s distinct rows
        assert bool(((a.rows[:, c] >= c * 4) & (a.rows[:, c] < (c + 1) * 4)).all())
    assert torch.equal(a.dense(), sjlt_matrix(a))
    assert torch.allclose((a.dense() ** 2).sum(0), torch.ones(500, dtype=F64))   # unit columns


def test_subset_by_rejection(monkeypatch):
    monkeypatch.setattr(tables, "_RANDPERM_MAX", 10)
    tables._subset_cpu.cache_clear()
    P = ga.proj.mask(30, seed=3)
    idx = ga.proj.mask_indices(P, "big", 10_000, 30)
    assert idx.numel() == 30 and idx.unique().numel() == 30
    assert bool((idx[1:] > idx[:-1]).all()) and 0 <= int(idx.min()) and int(idx.max()) < 10_000
    tables._subset_cpu.cache_clear()
    assert torch.equal(idx, ga.proj.mask_indices(P, "big", 10_000, 30))
    tables._subset_cpu.cache_clear()


# ---------------------------------------------------------------------------- unbiasedness
@pytest.mark.parametrize("make", [
    lambda seed: ga.proj.sparse(6, seed, per_block=True),
    lambda seed: ga.proj.sparse(6, seed, s=2, per_block=True),
    lambda seed: ga.proj.mask(8, seed),
    lambda seed: ga.proj.grass(4, seed, mask_k=20),
    lambda seed: ga.proj.factgrass(4, seed),
    lambda seed: ga.proj.tensorsketch(6, seed, per_block=True),
], ids=["sparse", "sparse-s2", "mask", "grass", "factgrass", "tensorsketch"])
def test_inner_products_unbiased_over_seeds(make):
    Fa = _random_factors(n=2, T=3, n_out=8, n_in=9, seed=11)
    block = Block("layer", (8, 9), "linear")
    flat = factors_module.materialize(Fa).flatten(1)
    true = float(flat[0] @ flat[1])
    true_sq = float(flat[0] @ flat[0])
    inner, sq = [], []
    for seed in range(600):
        y = project_block(make(seed), block, Fa)
        inner.append(float(y[0] @ y[1]))
        sq.append(float(y[0] @ y[0]))
    for values, target in ((torch.tensor(inner, dtype=F64), true), (torch.tensor(sq, dtype=F64), true_sq)):
        stderr = float(values.std()) / math.sqrt(values.numel())
        assert abs(float(values.mean()) - target) <= 4.5 * stderr + 1e-9 * abs(target), (
            float(values.mean()), target, stderr)


# ---------------------------------------------------------------------------- specs
def test_repr_and_validation():
    assert repr(ga.proj.sparse(8, 1, s=2)) == "ga.proj.sparse(k=8, seed=1, s=2)"
    assert repr(ga.proj.mask(8)) == "ga.proj.mask(k=8, seed=0)"
    assert repr(ga.proj.mask(8, per_block=False)) == "ga.proj.mask(k=8, seed=0, per_block=False)"
    assert repr(ga.proj.grass(8, mask_k=64)) == "ga.proj.grass(k=8, seed=0, mask_k=64)"
    assert repr(ga.proj.factgrass(8, k_out=4, k_in=8)) == "ga.proj.factgrass(k=8, seed=0, k_out=4, k_in=8)"
    assert repr(ga.proj.gaussian(8, per_block=True)) == "ga.proj.gaussian(k=8, seed=0, per_block=True)"
    assert ga.proj.factgrass(4096).factgrass_shape(768, 3073) == (128, 128)
    assert ga.proj.factgrass(4096).factgrass_shape(10, 3073) == (10, 1639)   # in takes up the slack
    assert ga.proj.factgrass(64).factgrass_shape(3, 5) == (3, 5)               # small layer: whole
    with pytest.raises(ValueError, match="k_out \\* k_in"):
        ga.proj.factgrass(64, k_out=4, k_in=8)
    with pytest.raises(ValueError, match="mask_k"):
        ga.proj.grass(64, mask_k=32)
    with pytest.raises(ValueError, match="s must be"):
        ga.proj.sparse(4, s=5)
    with pytest.raises(ValueError, match="non-zeros"):
        ga.proj.Projector("gaussian", 4, s=2)
    with pytest.raises(ValueError, match="per layer"):
        ga.proj.Projector("grass", 4, per_block=False)
    with pytest.raises(ValueError, match="no dense matrix"):
        ga.proj.dense_matrix(ga.proj.sparse(4), "x", 10)


def test_tensorsketch_never_materializes_and_is_one_sparse_map(materialize_calls):
    """A TensorSketch is an SJLT with the factored hash (h_out(o) + h_in(i)) mod k and sign
    σ_out(o)σ_in(i): one ±1 per column of its explicit matrix; on factors it never forms
    an (out, in) gradient (FFTs of the factors' count sketches), in token blocks or not,
    and it is unbiased over seeds like the other kinds (test_inner_products_unbiased_over_seeds)."""
    M = tensorsketch_matrix(ga.proj.tensorsketch(16, seed=2), "layer", (7, 11))
    assert torch.equal((M != 0).sum(0), torch.ones(77, dtype=torch.long)) and set(M.abs().unique().tolist()) == {0.0, 1.0}
    task, train, _, layers, _ = _gpt2_case()
    G = _captured_once(ga.grads(task, train, layers=layers, batch_size=3))
    P = ga.proj.tensorsketch(16, seed=2)
    whole = P(G).to_dense()["projected"]
    with ga.options(token_block=2):
        blocked = P(G).to_dense()["projected"]
    assert materialize_calls == []
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-5)
