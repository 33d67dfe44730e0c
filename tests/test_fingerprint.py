"""A tensor's digest is cached by what its writes bump: a cached digest of changed weights
would let a store match a model it was not written from (a silently wrong number)."""
from __future__ import annotations

from references import run_one_rank

_DTENSOR_WRITES = r'''
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
from gradalg.fingerprint import tensor_digest
p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), DeviceMesh("cpu", [0]), [Shard(0)]))
seen = [tensor_digest(p)]
assert tensor_digest(p) == seen[0]                       # cached, unchanged
with torch.no_grad():
    p.to_local().add_(1.0)                               # a loader writing this rank's shard
seen.append(tensor_digest(p))
with torch.no_grad():
    p.add_(1.0)                                          # an optimizer's step on the DTensor
seen.append(tensor_digest(p))
assert len(set(seen)) == 3, seen
dist.destroy_process_group()
print("ok")
'''


def test_a_dtensor_written_through_its_local_shard_gets_a_new_digest(tmp_path):
    """FSDP2's parameters are DTensors: a write into ``p.to_local()`` does not bump the
    DTensor's version counter (nor a step on the DTensor its shard's), so a digest cached by
    the DTensor's counter alone stayed the old weights' (a store would match a changed model).
    One rank, gloo, in a fresh process."""
    out = run_one_rank(_DTENSOR_WRITES, tmp_path, "dtensor_writes.py")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
