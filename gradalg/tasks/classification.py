"""Classification tasks: ``classification`` (batches ``(x, y)``) and
``sequence_classification`` (HF ``*ForSequenceClassification`` on dict batches).

``classification(model)`` builds a :class:`~gradalg.task.Task` for a classifier trained
with cross-entropy on batches ``(x, y)``, with everything the methods need:

* ``loss``          Σ_i −log p(y_i | x_i)
* ``sampled_loss``  Σ_i −log p(ŷ_i | x_i), ŷ_i ~ p(· | x_i): its gradients give the true
                    Fisher = Gauss-Newton matrix of the cross-entropy
* ``output``        Σ_i log(p_i / (1 − p_i)), p_i = p(y_i | x_i): TRAK's margin
* ``output_weight`` 1 − p_i: TRAK's Q
* ``expected_terms`` −Σ_i √p_ic log p_ic for each class c: their per-example gradients
                    give the exact Gauss-Newton matrix Σ_c p_c g_c g_cᵀ
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import HeadMismatchError, OptionError
from ..task import Task, TransformerBlocks
from .regression import multilabel_task, regression_task

__all__ = ["classification", "sequence_classification"]


def classification(model: nn.Module, *, inputs: Callable[[Any], Any] | None = None,
                   targets: Callable[[Any], torch.Tensor] | None = None,
                   name: str | None = None) -> Task:
    """A cross-entropy classification task over batches from which ``inputs(batch)`` and
    ``targets(batch)`` extract the model input and the (B,) integer labels (default:
    ``batch[0]`` and ``batch[1]`` of ``(x, y)`` batches; a dict or one-field batch is
    refused naming the fix). Labels of any integer dtype, or (B, 1), are read as (B,)
    int64 and checked to lie in [0, C) (:mod:`gradalg.tasks.validation`)."""
    from .validation import model_inputs, pair_field, reading
    inputs = inputs if inputs is not None else pair_field(0)
    targets = targets if targets is not None else pair_field(1)

    def logits_of(m, batch):
        with reading("classification"):   # a dtype or width the model does not take: a BatchContentError
            x = model_inputs(inputs(batch), m)
        with reading("classification", m, (x,)):
            return m(x)

    return categorical_task(model, logits_of, targets, name=name)


def sequence_classification(model: nn.Module, *, padding_side: str = "right", problem_type: str | None = None,
                            name: str | None = None) -> Task:
    """The loss of an HF ``*ForSequenceClassification`` head over its (B, C) logits on dict
    batches: ``input_ids`` (B, T), ``attention_mask``, ``token_type_ids`` optional, the
    labels in ``labels`` (or ``label``). ``token_mask`` is the attention mask.
    ``padding_side="left"`` passes ``position_ids`` counted from each row's first real
    token, and gradalg's own loaders pad a list of items on the left
    (:func:`gradalg.collate.left_pad_collate`); a batch padded on the other side, or a row
    without a real token, is refused naming the example ids.

    The loss follows the head's ``problem_type`` as HF's does (``problem_type`` here, else
    ``model.config.problem_type``, else HF's rule: ``num_labels == 1`` is regression):

    * ``"single_label_classification"``: cross-entropy, class ids (B,); every output of
      :func:`classification` (sampled labels, exact per-class Gauss-Newton terms, TRAK's
      margin and 1 − p) comes with it;
    * ``"regression"``: squared error, targets (B,) or (B, C), integer targets cast to float;
    * ``"multi_label_classification"``: binary cross-entropy, 0/1 labels (B, C);
    * none set and ``num_labels > 1``: decided per batch as HF does, integer labels →
      single-label, float labels → multi-label.

    The regression and multi-label losses and their Gauss-Newton terms are in
    :mod:`gradalg.tasks.regression`.

    Default layers (``layers=None``): :class:`~gradalg.TransformerBlocks` with
    ``head=True``, the linear layers inside the transformer blocks **and** the
    classification head (``score``; BERT's ``pooler.dense`` and ``classifier``), not the
    embeddings or the norms. The head is a few thousand parameters, cheap to attribute,
    and in a fine-tune it is the layer trained from scratch, often the one that moves
    most: leaving it out would drop a central part of what the training data taught.
    ``layers="all"`` adds the embeddings and norms; ``explain()`` shows the coverage.
    """
    from ..collate import left_pad_collate
    from .language import MODEL_INPUTS, hf_forward
    from .tokens import check_padding, field, real_mask
    from .validation import token_batch

    forward = hf_forward(padding_side, MODEL_INPUTS)

    def check_batch(batch, ids=None):
        targets(batch)
        batch = token_batch(batch, "sequence_classification", model, ids=ids)   # tasks/validation.py
        check_padding(real_mask(batch), padding_side, ids, "sequence_classification")
        return batch

    def logits_of(m, batch):
        return forward(m, check_batch(batch))

    def targets(batch):
        key = "labels" if "labels" in batch else "label"
        return field(batch, key, "sequence_classification", hint="; the class goes in 'labels' (B,)")

    kind = head_problem(model, problem_type)
    if kind == "single_label_classification" and _num_labels(model) == 1:
        _checked(torch.zeros(1, 1))     # refused now, not at the first batch
    common = dict(check_batch=check_batch, token_mask=real_mask, default_layers=TransformerBlocks(head=True),
                  name=name)
    if kind == "regression":
        task = regression_task(model, logits_of, targets, **common)
    elif kind == "multi_label_classification":
        task = multilabel_task(model, logits_of, targets, **common)
    elif kind == "single_label_classification":
        task = categorical_task(model, logits_of, targets, **common)
    else:
        single = categorical_task(model, logits_of, targets, **common)
        task = _by_label_dtype(single, multi=multilabel_task(model, logits_of, targets, **common), targets=targets)
    if padding_side == "left":     # gradalg's own loaders pad a list of items on the task's side
        task.collate_fn = left_pad_collate
    return task


PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def head_problem(model: nn.Module, problem_type: str | None = None) -> str | None:
    """The loss an HF classification head trains with: ``problem_type`` if given, else
    ``config.problem_type``, else ``"regression"`` for ``num_labels == 1``, else None (HF
    decides by the labels' dtype)."""
    if problem_type is not None:
        if problem_type not in PROBLEM_TYPES:
            raise OptionError(f"ga.tasks.sequence_classification: problem_type must be one of {PROBLEM_TYPES} "
                              f"or None (the model's config decides), got {problem_type!r}")
        return problem_type
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    if getattr(config, "problem_type", None) in PROBLEM_TYPES:
        return config.problem_type
    if _num_labels(model) == 1:
        return "regression"
    return None


def _num_labels(model: nn.Module):
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    return getattr(config, "num_labels", None)


def _by_label_dtype(single: Task, multi: Task, targets: Callable) -> Task:
    """HF's rule when no problem type is set: integer labels → cross-entropy, float labels →
    binary cross-entropy; each of the task's functions dispatches on the batch's labels."""
    def pick(attr):
        def fn(m, batch, *rest):
            label = targets(batch)
            chosen = single if not torch.is_floating_point(torch.as_tensor(label)) else multi
            return getattr(chosen, attr)(m, batch, *rest)
        return fn

    return Task(single.model, pick("loss"), sampled_loss=pick("sampled_loss"), output=pick("output"),
                output_weight=pick("output_weight"), expected_terms=pick("expected_terms"),
                forward=single.forward, loss_from_outputs=pick("loss_from_outputs"),
                check_batch=single.check_batch, token_mask=single.token_mask,
                default_layers=single.default_layers, name=single.name)


def _checked(logits: torch.Tensor) -> torch.Tensor:
    """Refuse one logit per example: a softmax over one class is 1 whatever the model,
    so the cross-entropy and every gradient would be a silent 0."""
    if logits.dim() == 2 and logits.shape[1] == 1:
        raise HeadMismatchError(
            "the model gives 1 logit per example: cross-entropy over a single class is 0 for every "
            "example (every gradient and score would be 0). A one-output model is a regression "
            "(or binary) head: use ga.tasks.sequence_classification(model, problem_type='regression') "
            "for an HF head, or write its loss as ga.Task(model, loss) (e.g. squared error, "
            "or F.binary_cross_entropy_with_logits, summed over the batch)")
    return logits


def categorical_task(model: nn.Module, logits_of: Callable, targets: Callable, *, check_batch=None,
                     token_mask=None, default_layers=None, name: str | None = None) -> Task:
    """The classification task of ``logits_of(model, batch)`` (B, C) and ``targets(batch)`` (B,);
    ``default_layers`` as in :class:`~gradalg.Task`. The targets are checked against the
    logits' C classes (:func:`~gradalg.tasks.validation.class_labels`: int64 in [0, C),
    or class probabilities (B, C))."""
    from .validation import class_labels
    raw_logits = logits_of

    def logits_of(m, batch):        # every output refuses a single logit (a silent 0 otherwise)
        return _checked(raw_logits(m, batch))

    def labels(logits, batch, indices=False):   # (B,) int64 in [0, C), or probabilities (B, C) unless indices
        return class_labels(targets(batch), logits.shape[-1], name or "classification", probabilities=not indices)

    def loss(m, batch):
        logits = logits_of(m, batch)
        return F.cross_entropy(logits, labels(logits, batch), reduction="sum")

    def sampled_loss(m, batch, rng):
        logits = logits_of(m, batch)
        probs = torch.softmax(logits.detach().to(torch.float64), dim=-1)
        return F.cross_entropy(logits, rng.sample(probs), reduction="sum")

    def margin(m, batch):
        logp = torch.log_softmax(logits_of(m, batch), dim=-1)
        y = labels(logp, batch, indices=True)
        correct = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        others = logp.scatter(-1, y.unsqueeze(-1), float("-inf")).logsumexp(-1)
        return (correct - others).sum()

    def one_minus_p(m, batch):
        probs = torch.softmax(logits_of(m, batch), dim=-1)
        p = probs.gather(-1, labels(probs, batch, indices=True).unsqueeze(-1)).squeeze(-1)
        return 1 - p

    def expected_terms(m, batch):
        logp = torch.log_softmax(logits_of(m, batch), dim=-1)
        weight = logp.detach().exp().sqrt()
        return [-(weight[:, c] * logp[:, c]).sum() for c in range(logp.shape[-1])]

    def loss_from_outputs(logits, batch):
        return F.cross_entropy(_checked(logits), labels(logits, batch), reduction="sum")

    return Task(model, loss, sampled_loss=sampled_loss, output=margin, output_weight=one_minus_p,
                expected_terms=expected_terms, forward=logits_of, loss_from_outputs=loss_from_outputs,
                check_batch=check_batch, token_mask=token_mask, default_layers=default_layers,
                name=name or type(model).__name__)
