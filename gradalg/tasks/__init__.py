"""Ready-made tasks: a model and its loss, with everything the methods need.

========================================  ==============================================
``classification(model)``                 batches ``(x, y)``, cross-entropy on (B, C) logits
``sequence_classification(model)``        HF ``*ForSequenceClassification``, dict batches (its problem_type)
``causal_lm(model)``                      HF ``*ForCausalLM`` (or logits (B, T, V)), next token
``queries_from_prompts(task, prompts)``   query items from prompts (+ generated completions),
                                          only the completion's tokens counted
``masked_lm(model)``                      HF ``*ForMaskedLM`` (BERT), masked positions
``seq2seq(model)``                        HF ``*ForConditionalGeneration`` (T5, BART)
``contrastive(task)``                     ``task`` with paired queries: L(behaviour) − L(control)
========================================  ==============================================

Each provides the loss (a sum over examples; for sequences, a sum over each one's
counted tokens), sampled labels for the Gauss-Newton curvature, TRAK's output
function and weights, and, for sequences, ``token_mask`` and batch checks.
"""
from __future__ import annotations

from .contrast import contrast_pairs, contrastive
from .classification import categorical_task, classification, sequence_classification
from .language import CausalLMTask, causal_lm, masked_lm, seq2seq, sequence_task
from .prompts import queries_from_prompts

__all__ = ["classification", "sequence_classification", "causal_lm", "masked_lm", "seq2seq",
           "categorical_task", "sequence_task", "queries_from_prompts", "CausalLMTask", "contrastive",
           "contrast_pairs"]
