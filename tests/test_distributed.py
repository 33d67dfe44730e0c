"""DDP, FSDP2 (``fully_shard``) and FSDP1 under ``torchrun --nproc_per_node 2`` with gloo on CPU.

One launch of ``tests/dist_scripts/parallel_capture.py`` runs every case (a launch costs
seconds of start-up); each test below reports one case:

- capture: each rank's per-example gradients equal the torch.func oracle on its shard,
  and ``ga.integrations.gather`` gives one GradientSet equal to a single-process capture
  of the global batches (DDP with sum and mean losses, FSDP2 on an MLP and a GPT-2, FSDP1);
- online selection: the corrected step gradient on every rank equals a fresh backward
  over the kept examples of the global batch (DDP, FSDP2 with batch-mean and validation
  targets, GPT-2 under FSDP2 with every LayerNorm corrected), with the same scores and
  choices as a single-process selection;
- HF ``Trainer`` under torchrun (DDP on CPU): the callback's rows (``scale="loss"``) equal
  ``ga.capture`` around a plain replay of each rank's micro-batches.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

from torchrun import run_cases   # tests/ is on sys.path (conftest)

CASES = ["ddp_sum", "ddp_mean", "fsdp2", "fsdp2_gpt2", "fsdp1", "ddp_selection", "fsdp2_selection",
         "fsdp2_selection_validation_target", "fsdp2_selection_gpt2_layernorms", "hf_trainer_ddp"]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("transformers")
    return run_cases("parallel_capture.py", tmp_path_factory.mktemp("dist") / "results.json", timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_parallel_equals_single_process(results, case):
    assert case in results, f"the script did not run {case}"
    assert results[case] == "ok", results[case]
