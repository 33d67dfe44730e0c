"""Suite-wide settings.

Tests run two at a time (``pytest -n 2``) on two cores with tiny tensors: one intra-op
thread per test process avoids oversubscription (measured 4-10× slower otherwise).
``tests/`` is put on ``sys.path`` so test modules can share ``models`` and ``references``.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)
