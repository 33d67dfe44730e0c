"""The products job's memory per example, measured on the meta device: what autograd saves for the
backward (distinct storages, the parameters, buffers and batch left out, split by whether a saved
tensor needs the free parameters' gradient), the forward's working set beside it, and a Hessian
product's own peak (:func:`gradalg.curvature.hvp.held_per_example`). Before, the job counted the
leaf modules' outputs: a tiny GPT-2's products held 1.3–2.1× the estimate (attention's functional
ops, the loss and the tangents of the backward's temporaries are no leaf module's output), and a
ReLU conv net's were over-counted (a conv's pre-ReLU output is freed)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import gradalg as ga
from gradalg.plan.decisions import DecisionKind
from gradalg.plan.shapes import _measure_on_meta
from test_products_groups import _peak_bytes


def tanh_net():
    """Linear(4, 8) → Tanh → Linear(8, 3), float64 (8 bytes a number)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


@pytest.mark.parametrize("objective, free, expected", [
    # the outputs (the Gauss-Newton's vjp), every parameter free: the tanh output h (1, 8), saved by
    # Tanh (its result) and by the second Linear (its input) on one storage, counted once: 64 bytes,
    # and it needs the gradient (it depends on the first Linear's weights). The first Linear's input is
    # the batch and the Linears' weights are parameters: not counted.
    ("forward", ["0.weight", "0.bias", "2.weight", "2.bias"], (0, 64)),
    # only the last Linear free: h is saved for its weight's gradient but needs none itself (plain)
    ("forward", ["2.weight", "2.bias"], (64, 0)),
    # the summed loss (the Hessian's grad): also cross-entropy's log-softmax (1, 3), 24 bytes that
    # need the gradient, and its nll's total weight, a float64 scalar (8 bytes, plain)
    ("summed_loss", ["0.weight", "0.bias", "2.weight", "2.bias"], (8, 88)),
])
def test_the_saved_bytes_of_one_example_are_the_distinct_storages_autograd_saves(objective, free, expected):
    task = ga.tasks.classification(tanh_net())
    batch = (torch.randn(1, 4, dtype=torch.float64), torch.tensor([1]))
    fn = task.forward if objective == "forward" else task.summed_loss
    _, activations, saved = _measure_on_meta(task, batch, [], fn, free)
    assert activations == 8 + 8 + 3                    # the leaf outputs, as before
    assert saved[:2] == expected
    # working: at the Tanh, its input (the pre-activation) and its output are both alive and neither
    # is saved yet: 2 × 64 bytes; nothing later holds more beside the saved ones
    assert saved[2] == 128


class Reads(nn.Module):
    """Linear(4, 3) whose forward reads a value of its input (``.item()``): it cannot run on meta."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x) * float(x.abs().sum().item() > 0)


def test_the_saved_bytes_fall_back_where_the_forward_needs_numbers():
    """A forward that reads a value (``.item()``) cannot run on meta: no saved bytes (None), not a
    partial count."""
    task = ga.tasks.classification(Reads())
    _, _, saved = _measure_on_meta(task, (torch.randn(1, 4), torch.tensor([1])), [], task.forward, ["fc.weight"])
    assert saved is None


def tiny_gpt2():
    """``benchmarks/alternating.py``'s GPT-2 (2 layers, width 64, 2 heads, vocabulary 256, T = 32,
    tied head), eager attention."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("kind", ["hessian", "gauss_newton"])
def test_a_tiny_gpt2_products_call_holds_no_more_than_the_job_prices(kind):
    """One batch of 8 sequences of 32 tokens, 4 vectors through ``vmap``, the first attention
    projection's products: torch.profiler's peak is at most the job's memory and not below two
    thirds of it. Before (leaf module outputs, floored by ``activation_bytes``) the estimate was
    0.5 (Hessian) and 0.6–0.8 (Gauss-Newton) of the peak: a plan that fit could exceed its budget."""
    from gradalg.curvature.hvp import Products
    from gradalg.eval_mode import eval_mode
    from gradalg.exec import LocalExecutor
    model, m = tiny_gpt2(), 4
    g = torch.Generator().manual_seed(0)
    data = {"input_ids": torch.randint(0, 256, (8, 32), generator=g)}
    task = ga.tasks.causal_lm(model)
    make = ga.hessian if kind == "hessian" else ga.gauss_newton
    with ga.options(batch_size=8, products_vmap_elements=0, progress=False):
        plan = LocalExecutor().plan(make(task, data, layers=["transformer.h.0.attn.c_proj"]).expr)
        [step] = [p for p in plan.passes if p.per_call]
        job = replace(step.jobs[0], groups=((1, m, ""),))
        estimate = job.fixed_bytes(plan.facts) + job.per_example_bytes(plan.facts) * 8
        products = Products(task, job.target.data, job.target.layers, kind, batching=job.batching)
        _, batch = next(products.batches(8))
        V = torch.randn(m, job.target.space.dim, generator=g)
        with eval_mode(model):
            measured = _peak_bytes(lambda: products.batch_rows(batch, V, 0))
    assert measured <= estimate <= 1.5 * measured, estimate / measured
    [decision] = plan.decisions.of(DecisionKind.PRODUCTS_BATCHING)
    assert ("Hessian product on the meta device" if kind == "hessian" else "autograd's saved tensors") \
        in decision.reason


def test_the_plan_names_the_fallback_where_meta_cannot_run_the_forward():
    """A model whose forward reads a value is priced by today's rule (the weight layers' activations
    once for the primal and once per vector), and the products' decision says so."""
    from gradalg.exec import LocalExecutor

    g = torch.Generator().manual_seed(0)
    task = ga.tasks.classification(Reads())
    with ga.options(batch_size=8, progress=False):
        plan = LocalExecutor().plan(ga.gauss_newton(task, (torch.randn(16, 4, generator=g),
                                                           torch.randint(0, 3, (16,), generator=g))).expr)
    [decision] = plan.decisions.of(DecisionKind.PRODUCTS_BATCHING)
    assert "memory: fallback, activation_bytes" in decision.reason


def _formation_job(model, data, **options):
    """The products job of the formed Hessian of ``model`` (classification) on ``data``, planned, and the plan."""
    from gradalg.exec import LocalExecutor
    from gradalg.expr.curvature import Formed
    with ga.options(progress=False, **options):
        plan = LocalExecutor().plan(Formed(ga.hessian(ga.tasks.classification(model), data).expr))
    [step] = [p for p in plan.passes if p.per_call]
    return step.jobs[0], step, plan


def test_a_float32_formation_prices_its_float64_identity_columns_at_8_bytes():
    """Linear(4, 3) in float32: dim = 3·(4 + 1) = 15, one call of the formation's 15 float64 identity
    columns (a chunk of 256 > 15). Held at once: the formed rows, the (15, 15) float64 H, 1,800 bytes
    (before session 49's ``formedrows``: in no estimate); V in float64, 15·15·8 = 1,800 bytes; its copy
    cast to float32, the running sum and a batch's products twice (per parameter, as rows), 4 × 15·15·4 =
    3,600: 7,200. Before session 49 V was priced at the model's 4 bytes: 4 × 15·15·4 = 3,600. A float64
    model's columns need no cast: 15·15·8 + 4 × 15·15·8 = 9,000."""
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g))
    torch.manual_seed(0)
    job, _, plan = _formation_job(nn.Linear(4, 3), data)
    assert job.groups == ((1, 15, "formed: 15 products, 256 per call"),)
    assert job.fixed_bytes(plan.facts) == 15 * 15 * 8 + 15 * 15 * 8 + 4 * 15 * 15 * 4 == 7_200
    job, _, plan = _formation_job(nn.Linear(4, 3).double(), (data[0].double(), data[1]))
    assert job.fixed_bytes(plan.facts) == 15 * 15 * 8 + 4 * 15 * 15 * 8 == 9_000


def test_a_float32_mlp_formation_call_holds_no_more_than_the_job_prices():
    """One call of a float32 MLP's formation (64 → 32 → 10, dim 2,410: 256 float64 identity columns,
    as :class:`~gradalg.expr.curvature.Formed` passes them) over 4 examples, where V and the sums
    outweigh the activations: torch.profiler's peak plus the columns themselves is at most the job's
    memory and not below two thirds of it. On main (V priced at 4 bytes a number) the estimate was
    0.8 of the peak: a plan that fit could exceed its budget. The call alone: the formed rows beside
    it (``job.beside``) are the whole formation's (the test below)."""
    from gradalg.eval_mode import eval_mode
    from gradalg.plan.jobs import ProductPass
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    g = torch.Generator().manual_seed(0)
    job, step, plan = _formation_job(model, (torch.randn(4, 64, generator=g), torch.randint(0, 10, (4,), generator=g)))
    d = job.target.space.dim
    assert job.beside == 8 * d * d
    job = replace(job, beside=0.0)
    estimate = job.fixed_bytes(plan.facts) + job.per_example_bytes(plan.facts) * step.batch_size
    V = torch.zeros(256, d, dtype=torch.float64)
    V[:, :256].fill_diagonal_(1.0)
    call = ProductPass(job, RUN)
    with eval_mode(model):
        measured = _peak_bytes(lambda: call(V)) + V.numel() * V.element_size()
    assert measured <= estimate <= 1.5 * measured, estimate / measured


@pytest.mark.parametrize("examples", [4, 256])
def test_a_whole_formation_holds_no_more_than_its_products_pass_prices(examples):
    """The whole formation of a float32 MLP's Hessian (64 → 32 → 10, dim d = 2,410; 10 calls of at most
    256 float64 identity columns), resolved alone (``to_dense``: the products pass is the plan's only
    pass): torch.profiler's peak is at most the products pass's estimate (the formed rows, H, 8·d²
    bytes held beside each call, ``ProductsJob.beside``, and the call's own memory) and not below
    1/1.3 of it; over 4 examples the rows dominate, over 256 (batches of 64) the call's activations
    weigh too. Before (session 49, ``formedrows``) the rows were in no estimate and the formation
    concatenated them and made H + Hᵀ and its half anew: 3 × 8·d² (4 × 8·d² with the d × d identity
    held before ``formed``) beside an estimate of one call's memory, 0.1–0.2 of the peak."""
    from gradalg.expr.curvature import Formed
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(examples, 64, generator=g), torch.randint(0, 10, (examples,), generator=g))
    with ga.options(progress=False, batch_size=64):
        op = ga.Operator(Formed(ga.hessian(ga.tasks.classification(model), data).expr))
        plan = op.explain().plan
        [step] = plan.passes
        measured = _peak_bytes(op.to_dense)
    d = step.jobs[0].target.space.dim
    assert step.jobs[0].beside == 8 * d * d
    assert measured <= step.cost.peak_bytes <= 1.3 * measured, (measured / (8 * d * d), step.cost.peak_bytes / measured)


class Run:
    """An executor's stand-in for a :class:`~gradalg.plan.jobs.ProductPass` run alone: it records its
    calls in ``ctx.pass_stats`` (none here) and holds ``ctx`` weakly, so one kept for the module."""

    pass_stats: tuple = ()


RUN = Run()
