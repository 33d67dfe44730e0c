"""A pass draws each block's projection matrix once, however many blocks the model has, and
the executor forgets the matrices when the plan's run ends. A cache of 64 entries redrew every
matrix at every batch of a model with more projected layers (a 32-layer Llama has 224 block
Linears), while the plan priced one draw per block."""
from __future__ import annotations

import torch
from torch import nn

import gradalg as ga
from gradalg.proj import matrices


def deep_mlp(layers: int = 70) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(8, 3)).double()


def test_each_block_is_drawn_once_per_run_and_forgotten_after(monkeypatch):
    model = deep_mlp()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(24, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (24,), generator=g)
    task = ga.tasks.classification(model)
    G, Q = ga.grads(task, (X, y), batch_size=4), ga.grads(task, (X[:3], y[:3]))
    P = ga.proj.kron(k=4, seed=3)
    blocks = len(G.space.blocks)
    assert blocks == 71
    draws = []
    real = matrices._draw
    monkeypatch.setattr(matrices, "_draw", lambda *a: draws.append(a) or real(*a))
    matrices.clear_caches()
    scores = (P(Q) @ P(G).T).compute()
    assert len(draws) == 2 * blocks          # P_out and P_in of every block, once for the 6 + 1 batches
    assert matrices._kron.cache_info().currsize == 0      # forgotten when the run ended
    # the same numbers as projecting each example's dense gradient with the same matrices
    dense = torch.cat([G.to_dense()[b.name].flatten(1) for b in G.space.blocks], 1)
    dq = torch.cat([Q.to_dense()[b.name].flatten(1) for b in Q.space.blocks], 1)

    def project(rows):
        out, start = [], 0
        for b in G.space.blocks:
            P_out, P_in = ga.proj.kron_matrices(P, b.name, *b.shape, dtype=torch.float64)
            block = rows[:, start:start + b.dim].reshape(-1, *b.shape)
            out.append((P_out @ block @ P_in.T).flatten(1))
            start += b.dim
        return torch.cat(out, 1)
    ref = project(dq) @ project(dense).T
    torch.testing.assert_close(torch.as_tensor(scores.values if hasattr(scores, "values") else scores).to(ref),
                               ref, rtol=1e-10, atol=1e-12)
