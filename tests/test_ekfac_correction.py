"""EK-FAC's eigenvalue correction pass (``EKFACAccumulator``): its reused buffers and its estimate.

The correction rotates each chunk's gradients into the K-FAC eigenbasis, squares and
sums them. Its (c, out, in) rotated gradients and their (out, in) sum are written into
buffers reused across blocks and chunks (``ga.options(reuse_buffer_bytes)``); the numbers
must not depend on that (bit for bit without token blocks) and must equal the exact
diagonal of the Fisher in the Kronecker eigenbasis. The estimate prices the buffers'
traffic and no fresh memory (:func:`gradalg.plan.jobs.kron.correction_traffic`), and the
pass's bytes per example are one block's, not every block's.
"""
import pytest
import torch

import gradalg as ga
from gradalg.exec.local import LocalExecutor
from gradalg.plan.jobs.kron import EKFACJob, correction_traffic
from gradalg.plan.shapes import ModelFacts
from models import classification_data, mlp
from references import one_thread  # noqa: F401 - one intra-op thread per test module


@pytest.fixture(scope="module")
def setting():
    model = mlp(hidden=24)
    X, y = classification_data(n=24)
    task = ga.tasks.classification(model)
    return task, (X, y)


def _ekfac(C, **options):
    options = {k: v for k, v in options.items() if v is not None}
    with ga.options(**options):
        return LocalExecutor().operator(ga.ekfac(C).expr)


@pytest.mark.parametrize("token_block", [None, 2])
def test_the_reused_buffers_give_the_numbers_of_fresh_tensors_and_the_exact_diagonal(setting, token_block):
    task, data = setting
    C = ga.grads(task, data, objective="expected", batch_size=8)
    buffered = _ekfac(C, reuse_buffer_bytes=1, token_block=token_block)      # every block through the buffers
    fresh = _ekfac(C, reuse_buffer_bytes=2 ** 40, token_block=token_block)   # none
    kfac = LocalExecutor().operator(ga.kfac(C).expr)
    block_fisher = ga.fisher(C, structure="block").to_dense()
    start = 0
    for name in C.layers:
        if token_block is None:
            assert torch.equal(buffered.eigenvalues[name], fresh.eigenvalues[name])
        Q_S, Q_A = kfac.bases[name]
        K = torch.kron(Q_S, Q_A)
        d = K.shape[0]
        exact = torch.diagonal(K.T @ block_fisher[start:start + d, start:start + d] @ K)
        start += d
        torch.testing.assert_close(buffered.eigenvalues[name], exact.reshape(buffered.eigenvalues[name].shape),
                                   rtol=1e-9, atol=1e-12)


def test_the_estimate_prices_the_buffers_traffic_and_no_fresh_memory():
    """Per (out, in) block and chunk of c: the GEMM's output written (w·c·m), the squares in
    place (2·w·c·m, elementwise), their sum (w·c·m + w·m) and the float64 add (w·m + 16·m)."""
    c, o, i, w = 4, 6, 5, 4
    m = o * i
    cost = correction_traffic(c, o, i, w)
    assert cost.bytes == w * c * m * 2 + w * m * 2 + 16 * m
    assert cost.elementwise == 2 * w * c * m
    assert cost.faulted == 0
    assert correction_traffic(c, o, i, 8).bytes == 8 * c * m * 2 + 8 * m * 2 + 16 * m


def test_bytes_per_example_are_the_widest_blocks_not_their_sum(setting):
    """A chunk's rotated gradients are made a block at a time: 4·w·d_max per example (the
    buffer's row and a flat block's rotation), not 16 bytes per coordinate of every block."""
    task, data = setting
    C = ga.grads(task, data, objective="expected")
    node = ga.ekfac(C).expr
    job = EKFACJob(node, (C.expr,), set())
    blocks = node.space.blocks
    widest = max(b.dim for b in blocks)
    T = 1
    tokens = max(T * sum(b.shape) for b in blocks if len(b.shape) == 2)
    for dtype, w in ((torch.float64, 8), (torch.float32, 4), (torch.bfloat16, 4)):
        facts = ModelFacts(dtype=dtype)
        assert job.example_bytes(facts) == 4 * w * widest + tokens * w


def test_gradients_formed_first_are_the_rotated_factors():
    """``rotate_gradients`` (Q_Sᵀ G_i Q_A with G_i = Σ_p D_pᵀ A_p formed first) gives the
    dense reference Q_Sᵀ materialize(F)_i Q_A, in token blocks or not, into the reused
    buffers or fresh; the choice is by FLOPs, T·(out² + in²) > out·in·(out + in)."""
    from types import SimpleNamespace
    from gradalg.capture.factors import Factors, materialize
    from gradalg.plan.jobs.kron import gradient_first, rotate_gradients
    g = torch.Generator().manual_seed(0)
    n, T, o, i = 3, 40, 5, 7
    F = Factors(torch.randn(n, T, i, generator=g, dtype=torch.float64),
                torch.randn(n, T, o, generator=g, dtype=torch.float64))
    Q_S = torch.linalg.qr(torch.randn(o, o, generator=g, dtype=torch.float64))[0]
    Q_A = torch.linalg.qr(torch.randn(i, i, generator=g, dtype=torch.float64))[0]
    exact = Q_S.T @ materialize(F) @ Q_A
    for token_block in (None, 16):
        torch.testing.assert_close(rotate_gradients(F, Q_S, Q_A, token_block), exact, rtol=1e-12, atol=1e-12)
        out, work = torch.full((n, o, i), float("nan"), dtype=torch.float64), torch.empty(n, o, i, dtype=torch.float64)
        got = rotate_gradients(F, Q_S, Q_A, token_block, out=out, work=work)
        assert got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(got, exact, rtol=1e-12, atol=1e-12)
    block = lambda o, i, kind="linear": SimpleNamespace(shape=(o, i), kind=kind)
    assert gradient_first(block(64, 64), 128) and not gradient_first(block(64, 64), 64)   # T > d for d × d
    assert not gradient_first(block(768, 768), 128) and not gradient_first(block(64, 64, "embedding"), 512)
    assert gradient_first(block(64, 16), 19) and not gradient_first(block(64, 16), 18)    # 18·4352 < 64·16·80


def test_the_correction_pass_runs_what_its_estimate_prices(monkeypatch):
    """Issue 28 (LoGra's correction pass 1.8–2.9× its estimate on a 1-layer Mistral): per
    block and chunk the run rotates either the gradients formed first or the factors, as
    the estimate prices each block (its batched GEMMs by shape), and it opens and
    finishes one float64 sum per block, which ``EKFACJob.once_cost`` prices (two
    ``resolve`` units per block, the sums' fresh pages). T = 18 positions: a 16 × 17
    block (its bias a column) forms its gradients first, a 64 × 17 one rotates its factors."""
    import collections
    import gradalg.plan.jobs.kron as KJ
    from gradalg import devices
    from gradalg.plan.planner import plan
    from models import gpt2, lm_task, padded_token_data
    task = lm_task(gpt2(n_layer=1, n_embd=16, vocab=31))
    layers = ["transformer.h.*.mlp.c_fc", "transformer.h.*.attn.c_proj"]
    G = ga.grads(task, padded_token_data(n=4, vocab=31, min_len=18, max_len=18), layers=layers)
    Q = ga.grads(task, padded_token_data(n=2, vocab=31, min_len=18, max_len=18, seed=4), layers=layers)
    S = Q @ ga.ekfac(G).damp(0.1).inv() @ G.T
    calls, opened, finished = collections.Counter(), [], []
    for fn in ("rotate_gradients", "rotate_factors"):
        original = getattr(KJ, fn)
        monkeypatch.setattr(KJ, fn, lambda F, *a, _f=original, _n=fn, **k:
                            calls.update([(_n, F.D.shape[-1], F.A.shape[-1])]) or _f(F, *a, **k))
    init, finish = KJ.EKFACAccumulator.__init__, KJ.EKFACAccumulator.finish
    monkeypatch.setattr(KJ.EKFACAccumulator, "__init__",
                        lambda self, *a, **k: init(self, *a, **k) or opened.append(len(self.sums)))
    monkeypatch.setattr(KJ.EKFACAccumulator, "finish", lambda self: finished.append(len(self.sums)) or finish(self))
    with ga.options(batch_size=2):
        S.compute()
        p = plan(S.expr, device=devices.PRESETS["a100"])
    job = next(j for s in p.passes for j in s.jobs if j.kind == "ekfac")
    blocks, chunks, c, T = job.target.space.blocks, 2, 2, 18
    assert {b.shape for b in blocks} == {(64, 17), (16, 17)}        # the bias is a column
    for b in blocks:
        o, i = b.shape
        first = KJ.gradient_first(b, T)
        assert first == (b.shape == (16, 17))       # 18·(16² + 17²) > 16·17·33; 18·(64² + 17²) < 64·17·81
        assert calls[("rotate_gradients" if first else "rotate_factors", o, i)] == chunks
        assert calls[("rotate_factors" if first else "rotate_gradients", o, i)] == 0
        # priced: G_i formed (c products over T) and Q_Sᵀ · (c products over out), or the factors rotated
        priced = (c, o, i, T, chunks, 8) in job.cost.bmms and (c, o, i, o, chunks, 8) in job.cost.bmms
        rotated = (c * T, i, i, chunks, 8) in job.cost.gemms and (c * T, o, o, chunks, 8) in job.cost.gemms
        assert (priced, rotated) == (first, not first)
    once = job.once_cost(p.facts)
    assert opened == finished == [len(blocks)]
    assert once.blocks == (("resolve", 2.0 * len(blocks), 0.0),)
    assert once.faulted == 8 * sum(b.dim for b in blocks)


def test_flat_rows_of_a_block_with_a_diagonal_factor_are_corrected():
    """Rows kept flat (a Kronecker-projected block over long sequences) of a block with a
    diagonal factor (its output side wider than ``kron_diagonal_width``: the identity as
    basis, Q_S None) are rotated by Q_A alone: Λ = Σ_i (G_i Q_A)² over the chunk. The
    accumulator read the block's shape from Q_S and failed on the identity basis."""
    from types import SimpleNamespace
    from gradalg.linalg.kron import BlockEigenvalues
    from gradalg.plan.jobs.kron import EKFACAccumulator
    g = torch.Generator().manual_seed(0)
    n, o, i = 5, 7, 3
    Q_A = torch.linalg.qr(torch.randn(i, i, generator=g, dtype=torch.float64))[0]
    lam = BlockEigenvalues((torch.ones(o, dtype=torch.float64), torch.ones(i, dtype=torch.float64)))
    kfac = SimpleNamespace(bases={"w": (None, Q_A)}, parts={"w": lam})
    node = SimpleNamespace(space=SimpleNamespace(names=["w"], blocks=[SimpleNamespace(name="w", shape=(o, i))]))
    G = torch.randn(n, o, i, generator=g, dtype=torch.float64)
    acc = EKFACAccumulator(node, kfac)
    acc.update(SimpleNamespace(blocks={"w": G.reshape(n, o * i)}))
    torch.testing.assert_close(acc.sums["w"], ((G @ Q_A) ** 2).sum(0), rtol=1e-12, atol=1e-12)
