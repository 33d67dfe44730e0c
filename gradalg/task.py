"""What is being attributed: a model and a per-example loss.

A :class:`Task` pairs a ``torch.nn.Module`` with ``loss(model, batch)``, which must return
the **sum over the batch's examples** of each example's loss. Per-example gradients are
gradients of those summands; a mean over the batch would scale every example's
gradient by ``1/B`` and make scores depend on the batch size.
"""
from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .data import batch_size_of, slice_batch
from .errors import LossReductionError, OptionError
from .eval_mode import eval_mode
from .fingerprint import callable_fingerprint, digests_held, model_digest

__all__ = ["Task", "TransformerBlocks"]

#: what ``TransformerBlocks(vocabulary=...)`` accepts
VOCABULARY_MODES = (False, True, "auto")


@dataclass(frozen=True)
class TransformerBlocks:
    """A layer selection: the linear layers inside a model's transformer blocks.

    Passed as ``layers=`` (or as a task's ``default_layers``), it selects, in model order,
    the modules that hook capture factors as linear maps (``nn.Linear``, HF ``Conv1D``,
    and the ``nn.Linear`` experts of a mixture of experts) with trainable parameters and
    that lie inside the model's *blocks*: the outermost ``nn.ModuleList`` objects holding
    at least two modules of one class that hold parameters (``transformer.h``,
    ``model.layers``, ``gpt_neox.layers``, ``encoder.layer``, T5's ``encoder.block`` and
    ``decoder.block``). Embeddings, norms and the LM head are not selected: this is the
    default of every peer (Kronfluence, Bergson, dattri) and of the ``ga.tasks`` language
    tasks, and it keeps curvature factors at the hidden width (GPT-2 small's tied
    50,257 × 768 embedding/head alone is a third of the model).

    A model without such a list falls back to every default layer except the input
    embeddings and the output head (``get_input_embeddings()``, ``get_output_embeddings()``
    and every layer sharing a weight with them; without those methods, every
    ``nn.Embedding`` and every linear layer whose output size is an embedding's
    vocabulary); ``explain()`` says which rule applied.

    head : also select the layers outside the blocks that are neither embeddings nor
        tied to one (a sequence classifier's ``score`` / ``pooler`` + ``classifier``).
    vocabulary : False (default), True or "auto"
        Also select the **vocabulary layers**, the input embedding and the output head
        (one block when tied; trainable ones only, so a PEFT model's frozen embeddings stay
        out): ``True`` always, ``"auto"`` when the vocabulary V is at most
        ``ga.options().vocabulary_layers_max`` (read when the layers are resolved). The
        ``ga.tasks`` language tasks default to ``TransformerBlocks(vocabulary="auto")``:
        a small vocabulary's embedding carries most of what a small LM learns (on the
        project's real-text settings EK-FAC influence LDS 0.35 → 0.66 with it), while a
        real one's (32k–262k) costs a V × V curvature factor and V·d gradient coordinates
        per example (:class:`~gradalg.options.Options`, ``vocabulary_layers_max``).
        ``explain()``'s coverage line says which vocabulary layers were taken or left out
        and why.
    """

    head: bool = False
    vocabulary: bool | str = False

    def __post_init__(self):
        if self.vocabulary not in VOCABULARY_MODES or not isinstance(self.vocabulary, (bool, str)):
            raise OptionError(f"TransformerBlocks(vocabulary=...) must be False, True or 'auto', "
                              f"got {self.vocabulary!r}")

    def __str__(self) -> str:
        vocabulary = {False: "", True: " + vocabulary layers",
                      "auto": " + vocabulary layers up to vocabulary_layers_max"}[self.vocabulary]
        return "transformer-block linears" + (" + head" if self.head else "") + vocabulary



class Task:
    """A model and the loss whose per-example gradients are attributed.

    Parameters
    ----------
    model : nn.Module
        Any module. Hook capture records the supported layers (``nn.Linear``, HF
        ``Conv1D``, ``nn.Embedding``, ``nn.Conv2d``); ``backend="func"`` records any
        parameter with ``torch.func``.
    loss : callable ``(model, batch) -> scalar tensor``
        Sum over the batch of each example's loss, e.g.
        ``F.cross_entropy(model(x), y, reduction="sum")``.
    reduction : {"sum", "mean"}
        ``"sum"`` (default): ``loss`` is a sum over examples. ``"mean"``: ``loss`` is a
        mean over the examples; gradalg multiplies by the batch size to recover the sum.
        A mean-reduced loss declared as ``"sum"`` is detected on the first batch and
        refused with a :class:`LossReductionError`.
    token_mask : callable ``batch -> (B, T) bool tensor``, optional
        For sequence models: which token positions are real (not padding). Masked
        positions are zeroed in the captured factors (T stays the padded length), so
        they contribute neither to gradients nor to curvature statistics; K-FAC's token
        count skips them.
    sampled_loss : callable ``(model, batch, rng) -> scalar``, optional
        The summed loss with targets drawn from the model's own predictive distribution,
        using ``rng`` (an :class:`ExampleRandom`: ``rng.sample(probs)``, ``rng.uniform(...)``)
        so that each example's draw depends on the seed and its id only.
        Its per-example gradients give the (Monte-Carlo) true Fisher, which equals the
        Gauss-Newton matrix for cross-entropy: ``ga.grads(..., objective="sampled")``.
    output : callable ``(model, batch) -> scalar``, optional
        Sum over examples of a model output function f_i (TRAK's margin
        log p/(1-p)): ``ga.grads(..., objective="output")``.
    output_weight : callable ``(model, batch) -> (B,)``, optional
        Per-example weight paired with ``output`` (TRAK's 1 − p_i).
    expected_terms : callable ``(model, batch) -> list of scalars``, optional
        Losses L_c (one forward, shared) whose per-example gradients satisfy
        Σ_c ∇L_c,i ∇L_c,iᵀ = the example's Gauss-Newton matrix exactly (for
        cross-entropy: L_c = −Σ_i √p_ic log p_ic, one term per class):
        ``ga.grads(..., objective="expected")``, for curvature only.
    weighted_output : callable ``(model, batch) -> scalar``, optional
        Σ_i Σ_t w_it f_it with the weights detached: TRAK's output function with its Q
        applied per token (``objective="weighted_output"``); for a margin f_t = log
        p_t/(1 − p_t) and w_t = 1 − p_t its gradient is −∇L (see ``ga.tasks.causal_lm``).
    curvature_objective : {"expected", "sampled"}, optional
        Which objective the methods' Gauss-Newton curvature uses; default: "expected"
        when ``expected_terms`` is given, else "sampled". Language-model tasks set
        "sampled": one exact term per vocabulary entry is infeasible.
    check_batch : callable ``(batch, ids) -> None``, optional
        Validates a batch before it is captured, raising a ``GradalgError`` that names
        the example ids at fault (padding side, empty rows, labels that never count).
    forward, loss_from_outputs : callables, optional
        ``forward(model, batch) -> outputs`` and ``loss_from_outputs(outputs, batch) ->
        summed scalar``, with ``loss = loss_from_outputs(forward(model, batch), batch)``.
        They split the loss at the model's outputs for exact Gauss-Newton products.
    default_layers : optional
        The layers ``ga.grads``, ``ga.hessian``, ``ga.gauss_newton`` and every method use
        when called without ``layers``: None (every default layer: Linear, Conv1D,
        Embedding, convolutions), names / glob patterns, ``"all"``, a
        :class:`TransformerBlocks` selection (what the ``ga.tasks`` language tasks set), or
        a callable ``model -> list of module names``. ``layers=`` given to a call wins.
    name : str, optional
        Shown in reprs.
    collate_fn : callable ``list of items -> batch``, optional
        How gradalg's own loaders batch this task's items when the data brings none (a
        list or Dataset, not a DataLoader). None: :func:`gradalg.collate.pad_collate`
        (dict items of unequal length right-padded); the language tasks made with
        ``padding_side="left"`` set :func:`gradalg.collate.left_pad_collate`.

    See :func:`gradalg.tasks.classification` for a task with all of these filled in.
    """

    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, Any], torch.Tensor], *,
                 reduction: str = "sum", token_mask: Callable[[Any], torch.Tensor] | None = None,
                 sampled_loss: Callable | None = None, output: Callable | None = None,
                 output_weight: Callable | None = None, expected_terms: Callable | None = None,
                 weighted_output: Callable | None = None, curvature_objective: str | None = None,
                 check_batch: Callable | None = None, forward: Callable | None = None,
                 loss_from_outputs: Callable | None = None, default_layers: Any = None,
                 name: str | None = None, collate_fn: Callable | None = None):
        if not isinstance(model, nn.Module):
            raise OptionError(f"Task needs a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss):
            raise OptionError("loss must be a callable loss(model, batch) -> scalar tensor")
        if reduction not in ("sum", "mean"):
            raise OptionError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        self.model = model
        self.loss = loss
        self.reduction = reduction
        self.token_mask = token_mask
        self.sampled_loss = sampled_loss
        self.output = output
        self.output_weight = output_weight
        self.expected_terms = expected_terms
        self.weighted_output = weighted_output
        if curvature_objective not in (None, "expected", "sampled"):
            raise OptionError(f"curvature_objective must be 'expected' or 'sampled', got {curvature_objective!r}")
        self.curvature_objective = curvature_objective
        self.check_batch = check_batch
        self.forward = forward
        self.loss_from_outputs = loss_from_outputs
        if isinstance(default_layers, (list, tuple)) and not all(isinstance(n, str) for n in default_layers):
            raise OptionError("default_layers must be None, 'all', module names / glob patterns, a "
                            "ga.TransformerBlocks() selection or a callable model -> list of names")
        self.default_layers = default_layers
        self.name = name or type(model).__name__
        if collate_fn is not None and not callable(collate_fn):
            raise OptionError(f"collate_fn must be a callable list of items -> batch, got {type(collate_fn).__name__}")
        self.collate_fn = collate_fn

    def layers_for(self, layers: Any = None) -> Any:
        """The layer selection of a call: ``layers`` when given, else the task's
        ``default_layers`` (a callable is called on the model here)."""
        if layers is not None:
            return layers
        if callable(self.default_layers) and not isinstance(self.default_layers, TransformerBlocks):
            names = self.default_layers(self.model)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise OptionError(f"default_layers(model) must return a list of module names, got {names!r}")
            return list(names)
        return self.default_layers

    @property
    def token(self) -> str:
        """Stable identity: the model's fingerprint (module tree and every weight, see
        :mod:`gradalg.fingerprint`), the loss functions' fingerprints and the options.

        The same in every process holding the same model and functions; it follows the
        weights (an optimizer step changes it), so a result computed before training is
        never reused after. The weights are hashed once per version (cached), so reading
        the token costs a version check per tensor."""
        with digests_held():    # the loss closures hold the model again: walk it once
            functions = [callable_fingerprint(f) if f is not None else "-"
                         for f in (self.loss, self.token_mask, self.sampled_loss, self.output,
                                   self.output_weight, self.expected_terms, self.forward, self.loss_from_outputs)]
            h = hashlib.blake2b("|".join([model_digest(self.model), self.reduction, *functions]).encode(),
                                digest_size=10).hexdigest()
        return f"task-{h}-{self.name}"

    def __repr__(self):
        return f"Task({self.name}, reduction={self.reduction!r})"

    def validate_batch(self, batch: Any, ids=None) -> None:
        """Run the task's ``check_batch`` (if any) on a batch about to be captured."""
        if self.check_batch is not None:
            self.check_batch(batch, ids)

    def summed_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss as a sum over the batch's examples (rescaling a declared mean)."""
        value = self.loss(model, batch)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise LossReductionError(
                f"loss(model, batch) must return a scalar tensor (the sum over the batch of "
                f"per-example losses), got {shape}; reduce it with .sum()"
            )
        if self.reduction == "mean":
            value = value * batch_size_of(batch)
        return value

    def objective_fn(self, objective: str, seed: int = 0) -> Callable[[nn.Module, Any], torch.Tensor]:
        """``(model, batch) -> summed scalar`` whose per-example gradients are captured.

        objective: "loss" (the training loss), "sampled" (targets sampled from the model:
        the function also takes the batch's example ids, and each example's draw depends
        only on ``seed`` and its id, never on batching) or "output" (the output function).
        """
        if objective == "loss":
            return self.summed_loss
        if objective == "sampled":
            if self.sampled_loss is None:
                raise OptionError("objective='sampled' needs Task(..., sampled_loss=fn(model, batch, "
                                 "generator)); ga.tasks.classification(model) provides one")
            def sampled(model, batch, ids=None):
                ids = range(batch_size_of(batch)) if ids is None else ids
                return self.sampled_loss(model, batch, ExampleRandom(seed, tuple(ids), _device_of(model)))
            return sampled
        if objective == "output":
            if self.output is None:
                raise OptionError("objective='output' needs Task(..., output=fn(model, batch)); "
                                 "ga.tasks.classification(model) provides the TRAK margin")
            return self.output
        if objective == "weighted_output":
            if self.weighted_output is None:
                raise OptionError("objective='weighted_output' needs Task(..., weighted_output=fn(model, batch)); "
                                 "ga.tasks.causal_lm(model) provides TRAK's per-token weighted margin")
            return self.weighted_output
        if objective == "expected":
            if self.expected_terms is None:
                raise OptionError("objective='expected' needs Task(..., expected_terms=fn(model, batch)); "
                                 "ga.tasks.classification(model) provides one")
            return self.expected_terms
        raise OptionError("objective must be 'loss', 'sampled', 'expected', 'output' or 'weighted_output', "
                         f"got {objective!r}")

    @torch.no_grad()
    def check_reduction(self, batch: Any, full_loss: float | None = None) -> None:
        """Refuse a loss that averages over the batch while declared a sum.

        Compares ``L(batch)`` with ``L(first) + L(rest)`` and with the batch-size weighted
        mean of the two, using forward passes only. A batch of one example is checked as
        that example twice (a sum doubles, a mean does not). Inconclusive cases (both
        parts with equal losses and ``L = 0``, a batch that cannot be indexed) pass.

        ``full_loss``: ``summed_loss(model, batch)`` already computed in eval mode (the
        capture's own forward of this batch). When the check's examples are the whole
        batch (2 to 4 examples) it stands for ``L(batch)``, so the check costs the
        forwards of ``first`` and ``rest`` only (one forward of the batch, not two). A
        batch of one example is its own ``first`` and ``rest`` (the same example): then
        the check costs the forward of the doubled batch only.

        Forwards, in examples: n = 1: 2 (3 without ``full_loss``); 2 ≤ n ≤ 4: n (2n);
        n > 4: 8. Fewer cannot decide it: the check needs L(A ∪ B), L(A) and L(B) for
        disjoint non-empty A and B (or B = A, doubled), and a capture's forward gives
        one of them, so at least two examples' forwards are extra.
        """
        n = batch_size_of(batch)
        b = min(n, 4)  # a few examples decide it: the check costs ~2 of their forwards
        if b < 1:
            return
        known = float(full_loss) if full_loss is not None and n <= 4 else None
        with eval_mode(self.model), torch.no_grad():
            if b == 1:
                # one example: compare it with a batch holding it twice (a sum doubles, a mean
                # does not); its own loss is both parts (one forward of it, or the capture's)
                try:
                    doubled = slice_batch(batch, [0, 0])
                    if batch_size_of(doubled) != 2:
                        return
                except (IndexError, TypeError, RuntimeError):
                    return   # a batch that cannot be indexed by example: inconclusive
                b = 2
                full = float(self.summed_loss(self.model, doubled))
                first = rest = known if known is not None else float(self.summed_loss(self.model, batch))
            else:
                batch = slice_batch(batch, slice(0, b))
                full = known if known is not None else float(self.summed_loss(self.model, batch))
                first = float(self.summed_loss(self.model, slice_batch(batch, slice(0, 1))))
                rest = float(self.summed_loss(self.model, slice_batch(batch, slice(1, b))))
        if not all(map(math.isfinite, (full, first, rest))):
            return  # inconclusive: NaN/inf is reported by the finite check, naming the examples
        as_sum = first + rest
        as_mean = (first + (b - 1) * rest) / b if self.reduction == "sum" else None
        scale = max(abs(full), abs(as_sum), 1e-12)
        # a half-precision model rounds each loss to 8 (bf16) or 11 (fp16) bits
        half = next((p.dtype for p in self.model.parameters()), None) in (torch.float16, torch.bfloat16)
        rel = 3e-2 if half else 1e-3
        if math.isclose(full, as_sum, rel_tol=rel, abs_tol=1e-6 * scale):
            return
        if self.reduction == "sum" and math.isclose(full, as_mean, rel_tol=rel, abs_tol=1e-6 * scale):
            raise LossReductionError(
                "the task's loss looks averaged over the batch (loss(batch) equals the mean of "
                "its parts, not their sum). Per-example gradients need a sum: use "
                "reduction='sum' in the loss (e.g. F.cross_entropy(..., reduction='sum')), or "
                "declare ga.Task(model, loss, reduction='mean') to let gradalg rescale by the "
                "batch size."
            )
        raise LossReductionError(
            f"loss(batch)={full:.6g} is neither the sum ({as_sum:.6g}) of the losses of its "
            "examples nor their mean: the loss couples examples (batch statistics such as "
            "BatchNorm in train mode, or a token mean across the whole batch). Make it a sum "
            "of per-example terms, e.g. average tokens within each sequence and sum over "
            "sequences, and put BatchNorm in eval mode."
        )


class ExampleRandom:
    """Per-example random numbers: example ``id`` draws from its own generator seeded by
    (seed, id), so results do not depend on how examples are batched or sharded."""

    def __init__(self, seed: int, ids: tuple, device=None):
        self.seed, self.ids, self.device = seed, ids, device

    def _generator(self, example_id) -> torch.Generator:
        return torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{example_id}".encode()) + self.seed * 2**32)

    def uniform(self, *shape) -> torch.Tensor:
        """(B, *shape) uniforms in [0, 1)."""
        rows = [torch.rand(shape, generator=self._generator(i), dtype=torch.float64) for i in self.ids]
        return torch.stack(rows).to(self.device) if rows else torch.empty(0, *shape)

    def uniform_ragged(self, counts) -> list[torch.Tensor]:
        """``counts[i]`` uniforms for example i, the first ones the same whatever the count
        (a sequence's draws do not depend on the padded length of its batch)."""
        return [_prefix_uniform(self._generator(i), int(c)).to(self.device) for i, c in zip(self.ids, counts)]

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """Indices drawn from ``probs`` (B, ..., C) along the last dim, per example.   (B, ...)"""
        u = self.uniform(*probs.shape[1:-1]).to(probs.device)
        cdf = probs.cumsum(-1, dtype=torch.float64)       # float64: tail tokens keep their width
        # u scaled by the total (unnormalized probs are fine) rather than the CDF divided by it
        target = (u * cdf[..., -1]).unsqueeze(-1)
        return torch.searchsorted(cdf, target).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def _prefix_uniform(generator: torch.Generator, count: int) -> torch.Tensor:
    """``count`` float64 uniforms drawn one at a time in blocks of 64, so that a longer
    draw extends a shorter one (a single ``torch.rand(count)`` may vectorize differently)."""
    blocks = [torch.rand(64, generator=generator, dtype=torch.float64) for _ in range(-(-count // 64))]
    return torch.cat(blocks)[:count] if blocks else torch.empty(0, dtype=torch.float64)


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
