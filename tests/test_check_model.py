"""``ga.check_model(task, data)`` and ``gradalg check``: each check fires on a model broken
on purpose (dropout and BatchNorm in train mode, a mean loss, examples mixed across the
batch, padding read as tokens, positions counted from left padding, a hand-written tied
head, NaN weights and examples), its fix makes it pass, and the zoo models in eval mode
pass every check. The numbers compared are sketches of the real capture path's rows
against each example alone and against autograd (``gradalg.check.sketch``)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradalg as ga
from gradalg.check import ModelCheck, ModelCheckError
from gradalg.check.sketch import Sketch

from models import classification_data, gpt2, mlp, padded_token_data
import zoo


def kinds(check: ModelCheck, severity: str = "fail") -> set:
    return {f.kind for f in check.findings if f.severity == severity}


def sum_ce(m, b):
    return F.cross_entropy(m(b[0]), b[1], reduction="sum")


def token_items(n=6, seed=3, vocab=101):
    """Dict items of unequal length (no padding of their own)."""
    ids, mask = padded_token_data(n=n, vocab=vocab, seed=seed)
    return [{"input_ids": ids[i][mask[i].bool()]} for i in range(n)]


# ----------------------------------------------------------------------- the sketch itself
def test_sketch_rows_are_linear_and_exact_on_small_sides():
    """Σ_i of the row sketches is the sketch of Σ_i G_i, and a side of size ≤ k is exact."""
    from gradalg.capture.factors import Factors, materialize

    g = torch.Generator().manual_seed(0)
    Fa = Factors(torch.randn(3, 5, 40, generator=g, dtype=torch.float64),
                 torch.randn(3, 5, 6, generator=g, dtype=torch.float64))
    s = Sketch(k=8, seed=1)
    rows = s.rows("b", Fa)
    G = materialize(Fa)
    assert rows.shape == (3, 6 * 8)
    torch.testing.assert_close(rows.sum(0), s.matrix("b", G.sum(0)))
    P_out, P_in = s.mats("b", 6, 40, torch.float64, torch.device("cpu"))
    assert torch.equal(P_out, torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(rows[1], (G[1] @ P_in.T).flatten())


# ----------------------------------------------------------------------- silent on good models
def test_mlp_in_eval_mode_passes_every_check():
    model = mlp().eval()
    x, y = classification_data()
    check = ga.check_model(ga.Task(model, sum_ce), (x, y))
    assert check.ok, check
    assert not check.warnings
    assert {f.kind for f in check.findings} >= {"finite", "train_mode", "loss_sum", "batch_independence",
                                                "tied_weights", "coverage"}
    assert check.examples == tuple(range(8)) and check.tolerance == 1e-6
    assert check["batch_independence"][0].numbers["max_relative_difference[collated]"] < 1e-10
    assert check["tied_weights"][0].numbers["max_relative_difference"] < 1e-10
    assert check.raise_if_failed() is check


@pytest.mark.parametrize("name", ["gpt2", "llama", "gpt_neox", "qwen2_moe", "bert", "t5"])
def test_zoo_models_in_eval_mode_pass(name):
    model, task, data, _ = getattr(zoo, name)()
    model.eval()
    check = ga.check_model(task, data, n_examples=4)
    assert check.ok, check
    assert check["tied_weights"][0].numbers["blocks_compared"] == len(check.layers)


def test_lm_task_with_tied_head_and_layers_all_passes():
    """GPT-2 with its tied embedding/head, every parameter, dict items of unequal length:
    compared alone, in the collated batch and right-padded; left padding is refused by the
    right-padding task (an info, not a failure)."""
    model = gpt2(tied=True)
    check = ga.check_model(ga.tasks.causal_lm(model), token_items(), layers="all", n_examples=5)
    assert check.ok, check
    independence = check["batch_independence"]
    assert "collated and right-padded" in independence[0].message
    assert any(f.severity == "info" and "left-padded" in f.message for f in independence)
    assert check["tied_weights"][0].severity == "ok"


def test_left_padding_task_compares_left_padded_batches():
    from torch.utils.data import DataLoader

    loader = DataLoader(token_items(), batch_size=2, collate_fn=left_pad_collate)
    check = ga.check_model(ga.tasks.causal_lm(gpt2(), padding_side="left"), loader, n_examples=4)
    assert "collated and left-padded" in check["batch_independence"][0].message
    assert check.ok, check


def test_a_target_predicted_from_padding_fails_loss_sum():
    """Per-example rows are right (padded positions are masked out of the factors), but the
    batch's loss has a term no example has alone: what TRAK's output weights would read."""
    from torch.utils.data import DataLoader

    loader = DataLoader(token_items(), batch_size=2, collate_fn=left_pad_collate)
    check = ga.check_model(ga.Task(gpt2(), lm_loss_positions(first_target=True), token_mask=lambda b:
                                   b["attention_mask"].bool()), loader, n_examples=4)
    assert kinds(check) == {"loss_sum"}, check
    assert "padding position" in check["loss_sum"][0].message and "-100" in check["loss_sum"][0].fix
    assert ga.check_model(ga.Task(gpt2(), lm_loss_positions(), token_mask=lambda b: b["attention_mask"].bool()),
                          loader, n_examples=4).ok


# ----------------------------------------------------------------------- train mode
def dropout_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3)).double()


def test_dropout_in_train_mode_fails_and_eval_fixes_it():
    model = dropout_mlp().train()
    x, y = classification_data()
    task = ga.Task(model, sum_ce)
    check = ga.check_model(task, (x, y))
    assert kinds(check) == {"train_mode"}
    finding = check["train_mode"][0]
    assert finding.where == ("2",) and "model.eval()" in finding.fix
    assert model.training                        # the mode is left as it was
    with pytest.raises(ModelCheckError, match="train_mode"):
        check.raise_if_failed()
    model.eval()
    assert ga.check_model(task, (x, y)).ok


class FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.b(F.dropout(torch.relu(self.a(x)), 0.3, self.training))


def test_dropout_without_a_module_is_seen_by_two_forwards():
    torch.manual_seed(0)
    model = FunctionalDropout().double().train()
    x, y = classification_data()
    check = ga.check_model(ga.Task(model, sum_ce), (x, y))
    assert kinds(check) == {"train_mode"}
    assert check["train_mode"][0].numbers["random_forward"] is True
    model.eval()
    assert ga.check_model(ga.Task(model, sum_ce), (x, y)).ok


def test_batchnorm_in_train_mode_fails_and_eval_fixes_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).double().train()
    x, y = classification_data()
    before = model[1].running_mean.clone()
    check = ga.check_model(ga.Task(model, sum_ce), (x, y))
    assert kinds(check) == {"train_mode"}
    assert check["train_mode"][0].where == ("1",)
    assert torch.equal(model[1].running_mean, before)      # the check updates no statistics
    model[1].eval()                                         # a frozen BatchNorm in a model in train mode
    check = ga.check_model(ga.Task(model, sum_ce), (x, y))
    assert check.ok and model.training and not model[1].training     # each module's mode kept
    model.eval()
    assert ga.check_model(ga.Task(model, sum_ce), (x, y)).ok


def test_hf_model_built_from_a_config_is_in_train_mode_with_dropout():
    """GPT2LMHeadModel(config) starts in train mode with dropout 0.1: named, fixed by eval()."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=101, n_positions=32)).double()
    task = ga.tasks.causal_lm(model)
    check = ga.check_model(task, token_items(), n_examples=3)
    assert kinds(check) == {"train_mode"}
    assert "transformer.drop" in check["train_mode"][0].where
    model.eval()
    assert ga.check_model(task, token_items(), n_examples=3).ok


# ----------------------------------------------------------------------- a mean loss
def test_mean_loss_fails_and_each_fix_passes():
    model = mlp().eval()
    x, y = classification_data()

    def mean_ce(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    check = ga.check_model(ga.Task(model, mean_ce), (x, y))
    assert kinds(check) == {"loss_sum"}              # rows compared after undoing the mean
    assert "reduction='mean'" in check["loss_sum"][0].fix and "reduction='sum'" in check["loss_sum"][0].fix
    assert ga.check_model(ga.Task(model, mean_ce, reduction="mean"), (x, y)).ok
    assert ga.check_model(ga.Task(model, sum_ce), (x, y)).ok


# ----------------------------------------------------------------------- examples that interact
class Mixer(nn.Module):
    """Adds the batch's mean hidden state to each example's (attention across the batch)."""

    def __init__(self, mix=True):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.mix = nn.Linear(8, 16), nn.Linear(16, 3), mix

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.mix:
            h = h + h.mean(0, keepdim=True)
        return self.b(h)


def test_a_model_mixing_examples_fails_batch_independence():
    x, y = classification_data()
    check = ga.check_model(ga.Task(Mixer().double().eval(), sum_ce), (x, y))
    assert "batch_independence" in kinds(check)
    finding = [f for f in check["batch_independence"] if f.severity == "fail"][0]
    assert finding.examples == tuple(range(8)) and finding.numbers["max_relative_difference"] > 1e-3
    assert "interact" in finding.fix
    assert check["loss_sum"][0].severity == "info"
    assert ga.check_model(ga.Task(Mixer(mix=False).double().eval(), sum_ce), (x, y)).ok


# ----------------------------------------------------------------------- padding
class BagOfTokens(nn.Module):
    """Mean of the token embeddings, then a linear classifier."""

    def __init__(self, vocab=101, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, 3)

    def forward(self, ids, mask=None):
        e = self.emb(ids)
        if mask is None:
            return self.head(e.mean(1))
        m = mask.unsqueeze(-1).to(e.dtype)
        return self.head((e * m).sum(1) / m.sum(1))


def bag_items():
    return [{**item, "label": torch.tensor(i % 3)} for i, item in enumerate(token_items())]


def test_padding_read_as_tokens_fails_and_the_mask_fixes_it():
    model = BagOfTokens().double().eval()
    unmasked = ga.Task(model, lambda m, b: F.cross_entropy(m(b["input_ids"]), b["label"], reduction="sum"))
    check = ga.check_model(unmasked, bag_items(), n_examples=5)
    failing = [f for f in check["batch_independence"] if f.severity == "fail"]
    assert {f.message.split(" batch of")[0].rsplit(" ", 1)[-1] for f in failing} == {
        "collated", "right-padded", "left-padded"}
    assert "emb" in failing[0].where and "attention_mask" in failing[0].fix
    masked = ga.Task(model, lambda m, b: F.cross_entropy(m(b["input_ids"], b["attention_mask"]), b["label"],
                                                         reduction="sum"))
    assert ga.check_model(masked, bag_items(), n_examples=5).ok


def left_pad_collate(items):
    T = max(len(i["input_ids"]) for i in items)
    ids = torch.zeros(len(items), T, dtype=torch.long)
    mask = torch.zeros(len(items), T, dtype=torch.long)
    for r, item in enumerate(items):
        L = len(item["input_ids"])
        ids[r, T - L:], mask[r, T - L:] = item["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask}


def lm_loss_no_positions(m, b):
    """Causal LM loss that passes the mask but not position ids (wrong under left padding)."""
    ids, mask = b["input_ids"], b["attention_mask"]
    logits = m(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum", ignore_index=-100)


def lm_loss_positions(first_target=False):
    """The fix of :func:`lm_loss_no_positions`: positions counted from each row's first real
    token, and no target predicted from a padding position (unless ``first_target``)."""
    def loss(m, b):
        ids, mask = b["input_ids"], b["attention_mask"]
        positions = (mask.cumsum(1) - 1).clamp_min(0)
        logits = m(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1]
        dropped = mask[:, 1:] == 0 if first_target else (mask[:, 1:] == 0) | (mask[:, :-1] == 0)
        targets = ids[:, 1:].masked_fill(dropped, -100)
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum", ignore_index=-100)
    return loss


def test_left_padding_with_positions_from_the_padding_fails_and_the_fix_passes():
    from torch.utils.data import DataLoader

    model = gpt2()
    loader = DataLoader(token_items(), batch_size=3, collate_fn=left_pad_collate)
    check = ga.check_model(ga.Task(model, lm_loss_no_positions), loader, n_examples=4)
    failing = {f.message.split(" batch of")[0].rsplit(" ", 1)[-1] for f in check["batch_independence"]
               if f.severity == "fail"}
    assert failing == {"collated", "left-padded"}, check      # the loader's own batches and left padding
    fixed = ga.check_model(ga.Task(model, lm_loss_positions()), loader, n_examples=4)
    assert fixed.ok, fixed


def test_left_padding_only_is_a_warning_when_right_padding_works():
    """A task that accepts both sides, a model that reads left padding wrong: a warning
    (gradalg's collate pads on the right), with the right-padded batch passing."""
    model = gpt2()
    check = ga.check_model(ga.Task(model, lm_loss_no_positions), token_items(), n_examples=4)
    assert check.ok
    warning = [f for f in check["batch_independence"] if f.severity == "warning"]
    assert len(warning) == 1 and "left-padded" in warning[0].message and "padding_side='left'" in warning[0].fix


def test_a_task_that_refuses_the_datas_padding_is_reported_with_its_fix():
    from torch.utils.data import DataLoader

    loader = DataLoader(token_items(), batch_size=3, collate_fn=left_pad_collate)
    check = ga.check_model(ga.tasks.causal_lm(gpt2()), loader, n_examples=4)
    assert kinds(check) == {"refused"}
    assert "padding_side='left'" in check["refused"][0].message


# ----------------------------------------------------------------------- tied and reused weights
class HandTied(nn.Module):
    """Logits through the embedding matrix by hand (h @ emb.weight.T), or through an
    nn.Linear head sharing the weight (the fix)."""

    def __init__(self, vocab=31, d=12, module_head=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid = nn.Embedding(vocab, d), nn.Linear(d, d)
        self.head = None
        if module_head:
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = torch.tanh(self.mid(self.emb(ids)))
        return self.head(h) if self.head is not None else h @ self.emb.weight.T


def tied_loss(m, b):
    logits = m(b[0])[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), b[0][:, 1:], reduction="sum")


def test_a_hand_written_tied_head_fails_and_each_fix_passes():
    ids = torch.randint(0, 31, (6, 7), generator=torch.Generator().manual_seed(0))
    check = ga.check_model(ga.Task(HandTied().double().eval(), tied_loss), (ids,))
    assert kinds(check) == {"tied_weights"}, check
    finding = check["tied_weights"][0]
    assert finding.where == ("emb",) and finding.numbers["max_relative_difference"] > 0.1
    assert ga.check_model(ga.Task(HandTied(module_head=True).double().eval(), tied_loss), (ids,)).ok
    assert ga.check_model(ga.Task(HandTied().double().eval(), tied_loss), (ids,), layers=["mid"]).ok


def test_a_layer_called_twice_is_seen():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))

    x, y = classification_data()
    check = ga.check_model(ga.Task(Twice().double().eval(), sum_ce), (x, y))
    assert check.ok, check


# ----------------------------------------------------------------------- finite values
def test_nan_weight_and_buffer_are_named():
    model = mlp().eval()
    x, y = classification_data()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    check = ga.check_model(ga.Task(model, sum_ce), (x, y))
    assert kinds(check) == {"finite"} and check["finite"][0].where == ("parameter 0.weight",)
    bn = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).double().eval()
    bn[1].running_var[2] = float("inf")
    assert ga.check_model(ga.Task(bn, sum_ce), (x, y))["finite"][0].where == ("buffer 1.running_var",)


def test_nan_example_is_named():
    model = mlp().eval()
    x, y = classification_data()
    x[3, 1] = float("nan")
    check = ga.check_model(ga.Task(model, sum_ce), (x, y), n_examples=5)
    assert kinds(check) == {"finite"} and check["finite"][-1].examples == (3,)
    check = ga.check_model(ga.Task(model, sum_ce), (x[4:], y[4:]), n_examples=5)
    assert check.ok


# ----------------------------------------------------------------------- special tokens
def test_doubled_bos_is_a_warning():
    model = gpt2()        # bos = eos = 0
    items = token_items()
    items[1] = {"input_ids": torch.cat([torch.tensor([0, 0]), items[1]["input_ids"]])}
    check = ga.check_model(ga.tasks.causal_lm(model), items, n_examples=4)
    assert check.ok and check["special_tokens"][0].severity == "warning"
    assert check["special_tokens"][0].examples == (1,)
    items[1] = {"input_ids": items[1]["input_ids"][1:]}
    assert ga.check_model(ga.tasks.causal_lm(model), items, n_examples=4)["special_tokens"][0].severity == "ok"


# ----------------------------------------------------------------------- inputs and displays
def test_arguments_are_validated():
    model = mlp().eval()
    x, y = classification_data()
    task = ga.Task(model, sum_ce)
    with pytest.raises(ga.OptionError, match="n_examples"):
        ga.check_model(task, (x, y), n_examples=1)
    with pytest.raises(ga.OptionError, match="ga.Task"):
        ga.check_model(model, (x, y))
    with pytest.raises(ga.OptionError, match="tolerance"):
        ga.check_model(task, (x, y), tolerance=-1)
    with pytest.raises(ga.OptionError, match="tolerance"):
        ga.check_model(task, (x, y), tolerance=float("inf"))
    with pytest.raises(ga.OptionError, match="sketch_dim"):
        ga.check_model(task, (x, y), sketch_dim=0)
    with pytest.raises(ga.UnsupportedLayerError, match="no module named"):
        ga.check_model(task, (x, y), layers=["nope"])
    with pytest.raises(ga.UnsupportedLayerError):
        ga.check_model(task, (x, y), layers=[])
    with pytest.raises(ga.DataError):
        ga.check_model(task, None)
    with torch.device("meta"):
        meta = nn.Linear(8, 3)
    with pytest.raises(ga.ModelMismatchError, match="meta device"):
        ga.check_model(ga.Task(meta, sum_ce), (x.float(), y))
    vector = ga.check_model(ga.Task(model, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")), (x, y))
    assert kinds(vector) == {"refused"} and "scalar" in vector["refused"][0].message
    assert ga.check_model(task, (x, y), n_examples=np.int64(3), tolerance=np.float32(1e-5)).examples == (0, 1, 2)
    one = ga.check_model(task, (x[:1], y[:1]))
    assert one.ok and "one example" in one["batch_independence"][0].message


def test_ids_of_the_data_label_the_findings():
    x, y = classification_data()
    from gradalg.data import as_data

    data = as_data((x, y), ids=[f"ex{i}" for i in range(len(x))])
    check = ga.check_model(ga.Task(Mixer().double().eval(), sum_ce), data, n_examples=3)
    assert check.examples == ("ex0", "ex1", "ex2")
    assert [f for f in check["batch_independence"] if f.severity == "fail"][0].examples == ("ex0", "ex1", "ex2")


def test_text_html_and_dict():
    x, y = classification_data()
    check = ga.check_model(ga.Task(Mixer().double().eval(), sum_ce), (x, y), n_examples=3)
    text = str(check)
    assert text.startswith("ga.check_model(Mixer): 1 check(s) FAILED") and "[FAIL] batch_independence" in text
    assert "fix: the examples of a batch interact" in text
    html = check._repr_html_()
    assert "<table>" in html and "batch_independence" in html and "&lt;" not in check.summary()
    d = json.loads(json.dumps(check.to_dict()))
    assert d["ok"] is False and d["findings"][0]["kind"] == "finite"
    assert math.isfinite(d["seconds"]) and d["seconds"] >= 0
    with pytest.raises(KeyError, match="the checks are"):
        check["nope"]


# ----------------------------------------------------------------------- the command line
pytest.importorskip("pydantic")


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory):
    import shutil
    import sys
    from pathlib import Path

    root = tmp_path_factory.mktemp("check_cli")
    examples = Path(__file__).resolve().parents[1] / "examples"
    shutil.copy(examples / "gpt2_tiny.toml", root / "run.toml")
    sys.path.insert(0, str(examples))
    from make_gpt2_tiny import write_tiny

    write_tiny(root / "gpt2_tiny")
    (root / "check_tasks.py").write_text(
        "import gradalg as ga\n"
        "import torch.nn.functional as F\n"
        "def mean_task(model):\n"
        "    def loss(m, b):\n"
        "        logits = m(input_ids=b['input_ids'], attention_mask=b['attention_mask']).logits[:, :-1]\n"
        "        t = b['input_ids'][:, 1:].masked_fill(b['attention_mask'][:, 1:] == 0, -100)\n"
        "        tok = F.cross_entropy(logits.transpose(1, 2), t, ignore_index=-100, reduction='none')\n"
        "        return tok.sum(1).mean()   # a mean over the sequences of the batch\n"
        "    return ga.Task(model, loss)\n")
    sys.path.insert(0, str(root))
    return root


def test_cli_check_passes_and_fails_with_exit_7(cli_dir, capsys):
    from gradalg.cli import EXIT_CODES, main

    run = str(cli_dir / "run.toml")
    assert main(["check", "-c", run, "--examples", "3"]) == 0
    out = capsys.readouterr().out
    assert "ga.check_model(GPT2LMHeadModel): ok" in out and "[ ok ] batch_independence" in out
    assert main(["check", "-c", run, "--examples", "3", "--set", "task.kind=check_tasks:mean_task", "--json"]) == 7
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["ok"] is False and [f["kind"] for f in result["findings"] if f["severity"] == "fail"] == ["loss_sum"]
    assert "each finding above names its fix" in captured.err
    assert 7 in EXIT_CODES
    assert main(["check", "-c", run, "--examples", "1"]) == 2
    assert main(["check", "-c", run, "--examples", "many"]) == 2
    assert main(["check", "-c", run, "--set", 'layers=["nope"]']) == 2
    assert main(["check", "-c", run, "--data", "queries", "--examples", "2", "--html", str(cli_dir / "c.html")]) == 0
    assert "<table>" in (cli_dir / "c.html").read_text()


def test_cli_docs_page_holds_the_check_help():
    from pathlib import Path

    from gradalg.cli import reference

    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert "<!-- generated: help check -->" in text and "## `gradalg check`" in text
    assert reference.render(text) == text


# ----------------------------------------------------------------------- hostile inputs
def test_a_loss_that_raises_names_the_example():
    """A token id beyond the vocabulary: the task's batch validation refuses it, and the
    refusal becomes a finding naming the example, not a raw error."""
    items = token_items()
    items[2] = {"input_ids": torch.tensor([3, 5, 500, 7])}
    check = ga.check_model(ga.tasks.causal_lm(gpt2()), items, n_examples=4)
    assert not check.ok and kinds(check) == {"refused"}
    assert check["refused"][0].examples == (2,) and "'input_ids' holds ids >=" in check["refused"][0].message


def test_dict_of_batched_tensors_is_cut_to_each_examples_tokens():
    """{"input_ids": (N, T), "attention_mask": (N, T)} already right-padded: each example
    alone is cut to its real tokens."""
    ids, mask = padded_token_data(n=5)
    check = ga.check_model(ga.tasks.causal_lm(gpt2()), {"input_ids": ids, "attention_mask": mask}, n_examples=5)
    assert check.ok, check
    assert "collated and right-padded" in check["batch_independence"][0].message
    # int32 ids: whatever the task does with them, no raw error escapes the check
    ga.check_model(ga.tasks.causal_lm(gpt2()), {"input_ids": ids.to(torch.int32), "attention_mask": mask},
                   n_examples=3)


def test_masked_lm_and_seq2seq_dict_items():
    """BERT (labels aligned with input_ids) and T5 (decoder labels of their own length) as
    dict items of unequal length: padded on the encoder's side only where it must."""
    model, _, data, _ = zoo.bert()
    ids, mask, labels = data
    items = [{"input_ids": ids[i][mask[i].bool()], "labels": labels[i][mask[i].bool()]} for i in range(4)]
    keep = [i for i, item in enumerate(items) if (item["labels"] != -100).any()]
    check = ga.check_model(ga.Task(model.eval(), lambda m, b: zoo.masked_lm_loss(
        m, (b["input_ids"], b["attention_mask"], b["labels"]))), [items[i] for i in keep], n_examples=4)
    assert check.ok, check
    t5, task, data, _ = zoo.t5()
    ids, mask, dec, dec_mask, labels = data
    items = [{"input_ids": ids[i][mask[i].bool()], "labels": labels[i][dec_mask[i].bool()]} for i in range(4)]
    check = ga.check_model(ga.tasks.seq2seq(t5.eval()), items, n_examples=4)
    assert check.ok, check
