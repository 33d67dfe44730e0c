"""Dask workers that build or load the model themselves (``DaskExecutor(model_fn=...)``):
results equal the pickled-model path and the local executor, the client may hold the model
on the meta device, a worker that has other weights is refused, each worker builds once,
and the one-worker-per-GPU cluster pins ``CUDA_VISIBLE_DEVICES`` per worker.
One 2-process LocalCluster serves the module."""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import dask_model_factories as factories  # noqa: E402
import models  # noqa: E402

import gradalg as ga  # noqa: E402
from gradalg.errors import ModelMismatchError  # noqa: E402
from gradalg.exec.models import (WorkerModel, as_worker_model, forget_worker_models, is_meta_model,  # noqa: E402
                                 model_structure, worker_model_builds)
from gradalg.fingerprint import model_digest  # noqa: E402

distributed = pytest.importorskip("distributed")

pytestmark = pytest.mark.slow

MIN_SHARD = 8     # the 5-query passes stay on the client; the training passes make 4 shards


@pytest.fixture(scope="module")
def client():
    """Two worker processes, one per (pinned) device: the cluster ``ga.exec.gpu_cluster``
    starts on a machine with two GPUs and no dask-cuda; on this CPU machine each worker's
    model lands on the CPU."""
    from distributed import Client

    cluster = ga.exec.gpu_cluster(["0", "1"], use_dask_cuda=False)
    c = Client(cluster)
    c.wait_for_workers(2)
    yield c
    c.close()
    cluster.close()


def _executor(client, **kw):
    return ga.exec.DaskExecutor(client, min_shard_examples=MIN_SHARD, **kw)


def _mlp_setting(model):
    X, y = models.classification_data(n=48)
    return ga.tasks.classification(model), (X, y), (X[:5], y[:5])


def _gpt2_setting(model):
    ids, mask = models.padded_token_data(n=24, vocab=101)
    rows = [{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask)]
    return ga.tasks.causal_lm(model), rows, rows[:5]


def _methods(task, train, queries):
    yield "grad_dot", ga.methods.grad_dot(task, train, queries)
    yield "influence_ekfac", ga.methods.influence(task, train, queries, curvature="ekfac", damping=0.1)


SETTINGS = {
    "mlp": (WorkerModel("dask_model_factories:mlp", seed=0), _mlp_setting),
    "gpt2": (WorkerModel("dask_model_factories:gpt2", seed=0), _gpt2_setting),
}


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_a_factory_gives_the_pickled_and_the_local_results(client, name):
    spec, setting = SETTINGS[name]
    task, train, queries = setting(spec.build())
    meta_task, _, _ = setting(spec.meta())
    assert is_meta_model(meta_task.model) and model_structure(meta_task.model) == model_structure(task.model)
    with ga.options(progress=False):
        pickled, built, meta = _executor(client), _executor(client, model_fn=spec), _executor(client, model_fn=spec)
        for (method, S), (_, S_meta) in zip(_methods(task, train, queries), _methods(meta_task, train, queries)):
            local = S.compute().values
            for how, ex, expr in (("pickled", pickled, S), ("factory", built, S), ("meta client", meta, S_meta)):
                np.testing.assert_allclose(expr.compute(executor=ex).values, local, rtol=1e-9, atol=1e-12,
                                           err_msg=f"{name} {method} {how}")
    # tiny passes stay on the client when it holds the weights; a meta client ships them too
    assert not any(t["pass"].endswith("(5 examples)") for t in built.transfers)
    assert any(t["pass"].endswith("(5 examples)") for t in meta.transfers)
    # the reference is smaller than the model it stands for
    weights = sum(p.numel() * p.element_size() for p in task.model.parameters())
    assert [t["pass"] for t in built.transfers] == [t["pass"] for t in pickled.transfers]
    for by_ref, by_pickle in zip(built.transfers, pickled.transfers):   # the rest: jobs and held rows
        assert by_pickle["payload_bytes"] - by_ref["payload_bytes"] >= weights


def test_each_worker_builds_the_model_once(client):
    before = client.run(factories.calls)
    spec = WorkerModel("dask_model_factories:mlp", seed=0, hidden=12)      # a key no other test builds
    task, train, queries = _mlp_setting(spec.build())
    with ga.options(progress=False):
        dx = _executor(client, model_fn=spec)
        for _, S in _methods(task, train, queries):
            S.compute(executor=dx)
    shards = sum(len(t["result_bytes"]) for t in dx.transfers)
    after = client.run(factories.calls)
    builds = {w: after[w].get("mlp", 0) - before.get(w, {}).get("mlp", 0) for w in after}
    assert shards >= 3 * len(after)                            # several shards per worker ran ...
    assert sum(builds.values()) >= 1 and max(builds.values()) == 1   # ... on one build per worker
    keys = client.run(worker_model_builds)
    assert all(counts.get(spec.key, 0) <= 1 for counts in keys.values())


def test_a_worker_with_other_weights_is_refused(client):
    spec = WorkerModel("dask_model_factories:mlp", seed=0)
    task, train, queries = _mlp_setting(models.mlp(seed=1))        # the client trained / seeded otherwise
    expected, built = model_digest(task.model), model_digest(spec.build())
    with ga.options(progress=False), pytest.raises(ModelMismatchError) as err:
        ga.methods.grad_dot(task, train, queries).compute(executor=_executor(client, model_fn=spec, retries=0))
    assert expected in str(err.value) and built in str(err.value) and "different weights" in str(err.value)


def test_a_worker_with_another_architecture_is_refused(client):
    spec = WorkerModel("dask_model_factories:mlp", seed=0, hidden=16)
    task, train, queries = _mlp_setting(WorkerModel("dask_model_factories:mlp", hidden=10).meta())
    with ga.options(progress=False), pytest.raises(ModelMismatchError, match="architecture") as err:
        ga.methods.grad_dot(task, train, queries).compute(executor=_executor(client, model_fn=spec, retries=0))
    assert "(10, 8)" in str(err.value) and "(16, 8)" in str(err.value)     # the differing weight shapes


def test_workers_that_build_different_weights_are_refused(client):
    """A meta client cannot check the weights: every build must give the weights the first
    one gave (a factory without a seed, or a checkpoint rewritten in place, does not)."""
    spec = WorkerModel("dask_model_factories:fresh_mlp")
    task, train, queries = _mlp_setting(spec.meta())
    S = ga.methods.grad_dot(task, train, queries)
    with ga.options(progress=False):
        dx = _executor(client, model_fn=spec, retries=0)
        client.run(factories.set_seed, 1)
        S.compute(executor=dx)
        client.run(forget_worker_models)
        client.run(factories.set_seed, 2)              # every worker now builds other weights
        dx.reset()
        with pytest.raises(ModelMismatchError, match="workers built different weights") as err:
            S.compute(executor=dx)
    assert model_digest(models.mlp(seed=1)) in str(err.value) and model_digest(models.mlp(seed=2)) in str(err.value)


def test_a_declared_fingerprint_is_checked(client):
    model = models.mlp(seed=0)
    task, train, queries = _mlp_setting(model)
    wrong = WorkerModel("dask_model_factories:mlp", seed=0, fingerprint=model_digest(models.mlp(seed=3)))
    with ga.options(progress=False), pytest.raises(ModelMismatchError, match="declares"):
        ga.methods.grad_dot(task, train, queries).compute(executor=_executor(client, model_fn=wrong))
    # a meta client with the right declared fingerprint: the workers check against it
    right = WorkerModel("dask_model_factories:mlp", seed=0, fingerprint=model_digest(model))
    meta_task, _, _ = _mlp_setting(right.meta())
    with ga.options(progress=False):
        got = ga.methods.grad_dot(meta_task, train, queries).compute(executor=_executor(client, model_fn=right))
    np.testing.assert_allclose(got.values, ga.methods.grad_dot(task, train, queries).compute().values, rtol=1e-9)


def test_a_meta_model_without_a_factory_is_refused(client):
    task, train, queries = _mlp_setting(WorkerModel("dask_model_factories:mlp").meta())
    with ga.options(progress=False), pytest.raises(ModelMismatchError, match="model_fn"):
        ga.methods.grad_dot(task, train, queries).compute(executor=_executor(client))


def test_explain_says_how_the_model_travels(client):
    spec = WorkerModel("dask_model_factories:mlp", seed=0)
    meta_task, train, queries = _mlp_setting(spec.meta())
    text = str(ga.methods.grad_dot(meta_task, train, queries).explain(executor=_executor(client, model_fn=spec)))
    assert "a reference to the model" in text and "runs on the client (5 examples" not in text
    task, _, _ = _mlp_setting(spec.build())
    text = str(ga.methods.grad_dot(task, train, queries).explain(executor=_executor(client)))
    assert "the model (" in text and "runs on the client (5 examples" in text


def test_checkpoints_load_on_the_workers(client, tmp_path):
    """A Hugging Face directory (``model_fn=path``) and a torch state dict."""
    gpt2 = models.gpt2(n_layer=2, n_embd=32, seed=4)
    gpt2.save_pretrained(tmp_path / "hf")
    task, train, queries = _gpt2_setting(gpt2)
    spec = as_worker_model(str(tmp_path / "hf"))                   # the class named by the config
    meta_task, _, _ = _gpt2_setting(spec.meta())
    S, S_meta = ga.methods.grad_dot(task, train, queries), ga.methods.grad_dot(meta_task, train, queries)
    with ga.options(progress=False):
        local = S.compute().values
        np.testing.assert_allclose(S_meta.compute(executor=_executor(client, model_fn=spec)).values, local,
                                   rtol=1e-9, atol=1e-12)
        as_float32 = WorkerModel.from_pretrained(tmp_path / "hf", dtype=torch.float32)
        with pytest.raises(ModelMismatchError, match="architecture"):   # loaded in float32: not the client's
            S.compute(executor=_executor(client, model_fn=as_float32, retries=0))

    mlp = models.mlp(seed=7)
    torch.save(mlp.state_dict(), tmp_path / "mlp.pt")
    task, train, queries = _mlp_setting(mlp)
    spec = WorkerModel.from_state_dict(tmp_path / "mlp.pt", "dask_model_factories:mlp", seed=0)
    S = ga.methods.grad_dot(task, train, queries)
    with ga.options(progress=False):
        np.testing.assert_allclose(S.compute(executor=_executor(client, model_fn=spec)).values, S.compute().values,
                                   rtol=1e-9, atol=1e-12)
    with pytest.raises(TypeError, match="from_state_dict"):
        as_worker_model(str(tmp_path / "mlp.pt"))


def test_results_name_the_model_instead_of_carrying_it():
    """What a shard returns (rows point at their task, hence the model) pickles the
    worker's model as a key that resolves to the client's model; GPU tensors would come
    back on the CPU."""
    from gradalg.exec.models import pack, register_client_model, to_client, unpack

    worker_model, client_model = models.gpt2(n_layer=2, n_embd=32), models.gpt2(n_layer=2, n_embd=32)
    task = models.lm_task(worker_model)
    rows = torch.randn(3, 5, dtype=torch.float64)
    plain = pack((task, rows))
    named = pack((task, rows), [to_client(worker_model, "key-1")], to_cpu=True)
    weights = sum(p.numel() * p.element_size() for p in worker_model.parameters())
    assert len(plain) > weights > 20 * len(named)
    register_client_model("key-1", client_model)
    back_task, back_rows = unpack(named)
    assert back_task.model is client_model and torch.equal(back_rows, rows)


def test_the_factory_key_follows_its_arguments():
    a = WorkerModel("dask_model_factories:mlp", seed=0)
    assert a.key == WorkerModel("dask_model_factories:mlp", seed=0).key
    assert a.key != WorkerModel("dask_model_factories:mlp", seed=1).key
    assert a.key != WorkerModel("dask_model_factories:gpt2", seed=0).key
    assert WorkerModel(factories.mlp, seed=0).key != WorkerModel(factories.gpt2, seed=0).key


def test_one_model_fn_for_two_models_is_refused(client):
    from gradalg.errors import OptionError

    X, y = models.classification_data(n=48)
    t1, t2 = ga.tasks.classification(models.mlp(seed=0)), ga.tasks.classification(models.mlp(seed=1))
    S = ga.methods.trak([t1, t2], (X, y), (X[:5], y[:5]), k=8)
    one = _executor(client, model_fn=WorkerModel("dask_model_factories:mlp", seed=0))
    with ga.options(progress=False):
        ga.methods.grad_dot(t1, (X, y), (X[:5], y[:5])).compute(executor=one)     # binds the factory to t1's model
        with pytest.raises(OptionError, match="dict"):
            S.compute(executor=one)
    specs = {t1.model: WorkerModel("dask_model_factories:mlp", seed=0),
             t2.model: WorkerModel("dask_model_factories:mlp", seed=1)}
    with ga.options(progress=False):
        np.testing.assert_allclose(S.compute(executor=_executor(client, model_fn=specs)).values, S.compute().values,
                                   rtol=1e-9, atol=1e-12)


def test_the_gpu_cluster_pins_one_device_per_worker(client):
    specs = ga.exec.pinned_worker_specs(["0", "1"], threads_per_worker=1)
    assert [s["options"]["env"]["CUDA_VISIBLE_DEVICES"] for s in specs.values()] == ["0", "1"]
    with pytest.raises(ValueError, match="distinct"):
        ga.exec.pinned_worker_specs(["0", "0"])
    envs = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
    assert sorted(envs.values()) == ["0", "1"]
    from gradalg.exec.models import worker_device
    devices = client.run(lambda: str(worker_device()))
    if not torch.cuda.is_available():
        assert set(devices.values()) == {"cpu"}


def test_visible_gpus_reads_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert ga.exec.visible_gpus() == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert ga.exec.visible_gpus() == []
