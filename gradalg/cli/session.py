"""A config made into gradalg objects, loaded once each: model, task, projector, data,
and the expressions the commands run.

    session = Session(cfg)                  # nothing loaded yet
    session.grads("train")                  # P(ga.grads(task, train, layers)), lazy
    session = Session(cfg, planning=True)   # data replaced by PlanningData (gradalg explain)
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from functools import cached_property

from .config import Config, ConfigError
from . import loaders

__all__ = ["Session"]

log = logging.getLogger("gradalg.cli")


class Session:
    """The objects a config names. ``planning=True``: data are stand-ins of the configured
    size (``data.<x>.n``, ``seq_len``) and a transformers model is built on the meta
    device, so nothing is read and no memory is taken."""

    def __init__(self, cfg: Config, *, planning: bool = False):
        self.cfg = cfg
        self.planning = planning
        self._data: dict = {}

    @cached_property
    def model(self):
        """The model (on the meta device when planning: shapes only)."""
        return loaders.load_model(self.cfg, meta=self.planning)

    @cached_property
    def task(self):
        return loaders.make_task(self.cfg, self.model)

    @cached_property
    def projector(self):
        return loaders.make_projector(self.cfg)

    @property
    def layers(self):
        return self.cfg.layers

    @contextlib.contextmanager
    def executor(self):
        """The ``[executor]``: None (this process) or a DaskExecutor, closed afterwards (a
        cluster it started is shut down; a scheduler given by address is only disconnected)."""
        e = self.cfg.executor
        if e.kind == "local":
            yield None
            return
        from ..exec import DaskExecutor

        if e.address is not None:
            from distributed import Client

            client = Client(e.address)
            log.info("dask: connected to %s (%d workers)", e.address, len(client.scheduler_info()["workers"]))
            try:
                yield DaskExecutor(client, threads_per_worker=e.threads_per_worker, **e.options)
            finally:
                client.close()
            return
        ex = DaskExecutor(n_workers=e.n_workers, threads_per_worker=e.threads_per_worker, **e.options)
        log.info("dask: a local cluster of %d workers (dashboard %s)", e.n_workers, ex.client.dashboard_link)
        try:
            yield ex
        finally:
            ex.close()

    def data(self, which: str):
        """``(dataset, ids)`` of ``[data.<which>]`` (read once)."""
        if which not in self._data:
            section = getattr(self.cfg.data, which, None)
            if not self.planning and section is not None and section.prompt is not None:
                self._data[which] = loaders.prompt_data(self.cfg, which, self.task)   # generates with the model
            else:
                load = loaders.planning_data if self.planning else loaders.load_data
                self._data[which] = load(self.cfg, which)
        return self._data[which]

    def grads(self, which: str):
        """The (projected) gradients of ``[data.<which>]``: what ``build`` stores and
        ``query`` scores against the store."""
        import gradalg as ga

        data, ids = self.data(which)
        try:
            G = ga.grads(self.task, data, self.layers, ids=ids, backend=self.cfg.backend,
                         objective=self.cfg.objective)
        except KeyError as err:     # a layer name the model does not have
            raise ConfigError(f"layers: {err.args[0] if err.args else err}") from None
        P = self.projector
        return P(G) if P is not None else G

    def query_scores(self, stored):
        """Scores of the queries against ``stored`` (a GradientSet read from the store),
        by ``[query].similarity``."""
        import gradalg as ga

        Q = self.grads("queries")
        q = self.cfg.query
        if q.similarity == "dot":
            return Q @ stored.T
        if q.similarity == "cos":
            return Q.normalize() @ stored.normalize().T
        return Q @ ga.fisher(stored).damp(q.damping).inv() @ stored.T

    def method_scores(self):
        """``ga.methods.<name>(task, train, queries, layers=..., **options)`` of ``[method]``."""
        import gradalg as ga
        from ..data import as_data

        m = self.cfg.method
        fn = getattr(ga.methods, m.name)
        params = inspect.signature(fn).parameters
        accepted = [p for p in params if p not in ("task", "tasks", "train", "queries")]
        unknown = sorted(set(m.options) - set(accepted))
        if unknown:
            raise ConfigError(f"method.options: ga.methods.{m.name} has no argument {unknown}; it takes {accepted}")
        kwargs = dict(m.options)
        if "layers" in params and "layers" not in kwargs:
            kwargs["layers"] = self.layers
        if m.use_projector and "projector" in params and "projector" not in kwargs and self.projector is not None:
            kwargs["projector"] = self.projector
        train, train_ids = self.data("train")
        queries, query_ids = self.data("queries")
        if train_ids is not None:
            train = as_data(train, train_ids)
        if query_ids is not None:
            queries = as_data(queries, query_ids)
        try:
            return fn(self.task, train, queries, **kwargs)
        except (TypeError, ValueError) as err:
            if isinstance(err, ga.GradalgError):
                raise
            raise ConfigError(f"[method] {m.name}: {err}") from None
