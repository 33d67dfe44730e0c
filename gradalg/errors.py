"""Exceptions that name the problem and the fix.

Every error a user can trigger with bad input is one of these, so notebooks can catch
``gradalg.GradalgError`` and tests can assert on the exact class.
"""
from __future__ import annotations

from collections import Counter

from .bytefmt import format_bytes_alike

__all__ = [
    "GradalgError",
    "UnsupportedLayerError",
    "NoForwardADError",
    "LossReductionError",
    "SpaceMismatchError",
    "NonFiniteGradientError",
    "NonFiniteWeightError",
    "ShapeMismatchError",
    "MemoryBudgetError",
    "StoreMismatchError",
    "StoreIncompleteError",
    "BatchContentError",
    "PerTokenError",
    "StoreCorruptError",
    "OptionError",
    "DataError",
    "WorkerFaultError",
    "ExampleIdsError",
    "OperatorError",
    "CurvatureError",
    "StaleCompiledError",
    "ObjectiveError",
    "DistributedError",
    "ModelMismatchError",
    "IdMismatchError",
    "PlanError",
    "CaptureStateError",
    "HeadMismatchError",
    "PartialGradientError",
    "LayerNameError",
    "StoreNotFoundError",
    "MissingLibraryError",
]


class GradalgError(Exception):
    """Base class of every error gradalg raises on purpose."""


class UnsupportedLayerError(GradalgError, TypeError):
    """A layer was requested that hook capture cannot record per example."""


class NoForwardADError(UnsupportedLayerError):
    """The model runs an operation torch has no forward-mode AD rule for (``torch.func.jvp``),
    which curvature products (Hessian- and Gauss-Newton-vector) need."""


class LossReductionError(GradalgError, ValueError):
    """The task's loss is not a sum over the examples of a batch."""


class SpaceMismatchError(GradalgError, ValueError):
    """Two operands live in different parameter spaces (layers, shapes or projections)."""


class ShapeMismatchError(GradalgError, ValueError):
    """A tensor handed to gradalg has the wrong shape."""


class IdMismatchError(ShapeMismatchError):
    """Two results that are paired (scores and a ground truth, two score matrices, a
    store and the rows written to it) do not carry the same ids along a dimension, or
    one repeats an id. The results are paired by id, never by position: ids in another
    order are aligned, and any other difference is this error, which names the ids and
    the fix. A :class:`ShapeMismatchError`.

    Attributes
    ----------
    dim : str
        The dimension ("query", "train", "subset", ...).
    missing : list
        Ids of the reference side (``reference``) that the other side lacks.
    extra : list
        Ids of the other side that the reference side lacks.
    repeated : list
        Ids that occur more than once on either side.
    """

    def __init__(self, message: str, dim: str = "", missing=(), extra=(), repeated=()):
        self.message, self.dim = message, dim
        self.missing, self.extra, self.repeated = list(missing), list(extra), list(repeated)
        super().__init__(message)

    def __reduce__(self):   # picklable (raised on a Dask worker, re-raised here)
        return type(self), (self.message, self.dim, self.missing, self.extra, self.repeated)

    @staticmethod
    def difference(reference, other) -> tuple[list, list, list]:
        """(missing, extra, repeated): ids of ``reference`` not in ``other``, ids of
        ``other`` not in ``reference``, ids repeated on either side (each in first-seen order)."""
        reference, other = list(reference), list(other)
        ref_set, other_set = set(reference), set(other)
        missing = [i for i in dict.fromkeys(reference) if i not in other_set]
        extra = [i for i in dict.fromkeys(other) if i not in ref_set]
        counts_ref, counts_other = Counter(reference), Counter(other)
        repeated = [i for i in dict.fromkeys(reference + other) if counts_ref[i] > 1 or counts_other[i] > 1]
        return missing, extra, repeated

    @staticmethod
    def describe(missing, extra, repeated, reference_name: str, other_name: str, dim: str) -> str:
        """One sentence naming (a few of) the missing, extra and repeated ids."""
        def few(ids):
            shown = ", ".join(repr(i) for i in ids[:8])
            return f"[{shown}{', ...' if len(ids) > 8 else ''}]"
        parts = []
        if missing:
            parts.append(f"{len(missing)} {dim} id{'s' if len(missing) > 1 else ''} of {reference_name} "
                         f"missing from {other_name} {few(missing)}")
        if extra:
            parts.append(f"{len(extra)} {dim} id{'s' if len(extra) > 1 else ''} of {other_name} not in "
                         f"{reference_name} {few(extra)}")
        if repeated:
            parts.append(f"repeated {dim} ids {few(repeated)}")
        return "; ".join(parts) if parts else f"the {dim} ids are in another order"


class MemoryBudgetError(GradalgError, MemoryError):
    """Something cannot be carried out within the memory budget: a pass, a dense matrix, a
    Fisher's statistics, a run on a number of GPUs. Raised before anything runs (on a Dask
    worker too: picklable). Its numbers are fields, and its message is rendered from them in
    one place (:meth:`render`): code reads the fields, never the text. A ``MemoryError``.

    The message is ``"{subject} needs {needed} ({parts}; {detail}), over {limit} of
    {budget}. Fixes: {fixes[0]}; or {fixes[1]} ... {note}"``, its byte counts in one unit
    (:func:`~gradalg.units.format_bytes_alike`).

    Attributes
    ----------
    subject : str
        What does not fit: a pass's label, ``"a dense gaussian projection of 1,000
        coordinates to k=512"``, ``"a dense Fisher over 36 coordinates"``, ``"each of 1 ×
        H200"``.
    needed : float | None
        Bytes it needs at the least (a pass: what it holds plus one example's or one chunk's
        work; a Fisher: its matrix or the peak of inverting it, whichever is larger). None
        only for an error made from a message alone.
    budget : float | None
        Bytes it was refused under (the memory budget; a GPU's memory for ``limit="the memory
        of one H200"``).
    parts : list[tuple[str, float]]
        How ``needed`` is made up: (what, bytes) pairs, written in the unit of ``needed``
        (those of 0 bytes left out).
    detail : str
        Further arithmetic, as text ("" if none).
    fixes : list[str]
        Short fixes, each applicable as written, in the order to try them.
    fits_under : float | None
        The smallest budget under which what was refused plans (for a pass: every pass of
        its plan at a batch of one): the budget the planner's note suggests
        (:func:`~gradalg.plan.budget.refusal_note`); None where no budget this machine has
        would do (none is suggested). ``needed`` unless given.
    limit : str
        What ``budget`` is: ``"the memory budget"`` unless given.
    note : str
        Where the budget came from and how to change it, added by the planner
        (:func:`~gradalg.plan.budget.with_note`); "" until then.
    """

    def __init__(self, subject: str, needed: float | None = None, budget: float | None = None, *,
                 parts=(), detail: str = "", fixes=(), fits_under: float | None | str = "needed",
                 limit: str = "the memory budget", note: str = ""):
        self.subject, self.detail, self.limit, self.note = subject, detail, limit, note
        self.needed = None if needed is None else float(needed)
        self.budget = None if budget is None else float(budget)
        self.parts = [(what, float(n)) for what, n in parts]
        self.fixes = [f for f in fixes if f]
        self.fits_under = self.needed if fits_under == "needed" else None if fits_under is None else float(fits_under)
        super().__init__(self.render())

    def __reduce__(self):   # picklable (raised on a Dask worker, re-raised here)
        return _memory_budget_error, (self.subject, self.needed, self.budget, self.parts, self.detail, self.fixes,
                                      self.fits_under, self.limit, self.note)

    def __str__(self):
        return self.render()

    def summary(self) -> str:
        """``"{subject} needs {needed}, over {limit} of {budget}"`` (``subject`` alone
        without numbers): the first sentence of the message, for a decision's reason."""
        if self.needed is None or self.budget is None:
            return self.subject
        need, budget = _alike(self.needed, self.budget)[:2]
        return f"{self.subject} needs {need}, over {self.limit} of {budget}"

    def render(self) -> str:
        """The message, from the fields (see the class docstring); an error made from a
        message alone is that message."""
        text = self.subject
        if self.needed is None and not (self.detail or self.fixes or self.note):
            return text
        if self.needed is not None and self.budget is not None:
            parts = [(what, n) for what, n in self.parts if n]      # the parts that are not 0
            shown = _alike(self.needed, self.budget, *(n for _, n in parts))
            why = "; ".join(x for x in (", ".join(f"{what} {n}" for (what, _), n in zip(parts, shown[2:])),
                                        self.detail) if x)
            text += f" needs {shown[0]}" + (f" ({why})" if why else "") + f", over {self.limit} of {shown[1]}"
        elif self.detail:
            text += f": {self.detail}"
        if self.fixes:
            text += ". Fixes: " + "; or ".join(self.fixes)
        text = text.rstrip(".") + "."
        return f"{text} {self.note}" if self.note else text


def _alike(needed: float, budget: float, *parts: float) -> tuple[str, ...]:
    """``needed``, ``budget`` and ``parts`` in one unit, to three significant digits, or as
    many more (up to 7) as it takes for ``needed`` and ``budget`` not to read the same."""
    for digits in range(3, 8):
        shown = format_bytes_alike(needed, budget, *parts, digits=digits)
        if shown[0] != shown[1] or needed == budget:
            return shown
    return shown


def _memory_budget_error(subject, needed, budget, parts, detail, fixes, fits_under, limit, note):
    return MemoryBudgetError(subject, needed, budget, parts=parts, detail=detail, fixes=fixes,
                             fits_under=fits_under, limit=limit, note=note)


class ExampleIdsError(GradalgError, ValueError):
    """Captured rows cannot be labelled with the dataset examples they came from."""


class StoreMismatchError(GradalgError, ValueError):
    """A store (``ga.store``) was written from something else: another model, projector,
    layer list, objective, set of examples or chunking.

    Attributes
    ----------
    differences : list[str]
        One line per metadata field that differs, with both values.
    """

    def __init__(self, differences, fix: str):
        self.differences = list(differences)
        self.fix = fix
        super().__init__("the store does not match: " + "; ".join(self.differences) + f". {fix}.")

    def __reduce__(self):   # picklable (raised on a Dask worker, re-raised here)
        return type(self), (self.differences, self.fix)


class StoreIncompleteError(GradalgError, RuntimeError):
    """A store whose writing did not finish (or never started) was opened."""


class StoreNotFoundError(GradalgError, FileNotFoundError):
    """No store at the path given (``ga.store.open``, ``ga.store.verify``, ``gradalg inspect``)."""


class MissingLibraryError(GradalgError, ImportError):
    """An optional library this feature needs is not installed; the message names the
    ``pip install`` that adds it (the command line exits 6). Also an ``ImportError``."""


class StoreCorruptError(GradalgError, OSError):
    """A store's files are damaged: a chunk is missing, truncated or fails its checksum,
    or its attributes contradict its data. The message names the files."""


class OptionError(GradalgError, ValueError, TypeError):
    """An option or argument is unknown or has an invalid value (wrong type or out of
    range). Both a ``ValueError`` and a ``TypeError``."""


class LayerNameError(OptionError, KeyError):
    """A layer name or glob pattern matches no module of the model (close names are
    suggested). Also a ``KeyError``."""

    def __str__(self):   # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DataError(GradalgError, ValueError, TypeError):
    """The data cannot be attributed as given (no examples or no length, a shuffling or
    dropping loader, ids that do not match, a batch without a batch dimension). Both a
    ``ValueError`` and a ``TypeError``."""


class WorkerFaultError(GradalgError, RuntimeError):
    """A distributed pass could not finish: workers kept dying, a task stalled past its
    timeout (the worker is named), or the cluster has no workers left."""


class NonFiniteGradientError(GradalgError, FloatingPointError):
    """Per-example gradients, inputs or losses contain NaN or inf.

    Attributes
    ----------
    example_ids : list
        Ids of the examples whose gradients (inputs, losses) are not finite.
    layers : list[str]
        Layers in which the non-finite values were found (empty when found in the inputs
        or the losses).
    """

    def __init__(self, example_ids, layers, where: str | None = None, fix: str | None = None):
        self.example_ids = list(example_ids)
        self.layers = list(layers)
        self.where, self.fix = where, fix
        shown = ", ".join(map(str, self.example_ids[:20]))
        more = "" if len(self.example_ids) <= 20 else f" (and {len(self.example_ids) - 20} more)"
        what = where if where is not None else f"NaN/inf per-example gradients in layers {self.layers}"
        at = f" for example ids [{shown}]{more}" if self.example_ids else ""
        super().__init__(
            f"{what}{at}. " + (fix if fix is not None else
            "The model's parameters and buffers passed the weight check (no NaN/inf), so these examples "
            "are at fault: check their inputs and labels (an empty target, a log of zero, an overflow in half precision); remove "
            "them with a filtered dataset, or compute in float32/float64.")
        )

    def __reduce__(self):   # picklable (raised on a Dask worker, re-raised here)
        return type(self), (self.example_ids, self.layers, self.where, self.fix)


class NonFiniteWeightError(NonFiniteGradientError):
    """A parameter or buffer of the model holds NaN or inf, so every gradient and score
    computed from it would be NaN: the examples are not at fault. Raised before the
    first pass (checked once per pass, one ``isfinite`` per tensor).

    Attributes
    ----------
    name : str
        The parameter's or buffer's name (``model.named_parameters()`` / ``named_buffers()``).
    kind : str
        ``"parameter"`` or ``"buffer"``.
    layer : str
        The module that holds it (``""``: the model itself).
    example_ids, layers : ``[]`` and ``[layer]`` (as for :class:`NonFiniteGradientError`).
    """

    def __init__(self, name: str, kind: str, n_nan: int, n_inf: int, numel: int):
        self.name, self.kind, self.n_nan, self.n_inf, self.numel = name, kind, n_nan, n_inf, numel
        self.layer = name.rpartition(".")[0]
        self.example_ids, self.layers = [], [self.layer]
        self.where = self.fix = None
        layer = f" of layer {self.layer!r}" if self.layer else ""
        GradalgError.__init__(
            self,
            f"the model's {kind} {name!r}{layer} holds {n_nan:,} NaN and {n_inf:,} inf of its {numel:,} "
            "values: every gradient and score computed from it would be NaN, whatever the examples. "
            "Load finite weights (the checkpoint before the training run diverged; a float16/bfloat16 "
            "conversion that overflowed), or repair this tensor "
            f"(with torch.no_grad(): model.get_{kind}({name!r}).nan_to_num_(0.0)) if you know its "
            "values do not matter")

    def __reduce__(self):
        return type(self), (self.name, self.kind, self.n_nan, self.n_inf, self.numel)


class BatchContentError(GradalgError, ValueError):
    """A batch's fields cannot give the loss the task declares: a missing field, padding
    on the other side than the task assumes, a row with no real token, or a row none of
    whose labels count.

    Attributes
    ----------
    example_ids : list
        Ids of the offending examples (batch positions when the ids are not known).
    """

    def __init__(self, message: str, example_ids=()):
        self.example_ids = list(example_ids)
        self.message = message
        super().__init__(message)

    def __reduce__(self):   # picklable (raised on a Dask worker, re-raised here)
        return type(self), (self.message, self.example_ids)


class PerTokenError(GradalgError, ValueError):
    """Per-token rows (``G.per_token()``) cannot be built or computed exactly for these gradients."""


class OperatorError(GradalgError, ValueError):
    """An operation a resolved operator cannot do exactly for its structure (the inverse of
    a singular matrix, a fractional power of an indefinite one, a power of an operator known
    only through products, ...). The message names the structure and the fix."""


class CurvatureError(OperatorError):
    """Kronecker curvature kept in float32 (factors wider than
    ``ga.options(kron_float64_width)``) whose eigendecomposition is not accurate enough for
    what is asked of it: the eigensolver's residual or orthogonality check failed, or an
    inverse would divide by eigenvalues smaller than their own error. The message shows
    the arithmetic and the fixes (more damping, a projection, float64 factors)."""


class StaleCompiledError(GradalgError, RuntimeError):
    """A compiled expression (``ga.compile``) whose model weights changed since it was
    compiled, used with ``on_change="raise"``."""


class ObjectiveError(GradalgError, ValueError):
    """The optimizer's settings (weight decay, Adam state) cannot be read, or have no exact form
    in the requested space (``gradalg.objective``)."""


class DistributedError(GradalgError, RuntimeError):
    """A torch.distributed run cannot give exact results: no process group, ranks that
    planned different passes, a sharded model on a path that reads whole weights, or an
    error on another rank (named, with its message)."""


class ModelMismatchError(GradalgError, ValueError):
    """The model a Dask worker built or loaded from its factory
    (``DaskExecutor(model_fn=...)``) is not the client's: another architecture, other
    weights (both fingerprints are named), or workers that disagree with each other; or a
    pass needs the weights of a model the client holds on the ``meta`` device."""


class PlanError(GradalgError, RuntimeError):
    """The planner could not produce a plan for this expression: a stage did not converge,
    jobs depend on each other in a circle, or the expression asks for something no pass
    can compute (the message names it and what to write instead). Importable as
    ``gradalg.plan.PlanError`` too."""


class CaptureStateError(GradalgError, RuntimeError, ValueError):
    """A training-time capture used out of order: its rows read before any training ran or
    when it keeps none (``keep=False``), a capture entered twice, a stream used before it is
    attached. Both a ``RuntimeError`` and a ``ValueError``."""


class HeadMismatchError(GradalgError, ValueError):
    """The task's loss does not fit the model's head: a cross-entropy over one logit per
    example (0 whatever the model: every gradient would be a silent 0), labels of another
    shape than the head's outputs, a causal-LM task on an encoder-decoder model."""


class PartialGradientError(GradalgError, RuntimeError):
    """Hook capture accounts for only part of a parameter's gradient: the weight is also
    used outside the module that holds it (an ``nn.Embedding`` weight reused by
    ``x @ emb.weight.T`` or ``F.linear``: a hand-written tied head), so its per-example
    gradients would miss that use. Checked on the first batch against autograd's gradient
    (:mod:`gradalg.capture.verify`); the message names the parameters and the fix."""
