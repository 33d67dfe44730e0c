"""Language-model tasks: causal LM, masked LM and sequence-to-sequence.

Every task here reads dict batches (``input_ids``, ``attention_mask``, ``labels`` …; a
list of dict items of unequal length is right-padded by gradalg's collate, see
:mod:`gradalg.collate`) and defines, for sequence i with counted target tokens
t ∈ C_i (p_it = p_θ(y_it | context)):

* ``loss``            L_i = Σ_{t∈C_i} −log p_it            (a **sum** over its tokens)
* ``sampled_loss``    Σ_{t∈C_i} −log p_θ(ŷ_it | ·), ŷ_it ~ p_θ(· | ·): E[ĝ ĝᵀ] is the
                      Gauss-Newton matrix of L_i (= true Fisher for softmax outputs)
* ``expected_terms``  (``n_samples > 1``) S sampled losses each scaled by 1/√S:
                      Σ_s ĝ_s ĝ_sᵀ / S, a lower-variance Monte-Carlo Gauss-Newton
* ``output``          TRAK's margin, by ``trak_output``:
                      "sequence" (default): f_i = log p_i/(1 − p_i) with p_i = Π_t p_it =
                      exp(−L_i), the sequence as one class (TRAK's treatment of text targets);
                      "token": f_i = Σ_{t∈C_i} log p_it/(1 − p_it), one margin per token
* ``weighted_output`` TRAK's Q applied to the output with the weight detached:
                      (1 − p_i) f_i ("sequence") or Σ_t (1 − p_it) f_it ("token", Q per
                      token). Since ∂ℓ/∂f = −(1 − p) for ℓ = −log p, the gradient is exactly
                      −∇L_i either way: TRAK's training side Φᵀ Q is the negative loss
                      gradient (per token: every token weighted by its own 1 − p_t); the two
                      choices differ in the query side φ = ∇f and the kernel ΦᵀΦ only
* ``output_weight``   per sequence: 1 − p_i ("sequence"), or the mean of 1 − p_it over the
                      counted tokens ("token"), for code that weights whole rows
* ``token_mask``      the attention mask: padding is zeroed in captured factors
* ``curvature_objective = "sampled"``: one exact Gauss-Newton term per vocabulary entry
                      (``objective="expected"``, what classification uses) is infeasible
                      for V ≈ 50k, so the methods' curvature uses sampled labels.

**Default layers.** Called without ``layers``, ``ga.grads``, ``ga.hessian``,
``ga.gauss_newton`` and every method attribute the linear layers inside the transformer
blocks (attention and MLP projections, ``nn.Linear`` experts, LoRA adapters:
:class:`~gradalg.TransformerBlocks`), as Kronfluence, Bergson and dattri do. MoE experts
stored fused as 3-D parameters (transformers ≥ 5) are not linear layers: left out, and
named by ``explain()``'s coverage line. The
embeddings, the LM head (on GPT-2 small the tied 50,257 × 768 matrix, a third of the
model, whose curvature factor alone is vocabulary × vocabulary) and the norms are left
out; ``explain()`` names them with their share of the parameters. ``layers="all"``
attributes every parameter; names and glob patterns pick any layer.

The batch is checked before it is captured (:class:`~gradalg.errors.BatchContentError`
with the example ids): a missing field, padding on the other side than ``padding_side``,
rows without a real token, rows none of whose labels count.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from ..collate import left_pad_collate
from ..errors import BatchContentError, HeadMismatchError, OptionError
from ..options import plain
from ..task import ExampleRandom, Task, TransformerBlocks
from .tokens import (IGNORE, PADDING_SIDES, check_counted, check_padding, content_keys, field, model_logits,
                     position_ids, real_mask, sampled_targets, token_margin, token_nll)
from .prompts import queries_from_prompts
from .validation import reading, token_batch

__all__ = ["causal_lm", "CausalLMTask", "masked_lm", "seq2seq", "sequence_task"]

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
TRAK_OUTPUTS = ("token", "sequence")


def _check_side(padding_side: str) -> None:
    if padding_side not in PADDING_SIDES:
        raise OptionError(f"padding_side must be 'right' or 'left', got {padding_side!r}")


def hf_forward(padding_side: str, fields=MODEL_INPUTS, extra: Callable | None = None):
    """``(model, batch) -> logits``: the model called on the batch's input fields; with
    left padding, ``position_ids`` counted from each row's first real token (what the
    unpadded sequence would get)."""
    def forward(model, batch):
        kwargs = {k: batch[k] for k in fields if k in batch}
        if padding_side == "left":
            kwargs["position_ids"] = position_ids(real_mask(batch))
        if extra is not None:
            kwargs.update(extra(model, batch))
        with reading("language model", model, (), kwargs, checked=True):   # an error the model raises on the batch: a BatchContentError
            out = model(**kwargs)
        return model_logits(out)
    return forward


def sequence_task(model: nn.Module, logits_of: Callable[[nn.Module, Any], torch.Tensor],
                  targets_of: Callable[[Any], torch.Tensor], *, check_batch: Callable | None = None,
                  token_mask: Callable | None = None, n_samples: int = 1, seed_salt: str = "",
                  trak_output: str = "sequence", default_layers=TransformerBlocks(vocabulary="auto"),
                  name: str | None = None, task_class: type = Task, collate_fn: Callable | None = None) -> Task:
    """A :class:`Task` for token-level cross-entropy from ``logits_of(model, batch)``
    (B, T', V) and ``targets_of(batch)`` (B, T') with ``-100`` for positions that do not
    count; everything in the module docstring is derived from these two. ``default_layers``
    as in :class:`~gradalg.Task` (default: the linear layers inside the transformer blocks).
    ``task_class``: the :class:`~gradalg.Task` subclass built (:class:`CausalLMTask` for
    ``causal_lm``); ``collate_fn`` as in :class:`~gradalg.Task`."""
    n_samples = plain(n_samples)
    if not isinstance(n_samples, int) or isinstance(n_samples, bool) or n_samples < 1:
        raise OptionError(f"n_samples must be a positive int, got {n_samples!r}")
    if trak_output not in TRAK_OUTPUTS:
        raise OptionError(f"trak_output must be one of {TRAK_OUTPUTS}, got {trak_output!r}")

    def summed_nll(logits, targets):
        return token_nll(logits, targets).sum()

    def loss(m, batch):
        return summed_nll(logits_of(m, batch), targets_of(batch))

    def sampled_loss(m, batch, rng: ExampleRandom):
        logits, targets = logits_of(m, batch), targets_of(batch)
        draws = rng.uniform_ragged((targets != IGNORE).sum(1).tolist())
        return summed_nll(logits, sampled_targets(logits, targets, draws))

    def expected_terms(m, batch):
        # expected_terms get no example ids: draws are keyed by each row's counted tokens
        logits, targets = logits_of(m, batch), targets_of(batch)
        counts = (targets != IGNORE).sum(1).tolist()
        scale = 1 / math.sqrt(n_samples)
        terms = []
        for s in range(n_samples):
            rng = ExampleRandom(s, tuple(content_keys(targets, seed_salt)), logits.device)
            terms.append(summed_nll(logits, sampled_targets(logits, targets, rng.uniform_ragged(counts))) * scale)
        return terms

    def sequence_margin(m, batch):
        """(f_i, 1 − p_i) per sequence, p_i = Π_t p_it = exp(−L_i)."""
        log_p = -token_nll(logits_of(m, batch), targets_of(batch)).sum(1)            # (B,) ≤ 0
        one_minus = (-torch.expm1(log_p)).clamp_min(torch.finfo(log_p.dtype).tiny)
        return log_p - torch.log(one_minus), one_minus

    def output(m, batch):
        if trak_output == "sequence":
            return sequence_margin(m, batch)[0].sum()
        margin, _ = token_margin(logits_of(m, batch), targets_of(batch))
        return margin.sum()

    def weighted_output(m, batch):
        if trak_output == "sequence":
            f, w = sequence_margin(m, batch)
            return (w.detach() * f).sum()
        margin, p = token_margin(logits_of(m, batch), targets_of(batch))
        return ((1 - p).detach() * margin).sum()

    def one_minus_p(m, batch):
        if trak_output == "sequence":
            return sequence_margin(m, batch)[1]
        targets = targets_of(batch)
        _, p = token_margin(logits_of(m, batch), targets)
        counted = (targets != IGNORE)
        return ((1 - p) * counted).sum(1) / counted.sum(1).clamp_min(1)

    return task_class(model, loss, sampled_loss=sampled_loss, output=output, output_weight=one_minus_p,
                      weighted_output=weighted_output, expected_terms=expected_terms if n_samples > 1 else None,
                      curvature_objective="expected" if n_samples > 1 else "sampled", check_batch=check_batch,
                      token_mask=token_mask, forward=logits_of, loss_from_outputs=lambda lg, b: summed_nll(lg, targets_of(b)),
                      default_layers=default_layers, name=name or type(model).__name__, collate_fn=collate_fn)


class CausalLMTask(Task):
    """The :class:`~gradalg.Task` :func:`causal_lm` returns: a Task, plus query items from prompts."""

    def queries_from_prompts(self, prompts, completions=None, **options) -> list[dict]:
        """Query items from prompts, the completions generated by this task's model when not
        given, counting only completion tokens: :func:`gradalg.tasks.queries_from_prompts`
        with this task (same options: ``tokenizer=``, ``generate=``, ``max_new_tokens=``,
        ``chat_template=``, ``system=``, ``seed=``)."""
        return queries_from_prompts(self, prompts, completions, **options)


def causal_lm(model: nn.Module, *, padding_side: str = "right", completion_only: bool = False,
              n_samples: int = 1, trak_output: str = "sequence",
              logits: Callable[[nn.Module, Any], torch.Tensor] | None = None,
              name: str | None = None) -> CausalLMTask:
    """A next-token prediction task for any HF ``*ForCausalLM`` (or a module returning
    logits (B, T, V)), on dict batches.

    Sequence i's loss is the **sum** over its predicted tokens
    ``L_i = Σ_{t ∈ C_i} −log p_θ(y_{i,t+1} | x_{i,≤t})``, where the target of position t
    is ``labels[t+1]`` if the batch has ``labels`` (HF convention: aligned with the
    inputs, ``-100`` ignored) else ``input_ids[t+1]``, and C_i drops padding
    (``attention_mask`` 0) and, with ``completion_only``, the prompt.

    Parameters
    ----------
    padding_side : "right" (default) or "left". With "left", ``position_ids`` are passed
        to the model counted from each row's first real token, so a left-padded row gets
        the positions of its unpadded sequence, and gradalg's own loaders pad a list of
        items of unequal length on the left (:func:`gradalg.collate.left_pad_collate`). A
        batch padded on the other side (a DataLoader's own collate) is refused
        (:class:`~gradalg.errors.BatchContentError`, example ids named).
    completion_only : count only completion tokens (prompt masking): positions where the
        batch's ``completion_mask`` is 1, or at/after ``prompt_length`` (B,) real tokens.
        (Labels already set to ``-100`` on the prompt work without this option.)
    n_samples : sampled labels per token for the Gauss-Newton curvature. 1: the
        ``"sampled"`` objective (one draw per token, seeded by example id). S > 1:
        S sampled losses scaled by 1/√S as ``expected_terms`` (rows Σ_s ĝ_s ĝ_sᵀ/S;
        draws keyed by the sequence's tokens), and ``curvature_objective="expected"``.
    trak_output : "sequence" (default) or "token": TRAK's margin of the whole sequence
        (p = Π_t p_t) or the sum of per-token margins (module docstring). Chosen by
        measurement (docs/fidelity.md, LM defaults): per-token margins weigh the query's
        most confident tokens by 1/(1 − p_t) and scored 0.31 against 0.39 (k = 512).
    logits : ``(model, batch) -> (B, T, V)`` replacing the default call
        ``model(input_ids=, attention_mask=[, position_ids=]).logits``. Without it, an
        encoder-decoder model (``config.is_encoder_decoder``) is refused
        (:class:`~gradalg.errors.HeadMismatchError`): use :func:`seq2seq`.

    Default layers: the linear layers inside the transformer blocks (module docstring);
    pass ``layers="all"`` or module names to ``ga.grads`` / the methods for the embeddings
    and the head.

    Batch fields: ``input_ids`` (B, T) required; ``attention_mask``, ``labels``,
    ``completion_mask`` / ``prompt_length`` optional. See the module docstring for the
    sampled loss, TRAK's output and weights.
    """
    _check_side(padding_side)
    if logits is None:
        _check_decoder_only(model)
    logits_of = logits or hf_forward(padding_side)

    def clean(batch, ids=None):   # checked, integer fields int64 (tasks/validation.py)
        return token_batch(batch, "causal_lm", model, labels="causal", ids=ids)

    def targets_of(batch):
        return shifted_targets(clean(batch))

    def shifted_targets(batch):
        ids = field(batch, "input_ids", "causal_lm")
        mask = real_mask(batch)
        base = batch["labels"] if "labels" in batch else ids
        # a target counts only when both the predicting position and the predicted token are
        # real: under left padding the last pad would otherwise 'predict' the first token
        targets = base[:, 1:].masked_fill(~(mask[:, 1:] & mask[:, :-1]), IGNORE)
        if completion_only:
            if "completion_mask" in batch:
                targets = targets.masked_fill(~batch["completion_mask"][:, 1:].bool(), IGNORE)
            elif "prompt_length" in batch:
                plen = batch["prompt_length"].reshape(-1, 1).to(ids.device)
                targets = targets.masked_fill(position_ids(mask)[:, 1:] < plen, IGNORE)
            else:
                field(batch, "completion_mask", "causal_lm",
                      hint="; completion_only=True needs 'completion_mask' (B, T) or 'prompt_length' (B,)")
        return targets

    def check_batch(batch, ids=None):
        batch = clean(batch, ids)
        check_padding(real_mask(batch), padding_side, ids, "causal_lm")
        check_counted(shifted_targets(batch), ids, "causal_lm",
                      " after the shift by one: a one-token row, labels all -100"
                      + (", or no completion token" if completion_only else ""))
        return batch

    def checked_logits(m, batch):   # (B, T - 1, V): the predictions of tokens 2..T
        batch = check_batch(batch)  # cheap; also guards calls that do not come through a capture pass
        return logits_of(m, batch)[:, :-1]

    return sequence_task(model, checked_logits, targets_of, check_batch=check_batch,
                         token_mask=real_mask, n_samples=n_samples, seed_salt="causal_lm",
                         trak_output=trak_output, name=name, task_class=CausalLMTask,
                         collate_fn=left_pad_collate if padding_side == "left" else None)


def _check_decoder_only(model: nn.Module) -> None:
    """Refuse an encoder–decoder model (``config.is_encoder_decoder``: T5, BART, ...) in
    :func:`causal_lm`: its forward needs decoder inputs that a causal-LM batch does not have."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise HeadMismatchError(
            f"ga.tasks.causal_lm got {type(model).__name__}, an encoder-decoder model "
            "(config.is_encoder_decoder): it predicts labels from encoder inputs, not the next "
            "token of its input. Use ga.tasks.seq2seq(model) with items {'input_ids': ..., "
            "'labels': ...}, or pass causal_lm(model, logits=...) to say how logits are computed")


def masked_lm(model: nn.Module, *, n_samples: int = 1, trak_output: str = "sequence",
              name: str | None = None) -> Task:
    """Masked-language-model task (BERT-style ``*ForMaskedLM``): L_i = Σ_t −log p(labels_t)
    over the positions whose ``labels`` are not ``-100`` (no shift). Right padding only
    (absolute positions). Fields: ``input_ids``, ``labels`` (B, T); ``attention_mask``,
    ``token_type_ids`` optional. The other outputs and the default layers (the linear
    layers inside the transformer blocks) as in :func:`causal_lm`."""
    logits_of = hf_forward("right")

    def clean(batch, ids=None):   # checked, integer fields int64 (tasks/validation.py)
        return token_batch(batch, "masked_lm", model, labels="aligned", ids=ids)

    def targets_of(batch):
        return masked_targets(clean(batch))

    def masked_targets(batch):
        labels = field(batch, "labels", "masked_lm", hint="; masked_lm needs labels (-100 where not masked)")
        return labels.masked_fill(~real_mask(batch), IGNORE)

    def check_batch(batch, ids=None):
        batch = clean(batch, ids)
        check_padding(real_mask(batch), "right", ids, "masked_lm")
        check_counted(masked_targets(batch), ids, "masked_lm", ": no masked position")
        return batch

    def checked_logits(m, batch):
        return logits_of(m, check_batch(batch))

    return sequence_task(model, checked_logits, targets_of, check_batch=check_batch, token_mask=real_mask,
                         n_samples=n_samples, seed_salt="masked_lm", trak_output=trak_output, name=name)


def seq2seq(model: nn.Module, *, n_samples: int = 1, trak_output: str = "sequence",
            name: str | None = None) -> Task:
    """Encoder-decoder task (T5 / BART ``*ForConditionalGeneration``):
    L_i = Σ_t −log p(labels_t | labels_<t, encoder inputs) over labels that are not -100.

    Fields: ``input_ids``, ``labels`` (B, T_dec) required; ``attention_mask``,
    ``decoder_input_ids``, ``decoder_attention_mask`` optional. Without
    ``decoder_input_ids`` they are made from the labels by the model's
    ``prepare_decoder_input_ids_from_labels`` (shift right, -100 → pad). No
    ``token_mask``: encoder and decoder positions differ (T_enc ≠ T_dec), and padding
    carries no gradient either side (encoder padding is masked out of the cross-attention,
    decoder padding comes after every counted token), so gradients are exact; K-FAC
    statistics then count padded positions as well. Default layers: the linear layers
    inside the encoder's and the decoder's blocks (as in :func:`causal_lm`).
    """
    def decoder_inputs(m, batch):
        labels = field(batch, "labels", "seq2seq", hint="; seq2seq needs decoder labels (B, T_dec)")
        out = {}
        if "decoder_input_ids" in batch:
            out["decoder_input_ids"] = batch["decoder_input_ids"]
        elif hasattr(m, "prepare_decoder_input_ids_from_labels"):
            out["decoder_input_ids"] = m.prepare_decoder_input_ids_from_labels(labels=labels)
        else:
            raise BatchContentError(f"{type(m).__name__} has no prepare_decoder_input_ids_from_labels: "
                                    "give the batch 'decoder_input_ids' (the labels shifted right)")
        if "decoder_attention_mask" in batch:
            out["decoder_attention_mask"] = batch["decoder_attention_mask"]
        return out

    logits_of = hf_forward("right", extra=decoder_inputs)

    def clean(batch, ids=None):   # checked, integer fields int64 (tasks/validation.py)
        return token_batch(batch, "seq2seq", model, labels="decoder", ids=ids)

    def targets_of(batch):
        return decoder_targets(clean(batch))

    def decoder_targets(batch):
        labels = field(batch, "labels", "seq2seq", hint="; seq2seq needs decoder labels (B, T_dec)")
        if "decoder_attention_mask" in batch:
            labels = labels.masked_fill(~batch["decoder_attention_mask"].bool(), IGNORE)
        return labels

    def check_batch(batch, ids=None):
        batch = clean(batch, ids)
        check_padding(real_mask(batch), "right", ids, "seq2seq")
        check_counted(decoder_targets(batch), ids, "seq2seq")
        return batch

    def checked_logits(m, batch):
        return logits_of(m, check_batch(batch))

    return sequence_task(model, checked_logits, targets_of, check_batch=check_batch, n_samples=n_samples,
                         seed_salt="seq2seq", trak_output=trak_output, name=name)
