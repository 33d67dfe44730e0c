"""One sharding predicate for every caller: :func:`gradalg.capture.wrappers.is_sharded` is
true for FSDP1 (``FullyShardedDataParallel``) and for DTensor parameters (FSDP2), false
for a plain model and DDP, and ``influence(curvature="auto")`` keeps the Gauss-Newton for
both sharded kinds (``hessian_refusal``); the one DTensor test (``gradalg.dtensor``) reads
FSDP2's parameters as this rank's shards for the finiteness check and the digest. One ``torchrun --nproc_per_node 2`` launch with
gloo on CPU (``tests/dist_scripts/sharding.py``)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from torchrun import run_cases   # tests/ is on sys.path (conftest)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases("sharding.py", tmp_path_factory.mktemp("dist") / "results.json", timeout=120)


@pytest.mark.parametrize("case", ["whole", "fsdp1", "fsdp2", "dtensor_shards"])
def test_one_sharding_predicate(results, case):
    assert case in results, f"the script did not run {case}"
    assert results[case] == "ok", results[case]


def test_a_plain_model_is_not_sharded():
    from torch import nn

    from gradalg.capture.wrappers import is_sharded, sharding
    model = nn.Sequential(nn.Linear(3, 2))
    assert sharding(model) is None and not is_sharded(model)
