"""Defaults from the training objective: weight decay read from SGD / Adam / AdamW / a
transformers Trainer (per parameter group), and damping relative to the curvature's
spectrum — each against a dense torch.func reference, and each shown in the plan."""
from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gradalg as ga
from gradalg.objective import ObjectiveError, training_objective

from models import classification_data, mlp
from references import one_thread, reference_rows  # noqa: F401 - one_thread is an autouse fixture

LAYERS = ["0", "2"]


@pytest.fixture()
def setting():
    X, y = classification_data(n=30, d_in=5, classes=3)
    model = mlp(d_in=5, hidden=4, classes=3, seed=0)
    return {"model": model, "task": ga.tasks.classification(model), "X": X, "y": y,
            "train": (X[:24], y[:24]), "query": (X[24:], y[24:])}


def values(scores) -> np.ndarray:
    return np.asarray(scores.compute().values)


def steps(model, opt, X, y, n=3):
    for _ in range(n):
        opt.zero_grad()
        F.cross_entropy(model(X), y).backward()
        opt.step()


def block_vector(model, per_param) -> torch.Tensor:
    """(dim,) in gradalg's layout: per Linear [W | b] row-major, from {param name: tensor}."""
    parts = []
    for name in LAYERS:
        W, b = per_param[f"{name}.weight"], per_param[f"{name}.bias"]
        parts.append(torch.cat([W, b.unsqueeze(-1)], 1).flatten())
    return torch.cat(parts).to(torch.float64)


def empirical_influence(s, lam, decay_diag) -> np.ndarray:
    """Q (F + λI + diag(decay))⁻¹ Gᵀ with F the empirical Fisher of the reference rows."""
    G, Q = reference_rows(s["task"], s["train"], LAYERS), reference_rows(s["task"], s["query"], LAYERS)
    H = G.T @ G / G.shape[0] + lam * torch.eye(G.shape[1], dtype=G.dtype) + torch.diag(decay_diag)
    return (Q @ torch.linalg.solve(H, G.T)).numpy()


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10 * np.abs(want).max())


def test_sgd_coupled_decay_is_wd_identity_and_shown(setting):
    s = setting
    opt = torch.optim.SGD(s["model"].parameters(), lr=0.1, weight_decay=0.02)
    S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="empirical",
                             damping=0.0, optimizer=opt)
    dim = reference_rows(s["task"], s["query"], LAYERS).shape[1]
    close(values(S), empirical_influence(s, 0.0, torch.full((dim,), 0.02, dtype=torch.float64)))
    text = repr(S) + str(S.explain())
    assert "weight_decay=0.02 from SGD param_groups[0]" in text
    same = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="empirical",
                                damping=0.0, weight_decay=0.02)
    assert S.expr == same.expr     # the note is display only: the same expression as weight_decay=0.02
    with pytest.raises(ObjectiveError, match="not both"):
        ga.methods.influence(s["task"], s["train"], s["query"], optimizer=opt, weight_decay=0.02)


def test_param_groups_with_different_decay_are_exact_per_coordinate(setting):
    """Decay on weights, none on biases (Trainer's grouping): diag(wd_j), exactly."""
    s, m = setting, setting["model"]
    weights = [p for n, p in m.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in m.named_parameters() if n.endswith("bias")]
    opt = torch.optim.Adam([{"params": weights, "weight_decay": 0.05}, {"params": biases, "weight_decay": 0.0}])
    steps(m, opt, s["X"], s["y"])          # coupled Adam: the state does not matter, only the groups
    decay = block_vector(m, {n: torch.full_like(p, 0.05 if n.endswith("weight") else 0.0)
                             for n, p in m.named_parameters()})
    for solver in ("direct", "cg"):
        curvature = "empirical" if solver == "direct" else "gauss_newton"
        S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature=curvature,
                                 solver=solver, damping=0.01, optimizer=opt,
                                 solver_settings={"rtol": 1e-12, "max_iter": 500} if solver == "cg" else None)
        if solver == "direct":
            close(values(S), empirical_influence(s, 0.01, decay))
        assert "weight decay per coordinate from Adam param_groups[0] weight_decay=0.05" in repr(S)
    # the CG solution of the Gauss-Newton system with the same diagonal, against a dense GN
    GN = ga.gauss_newton(s["task"], s["train"], LAYERS).to_dense()
    G, Q = reference_rows(s["task"], s["train"], LAYERS), reference_rows(s["task"], s["query"], LAYERS)
    want = (Q @ torch.linalg.solve(GN + 0.01 * torch.eye(GN.shape[0], dtype=GN.dtype) + torch.diag(decay), G.T)).numpy()
    np.testing.assert_allclose(values(S), want, rtol=1e-6, atol=1e-8 * np.abs(want).max())
    # no exact form after a projection, or for K-FAC / DataInf: refused, naming the fix
    with pytest.raises(ObjectiveError, match="projected space"):
        ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, optimizer=opt,
                             projector=ga.proj.gaussian(8))
    for curvature in ("kfac", "ekfac", "datainf"):
        with pytest.raises(ObjectiveError, match="uniform|one λ"):
            ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, optimizer=opt, curvature=curvature)


def test_adamw_decoupled_decay_is_wd_times_adam_denominator(setting):
    s, m = setting, setting["model"]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-6)
    steps(m, opt, s["X"], s["y"], n=4)
    denom = {}
    for n, p in m.named_parameters():
        st = opt.state[p]
        denom[n] = (st["exp_avg_sq"] / (1 - 0.99 ** float(st["step"]))).sqrt() + 1e-6
    decay = 0.1 * block_vector(m, denom)
    S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="empirical",
                             damping=0.0, optimizer=opt)
    close(values(S), empirical_influence(s, 0.0, decay))
    assert "decoupled weight decay wd·(√v̂+ε) from AdamW" in repr(S)
    fresh = torch.optim.AdamW(m.parameters(), weight_decay=0.1)
    with pytest.raises(ObjectiveError, match="at least one step"):
        ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, optimizer=fresh)
    zero = torch.optim.AdamW(m.parameters(), weight_decay=0.0)   # no decay: no state needed
    assert training_objective(zero).decay_term(ga.grads(s["task"], s["train"], LAYERS)).zero


def test_unreadable_optimizers_are_refused(setting):
    s = setting
    with pytest.raises(ObjectiveError, match="RMSprop"):
        training_objective(torch.optim.RMSprop(s["model"].parameters(), weight_decay=0.1))
    other = mlp(d_in=5, hidden=4, classes=3, seed=1)
    with pytest.raises(ObjectiveError, match="does not hold parameter"):
        ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS,
                             optimizer=torch.optim.SGD(other.parameters(), lr=0.1, weight_decay=0.1))


def test_trainer_optimizer_groups_are_read():
    """A transformers Trainer's AdamW: decay on weights, none on biases and LayerNorms."""
    from transformers import Trainer, TrainingArguments

    from models import gpt2
    model = gpt2(n_layer=1, n_embd=16)
    layers = ["transformer.h.0.mlp.c_fc", "lm_head"]
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(output_dir=d, use_cpu=True, report_to=[], weight_decay=0.1, learning_rate=1e-3,
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True)
        trainer = Trainer(model=model, args=args)
        with pytest.raises(ObjectiveError, match="no optimizer yet"):
            training_objective(trainer)
        trainer.create_optimizer()
        ids = torch.randint(1, 101, (2, 6))
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        trainer.optimizer.step()
        model.eval()
        obj = training_objective(trainer)
        G = ga.grads(ga.tasks.causal_lm(model), [{"input_ids": ids[0]}], layers)
        term = obj.decay_term(G)
        assert not term.uniform and "AdamW param_groups[0] weight_decay=0.1" in term.note
        assert "param_groups[1] weight_decay=0" in term.note            # c_fc's bias
        v_hat, eps = obj.second_moment(G)
        fc = dict(model.named_parameters())["transformer.h.0.mlp.c_fc.bias"]
        n_fc = G.space.blocks[0].dim
        bias_cols = term.values[:n_fc].reshape(G.space.blocks[0].shape)[:, -1]   # HF Conv1D: [Wᵀ | b]
        assert torch.all(bias_cols == 0) and term.values[:n_fc].reshape(G.space.blocks[0].shape)[:, :-1].gt(0).all()
        st = trainer.optimizer.state[fc]
        want = st["exp_avg_sq"].double() / (1 - 0.999 ** float(st["step"]))
        torch.testing.assert_close(v_hat[:n_fc].reshape(G.space.blocks[0].shape)[:, -1], want)


def test_default_damping_is_relative_to_the_spectrum(setting):
    """λ = c × tr(H)/dim for an explicit dense H (c = 1), shown in the plan; K-FAC / EK-FAC
    default to λ_b per Kronecker block (``damping="auto"``'s rule, issue 31) and take
    ``relative_damping=c`` for the relative rule; products-only solvers keep an absolute
    default, also shown."""
    s = setting
    G, Q = reference_rows(s["task"], s["train"], LAYERS), reference_rows(s["task"], s["query"], LAYERS)
    Fm = G.T @ G / G.shape[0]
    lam = 1.0 * torch.trace(Fm) / Fm.shape[0]
    S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="empirical")
    close(values(S), (Q @ torch.linalg.solve(Fm + lam * torch.eye(Fm.shape[0], dtype=Fm.dtype), G.T)).numpy())
    assert "damp(λ=1·mean eig) [default: 1 × mean eigenvalue]" in repr(S)
    assert "damp(auto: mass=0.99) [damping='auto'" in repr(
        ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="ekfac"))
    assert "the default for a Kronecker H since issue 31" in repr(
        ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="ekfac"))
    assert "damp(λ=0.1·mean eig) [default: 0.1 × mean eigenvalue]" in repr(
        ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="ekfac",
                             relative_damping=0.1))
    for curvature in ("kfac", "ekfac"):
        C = ga.grads(s["task"], s["train"], LAYERS, objective="expected")
        H = ga.kfac(C, eigen_correction=curvature == "ekfac").to_dense()
        lam = 0.01 * torch.trace(H) / H.shape[0]
        S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature=curvature,
                                 relative_damping=0.01)
        close(values(S), (Q @ torch.linalg.solve(H + lam * torch.eye(H.shape[0], dtype=H.dtype), G.T)).numpy())
    S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, curvature="hessian")
    assert "damp(λ=0.001) [default: no spectrum for products-only H]" in repr(S)
    S = ga.methods.influence(s["task"], s["train"], s["query"], layers=LAYERS, damping=0.01, weight_decay=0.02)
    text = str(S.explain(stage="simplified"))   # curvature='auto' names its choice in the same note
    assert "damp(λ=0.03) [damping (given); curvature='auto': " in text
    assert "ga.options(dense_curvature_dim=4096); not near a minimum: the dense Gauss-Newton + weight_decay=0.02 " \
           "(given)]" in text
