"""``ga.exec.TorchDistributed`` under ``torchrun --nproc_per_node 2`` with gloo on CPU.

One launch of ``tests/dist_scripts/torch_distributed.py`` runs every case (a launch costs
seconds of start-up); each test below reports one case. Every case compares the
DataArray each rank returns with a single-process ``LocalExecutor`` result computed in
the same script on a plain copy of the model (same coordinates, values to 1e-9 in
float64) and requires the same bits on both ranks:

- Grad-Dot, EK-FAC influence, LoGra and TRAK, each on an MLP and a 2-layer GPT-2
  (GPT2Config n_embd=32, random init), each with the model sharded by FSDP2
  (``fully_shard``) and replicated by DDP; 13 training examples in batches of 3 split
  7 / 6, so rank 1 pads a step;
- the default (dense Gauss-Newton) influence under FSDP2, and Gauss-Newton solved by CG
  under DDP (its product passes read the whole data on every rank); the dense EK-FAC
  operator of GPT-2 layers under FSDP2 (the ``operator`` entry point);
- one query over two ranks (rank 1 reads nothing and pads), the forward calls per rank
  counted, ranks that plan different passes refused, a NaN gradient on one rank raised on
  both (and the model still usable after), ``backend="func"`` on a sharded model and FSDP1
  refused.

Without a process group the executor names the fix, and a tensor's fingerprint leaves its
storage resizable (both tested in this process).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import gradalg as ga
from gradalg.errors import DistributedError
from gradalg.exec.shards import batches_in, rank_ranges

from torchrun import run_cases   # tests/ is on sys.path (conftest)

METHODS = ["grad_dot", "ekfac_influence", "logra", "trak"]
CASES = ([f"{m}_{model}_{how}" for model in ("mlp", "gpt2") for how in ("fsdp2", "ddp") for m in METHODS]
         + ["one_query_fewer_than_ranks", "padding_steps_counted", "plans_differ_refused",
            "nan_on_one_rank_raised_everywhere", "token_stable_through_forward", "gauss_newton_products_ddp",
            "gauss_newton_dense_fsdp2", "ekfac_operator_fsdp2", "fsdp1_refused",
            "func_backend_refused", "topk_fsdp2"])

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("transformers")
    return run_cases("torch_distributed.py", tmp_path_factory.mktemp("torch_distributed") / "results.json", timeout=400)


@needs_gloo
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process(results, case):
    assert case in results, f"the script did not run {case}"
    assert results[case] == "ok", results[case]


def test_without_a_process_group_the_fix_is_named():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(DistributedError, match=r"init_process_group.*torchrun|torchrun.*init_process_group"):
        ga.exec.TorchDistributed()


@pytest.mark.parametrize("n, ranks", [(13, 2), (1, 2), (0, 3), (7, 3), (8, 4), (5, 8)])
def test_rank_ranges_cover_the_data_once_in_rank_order(n, ranks):
    ranges = rank_ranges(n, ranks)
    assert len(ranges) == ranks
    assert [i for a, b in ranges for i in range(a, b)] == list(range(n))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_fingerprint_leaves_a_tensors_storage_resizable():
    """Hashing a weight must not pin its storage (NumPy export does): FSDP2 frees gathered
    weights by resizing their storage to 0."""
    import torch

    from gradalg.fingerprint import tensor_digest
    t = torch.arange(1000, dtype=torch.float32)
    digest = tensor_digest(t)
    t.untyped_storage().resize_(0)     # raises "Trying to resize storage that is not resizable" if pinned
    assert digest == tensor_digest(torch.arange(1000, dtype=torch.float32))


def test_batches_in_counts_a_partial_last_batch():
    assert [batches_in(s, 3) for s in (0, 1, 3, 4, 6, 7)] == [0, 1, 1, 2, 2, 3]


@needs_gloo
@pytest.mark.slow
def test_dask_refuses_a_model_sharded_across_ranks():
    """An FSDP2 model handed to the Dask executor is refused by name before anything ships:
    a worker would receive only this rank's shards (world size 1, gloo, in a subprocess)."""
    pytest.importorskip("distributed")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.join(os.path.dirname(__file__), "dist_scripts", "dask_refuses_sharded.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, script, str(port)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED:" in proc.stdout and "TorchDistributed" in proc.stdout, proc.stdout[-2000:]
