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

``vocabulary`` adds the **vocabulary layers**: the input embedding and the output head
(``get_input_embeddings()`` / ``get_output_embeddings()``; without them every
``nn.Embedding`` that is not a position embedding and every linear layer whose output
size is such an embedding's vocabulary), the trainable ones only (a PEFT model's frozen
embeddings stay out). A head tied to the embedding is one block (:mod:`gradalg.capture.
tying`). ``True``: always; ``"auto"`` (the ``ga.tasks`` language tasks): when the
vocabulary V (the input embedding's ``num_embeddings``, else the head's output size) is
at most ``ga.options().vocabulary_layers_max``, read when the layers are resolved. Their
cost grows with V, not with the model: a K-FAC / EK-FAC factor of V × V (8·V² bytes, an
O(V³) eigendecomposition up to ``kron_diagonal_width``) and V·d gradient coordinates per
example (:class:`VocabularyChoice` says which applied and why).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

from ..errors import OptionError, UnsupportedLayerError
from ..options import get_options
from ..task import VOCABULARY_MODES
from .layers import POSITION_EMBEDDINGS, rule_for

__all__ = ["block_lists", "select_block_layers", "vocabulary_layers", "BlockSelection", "VocabularyChoice",
           "LINEAR_KINDS", "VOCABULARY_MODES"]


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
    vocabulary: "VocabularyChoice | None" = None


@dataclass(frozen=True)
class VocabularyChoice:
    """Whether a selection took a model's vocabulary layers, and why.

    ``names``: the vocabulary layers' module names in model order (a tied head and
    embedding both named: one block); ``shown``: them for reading (``transformer.wte
    (tied to lm_head)``); ``size``: the vocabulary V; ``included``; ``mode``: the
    selection's ``vocabulary`` (True / "auto"); ``limit``: ``vocabulary_layers_max`` read
    for "auto" (None otherwise)."""

    names: tuple[str, ...]
    shown: str
    size: int
    included: bool
    mode: object
    limit: int | None = None

    def describe(self) -> str:
        """One clause for ``explain()``'s coverage: which vocabulary layers are in or out, and why."""
        if self.mode is True:
            return f"and the vocabulary layers {self.shown} (vocabulary {self.size:,}; vocabulary=True)"
        if self.included:
            return (f"and the vocabulary layers {self.shown}: vocabulary {self.size:,} ≤ "
                    f"ga.options(vocabulary_layers_max={self.limit})")
        return (f"not the vocabulary layers {self.shown}: vocabulary {self.size:,} > "
                f"ga.options(vocabulary_layers_max={self.limit}), whose K-FAC factor would be "
                f"{self.size:,} × {self.size:,} and whose gradient is {self.size:,}·d per example "
                f"(name them, or raise vocabulary_layers_max above {self.size:,}, to include them)")


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


def _from_getters(model: nn.Module) -> list[nn.Module]:
    """The modules ``model.get_input_embeddings()`` / ``get_output_embeddings()`` return (in
    that order; a getter that is missing, not implemented or returns no module gives none)."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        try:
            module = fn() if callable(fn) else None
        except (NotImplementedError, AttributeError):
            module = None
        if isinstance(module, nn.Module):
            found.append(module)
    return found


def _embedding_params(model: nn.Module, modules: dict) -> tuple[set[int], str]:
    """Ids of the parameters of the input embeddings and the output head (and a phrase
    saying how they were found)."""
    chosen = _from_getters(model)
    how = "get_input_embeddings() / get_output_embeddings()"
    if not chosen:
        embeddings = [m for m in modules.values() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
        vocab = {m.num_embeddings for m in embeddings}
        heads = [m for m in modules.values() if isinstance(m, nn.Linear) and m.out_features in vocab]
        chosen = embeddings + heads
        how = "every nn.Embedding and every nn.Linear whose output size is an embedding's vocabulary"
    return {id(p) for m in chosen for p in m.parameters()}, how


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def vocabulary_layers(model: nn.Module) -> tuple[tuple[str, ...], str, int]:
    """``(names, shown, V)``: the trainable vocabulary layers of ``model`` (module docstring)
    in model order, them for reading, and the vocabulary V (0 and no names: none found).

    A head tied to the embedding is named with it (``names`` holds both; they resolve to
    one block) and shown as ``transformer.wte (tied to lm_head)``."""
    modules = dict(model.named_modules())
    by_id = {id(m): n for n, m in modules.items()}
    chosen = [m for m in _from_getters(model) if id(m) in by_id]
    size = 0
    if chosen:
        emb = chosen[0] if isinstance(chosen[0], (nn.Embedding, nn.EmbeddingBag)) else None
        size = emb.num_embeddings if emb is not None else int(getattr(chosen[-1], "out_features", 0) or 0)
    else:
        embeddings = [m for n, m in modules.items() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                      and n.split(".")[-1] not in POSITION_EMBEDDINGS]
        vocab = {m.num_embeddings for m in embeddings}
        chosen = embeddings + [m for m in modules.values() if isinstance(m, nn.Linear) and m.out_features in vocab]
        size = max(vocab, default=0)
    chosen = [m for m in chosen if _trainable(m)]
    if not chosen:
        return (), "", size
    names = sorted({by_id[id(m)] for m in chosen}, key=list(modules).index)
    # a module sharing a weight with an earlier one is shown as tied to it
    first: dict[int, str] = {}
    groups: dict[str, list[str]] = {}
    for n in names:
        owner = next((first[id(p)] for p in modules[n].parameters(recurse=False) if id(p) in first), None)
        for p in modules[n].parameters(recurse=False):
            first.setdefault(id(p), owner or n)
        groups.setdefault(owner or n, [])
        if owner is not None:
            groups[owner].append(n)
    shown = ", ".join(n + (f" (tied to {', '.join(t)})" if t else "") for n, t in groups.items())
    return tuple(names), shown, size


def _vocabulary_choice(model: nn.Module, mode) -> VocabularyChoice | None:
    if mode not in VOCABULARY_MODES or not isinstance(mode, (bool, str)):
        raise OptionError(f"TransformerBlocks(vocabulary=...) must be False, True or 'auto', got {mode!r}")
    if mode is False:
        return None
    names, shown, size = vocabulary_layers(model)
    if not names:
        return None
    limit = get_options().vocabulary_layers_max if mode == "auto" else None
    included = mode is True or size <= limit
    return VocabularyChoice(names, shown, size, included, mode, limit)


def select_block_layers(model: nn.Module, head: bool = False, vocabulary=False) -> BlockSelection:
    """The layers :class:`~gradalg.TransformerBlocks` selects in ``model`` (unwrapped:
    names as in ``model.named_modules()``), with the rule that selected them;
    ``vocabulary`` (False, True or "auto"): whether the vocabulary layers are added (module
    docstring), decided here, under the options in force."""
    modules = dict(model.named_modules())
    choice = _vocabulary_choice(model, vocabulary)
    extra = set(choice.names) if choice is not None and choice.included else set()
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
        if name in extra:
            names.append(name)
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
    if choice is not None:
        rule += "; " + choice.describe()
    if not names:
        raise UnsupportedLayerError(
            f"TransformerBlocks selects no layer of {type(model).__name__} ({rule}): pass layers='all', "
            "or name the layers (module names or glob patterns)")
    return BlockSelection(tuple(names), tuple(lists), n_blocks, rule, choice)
