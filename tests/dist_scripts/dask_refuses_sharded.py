"""A model sharded by FSDP2 (world size 1, gloo) given to the Dask executor: refused by
name before anything is shipped (a worker would receive only this rank's shards)."""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import gradalg as ga

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
fully_shard(model)
x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
task = ga.tasks.classification(model)
S = ga.grads(task, (x[:2], y[:2])) @ ga.grads(task, (x, y)).T
from distributed import Client, LocalCluster  # noqa: E402

with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
    try:
        S.compute(executor=ga.exec.DaskExecutor(client=client, min_shard_examples=1))
    except ga.DistributedError as err:
        print("REFUSED:", err)
    else:
        print("NOT REFUSED")
dist.destroy_process_group()
