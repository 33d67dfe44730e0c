"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): the one sharding predicate
(:func:`gradalg.capture.wrappers.sharding` / ``is_sharded``) on a plain model, DDP, FSDP1
and FSDP2, and ``curvature="auto"``'s refusal of the formed Hessian on the sharded ones.
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


if __name__ == "__main__":
    run_and_report({"whole": case_whole, "fsdp1": case_fsdp1, "fsdp2": case_fsdp2})
