"""K-FAC / EK-FAC statistics on a subset (``covariance_max_examples``,
``lambda_max_examples``) against a plain-torch reference: per-example activations and
output gradients from a loop of backward with hooks, covariances, eigenbases and the
eigenvalue correction on the first m examples; the passes read only those examples."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradalg as ga
from models import classification_data, gpt2, lm_task, mlp, padded_token_data

N = 40


@pytest.fixture(scope="module")
def setting():
    model = mlp()                               # Linear(8, 16) → tanh → Linear(16, 3), float64
    X, y = classification_data(n=N)
    return ga.tasks.classification(model), (X, y)


def _linears(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def _factors(model, X, y, cotangent=None):
    """Per example i (a loop of single-example backward): {layer: (a_i (in+1,), [d_i (out,)])},
    a_i the layer's input with the bias column 1, d_i ∂/∂(layer output) of CE(f(x_i), y_i)
    (``cotangent=None``), or one d_ic per Gauss-Newton term √p_c (e_c − p) backpropagated
    from the logits (``cotangent="gauss_newton"``: Σ_c d_ic d_icᵀ is Jᵀ(diag p − ppᵀ)J)."""
    out = []
    for i in range(len(X)):
        acts, grads = {}, {}
        handles = []
        for name, m in _linears(model):
            def fwd(mod, inp, outp, name=name):
                acts[name] = torch.cat([inp[0].detach()[0], inp[0].new_ones(1)])
                outp.register_hook(lambda g, name=name: grads.setdefault(name, []).append(g.detach()[0].clone()))
            handles.append(m.register_forward_hook(fwd))
        logits = model(X[i:i + 1])
        if cotangent is None:
            F.cross_entropy(logits, y[i:i + 1], reduction="sum").backward()
        else:
            p = logits.softmax(-1).detach()[0]
            for c in range(len(p)):
                v = p.sqrt()[c] * (torch.eye(len(p), dtype=p.dtype)[c] - p)
                logits.backward(v[None], retain_graph=True)
        for h in handles:
            h.remove()
        out.append({name: (acts[name], grads[name]) for name, _ in _linears(model)})
    return out


def _reference(factors, m_cov, m_lam, eigen_correction=True):
    """Dense K-FAC / EK-FAC (block diagonal over layers, rows as (out, in+1) row-major) from
    the first m_cov examples' covariances and the first m_lam examples' eigenvalue correction."""
    blocks = []
    for name in factors[0]:
        A = sum(torch.outer(f[name][0], f[name][0]) for f in factors[:m_cov]) / m_cov
        S = sum(sum(torch.outer(d, d) for d in f[name][1]) for f in factors[:m_cov]) / m_cov
        if not eigen_correction:
            blocks.append(torch.kron(S, A))
            continue
        lam_S, Q_S = torch.linalg.eigh(S)
        lam_A, Q_A = torch.linalg.eigh(A)
        Lam = sum(sum((Q_S.T @ torch.outer(d, f[name][0]) @ Q_A) ** 2 for d in f[name][1])
                  for f in factors[:m_lam]) / m_lam
        K = torch.kron(Q_S, Q_A)
        blocks.append(K @ torch.diag(Lam.flatten()) @ K.T)
    return torch.block_diag(*blocks)


def _grad_rows(factors):
    return torch.stack([torch.cat([torch.outer(f[name][1][0], f[name][0]).flatten() for name in f])
                        for f in factors])


def test_reference_rows_are_gradalgs_gradients(setting):
    task, (X, y) = setting
    ref = _grad_rows(_factors(task.model, X, y))
    G = ga.grads(task, (X, y)).to_dense()
    torch.testing.assert_close(torch.cat([v.flatten(1) for v in G.values()], 1), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("m_cov", [24, N, 1000])   # a subset; all; more than n (all)
def test_kfac_on_the_first_examples_equals_the_reference(setting, m_cov):
    task, (X, y) = setting
    factors = _factors(task.model, X, y)
    K = ga.kfac(ga.grads(task, (X, y), batch_size=7), covariance_max_examples=m_cov).to_dense()
    torch.testing.assert_close(K, _reference(factors, min(m_cov, N), N, eigen_correction=False),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("m_cov,m_lam", [(24, 32), (32, 20), (24, 24), (None, 10), (30, None)])
def test_ekfac_with_covariance_and_lambda_subsets_equals_the_reference(setting, m_cov, m_lam):
    task, (X, y) = setting
    factors = _factors(task.model, X, y)
    H = ga.ekfac(ga.grads(task, (X, y), batch_size=7), covariance_max_examples=m_cov, lambda_max_examples=m_lam)
    ref = _reference(factors, m_cov or N, m_lam or N)
    torch.testing.assert_close(H.to_dense(), ref, rtol=1e-9, atol=1e-12)
    # and its damped inverse applied: the scores of the first 5 examples against all 40
    G = ga.grads(task, (X, y), batch_size=7)
    Q = ga.grads(task, (X[:5], y[:5]))
    S = (Q @ H.damp(1e-2).inv() @ G.T).compute().values
    rows = _grad_rows(factors)
    want = rows[:5] @ torch.linalg.solve(ref + 1e-2 * torch.eye(len(ref), dtype=ref.dtype), rows.T)
    torch.testing.assert_close(torch.as_tensor(S), want, rtol=1e-7, atol=1e-9)


def test_lambda_subset_eigenvalues_in_gradalgs_own_basis(setting):
    """Where the covariance subset leaves a factor singular (10 examples, 17-wide input),
    its null-space basis is arbitrary: the correction is checked in gradalg's own basis."""
    task, (X, y) = setting
    factors = _factors(task.model, X, y)
    op = ga.LocalExecutor().operator(
        ga.ekfac(ga.grads(task, (X, y), batch_size=7), covariance_max_examples=10, lambda_max_examples=25).expr)
    for name, _ in _linears(task.model):
        Q_S, Q_A = op.bases[name]
        want = sum((Q_S.T @ torch.outer(f[name][1][0], f[name][0]) @ Q_A) ** 2 for f in factors[:25]) / 25
        torch.testing.assert_close(op.eigenvalues[name].to(want.dtype), want, rtol=1e-9, atol=1e-14)


def test_influence_method_with_subsets_equals_the_gauss_newton_reference(setting):
    """ga.methods.influence(curvature="ekfac") estimates EK-FAC of the Gauss-Newton rows
    (one per class term) on the subsets: the reference backpropagates √p_c (e_c − p)."""
    task, (X, y) = setting
    gn = _factors(task.model, X, y, cotangent="gauss_newton")
    ref = _reference(gn, 24, 30)
    lam = 1e-2
    S = ga.methods.influence(task, (X, y), (X[:4], y[:4]), curvature="ekfac", damping=lam,
                             covariance_max_examples=24, lambda_max_examples=30).compute().values
    rows = _grad_rows(_factors(task.model, X, y))
    want = rows[:4] @ torch.linalg.solve(ref + lam * torch.eye(len(ref), dtype=ref.dtype), rows.T)
    torch.testing.assert_close(torch.as_tensor(S), want, rtol=1e-7, atol=1e-9)
    # K-FAC through the method: the covariances only
    S = ga.methods.influence(task, (X, y), (X[:4], y[:4]), curvature="kfac", damping=lam,
                             covariance_max_examples=24).compute().values
    ref = _reference(gn, 24, 24, eigen_correction=False)
    want = rows[:4] @ torch.linalg.solve(ref + lam * torch.eye(len(ref), dtype=ref.dtype), rows.T)
    torch.testing.assert_close(torch.as_tensor(S), want, rtol=1e-7, atol=1e-9)


def test_subsets_are_part_of_the_operators_identity(setting):
    task, data = setting
    G = ga.grads(task, data)
    full, sub, sub2 = ga.ekfac(G), ga.ekfac(G, covariance_max_examples=10), ga.ekfac(G, lambda_max_examples=10)
    assert len({full.expr.token, sub.expr.token, sub2.expr.token}) == 3
    assert ga.ekfac(G, covariance_max_examples=N).expr.token == full.expr.token     # n or more: all
    assert ga.ekfac(G, covariance_max_examples=10 ** 6).expr.token == full.expr.token
    # one executor, both operators: not memoized as one
    ex = ga.LocalExecutor()
    a, b = ex.operator(full.expr), ex.operator(sub.expr)
    assert not torch.allclose(a.eigenvalues["0"], b.eigenvalues["0"])


class _Counter:
    """Examples the model was run on with gradients (the captures; the loss-reduction check
    runs under no_grad, planning's forward on the meta device)."""

    def __init__(self, model):
        self.n = 0
        model.register_forward_pre_hook(self)

    def __call__(self, module, inputs):
        x = inputs[0] if inputs else None
        if isinstance(x, torch.Tensor) and not x.is_meta and torch.is_grad_enabled():
            self.n += x.shape[0]


def test_the_curvature_passes_capture_only_the_subsets():
    model = mlp(seed=3)
    X, y = classification_data(n=1000, seed=5)
    task = ga.tasks.classification(model)
    counter = _Counter(model)
    G = ga.grads(task, (X, y))
    ga.LocalExecutor().operator(ga.kfac(G, covariance_max_examples=100).expr)
    assert counter.n == 100
    counter.n = 0
    ga.LocalExecutor().operator(ga.ekfac(G, covariance_max_examples=100, lambda_max_examples=300).expr)
    assert counter.n == 100 + 300
    # a plan: the covariance pass reads 100 examples, the correction pass 300, the scores 1,000 + 2
    counter.n = 0
    Q = ga.grads(task, (X[:2], y[:2]))
    S = Q @ ga.ekfac(G, covariance_max_examples=100, lambda_max_examples=300).damp(0.1).inv() @ G.T
    ex = ga.LocalExecutor()
    S.compute(executor=ex)
    assert counter.n == 2 + 100 + 300 + 1000
    plan = ex.last_plan
    reads = {j.kind: p.label for p in plan.passes for j in p.jobs}
    assert "(100 examples)" in reads["kfac"] and "(300 examples)" in reads["ekfac"]
    # the estimates use the subset sizes: the covariance pass costs about a tenth of a full one
    full = [p for p in ga.plan.planner.plan(
        (Q @ ga.ekfac(G).damp(0.1).inv() @ G.T).expr).passes if any(j.kind == "kfac" for j in p.jobs)][0]
    sub = [p for p in plan.passes if any(j.kind == "kfac" for j in p.jobs)][0]
    assert sub.cost.flops < 0.2 * full.cost.flops


def test_explain_shows_the_subsets(setting):
    task, data = setting
    G = ga.grads(task, data)
    S = G @ ga.ekfac(G, covariance_max_examples=10, lambda_max_examples=20).damp(0.1).inv() @ G.T
    text = str(S.explain())
    assert "kfac ekfac (covariances: first 10 of 40 examples)" in text
    assert "ekfac ekfac (eigenvalue correction: first 20 of 40 examples)" in text
    rows = S.explain().passes()
    assert any("(10 examples)" in r["reads"] for r in rows) and any("(20 examples)" in r["reads"] for r in rows)
    assert "covariances: first 10 of 40 examples" in repr(S)


def test_subset_notes_are_typed_and_found_by_statistic(setting, monkeypatch):
    """The notes are records (statistic, first, n): the jobs pick theirs by ``statistic``,
    never by wording, so a reworded note still lands on its own job."""
    from gradalg.expr.curvature import SubsetNote
    task, data = setting
    G = ga.grads(task, data)
    K = ga.ekfac(G, covariance_max_examples=10, lambda_max_examples=20)
    assert K.expr.subset_notes() == (SubsetNote("kfac", 10, N), SubsetNote("ekfac", 20, N))
    assert ga.kfac(G).expr.subset_notes() == ()
    monkeypatch.setattr(SubsetNote, "__str__", lambda x: f"<{x.first} of {x.n}>")
    jobs = {j.kind: j for p in ga.plan.planner.plan((G @ K.damp(0.1).inv() @ G.T).expr).passes for j in p.jobs}
    assert jobs["kfac"].describe() == "kfac ekfac (<10 of 40>)"
    assert jobs["ekfac"].describe() == "ekfac ekfac (<20 of 40>)"


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
@pytest.mark.parametrize("option", ["covariance_max_examples", "lambda_max_examples"])
def test_bad_subset_sizes_are_refused_naming_the_option(setting, option, bad):
    task, data = setting
    with pytest.raises(ValueError, match=option):
        ga.ekfac(ga.grads(task, data), **{option: bad})


def test_subsets_where_they_mean_nothing_are_refused(setting):
    task, data = setting
    G = ga.grads(task, data)
    with pytest.raises(ValueError, match="lambda_max_examples.*ga.ekfac"):
        ga.kfac(G, lambda_max_examples=10)
    with pytest.raises(ValueError, match="covariance_max_examples.*'kfac' or 'ekfac'"):
        ga.methods.influence(task, data, data, covariance_max_examples=10)
    with pytest.raises(ValueError, match="lambda_max_examples.*curvature='ekfac'"):
        ga.methods.influence(task, data, data, curvature="kfac", lambda_max_examples=10)
    with pytest.raises(ValueError, match="covariance_max_examples"):
        ga.methods.logra(task, data, data, curvature="fisher", covariance_max_examples=10)
    with pytest.raises(ValueError, match="need curvature="):
        ga.methods.tracin([task], [1.0], data, data, covariance_max_examples=10)


def test_captured_rows_have_no_prefix_pass(setting):
    task, (X, y) = setting
    model = task.model
    with ga.capture(model, layers=["0", "2"], reduction="sum") as cap:
        for i in range(0, N, 10):
            model.zero_grad()
            F.cross_entropy(model(X[i:i + 10]), y[i:i + 10], reduction="sum").backward()
    G = cap.grads
    with pytest.raises(ValueError, match="computed from data"):
        ga.ekfac(G, covariance_max_examples=10)
    ga.ekfac(G, covariance_max_examples=N)      # all of them: allowed


def test_gpt2_subset_equals_ekfac_of_the_first_sequences():
    """A causal LM with padding: EK-FAC on the first m sequences through the options equals
    EK-FAC of a gradient set built on those m sequences (token-normalized covariances)."""
    model = gpt2(n_layer=1, n_embd=16)
    task = lm_task(model)
    ids, mask = padded_token_data(n=12)
    layers = ["transformer.h.0.mlp.c_fc", "transformer.h.0.attn.c_proj"]
    G = ga.grads(task, (ids, mask), layers, batch_size=5)
    ex = ga.LocalExecutor()
    sub = ex.operator(ga.ekfac(G, covariance_max_examples=7, lambda_max_examples=7).expr)
    alone = ex.operator(ga.ekfac(ga.grads(task, (ids[:7], mask[:7]), layers, batch_size=5)).expr)
    torch.testing.assert_close(sub.dense(), alone.dense(), rtol=1e-9, atol=1e-12)
    kfac_sub = ex.operator(ga.kfac(G, covariance_max_examples=7).expr)
    kfac_alone = ex.operator(ga.kfac(ga.grads(task, (ids[:7], mask[:7]), layers, batch_size=5)).expr)
    torch.testing.assert_close(kfac_sub.dense(), kfac_alone.dense(), rtol=1e-9, atol=1e-12)
