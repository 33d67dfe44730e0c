"""Fused 3-D experts (transformers ≥ 5: OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral) as default
layers, one factored block per expert and matrix (``gradalg.capture.experts``), on tiny
float64 models with 4 experts and top-2 routing:

* Grad-Dot at the LM task's defaults equals the loop-of-backward reference (each sequence
  alone, ``torch.autograd.grad`` of its summed token cross-entropy on the attributed
  parameters), in batches of sequences of unequal lengths (padding);
* an expert that receives no token of an example has an exactly zero block there;
* influence with an EK-FAC curvature equals the dense formula on the experts' blocks: the
  Kronecker eigenbases from the factor covariances, computed here from the experts' inputs
  (a forward hook) and the loop reference's per-example gradients, the eigenvalues refit to
  the reference's exact diagonal;
* the planner's facts (the forward's GEMMs, the coverage line) and positions: without
  running the model an expert's block is priced at the expected padded length of a chunk
  at balanced routing (the largest of B binomial counts, checked against an enumeration of
  every routing); before a run, at the padded length measured on the data's first chunk,
  equal to what capture then pads (the meta-device measurement runs for a causal LM: a
  shape-only experts forward, value checks skipped);
* ``to_params`` of one expert's block is that expert's slice, not its (E, ...) parameter.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradalg as ga
from gradalg.capture.coverage import layer_coverage
from gradalg.capture.experts import MATRICES, ExpertMatrixRule, FusedExpertsRule, ParamPart, expected_padded
from gradalg.capture.hooks import resolve_layers
from gradalg.capture.layers import ReplayRule, rule_class
from references import block_rows, lm_default_names, one_thread  # noqa: F401 - fixture
from zoo import stock_oracle

F64 = torch.float64
V, H, E, K = 37, 16, 4, 2
ARCHS = ("olmoe", "qwen3_moe", "qwen2_moe", "mixtral")


def build(arch: str, implementation: str = "eager") -> nn.Module:
    """A 2-layer, width-16 MoE of ``arch``: 4 experts, top-2 routing, float64, eval."""
    import transformers as tf
    torch.manual_seed(0)
    common = dict(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, vocab_size=V, num_hidden_layers=2,
                  max_position_embeddings=32, num_experts_per_tok=K, experts_implementation=implementation)
    if arch == "olmoe":
        model = tf.OlmoeForCausalLM(tf.OlmoeConfig(**common, intermediate_size=8, num_experts=E))
    elif arch == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, intermediate_size=24, moe_intermediate_size=8,
                                                         head_dim=8, num_experts=E))
    elif arch == "qwen2_moe":
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, intermediate_size=24, moe_intermediate_size=8,
                                                         shared_expert_intermediate_size=12, num_experts=E,
                                                         decoder_sparse_step=1))
    else:
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=8, num_local_experts=E))
    return model.double().eval()


def items(lengths, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, V, (n,), generator=g)} for n in lengths]


def pad(item: dict, T: int, side: str) -> dict:
    """``item`` padded to ``T`` tokens (token 0, ``attention_mask`` 0) on ``side``."""
    ids = item["input_ids"]
    fill = torch.zeros(T - len(ids), dtype=ids.dtype)
    mask = torch.cat([torch.ones_like(ids), fill])
    if side == "left":
        return {"input_ids": torch.cat([fill, ids]), "attention_mask": mask.flip(0)}
    return {"input_ids": torch.cat([ids, fill]), "attention_mask": mask}


def experts_of(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if rule_class(m) is FusedExpertsRule}


def expert_blocks(model) -> list[str]:
    """By hand: ``<module>.<matrix>.<e>`` for every expert of every fused experts module."""
    return [f"{n}.{mat}.{e}" for n in experts_of(model) for e in range(E) for mat in ("gate_up_proj", "down_proj")]


def block_params(model, layers) -> list[str]:
    modules = dict(model.named_modules())
    out = []
    for name in layers:
        out += ([f"{name}.{p}" for p, _ in modules[name].named_parameters(recurse=False)] if name in modules
                else [name.rsplit(".", 1)[0]])
    return list(dict.fromkeys(out))


def reference_rows(model, data, layers) -> torch.Tensor:
    """(n, dim): the loop of backward, laid out as the blocks ``layers``."""
    return block_rows(model, layers, stock_oracle(model, data, "causal_lm", block_params(model, layers)))


def routing(model, data) -> dict[str, list[torch.Tensor]]:
    """Per experts module, per sequence (alone): its tokens' experts (T, k), from a forward hook."""
    out = {n: [] for n in experts_of(model)}
    each_sequence(model, data, lambda mod, args, o, n: out[n].append(args[1].clone()))
    return out


def each_sequence(model, data, hook) -> None:
    """Run every sequence of ``data`` alone through ``model`` (no grad), with
    ``hook(module, args, output, name)`` on each experts module."""
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: hook(mod, a, o, n)) for n, m in experts_of(model).items()]
    try:
        with torch.no_grad():
            for item in data:
                model(input_ids=item["input_ids"][None])
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", ARCHS)
def test_grad_dot_at_defaults_equals_the_loop_reference(arch):
    model = build(arch)
    task = ga.tasks.causal_lm(model)
    train, queries = items((6, 3, 5, 7), 1), items((4, 6), 2)
    refs = resolve_layers(model, ga.TransformerBlocks())
    names = [r.name for r in refs]
    assert [n for n in names if ".experts." in n] == expert_blocks(model)
    assert all(type(r.rule) is ExpertMatrixRule for r in refs if ".experts." in r.name)
    names = lm_default_names(model, names)        # the task's default: + the vocabulary layers (small V)
    got = torch.from_numpy(ga.methods.grad_dot(task, train, queries).compute().values)
    expected = reference_rows(model, queries, names) @ reference_rows(model, train, names).T
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("implementation", ("batched_mm",))    # (torch's grouped_mm has no float64)
def test_the_experts_implementation_computes_the_same_map(implementation):
    """transformers' batched GEMM forward of the experts: the same blocks."""
    model = build("olmoe", implementation)
    data = items((6, 3, 5), 1)
    names = [r.name for r in resolve_layers(model, ga.TransformerBlocks())]
    blocks = ga.grads(ga.tasks.causal_lm(model), data).to_dense()
    got = torch.cat([blocks[n].flatten(1) for n in names], 1).to(F64)
    torch.testing.assert_close(got, reference_rows(model, data, names), rtol=1e-10, atol=1e-13)


def test_grouped_mm_in_float32_gives_the_loop_reference():
    """transformers' default experts forward (grouped GEMMs; float32 only) computes the same map."""
    model = build("olmoe", "grouped_mm").float()
    data = items((6, 3, 5), 1)
    names = [r.name for r in resolve_layers(model, ga.TransformerBlocks())]
    blocks = ga.grads(ga.tasks.causal_lm(model), data).to_dense()
    got = torch.cat([blocks[n].flatten(1) for n in names], 1).to(F64)
    torch.testing.assert_close(got, reference_rows(model, data, names), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ("olmoe", "mixtral"))
def test_an_expert_without_tokens_of_an_example_has_a_zero_block(arch):
    model = build(arch)
    data = items((2, 3, 6, 4), 5)
    routes = routing(model, data)
    blocks = ga.grads(ga.tasks.causal_lm(model), data).to_dense()
    zero = nonzero = 0
    for module, per_example in routes.items():
        for i, idx in enumerate(per_example):
            assert idx.shape[1] == K and bool((idx[:, 0] != idx[:, 1]).all())     # top-2, distinct experts
            for e in range(E):
                for mat in ("gate_up_proj", "down_proj"):
                    block = blocks[f"{module}.{mat}.{e}"][i]
                    if bool((idx == e).any()):
                        nonzero += bool(block.abs().max() > 0)
                    else:
                        assert bool((block == 0).all())
                        zero += 1
    assert zero > 0 and nonzero > 0    # the data has both cases
    names = list(blocks)
    R = reference_rows(model, data, names)
    got = torch.cat([blocks[n].flatten(1) for n in names], 1).to(F64)
    torch.testing.assert_close(got, R, rtol=1e-10, atol=1e-13)


def _expert_inputs(model, data) -> dict[str, list[torch.Tensor]]:
    """Per experts block ``<module>.<matrix>.<e>``, per sequence: the inputs of every token
    routed to expert e (x for gate_up, act(gate)·up for down), from a forward hook."""
    out: dict[str, list] = {}

    def hook(module, args, output, name):
        x, idx = args[0].detach(), args[1]
        for e in range(E):
            rows = (idx == e).any(1)
            xe = x[rows]
            gate, up = F.linear(xe, module.gate_up_proj[e].detach()).chunk(2, -1)
            out.setdefault(f"{name}.gate_up_proj.{e}", []).append(xe)
            out.setdefault(f"{name}.down_proj.{e}", []).append(module.act_fn(gate) * up)
    each_sequence(model, data, hook)
    return out


@pytest.mark.parametrize("arch", ("olmoe", "qwen3_moe"))
def test_ekfac_influence_on_the_experts_equals_the_dense_formula(arch):
    """Sequences of 2 tokens: only position 0 has a loss gradient, so each example's block is
    ``G_i = d_i a_iᵀ`` (a_i: position 0's input when routed to the expert, else G_i = 0) and
    the output-side covariance is ``S = Σ_i d_i d_iᵀ / n = Σ_i G_i G_iᵀ / ‖a_i‖² / n``;
    ``A = Σ_t a_t a_tᵀ / #tokens`` over every routed token. EK-FAC: the eigenbases of S and
    A, eigenvalues the exact diagonal of the block's Fisher in that basis."""
    model = build(arch)
    task = ga.tasks.causal_lm(model)
    train, queries = items((2,) * 12, 3), items((2, 2, 2), 4)
    layers = list(experts_of(model))
    lam = 1e-3
    S = ga.methods.influence(task, train, queries, layers=layers, damping=lam,
                             curvature=ga.ekfac(ga.grads(task, train, layers=layers)))
    got = torch.from_numpy(S.compute().values)
    names = expert_blocks(model)
    RG, RQ = reference_rows(model, train, names), reference_rows(model, queries, names)
    inputs = _expert_inputs(model, train)
    n, blocks, start = len(train), [], 0
    for name in names:
        owner, mat, e = name.rsplit(".", 2)
        out_f, in_f = dict(model.named_modules())[owner].get_parameter(mat).shape[1:]
        G = RG[:, start:start + out_f * in_f].reshape(n, out_f, in_f)
        start += out_f * in_f
        a_all = torch.cat(inputs[name])
        A = a_all.T @ a_all / max(1, a_all.shape[0])
        S_cov = torch.zeros(out_f, out_f, dtype=F64)
        for i, a in enumerate(inputs[name]):
            if len(a):   # a[0] is position 0's input when it is routed here, else G_i = 0
                S_cov += G[i] @ G[i].T / (a[0] @ a[0])
        S_cov /= n
        Q = torch.kron(torch.linalg.eigh(S_cov)[1], torch.linalg.eigh(A)[1])
        Fb = G.flatten(1).T @ G.flatten(1) / n
        lamb = torch.diagonal(Q.T @ Fb @ Q)
        blocks.append(Q @ torch.diag(1 / (lamb + lam)) @ Q.T)
    expected = RQ @ torch.block_diag(*blocks) @ RG.T
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-10)


def test_planner_facts_and_coverage_on_an_olmoe_shape():
    """Positions per example are priced at ⌈T k / E⌉; the forward's GEMMs are the k experts'
    gate/up and down products; the coverage line counts the experts (no longer left out)."""
    model = build("olmoe")
    module = model.model.layers[0].mlp.experts
    rule = resolve_layers(model, ["model.layers.0.mlp.experts.down_proj.3"])[0].rule
    assert (rule.expert, rule.matrix) == (3, "down_proj")
    assert rule.positions(module, torch.empty(7, H, device="meta")) == math.ceil(7 * K / E)
    # the plan's positions without running the model: the padded length of a chunk of the two
    # examples at balanced routing (share k / E) for the experts, T for the rest
    from gradalg.plan.shapes import chunk_examples, forward_shapes
    src = ga.grads(ga.tasks.causal_lm(model), items((10, 10), 1)).expr.source
    assert chunk_examples(src) == 2
    T = forward_shapes(src, {}).positions
    assert T["model.layers.0.mlp.experts.down_proj.3"] == math.ceil(expected_padded(10, K / E, 2)) == 6
    assert T["model.layers.0.self_attn.q_proj"] == 10
    I = module.down_proj.shape[2]
    assert FusedExpertsRule().weight_gemm(module) == (H, 3 * K * I)
    cov = layer_coverage(model, [r.name for r in resolve_layers(model, ga.TransformerBlocks())],
                         selection=ga.TransformerBlocks())
    experts = sum(p.numel() for m in experts_of(model).values() for p in m.parameters())
    attention = sum(p.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".self_attn." in n
                    for p in m.parameters())
    assert cov.attributed == experts + attention
    assert "experts" not in cov.describe()


def test_an_experts_forward_of_its_own_is_replayed_not_factored():
    """A subclass overriding forward is not the map the rule factors: it is recorded by
    replay (dense rows) when named, left out of the defaults, and named by the coverage line."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts

    class Own(OlmoeExperts):
        def forward(self, *args):
            return super().forward(*args)
    model = build("olmoe")
    for layer in model.model.layers:
        layer.mlp.experts.__class__ = Own
    assert isinstance(rule_class(model.model.layers[0].mlp.experts).for_module(model.model.layers[0].mlp.experts),
                      ReplayRule)
    names = [r.name for r in resolve_layers(model, ga.TransformerBlocks())]
    assert not any("experts" in n for n in names)
    assert "model.layers.*.mlp.experts (2 modules" in layer_coverage(model, names).describe()
    data = items((3, 5), 1)
    captured = ga.grads(ga.tasks.causal_lm(model), data, layers=["model.layers.0.mlp.experts"]).to_params()
    reference = stock_oracle(model, data, "causal_lm", list(captured))
    for name in captured:
        torch.testing.assert_close(captured[name], reference[name], rtol=1e-9, atol=1e-12)


def test_ga_capture_at_its_defaults_leaves_the_fused_experts_to_ga_grads():
    """``ga.capture`` records one A per call (no routing): at its default layers the fused
    experts are not recorded (named explicitly, they are refused, naming ga.grads)."""
    model = build("olmoe")
    ids = torch.stack([d["input_ids"] for d in items((5, 5), 1)])
    with ga.capture(model, reduction="sum") as cap:
        out = model(input_ids=ids, labels=ids)
        (out.loss * ids.numel()).backward()
    assert cap.refs and not any("experts" in r.name for r in cap.refs)
    with pytest.raises(ga.errors.UnsupportedLayerError, match="ga.grads"):
        ga.capture(model, layers=["model.layers.0.mlp.experts"], reduction="sum")


def test_check_model_compares_each_expert_block_with_its_slice_of_autograd():
    model = build("olmoe")
    report = ga.check_model(ga.tasks.causal_lm(model), items((5, 6, 4), 1))
    n_blocks = len(lm_default_names(model, [r.name for r in resolve_layers(model, ga.TransformerBlocks())]))
    assert n_blocks == 24 + 2       # + the untied embedding and head (a small vocabulary)
    assert f"tied_weights: captured gradients equal autograd's for all {n_blocks} blocks" in str(report)
    assert "FAIL" not in str(report)


@pytest.mark.parametrize("tokens,share,examples", [(4, 0.25, 1), (4, 0.25, 2), (3, 0.5, 3), (4, 0.75, 2), (2, 0.1, 4)])
def test_expected_padded_length_equals_an_enumeration_of_every_routing(tokens, share, examples):
    """E[max(1, max_i c_i)] over every assignment of ``examples × tokens`` tokens (each routed
    to the expert with probability ``share``), weighted by its probability."""
    expected = 0.0
    for routed in itertools.product((0, 1), repeat=tokens * examples):
        weight = math.prod(share if r else 1 - share for r in routed)
        counts = [sum(routed[i * tokens:(i + 1) * tokens]) for i in range(examples)]
        expected += weight * max(1, max(counts))
    assert expected_padded(tokens, share, examples) == pytest.approx(expected, rel=1e-12)
    assert expected_padded(tokens, 0.0, examples) == 1.0 and expected_padded(tokens, 1.0, examples) == tokens


@pytest.mark.parametrize("arch", ("olmoe", "qwen2_moe"))
def test_the_shape_measurement_runs_for_a_causal_lm_and_the_plan_uses_it(arch, monkeypatch):
    """Before a run the planner measures a causal LM's shapes (a meta forward, the batch's
    value checks skipped there, the experts' forward shape-only) and the routing of the data's
    first chunk (a real forward): every expert's block is priced at the padded length capture
    then gives it in that chunk (recorded here from the factors of the run, padding included);
    the plan's facts hold that measurement."""
    from gradalg.plan.planner import plan
    from gradalg.plan.shapes import chunk_examples, measure_forward_shapes
    model = build(arch)
    data = items((9, 9, 7), 3)
    G = ga.grads(ga.tasks.causal_lm(model), data)
    src = G.expr.source
    shapes = measure_forward_shapes(src)
    assert shapes.measured and shapes.activations > 0
    assert chunk_examples(src) == 3
    assert all(shapes.positions[n] == 9 for n in shapes.positions if n not in shapes.routed)   # a shared expert too
    # the bytes of an example in capture: the blocks' factors at these positions, and the
    # model's activations at its T tokens (the experts' positions are routed tokens, not
    # other position counts of the layers: no measured-activations path)
    from gradalg.plan.memory import capture_bytes_per_example
    from gradalg.plan.shapes import ModelFacts, activation_bytes, output_bytes
    assert shapes.routed == frozenset(expert_blocks(model))
    factors = sum(shapes.positions[b.name] * (3 * b.shape[1] + 2 * b.shape[0]) * 8 for b in src.space.blocks)
    assert capture_bytes_per_example(src, ModelFacts(dtype=F64, shapes={src.token: shapes})) == pytest.approx(
        factors + activation_bytes(model, 9, 8) + output_bytes(model, 9, 8))
    p = plan((G @ G.T).expr, measure_shapes=True)
    assert p.stages["facts"].shapes[src.token] == shapes
    assert "measured for a run" in p.explain("facts")
    # what capture pads each block to in the run's (only) chunk
    padded, factors = {}, ExpertMatrixRule.factors
    names = {id(m): n for n, m in experts_of(model).items()}

    def recording(self, module, recorded, g, layout):
        out = factors(self, module, recorded, g, layout)
        padded.setdefault(f"{names[id(module)]}.{self.matrix}.{self.expert}", out.A.shape[1])
        return out
    monkeypatch.setattr(ExpertMatrixRule, "factors", recording)
    G.to_dense()
    assert set(padded) == set(expert_blocks(model))
    assert {n: shapes.positions[n] for n in padded} == padded
    assert sum(padded.values()) > sum(math.ceil(9 * K / E) for _ in padded)   # more than the mean
    # the real batch is still checked: a token outside the vocabulary is refused by name
    with pytest.raises(ga.errors.BatchContentError, match="vocabulary"):
        ga.grads(ga.tasks.causal_lm(model), [{"input_ids": torch.tensor([1, V + 3, 2])}]).to_dense()


def test_to_params_of_one_expert_is_its_slice_and_the_parts_add_up():
    """``to_params`` of an expert's block holds that expert's (n, out, in) only; ``G.to_params()``
    adds the parts into one (n, E, out, in) tensor per parameter, equal to the loop reference."""
    model = build("olmoe")
    module = model.model.layers[0].mlp.experts
    rule = resolve_layers(model, ["model.layers.0.mlp.experts.down_proj.2"])[0].rule
    block = torch.randn(3, *module.down_proj.shape[1:], dtype=F64)
    part = rule.to_params(module, block)["down_proj"]
    assert isinstance(part, ParamPart) and part.value is block and part.index == 2
    assert part.dense().shape == (3, *module.down_proj.shape) and torch.equal(part.dense()[:, 2], block)
    data = items((5, 3, 6), 2)
    captured = ga.grads(ga.tasks.causal_lm(model), data, layers=["model.layers.0.mlp.experts"]).to_params()
    assert set(captured) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    reference = stock_oracle(model, data, "causal_lm", list(captured))
    for name in captured:
        torch.testing.assert_close(captured[name], reference[name], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("arch,side", [("olmoe", "right"), ("qwen2_moe", "left")])
def test_padding_tokens_get_no_expert_rows_and_curvature_ignores_them(arch, side):
    """Padding tokens are routed by the forward but carry no output gradient: their expert
    rows are dropped, as the layers whose positions are the tokens zero them in ``A`` and
    ``D``. So K-FAC's ``A = Σ_t a_t a_tᵀ / #tokens`` leaves them out for the experts as for
    the attention projections: K-FAC and EK-FAC influence at the LM defaults on padded
    chunks equal the same data one sequence per chunk (no padding), and capture pads each
    expert's block to its most-routed example's real tokens (what the plan measures)."""
    from gradalg.capture.experts import routed_counts
    from gradalg.plan.shapes import measure_forward_shapes
    model = build(arch)
    task = ga.tasks.causal_lm(model, padding_side=side)
    train, queries = items((7, 2, 5, 3, 6, 2), 6), items((6, 6), 7)
    padded_train = [pad(item, 7, side) for item in train]
    lam = 1e-2

    def scores(curvature, data):
        G = ga.grads(task, data)
        return torch.from_numpy(ga.methods.influence(task, data, queries, damping=lam,
                                                     curvature=curvature(G)).compute().values)
    for curvature in (ga.kfac, ga.ekfac):
        padded = scores(curvature, padded_train)
        with ga.options(batch_size=1):
            alone = scores(curvature, train)
        torch.testing.assert_close(padded, alone, rtol=1e-8, atol=1e-10)
    # the plan's positions: the most-routed example's real tokens in the chunk (each sequence
    # routed alone here: the real tokens' routing does not depend on the padding)
    shapes = measure_forward_shapes(ga.grads(task, padded_train).expr.source)
    counts = {}
    for name, per_example in routing(model, train).items():
        module = experts_of(model)[name]
        c = torch.stack([routed_counts(module, idx)[0] for idx in per_example])   # (n, E), each alone
        counts.update({f"{name}.{m}.{e}": max(1, int(c[:, e].max())) for e in range(E) for m in MATRICES})
    assert {n: shapes.positions[n] for n in counts} == counts


def test_a_display_plan_costs_expert_kernels_at_the_estimate_and_a_batch_size_change_remeasures():
    """Without a model run (a display), the experts' positions are the balanced-routing
    estimate: every block's kernel is costed there (the attention projections' T is the
    data's), none left "when run" (priced as dense rows, the pessimistic peak), and the
    expert blocks' reasons say the run decides again. A run's measurement depends on the
    chunk's examples: planned again under another ``batch_size``, the routing is measured
    again (not the first measurement's, kept by source)."""
    from gradalg.plan.decisions import DecisionKind
    from gradalg.plan.planner import plan
    from gradalg.plan.shapes import measure_forward_shapes
    model = build("olmoe")
    task = ga.tasks.causal_lm(model)
    G, Q = ga.grads(task, items((9, 9, 7, 8), 3)), ga.grads(task, items((6, 6), 4))
    display = plan((Q @ G.T).expr)
    decisions = display.decisions.of(DecisionKind.KERNEL)
    assert {d.chosen for d in decisions} <= {"ghost", "dense"} and len(decisions) == len(G.layers)
    assert all(("balanced-routing estimate" in d.reason) == (".experts." in d.block) for d in decisions)
    src = G.expr.source
    measured = {}
    for B in (1, 4, 1):
        with ga.options(batch_size=B):
            shapes = plan((Q @ G.T).expr, measure_shapes=True).stages["facts"].shapes[src.token]
            assert shapes == measure_forward_shapes(src)
        measured.setdefault(B, shapes)
        assert measured[B] == shapes
    assert sum(measured[4].positions.values()) > sum(measured[1].positions.values())


def test_online_selection_refuses_fused_experts_with_a_fix_that_works():
    """A training loop's capture does not record fused experts, so online selection, which
    corrects every trainable parameter's gradient, names them and the fixes that work
    (``uncovered='ignore'``, or freezing them), each applied here."""
    from gradalg.integrations import BatchMean, DropFraction, OnlineSelection
    model = build("olmoe")
    with pytest.raises(ga.errors.UnsupportedLayerError, match="fused experts module.*'model.layers.0.mlp.experts'"
                       ".*uncovered='ignore'"):
        OnlineSelection(BatchMean(), DropFraction(0.5)).attach(model)
    OnlineSelection(BatchMean(), DropFraction(0.5), uncovered="ignore").attach(model)
    for name, p in model.named_parameters():
        if ".mlp." in name:
            p.requires_grad_(False)     # the experts and their routers
    OnlineSelection(BatchMean(), DropFraction(0.5)).attach(model)
