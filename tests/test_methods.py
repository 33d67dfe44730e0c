"""Each published method equals its dense formula, computed in float64 torch from
``ga.per_example_grads`` (torch.func) on a small MLP."""
from __future__ import annotations

import functools
import inspect
import os
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

import gradalg as ga
from gradalg.plan import DecisionKind
from gradalg.testing import assert_close
from gradalg.testing.conformance import project_dense

sys.path.insert(0, os.path.dirname(__file__))
import models
from references import block_rows, one_thread, reference_rows  # noqa: F401 - one_thread is an autouse fixture

F64 = torch.float64
LAYERS = ("0", "2")
TOL = {"rtol": 1e-7, "atol": 1e-9}


@functools.cache
def setup(seed=0):
    model = models.mlp(seed=seed)
    task = ga.tasks.classification(model)
    x, y = models.classification_data(20, seed=1)
    xq, yq = models.classification_data(4, seed=2)
    train, query = TensorDataset(x, y), TensorDataset(xq, yq)
    return {"model": model, "task": task, "x": x, "y": y, "xq": xq, "yq": yq, "train": train, "query": query,
                "R": reference_rows(task, (x, y), LAYERS), "RQ": reference_rows(task, (xq, yq), LAYERS)}


def values(S) -> torch.Tensor:
    out = S.compute()
    assert out.dims == ("query", "train")
    return torch.from_numpy(out.values)


def influence_formula(RQ, RG, C, damping):
    """RQ (C ᵀC / n + λI)⁻¹ RGᵀ with C the curvature gradients (n_c, dim)."""
    H = C.T @ C / C.shape[0] + damping * torch.eye(C.shape[1], dtype=F64)
    return RQ @ torch.linalg.solve(H, RG.T)


PROJECTORS = {"none": None, "gaussian": ga.proj.gaussian(12, seed=4), "kron": ga.proj.kron(8, seed=5)}


def project(R, space, P):
    return R if P is None else project_dense(R, space, P)


# ---------------------------------------------------------------------- grad-dot / cos
@pytest.mark.parametrize("proj", sorted(PROJECTORS))
def test_grad_dot(proj):
    s, P = setup(), PROJECTORS[proj]
    space = ga.grads(s["task"], s["train"]).space
    S = ga.methods.grad_dot(s["task"], s["train"], s["query"], projector=P)
    expected = project(s["RQ"], space, P) @ project(s["R"], space, P).T
    assert_close(values(S), expected, what="grad_dot", **TOL)


@pytest.mark.parametrize("proj", sorted(PROJECTORS))
def test_grad_cos(proj):
    s, P = setup(), PROJECTORS[proj]
    space = ga.grads(s["task"], s["train"]).space
    RQ, RG = project(s["RQ"], space, P), project(s["R"], space, P)
    expected = (RQ / RQ.norm(dim=1, keepdim=True)) @ (RG / RG.norm(dim=1, keepdim=True)).T
    S = ga.methods.grad_cos(s["task"], s["train"], s["query"], projector=P)
    got = values(S)
    assert_close(got, expected, what="grad_cos", **TOL)
    assert float(got.abs().max()) <= 1 + 1e-12


# ---------------------------------------------------------------------- influence
@pytest.mark.parametrize("proj", sorted(PROJECTORS))
def test_influence_empirical(proj):
    s, P = setup(), PROJECTORS[proj]
    space = ga.grads(s["task"], s["train"]).space
    RQ, RG = project(s["RQ"], space, P), project(s["R"], space, P)
    S = ga.methods.influence(s["task"], s["train"], s["query"], projector=P, curvature="empirical", damping=0.01)
    assert_close(values(S), influence_formula(RQ, RG, RG, 0.01), what="empirical influence", **TOL)


def sampled_task(model):
    """A classification task whose Gauss-Newton comes from sampled labels only."""
    full = ga.tasks.classification(model)
    return ga.Task(model, full.loss, sampled_loss=full.sampled_loss, name="sampled")


def test_sampled_gradients_are_gradients_at_drawn_labels():
    """Each row of objective="sampled" is the loss gradient at one of the classes (checked
    against the per-class references), the draw depends on the seed, and is reproducible."""
    s = setup()
    task = sampled_task(s["model"])
    C = ga.grads(task, s["train"], objective="sampled", seed=0)
    rows = torch.cat([v.reshape(C.n, -1) for v in C.to_dense().values()], 1)
    per_class = torch.stack([reference_rows(task, (s["x"], torch.full_like(s["y"], c)), LAYERS)
                             for c in range(3)])                                  # (3, n, dim)
    err = (per_class - rows[None]).abs().amax(dim=2)                              # (3, n)
    assert (err.min(0).values < 1e-12).all(), "a sampled row is no class's gradient"
    labels = err.argmin(0)
    again = ga.grads(task, s["train"], objective="sampled", seed=0)
    assert torch.equal(rows, torch.cat([v.reshape(C.n, -1) for v in again.to_dense().values()], 1))
    other = ga.grads(task, s["train"], objective="sampled", seed=1).to_dense()
    other_rows = torch.cat([v.reshape(C.n, -1) for v in other.values()], 1)
    other_labels = (per_class - other_rows[None]).abs().amax(dim=2).argmin(0)
    assert not torch.equal(labels, other_labels)


@pytest.mark.parametrize("proj", sorted(PROJECTORS))
def test_influence_gauss_newton_sampled(proj):
    """Gauss-Newton from sampled labels: the curvature input of the formula is the same
    sampled gradients, ga.grads(task, data, objective="sampled", seed=0)."""
    s, P = setup(), PROJECTORS[proj]
    task = sampled_task(s["model"])
    C = ga.grads(task, s["train"], objective="sampled", seed=0)
    space = C.space
    C_rows = torch.cat([v.reshape(C.n, -1) for v in C.to_dense().values()], 1).to(F64)
    RQ, RG, RC = (project(r, space, P) for r in (s["RQ"], s["R"], C_rows))
    S = ga.methods.influence(task, s["train"], s["query"], projector=P, curvature="gauss_newton",
                             damping=0.01, seed=0)
    assert_close(values(S), influence_formula(RQ, RG, RC, 0.01), what="sampled GN influence", **TOL)


def exact_gauss_newton(s):
    """(1/n) Σ_i J_iᵀ (diag p_i − p_i p_iᵀ) J_i with J_i the per-example Jacobian of the logits."""
    model, task = s["model"], s["task"]
    names = [f"{layer}.{p}" for layer in LAYERS for p in ("weight", "bias")]
    J = []
    for c in range(3):
        grads = ga.per_example_grads(task, (s["x"], s["y"]), names, loss_fn=lambda m, b, c=c: m(b[0])[:, c].sum())
        J.append(block_rows(model, LAYERS, grads))
    J = torch.stack(J, 1)                                                         # (n, 3, dim)
    with torch.no_grad():
        p = torch.softmax(model(s["x"]), -1)
    A = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]                       # (n, 3, 3)
    return torch.einsum("nci,ncd,ndj->ij", J, A, J) / len(p)


@pytest.mark.parametrize("proj", sorted(PROJECTORS))
def test_influence_gauss_newton_exact(proj):
    """The default task's Gauss-Newton is exact (its expected terms): J ᵀ(diag p − ppᵀ)J."""
    s, P = setup(), PROJECTORS[proj]
    space = ga.grads(s["task"], s["train"]).space
    GN = exact_gauss_newton(s)
    if P is not None:
        M = project_dense(torch.eye(space.dim, dtype=F64), space, P).T           # (k, dim)
        GN = M @ GN @ M.T
    RQ, RG = project(s["RQ"], space, P), project(s["R"], space, P)
    H = GN + 0.01 * torch.eye(GN.shape[0], dtype=F64)
    S = ga.methods.influence(s["task"], s["train"], s["query"], projector=P, damping=0.01, curvature="gauss_newton")
    assert_close(values(S), RQ @ torch.linalg.solve(H, RG.T), what="exact GN influence", **TOL)


# ---------------------------------------------------------------------- TRAK
def trak_formula(s, P, damping=None, relative=None, mass=None):
    """φ (ΦᵀΦ + λI)⁻¹ Φᵀ diag(1 − p), Φ = P ∇f(z), φ = P ∇f(q), f the margin log p/(1−p);
    λ = damping, or relative · tr(ΦᵀΦ)/k (trak's default before issue 31), or with ``mass=q``
    the eigenvalue μ_(j) of ΦᵀΦ (descending) at the first j whose top eigenvalues hold q of
    the trace (``damping="auto"``, trak's default)."""
    model, task = s["model"], s["task"]
    names = [f"{layer}.{p}" for layer in LAYERS for p in ("weight", "bias")]

    def out_rows(x, y):
        return block_rows(model, LAYERS, ga.per_example_grads(task, (x, y), names, loss_fn=task.output))

    space = ga.grads(task, s["train"]).space
    if P is None:            # no projection
        M = torch.eye(space.dim, dtype=F64)
    elif P.kind == "sparse":   # the SJLT's explicit matrix, block by block over the concatenated gradient
        M = torch.cat([ga.proj.sjlt(P, b.name, b.dim).dense() for b in space.blocks], dim=1)
    elif P.kind == "tensorsketch":   # column (o, i): σ_out[o]σ_in[i] at row (h_out[o] + h_in[i]) mod k, per block
        parts = []
        for b in space.blocks:
            shape = b.shape if len(b.shape) == 2 else (1, b.dim)
            h_out, s_out, h_in, s_in = ga.proj.tensorsketch_tables(P, b.name, *shape)
            Mb = torch.zeros(P.k, b.dim, dtype=F64)
            Mb[((h_out[:, None] + h_in[None, :]) % P.k).flatten(), torch.arange(b.dim)] = (
                s_out[:, None].to(F64) * s_in[None, :].to(F64)).flatten()
            parts.append(Mb)
        M = torch.cat(parts, dim=1)
    else:
        M = project_dense(torch.eye(space.dim, dtype=F64), space, P).T                          # (k, dim)
    Phi, phi = out_rows(s["x"], s["y"]) @ M.T, out_rows(s["xq"], s["yq"]) @ M.T
    with torch.no_grad():
        p = torch.softmax(model(s["x"]), -1).gather(1, s["y"][:, None]).squeeze(1)
    if relative is not None:
        damping = relative * float(torch.trace(Phi.T @ Phi)) / M.shape[0]
    if mass is not None:     # per block of the kernel's space: the layers unprojected, one block projected
        sizes = [b.dim for b in space.blocks] if P is None else [M.shape[0]]
        lam, start = [], 0
        for size in sizes:
            Kb = (Phi.T @ Phi)[start:start + size, start:start + size]
            mu = torch.linalg.eigvalsh(Kb).clamp_min(0).flip(0)                               # descending
            lam += [float(mu[int((torch.cumsum(mu, 0) < mass * mu.sum() * (1 - 1e-12)).sum())])] * size
            start += size
        K = Phi.T @ Phi + torch.diag(torch.tensor(lam, dtype=F64))
        return phi @ torch.linalg.solve(K, Phi.T) * (1 - p)[None, :]
    K = Phi.T @ Phi + damping * torch.eye(M.shape[0], dtype=F64)
    return phi @ torch.linalg.solve(K, Phi.T) * (1 - p)[None, :]


def test_trak_one_model():
    s = setup()
    P = ga.proj.gaussian(12, seed=3)
    S = ga.methods.trak(s["task"], s["train"], s["query"], k=12, seed=3)
    # default damping (issue 31): "auto", λ from the kernel's spectrum (mass 0.95), shown in the plan
    assert_close(values(S), trak_formula(s, P, mass=0.95), what="TRAK, default damping='auto'", rtol=1e-6, atol=1e-8)
    assert "[default: damping='auto', λ_b = the eigenvalue where the top ones hold 0.95" in repr(S)
    # damping=None: RELATIVE_DAMPING × the kernel's mean eigenvalue (the default before; the one
    # before that, an absolute 1e-6, interpolates when k ≥ n: chance-level scores on an LM)
    import importlib
    relative = importlib.import_module("gradalg.methods.trak").RELATIVE_DAMPING
    S = ga.methods.trak(s["task"], s["train"], s["query"], k=12, seed=3, damping=None)
    assert_close(values(S), trak_formula(s, P, relative=relative), what="TRAK", rtol=1e-6, atol=1e-8)
    S2 = ga.methods.trak(s["task"], s["train"], s["query"], projector=P, damping=0.1)
    assert_close(values(S2), trak_formula(s, P, 0.1), what="TRAK damped", **TOL)


def test_trak_default_projection_turns_sparse_past_a_gib_of_matrix(monkeypatch):
    """Dense Gaussian (the paper's) for small models; a sparse JL projection, same k and
    seed, once the dense matrix would pass ga.options(dense_projection_bytes) (GPT-2-sized layers)."""
    import importlib

    from gradalg.expr import Project
    trak_module = importlib.import_module("gradalg.methods.trak")   # the module, not the function
    s = setup()
    dim = ga.grads(s["task"], s["train"]).space.dim
    assert trak_module.default_projector(12, dim, 3) == ga.proj.gaussian(12, 3)
    assert trak_module.default_projector(512, 3_150_000, 3) == ga.proj.sparse(512, 3)   # GPT-2 4×256
    assert trak_module.default_projector(2048, 85_017_600, 3) == ga.proj.tensorsketch(2048, 3)   # GPT-2 small
    with ga.options(sjlt_table_bytes=2**40):
        assert trak_module.default_projector(2048, 85_017_600, 3) == ga.proj.sparse(2048, 3)
    with ga.options(dense_projection_bytes=12 * dim * 8 - 1):
        S = ga.methods.trak(s["task"], s["train"], s["query"], k=12, seed=3)
    kinds = {x.projector.kind for x in S.expr.walk() if isinstance(x, Project)}
    assert kinds == {"sparse"}
    assert_close(values(S), trak_formula(s, ga.proj.sparse(12, 3), mass=0.95), what="TRAK, sparse default",
                 rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------- LESS at width
def less_setting(k=24, seed=3):
    """The MLP of :func:`setup` after one Adam step, its LESS inputs and the dense
    reference pieces: per-example gradients (n, d), Adam's moments in space order."""
    s = setup()
    opt = torch.optim.Adam(s["model"].parameters(), lr=1e-3)
    torch.nn.functional.cross_entropy(s["model"](s["x"]), s["y"]).backward()
    opt.step()
    opt.zero_grad()
    s["R"] = reference_rows(s["task"], (s["x"], s["y"]), LAYERS)           # at the stepped weights
    s["RQ"] = reference_rows(s["task"], (s["xq"], s["yq"]), LAYERS)
    G = ga.grads(s["task"], s["train"])
    st = ga.adam_state(opt, G)
    return s, opt, G.space, st


def less_formula(s, space, st, M, groups, lr=1e-3):
    """lr · mean_t(unit(M q)) · unit(M Γ(z))ᵀ with Γ Adam's direction, M (k, dim) explicit."""
    R, RQ = s["R"], s["RQ"]
    m = st.beta1 * st.exp_avg.to(F64) + (1 - st.beta1) * R
    v = st.beta2 * st.exp_avg_sq.to(F64) + (1 - st.beta2) * R * R
    train = (m / (v.sqrt() + st.eps)) @ M.T
    train = train / train.norm(dim=1, keepdim=True)
    val = RQ @ M.T
    val = val / val.norm(dim=1, keepdim=True)
    target = torch.stack([val[torch.tensor(groups) == g].mean(0) for g in sorted(set(groups))])
    return lr * target @ train.T


def sjlt_explicit(P, space) -> torch.Tensor:
    """(k, dim): a global SJLT is the concatenation of its blocks' own tables (seeded per block)."""
    return torch.cat([ga.proj.sjlt(P, b.name, b.dim).dense() for b in space.blocks], 1)


def test_less_default_is_the_dense_rademacher_on_small_models():
    """Within ``dense_projection_bytes`` LESS's default projection is today's dense
    Rademacher map, bit for bit, and the plan says so and names the option."""
    from gradalg.expr import Project
    s, opt, space, st = less_setting()
    groups = [0, 0, 1, 1]
    S = ga.methods.less([s["task"]], [opt], [1e-3], s["train"], s["query"], groups, k=24, seed=3)
    assert {x.projector for x in S.expr.walk() if isinstance(x, Project)} == {ga.proj.rademacher(24, 3)}
    same = ga.methods.less([s["task"]], [opt], [1e-3], s["train"], s["query"], groups,
                           projector=ga.proj.rademacher(24, 3))
    got = S.compute().values
    assert (got == same.compute().values).all()
    M = project_dense(torch.eye(space.dim, dtype=F64), space, ga.proj.rademacher(24, 3)).T      # (k, dim)
    assert_close(torch.from_numpy(got), less_formula(s, space, st, M, groups), what="LESS dense", **TOL)
    d = S.explain().plan.decisions.one(DecisionKind.PROJECTION_MAP)
    assert d.chosen == "dense" and "dense_projection_bytes" in d.reason


def test_less_at_width_projects_block_by_block_without_a_dense_matrix(monkeypatch):
    """Just above ``ga.options(dense_projection_bytes)`` LESS switches to a sparse JL map of
    the same k and seed: no dense matrix is drawn, the whole model's Adam-preconditioned
    rows are never formed (each block preconditioned and projected in turn), and the
    scores equal the formula with the explicit SJLT matrix."""
    import gradalg.exec.rowwise as rowwise
    import gradalg.proj.matrices as matrices
    from gradalg.expr import Project
    s, opt, space, st = less_setting()
    groups = [0, 1, 1, 0]
    with ga.options(dense_projection_bytes=24 * space.dim * 8 - 1):       # one byte under the dense matrix
        S = ga.methods.less([s["task"]], [opt], [1e-3], s["train"], s["query"], groups, k=24, seed=3)
        d = S.explain().plan.decisions.one(DecisionKind.PROJECTION_MAP)
    assert {x.projector for x in S.expr.walk() if isinstance(x, Project)} == {ga.proj.sparse(24, 3)}
    assert d.chosen == "sparse JL" and "over ga.options(dense_projection_bytes" in d.reason

    def refuse(*args, **kwargs):
        raise AssertionError("a dense projection matrix was drawn")

    widths = []
    original = rowwise.adam_block

    def spy(state, value, coords):
        widths.append(coords.stop - coords.start)
        return original(state, value, coords)

    monkeypatch.setattr(matrices, "_draw", refuse)
    import gradalg.expr.grads as grad_nodes                         # the row-wise nodes flatten there
    monkeypatch.setattr(grad_nodes, "flatten", refuse)              # no (n, dim) row of the whole model
    monkeypatch.setattr(rowwise, "adam_block", spy)
    got = torch.from_numpy(S.compute().values)
    assert widths and max(widths) == max(b.dim for b in space.blocks) < space.dim
    M = sjlt_explicit(ga.proj.sparse(24, 3), space)
    assert_close(got, less_formula(s, space, st, M, groups), what="LESS sparse", **TOL)


def test_adam_then_projection_blockwise_equals_the_two_steps():
    """``P(G.adam(state))`` computed block by block (the fused path) gives the numbers of
    the Adam rows first and their projection after, for dense, sparse and per-block maps."""
    from gradalg.exec.rowwise import RowContext, project_blockwise
    s, opt, space, st = less_setting()
    G = ga.grads(s["task"], s["train"])
    A = G.adam(st)
    ex = ga.LocalExecutor()
    for P in (ga.proj.rademacher(24, 3), ga.proj.sparse(24, 3), ga.proj.sparse(8, 1, s=2, per_block=True)):
        node = P(A).expr
        for chunk in ex.windows(G.expr):
            fused = project_blockwise(ex, node, chunk)
            ctx = RowContext(ex)
            two = node.apply(A.expr.apply(chunk, ctx), ctx)
            assert fused.blocks.keys() == two.blocks.keys()
            for name in fused.blocks:
                assert torch.equal(fused.blocks[name], two.blocks[name]), (P, name)


def test_trak_default_k_at_or_above_the_gradient_dimension_projects_nothing():
    """A projection up to k ≥ dim adds cost and reduces nothing: the default projector is
    then none, and TRAK is its formula on the full gradients (relative damping over dim)."""
    import importlib

    from gradalg.expr import Project
    trak_module = importlib.import_module("gradalg.methods.trak")
    s = setup()
    dim = ga.grads(s["task"], s["train"]).space.dim
    assert trak_module.default_projector(dim, dim, 3) is None
    assert trak_module.default_projector(dim - 1, dim, 3) == ga.proj.gaussian(dim - 1, 3)
    S = ga.methods.trak(s["task"], s["train"], s["query"], k=dim)
    assert not [x for x in S.expr.walk() if isinstance(x, Project)]
    assert_close(values(S), trak_formula(s, None, mass=0.95), what="TRAK, no projection", rtol=1e-6, atol=1e-8)
    assert trak_module.K == inspect.signature(ga.methods.trak).parameters["k"].default


def test_trak_ensemble_of_two():
    a, b = setup(0), setup(1)           # two models (other weights), the same examples
    assert torch.equal(a["x"], b["x"])
    P = ga.proj.rademacher(10, seed=8)
    S = ga.methods.trak([a["task"], b["task"]], a["train"], a["query"], projector=P, damping=0.05)
    expected = (trak_formula(a, P, 0.05) + trak_formula(b, P, 0.05)) / 2
    assert_close(values(S), expected, what="TRAK ensemble", **TOL)
    single = values(ga.methods.trak(a["task"], a["train"], a["query"], projector=P, damping=0.05))
    assert not torch.allclose(single, torch.from_numpy(S.compute().values))


def test_ekfac_of_kron_projected_sequences_stored_flat():
    """LoGra on sequences: the projected training rows (T·(k_out + k_in) > k_out·k_in) are
    kept flat for the passes after the K-FAC statistics, and the eigenvalue correction
    runs on those flat rows; it must equal EK-FAC on the streamed factors."""
    model = models.gpt2(n_layer=1, n_embd=16, vocab=31)
    task = models.lm_task(model)
    ids = torch.randint(1, 31, (10, 12), generator=torch.Generator().manual_seed(0))
    train, queries = (ids, torch.ones_like(ids)), (ids[:3], torch.ones_like(ids[:3]))
    layers = ["transformer.h.0.mlp.c_fc", "transformer.h.0.attn.c_proj"]
    P = ga.proj.kron(16, seed=0)                                   # 4 × 4 per layer, T = 12
    G, Q = P(ga.grads(task, train, layers)), P(ga.grads(task, queries, layers))
    H = ga.ekfac(G).damp(1e-3)
    ex = ga.LocalExecutor()
    S = torch.from_numpy((Q @ H.inv() @ G.T).compute(ex).values)
    assert any(not p.reads_data for p in ex.last_plan.passes)     # the rows were kept, not re-read
    Hd = H.to_dense()                                              # pull path: the streamed factors
    Gd, Qd = (torch.cat([v.flatten(1) for v in X.to_dense().values()], 1) for X in (G, Q))
    assert_close(S, Qd @ torch.linalg.solve(Hd, Gd.T), what="EK-FAC on flat kept rows", **TOL)


def test_trak_at_width_takes_a_tensorsketch_past_the_sjlt_table_option():
    """Past ``ga.options(sjlt_table_bytes)`` TRAK's default is a TensorSketch of the same k
    and seed: the scores equal TRAK's formula with its explicit matrix (one ±1 per
    coordinate at row (h_out(o) + h_in(i)) mod k), and the plan says why."""
    import importlib

    from gradalg.expr import Project
    trak_module = importlib.import_module("gradalg.methods.trak")
    s = setup()
    dim = ga.grads(s["task"], s["train"]).space.dim
    with ga.options(dense_projection_bytes=12 * dim * 8 - 1, sjlt_table_bytes=5 * dim - 1):
        S = ga.methods.trak(s["task"], s["train"], s["query"], k=12, seed=3)
        d = S.explain().plan.decisions.one(DecisionKind.PROJECTION_MAP)
    P = ga.proj.tensorsketch(12, 3)
    assert {x.projector for x in S.expr.walk() if isinstance(x, Project)} == {P}
    assert d.chosen == "tensorsketch" and "over ga.options(sjlt_table_bytes" in d.reason
    assert_close(values(S), trak_formula(s, P, mass=0.95), what="TRAK, tensorsketch", rtol=1e-6, atol=1e-8)
