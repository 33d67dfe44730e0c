"""A per-example weight function's identity (``ga.row_weights``) is its code, defaults and
closure, not its address: equal definitions give equal tokens (in this process and in another),
different ones different tokens, so no cache keyed by an expression's token can serve the rows
of one weight function for another."""
import subprocess
import sys

import torch

import gradalg as ga


def _scaled(c):
    def weight(model, batch):
        return torch.full((len(batch[0]),), c)
    return weight


def test_equal_definitions_give_equal_tokens_and_different_ones_differ():
    a, b, c = ga.row_weights(_scaled(2.0)), ga.row_weights(_scaled(2.0)), ga.row_weights(_scaled(3.0))
    assert a.fn is not b.fn
    assert a.token == b.token                 # by address these differed
    assert a.token != c.token                 # same name and code, another closed-over value
    assert ga.row_weights(_scaled(2.0), "w").token != a.token


def test_the_token_is_the_same_in_another_process():
    code = ("import torch, gradalg as ga\n"
            "def weight(model, batch):\n"
            "    return torch.ones(len(batch[0]))\n"
            "print(ga.row_weights(weight).token)\n")
    tokens = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
              .stdout.strip() for _ in range(2)}
    assert len(tokens) == 1 and next(iter(tokens)).startswith("rowweights-weight-")


def test_scaled_rows_follow_their_function():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    task = ga.tasks.classification(model)
    G = ga.grads(task, (x, y))
    dense = torch.as_tensor((G @ G.T).compute().values)
    for c in (2.0, 3.0):
        got = torch.as_tensor(((G * ga.row_weights(_scaled(c))) @ G.T).compute().values)
        torch.testing.assert_close(got, c * dense)
