"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): the one sharding predicate
(:func:`gradalg.capture.wrappers.sharding` / ``is_sharded``) on a plain model, DDP, FSDP1
and FSDP2, and ``curvature="auto"``'s refusal of the formed Hessian on the sharded ones;
the one DTensor test (:mod:`gradalg.dtensor`) that the finiteness check and the digest read
on an FSDP2 model.
Rank 0 writes ``{case: "ok" | error}`` as JSON to the path given as the first argument.
"""
from __future__ import annotations

import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import gradalg as ga
from gradalg.capture.wrappers import is_sharded, sharding
from gradalg.dtensor import is_dtensor, local_shard
from gradalg.errors import NonFiniteWeightError
from gradalg.finite import check_model
from gradalg.fingerprint import model_digest
from gradalg.methods.influence import hessian_refusal
from cases import run_and_report  # noqa: E402 - the script folder is on sys.path
from models import mlp

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def check(model, kind):
    assert sharding(model) == kind, (type(model).__name__, sharding(model), kind)
    assert is_sharded(model) == (kind is not None)
    refusal = hessian_refusal(ga.tasks.classification(model))
    if kind is None:
        assert refusal is None, refusal
    else:
        assert refusal is not None and "sharded across ranks" in refusal, refusal


def case_whole():
    """A plain model and DDP hold whole parameters on every rank."""
    check(mlp(), None)
    check(DDP(mlp()), None)


def case_fsdp1():
    """FSDP1 (flat parameters; the wrapper anywhere in the model)."""
    check(FSDP1(mlp(), use_orig_params=True, device_id=torch.device("cpu")), "fsdp1")
    outer = torch.nn.Sequential(FSDP1(mlp(), device_id=torch.device("cpu")))
    check(outer, "fsdp1")


def case_fsdp2():
    """FSDP2 (fully_shard: DTensor parameters)."""
    model = mlp()
    fully_shard(model)
    check(model, "dtensor")


def case_dtensor_shards():
    """FSDP2's parameters are DTensors, each rank's shard ``(rows / 2, cols)``; the digest
    reads this rank's shard (two ranks: two digests; the whole weights would give one) and
    the finiteness check a NaN in it (rank 1's only: rank 0 passes)."""
    model = mlp()                                  # Linear(8, 16), Tanh, Linear(16, 3)
    plain = mlp()
    fully_shard(model)
    rank = dist.get_rank()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert is_dtensor(p) and not is_dtensor(q) and local_shard(q) is q
        shard = local_shard(p)
        assert not is_dtensor(shard) and tuple(p.shape) == tuple(q.shape)
        rows = -(-q.shape[0] // 2)                 # dim 0 split in chunks of ceil(n / 2)
        assert torch.equal(shard, q[rank * rows:(rank + 1) * rows]), (tuple(shard.shape), tuple(q.shape))
    digests = [None, None]
    dist.all_gather_object(digests, model_digest(model))
    assert digests[0] != digests[1], digests
    check_model(model)
    if rank == 1:
        with torch.no_grad():
            local_shard(model[0].weight)[0, 0] = float("nan")
        try:
            check_model(model)
        except NonFiniteWeightError as err:
            assert "0.weight" in str(err), str(err)
        else:
            raise AssertionError("a NaN in this rank's shard was not found")
    else:
        check_model(model)


if __name__ == "__main__":
    run_and_report({"whole": case_whole, "fsdp1": case_fsdp1, "fsdp2": case_fsdp2,
                    "dtensor_shards": case_dtensor_shards})
