"""A table of bad (and valid-but-unusual) inputs over every public entry point.

Each row calls one entry point (``ga.grads``, ``ga.capture``, the ``ga.tasks`` builders,
the methods, ``ga.store``, ``ga.compile``, ``ga.eval``, ``ga.options``, the command line's
``main(argv)``) with one input and says what must happen:

* ``REFUSE``: a :class:`~gradalg.GradalgError` (never a raw torch / numpy / xarray /
  Python error), whose message names the field or argument;
* ``WORKS``: no error, and where a number comes out it equals the same computation on the
  canonical input (int64 ids, Python ints, a Dataset) — itself checked against
  loop-of-backward oracles in ``test_tasks_lm.py`` and ``test_capture.py``.

Any other exception fails the row: that is the guarantee of docs/reliability.md, "Bad input".
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from references import one_thread  # noqa: F401 - fixture
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import gradalg as ga
from gradalg.collate import pad_collate

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
VOCAB = 29
WORKS, REFUSE = "works", "refuse"


# --------------------------------------------------------------------------- models and data
def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    return GPT2LMHeadModel(cfg).to(F64).eval()


def _bert():
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=24, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)).to(F64).eval()


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=24, num_layers=1,
                                               num_heads=2, dropout_rate=0.0, decoder_start_token_id=0,
                                               pad_token_id=0)).to(F64).eval()


def _clf():
    from transformers import GPT2Config, GPT2ForSequenceClassification
    torch.manual_seed(0)
    return GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                                                    num_labels=3, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                    attn_pdrop=0.0)).to(F64).eval()


M = {}


def lm():
    if "gpt2" not in M:
        M["gpt2"] = ga.tasks.causal_lm(_gpt2())
    return M["gpt2"]


def bert():
    if "bert" not in M:
        M["bert"] = ga.tasks.masked_lm(_bert())
    return M["bert"]


def t5():
    if "t5" not in M:
        M["t5"] = ga.tasks.seq2seq(_t5())
    return M["t5"]


def clf():
    if "clf" not in M:
        M["clf"] = ga.tasks.sequence_classification(_clf())
    return M["clf"]


def mlp():
    if "mlp" not in M:
        M["mlp"] = ga.tasks.classification(models.mlp())
    return M["mlp"]


LM_LAYERS = ["transformer.h.0.mlp.c_fc"]
XY = models.classification_data(n=10)


def items(n=4, lengths=(6, 4, 6, 5), dtype=torch.long, labels=False, mask=True):
    g = torch.Generator().manual_seed(1)
    out = []
    for L in lengths[:n]:
        ids = torch.randint(1, VOCAB, (L,), generator=g)
        item = {"input_ids": ids.to(dtype)}
        if mask:
            item["attention_mask"] = torch.ones(L, dtype=torch.long)
        if labels:
            item["labels"] = ids.clone().to(dtype)
        out.append(item)
    return out


def mlm_items(n=4):
    out = items(n)
    for i, it in enumerate(out):
        lab = torch.full_like(it["input_ids"], -100)
        lab[i % 3] = it["input_ids"][i % 3]
        it["labels"] = lab
    return out


def s2s_items(n=4):
    g = torch.Generator().manual_seed(2)
    out = items(n)
    for it in out:
        it["labels"] = torch.randint(1, VOCAB, (3,), generator=g)
    return out


def clf_items(n=4):
    out = items(n)
    for i, it in enumerate(out):
        it["labels"] = torch.tensor(i % 3)
    return out


def rows(G) -> torch.Tensor:
    """(n, dim) rows of a GradientSet, blocks in order."""
    return torch.cat([b.flatten(1) for b in G.to_dense().values()], dim=1)


def lm_rows(data, **kw):
    return rows(ga.grads(lm(), data, layers=LM_LAYERS, **kw))


def mlp_rows(data, **kw):
    return rows(ga.grads(mlp(), data, **kw))


def edit(data, i, key, fn):
    data[i][key] = fn(data[i][key])
    return data


def with_(data, key, fn):
    for it in data:
        it[key] = fn(it)
    return data


class Iterable(IterableDataset):
    def __init__(self, xs, n=None):
        self.xs, self.n = xs, n

    def __iter__(self):
        return iter(self.xs)

    def __len__(self):
        return len(self.xs) if self.n is None else self.n


class NoLen(IterableDataset):
    def __iter__(self):
        return iter(items())


class ListData(Dataset):
    def __init__(self, xs):
        self.xs = xs

    def __len__(self):
        return len(self.xs)

    def __getitem__(self, i):
        return self.xs[i]


def dropping(batch):
    return pad_collate(batch[:-1])


def doubling(batch):
    return pad_collate(batch + batch[:1])


def preshifted(it):
    return torch.cat([it["input_ids"][1:], torch.tensor([-100])])


# --------------------------------------------------------------------------- the table
# (id, call, expected, reference): reference() gives the number the call must equal (WORKS rows)
REF_LM = lambda: lm_rows(items())                     # noqa: E731
REF_MLP = lambda: mlp_rows(XY)                        # noqa: E731
IDS = torch.randint(1, VOCAB, (4, 5), generator=torch.Generator().manual_seed(3))

TABLE = [
    # ---- LM batches: ga.grads over ga.tasks.causal_lm
    ("lm int32 input_ids", lambda: lm_rows(items(dtype=torch.int32)), WORKS, REF_LM),
    ("lm int16 ids and int32 labels", lambda: lm_rows(items(dtype=torch.int16, labels=True)), WORKS, REF_LM),
    ("lm backend='func' int32", lambda: lm_rows(items(dtype=torch.int32), backend="func"), WORKS, lambda: lm_rows(items(), backend="func")),
    ("lm backend='func' id >= vocabulary", lambda: lm_rows(edit(items(), 2, "input_ids", lambda t: t + VOCAB), backend="func"), REFUSE, "vocabulary"),
    ("lm a single example", lambda: lm_rows(items(1)), WORKS, lambda: REF_LM()[:1]),
    ("lm items without attention_mask", lambda: lm_rows(items(mask=False)), WORKS, REF_LM),
    ("lm DataLoader(batch_size=None)", lambda: lm_rows(DataLoader(items(), batch_size=None)), WORKS, REF_LM),
    ("lm DataLoader(batch_size=None) + ga batch_size", lambda: lm_rows(DataLoader(items(), batch_size=None),
                                                                      batch_size=3), WORKS, REF_LM),
    ("lm IterableDataset with len", lambda: lm_rows(Iterable(items())), WORKS, REF_LM),
    ("lm DataLoader over an IterableDataset", lambda: lm_rows(DataLoader(Iterable(items()), batch_size=2,
                                                                         collate_fn=pad_collate)), WORKS, REF_LM),
    ("lm items of python lists", lambda: lm_rows([{k: v.tolist() for k, v in d.items()} for d in items()]), WORKS, REF_LM),
    ("lm items of numpy arrays", lambda: lm_rows([{k: v.numpy() for k, v in d.items()} for d in items()]), WORKS, REF_LM),
    ("lm string ids with an empty string", lambda: lm_rows(items(), ids=["", "a", "b", "c"]), WORKS, REF_LM),
    ("lm numpy ids", lambda: lm_rows(items(), ids=np.arange(4)), WORKS, REF_LM),
    ("lm numpy batch_size", lambda: lm_rows(items(), batch_size=np.int64(3)), WORKS, REF_LM),
    ("lm id >= vocabulary", lambda: lm_rows(edit(items(), 2, "input_ids", lambda t: t.index_fill(0, torch.tensor([1]), VOCAB + 3))), REFUSE, "vocabulary"),
    ("lm -100 in input_ids", lambda: lm_rows(edit(items(), 1, "input_ids", lambda t: t.index_fill(0, torch.tensor([2]), -100))), REFUSE, "-100"),
    ("lm negative id", lambda: lm_rows(edit(items(), 0, "input_ids", lambda t: t.index_fill(0, torch.tensor([0]), -3))), REFUSE, "negative"),
    ("lm float input_ids", lambda: lm_rows(items(dtype=F64)), REFUSE, "integer"),
    ("lm 1-d input_ids dict", lambda: lm_rows({"input_ids": torch.arange(1, 6)}), REFUSE, "input_ids"),
    ("lm attention_mask one wider (all)", lambda: lm_rows(with_(items(lengths=(5, 5, 5, 5)), "attention_mask", lambda it: torch.ones(6, dtype=torch.long))), REFUSE, "attention_mask"),
    ("lm attention_mask one narrower (all)", lambda: lm_rows(with_(items(lengths=(5, 5, 5, 5)), "attention_mask", lambda it: torch.ones(4, dtype=torch.long))), REFUSE, "attention_mask"),
    ("lm attention_mask one wider (one item)", lambda: lm_rows(edit(items(), 1, "attention_mask", lambda t: torch.ones(len(t) + 1, dtype=torch.long))), REFUSE, "attention_mask"),
    ("lm attention_mask values 2", lambda: lm_rows(edit(items(), 0, "attention_mask", lambda t: t * 2)), REFUSE, "0 and 1"),
    ("lm labels one wider", lambda: lm_rows(with_(items(lengths=(5, 5, 5, 5)), "labels", lambda it: torch.cat([it["input_ids"], torch.tensor([1])]))), REFUSE, "labels"),
    ("lm labels one narrower", lambda: lm_rows(with_(items(lengths=(5, 5, 5, 5)), "labels", lambda it: it["input_ids"][1:])), REFUSE, "shifted"),
    ("lm pre-shifted labels, trailing -100", lambda: lm_rows(with_(items(), "labels", preshifted)), REFUSE, "already shifted"),
    ("lm labels >= vocabulary", lambda: lm_rows(edit(items(labels=True), 3, "labels", lambda t: t + VOCAB)), REFUSE, "vocabulary"),
    ("lm labels -7", lambda: lm_rows(edit(items(labels=True), 3, "labels", lambda t: t.index_fill(0, torch.tensor([0]), -7))), REFUSE, "negative"),
    ("lm float labels", lambda: lm_rows(with_(items(), "labels", lambda it: it["input_ids"].to(F64))), REFUSE, "integer"),
    ("lm longer than the model's positions", lambda: lm_rows([{"input_ids": torch.randint(1, VOCAB, (L,))} for L in (5, 40, 6)]), REFUSE, "max_position_embeddings"),
    ("lm tuple batches", lambda: lm_rows(TensorDataset(torch.randint(1, VOCAB, (4, 5)))), REFUSE, "dict"),
    ("lm a bare (N, T) id tensor", lambda: lm_rows(IDS), REFUSE, "{'input_ids': ids}"),
    ("lm the message's fix for a bare id tensor", lambda: lm_rows({"input_ids": IDS}), WORKS,
     lambda: lm_rows([{"input_ids": r} for r in IDS])),
    ("lm completion_only without fields", lambda: rows(ga.grads(ga.tasks.causal_lm(lm().model, completion_only=True), items(), layers=LM_LAYERS)), REFUSE, "completion_mask"),
    ("lm prompt_length of another count", lambda: rows(ga.grads(ga.tasks.causal_lm(lm().model, completion_only=True), {"input_ids": torch.randint(1, VOCAB, (3, 5)), "prompt_length": torch.tensor([[1, 2, 1]]).T.repeat(1, 2)}, layers=LM_LAYERS)), REFUSE, "prompt_length"),
    ("lm collate_fn that drops an example", lambda: lm_rows(DataLoader(items(), batch_size=2, collate_fn=dropping)), REFUSE, "collate_fn"),
    ("lm collate_fn that adds an example", lambda: lm_rows(DataLoader(items(), batch_size=2, collate_fn=doubling)), REFUSE, "collate_fn"),
    ("lm IterableDataset with a len too large", lambda: lm_rows(Iterable(items(), n=6)), REFUSE, "len()"),
    ("lm IterableDataset with a len too small", lambda: lm_rows(Iterable(items(), n=3)), REFUSE, "len()"),
    ("lm IterableDataset without len", lambda: lm_rows(NoLen()), REFUSE, "len()"),
    # ---- masked LM, seq2seq, sequence classification
    ("mlm int32 ids and labels", lambda: rows(ga.grads(bert(), [{k: v.int() for k, v in d.items()} for d in mlm_items()])), WORKS, lambda: rows(ga.grads(bert(), mlm_items()))),
    ("mlm id >= vocabulary", lambda: rows(ga.grads(bert(), edit(mlm_items(), 1, "input_ids", lambda t: t + VOCAB))), REFUSE, "vocabulary"),
    ("mlm labels one narrower", lambda: rows(ga.grads(bert(), with_(mlm_items(), "labels", lambda it: it["labels"][:-1]))), REFUSE, "labels"),
    ("mlm token_type_ids 5", lambda: rows(ga.grads(bert(), with_(mlm_items(), "token_type_ids", lambda it: torch.full_like(it["input_ids"], 5)))), REFUSE, "token_type_ids"),
    ("s2s int32", lambda: rows(ga.grads(t5(), [{k: v.int() for k, v in d.items()} for d in s2s_items()])), WORKS, lambda: rows(ga.grads(t5(), s2s_items()))),
    ("s2s labels >= vocabulary", lambda: rows(ga.grads(t5(), edit(s2s_items(), 0, "labels", lambda t: t + VOCAB))), REFUSE, "vocabulary"),
    ("s2s decoder_attention_mask one wider", lambda: rows(ga.grads(t5(), with_(s2s_items(), "decoder_attention_mask", lambda it: torch.ones(4, dtype=torch.long)))), REFUSE, "decoder_attention_mask"),
    ("seqclf int32 ids and labels", lambda: rows(ga.grads(clf(), [{k: v.int() for k, v in d.items()} for d in clf_items()])), WORKS, lambda: rows(ga.grads(clf(), clf_items()))),
    ("seqclf label 3 of 3 classes", lambda: rows(ga.grads(clf(), edit(clf_items(), 2, "labels", lambda t: t * 0 + 3))), REFUSE, "outside"),
    ("seqclf id >= vocabulary", lambda: rows(ga.grads(clf(), edit(clf_items(), 0, "input_ids", lambda t: t + VOCAB))), REFUSE, "vocabulary"),
    # ---- classification on (x, y)
    ("clf int32 labels", lambda: mlp_rows((XY[0], XY[1].int())), WORKS, REF_MLP),
    ("clf (B, 1) labels", lambda: mlp_rows((XY[0], XY[1][:, None])), WORKS, REF_MLP),
    ("clf a list of (x, y) items", lambda: mlp_rows(list(zip(XY[0], XY[1]))), WORKS, REF_MLP),
    ("clf dict batches with default extractors", lambda: mlp_rows({"x": XY[0], "y": XY[1]}), REFUSE, "inputs=lambda"),
    ("clf dict batches with extractors", lambda: rows(ga.grads(ga.tasks.classification(mlp().model, inputs=lambda b: b["x"], targets=lambda b: b["y"]), {"x": XY[0], "y": XY[1]})), WORKS, REF_MLP),
    ("clf inputs without labels", lambda: mlp_rows(XY[0]), REFUSE, "labels"),
    ("clf float32 features for a float64 model", lambda: mlp_rows((XY[0].float(), XY[1])), WORKS, lambda: mlp_rows((XY[0].float().double(), XY[1]))),
    ("clf labels as a list", lambda: mlp_rows((XY[0], XY[1].tolist())), WORKS, REF_MLP),
    ("clf numpy arrays", lambda: mlp_rows((XY[0].numpy(), XY[1].numpy())), WORKS, REF_MLP),
    ("clf integer features for a float model", lambda: mlp_rows((XY[0].long(), XY[1])), REFUSE, "could not read"),
    ("clf features of the wrong width", lambda: mlp_rows((XY[0][:, :5], XY[1])), REFUSE, "could not read"),
    ("lm an item that is None", lambda: lm_rows([None, None]), REFUSE, "stacked"),
    ("lm an empty sequence", lambda: lm_rows([{"input_ids": torch.tensor([], dtype=torch.long)}, {"input_ids": torch.tensor([1, 2])}]), REFUSE, "no tokens"),
    ("clf labels out of range", lambda: mlp_rows((XY[0], XY[1] + 3)), REFUSE, "outside"),
    ("clf label -100", lambda: mlp_rows((XY[0], XY[1].index_fill(0, torch.tensor([4]), -100))), REFUSE, "outside"),
    ("clf float labels", lambda: mlp_rows((XY[0], XY[1].double())), REFUSE, "class indices"),
    ("clf (B, 2) int labels", lambda: mlp_rows((XY[0], XY[1][:, None].repeat(1, 2))), REFUSE, "shape"),
    # ---- data and loaders
    ("data tensors of different lengths", lambda: mlp_rows((XY[0], XY[1][:5])), REFUSE, "different numbers"),
    ("data dict fields of different lengths", lambda: lm_rows({"input_ids": torch.randint(1, VOCAB, (4, 5)), "attention_mask": torch.ones(3, 5)}), REFUSE, "numbers of examples"),
    ("data empty dataset", lambda: mlp_rows((XY[0][:0], XY[1][:0])), REFUSE, "no examples"),
    ("data None", lambda: mlp_rows(None), REFUSE, "not examples"),
    ("data a string", lambda: mlp_rows("train.jsonl"), REFUSE, "str"),
    ("data ids of another length", lambda: mlp_rows(XY, ids=[1, 2]), REFUSE, "ids"),
    ("data repeated ids", lambda: mlp_rows(XY, ids=[0] * 10), REFUSE, "unique"),
    ("data unhashable ids", lambda: mlp_rows(XY, ids=[[i] for i in range(10)]), REFUSE, "hashable"),
    ("data shuffling loader", lambda: mlp_rows(DataLoader(TensorDataset(*XY), batch_size=3, shuffle=True)), REFUSE, "shuffle"),
    ("data drop_last loader", lambda: mlp_rows(DataLoader(TensorDataset(*XY), batch_size=3, drop_last=True)), REFUSE, "drop_last"),
    ("data loader batch_size=None over (x, y)", lambda: mlp_rows(DataLoader(TensorDataset(*XY), batch_size=None)), WORKS, REF_MLP),
    ("data custom Dataset", lambda: mlp_rows(ListData(list(zip(*XY)))), WORKS, REF_MLP),
    # ---- ga.grads arguments
    ("grads batch_size 0", lambda: mlp_rows(XY, batch_size=0), REFUSE, "batch_size"),
    ("grads batch_size 2.5", lambda: mlp_rows(XY, batch_size=2.5), REFUSE, "batch_size"),
    ("grads batch_size '4'", lambda: mlp_rows(XY, batch_size="4"), REFUSE, "batch_size"),
    ("grads layers []", lambda: mlp_rows(XY, layers=[]), REFUSE, "layer"),
    ("grads unknown layer", lambda: mlp_rows(XY, layers=["nope"]), REFUSE, "nope"),
    ("grads layers 5", lambda: mlp_rows(XY, layers=5), REFUSE, "layers"),
    ("grads layers ''", lambda: mlp_rows(XY, layers=""), REFUSE, "layer"),
    ("grads objective 'x'", lambda: mlp_rows(XY, objective="x"), REFUSE, "objective"),
    ("grads backend 'x'", lambda: mlp_rows(XY, backend="x"), REFUSE, "backend"),
    ("grads objective 'sampled' with backend 'func'", lambda: mlp_rows(XY, objective="sampled", backend="func"), REFUSE, "backend='hooks'"),
    ("grads objective 'expected' with backend 'func'", lambda: mlp_rows(XY, objective="expected", backend="func"), REFUSE, "backend='hooks'"),
    ("grads seed 'x'", lambda: mlp_rows(XY, seed="x", objective="sampled"), REFUSE, "seed"),
    ("grads seed np.int64", lambda: mlp_rows(XY, seed=np.int64(3), objective="sampled"), WORKS, lambda: mlp_rows(XY, seed=3, objective="sampled")),
    ("datainf damping 'x'", lambda: ga.datainf(ga.grads(mlp(), XY), "x"), REFUSE, "damping"),
    ("pow 'x'", lambda: ga.fisher(ga.grads(mlp(), XY)).pow("x"), REFUSE, "power"),
    ("grads task not a Task", lambda: ga.grads(models.mlp(), XY), REFUSE, "Task"),
    # ---- task builders
    ("task causal_lm padding_side 'up'", lambda: ga.tasks.causal_lm(lm().model, padding_side="up"), REFUSE, "padding_side"),
    ("task causal_lm n_samples 0", lambda: ga.tasks.causal_lm(lm().model, n_samples=0), REFUSE, "n_samples"),
    ("task causal_lm n_samples np.int64(2)", lambda: ga.tasks.causal_lm(lm().model, n_samples=np.int64(2)), WORKS, None),
    ("task causal_lm trak_output 'x'", lambda: ga.tasks.causal_lm(lm().model, trak_output="x"), REFUSE, "trak_output"),
    ("task classification of a non-module", lambda: ga.tasks.classification("model"), REFUSE, "Module"),
    ("task Task reduction 'avg'", lambda: ga.Task(models.mlp(), lambda m, b: 0, reduction="avg"), REFUSE, "reduction"),
    ("task Task loss not callable", lambda: ga.Task(models.mlp(), 3), REFUSE, "loss"),
    ("task empty name", lambda: ga.tasks.classification(models.mlp(), name=""), WORKS, None),
    # ---- ga.capture
    ("capture a non-module", lambda: ga.capture("model"), REFUSE, "Module"),
    ("capture reduction 'x'", lambda: ga.capture(models.mlp(), reduction="x"), REFUSE, "reduction"),
    ("capture unknown layer", lambda: ga.capture(models.mlp(), ["nope"], reduction="sum").__enter__(), REFUSE, "nope"),
    # ---- options
    ("options np.int64 batch_size", lambda: ga.options(batch_size=np.int64(4)).__enter__().batch_size, WORKS, None),
    ("options np.float32 memory_fraction", lambda: ga.options(memory_fraction=np.float32(0.5)).__enter__(), WORKS, None),
    ("options np.bool_ check_finite", lambda: ga.options(check_finite=np.bool_(True)).__enter__(), WORKS, None),
    ("options np.int64 memory_budget", lambda: ga.options(memory_budget=np.int64(2**30)).__enter__(), WORKS, None),
    ("options unknown", lambda: ga.options(batchsize=4), REFUSE, "unknown"),
    ("options batch_size 0", lambda: ga.options(batch_size=0), REFUSE, "batch_size"),
    ("options batch_size '8'", lambda: ga.options(batch_size="8"), REFUSE, "batch_size"),
    ("options memory_budget 'lots'", lambda: ga.options(memory_budget="lots"), REFUSE, "memory_budget"),
    ("options memory_fraction nan", lambda: ga.options(memory_fraction=float("nan")), REFUSE, "memory_fraction"),
    ("options progress 'x'", lambda: ga.options(progress="x"), REFUSE, "progress"),
    ("options check_finite 'no'", lambda: ga.options(check_finite="no"), REFUSE, "check_finite"),
    # ---- projectors, operators, scores
    ("proj k np.int64, seed np.int64", lambda: rows(ga.proj.gaussian(k=np.int64(4), seed=np.int64(3))(ga.grads(mlp(), XY))), WORKS, lambda: rows(ga.proj.gaussian(k=4, seed=3)(ga.grads(mlp(), XY)))),
    ("proj k 0", lambda: ga.proj.gaussian(k=0), REFUSE, "k"),
    ("proj k '8'", lambda: ga.proj.kron(k="8"), REFUSE, "k"),
    ("proj k 2.5", lambda: ga.proj.sparse(k=2.5), REFUSE, "k"),
    ("proj applied to a tensor", lambda: ga.proj.gaussian(k=4)(XY[0]), REFUSE, "GradientSet"),
    ("proj dense_matrix of a sparse projector", lambda: ga.proj.dense_matrix(ga.proj.sparse(k=4), "0", 10), REFUSE, "no dense matrix"),
    ("damp np.float32", lambda: ga.fisher(ga.grads(mlp(), XY)).damp(np.float32(0.5)).to_dense(), WORKS, lambda: ga.fisher(ga.grads(mlp(), XY)).damp(0.5).to_dense()),
    ("damp -1", lambda: ga.fisher(ga.grads(mlp(), XY)).damp(-1.0), REFUSE, "damp"),
    ("damp nan", lambda: ga.fisher(ga.grads(mlp(), XY)).damp(float("nan")), REFUSE, "damp"),
    ("damp 'x'", lambda: ga.fisher(ga.grads(mlp(), XY)).damp("x"), REFUSE, "damp"),
    ("fisher structure 'x'", lambda: ga.fisher(ga.grads(mlp(), XY), structure="x"), REFUSE, "structure"),
    ("inv method 'x'", lambda: ga.fisher(ga.grads(mlp(), XY)).damp(0.1).inv("x"), REFUSE, "x"),
    ("kfac max examples np.int64", lambda: ga.kfac(ga.grads(mlp(), XY), covariance_max_examples=np.int64(6)).to_dense(), WORKS, lambda: ga.kfac(ga.grads(mlp(), XY), covariance_max_examples=6).to_dense()),
    ("kfac max examples 0", lambda: ga.kfac(ga.grads(mlp(), XY), covariance_max_examples=0), REFUSE, "covariance_max_examples"),
    ("arnoldi rank 0", lambda: ga.arnoldi(ga.fisher(ga.grads(mlp(), XY)), rank=0), REFUSE, "rank"),
    ("low_rank np.int64", lambda: rows(ga.grads(mlp(), XY).low_rank(np.int64(2))), WORKS, lambda: rows(ga.grads(mlp(), XY).low_rank(2))),
    ("low_rank 0", lambda: ga.grads(mlp(), XY).low_rank(0), REFUSE, "rank"),
    ("topk np.int64", lambda: (ga.grads(mlp(), XY[0][:2], ) if False else (ga.grads(mlp(), (XY[0][:2], XY[1][:2])) @ ga.grads(mlp(), XY).T).topk(np.int64(3)).values), WORKS, lambda: (ga.grads(mlp(), (XY[0][:2], XY[1][:2])) @ ga.grads(mlp(), XY).T).topk(3).values),
    ("topk 0", lambda: (ga.grads(mlp(), (XY[0][:2], XY[1][:2])) @ ga.grads(mlp(), XY).T).topk(0), REFUSE, "k"),
    ("topk '3'", lambda: (ga.grads(mlp(), (XY[0][:2], XY[1][:2])) @ ga.grads(mlp(), XY).T).topk("3"), REFUSE, "k"),
    ("product of a GradientSet and a tensor", lambda: ga.grads(mlp(), XY) @ XY[0], REFUSE, "GradientSet"),
    ("scores / 0", lambda: (ga.grads(mlp(), (XY[0][:2], XY[1][:2])) @ ga.grads(mlp(), XY).T) / 0, REFUSE, "non-zero"),
    ("scores + tensor", lambda: (ga.grads(mlp(), (XY[0][:2], XY[1][:2])) @ ga.grads(mlp(), XY).T) + torch.ones(2, 10), REFUSE, "Scores"),
    ("G * tensor", lambda: ga.grads(mlp(), XY) * torch.ones(10), REFUSE, "row_weights"),
    ("G.select an unknown block", lambda: ga.grads(mlp(), XY).select(["nope"]), REFUSE, "nope"),
    ("group_mean with too few labels", lambda: ga.grads(mlp(), XY).group_mean([0, 1]), REFUSE, "group labels"),
    ("row_weights of a GradientSet", lambda: ga.row_weights(ga.grads(mlp(), XY), torch.ones(3)), REFUSE, "row_weights"),
    ("compiled called on a string", lambda: ga.compile(ga.grads(mlp(), (XY[0][:2], XY[1][:2])) @ ga.grads(mlp(), XY).T)("x"), REFUSE, "Scores"),
    # ---- methods
    ("influence np.float32 damping", lambda: ga.methods.influence(mlp(), XY, (XY[0][:2], XY[1][:2]), damping=np.float32(0.5)).compute().values, WORKS, lambda: ga.methods.influence(mlp(), XY, (XY[0][:2], XY[1][:2]), damping=0.5).compute().values),
    ("influence damping -1", lambda: ga.methods.influence(mlp(), XY, XY, damping=-1.0), REFUSE, "damping"),
    ("influence damping 'x'", lambda: ga.methods.influence(mlp(), XY, XY, damping="x"), REFUSE, "damping"),
    ("influence curvature 'x'", lambda: ga.methods.influence(mlp(), XY, XY, curvature="x"), REFUSE, "curvature"),
    ("influence solver 'x'", lambda: ga.methods.influence(mlp(), XY, XY, solver="x"), REFUSE, "solver"),
    ("influence queries None", lambda: ga.methods.influence(mlp(), XY, None), REFUSE, "not examples"),
    ("trak k np.int64, seed np.int64", lambda: ga.methods.trak(mlp(), XY, (XY[0][:2], XY[1][:2]), k=np.int64(8), seed=np.int64(1)).compute().values, WORKS, lambda: ga.methods.trak(mlp(), XY, (XY[0][:2], XY[1][:2]), k=8, seed=1).compute().values),
    ("trak k 0", lambda: ga.methods.trak(mlp(), XY, XY, k=0), REFUSE, "k"),
    ("logra k '4'", lambda: ga.methods.logra(mlp(), XY, XY, k="4"), REFUSE, "k"),
    ("grass k 0", lambda: ga.methods.grass(mlp(), XY, XY, k=0), REFUSE, "k"),
    ("grad_dot projector 'x'", lambda: ga.methods.grad_dot(mlp(), XY, XY, projector="x"), REFUSE, "projector"),
    ("trak of an empty list", lambda: ga.methods.trak([], XY, XY, k=4), REFUSE, "non-empty"),
    ("tracin numpy learning rates", lambda: ga.methods.tracin([mlp(), mlp()], np.array([0.1, 0.2]), XY, (XY[0][:2], XY[1][:2])).compute().values, WORKS, lambda: ga.methods.tracin([mlp(), mlp()], [0.1, 0.2], XY, (XY[0][:2], XY[1][:2])).compute().values),
    ("tracin nan learning rate", lambda: ga.methods.tracin([mlp()], [float("nan")], XY, XY), REFUSE, "finite"),
    ("tracin lengths differ", lambda: ga.methods.tracin([mlp(), mlp()], [0.1], XY, XY), REFUSE, "learning rates"),
    ("self_influence of a method's name", lambda: ga.methods.self_influence("grad_dot", mlp(), XY).compute().values, WORKS, lambda: ga.methods.self_influence(ga.methods.grad_dot, mlp(), XY).compute().values),
    ("self_influence of an unknown name", lambda: ga.methods.self_influence("grad_dots", mlp(), XY), REFUSE, "no method named"),
    ("self_influence of a number", lambda: ga.methods.self_influence(3, mlp(), XY), REFUSE, "method"),
    # ---- stores and compile
    ("store.write a tensor", lambda: ga.store.write(XY[0], "x.zarr"), REFUSE, "GradientSet"),
    ("store.write chunk_rows 0", lambda: ga.store.write(ga.grads(mlp(), XY), "x.zarr", chunk_rows=0), REFUSE, "chunk_rows"),
    ("store.write chunk_rows np.int64", "store_np", WORKS, None),
    ("store.write an IterableDataset", "store_iterable", WORKS, None),
    ("store.write to a None path", lambda: ga.store.write(ga.grads(mlp(), XY), None), REFUSE, "path"),
    ("store.open of an int", lambda: ga.store.open(5), REFUSE, "path"),
    ("store.open a missing path", lambda: ga.store.open("/nonexistent/x.zarr"), REFUSE, "x.zarr"),
    ("store.open a plain file", "store_file", REFUSE, "store"),
    ("compile a GradientSet", lambda: ga.compile(ga.grads(mlp(), XY)), REFUSE, "Scores"),
    ("compile on_change 'x'", lambda: ga.compile(ga.grads(mlp(), XY) @ ga.grads(mlp(), XY).T, on_change="x"), REFUSE, "on_change"),
    # ---- evaluation
    ("eval subset_masks numpy", lambda: ga.eval.subset_masks(np.int64(10), np.int64(4), np.float32(0.5)), WORKS, lambda: ga.eval.subset_masks(10, 4, 0.5)),
    ("eval subset_masks fraction 2", lambda: ga.eval.subset_masks(10, 4, 2.0), REFUSE, "fraction"),
    ("eval subset_masks n_subsets 0", lambda: ga.eval.subset_masks(10, 0, 0.5), REFUSE, "n_subsets"),
    ("eval lds of a list", lambda: ga.eval.lds([1, 2, 3], [1, 2, 3]), REFUSE, "target"),
    ("eval spearman shapes differ", lambda: ga.eval.spearman(np.ones((3, 2)), np.ones((4, 2))), REFUSE, "shape"),
    ("eval retrain n_train 0", lambda: ga.eval.retrain(lambda idx: None, 0, n_subsets=2, targets_fn=lambda m: [0.0]), REFUSE, "n_train"),
    # ---- checks and the trajectory
    ("check Finding of an unknown kind", lambda: ga.check.Finding("nope", "error", "m"), REFUSE, "finding kind"),
    ("check Finding of an unknown severity", lambda: ga.check.Finding(ga.check.result.KINDS[0], "nope", "m"), REFUSE, "severity"),
    ("trajectory hf_callback layers", lambda: ga.trajectory(mlp().model, mlp(), XY, lr=0.1).hf_callback(layers=["0"]), REFUSE, "ga.trajectory(..., layers="),
]


def _special(name, tmp_path):
    if name == "store_np":
        ga.store.write(ga.grads(mlp(), XY), tmp_path / "a.zarr", chunk_rows=np.int64(4))
        return rows(ga.store.open(tmp_path / "a.zarr")), REF_MLP()
    if name == "store_iterable":
        G = ga.grads(lm(), Iterable(items()), layers=LM_LAYERS)
        with pytest.warns(UserWarning, match="materialized"):
            ga.store.write(G, tmp_path / "b.zarr", chunk_rows=3)
        return rows(ga.store.open(tmp_path / "b.zarr", like=G)), REF_LM()
    if name == "store_file":
        (tmp_path / "f.zarr").write_text("not a store")
        return ga.store.open(tmp_path / "f.zarr"), None
    raise AssertionError(name)


def _close(got, want):
    got = torch.as_tensor(np.asarray(got)) if not isinstance(got, torch.Tensor) else got
    want = torch.as_tensor(np.asarray(want)) if not isinstance(want, torch.Tensor) else want
    assert got.shape == want.shape
    assert torch.allclose(got.double(), want.double(), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("case", TABLE, ids=[c[0] for c in TABLE])
def test_bad_input_is_refused_or_works(case, tmp_path, monkeypatch):
    name, call, expected, ref = case
    monkeypatch.chdir(tmp_path)
    with ga.options(progress=False):
        try:
            if isinstance(call, str):
                got, want = _special(call, tmp_path)
            else:
                got, want = call(), (ref() if callable(ref) else None)
        except ga.GradalgError as err:
            if expected == WORKS:
                pytest.fail(f"{name}: valid input refused: {type(err).__name__}: {err}")
            assert ref.lower() in str(err).lower(), f"{name}: the message does not name {ref!r}: {err}"
            return
        except Exception as err:   # noqa: BLE001 - the point of the table
            pytest.fail(f"{name}: raw {type(err).__name__} from user input: {err}")
    assert expected == WORKS, f"{name}: bad input accepted (no error)"
    if want is not None:
        _close(got, want)


# --------------------------------------------------------------------------- the fix in a refusal works
def test_the_suggested_fixes_work():
    """The fixes the refusals name give the numbers of the canonical input."""
    ref = REF_LM()
    # "-100 belongs in labels only": the pad token with attention_mask 0 (at the end: right padding)
    data = items()
    data[1]["input_ids"][3] = 0
    data[1]["attention_mask"][3] = 0
    with pytest.raises(ga.BatchContentError):
        bad = items()
        bad[1]["input_ids"][3] = -100
        lm_rows(bad)
    # pre-shifted labels: pass them aligned (labels = input_ids) or leave them out
    aligned = with_(items(), "labels", lambda it: it["input_ids"].clone())
    _close(lm_rows(aligned), ref)
    # a collate_fn that drops examples: remove them from the dataset instead
    kept = [it for i, it in enumerate(items()) if i % 2 == 0]
    _close(lm_rows(DataLoader(kept, batch_size=2, collate_fn=pad_collate)), ref[[0, 2]])
    # class labels (B,) long
    _close(mlp_rows((XY[0], XY[1].double().long())), REF_MLP())


def test_refusals_name_the_example_ids():
    data = edit(items(), 2, "input_ids", lambda t: t.index_fill(0, torch.tensor([1]), VOCAB + 3))
    with pytest.raises(ga.BatchContentError, match=r"example ids \['c'\].*example c position 1") as err:
        lm_rows(data, ids=["a", "b", "c", "d"])
    assert err.value.example_ids == ["c"]
    with pytest.raises(ga.BatchContentError, match=r"example ids \[1, 3\]") as err:
        lm_rows([dict(it, labels=preshifted(it) if i % 2 else it["input_ids"].clone()) for i, it in enumerate(items())])
    assert err.value.example_ids == [1, 3]
    with pytest.raises(ga.DataError, match="batch 0 .from example 0 on. holds 1 examples"):
        lm_rows(DataLoader(items(), batch_size=2, collate_fn=dropping))


# --------------------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory):
    pytest.importorskip("pydantic")
    sys.path.insert(0, str(ROOT / "examples"))
    from make_gpt2_tiny import write_tiny
    root = tmp_path_factory.mktemp("cli_bad")
    shutil.copy(ROOT / "examples" / "gpt2_tiny.toml", root / "run.toml")
    write_tiny(root / "gpt2_tiny")
    return root


def _cli(*argv):
    from gradalg.cli import main
    return main([str(a) for a in argv])


def test_cli_out_of_vocabulary_id_exits_5_naming_the_example(cli_dir, capsys):
    from gradalg.cli.codes import RUN_REFUSED
    path = cli_dir / "gpt2_tiny" / "bad.jsonl"
    lines = (cli_dir / "gpt2_tiny" / "train.jsonl").read_text().splitlines()
    row = json.loads(lines[5])
    row["input_ids"][2] = 500
    lines[5] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    code = _cli("build", "-c", cli_dir / "run.toml", "-q", "--set", f"data.train.path='{path}'",
                "--set", f"store.path='{cli_dir / 'bad.zarr'}'")
    err = capsys.readouterr().err
    assert code == RUN_REFUSED and "Traceback" not in err
    assert "vocabulary size 64" in err and "example ids [5]" in err


@pytest.mark.parametrize("argv, code", [
    (["nope"], 2),
    (["build"], 2),
    (["build", "-c", "absent.toml"], 2),
    (["build", "-c", "{run}", "--set", "projector.k=0"], 2),
    (["build", "-c", "{run}", "--set", "options.batch_size='x'"], 2),
    (["build", "-c", "{run}", "--set", "layers=''"], 2),
    (["build", "-c", "{run}", "--set", "data.train.path=''"], 2),
    (["inspect", "{dir}/nothing.zarr"], 4),
])
def test_cli_bad_arguments_exit_with_their_code(cli_dir, capsys, argv, code):
    argv = [a.format(run=cli_dir / "run.toml", dir=cli_dir) for a in argv]
    got = _cli(*argv)
    err = capsys.readouterr().err
    assert got == code, err
    assert "Traceback" not in err and "unexpected" not in err


@pytest.mark.parametrize("line, code, words", [
    ({"tokens": [1, 2]}, 5, "no column 'input_ids'"),
    ({"input_ids": ["a", "b"]}, 5, "not a list of integer token ids"),
    ({"input_ids": [1.5, 2.0]}, 5, "not a list of integer token ids"),     # would be truncated to ints silently
    ({"input_ids": [[1, 2], [3]]}, 5, "not a list of integer token ids"),
    ({"input_ids": []}, 5, "no tokens"),
    ({"input_ids": [1, -100, 3]}, 5, "-100"),
    ({"input_ids": list(range(1, 40))}, 5, "max_position_embeddings"),
    ("{not json", 2, "not JSON"),
])
def test_cli_bad_data_lines_exit_with_their_code(cli_dir, capsys, line, code, words):
    name = f"bad{abs(hash(str(line))) % 10**6}"
    good = (cli_dir / "gpt2_tiny" / "train.jsonl").read_text().splitlines()[:3]
    path = cli_dir / "gpt2_tiny" / f"{name}.jsonl"
    path.write_text("\n".join(good + [line if isinstance(line, str) else json.dumps(line)]) + "\n")
    got = _cli("build", "-c", cli_dir / "run.toml", "-q", "--set", f"data.train.path='{path}'",
               "--set", f"store.path='{cli_dir / name}.zarr'", "--set", "data.train.n=4")
    err = capsys.readouterr().err
    assert got == code, err
    assert words in err and "Traceback" not in err


# --------------------------------------------------------------------------- no bare ValueError / TypeError
#: the bare raises left in the package, each an internal invariant no user input reaches:
#: a stale device-profile cache entry (caught by ``read_cached``, which re-measures); rows by
#: ranges of a root ``restrictable()`` refused first; layer rules of tied blocks and embeddings
#: never asked to record, and a transpose only of one-hot factors (the projection kinds' kernels
#: are reached through their kind object, so no "not a sparse kind" fall-through is left)
BARE_RAISES = {"devices/record.py": 1, "expr/windows.py": 1, "capture/tying.py": 5}


def test_user_input_raises_gradalg_errors_not_bare_value_or_type_errors():
    """Each ``raise ValueError`` / ``raise TypeError`` in the package is one of the internal
    invariants above: an error from user input is a :class:`~gradalg.GradalgError` naming the
    fix (a new bare raise fails here: make it a typed error, or list it with its reason)."""
    import re
    found = {}
    for path in sorted((ROOT / "gradalg").rglob("*.py")):
        count = len(re.findall(r"raise (?:ValueError|TypeError)\b", path.read_text()))
        if count:
            found[path.relative_to(ROOT / "gradalg").as_posix()] = count
    assert found == BARE_RAISES
