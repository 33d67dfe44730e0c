"""A self-score whose two sides read different models (a diagonal ⟨g_i(θ₁), g_i(θ₂)⟩ over
one dataset): the plan collects one side (held) and streams the other, aligning the held
rows to each streamed chunk by example id (``DiagJob(held=...)``, ``HeldById``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gradalg as ga
from gradalg.capture.chunks import Chunk
from gradalg.capture.factors import Factors
from gradalg.plan.jobs import scores as scores_module
from models import gpt2, lm_task, padded_token_data
from references import reference_rows

LAYERS = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc"]


def two_checkpoints(n=10):
    data = padded_token_data(n=n, min_len=4, max_len=9, seed=3)
    first, second = lm_task(gpt2(seed=0)), lm_task(gpt2(seed=1))
    return first, second, data


def test_held_diagonal_of_two_checkpoints_equals_the_loop_reference(monkeypatch):
    """Five chunks of two sequences: each streamed chunk gets its own held rows, factored
    (the rows are never materialized flat for the alignment), and the diagonal equals the
    row-by-row products of the two models' loop-of-backward gradients. The held rows are
    joined once per pass, not once per chunk."""
    first, second, data = two_checkpoints()
    joins, concat = [], scores_module.concat_chunks
    monkeypatch.setattr(scores_module, "concat_chunks", lambda chunks: joins.append(len(chunks)) or concat(chunks))
    seen = []
    update = scores_module.DiagAccumulator.update

    def spy(self, left, right=None):
        seen.append({name: type(v) for name, v in left.blocks.items()})
        return update(self, left, right)

    monkeypatch.setattr(scores_module.DiagAccumulator, "update", spy)
    G1, G2 = ga.grads(first, data, LAYERS), ga.grads(second, data, LAYERS)
    with ga.options(batch_size=2, progress=False, check_models=False):    # two checkpoints, on purpose
        ex = ga.LocalExecutor()                   # (an executor reads the options when it is made)
        got = (G1 @ G2.T).diag().compute(executor=ex).values
    jobs = [j for p in ex.last_plan.passes for j in p.jobs if j.kind == "diag"]
    assert len(jobs) == 1 and jobs[0].held is not None
    want = (reference_rows(first, data, LAYERS) * reference_rows(second, data, LAYERS)).sum(1)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-9, atol=1e-12)
    assert len(seen) == 5 and all(t is Factors for blocks in seen for t in blocks.values()), seen
    assert len(joins) == 1, joins                      # once per pass (it was once per chunk)


def test_held_rows_align_by_id_in_the_streamed_order():
    """Rows are picked by id, block by block, in the streamed chunk's order (flat and factored)."""
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(4, 3, generator=g, dtype=torch.float64)                            # (n, d)
    A, D = (torch.randn(4, 2, k, generator=g, dtype=torch.float64) for k in (5, 6))       # (n, T, in/out)
    held = scores_module.HeldById([Chunk(("a", "b"), {"f": flat[:2], "w": Factors(A[:2], D[:2])}),
                                   Chunk(("c", "d"), {"f": flat[2:], "w": Factors(A[2:], D[2:])})])
    out = held.aligned(Chunk(("d", "a"), {}))
    assert out.ids == ("d", "a")
    torch.testing.assert_close(out.blocks["f"], flat[[3, 0]])
    torch.testing.assert_close(out.blocks["w"].A, A[[3, 0]])
    torch.testing.assert_close(out.blocks["w"].D, D[[3, 0]])


def test_ids_the_held_side_lacks_and_repeated_ids_are_refused():
    rows = torch.zeros(2, 3)
    with pytest.raises(ga.DataError, match="combine_repeats"):
        scores_module.HeldById([Chunk(("a", "a"), {"f": rows})])
    held = scores_module.HeldById([Chunk(("a", "b"), {"f": rows})])
    with pytest.raises(ga.DataError, match=r"\['z'\]"):
        held.aligned(Chunk(("a", "z"), {}))
