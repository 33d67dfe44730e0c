"""``ga.check_model(task, data)``: before a long run, check that per-example gradients are
what attribution assumes.

Checks, in order (each a :class:`~gradalg.check.result.Finding` kind):

1. ``finite``: every parameter and floating buffer is finite (else nothing else runs).
2. ``train_mode``: no dropout (p > 0) or batch-statistics module (BatchNorm) is in train
   mode, and two forwards of one batch in the model's current mode agree; fix
   ``model.eval()``.
3. ``special_tokens``: no example starts with BOS/CLS twice or ends with EOS/SEP twice
   (a warning).
4. ``loss_sum``: the loss L_B of a batch B of n examples and the sum of its captured
   rows Σ_i g_i^B are Σ_{i∈B} L_i and Σ_{i∈B} g_i, the sums over the examples computed
   alone. A loss averaged over the batch (both 1/n of the sums) fails, naming
   ``reduction``; a batch loss with terms no example has alone (a target predicted from a
   padding position) fails too, when the examples' rows are their own (else check 5
   reports the interaction).
5. ``batch_independence``: each example's captured gradient alone equals its row in
   every batch of the examples together (the data's own batch, and right- and left-padded
   batches for dict token data where the task accepts that side): catches padding read as
   tokens, positions counted from the padding, attention or statistics across the batch,
   a loss normalized by the batch's token count. Compared after undoing a detected mean
   (check 4 names that fix). Left padding alone failing, where the task accepts both sides
   and the data's own batches pass, is a warning (gradalg's collate pads on the right).
6. ``tied_weights``: for each example alone, the captured gradient of each block equals
   autograd's gradient of the block's parameters: a weight used somewhere hooks do not see
   (``h @ emb.weight.T``) fails, naming the block (Σ_i D_iᵀA_i against
   ``torch.autograd.grad``, sketched in the parameters' layout). With checks 4 and 5: an
   example's row in any batch = its row alone = autograd's gradient of its loss alone, and
   the batch's loss is the sum of those.
7. ``coverage``: which trainable parameters the layers attribute (an info,
   :mod:`gradalg.capture.coverage`).

Checks 4–6 run the real capture path (``capture.hooks``: what ``ga.grads`` runs per batch)
in eval mode, as ``ga.grads`` does, and compare random sketches of the gradients
(:mod:`gradalg.check.sketch`), all by relative difference ‖a − b‖ / max(‖a‖, ‖b‖) against
``tolerance``: by the parameters' dtype 1e-6 (float64), 1e-3 (float32), 2e-2 (float16),
5e-2 (bfloat16), unless given. Cost: n + 1 to n + 3 forward and backward passes (the n
examples alone, each with a second backward for autograd's gradient, then one to three
batches of all n), plus two forwards in train mode.
"""
from __future__ import annotations

import operator
import time

import torch

from ..capture.coverage import layer_coverage
from ..capture.hooks import resolve_layers
from ..capture.weight_uses import untraced
from ..data import move_batch
from ..eval_mode import eval_mode
from ..errors import GradalgError, ModelMismatchError, OptionError, UnsupportedLayerError
from ..task import Task
from .batches import examples_of, together_batches
from .probes import batch_stat_modules, dropout_modules, finite_state, special_tokens, train_mode
from .result import Finding, ModelCheck
from .sketch import LossFailedError, Sketch, capture_sketch, relative

__all__ = ["check_model", "TOLERANCES"]

#: relative tolerance of the comparisons by parameter dtype (``tolerance=`` overrides)
TOLERANCES = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
_SHOWN = 8


def _positive_int(name: str, value, least: int) -> int:
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None:
        raise OptionError(f"{name} must be an int ≥ {least}, got {value!r}")
    value = number
    if value < least:
        raise OptionError(f"{name} must be an int ≥ {least}, got {value}")
    return value


def _tolerance(model, tolerance) -> float:
    if tolerance is not None:
        try:
            value = float(tolerance)
        except (TypeError, ValueError):
            raise OptionError(f"tolerance must be a positive number, got {tolerance!r}") from None
        if not 0 < value < float("inf"):
            raise OptionError(f"tolerance must be a positive finite number, got {tolerance!r}")
        return value
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return TOLERANCES.get(dtype, 1e-3)


def _device(model):
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _random_forward(task, batch, device) -> bool | None:
    """Whether two forwards of ``batch`` in the model's current mode give different losses
    (functional dropout that no module names). None when not measured: in eval mode, or
    when a dropout or BatchNorm module already decides (a BatchNorm forward in train mode
    would update its running statistics), or when the forward fails in train mode (the
    checks in eval mode then report what ga.grads would meet)."""
    model = task.model
    if not model.training or dropout_modules(model) or batch_stat_modules(model):
        return None
    batch = move_batch(batch, device)
    try:
        with torch.no_grad():
            a, b = (float(task.summed_loss(model, batch)) for _ in range(2))
    except Exception:  # noqa: BLE001 - a probe only: the eval-mode capture below raises what matters
        return None
    return a != b and not (a != a and b != b)


def check_model(task: Task, data, *, layers=None, n_examples: int = 8, tolerance: float | None = None,
                seed: int = 0, sketch_dim: int = 16) -> ModelCheck:
    """Check, on a few examples of ``data``, that ``task``'s per-example gradients do not
    depend on the batch and that capture sees them whole (checks in the module docstring).

    Parameters
    ----------
    task : :class:`~gradalg.Task`
    data : anything ``ga.grads`` takes; its first ``n_examples`` examples are used, batched
        by the data's own ``collate_fn``.
    layers : as in ``ga.grads`` (default: the task's default layers).
    n_examples : examples to check (at least 2; default 8).
    tolerance : relative tolerance of the comparisons (default by the parameters' dtype:
        :data:`TOLERANCES`).
    seed, sketch_dim : the random sketch (``sketch_dim`` rows per side of each block).

    Returns a :class:`~gradalg.check.result.ModelCheck`: ``.ok``, ``.findings`` (each with
    ``kind``, ``severity``, ``message``, ``fix``, ``numbers``), ``.raise_if_failed()``.
    The model's train/eval mode is left as it was.

    Example::

        check = ga.check_model(ga.tasks.causal_lm(model), train)
        check.raise_if_failed()      # a ModelCheckError listing each failed check and its fix
    """
    start = time.perf_counter()
    if not isinstance(task, Task):
        raise OptionError(f"ga.check_model needs a ga.Task, got {type(task).__name__}: wrap the model as "
                          "ga.Task(model, loss) or use a ga.tasks builder")
    n_examples = _positive_int("n_examples", n_examples, 2)
    sketch_dim = _positive_int("sketch_dim", sketch_dim, 1)
    seed = _positive_int("seed", seed, 0)
    model = task.model
    if any(p.is_meta for p in model.parameters()):
        raise ModelMismatchError(f"{type(model).__name__}'s weights are on the meta device (shapes only): there "
                                 "is nothing to run. Load the weights (from_pretrained, or load_state_dict(..., "
                                 "assign=True)) before ga.check_model")
    tol = _tolerance(model, tolerance)
    try:
        refs = resolve_layers(model, task.layers_for(layers))
    except KeyError as err:
        raise UnsupportedLayerError(f"layers: {err.args[0] if err.args else err}") from None
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    examples = examples_of(data, n_examples, encoder_decoder)
    findings = [finite_state(model)]
    if findings[0].severity == "ok":
        findings += _run_checks(task, refs, examples, tol, Sketch(sketch_dim, seed), encoder_decoder)
    findings.append(_coverage(task, refs, layers))
    return ModelCheck(tuple(findings), type(model).__name__, tuple(r.name for r in refs), examples.ids,
                      time.perf_counter() - start, tol)


def _coverage(task, refs, layers) -> Finding:
    cov = layer_coverage(task.model, [r.name for r in refs],
                         selection=task.default_layers if layers is None else layers)
    text = cov.describe()
    return Finding("coverage", "info", text[len("coverage: "):] if text.startswith("coverage: ") else text, numbers={
        "blocks": cov.blocks, "attributed_parameters": cov.attributed, "trainable_parameters": cov.total,
        "fraction": round(cov.fraction, 6)})


def _run_checks(task, refs, examples, tol, sketch, encoder_decoder) -> list:
    device = _device(task.model)
    findings = []
    try:
        for i, batch in zip(examples.ids, examples.alone):
            task.validate_batch(batch, (i,))
        findings.append(train_mode(task.model, _random_forward(task, examples.alone[0], device)))
        special = special_tokens(task.model, examples.alone, examples.ids)
        if special is not None:
            findings.append(special)
        together, refused = together_batches(examples, task, encoder_decoder)
        with eval_mode(task.model), untraced(task.model, refs):   # eval mode, as ga.grads; tied_weights below
            alone = [capture_sketch(task, b, refs, sketch, device, autograd=True, ids=(i,))
                     for i, b in zip(examples.ids, examples.alone)]
            batches = [(t, capture_sketch(task, t.batch, refs, sketch, device, ids=examples.ids)) for t in together]
    except LossFailedError as err:
        return findings + [Finding("refused", "fail", str(err),
                                   "run task.loss(model, batch) on these examples to see the error: token ids "
                                   "within the vocabulary, fields of matching shapes (labels as wide as "
                                   "input_ids); ga.grads would stop on the same error",
                                   examples=tuple(err.example_ids))]
    except GradalgError as err:
        return findings + [Finding("refused", "fail", f"capturing the examples {list(examples.ids)[:_SHOWN]} "
                                   f"was refused: {err}", "the message above names the fix; "
                                   "ga.grads would refuse the same batches",
                                   examples=tuple(getattr(err, "example_ids", ()) or ()))]
    bad = [i for i, s in zip(examples.ids, alone) if not s.loss == s.loss or abs(s.loss) == float("inf")]
    if bad:
        return findings + [Finding("finite", "fail", f"the loss of examples {bad[:_SHOWN]} is NaN/inf",
                                   "check these examples' inputs and labels (an empty target, a log of zero, "
                                   "an overflow in half precision) or drop them", examples=tuple(bad))]
    scales = _mean_scales(alone, batches, tol)
    independence = _independence(examples.ids, alone, batches, tol, scales, refused)
    coupled = {f.numbers.get("batch") for f in independence if f.severity in ("fail", "warning")}
    findings.append(_loss_sum(alone, batches, tol, scales, coupled))
    findings += independence
    findings.append(_tied(alone, tol))
    return findings


def _mean_scales(alone, batches, tol) -> dict:
    """``{batch name: 1/n}`` for the batches whose gradient Σ_i g_i^B is (1/n) Σ_i g_i, and
    whose loss is (1/n) Σ_i L_i: a loss averaged over the batch (their rows are then
    compared times n)."""
    total = torch.cat([s.flat_rows() for s in alone]).sum(0)
    loss = sum(s.loss for s in alone)
    scales = {}
    for t, s in batches:
        g, n = s.flat_rows().sum(0), len(alone)
        if relative(g, total) > tol and relative(g * n, total) <= tol and \
                abs(s.loss * n - loss) <= tol * max(abs(loss), 1e-30):
            scales[t.name] = 1.0 / n
    return scales


def _loss_sum(alone, batches, tol, scales, coupled) -> Finding:
    """Each batch's loss and gradient (the sum of its captured rows) against the sums over
    the examples alone. ``coupled``: the batches whose rows differ from the examples' alone
    (reported by batch_independence)."""
    total = torch.cat([s.flat_rows() for s in alone]).sum(0)
    loss_alone = sum(s.loss for s in alone)
    n = len(alone)
    diffs = {t.name: (relative(s.flat_rows().sum(0), total), abs(s.loss - loss_alone) / max(abs(loss_alone), 1e-30),
                      s.loss) for t, s in batches}
    numbers = {"tolerance": tol, "batches": len(batches), "loss_of_examples_alone": loss_alone,
               "relative_difference": max((max(d[:2]) for d in diffs.values()), default=0.0)}
    if scales:
        name = next(iter(scales))
        return Finding("loss_sum", "fail",
                       f"the loss is a mean over the batch, not a sum: the loss and gradient of the {name} batch "
                       f"of {n} examples are 1/{n} of the sums over the examples alone",
                       "sum the per-example losses (e.g. F.cross_entropy(..., reduction='sum')), or declare "
                       "the mean: ga.Task(model, loss, reduction='mean') (gradalg rescales by the batch size)",
                       numbers, where=tuple(scales))
    extra = [name for name, (_, dl, _) in diffs.items() if dl > tol and name not in coupled]
    if extra:
        name = extra[0]
        return Finding("loss_sum", "fail",
                       f"the loss of the {name} batch of {n} ({diffs[name][2]:.6g}) is not the sum of its examples' "
                       f"losses alone ({loss_alone:.6g}) although each example's captured gradient is its own: the "
                       "loss counts terms that no example has alone (a target predicted from a padding position, "
                       "a penalty on the whole batch), so output functions and per-example weights built on it "
                       "are wrong",
                       "make the loss a sum of per-example terms over real positions only: give every target "
                       "whose input position is padding the label -100 (targets[:, t] where attention_mask[:, t] "
                       "is 0, not only where attention_mask[:, t + 1] is 0; with ga.tasks.causal_lm(model, "
                       "padding_side='left'), pass labels that are -100 at each row's first real token)", numbers,
                       where=tuple(extra))
    others = [name for name, d in diffs.items() if max(d[:2]) > tol]
    if others:
        return Finding("loss_sum", "info",
                       f"the loss or gradient of the {others[0]} batch is neither the sum nor the mean of the "
                       f"examples' (relative difference {max(diffs[others[0]][:2]):.2g}): the examples interact in "
                       "the batch, see batch_independence", numbers=numbers, where=tuple(others))
    return Finding("loss_sum", "ok", f"the loss and gradient of each batch are the sums over its {n} examples "
                   "computed alone", numbers=numbers)


def _independence(ids, alone, batches, tol, scales, refused) -> list:
    """Each example's captured row alone against its row in each batch."""
    solo = torch.cat([s.flat_rows() for s in alone])                      # (n, K)
    per_block_solo = {b: torch.cat([s.rows[b] for s in alone]) for b in alone[0].rows}
    results = {}
    for t, s in batches:
        together = s.flat_rows() / scales.get(t.name, 1.0)
        diffs = [relative(together[i], solo[i]) for i in range(len(ids))]
        blocks = {b: max(relative(s.rows[b][i] / scales.get(t.name, 1.0), per_block_solo[b][i])
                         for i in range(len(ids))) for b in s.rows}
        results[t.name] = (t, diffs, blocks)
    if len(ids) < 2:
        return [Finding("batch_independence", "info", "the data hold one example: there is no batch of several "
                        "examples to compare it with", "pass data with at least two examples",
                        {"examples": len(ids)})]
    findings = []
    numbers = {"tolerance": tol, "examples": len(ids),
               **{f"max_relative_difference[{name}]": max(d) for name, (_, d, _) in results.items()}}
    failing = {name: r for name, r in results.items() if max(r[1]) > tol}
    for name, (t, diffs, blocks) in failing.items():
        bad = [i for i, d in zip(ids, diffs) if d > tol]
        layers = [b for b, d in sorted(blocks.items(), key=lambda kv: -kv[1]) if d > tol]
        severity = "fail"
        if (name == "left-padded" and "right-padded" in results and "right-padded" not in failing
                and "collated" not in failing):
            severity = "warning"       # the task accepts both sides and the model wants right padding
        findings.append(Finding(
            "batch_independence", severity,
            f"per-example gradients differ between each example alone and the {name} batch of {len(ids)}: "
            f"relative difference up to {max(diffs):.2g} (tolerance {tol:.0e}) for example ids {bad[:_SHOWN]}, "
            f"largest in {layers[:4]}", _independence_fix(name, severity),
            {**numbers, "max_relative_difference": max(diffs), "batch": name}, examples=tuple(bad),
            where=tuple(layers)))
    if not findings:
        names = " and ".join(results)
        findings.append(Finding("batch_independence", "ok",
                                f"each example's gradient alone equals its row in the {names} batch"
                                f"{'es' if len(results) > 1 else ''} of {len(ids)}", numbers=numbers))
    for side, message in refused.items():
        findings.append(Finding("batch_independence", "info",
                                f"{side}-padded batches not compared: the task refuses them ({message.split(':')[0]})",
                                numbers={"side": side}))
    return findings


def _independence_fix(name: str, severity: str) -> str:
    if severity == "warning":
        return ("this model needs right padding (gradalg's collate pads on the right): do not left-pad, or count "
                "positions from each row's first real token (ga.tasks.causal_lm(model, padding_side='left') does)")
    if name in ("right-padded", "left-padded"):
        return ("padding changes the gradients: the model or the loss reads padded positions. Pass the "
                "attention_mask to the model, give padded targets the label -100, give the task a token_mask "
                "(ga.Task(..., token_mask=...)), or use ga.tasks.causal_lm / masked_lm / seq2seq, which do all "
                "three (padding_side='left' for left padding)")
    return ("the examples of a batch interact: make each example's loss depend on that example only (no "
            "attention or pooling across the batch dimension, no statistics of the batch: BatchNorm in eval "
            "mode, a loss normalized per sequence rather than by the batch's token count), and pad with an "
            "attention_mask the model reads")


def _tied(alone, tol) -> Finding:
    """Σ_i captured gradient against autograd's, per block, for each example alone (in a
    batch, the rows are checked against these by batch_independence, and their sum and the
    batch's loss against the examples' by loss_sum)."""
    worst: dict = {}
    for s in alone:
        for b, d in s.autograd.items():
            if d is not None:
                worst[b] = max(worst.get(b, 0.0), d)
    missed = [b for b, d in sorted(worst.items(), key=lambda kv: -kv[1]) if d > tol]
    numbers = {"tolerance": tol, "blocks_compared": len(worst),
               "max_relative_difference": max(worst.values(), default=0.0)}
    if not missed:
        return Finding("tied_weights", "ok", f"captured gradients equal autograd's for all {len(worst)} blocks "
                       "(tied and reused weights included)", numbers=numbers)
    return Finding("tied_weights", "fail",
                   f"the captured gradients of {missed[:_SHOWN]} are not autograd's gradient of their parameters "
                   f"(relative difference up to {worst[missed[0]]:.2g}): a weight is used where hooks do not see "
                   "it (a hand-written tied head h @ emb.weight.T, F.linear on a module's weight)",
                   "route every use of the weight through a module call (a head nn.Linear(d, V, bias=False) "
                   "whose weight is the embedding's: head.weight = emb.weight), or leave these blocks out of "
                   "`layers`", numbers, where=tuple(missed))
