"""Every gradient node type and every operator, checked against dense torch.

Each ``Test*`` class mixes in :class:`gradalg.testing.GradientSetConformance` or
:class:`gradalg.testing.OperatorConformance` and supplies ``create()`` and an independent
``dense_reference()`` built from ``ga.per_example_grads`` (torch.func) and torch math.
The hypothesis tests at the end run the same mixins on drawn shapes and seeds.
"""
from __future__ import annotations

import copy
import functools
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradalg as ga
from gradalg.testing import GradientSetConformance, OperatorConformance
from gradalg.testing.conformance import project_dense

sys.path.insert(0, os.path.dirname(__file__))
import models
from references import block_rows, func_rows, one_thread, reference_rows  # noqa: F401 - one_thread is an autouse fixture

F64 = torch.float64
TIGHT = {"rtol": 1e-8, "atol": 1e-10}   # float64 models: every path agrees to rounding


@functools.cache
def mlp_setup(n=10, n_query=5, d_in=8, hidden=16, classes=3, seed=0, batch_size=4):
    """An MLP task, train and query data and their reference rows (cached per shape)."""
    model = models.mlp(d_in, hidden, classes, seed=seed)
    task = ga.tasks.classification(model)
    train = models.classification_data(n, d_in, classes, seed=seed + 1)
    query = models.classification_data(n_query, d_in, classes, seed=seed + 2)
    layers = ("0", "2")
    G = ga.grads(task, train, list(layers), batch_size=batch_size, ids=[f"z{i}" for i in range(n)])
    Q = ga.grads(task, query, list(layers), batch_size=batch_size)
    return {"model": model, "task": task, "train": train, "query": query, "G": G, "Q": Q,
                "R": reference_rows(task, train, layers), "RQ": reference_rows(task, query, layers)}


def spd(dim, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=gen, dtype=F64)
    return a @ a.T / dim + 0.5 * torch.eye(dim, dtype=F64)


def positive(dim, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(dim, generator=gen, dtype=F64) + 0.25


# ====================================================================== gradient nodes
class MLPCase:
    """Shared: a gradient set derived from the cached MLP setup (``params`` picks the shape)."""

    rtol, atol = TIGHT["rtol"], TIGHT["atol"]
    params: dict | None = None   # mlp_setup keywords (hypothesis sets them per instance)

    @property
    def setup(self):
        return mlp_setup(**(self.params or {}))


class TestSourceHooksMLP(MLPCase, GradientSetConformance):
    def create(self):
        return self.setup["G"]

    def dense_reference(self):
        return self.setup["R"]


class TestSourceHooksCNN(GradientSetConformance):
    rtol, atol = TIGHT["rtol"], TIGHT["atol"]

    @staticmethod
    @functools.cache
    def _setup():
        model = models.cnn()
        task = ga.tasks.classification(model)
        data = models.image_data(n=7)
        layers = ["conv1", "conv2", "fc"]
        return ga.grads(task, data, layers, batch_size=3), reference_rows(task, data, layers)

    def create(self):
        return self._setup()[0]

    def dense_reference(self):
        return self._setup()[1]


class TestSourceHooksGPT2(GradientSetConformance):
    """Padded token sequences; Embedding (one-hot factors), HF Conv1D and a bias-free Linear."""

    rtol, atol = 1e-7, 1e-9
    proj_k = 4

    @staticmethod
    @functools.cache
    def _setup():
        model = models.gpt2(n_layer=2, n_embd=16, vocab=31)
        task = models.lm_task(model)
        data = models.padded_token_data(n=5, vocab=31, max_len=7)
        layers = ["transformer.wte", "transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_attn", "lm_head"]
        G = ga.grads(task, data, layers, batch_size=3, ids=[f"seq{i}" for i in range(5)])
        return G, reference_rows(task, data, layers)

    def create(self):
        return self._setup()[0]

    def dense_reference(self):
        return self._setup()[1]


class TestSourceFunc(GradientSetConformance):
    """backend="func" on a model with a LayerNorm (which hooks do not support)."""

    rtol, atol = TIGHT["rtol"], TIGHT["atol"]

    @staticmethod
    @functools.cache
    def _setup():
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
        task = ga.tasks.classification(model)
        data = models.classification_data(9, 5, 3, seed=4)
        layers = ["0", "1", "3"]
        return ga.grads(task, data, layers, backend="func", batch_size=4), func_rows(task, data, layers)

    def create(self):
        return self._setup()[0]

    def dense_reference(self):
        return self._setup()[1]

    def test_blocks_are_dense_params(self):
        G = self.create()
        assert set(G.representation.values()) == {"dense"}
        assert [b.shape for b in G.space.blocks] == [(36,), (12,), (21,)]


class ProjectCase(MLPCase, GradientSetConformance):
    projector = ga.proj.gaussian(8, seed=1)

    def create(self):
        return self.projector(self.setup["G"])

    def dense_reference(self):
        return project_dense(self.setup["R"], self.setup["G"].space, self.projector)


class TestProjectGaussian(ProjectCase):
    projector = ga.proj.gaussian(8, seed=1)


class TestProjectGaussianPerBlock(ProjectCase):
    projector = ga.proj.gaussian(5, seed=2, per_block=True)


class TestProjectRademacher(ProjectCase):
    projector = ga.proj.rademacher(7, seed=3)


class TestProjectRademacherPerBlock(ProjectCase):
    projector = ga.proj.rademacher(4, seed=4, per_block=True)


class TestProjectKron(ProjectCase):
    projector = ga.proj.kron(6, seed=5)


class TestProjectKronExplicitSplit(ProjectCase):
    projector = ga.proj.kron(8, seed=6, k_out=2, k_in=4)


class TestNormalize(MLPCase, GradientSetConformance):
    def create(self):
        return self.setup["G"].normalize()

    def dense_reference(self):
        R = self.setup["R"]
        return R / R.norm(dim=1, keepdim=True)


class TestSelect(MLPCase, GradientSetConformance):
    def create(self):
        return self.setup["G"].select(["2"])

    def dense_reference(self):
        return self.setup["R"][:, 16 * 9:]


class TestPreconditionDense(MLPCase, GradientSetConformance):
    def create(self):
        G = self.setup["G"]
        return G @ ga.dense(spd(G.space.dim, 7), G)

    def dense_reference(self):
        R = self.setup["R"]
        return R @ spd(R.shape[1], 7)


class TestPreconditionFisherInverse(MLPCase, GradientSetConformance):
    """P(Q) @ (F + λI)⁻¹ with F the Fisher of P(G): a Precondition whose operator needs a pass."""

    P = ga.proj.kron(4, seed=8)

    def create(self):
        s = self.setup
        return self.P(s["Q"]) @ ga.fisher(self.P(s["G"])).damp(0.1).inv()

    def dense_reference(self):
        s = self.setup
        RG = project_dense(s["R"], s["G"].space, self.P)
        RQ = project_dense(s["RQ"], s["G"].space, self.P)
        H = RG.T @ RG / RG.shape[0] + 0.1 * torch.eye(RG.shape[1], dtype=F64)
        return torch.linalg.solve(H, RQ.T).T


class TestScaleRowsConstant(MLPCase, GradientSetConformance):
    def create(self):
        return self.setup["G"] * 0.7

    def dense_reference(self):
        return 0.7 * self.setup["R"]


def _one_minus_p(model, batch):
    x, y = batch
    return 1 - torch.softmax(model(x), -1).gather(1, y[:, None]).squeeze(1)


class TestScaleRowsWeights(MLPCase, GradientSetConformance):
    """Per-example weights computed from the batches (TRAK's 1 − p)."""

    weights = ga.row_weights(_one_minus_p, "1 - p")

    def create(self):
        return self.setup["G"] * self.weights

    def dense_reference(self):
        s = self.setup
        with torch.no_grad():
            w = _one_minus_p(s["model"], s["train"])
        return w[:, None] * s["R"]


class TestCaptured(GradientSetConformance):
    """``ga.capture`` around an SGD loop: each step's rows at that step's weights."""

    rtol, atol = TIGHT["rtol"], TIGHT["atol"]

    @staticmethod
    @functools.cache
    def _setup():
        model = models.mlp(6, 7, 3, seed=5)
        x, y = models.classification_data(10, 6, 3, seed=6)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        steps = []
        with ga.capture(model, layers=["0", "2"]) as cap:
            for start in range(0, 10, 4):
                batch = (x[start:start + 4], y[start:start + 4])
                steps.append((copy.deepcopy(model.state_dict()), batch))   # weights before the step
                opt.zero_grad()
                F.cross_entropy(model(batch[0]), batch[1], reduction="sum").backward()
                opt.step()
        refs = []
        for state, batch in steps:   # outside the capture: the reference runs its own forwards
            snapshot = copy.deepcopy(model)
            snapshot.load_state_dict(state)
            refs.append(reference_rows(ga.tasks.classification(snapshot), batch, ("0", "2")))
        return cap, torch.cat(refs)

    def create(self):
        return self._setup()[0].grads

    def dense_reference(self):
        return self._setup()[1]


class TestGroupMean(MLPCase, GradientSetConformance):
    """Rows averaged within groups; the ids are the group labels, in order of appearance."""

    labels = ("b", "a", "b", "c", "a", "b", "c", "c", "a", "b")

    def create(self):
        return self.setup["G"].group_mean(self.labels)

    def dense_reference(self):
        R = self.setup["R"]
        order = list(dict.fromkeys(self.labels))
        return torch.stack([R[[i for i, g in enumerate(self.labels) if g == label]].mean(0) for label in order])

    def test_ids_are_the_labels(self):
        assert self.create().ids == ("b", "a", "c")


class TestNormalizeMetric(MLPCase, GradientSetConformance):
    """g / √⟨g, H g⟩ (RelatIF's metric normalization)."""

    def create(self):
        G = self.setup["G"]
        return G.normalize(ga.dense(spd(G.space.dim, 9), G))

    def dense_reference(self):
        R = self.setup["R"]
        M = spd(R.shape[1], 9)
        return R / ((R @ M) * R).sum(1, keepdim=True).sqrt()


class TestAdamPrecondition(GradientSetConformance):
    """LESS's Adam transform m/(√v + ε) with the moments of a real torch.optim.Adam."""

    rtol, atol = TIGHT["rtol"], TIGHT["atol"]

    @staticmethod
    @functools.cache
    def _setup():
        model = models.mlp(5, 6, 3, seed=11)
        task = ga.tasks.classification(model)
        x, y = models.classification_data(8, 5, 3, seed=12)
        opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95), eps=1e-6)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()
            opt.step()
        layers = ("0", "2")
        G = ga.grads(task, (x, y), list(layers), batch_size=3)
        state = {name: {k: opt.state[p][k].unsqueeze(0) for k in ("exp_avg", "exp_avg_sq")}
                 for name, p in model.named_parameters()}
        m0 = block_rows(model, layers, {n: v["exp_avg"] for n, v in state.items()})[0]
        v0 = block_rows(model, layers, {n: v["exp_avg_sq"] for n, v in state.items()})[0]
        R = reference_rows(task, (x, y), layers)
        m, v = 0.8 * m0 + 0.2 * R, 0.95 * v0 + 0.05 * R * R
        return G.adam(ga.adam_state(opt, G)), m / (v.sqrt() + 1e-6)

    def create(self):
        return self._setup()[0]

    def dense_reference(self):
        return self._setup()[1]


# ====================================================================== operators
class MLPOperatorCase(MLPCase, OperatorConformance):
    """An operator on the MLP's gradient space (or a projection of it, ``P``)."""

    P = None

    def G(self):
        G = self.setup["G"]
        return self.P(G) if self.P is not None else G

    def R(self, key="R"):
        R = self.setup[key]
        return project_dense(R, self.setup["G"].space, self.P) if self.P is not None else R

    def gradients(self):
        Q = self.setup["Q"]
        return self.P(Q) if self.P is not None else Q

    def gradients_reference(self):
        return self.R("RQ")

    def fisher_reference(self):
        R = self.R()
        return R.T @ R / R.shape[0]


class TestIdentity(MLPOperatorCase):
    def create(self):
        return ga.identity(self.G())

    def dense_reference(self):
        return torch.eye(self.G().space.dim, dtype=F64)


class TestDiagonal(MLPOperatorCase):
    def create(self):
        return ga.diagonal(positive(self.G().space.dim, 1), self.G())

    def dense_reference(self):
        return torch.diag(positive(self.G().space.dim, 1))


class TestDense(MLPOperatorCase):
    def create(self):
        return ga.dense(spd(self.G().space.dim, 2), self.G())

    def dense_reference(self):
        return spd(self.G().space.dim, 2)


class FisherCase(MLPOperatorCase):
    structure = "dense"

    def create(self):
        return ga.fisher(self.G(), self.structure)

    def dense_reference(self):
        Fm = self.fisher_reference()
        if self.structure == "diag":
            return torch.diag(torch.diagonal(Fm))
        if self.structure == "block":
            space = self.G().space
            mask = torch.block_diag(*(torch.ones(b.dim, b.dim, dtype=F64) for b in space.blocks))
            return Fm * mask
        return Fm


class TestFisherDenseUnprojected(FisherCase):
    inv_damping = 0.05


class TestFisherBlockUnprojected(FisherCase):
    structure = "block"
    inv_damping = 0.05


class TestFisherDiagUnprojected(FisherCase):
    structure = "diag"
    inv_damping = 0.05


class TestFisherDenseProjected(FisherCase):
    P = ga.proj.gaussian(6, seed=3)


class TestFisherBlockKron(FisherCase):
    P = ga.proj.kron(4, seed=4)
    structure = "block"


class TestFisherDiagPerBlock(FisherCase):
    P = ga.proj.rademacher(3, seed=5, per_block=True)
    structure = "diag"


class TestFisherCaptured(OperatorConformance):
    """The Fisher of gradients recorded by ``ga.capture`` (float64 model)."""

    rtol, atol = TIGHT["rtol"], TIGHT["atol"]
    P = ga.proj.gaussian(5, seed=9)

    def create(self):
        return ga.fisher(self.P(TestCaptured._setup()[0].grads))

    def dense_reference(self):
        cap, R = TestCaptured._setup()
        Rp = project_dense(R, cap.grads.space, self.P)
        return Rp.T @ Rp / Rp.shape[0]


class TestDamp(MLPOperatorCase):
    P = ga.proj.gaussian(6, seed=3)

    def create(self):
        return ga.fisher(self.G()).damp(0.2)

    def dense_reference(self):
        return self.fisher_reference() + 0.2 * torch.eye(6, dtype=F64)


class TestInverse(MLPOperatorCase):
    P = ga.proj.kron(4, seed=4)

    def create(self):
        return ga.fisher(self.G()).damp(0.1).inv()

    def dense_reference(self):
        return torch.linalg.inv(self.fisher_reference() + 0.1 * torch.eye(8, dtype=F64))


class TestInverseBlock(MLPOperatorCase):
    P = ga.proj.kron(4, seed=4)

    def create(self):
        return ga.fisher(self.G(), "block").damp(0.1).inv()

    def dense_reference(self):
        Fm = self.fisher_reference()
        blocks = [Fm[:4, :4], Fm[4:, 4:]]
        return torch.block_diag(*(torch.linalg.inv(b + 0.1 * torch.eye(4, dtype=F64)) for b in blocks))


class TestInverseDiagonal(MLPOperatorCase):
    def create(self):
        return ga.diagonal(positive(self.G().space.dim, 3), self.G()).inv()

    def dense_reference(self):
        return torch.diag(1 / positive(self.G().space.dim, 3))


class TestPower(MLPOperatorCase):
    P = ga.proj.gaussian(6, seed=3)

    def create(self):
        return ga.fisher(self.G()).damp(0.1).pow(0.5)

    def dense_reference(self):
        evals, evecs = torch.linalg.eigh(self.fisher_reference() + 0.1 * torch.eye(6, dtype=F64))
        return (evecs * evals.sqrt()) @ evecs.T


class TestPowerNegative(MLPOperatorCase):
    def create(self):
        return ga.dense(spd(self.G().space.dim, 4), self.G()).pow(-0.5)

    def dense_reference(self):
        evals, evecs = torch.linalg.eigh(spd(self.G().space.dim, 4))
        return (evecs * evals.rsqrt()) @ evecs.T


class TestScaledOp(MLPOperatorCase):
    def create(self):
        return 2.5 * ga.dense(spd(self.G().space.dim, 2), self.G())

    def dense_reference(self):
        return 2.5 * spd(self.G().space.dim, 2)


class TestSumOp(MLPOperatorCase):
    P = ga.proj.gaussian(6, seed=3)

    def create(self):
        return ga.fisher(self.G()) + ga.diagonal(positive(6, 5), self.G())

    def dense_reference(self):
        return self.fisher_reference() + torch.diag(positive(6, 5))


class TestSumOpBlockPlusIdentity(MLPOperatorCase):
    P = ga.proj.kron(4, seed=4)

    def create(self):
        return ga.fisher(self.G(), "block") * 0.5 + ga.identity(self.G())

    def dense_reference(self):
        Fm = self.fisher_reference()
        return 0.5 * torch.block_diag(Fm[:4, :4], Fm[4:, 4:]) + torch.eye(8, dtype=F64)


class KFACCase(MLPOperatorCase):
    """K-FAC per layer: S ⊗ A with S = (1/n) Σ d dᵀ, A = (1/n) Σ a aᵀ (T = 1: the bias
    column of each reference gradient is d, the inputs with a ones column are a)."""

    inv_damping = 0.05
    rtol, atol = 1e-7, 1e-9

    def factors(self):
        s = self.setup
        x = s["train"][0]
        with torch.no_grad():
            h = torch.tanh(s["model"][0](x))
        ones = torch.ones(len(x), 1, dtype=F64)
        R = s["R"]
        n, hidden = len(x), s["model"][0].out_features
        blocks = s["G"].space.blocks
        d0 = R[:, :blocks[0].dim].reshape(n, *blocks[0].shape)[:, :, -1]
        d2 = R[:, blocks[0].dim:].reshape(n, *blocks[1].shape)[:, :, -1]
        assert d0.shape[1] == hidden
        return [(d0, torch.cat([x, ones], 1), R[:, :blocks[0].dim].reshape(n, *blocks[0].shape)),
                (d2, torch.cat([h, ones], 1), R[:, blocks[0].dim:].reshape(n, *blocks[1].shape))]


class TestKFAC(KFACCase):
    def create(self):
        return ga.kfac(self.setup["G"])

    def dense_reference(self):
        n = self.setup["R"].shape[0]
        return torch.block_diag(*(torch.kron(d.T @ d / n, a.T @ a / n) for d, a, _ in self.factors()))


class TestEKFAC(KFACCase):
    """EK-FAC: K-FAC's eigenbasis Q_S ⊗ Q_A, eigenvalues refitted: λ = mean_i (Q_Sᵀ G_i Q_A)²."""

    def create(self):
        return ga.ekfac(self.setup["G"])

    def dense_reference(self):
        n = self.setup["R"].shape[0]
        out = []
        for d, a, G in self.factors():
            QS, QA = torch.linalg.eigh(d.T @ d / n)[1], torch.linalg.eigh(a.T @ a / n)[1]
            lam = ((QS.T @ G @ QA) ** 2).mean(0).flatten()
            Q = torch.kron(QS, QA)
            out.append(Q @ torch.diag(lam) @ Q.T)
        return torch.block_diag(*out)


# ====================================================================== properties
mlp_shapes = {"n": st.integers(2, 7), "n_query": st.integers(1, 4), "d_in": st.integers(1, 5),
                  "hidden": st.integers(1, 6), "classes": st.integers(2, 4), "seed": st.integers(0, 50),
                  "batch_size": st.integers(1, 5)}


@settings(max_examples=4, deadline=None)
@given(**mlp_shapes)
def test_source_hooks_property(**params):
    case = TestSourceHooksMLP()
    case.params = params
    case.run_conformance()


@settings(max_examples=4, deadline=None)
@given(kind=st.sampled_from(["gaussian", "gaussian_pb", "rademacher", "rademacher_pb", "kron"]),
       k=st.integers(1, 9), proj_seed=st.integers(0, 10**6), **mlp_shapes)
def test_project_property(kind, k, proj_seed, **params):
    make = {"gaussian": lambda: ga.proj.gaussian(k, proj_seed),
            "gaussian_pb": lambda: ga.proj.gaussian(k, proj_seed, per_block=True),
            "rademacher": lambda: ga.proj.rademacher(k, proj_seed),
            "rademacher_pb": lambda: ga.proj.rademacher(k, proj_seed, per_block=True),
            "kron": lambda: ga.proj.kron(k, proj_seed)}[kind]
    case = ProjectCase()
    case.params = params
    case.projector = make()
    case.proj_k = 3
    case.run_conformance()


@settings(max_examples=4, deadline=None)
@given(structure=st.sampled_from(["dense", "block", "diag"]), k=st.integers(1, 6),
       proj_seed=st.integers(0, 10**6), **mlp_shapes)
def test_fisher_property(structure, k, proj_seed, **params):
    case = FisherCase()
    case.params = params
    case.P = ga.proj.gaussian(k, proj_seed, per_block=True)
    case.structure = structure
    case.inv_damping = 0.1
    case.run_conformance()


def test_mixins_are_not_collected_themselves():
    """The mixins ship without a ``Test`` prefix, so pytest collects only concrete subclasses."""
    assert not GradientSetConformance.__name__.startswith("Test")
    assert not OperatorConformance.__name__.startswith("Test")
    with pytest.raises(NotImplementedError):
        GradientSetConformance().create()
