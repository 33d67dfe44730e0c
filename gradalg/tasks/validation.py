"""Validation of the batches the ``ga.tasks`` builders read: one place, called by every task.

A batch is checked (and its integer fields normalized) before the model sees it, so a
wrong field never reaches torch as an ``IndexError`` or a size mismatch: it is refused
with a :class:`~gradalg.errors.BatchContentError` that names the field, the example ids
(batch rows when the ids are not known) and the fix.

Token batches (:func:`token_batch`), for the sequence tasks and ``sequence_classification``:

====================  ===========================================================================
``input_ids``         an integer tensor (B, T) (int32, int16, uint8 are read as int64), every
                      id in ``[0, V)`` with V the model's input vocabulary (``-100`` is a label
                      value, never a token: refused naming the positions)
``attention_mask``    (B, T) like ``input_ids``, values 0 / 1 (bool, int or float)
``token_type_ids``    (B, T), integers in ``[0, config.type_vocab_size)``
``completion_mask``   (B, T), values 0 / 1;  ``prompt_length`` (B,) integers
``labels``            (B, T) like ``input_ids`` (causal and masked LM) or (B, T_dec) (seq2seq),
                      integers in ``[0, V)`` or ``-100``; causal LM labels already shifted by one
                      (``labels[t] = input_ids[t + 1]``, last real label ``-100``) are refused
``decoder_*``         (B, T_dec) like ``labels``
====================  ===========================================================================

Class labels (:func:`class_labels`), for the classification tasks: (B,) (or (B, 1)) integers
(any integer or bool dtype, read as int64) in ``[0, C)``, or class probabilities (B, C) float.
"""
from __future__ import annotations

import contextlib
import os
import re
import weakref
from collections.abc import Mapping

import torch

from ..errors import BatchContentError, GradalgError
from ..eval_mode import eval_mode
from ..own_hooks import suspended

__all__ = ["token_batch", "not_a_dict", "no_forward_ad", "class_labels", "pair_field", "input_vocab", "output_vocab", "max_positions", "IGNORE",
           "values_known"]

IGNORE = -100
#: integer fields read as int64 (token ids, labels, lengths)
INTEGER_FIELDS = ("input_ids", "labels", "token_type_ids", "decoder_input_ids", "prompt_length")
#: fields (B, T) aligned with ``input_ids``
ALIGNED = ("attention_mask", "token_type_ids", "completion_mask")
#: 0/1 fields
MASKS = ("attention_mask", "completion_mask", "decoder_attention_mask")


def _traced(value) -> bool:
    """Whether the values of ``value`` are unknown to Python: a tensor seen through a
    torch.func transform (``vmap`` / ``grad`` of the func backend and the per-example
    references), or a ``meta`` tensor (the planner's shape measurement,
    :func:`gradalg.plan.shapes.measure_forward_shapes`, which runs the loss on meta copies
    of the batch). The value checks are skipped there; the shape checks still run. The
    batch itself was checked before (``Task.validate_batch`` runs on the real tensors
    before every capture)."""
    return isinstance(value, torch.Tensor) and (value.is_meta
                                                 or torch._C._functorch.is_functorch_wrapped_tensor(value))


def values_known(value) -> bool:
    """Whether the value checks can read ``value`` (not :func:`_traced`, not meta)."""
    return not _traced(value)


@contextlib.contextmanager
def reading(task: str, model=None, args=(), kwargs: Mapping | None = None, checked: bool = False):
    """Run the model on a batch; an error the model raises on it (a dtype or a width its
    layers do not take) becomes a :class:`BatchContentError` carrying the model's message
    (the original chained). Errors raised inside gradalg's own code pass unchanged: they
    are gradalg's, not the batch's.

    ``model`` and its call's ``args`` / ``kwargs`` (the batch's tensors, as the model got
    them): when they are given and hold real tensors (not meta, not seen through a
    torch.func transform), the model's plain forward is run once more on them, without
    gradalg's capture (:func:`own_forward_error`). When it fails too, the message says the
    model's own forward fails on this batch, with torch's message, and the advice is about
    the model (a model in a dtype one of its ops has no kernel for: :func:`dtype_advice`;
    a config whose sizes disagree); ``checked``: the inputs passed gradalg's checks (a
    token batch, :func:`token_batch`), so the advice is about the model alone."""
    try:
        yield
    except GradalgError:
        raise
    except (RuntimeError, IndexError, TypeError, ValueError) as err:
        if _raised_in_gradalg(err) or no_forward_ad(err):
            raise   # gradalg's own, or an operation torch.func cannot differentiate: not the batch's fault
        raise BatchContentError(_unread(task, err, model, args, kwargs or {}, checked)) from err


_INPUTS = ("give it inputs of the dtype, shape and device its layers take (float features of the model's dtype "
           "and width, integer token ids)")


def _unread(task: str, err: BaseException, model, args, kwargs: Mapping, checked: bool) -> str:
    """The message of :func:`reading`'s :class:`BatchContentError` for the model's ``err``."""
    said = f"{type(err).__name__}: {str(err)[:300]}"
    own = own_forward_error(model, args, kwargs) if model is not None else _UNKNOWN
    advice = dtype_advice(err, model) if model is not None else None
    if own is _UNKNOWN or own is None:
        why = "" if own is _UNKNOWN else (" (its plain forward, without gradalg's capture, reads this batch: the "
                                          "failure comes with the capture)")
        fix = advice or _INPUTS
        return f"ga.tasks.{task}: the model could not read the batch ({said}){why}: {fix}"
    if advice is None:
        model_fix = ("check the model's config and code (sizes that disagree, e.g. a num_key_value_heads that does "
                     "not divide num_attention_heads, fail on every input) and run the model alone on the batch "
                     "until it works")
        advice = (f"the batch passed gradalg's checks, so the model is at fault: {model_fix}" if checked else
                  f"{_INPUTS}; if they are such inputs, {model_fix}")
    lead = "" if checked else "the model could not read the batch: "   # unchecked inputs may be the cause
    return (f"ga.tasks.{task}: {lead}the model's own forward fails on this batch, without gradalg's capture too "
            f"({type(own).__name__}: {str(own)[:300]}): {advice}")


_UNKNOWN = object()   # own_forward_error could not run the model's plain forward


def own_forward_error(model, args=(), kwargs: Mapping | None = None):
    """The error the model's plain forward ``model(*args, **kwargs)`` raises, run without
    gradalg's capture (gradalg's forward hooks on its modules and the global ones off:
    :func:`gradalg.own_hooks.suspended`, a user's hooks on; no torch-function
    mode, no autograd graph, eval mode: no running statistics updated);
    None when it runs; ``_UNKNOWN`` when the
    inputs are not real values (meta, or seen through a torch.func transform: not the
    user's batch) and nothing is run."""
    from torch.utils._pytree import tree_flatten
    kwargs = dict(kwargs or {})
    if any(_traced(t) for t in tree_flatten((args, kwargs))[0]) or not isinstance(model, torch.nn.Module):
        return _UNKNOWN
    try:
        with suspended(model), eval_mode(model), torch.no_grad(), torch._C.DisableTorchFunction():
            model(*args, **kwargs)
    except Exception as err:    # noqa: BLE001 - the model's own error is the answer
        return err
    return None


#: op names (Python frames) of kernels that exist for a few floating dtypes only, and the fix
_DTYPE_LIMITED_OPS = {
    "grouped_mm": ("float32, bfloat16 or float16", "its MoE experts' grouped matrix product (transformers' default "
                   "experts_implementation 'grouped_mm')",
                   "switch its experts to the per-expert loop: `model.set_experts_implementation(\"eager\")` "
                   "(or experts_implementation=\"eager\" in its config / from_pretrained), or run it in float32: "
                   "`model = model.float()`"),
}


def dtype_advice(err: BaseException, model) -> str | None:
    """The fix for a model whose op has no kernel for the model's dtype (``err`` raised
    under a frame named in ``_DTYPE_LIMITED_OPS``, the model's parameters in another
    floating dtype than the op takes); None otherwise."""
    tb, names = err.__traceback__, set()
    while tb is not None:
        names.add(tb.tb_frame.f_code.co_name.lstrip("_"))
        tb = tb.tb_next
    param = next((p for p in model.parameters() if p.is_floating_point()), None) if model is not None else None
    for op, (dtypes, what, fix) in _DTYPE_LIMITED_OPS.items():
        if op in names and param is not None and str(param.dtype).removeprefix("torch.") not in dtypes:
            return f"{what} has no {param.dtype} kernel (it takes {dtypes}): {fix}"
    return None


def no_forward_ad(err: BaseException) -> bool:
    """Whether ``err`` is torch's refusal of forward-mode AD (``torch.func.jvp``) through an
    operation that has no rule for it: an operator ("... forward AD ...", on CPU the fused
    ``scaled_dot_product_attention``) or a custom ``torch.autograd.Function`` without a ``jvp``
    ("... to use it with forward mode AD")."""
    return isinstance(err, NotImplementedError) and _FORWARD_AD.search(str(err)) is not None


_FORWARD_AD = re.compile(r"forward[- ](mode )?AD")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TASKS = os.path.dirname(os.path.abspath(__file__))


def _raised_in_gradalg(err: BaseException) -> bool:
    """Whether the innermost frame of ``err`` is gradalg's own code (outside ``tasks/``). An
    error a torch op raised while a gradalg torch-function mode forwarded the call (the
    innermost Python frame is then the mode's: ``raised_by_torch_op``) is the op's, not
    gradalg's."""
    if getattr(err, "raised_by_torch_op", False):
        return False
    tb, last = err.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    path = os.path.abspath(last or "")
    return path.startswith(_PACKAGE + os.sep) and not path.startswith(_TASKS + os.sep)


def model_inputs(x, model):
    """``x`` for ``model(x)``: a floating tensor in another floating dtype than the model's
    parameters is cast to theirs (float32 features for a float64 model); anything else as is."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        if param is not None and param.dtype != x.dtype:
            return x.to(param.dtype)
    return x


def _rows(rows, ids) -> tuple[str, list]:
    rows = sorted({int(r) for r in rows})
    named = [ids[r] for r in rows] if ids is not None else rows
    more = "" if len(named) <= 10 else f" (and {len(named) - 10} more)"
    return ("example ids " if ids is not None else "batch rows ") + str(named[:10]) + more, named


def _refuse(task: str, message: str, rows=(), ids=None, fix: str = "") -> BatchContentError:
    text = message + (f": {fix}" if fix else "")
    if len(rows):
        where, named = _rows(rows, ids)
        return BatchContentError(f"ga.tasks.{task}: {where}: {text}", named)
    return BatchContentError(f"ga.tasks.{task}: {text}")


def _positions(bad: torch.Tensor, ids, limit: int = 5) -> str:
    """'example 3 position 7, ...' for the first True entries of a (B, T) bool tensor."""
    where = torch.nonzero(bad)[:limit].tolist()
    text = ", ".join(f"{'example' if ids is not None else 'row'} {ids[b] if ids is not None else b} position {t}"
                     for b, t in where)
    return text + (" ..." if int(bad.sum()) > limit else "")


def _embeddings(model, getter: str):
    """``model.<getter>()`` (transformers' ``get_input_embeddings`` /
    ``get_output_embeddings``); None when the model has none or cannot say."""
    get = getattr(model, getter, None)
    try:
        return get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None


def input_vocab(model) -> int | None:
    """The number of rows of the model's input embedding (None when it cannot be read)."""
    emb = _embeddings(model, "get_input_embeddings")
    if isinstance(emb, torch.nn.Embedding):
        return emb.num_embeddings
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def output_vocab(model) -> int | None:
    """The number of logits per position (the output embedding's rows; else the input vocabulary)."""
    head = _embeddings(model, "get_output_embeddings")
    if isinstance(head, torch.nn.Linear):
        return head.out_features
    return input_vocab(model)


def max_positions(model) -> int | None:
    """The most positions a model with *learned* absolute position embeddings can read
    (``config.max_position_embeddings``, when an embedding named like ``*pos*`` / ``wpe``
    exists); None for relative or rotary positions (no table to index past)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    if model not in _LEARNED_POSITIONS:   # one walk over the modules per model
        _LEARNED_POSITIONS[model] = any(
            isinstance(m, torch.nn.Embedding) and ("pos" in name.rsplit(".", 1)[-1] or name.endswith("wpe"))
            for name, m in model.named_modules())
    return limit if _LEARNED_POSITIONS[model] else None


_LEARNED_POSITIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _check_length(tokens: torch.Tensor, mask, model, ids, task: str) -> None:
    limit = max_positions(model) if model is not None else None
    if limit is None or tokens.shape[1] <= limit or _traced(tokens):
        return
    lengths = mask.sum(1) if mask is not None else torch.full((tokens.shape[0],), tokens.shape[1])
    rows = torch.nonzero(lengths > limit).flatten()
    what = (f"have more than the model's {limit} positions (max_position_embeddings)" if len(rows) else
            f"are padded to {tokens.shape[1]} tokens, more than the model's {limit} positions "
            "(max_position_embeddings)")
    raise _refuse(task, f"the sequences {what}" if not len(rows) else what, rows, ids,
                  f"truncate to {limit} tokens (tokenizer(..., truncation=True, max_length={limit})) and pad "
                  "no further than that")


def _tensor(batch, name: str, task: str) -> torch.Tensor:
    value = batch[name]
    if isinstance(value, (list, tuple)):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise _refuse(task, f"the field {name!r} is a {type(value).__name__} that is not a rectangular "
                          "array of numbers", fix="pass a tensor (B, T), padded (gradalg's collate pads "
                          "dict items of unequal length)") from err
    if not isinstance(value, torch.Tensor):
        raise _refuse(task, f"the field {name!r} is a {type(value).__name__}, not a tensor",
                      fix=f"pass {name!r} as a torch tensor (B, ...)")
    return value


def _integers(value: torch.Tensor, name: str, task: str) -> torch.Tensor:
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise _refuse(task, f"{name!r} has dtype {value.dtype}, not integers",
                      fix=f"pass token ids as an integer tensor ({name}.long())")
    return value.long() if value.dtype != torch.long else value


def _check_shape(value: torch.Tensor, name: str, shape: tuple, task: str, against: str, hint: str = "") -> None:
    if tuple(value.shape) != tuple(shape):
        raise _refuse(task, f"{name!r} has shape {tuple(value.shape)} but {against} has {tuple(shape)}",
                      fix=f"give {name!r} one entry per token of {against} (same batch and length){hint}")


def _check_mask(value: torch.Tensor, name: str, ids, task: str) -> None:
    if value.dtype == torch.bool or _traced(value):
        return
    bad = (value != 0) & (value != 1)
    if bool(bad.any()):
        rows = torch.nonzero(bad.reshape(bad.shape[0], -1).any(1)).flatten()
        raise _refuse(task, f"{name!r} holds values other than 0 and 1 (at {_positions(bad.reshape(bad.shape[0], -1), ids)})",
                      rows, ids, f"pass {name!r} as 0/1 (1: a real token)")


def _check_range(value: torch.Tensor, name: str, vocab: int | None, ids, task: str, labels: bool) -> None:
    if _traced(value):
        return
    allowed_neg = value == IGNORE if labels else torch.zeros_like(value, dtype=torch.bool)
    low = (value < 0) & ~allowed_neg
    if bool(low.any()):
        rows = torch.nonzero(low.any(1)).flatten()
        what = "-100 (the labels' ignore value)" if bool((value[low] == IGNORE).all()) else "negative ids"
        fix = ("replace it in input_ids by a real token id (the pad token's) and mask it with "
               "attention_mask 0; -100 belongs in labels only" if what.startswith("-100") else
               "pass ids in [0, vocabulary)" + (" or -100 for labels that do not count" if labels else ""))
        raise _refuse(task, f"{name!r} holds {what} at {_positions(low, ids)}", rows, ids, fix)
    if vocab is not None:
        high = value >= vocab
        if bool(high.any()):
            rows = torch.nonzero(high.any(1)).flatten()
            raise _refuse(task, f"{name!r} holds ids >= the model's vocabulary size {vocab} (max "
                          f"{int(value[high].max())}) at {_positions(high, ids)}", rows, ids,
                          "tokenize with the model's own tokenizer, or resize the model's embeddings "
                          "(model.resize_token_embeddings) if tokens were added")


def _check_preshifted(ids_t: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, ids, task: str) -> None:
    """Refuse causal-LM labels already shifted by one: in every row holding at least two
    counted labels, each counted label at position t equals ``input_ids[t + 1]``, the
    label of the last real token is -100, and some counted label differs from
    ``input_ids[t]`` (labels aligned with the inputs, HF's convention, never qualify)."""
    if ids_t.shape[1] < 2 or _traced(ids_t) or _traced(labels):
        return
    counted = (labels != IGNORE) & mask
    head = counted[:, :-1]
    matches_next = (labels[:, :-1] == ids_t[:, 1:]) | ~head
    differs_here = ((labels != ids_t) & counted).any(1)
    last = (mask.long().cumsum(1).argmax(1))      # the last real position of a right- or left-padded row
    last_ignored = labels.gather(1, last.unsqueeze(1)).squeeze(1) == IGNORE
    shifted = matches_next.all(1) & differs_here & last_ignored & (head.sum(1) >= 2)
    if bool(shifted.any()):
        rows = torch.nonzero(shifted).flatten()
        raise _refuse(task, "'labels' look already shifted by one (labels[t] = input_ids[t + 1], the last "
                      "label -100), but causal_lm shifts them itself (HF's convention): each token would be "
                      "trained to predict the one after next", rows, ids,
                      "pass labels aligned with input_ids (labels = input_ids.clone(), -100 where a token "
                      "should not count), or leave 'labels' out")


def not_a_dict(batch, task: str) -> BatchContentError:
    """The error for a batch that is not a dict of fields, naming what it is.

    Tensors passed as the data (``ids`` (N, T), or ``(ids, labels)``) reach the task as a
    list of batch tensors, which carries no field names: the message says so and gives the
    dict spelling of the same data."""
    if isinstance(batch, (list, tuple)) and batch and all(isinstance(t, torch.Tensor) for t in batch):
        shapes = ", ".join(str(tuple(t.shape)) for t in batch)
        got = (f"unnamed tensors {shapes} (the data was passed as a tensor or a tuple of tensors), so "
               "gradalg cannot tell the token ids from the rest")
        fix = ("pass a dict of tensors with the examples along dimension 0, e.g. {'input_ids': ids} or "
               "{'input_ids': ids, 'attention_mask': mask, 'labels': labels}")
    else:
        got = f"a {type(batch).__name__}"
        fix = "pass a dict of tensors, a list of dicts, or a datasets.Dataset in torch format"
    return BatchContentError(f"ga.tasks.{task} takes dict batches (HF style: input_ids, attention_mask, labels), "
                             f"got {got}; {fix}")


def token_batch(batch, task: str, model=None, *, labels: str | None = None, ids=None,
                decoder_vocab: int | None = None) -> dict:
    """The batch checked and with its integer fields as int64: a new dict (the caller's is
    not changed). Fields as in the module docstring.

    labels : None (labels not read by this task), "aligned" (B, T) like ``input_ids``
        (masked LM), "causal" (aligned, and not already shifted by one) or "decoder"
        (B, T_dec) of their own length (seq2seq).
    ids : the batch's example ids, for the messages (batch rows when None).
    """
    if not isinstance(batch, Mapping):
        raise not_a_dict(batch, task)
    if "input_ids" not in batch:
        raise BatchContentError(f"ga.tasks.{task}: the batch has no 'input_ids' field (it has {sorted(batch)})")
    out = dict(batch)
    tokens = _integers(_tensor(batch, "input_ids", task), "input_ids", task)
    if tokens.dim() != 2:
        raise _refuse(task, f"'input_ids' has shape {tuple(tokens.shape)}, not (batch, tokens)",
                      fix="pass a batch of token-id rows (B, T); a single sequence is input_ids[None], "
                      "and a DataLoader(batch_size=None) over already-batched items should be a DataLoader "
                      "over the examples")
    if tokens.shape[1] == 0:
        raise _refuse(task, "'input_ids' has no tokens (shape (B, 0))", fix="drop empty sequences from the data")
    out["input_ids"] = tokens
    for name in ALIGNED:
        if name in batch and batch[name] is not None:
            value = _tensor(batch, name, task)
            _check_shape(value, name, tokens.shape, task, "'input_ids'")
            out[name] = value
    for name in MASKS:
        if name in out and out[name] is not None and name in batch:
            out[name] = _tensor(out, name, task)
            _check_mask(out[name], name, ids, task)
    if "token_type_ids" in out and out["token_type_ids"] is not None:
        out["token_type_ids"] = _integers(out["token_type_ids"], "token_type_ids", task)
        types = getattr(getattr(model, "config", None), "type_vocab_size", None)
        _check_range(out["token_type_ids"], "token_type_ids", types if isinstance(types, int) else None,
                     ids, task, labels=False)
    if "prompt_length" in batch:
        plen = _integers(_tensor(batch, "prompt_length", task), "prompt_length", task).reshape(-1)
        if plen.shape[0] != tokens.shape[0]:
            raise _refuse(task, f"'prompt_length' has {plen.shape[0]} entries for {tokens.shape[0]} rows",
                          fix="give 'prompt_length' one length per example (B,)")
        out["prompt_length"] = plen
    _check_range(tokens, "input_ids", input_vocab(model) if model is not None else None, ids, task, labels=False)
    mask = out.get("attention_mask")
    _check_length(tokens, mask.bool() if isinstance(mask, torch.Tensor) else None, model, ids, task)
    if labels is not None and "labels" in batch:
        out["labels"] = _labels(batch, out, task, model, labels, ids, decoder_vocab)
    return out


def _labels(batch, out: dict, task: str, model, kind: str, ids, decoder_vocab) -> torch.Tensor:
    tokens = out["input_ids"]
    value = _integers(_tensor(batch, "labels", task), "labels", task)
    vocab = decoder_vocab if decoder_vocab is not None else (output_vocab(model) if model is not None else None)
    if kind == "decoder":
        if value.dim() != 2 or value.shape[0] != tokens.shape[0]:
            raise _refuse(task, f"'labels' has shape {tuple(value.shape)}, not (B, T_dec) with B = "
                          f"{tokens.shape[0]} rows", fix="pass decoder labels (B, T_dec), -100 where not counted")
        for name in ("decoder_input_ids", "decoder_attention_mask"):
            if name in batch and batch[name] is not None:
                other = _tensor(batch, name, task)
                _check_shape(other, name, value.shape, task, "'labels'")
                if name == "decoder_input_ids":
                    other = _integers(other, name, task)
                    _check_range(other, name, vocab, ids, task, labels=False)
                else:
                    _check_mask(other, name, ids, task)
                out[name] = other
    else:
        hint = ""
        if kind == "causal" and value.dim() == 2 and value.shape[0] == tokens.shape[0] \
                and value.shape[1] == tokens.shape[1] - 1:
            hint = ("; labels one token shorter look already shifted (labels[t] = input_ids[t + 1]): "
                    "causal_lm shifts them itself, so pass them aligned with input_ids")
        _check_shape(value, "labels", tokens.shape, task, "'input_ids'", hint)
    _check_range(value, "labels", vocab, ids, task, labels=True)
    if kind == "causal":
        mask = out["attention_mask"].bool() if out.get("attention_mask") is not None else torch.ones_like(tokens, dtype=torch.bool)
        _check_preshifted(tokens, value, mask, ids, task)
    return value


class PairField:
    """``batch[index]`` of an ``(x, y)`` batch (``ga.tasks.classification``'s default
    ``inputs`` / ``targets``), refusing a dict batch or one without that field."""

    def __init__(self, index: int):
        self.index = index

    def __call__(self, batch):
        if isinstance(batch, Mapping):
            raise BatchContentError(
                f"ga.tasks.classification reads (x, y) batches, got a dict with fields {sorted(batch)}: pass "
                "inputs=lambda b: b['x'], targets=lambda b: b['label'] (your field names), or use "
                "ga.tasks.sequence_classification for an HF *ForSequenceClassification")
        if isinstance(batch, (tuple, list)) and len(batch) > self.index:
            return batch[self.index]
        count = len(batch) if isinstance(batch, (tuple, list)) else 1
        raise BatchContentError(
            f"ga.tasks.classification reads (x, y) batches, got a batch of {count} field(s): pass the data "
            "with its labels, e.g. ga.grads(task, (X, y)) or a Dataset of (x, y) pairs")

    def __repr__(self):
        return f"batch[{self.index}]"


def pair_field(index: int) -> PairField:
    """The default extractor of field ``index`` of ``(x, y)`` batches."""
    return PairField(index)


def class_labels(labels, n_classes: int, task: str = "classification", ids=None,
                 probabilities: bool = True) -> torch.Tensor:
    """Labels for a cross-entropy over ``n_classes`` logits: (B,) int64 in ``[0, C)``
    ((B, 1) and any integer or bool dtype accepted), or, where ``probabilities``, class
    probabilities (B, C) float returned as they are (TRAK's margin needs indices)."""
    if not isinstance(labels, torch.Tensor):
        try:
            labels = torch.as_tensor(labels)
        except (TypeError, ValueError, RuntimeError) as err:
            raise BatchContentError(f"ga.tasks.{task}: the labels are a {type(labels).__name__}, not a tensor of "
                                    "class indices; pass a tensor (B,) of ints") from err
    if labels.is_floating_point() and labels.dim() == 2 and labels.shape[1] == n_classes and n_classes > 1:
        if probabilities:
            return labels    # class probabilities
        raise BatchContentError(f"ga.tasks.{task}: the labels are class probabilities (B, {n_classes}); TRAK's "
                                "margin and 1 - p need one class index per example: pass labels.argmax(1)")
    if labels.dim() == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.is_floating_point() or labels.is_complex():
        raise BatchContentError(
            f"ga.tasks.{task}: the labels have dtype {labels.dtype} and shape {tuple(labels.shape)}: a "
            f"{n_classes}-class cross-entropy takes class indices (B,) of ints (labels.long()) or class "
            f"probabilities (B, {n_classes})")
    if labels.dim() != 1:
        raise BatchContentError(f"ga.tasks.{task}: the labels have shape {tuple(labels.shape)}; pass one class "
                                "index per example, shape (B,)")
    labels = labels.long()
    if _traced(labels):
        return labels
    bad = (labels < 0) | (labels >= n_classes)
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten()
        where, named = _rows(rows, ids)
        raise BatchContentError(
            f"ga.tasks.{task}: {where} have labels {labels[bad][:10].tolist()} outside [0, {n_classes}) (the model "
            f"gives {n_classes} logits; -100 is not ignored here): fix the labels, or give the model as many "
            "outputs as there are classes", named)
    return labels
