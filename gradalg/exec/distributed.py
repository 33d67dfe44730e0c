"""Model-sharded attribution with torch.distributed: every rank of a ``torchrun`` job
runs the same plan on its part of each dataset and returns the same full result.

``TorchDistributed()`` is built on every rank after ``torch.distributed.init_process_group``;
the model is sharded by FSDP2 (``fully_shard``), replicated by DDP, or plain. Every rank
calls ``S.compute(executor=ex)`` with the same expression.

A ``TorchDistributed`` is the one :class:`~gradalg.exec.base.Executor` (plan, run,
assemble) with :class:`RankShards` as its shard strategy (:mod:`gradalg.exec.runner`),
as :class:`~gradalg.exec.dask.DaskExecutor` is with Dask's. For each pass that reads a
dataset of n examples over W ranks:

1. **split**: rank r reads examples ``rank_ranges(n, W)[r]`` (contiguous, in rank order,
   sizes differing by at most one; :mod:`gradalg.exec.shards`), the pass's jobs restricted
   to that range (``restrict``) and fed into freshly opened accumulators;
2. **equal steps**: every rank runs the same number of forward/backward calls (FSDP2
   all-gathers weights in each forward and backward, DDP broadcasts buffers; unmatched
   collectives deadlock): a rank with fewer batches than the largest range reads
   ``batches_in(max size, batch) - batches_in(its size, batch)`` padding batches — the
   pass's first example, captured and transformed like any batch, fed to no accumulator;
3. **combine**: job i is owned by rank ``i % W``. Its owner gathers every rank's partial
   state (``export()``), absorbs them in rank order — exactly the order one process reads
   the data — and finishes it (Fisher / K-FAC normalization, K-FAC eigendecompositions,
   EK-FAC corrections, concatenated rows and score columns); the finished result is
   broadcast, so every rank publishes the *same bits* into its run state. Sums,
   eigenbases and held rows are therefore identical on every rank, and a later pass that
   rotates rows into a K-FAC basis uses one basis everywhere.

Passes over rows in memory or over a store read no model: every rank runs them whole.
Operators known only through products (``ga.hessian``, ``ga.gauss_newton``) run their
products pass whole on every rank, called by the solver, over the whole dataset (same
numbers, not faster; a typed placement decision says so); on a
sharded model they are refused, as is ``backend="func"`` (both read whole parameters
through ``torch.func``), and FSDP1 (``FullyShardedDataParallel``, flat parameters) is
refused with FSDP2 and DDP named.

Before running a plan the ranks compare a description of it (passes, their datasets'
fingerprints and row counts, job kinds, batch sizes): ranks given other data, options or
expressions are refused before any collective could mismatch. Node tokens themselves are
not compared: the fingerprint of an FSDP2 parameter hashes this rank's shard
(:mod:`gradalg.fingerprint`), so tokens of a sharded model are per rank; nothing is
exchanged by token (jobs are paired by their position in the plan).

Errors on one rank (a NaN gradient named by example, a Fisher over no rows) are
exchanged after the pass's batches and raised on every rank
(:class:`~gradalg.errors.DistributedError` names the rank and its message); the failing
rank keeps stepping through padding batches so the others are not left waiting in a
collective (an error inside a forward can still leave FSDP's collectives unmatched:
torch.distributed's timeout then ends the job).
"""
from __future__ import annotations

import io
from dataclasses import replace
from itertools import zip_longest

import torch

from ..errors import DistributedError
from ..capture.wrappers import is_sharded, sharding
from ..expr import CurvatureProducts, Source
from ..options import get_options
from ..units import format_bytes
from .base import Executor
from .capture_pass import model_device_dtype
from .runner import ShardStrategy, check_reductions
from .shards import batches_in, rank_ranges, restrict_step

__all__ = ["TorchDistributed", "RankShards", "plan_outline"]


def _dist():
    """``torch.distributed``, refused with a typed error when this torch build lacks it."""
    if not torch.distributed.is_available():
        raise DistributedError("this torch build has no torch.distributed: install a torch with distributed "
                               "support (the PyPI wheels have it), or use ga.exec.LocalExecutor")
    return torch.distributed


class RankShards(ShardStrategy):
    """The torch.distributed shard strategy: each pass over data split over the ranks of
    ``group``, each job's state combined on its owner rank and broadcast; parameters as
    :class:`TorchDistributed`'s. ``traffic``: per pass over data, the bytes this rank sent
    as partial states and received as finished results."""

    keeps_held_rows = True
    here, spread = "whole on every rank", "split over the ranks"

    def ways(self) -> int:
        return self.world_size

    def __init__(self, group=None, *, check_plans: bool = True):
        dist = _dist()
        if not dist.is_initialized():
            raise DistributedError(
                "TorchDistributed needs an initialized torch.distributed process group: launch the script "
                "with torchrun (torchrun --nproc_per_node N script.py) and call "
                "torch.distributed.init_process_group('nccl' on GPUs, 'gloo' on CPU) before building it; "
                "in one process use ga.exec.LocalExecutor")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.check_plans = check_plans
        self.traffic: list[dict] = []

    # ------------------------------------------------------------------ planning and checks
    def budget(self, options, node):
        """One memory budget on every rank: a budget from the machine
        (``ga.options(memory_budget=None)``) is each rank's free memory, which differs
        between ranks, and so would their batch sizes; the ranks take the smallest (one
        small all-gather per plan). None: the options' budget, the same everywhere."""
        if options.memory_budget is not None:
            return None
        from ..plan.budget import resolve_budget
        from ..plan.planner import model_device
        mine = resolve_budget(options, model_device(getattr(node, "expr", node)))
        budget = min(self._everyone(mine), key=lambda b: b.bytes)
        return replace(budget, source=f"{budget.source}, the smallest of {self.world_size} ranks")

    def before_run(self, p) -> None:
        """Refuse what a sharded model cannot run; compare the ranks' plans."""
        _refuse_inexact(p.simplified)
        self.traffic = []
        if self.check_plans:
            self._agree(p)

    def describe_shards(self, step, where, n: int, result_bytes: float) -> str:
        """How a pass over ``n`` examples is split over the ranks and what crosses the network."""
        sizes = [b - a for a, b in rank_ranges(n, self.world_size)]
        steps = batches_in(max(sizes), step.batch_size)
        return (f"{self.world_size} ranks, {min(sizes)}–{max(sizes)} examples each, {steps} forward/backward "
                f"steps per rank (shorter ranges padded); per job, every rank's partial state is gathered "
                f"by its owner rank and the finished result broadcast (~{format_bytes(result_bytes)} of results)")

    # ------------------------------------------------------------------ a pass over the ranks
    def run_shards(self, runner, step, accs) -> dict:
        """Run one pass: this rank's range of the data, padding batches up to the largest
        range's count, then each job's state combined on its owner rank (into ``accs[i]``)
        and broadcast. Returns every job's finished result (the same on every rank)."""
        data = step.sources()[0].data
        ranges = rank_ranges(data.n, self.world_size)
        start, stop = ranges[self.rank]
        steps = batches_in(max(b - a for a, b in ranges), step.batch_size)
        self._raise_any(_caught(check_reductions, runner.ctx, step)[1], step)   # the same forwards on every rank
        trace = runner.ctx.trace
        before = trace.copy()
        stepped = [0]   # an empty range (n < ranks) exports empty states
        parts, error = _caught(runner.feed_shard, step, data.token, start, stop, stepped=stepped)
        ran = dict(trace - before)    # this rank's kernels; its padding batches' are not traced
        padded = _caught(self._pad, runner, step, data, steps - stepped[0])[1]   # even after an error
        self._raise_any(error or padded, step)
        trace.clear()
        trace.update(before)          # equal on every rank, plus every rank's kernels: the same trace everywhere
        for counts in self._everyone(ran):
            trace.update(counts)
        device = model_device_dtype(step.sources()[0].task.model)[0]
        self.traffic.append({"pass": step.label, "part_bytes": 0, "result_bytes": 0})   # counted by _combine
        return {i: self._combine(i, job, accs[i], parts[i], device) for i, job in enumerate(step.jobs)}

    # ------------------------------------------------------------------ pieces of a pass
    @staticmethod
    def _pad(runner, step, data, count: int) -> None:
        """``count`` batches of the pass's first example, captured and derived like real
        ones (the same rows, projections, weights: the same collectives) and fed to no
        accumulator (the caller drops their kernels from the trace)."""
        if count <= 0:
            return
        pad_step = restrict_step(step, data.token, 0, 1)
        for _ in range(count):
            runner.feed(pad_step, [None] * len(pad_step.jobs), [0])

    def _combine(self, index: int, job, acc, part, device):
        """Job ``index`` finished on its owner rank, its accumulator ``acc`` absorbing every
        rank's part, broadcast to all.

        Parts and results cross as ``torch.save`` bytes loaded onto the receiving rank's
        ``device`` (a CUDA tensor pickled as such would land on the sender's GPU index)."""
        dist = _dist()
        owner = index % self.world_size
        parts = [None] * self.world_size if self.rank == owner else None
        packed = _pack(part)
        self.traffic[-1]["part_bytes"] += len(packed)
        dist.gather_object(packed, parts, dst=self._global(owner), group=self.group)
        out = [None]
        if self.rank == owner:
            try:
                for p in parts:        # rank order = the data's order
                    acc.absorb(_unpack(p, device))
                out = [("ok", _pack(acc.finish()))]
            except Exception as err:  # noqa: BLE001 - sent to every rank, raised there
                out = [("error", f"{type(err).__name__}: {err}")]
        dist.broadcast_object_list(out, src=self._global(owner), group=self.group)
        status, value = out[0]
        if status != "ok":
            raise DistributedError(f"rank {owner} could not finish {type(job).__name__} "
                                   f"{job.target.label!r}: {value}")
        self.traffic[-1]["result_bytes"] += len(value)
        return _unpack(value, device)

    def _raise_any(self, error, step) -> None:
        """Raise on every rank if any rank failed during the pass."""
        messages = self._everyone(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        for rank, message in enumerate(messages):
            if message is not None:
                raise DistributedError(f"rank {rank} failed in the {step.label}: {message}")

    def _agree(self, p) -> None:
        """Compare this rank's plan with every other rank's (by content, not by token)."""
        mine = plan_outline(p)
        for rank, other in enumerate(self._everyone(mine)):
            if other != mine:
                where, (a, b) = next((k, ab) for k, ab in enumerate(zip_longest(mine, other)) if ab[0] != ab[1])
                raise DistributedError(
                    f"rank {self.rank} and rank {rank} planned different passes (first difference at pass "
                    f"{where}: {a} vs {b}): every rank must compute the same expression over the same data "
                    "with the same ga.options")

    # ------------------------------------------------------------------ helpers
    def _everyone(self, mine) -> list:
        """Every rank's ``mine``, in rank order (one all-gather of Python objects)."""
        out = [None] * self.world_size
        _dist().all_gather_object(out, mine, group=self.group)
        return out

    def _global(self, rank: int) -> int:
        """The global rank of ``rank`` of this strategy's group."""
        return rank if self.group is None else _dist().get_global_rank(self.group, rank)


class TorchDistributed(RankShards, Executor):
    """Runs plans over the ranks of a torch.distributed process group (``torchrun``): the
    :class:`~gradalg.exec.base.Executor` with the :class:`RankShards` strategy.

    Every rank builds one (after ``torch.distributed.init_process_group``) and computes
    the same expression with it; each rank reads its part of every dataset, partial
    statistics are combined by their owner rank and broadcast, and every rank returns
    the same full (query, train) result, equal to one process's to float tolerance.

    Parameters
    ----------
    group : the process group (default: the default group, ``torch.distributed.group.WORLD``).
    options, rewrites, choices : as :class:`~gradalg.exec.LocalExecutor`.
    check_plans : compare the ranks' plans before running them (one small all-gather
        per plan); a difference raises :class:`~gradalg.errors.DistributedError` on every rank.

    After a run, ``traffic`` lists per pass over data the bytes this rank sent as partial
    states (``part_bytes``, to the jobs' owners) and received as finished results
    (``result_bytes``, broadcast by the owners; an owner counts its own results too).

    Example (``torchrun --nproc_per_node 2 examples/torch_distributed.py``)::

        dist.init_process_group("gloo")             # "nccl" on GPUs, after torch.cuda.set_device
        fully_shard(model)                          # or DDP(model), or the plain model
        ex = ga.exec.TorchDistributed()
        S = ga.methods.grad_dot(ga.Task(model, loss), train, queries)
        scores = S.compute(executor=ex)             # the same DataArray on every rank
    """

    name = "torch_distributed"

    def __init__(self, group=None, *, options=None, rewrites: bool = True, choices=None, check_plans: bool = True):
        RankShards.__init__(self, group, check_plans=check_plans)
        options = options or get_options()
        if self.rank != 0 and options.progress:   # one progress display per job, rank 0's
            options = replace(options, progress=False)
        Executor.__init__(self, options, rewrites=rewrites, choices=choices, shards=self)


def _caught(fn, *args, **kwargs) -> tuple:
    """``(fn(*args, **kwargs), None)``, or ``(None, its exception)``: a rank's failure is
    raised on every rank after the collectives every rank runs (:meth:`RankShards._raise_any`)."""
    try:
        return fn(*args, **kwargs), None
    except Exception as err:  # noqa: BLE001 - raised on every rank by the caller
        return None, err


def _refuse_inexact(node) -> None:
    """Refuse what reads whole parameters of a sharded model (``torch.func``)."""
    for x in node.walk():
        task = getattr(x, "task", None)
        if task is not None and sharding(task.model) == "fsdp1":
            raise DistributedError(
                f"{x.label!r} uses a model wrapped in FSDP1 (FullyShardedDataParallel), whose flat "
                "parameters TorchDistributed does not read exactly: shard it with FSDP2 "
                "(torch.distributed.fsdp.fully_shard) or replicate it with DDP")
        if isinstance(x, Source) and x.backend == "func" and is_sharded(x.task.model):
            raise DistributedError(
                f"gradients of {x.label!r} use backend='func' (torch.func over whole parameters), but the "
                "model's parameters are sharded (FSDP2 DTensors): use backend='hooks' (the default), which "
                "captures each layer's activations and output gradients inside FSDP's own forward/backward")
        if isinstance(x, CurvatureProducts) and is_sharded(x.task.model):
            raise DistributedError(
                f"{x.label!r} is known through Hessian/Gauss-Newton-vector products (torch.func over whole "
                "parameters), which a sharded (FSDP2) model does not hold: use ga.kfac / ga.ekfac or "
                "ga.fisher of (projected) gradients, or replicate the model with DDP")


def _pack(obj) -> bytes:
    """``obj`` (tensors, chunks, resolved operators) as bytes for an object collective."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _unpack(data: bytes, device):
    """An object packed by :func:`_pack`, its tensors on ``device``."""
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)


def plan_outline(p) -> list:
    """A plan's passes as plain data every rank can compare: for each pass its kind, the
    fingerprint and size of the data it reads, its batch size and its jobs' kinds."""
    return [(step.key.kind, (step.sources()[0].data.token, step.sources()[0].data.n) if step.reads_data else None,
             step.batch_size, tuple(type(j).__name__ for j in step.jobs)) for step in p.passes]
