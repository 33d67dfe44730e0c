"""Suite-wide settings.

Tests run two at a time (``pytest -n 2``) on two cores with tiny tensors: one intra-op
thread per test process avoids oversubscription (measured 4-10× slower otherwise).
``tests/`` is put on ``sys.path`` so test modules can share ``models`` and ``references``.

The memory budget is pinned to 2 GiB: by default it is a fraction of the memory free when
a plan is made (``gradalg.plan.budget``), which would make plans, batch sizes and
snapshots depend on what else runs on the machine. ``tests/test_planner.py`` checks
the machine-derived default with a fake ``/proc/meminfo``, and the cgroup limits (read from
``/proc/self/cgroup``) are pointed at nothing so that a CI runner's container limit does
not change those tests; ``tests/test_budget_cgroup.py`` fakes cgroup trees instead.
"""
import os
import sys

import torch

import gradalg as ga

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)
ga.options(memory_budget=2 * 2**30)
ga.plan.budget.PROC_CGROUP = os.path.join(os.path.dirname(__file__), "no-such-cgroup-list")
