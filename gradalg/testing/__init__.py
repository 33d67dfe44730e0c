"""Test helpers shipped with gradalg, for gradalg's own tests and for extensions.

``GradientSetConformance`` and ``OperatorConformance`` are mixins: a test class supplies
``create()`` and ``dense_reference()`` and inherits a check of every algebra operation
against dense torch. They need no test framework beyond plain ``assert`` (a check that
does not apply raises :class:`unittest.SkipTest`, which pytest reports as a skip)::

    from gradalg.testing import GradientSetConformance

    class TestMyGradients(GradientSetConformance):
        rtol = 1e-9

        def create(self):
            return ga.grads(task, data, layers=["fc1"])

        def dense_reference(self):          # (n, dim), computed without gradalg's executor
            return my_reference_rows()
"""
from .conformance import GradientSetConformance, OperatorConformance, assert_close

__all__ = ["GradientSetConformance", "OperatorConformance", "assert_close"]
