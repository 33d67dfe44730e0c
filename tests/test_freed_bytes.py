"""Free pages go back to the operating system per ``release_memory_above`` bytes dropped,
not per block (issue 28: LoGra's last pass, the scores over held rows, ran 25–49× its
estimate on real-size models, one ``malloc_trim`` per small held block, each a walk of the
whole heap)."""
import pytest
import torch

from gradalg.capture.chunks import Chunk, block_bytes
from gradalg.capture.factors import Factors
from gradalg.exec import allocator
from gradalg.exec.resolve import precondition
from gradalg.linalg.kron import KronOp
from gradalg.plan.jobs.rows import Collector
from gradalg.space import Block, ParamSpace

F64 = torch.float64


def test_freed_bytes_returns_pages_once_enough_was_dropped():
    calls = []
    pages = allocator.FreedBytes(100, release=lambda: calls.append(1))
    for nbytes in (30, 30, 30):          # 90 < 100: nothing yet
        pages.freed(nbytes)
    assert calls == [] and pages.pending == 90
    pages.freed(30)                      # 120 ≥ 100: one return, the count starts again
    assert len(calls) == 1 and pages.trims == 1 and pages.pending == 0
    pages.freed(250)                     # one block over the threshold: returned at once
    assert len(calls) == 2 and pages.pending == 0
    every = allocator.FreedBytes(0, release=lambda: calls.append(1))
    for _ in range(3):
        every.freed(1)
    assert every.trims == 3
    never = allocator.FreedBytes(float("inf"), release=lambda: calls.append(1))
    never.freed(2**40)
    assert never.trims == 0 and len(calls) == 5


def test_freed_bytes_calls_the_allocator_when_called(monkeypatch):
    """Without a ``release``, the module's function as it is when pages are returned (what
    tests and the executor patch)."""
    calls = []
    monkeypatch.setattr(allocator, "release_free_memory", lambda: calls.append(1))
    allocator.FreedBytes(0).freed(1)
    assert calls == [1]


def _kron(n_blocks: int, o: int, i: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    names = [f"b{k}" for k in range(n_blocks)]
    space = ParamSpace(tuple(Block(n, (o, i), "linear") for n in names))
    orth = lambda k: torch.linalg.qr(torch.randn(k, k, generator=g, dtype=F64))[0]  # noqa: E731
    op = KronOp(space, {n: (orth(o), orth(i)) for n in names},
                {n: torch.rand(o, i, generator=g, dtype=F64) + 0.5 for n in names})
    rows = {n: torch.randn(2, o * i, generator=g) for n in names}
    return op, space, rows


def test_preconditioning_small_held_blocks_returns_pages_per_megabyte(monkeypatch):
    """48 held blocks of 2 rows × 64·64 float32 numbers (32 KiB each: LoGra's projected
    blocks of a GPT-2 query pair), 1.5 MiB in all: one return per MiB dropped (1, at the
    32nd block), not one per block (48, the old code); the numbers equal those computed
    without dropping the raw rows."""
    calls = []
    monkeypatch.setattr(allocator, "release_free_memory", lambda: calls.append(1))
    op, space, rows = _kron(48, 64, 64)
    expect = precondition(op, Chunk(tuple(range(2)), dict(rows)), space).blocks
    assert calls == []                   # nothing consumed, nothing returned
    held = Chunk(tuple(range(2)), dict(rows))
    got = precondition(op, held, space, consume=True, release_above=2**20)
    total = sum(block_bytes(v) for v in rows.values())
    assert block_bytes(rows["b0"]) == 2 * 64 * 64 * 4 and total == 48 * 32768
    assert len(calls) == total // 2**20 == 1
    assert held.blocks == {}             # consumed
    assert all(torch.equal(got.blocks[n], expect[n]) for n in rows)
    calls.clear()                        # release_above 0: after every block, as before
    precondition(op, Chunk(tuple(range(2)), dict(rows)), space, consume=True, release_above=0)
    assert len(calls) == 48


def test_a_large_held_block_still_returns_its_pages_at_once(monkeypatch):
    """A block of at least ``release_above`` bytes (the case per-block returns were made
    for: EK-FAC queries on GPT-2, 344 MB raw beside 471 MB preconditioned) returns its
    pages before the next block is made."""
    calls = []
    monkeypatch.setattr(allocator, "release_free_memory", lambda: calls.append(1))
    op, space, rows = _kron(3, 16, 16)
    precondition(op, Chunk((0, 1), dict(rows)), space, consume=True, release_above=block_bytes(rows["b0"]))
    assert len(calls) == 3


def test_joining_held_chunks_returns_pages_per_threshold():
    """A held side joined from several chunks tells its page counter the bytes of each
    block's pieces (factors and flat rows), which returns pages once per threshold."""
    calls = []
    g = torch.Generator().manual_seed(0)
    chunks = [Chunk((2 * k, 2 * k + 1), {"w": Factors(torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 4, generator=g)),
                                         "b": torch.randn(2, 7, generator=g)}) for k in range(3)]
    w_bytes = sum(c.blocks["w"].nbytes() for c in chunks)          # 3 · 2·3·(5 + 4) · 4 = 648
    b_bytes = sum(block_bytes(c.blocks["b"]) for c in chunks)      # 3 · 2·7 · 4 = 168
    assert (w_bytes, b_bytes) == (648, 168)
    pages = allocator.FreedBytes(700, release=lambda: calls.append(1))
    held = Collector(whole=True, release=pages)
    for c in chunks:
        held.update(c)
    (joined,) = held.finish()
    assert joined.blocks["w"].A.shape == (6, 3, 5) and joined.blocks["b"].shape == (6, 7)
    assert len(calls) == 1 and pages.pending == 0                   # 648 + 168 ≥ 700: once, after "b"
    per_block = allocator.FreedBytes(0, release=lambda: calls.append(1))
    again = Collector(whole=True, release=per_block)
    for c in chunks:
        again.update(Chunk(c.ids, {n: v for n, v in c.blocks.items()}))
    again.finish()
    assert per_block.trims == 2


@pytest.mark.parametrize("above", [0, 2**20])
def test_logra_scores_do_not_depend_on_when_pages_are_returned(above):
    """End to end (LoGra, a tiny GPT-2): ``ga.options(release_memory_above)`` changes
    when pages are returned, never a score."""
    transformers = pytest.importorskip("transformers")
    import gradalg as ga
    from gradalg.exec.local import LocalExecutor
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)).eval()
    task = ga.tasks.causal_lm(model, name="tiny")
    g = torch.Generator().manual_seed(1)
    train = [{"input_ids": torch.randint(0, 64, (8,), generator=g)} for _ in range(4)]
    queries = [{"input_ids": torch.randint(0, 64, (8,), generator=g)} for _ in range(2)]
    with ga.options(progress=False):
        S = ga.methods.logra(task, train, queries)
        with ga.options(release_memory_above=float("inf")):
            base = S.compute(LocalExecutor()).values
        with ga.options(release_memory_above=above):
            got = S.compute(LocalExecutor()).values
    assert (base == got).all()


def test_release_memory_above_is_an_option_the_plan_shows_and_the_run_reads(monkeypatch):
    """``ga.options(release_memory_above=...)`` is in the plan's header, and the run returns
    pages per that many bytes: a batch's working set below it is not trimmed, above it is
    (:class:`~gradalg.exec.allocator.ResidentGuard`), and rows joined block by block return
    pages per that many bytes (:meth:`Executor.page_returner`)."""
    import gradalg as ga
    from gradalg.errors import OptionError
    from gradalg.exec import runner
    from gradalg.exec.local import LocalExecutor
    torch.manual_seed(0)
    task = ga.tasks.classification(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)))
    data = (torch.randn(12, 4), torch.randint(0, 3, (12,)))
    G = ga.grads(task, data)
    S = G @ G.T
    guards = []
    monkeypatch.setattr(runner, "ResidentGuard", lambda growth: guards.append(growth) or allocator.ResidentGuard(growth))
    with ga.options(progress=False, batch_size=4, release_memory_above="3MB"):
        assert "per 3 MB of dropped blocks (release_memory_above)" in str(S.explain())
        ex = LocalExecutor()
        want = S.compute(ex).values
        assert ex.page_returner().above == 3_000_000 and guards == []     # a few KB a batch: not trimmed
    with ga.options(progress=False, batch_size=4, release_memory_above=0):
        assert "per 0 B of dropped blocks" in str(S.explain())
        ex = LocalExecutor()
        assert (S.compute(ex).values == want).all()
        assert ex.page_returner().above == 0 and len(guards) == 1         # one pass over data, trimmed
    with ga.options(release_memory_above=float("inf")):
        assert "never per dropped block" in str(S.explain())
    for bad in (-1, "lots", True):
        with pytest.raises(OptionError, match="release_memory_above"):
            ga.options(release_memory_above=bad)
