"""What a Kronecker damp → inverse chain holds (:class:`gradalg.linalg.kron.BlockEigenvalues`).

K-FAC's Λ = λ_S λ_Aᵀ is kept as its two vectors and damping, scaling, inverses and powers
add elementwise steps to it instead of making a new (out, in) grid, so the operators of
``Inverse(Damp(KFAC))`` that the executor memoizes hold, all together, the bytes of one
operator: bases and vectors for K-FAC, bases and one re-fitted grid for EK-FAC (before,
each of the chain's operators had its own float64 grid: GPT-2 small with its tied head,
``layers="all"``: ~1 GB each, a scores pass peaking at 3.8 GB against 2.08 GB estimated).

References: the same operators kept as grids (a KronOp given materialized Λ), compared
bit for bit, and the bytes the planner counts (:func:`gradalg.plan.jobs.kron.kron_output_bytes`).
"""
import pytest
import torch

import gradalg as ga
import gradalg.linalg.kron as kron
from gradalg.linalg.kron import BlockEigenvalues, KronOp
from gradalg.errors import OperatorError
from gradalg.exec.local import LocalExecutor
from gradalg.plan.jobs.kron import kron_output_bytes
from gradalg.space import Block, ParamSpace
from references import one_thread  # noqa: F401 - one intra-op thread per test module

F64 = torch.float64
SHAPES = {"a": (5, 3), "b": (4, 6), "c": (7, 2)}


def distinct_bytes(ops) -> int:
    """Bytes of the distinct tensor storages behind resolved operators (shared ones once)."""
    seen = {}

    def visit(x):
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                visit(v)
        elif isinstance(x, BlockEigenvalues):
            visit(x.base)
        elif isinstance(x, KronOp):
            visit(x.bases)
            visit(x.parts)
        elif hasattr(x, "data"):      # a ResolvedOp
            visit(x.data)

    for op in ops:
        visit(op)
    return sum(seen.values())


def random_kron(vectors: bool, dtype=F64, seed=0):
    """A K-FAC-like KronOp: Λ = λ_S λ_Aᵀ as two vectors, or as the materialized grid."""
    g = torch.Generator().manual_seed(seed)
    space = ParamSpace(tuple(Block(n, s, "linear") for n, s in SHAPES.items()))
    orth = lambda k: torch.linalg.qr(torch.randn(k, k, generator=g, dtype=F64))[0].to(dtype)  # noqa: E731
    bases = {n: (orth(o), orth(i)) for n, (o, i) in SHAPES.items()}
    lam = {n: (torch.rand(o, generator=g, dtype=F64).to(dtype), torch.rand(i, generator=g, dtype=F64).to(dtype))
           for n, (o, i) in SHAPES.items()}
    evals = {n: BlockEigenvalues(v) if vectors else torch.outer(*v) for n, v in lam.items()}
    return KronOp(space, bases, evals)


CHAINS = {
    "damp-inverse": lambda H: H.damp(0.3).inverse(),
    "relative-damp-inverse": lambda H: H.damp(0.1, relative=True).inverse(),
    "power": lambda H: H.damp(0.01).power(-0.5),
    "scale-fractional-power": lambda H: H.scale(2.5).power(0.5),
    "integer-power": lambda H: H.damp(0.2).power(2).scale(-1.5),
}


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("chain", list(CHAINS))
def test_lazy_eigenvalues_give_the_numbers_of_the_grid_bit_for_bit(chain, dtype, monkeypatch):
    """Steps on two vectors, made a slice of rows at a time (slices of 7 numbers here),
    equal the same maps applied to the whole grid: apply, apply_block and trace."""
    monkeypatch.setattr(kron, "_SLICE_ELEMENTS", 7)
    lazy, grid = CHAINS[chain](random_kron(True, dtype)), CHAINS[chain](random_kron(False, dtype))
    assert lazy.rules == grid.rules and lazy.structure == grid.structure
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(4, lazy.space.dim, generator=g, dtype=F64).to(dtype)
    assert torch.equal(lazy.apply(rows), grid.apply(rows))
    for name, s in lazy.space.offsets().items():
        assert torch.equal(lazy.apply_block(name, rows[:, s].clone()), grid.apply_block(name, rows[:, s].clone()))
        assert torch.equal(lazy.eigenvalues[name], grid.eigenvalues[name])
    assert lazy.trace() == grid.trace()


def test_a_chain_holds_the_bytes_of_one_operator():
    """Damped, inverted and powered operators share their base: K-FAC's vectors (out + in
    numbers per block, not out·in), never a grid per operator."""
    H = random_kron(True)
    chain = [H, H.damp(0.3), H.damp(0.3).inverse(), H.damp(0.3).power(-0.5)]
    bases = sum(Q.numel() * 8 for Qs in H.bases.values() for Q in Qs)
    assert all(op.nbytes() == bases + sum(8 * (o + i) for o, i in SHAPES.values()) for op in chain)
    assert distinct_bytes(chain) == H.nbytes()
    grid = random_kron(False)
    assert grid.nbytes() == bases + sum(8 * o * i for o, i in SHAPES.values())


def test_refusals_of_the_inverse_and_of_powers_are_those_of_the_grid():
    """The checks read Λ's extremes: the same error, with the same message, when the step is
    added (not later, when Λ is applied)."""
    lazy, grid = random_kron(True), random_kron(False)
    for op in (lazy, grid):     # a zero eigenvalue: singular
        op.parts["a"] = BlockEigenvalues((torch.zeros(5, dtype=F64), torch.ones(3, dtype=F64))) \
            if op is lazy else BlockEigenvalues((torch.zeros(5, 3, dtype=F64),))
    messages = []
    for op in (lazy, grid):
        with pytest.raises(OperatorError, match="cannot invert") as err:
            op.inverse("H")
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    messages = []
    for op in (random_kron(True).scale(-1.0), random_kron(False).scale(-1.0)):   # indefinite
        with pytest.raises(OperatorError, match="indefinite") as err:
            op.power(0.5, "H")
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def small_gpt2(vocab=300):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=vocab, n_positions=16, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("curvature", ["kfac", "ekfac"])
@pytest.mark.parametrize("diagonal_width", [10 ** 6, 100])
def test_the_executor_holds_one_operator_per_chain_after_influence(curvature, diagonal_width):
    """After K-FAC / EK-FAC influence with ``layers="all"`` (a tied vocabulary-wide
    embedding/head: diagonal with ``kron_diagonal_width=100``), every operator the executor
    memoized (K-FAC, damped, inverted; EK-FAC's K-FAC basis) together holds what the planner
    counts for the operator its job produces (:func:`kron_output_bytes`), plus the K-FAC
    vectors an EK-FAC keeps beside its re-fitted grid. Before, each damp → inverse step
    held one more grid (three grids for K-FAC, four for EK-FAC)."""
    g = torch.Generator().manual_seed(0)
    seqs = [{"input_ids": torch.randint(0, 300, (6,), generator=g)} for _ in range(5)]
    task = ga.tasks.causal_lm(small_gpt2())
    with ga.options(kron_diagonal_width=diagonal_width):
        S = ga.methods.influence(task, seqs[:3], seqs[3:], curvature=curvature, layers="all")
        ex = LocalExecutor()
        scores = ex.scores(S.expr)
        o = ex.options
    assert torch.isfinite(torch.as_tensor(scores)).all()
    krons = [op for op in list(ex.state.ops.values()) + list(ex.state.kron.values()) if isinstance(op, KronOp)]
    assert len(krons) >= 3                          # the statistics, damped and inverted operators
    space = krons[0].space
    held = distinct_bytes(krons)
    bases = sum(Q.numel() * Q.element_size() for Qs in krons[0].bases.values() for Q in Qs if Q is not None)
    grid = sum(8 * b.dim for b in space.blocks)      # one float64 (out, in) grid per block
    # float32 rows: the bases are stored in float32, as the planner counts them (basis_dtype)
    assert all(Q.dtype == torch.float32 for Qs in krons[0].bases.values() for Q in Qs if Q is not None)
    rows = torch.float32
    if curvature == "kfac":
        assert held == kron_output_bytes(space, o.kron_float64_width, o.kron_diagonal_width, rows_dtype=rows)
        assert all(op.nbytes() == held for op in krons)   # each of the chain's operators: the same numbers
        assert held < bases + grid                       # not even one grid
    else:
        vectors = kron_output_bytes(space, o.kron_float64_width, o.kron_diagonal_width, rows_dtype=rows) - bases
        refit = kron_output_bytes(space, o.kron_float64_width, o.kron_diagonal_width, refit=True, rows_dtype=rows)
        assert held == refit + vectors < bases + 2 * grid   # one grid (the re-fitted Λ)
