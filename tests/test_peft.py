"""LoRA adapters (PEFT): factored capture of ``lora_A`` / ``lora_B``, checked against a
loop-of-backward oracle on the trainable parameters (float64); names through the
``PeftModel`` wrapper; LESS on the adapters."""
import copy

import pytest
import torch

import gradalg as ga
from references import one_thread  # noqa: F401 - one intra-op thread per test module
from models import lm_loss, padded_token_data

peft = pytest.importorskip("peft")
F64 = torch.float64
REL = 1e-8
VOCAB = 31


def gpt2_base(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).to(F64).eval()


def llama_base(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).to(F64).eval()


BASES = {"gpt2": (gpt2_base, ["c_attn", "c_fc"]), "llama": (llama_base, ["q_proj", "v_proj", "down_proj"])}


def lora(name, *, nonzero_b=True, dropout=0.1, seed=1):
    make, targets = BASES[name]
    model = peft.get_peft_model(make(), peft.LoraConfig(r=2, lora_alpha=6, target_modules=targets,
                                                        lora_dropout=dropout))
    model = model.to(F64).eval()
    if nonzero_b:   # PEFT starts lora_B at zero, which makes lora_A's gradient zero
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=F64))
    return model


def task_of(model):
    return ga.Task(model, lm_loss, token_mask=lambda b: b[1].bool(), name="lora")


def oracle(model, batch) -> tuple[list[str], torch.Tensor]:
    """(names, (n, dim)): per-example gradients of every trainable parameter, one backward each."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(batch[0].shape[0]):
        one = tuple(t[i:i + 1] for t in batch)
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(lm_loss(model, one), [p for _, p in named])]))
    return [n for n, _ in named], torch.stack(rows)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def data(n=5, seed=2):
    return padded_token_data(n=n, vocab=VOCAB, min_len=3, max_len=7, seed=seed)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lora_adapters_are_the_default_layers_and_match_oracle(arch):
    model = lora(arch)
    batch = data()
    G = ga.grads(task_of(model), batch, batch_size=3)
    trainable = [n.removeprefix("base_model.model.").removesuffix(".weight")
                 for n, p in model.named_parameters() if p.requires_grad]
    assert list(G.space.names) == trainable            # lora_A / lora_B of each target, nothing frozen
    assert all(".lora_A." in n or ".lora_B." in n for n in G.space.names)
    names, ref = oracle(model, batch)
    got = G.to_params()
    rows = torch.cat([got[n.removeprefix("base_model.model.")].flatten(1) for n in names], 1)
    assert rel(rows, ref) < REL
    S = torch.as_tensor((G @ G.T).compute().values)
    assert rel(S, ref @ ref.T) < REL


def test_lora_b_zero_at_init_gives_zero_lora_a_gradient():
    model = lora("gpt2", nonzero_b=False)
    batch = data()
    dense = ga.grads(task_of(model), batch).to_dense()
    names, ref = oracle(model, batch)
    a = [k for k in dense if ".lora_A." in k]
    b = [k for k in dense if ".lora_B." in k]
    assert all(float(dense[k].abs().max()) == 0.0 for k in a)
    assert all(float(dense[k].abs().max()) > 0.0 for k in b)
    rows = torch.cat([dense[k].flatten(1) for k in dense], 1)
    assert rel(rows, ref) < REL


def test_capture_inside_training_loop_matches_grads_with_dropout_in_eval():
    model = lora("llama", dropout=0.2)
    batch = data(n=4)
    task = task_of(model)
    G = ga.grads(task, batch)
    with ga.capture(model) as cap:       # in eval mode: the adapters' dropout is the identity
        for i in (0, 2):
            model.zero_grad()
            lm_loss(model, tuple(t[i:i + 2] for t in batch)).backward()
    assert cap.grads.space == G.space
    names, ref = oracle(model, batch)
    assert rel(torch.as_tensor((cap.grads @ G.T).compute().values), ref @ ref.T) < REL


def test_base_layers_keep_the_plain_models_names():
    """With lora_B = 0 the adapted model computes the plain model's function, so the frozen
    layers' gradients, named as in the plain model, equal the plain model's."""
    plain = gpt2_base()
    model = peft.get_peft_model(copy.deepcopy(plain), peft.LoraConfig(r=2, target_modules=["c_attn"]))
    model = model.to(F64).eval()
    batch = data(n=4)
    layers = ["transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"]
    G0 = ga.grads(task_of(plain), batch, layers=layers)
    G1 = ga.grads(task_of(model), batch, layers=["base_model.model." + layers[0], layers[1]])
    assert G1.space == G0.space and G1.space.names == tuple(layers)
    S0 = torch.as_tensor((G0 @ G0.T).compute().values)
    with pytest.raises(ga.SpaceMismatchError):   # a copy with adapters is another model...
        (G1 @ G0.T).compute()
    with ga.options(check_models=False):         # ...that computes the same function here
        assert rel(torch.as_tensor((G1 @ G0.T).compute().values), S0) < REL


def test_less_runs_on_lora_adapters_and_tracks_the_unprojected_scores():
    model = lora("gpt2")
    train, targets = data(n=6, seed=3), data(n=4, seed=4)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.zero_grad()
    lm_loss(model, train).backward()
    opt.step()
    model.zero_grad()
    groups = [0, 0, 1, 1]
    scores = ga.methods.less([task_of(model)], [opt], [1.0], train, targets, groups, k=4096, seed=0)
    S = torch.as_tensor(scores.compute().values)
    assert S.shape == (2, 6) and torch.isfinite(S).all()
    # the same recipe without projection, from the oracle's gradients
    _, g = oracle(model, train)
    _, q = oracle(model, targets)
    params = [p for p in model.parameters() if p.requires_grad]
    m0 = torch.cat([opt.state[p]["exp_avg"].flatten() for p in params])
    v0 = torch.cat([opt.state[p]["exp_avg_sq"].flatten() for p in params])
    (b1, b2), eps = opt.param_groups[0]["betas"], opt.param_groups[0]["eps"]
    gamma = (b1 * m0 + (1 - b1) * g) / ((b2 * v0 + (1 - b2) * g * g).sqrt() + eps)
    gamma = gamma / gamma.norm(dim=1, keepdim=True)
    qn = q / q.norm(dim=1, keepdim=True)
    target = torch.stack([qn[:2].mean(0), qn[2:].mean(0)])
    exact = target @ gamma.T
    assert torch.corrcoef(torch.stack([S.flatten(), exact.flatten()]))[0, 1] > 0.9
