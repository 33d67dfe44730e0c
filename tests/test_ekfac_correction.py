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
