"""The transformer blocks of a model and the linear layers inside them.

What :class:`gradalg.TransformerBlocks` selects (the language tasks' default layers),
found from the module tree alone, never from model names:

* a **block list** is an ``nn.ModuleList`` holding at least two modules of one class
  that hold parameters (``transformer.h``, ``model.layers``, ``gpt_neox.layers``,
  ``encoder.layer``, T5's ``encoder.block`` / ``decoder.block``); only the outermost
  lists count (a list of experts inside a block is part of that block);
* the **block linears** are the modules inside a block list that hook capture factors
  as linear maps (``nn.Linear``, HF ``Conv1D``) and have trainable parameters: the
  attention and MLP projections, ``nn.Linear`` experts, PEFT's LoRA adapters (the frozen
  layer they wrap has no trainable parameter), and experts stored fused, as 3-D parameters
  of one module (transformers ≥ 5's Mixtral / Qwen-MoE / OLMoE ``experts``: ``gate_up_proj``
  (E, 2I, H), ``down_proj`` (E, H, I)), whose rule (:mod:`gradalg.capture.experts`, kind
  ``"experts"``) gives one factored block per expert and matrix;
* a model **without** a block list falls back to every default layer (factored kinds)
  except the input embeddings and the output head: ``get_input_embeddings()`` and
  ``get_output_embeddings()`` when the model has them (HF), else every ``nn.Embedding``
  and every linear layer whose output size is the vocabulary of one; any layer sharing a
  weight with those is left out too.

``head=True`` adds the layers outside the blocks that are neither embeddings nor tied
to one (a sequence classifier's ``score``, or BERT's ``pooler.dense`` + ``classifier``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

from ..errors import UnsupportedLayerError
from .layers import rule_for

__all__ = ["block_lists", "select_block_layers", "BlockSelection", "LINEAR_KINDS"]

#: the layer kinds a block's "linear layers" are (``LayerRule.kind``)
LINEAR_KINDS = ("linear", "conv1d", "experts")


@dataclass(frozen=True)
class BlockSelection:
    """The outcome of a :class:`~gradalg.TransformerBlocks` selection.

    ``names``: selected module names in model order; ``lists``: the block lists found
    (empty: the fallback applied); ``n_blocks``: modules in those lists; ``rule``: one
    sentence saying which rule selected them (shown by ``explain()``)."""

    names: tuple[str, ...]
    lists: tuple[str, ...]
    n_blocks: int
    rule: str


def _holds_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def block_lists(model: nn.Module) -> list[str]:
    """Names of the outermost ``nn.ModuleList`` objects of ``model`` with ≥ 2 children of one
    class that hold parameters, in model order."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        if any(name.startswith(outer + ".") for outer in found):
            continue
        classes = Counter(type(child) for child in module if _holds_params(child))
        if classes and max(classes.values()) >= 2:
            found.append(name)
    return found


def _inside(name: str, lists: list[str]) -> bool:
    return any(name.startswith(outer + ".") for outer in lists)


def _embedding_params(model: nn.Module, modules: dict) -> tuple[set[int], str]:
    """Ids of the parameters of the input embeddings and the output head (and a phrase
    saying how they were found)."""
    chosen = []
    how = "get_input_embeddings() / get_output_embeddings()"
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        try:
            found = fn() if callable(fn) else None
        except (NotImplementedError, AttributeError):
            found = None
        if isinstance(found, nn.Module):
            chosen.append(found)
    if not chosen:
        embeddings = [m for m in modules.values() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
        vocab = {m.num_embeddings for m in embeddings}
        heads = [m for m in modules.values() if isinstance(m, nn.Linear) and m.out_features in vocab]
        chosen = embeddings + heads
        how = "every nn.Embedding and every nn.Linear whose output size is an embedding's vocabulary"
    return {id(p) for m in chosen for p in m.parameters()}, how


def select_block_layers(model: nn.Module, head: bool = False) -> BlockSelection:
    """The layers :class:`~gradalg.TransformerBlocks` selects in ``model`` (unwrapped:
    names as in ``model.named_modules()``), with the rule that selected them."""
    modules = dict(model.named_modules())
    lists = block_lists(model)
    embedding_ids, how = _embedding_params(model, modules)
    names = []
    for name, module in modules.items():
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        try:
            rule = rule_for(name, module)
        except UnsupportedLayerError:
            continue
        if not rule.in_default:
            continue    # norms, routers and other replayed modules: layers="all" or their names
        if lists and _inside(name, lists):
            if rule.kind in LINEAR_KINDS:
                names.append(name)
            continue
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            continue
        if any(id(p) in embedding_ids for p in module.parameters(recurse=False)):
            continue    # the head, or a layer tied to an embedding
        if head or not lists:
            names.append(name)
    n_blocks = sum(len(modules[n]) for n in lists)
    if lists:
        rule = (f"the linear layers inside the {n_blocks} blocks of {', '.join(lists)}"
                + ("; and the head: the layers outside the blocks that are not embeddings" if head else ""))
    else:
        rule = ("no block list (an nn.ModuleList of ≥ 2 modules of one class) in "
                f"{type(model).__name__}: every default layer except the embeddings and the "
                f"output head ({how})" + ("" if not head else "; the classification head is kept"))
    if not names:
        raise UnsupportedLayerError(
            f"TransformerBlocks selects no layer of {type(model).__name__} ({rule}): pass layers='all', "
            "or name the layers (module names or glob patterns)")
    return BlockSelection(tuple(names), tuple(lists), n_blocks, rule)
