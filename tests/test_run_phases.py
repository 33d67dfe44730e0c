"""Where a run's time and memory go: the phase clock, the resident-set guard, held rows
kept once (flat where their kernel is dense, one chunk instead of a list and a copy)."""
from __future__ import annotations

import time

import pytest
import torch

import gradalg as ga
from gradalg.errors import OptionError
from gradalg.exec import allocator
from gradalg.plan.jobs import Collector
from gradalg.exec.phases import PHASES, PhaseClock
from gradalg.capture.chunks import Chunk
from gradalg.capture.factors import Factors

import models


def test_phase_clock_charges_nested_time_to_the_inner_phase():
    clock = PhaseClock()
    with clock.phase("scoring"):
        time.sleep(0.02)
        with clock.phase("statistics"):
            time.sleep(0.05)
        time.sleep(0.02)
    s = clock.report()
    assert set(s) == set(PHASES)
    assert 0.045 <= s["statistics"] < 0.2
    assert 0.035 <= s["scoring"] < 0.2 and s["scoring"] < s["statistics"] + 0.02
    assert s["capture"] == s["planning"] == s["assembly"] == 0.0
    with pytest.raises(ValueError, match="unknown phase"):
        with clock.phase("imports"):
            pass


def _influence(n=24, nq=5, curvature="ekfac", dtype=torch.float32):
    model = models.mlp(dtype=dtype)
    data = models.classification_data(n=n, dtype=dtype)
    queries = models.classification_data(n=nq, seed=9, dtype=dtype)
    task = ga.tasks.classification(model)
    return ga.methods.influence(task, data, queries, curvature=curvature)


def test_scores_report_seconds_per_phase_that_add_up_to_the_run():
    S = _influence()
    with ga.options(batch_size=8, progress=False):
        S.compute()                                   # warm: one-time imports are not a phase
        start = time.perf_counter()
        out = S.compute()
        total = time.perf_counter() - start
    seconds = out.attrs["seconds"]
    assert set(seconds) == set(PHASES)
    assert seconds["capture"] > 0 and seconds["statistics"] > 0 and seconds["scoring"] > 0
    assert seconds["planning"] > 0 and seconds["assembly"] > 0
    assert sum(seconds.values()) <= total
    # the phases cover the run (20 ms of slack: on a loaded machine the scheduler can stall
    # the ~50 ms run between two phases)
    assert sum(seconds.values()) >= 0.7 * total - 0.02


def test_a_reused_executor_reports_each_computes_own_seconds():
    S = _influence()
    ex = ga.exec.LocalExecutor(ga.get_options())
    with ga.options(progress=False):
        first = S.compute(ex).attrs["seconds"]
        again = S.compute(ex).attrs["seconds"]
    assert first["capture"] > 0 and first["statistics"] > 0
    for phase in PHASES:   # the executor's clock runs on; each result reports its own share
        assert ex.phase_seconds[phase] == pytest.approx(first[phase] + again[phase])


def test_every_result_is_assembled_by_the_one_compute_path():
    """Scores, self-scores and a top-k come out of one path (plan, run, assemble:
    ``api._compute``): each records its expression, the kernels that ran and its seconds
    per phase, the assembly of its DataArray among them; the values are the score matrix's."""
    S = ga.methods.grad_dot(ga.tasks.classification(models.mlp(dtype=torch.float32)),
                            models.classification_data(n=12, dtype=torch.float32),
                            models.classification_data(n=12, dtype=torch.float32))
    with ga.options(batch_size=4, progress=False):
        full, diag, top = S.compute(), S.diag().compute(), S.topk(3)
    for out in (full, diag, top):
        assert set(out.attrs["seconds"]) == set(PHASES) and out.attrs["seconds"]["assembly"] > 0
        assert isinstance(out.attrs["kernels"], dict) and "scores" in out.attrs["expression"]
    assert full.attrs["kernels"] == top.attrs["kernels"] == {"ghost": 6}   # 3 batches × 2 blocks
    assert diag.attrs["expression"].startswith("diagonal (self-scores)")
    assert top.attrs["k"] == 3 and top.attrs["largest"] == 1
    dense = torch.as_tensor(full.values)
    torch.testing.assert_close(torch.as_tensor(diag.values), torch.diagonal(dense), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.as_tensor(top.values), dense.topk(3, dim=1).values, rtol=1e-5, atol=1e-6)


def test_release_growth_is_validated():
    for bad in (0.5, float("inf"), True, "2"):
        with pytest.raises(OptionError, match="release_growth"):
            ga.options(release_growth=bad).__enter__()
    with ga.options(release_growth=1.0):
        assert ga.get_options().release_growth == 1.0


def test_release_growth_is_shown_in_the_plan_header_and_its_trim_decisions():
    task = ga.tasks.classification(models.mlp(dtype=torch.float32))
    G = ga.grads(task, models.classification_data(n=12, dtype=torch.float32))
    with ga.options(release_growth=1.5, release_memory_above=0):
        shown = str((G @ G.T).explain())
    assert "free pages returned past 1.5× a batch's growth (release_growth)" in shown
    assert "after each batch: the pass's resident growth past 1.5× its first batch's (release_growth)" in shown


def _guarded(monkeypatch, growth, readings):
    """The batches after which a :class:`~gradalg.exec.allocator.ResidentGuard` of
    ``growth`` trims when the resident set reads ``readings`` (MiB): the first as the pass
    starts, then one per batch; every reading must be taken."""
    rss = iter([None if r is None else int(r * 2**20) for r in readings])
    monkeypatch.setattr(allocator, "resident_bytes", lambda: next(rss))
    trimmed, batch = [], [0]
    monkeypatch.setattr(allocator, "release_free_memory", lambda: trimmed.append(batch[0]))
    guard = allocator.ResidentGuard(growth)
    for batch[0] in range(1, len(readings)):
        guard.after_batch()
    assert next(rss, "all read") == "all read" and guard.trims == len(trimmed)
    return trimmed


def test_resident_guard_trims_on_the_pass_growth_past_its_first_batch(monkeypatch):
    """The guard compares the pass's growth (resident set after a batch − as the pass
    started) with ``release_growth`` × the first batch's growth, however large the process
    (on main it compared the whole resident set, 500 MiB here, so it never trimmed); the
    batch after a trim sets the reference again, so rows the pass keeps trim at growths
    ``release_growth`` apart, not after every batch."""
    # 500 MiB before the pass; the first batch grows 4 MiB: 5 is within 1.25 × 4, 6 trims;
    # the next batch (3 MiB after the trim) is the reference: 3.5 stays, 4 trims
    assert _guarded(monkeypatch, 1.25, [500, 504, 505, 506, 503, 503.5, 504]) == [3, 6]
    # under the factor throughout: never
    assert _guarded(monkeypatch, 1.25, [500, 508, 510, 509, 510]) == []
    # a small process, the same growth: the same decisions (the process's size plays no part)
    assert _guarded(monkeypatch, 1.25, [20, 24, 25, 26, 23, 23.5, 24]) == [3, 6]
    # kept rows, 10 MiB a batch, that no trim returns: trims at 20, 40, 70, 110 (the
    # reference then 10, 30, 50, 80), 4 of 11 batches, not 10
    assert _guarded(monkeypatch, 1.25, [0] + [10 * i for i in range(1, 12)]) == [2, 4, 7, 11]
    # a first batch that freed more than it kept: its growth counts as 0, any growth trims
    assert _guarded(monkeypatch, 2.0, [100, 99, 100.5, 101]) == [2]
    # without a resident-set reading (not Linux) the guard is off
    reads = []
    monkeypatch.setattr(allocator, "resident_bytes", lambda: reads.append(1))
    monkeypatch.setattr(allocator, "release_free_memory", lambda: pytest.fail("trimmed without a reading"))
    off = allocator.ResidentGuard(1.25)
    for _ in range(3):
        off.after_batch()
    assert off.trims == 0 and len(reads) in (1, 4)
    # 1.0 trims after every batch and reads nothing
    monkeypatch.setattr(allocator, "resident_bytes", lambda: pytest.fail("read at release_growth 1.0"))
    calls = []
    monkeypatch.setattr(allocator, "release_free_memory", lambda: calls.append(1))
    every = allocator.ResidentGuard(1.0)
    for _ in range(3):
        every.after_batch()
    assert every.trims == len(calls) == 3


def test_resident_bytes_reads_this_process():
    value = allocator.resident_bytes()
    if value is None:
        pytest.skip("no /proc/self/statm")
    assert 10 * 2**20 < value < 64 * 2**30


def test_a_held_side_is_kept_as_one_chunk_equal_to_its_pieces():
    torch.manual_seed(0)
    chunks = [Chunk((3 * k, 3 * k + 1, 3 * k + 2),
                    {"w": Factors(torch.randn(3, 4, 5), torch.randn(3, 4, 2)), "b": torch.randn(3, 7)})
              for k in range(3)]
    expect_A = torch.cat([c.blocks["w"].A for c in chunks])
    expect_b = torch.cat([c.blocks["b"] for c in chunks])
    held = Collector(whole=True)
    stored = Collector()
    for c in chunks:
        held.update(c)
        stored.update(c)
    (one,) = held.finish()
    assert one.ids == tuple(range(9))
    torch.testing.assert_close(one.blocks["w"].A, expect_A)
    torch.testing.assert_close(one.blocks["b"], expect_b)
    assert len(stored.finish()) == 3     # stored rows stream back chunk by chunk


def test_stored_rows_are_written_into_one_buffer_per_tensor():
    """Rows stored for a later pass (``Collector(rows=n)``) are views of one buffer per
    tensor of n rows, equal to the chunks they came from; a chunk of another row shape,
    or past n rows, keeps a copy of its own; exported (to a shard's caller) each chunk
    owns its memory."""
    torch.manual_seed(0)
    chunks = [Chunk((3 * k, 3 * k + 1, 3 * k + 2),
                    {"w": Factors(torch.randn(3, 4, 5), torch.randn(3, 4, 2)), "b": torch.randn(3, 7)})
              for k in range(3)]
    stored = Collector(rows=9)
    for c in chunks:
        stored.update(c)
    kept = stored.finish()
    assert len(kept) == 3
    for tensor in (lambda c: c.blocks["w"].A, lambda c: c.blocks["w"].D, lambda c: c.blocks["b"]):
        bases = {tensor(c).untyped_storage().data_ptr() for c in kept}
        assert len(bases) == 1                     # one buffer of the 9 rows
        assert tensor(kept[0]).untyped_storage().nbytes() == 9 * tensor(chunks[0])[0].numel() * 4
        for mine, given in zip(kept, chunks):
            assert torch.equal(tensor(mine), tensor(given))
    for c in stored.export():
        for t in (c.blocks["w"].A, c.blocks["w"].D, c.blocks["b"]):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    other = Chunk((9,), {"w": Factors(torch.randn(1, 6, 5), torch.randn(1, 6, 2)), "b": torch.randn(1, 7)})
    more = Chunk((10,), {"w": Factors(torch.randn(1, 4, 5), torch.randn(1, 4, 2)), "b": torch.randn(1, 7)})
    small = Collector(rows=2)
    for c in (more, other, more, more):   # another T in the 2nd; the 4th past the two rows
        small.update(c)
    a, b, c, d = small.finish()
    buffer = a.blocks["b"].untyped_storage().data_ptr()
    assert c.blocks["b"].untyped_storage().data_ptr() == buffer
    assert d.blocks["b"].untyped_storage().data_ptr() != buffer and b.blocks["w"].A.shape == (1, 6, 5)
    assert torch.equal(b.blocks["w"].A, other.blocks["w"].A)
    assert all(torch.equal(x.blocks["w"].D, more.blocks["w"].D) for x in (a, c, d))


def test_logra_stores_its_rows_in_the_bytes_its_plan_counts():
    """LoGra's first pass stores the Kronecker-projected training rows for EK-FAC's
    correction: in exactly the bytes its store job counts (``StoreJob.fixed_bytes``, the
    rows' factors), one allocation per tensor of a block (it was one per tensor and
    batch: 4 KiB pieces that kept 2.7× their bytes of the heap resident), and the scores
    equal those of the plan that reads the data again instead."""
    from gradalg.plan.jobs import StoreJob
    model = models.gpt2(dtype=torch.float64, n_embd=32)
    task = models.lm_task(model)
    data, queries = models.padded_token_data(n=10), models.padded_token_data(n=3, seed=7)
    P = ga.proj.kron(k=9, seed=0)

    def scores():
        G, Q = ga.grads(task, data), ga.grads(task, queries)
        return P(Q) @ ga.ekfac(P(G)).damp(1e-3).inv() @ P(G).T
    finished, original = [], Collector.finish
    try:
        Collector.finish = lambda self: finished.append((self, original(self))) or finished[-1][1]
        with ga.options(batch_size=4, progress=False):
            ex = ga.exec.LocalExecutor()
            stored = torch.as_tensor(scores().compute(executor=ex).values)
    finally:
        Collector.finish = original
    (job,) = [j for p in ex.last_plan.passes for j in p.jobs if isinstance(j, StoreJob)]
    (chunks,) = [c for acc, c in finished if not acc.whole]
    assert [c.n for c in chunks] == [4, 4, 2]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for c in chunks for f in c.blocks.values() for t in (f.A, f.D)}
    assert len(storages) == 2 * len(job.target.space.blocks)
    assert sum(storages.values()) == job.fixed_bytes(ex.last_plan.facts)
    with ga.options(batch_size=4, progress=False):
        again = ga.exec.LocalExecutor(choices=ga.plan.Choices(store="never"))
        recomputed = torch.as_tensor(scores().compute(executor=again).values)
    assert not any(isinstance(j, StoreJob) for p in again.last_plan.passes for j in p.jobs)
    torch.testing.assert_close(stored, recomputed, rtol=1e-10, atol=1e-12)


def test_held_rows_of_a_dense_kernel_are_kept_flat_and_scores_unchanged():
    """A held block whose kernel is dense is multiplied flat: keeping its factors as well
    would hold it twice. The scores equal a loop-of-backward reference either way."""
    model = models.gpt2(dtype=torch.float64, n_embd=32)
    task = models.lm_task(model)
    data = models.padded_token_data(n=6)
    queries = models.padded_token_data(n=3, seed=7)
    S = ga.methods.grad_dot(task, data, queries, layers=["transformer.h.*"])
    reference = None
    for ghost in ("never", "always"):
        with ga.options(ghost=ghost, batch_size=3, progress=False):
            text = S.explain().text if hasattr(S.explain(), "text") else str(S.explain())
            values = torch.as_tensor(S.compute().values)
        if ghost == "never":
            assert "storage of held rows" in text and "chose flat" in text
            assert "not kept twice" in text
        else:
            assert "chose factors" in text
        if reference is None:
            reference = values
        torch.testing.assert_close(values, reference, rtol=1e-9, atol=1e-12)
    G = ga.grads(task, data, layers=["transformer.h.*"]).to_params()
    Q = ga.grads(task, queries, layers=["transformer.h.*"]).to_params()
    dense = sum(Q[k].flatten(1) @ G[k].flatten(1).T for k in G)
    torch.testing.assert_close(reference, dense, rtol=1e-9, atol=1e-12)


def test_preconditioned_held_rows_are_collected_late_and_dropped_once_preconditioned():
    """EK-FAC influence: the query gradients are collected after the covariance pass (not
    carried through it) and the raw rows are dropped once their preconditioned copy exists;
    the scores are those of the plan that keeps everything (Choices/rewrites unchanged), to float64's
    precision (in float32 the two plans' different summation orders differ by ~1e-4 relative)."""
    S = _influence(n=30, nq=4, dtype=torch.float64)
    with ga.options(batch_size=8, progress=False):
        ex = ga.exec.LocalExecutor(ga.get_options())
        values = torch.as_tensor(S.compute(ex).values)
        keep_all = ga.exec.LocalExecutor(ga.get_options(), rewrites=False)
        reference = torch.as_tensor(S.compute(keep_all).values)
    p = ex.last_plan
    kinds = [[type(j).__name__ for j in step.jobs] for step in p.passes]
    first_collect = next(i for i, k in enumerate(kinds) if "CollectJob" in k)
    assert "KFACJob" in kinds[0] and first_collect > 0, kinds
    scores_jobs = [j for step in p.passes for j in step.jobs if type(j).__name__ == "ScoresJob"]
    assert scores_jobs and all(j.release_held for j in scores_jobs)
    assert all(j.held.token not in ex.state.rows for j in scores_jobs)
    torch.testing.assert_close(values, reference, rtol=1e-9, atol=1e-12)


def test_a_released_kronecker_held_side_is_counted_once_plus_one_block():
    """With ``release_held`` a Kronecker preconditioner replaces the raw held rows block
    by block, so the scores pass holds the larger of the two copies plus one block's
    preconditioned rows (at most both copies) (the batches were sized with both); an operator
    applied to the concatenated rows (a CG inverse) keeps both."""
    from gradalg.plan.jobs import ScoresJob, blockwise_preconditioner
    from gradalg.plan.memory import rows_bytes

    with ga.options(batch_size=8, progress=False):
        p = ga.exec.LocalExecutor(ga.get_options()).plan(_influence(n=30, nq=4).expr)
    step = next(s for s in p.passes if any(isinstance(j, ScoresJob) for j in s.jobs))
    job = next(j for j in step.jobs if isinstance(j, ScoresJob))
    assert job.release_held and blockwise_preconditioner(job.target.op)
    raw, flat = rows_bytes(job.held, job.held_storage, p.facts), rows_bytes(job.held, {}, p.facts)
    block = max(job.held.n * b.dim * 4 for b in job.held.space.blocks)
    assert job.fixed_bytes(p.facts) == pytest.approx(min(raw + flat, max(raw, flat) + block))
    assert step.fixed_bytes >= job.fixed_bytes(p.facts)
    assert step.cost.peak_bytes == pytest.approx(step.fixed_bytes + step.per_example_bytes * (step.batch_size or 1))
    import dataclasses
    kept = dataclasses.replace(job, release_held=False)     # jobs are frozen records
    assert kept.fixed_bytes(p.facts) == pytest.approx(raw + flat)
    G = ga.grads(ga.tasks.classification(models.mlp()), models.classification_data(n=6))
    assert not blockwise_preconditioner(ga.ekfac(G).damp(1e-3).inv(method="cg").expr)
    assert blockwise_preconditioner(ga.ekfac(G).damp(1e-3).inv().expr)


def test_an_executor_reused_after_dropping_held_rows_recomputes_them():
    """The raw held rows of a preconditioned product are dropped once preconditioned; a
    later expression on the same executor that needs them (plain Grad-Dot on the same
    queries, the same influence again, a regrouped product) captures them again and gives
    the numbers of a fresh executor."""
    model = models.mlp(dtype=torch.float64)
    data, queries = models.classification_data(n=30), models.classification_data(n=4, seed=9)
    task = ga.tasks.classification(model)
    G, Q = ga.grads(task, data), ga.grads(task, queries)
    H = ga.ekfac(ga.grads(task, data, objective="sampled")).damp(0.1).inv()
    exprs = [Q @ H @ G.T, Q @ G.T, Q @ H @ G.T, (Q @ H) @ G.T]
    with ga.options(batch_size=8, progress=False):
        ex = ga.exec.LocalExecutor(ga.get_options())
        reused = [torch.as_tensor(S.compute(ex).values) for S in exprs]
        fresh = [torch.as_tensor(S.compute().values) for S in exprs]
    for got, want in zip(reused, fresh):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dense = torch.cat([g.flatten(1) for g in Q.to_params().values()], 1) @ \
        torch.cat([g.flatten(1) for g in G.to_params().values()], 1).T
    torch.testing.assert_close(reused[1], dense, rtol=1e-10, atol=1e-12)
