"""MAGIC (Ilyas & Engstrom, "MAGIC: Near-optimal data attribution for deep learning",
2025): exact metagradients of each query's loss through a deterministic training run.

With per-example data weights ε (ε = 1: the run as trained) and the query function
f_q(θ_T(ε)) at the run's final parameters,

    τ_qi = − ∂f_q(θ_T(ε)) / ∂ε_i |_{ε=1}

positive when up-weighting example i lowers the query's loss (i helped q), the sign of
every gradalg score. It is the exact first-order change of f_q when example i is
re-weighted in *this* run (same initialisation, batch order and optimizer), so the
linear prediction Σ_{i∈S} τ_qi of dropping a subset is as good as the run is linear in
ε — the LDS of MAGIC is measured against retraining the same run with those weights.

Cost: one replay of the run (forward, then backward through every optimizer step) for
all queries together; memory ``replay.schedule_bound(checkpointing, T)`` model-plus-
optimizer states plus ``n_query`` adjoint copies of the state. Mechanics in
:mod:`gradalg.unroll.metagradient`; the scale is that of ε, not of the influence
function's (for a run whose objective averages n examples, influence ≈ n · τ).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch.func import functional_call

from ..unroll.metagradient import Metagradients, metagradients
from ..unroll.replay import check_schedule, schedule_bound
from ..unroll.run import TrainingRun, _as_tensors, _LossOf, _rows
from ..unroll.errors import UnsupportedTrainingError
from .registry import method
from ..options import plain
from ..token_scores import Axis, labelled

if TYPE_CHECKING:                 # xarray loads when a result is made (about 76 MB)
    import xarray as xr

__all__ = ["magic", "MagicScores"]


class MagicScores:
    """Lazy MAGIC scores: ``.compute()`` replays the run and returns a DataArray
    (query, train); ``.metagradients`` keeps the raw result (ledger of stored states,
    query targets, ∂f/∂θ₀) after a compute."""

    def __init__(self, run: TrainingRun, queries, query_loss: Callable, checkpointing, replay_tolerance: float):
        self.run = run
        self.queries = queries
        self.query_loss = query_loss
        self.checkpointing = checkpointing
        self.replay_tolerance = replay_tolerance
        self.metagradients: Metagradients | None = None
        self.n_query = _rows(queries)
        self._module = _LossOf(run.model, query_loss)   # query_loss(model, batch) sees θ_T

    @property
    def shape(self) -> tuple[int, int]:
        """(n_query, n_train): one metagradient per query and training example."""
        return (self.n_query, self.run.n_train)

    def _query_fn(self, params: dict) -> torch.Tensor:
        full = {f"model.{n}": v for n, v in params.items()}
        self.run.model.eval()                       # queries are scored without dropout
        try:
            values = functional_call(self._module, full, (self.queries,))
        finally:
            self.run.training_mode()
        if values.shape != (self.n_query,):
            raise UnsupportedTrainingError(f"query_loss must return one value per query, shape ({self.n_query},); "
                                           f"got {tuple(values.shape)}")
        return values

    def compute(self) -> xr.DataArray:
        """Replay the run and back-propagate every query through it: a (query, train)
        ``DataArray`` of −∂f_q/∂ε_i (positive: up-weighting example i lowers the query's loss)."""
        result = metagradients(self.run, self._query_fn, checkpointing=self.checkpointing,
                               replay_tolerance=self.replay_tolerance)
        self.metagradients = result
        values = (-result.values).detach().cpu().numpy()           # (n_query, n_train)
        return labelled(values, [Axis("query", np.arange(self.n_query)), Axis("train", np.arange(self.run.n_train))],
                        "magic", {"method": "magic", "steps": self.run.n_steps,
                                  "checkpointing": str(self.checkpointing), "stored_states_peak": result.ledger.peak})

    def __repr__(self):
        bound = schedule_bound(self.checkpointing, self.run.n_steps)
        return (f"MAGIC scores {self.shape[0]} × {self.shape[1]} (lazy)\n"
                f"  run: {self.run!r}\n"
                f"  replay: checkpointing={self.checkpointing!r}, at most {bound} stored states of "
                f"{self.run.n_steps + 1}, one backward through {self.run.n_steps} optimizer steps")


@method('MAGIC: exact metagradients −∂f_q/∂ε_i through a replayed training run (Ilyas & Engstrom 2025)')
def magic(run: TrainingRun, queries, *, query_loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
          checkpointing="sqrt", replay_tolerance: float = 0.0) -> MagicScores:
    """MAGIC scores ``τ_qi = −∂ f_q(θ_T) / ∂ε_i`` for a :class:`ga.unroll.TrainingRun`.

    queries : the query examples, tensors like the run's data (tuple, dict, TensorDataset).
    query_loss : ``(model, batch) -> (n_query,)``; default the run's per-example loss.
        The model is in eval mode while the queries are scored (no dropout).
    checkpointing : "sqrt" (default, ≤ 2⌈√T⌉ stored states), "log" (⌈log₂T⌉ + 1 states,
        ≈ log₂T times the forward steps), "all" (T states) or a checkpoint interval k.
    replay_tolerance : relative difference allowed when a replayed step is compared with
        the first run (0: bit-identical; raise it for non-deterministic GPU kernels).
    """
    if not isinstance(run, TrainingRun):
        raise UnsupportedTrainingError(f"magic needs a ga.unroll.TrainingRun, got {type(run).__name__}")
    checkpointing = plain(checkpointing)   # np.int64 works as an interval
    check_schedule(checkpointing)
    return MagicScores(run, _as_tensors(queries), query_loss if query_loss is not None else run.loss,
                       checkpointing, float(replay_tolerance))
