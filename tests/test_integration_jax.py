"""JAX integration: global arrays over a 4-device CPU mesh, in one process and across two.

XLA reads XLA_FLAGS once, when JAX starts its backend, so the checks run in fresh interpreters:
this file is also the script they run (``python test_integration_jax.py MODE STORE ...``).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve()
L, B = 8, 2  # per-rank batch B; global batch 4·B over a mesh of 4 devices


def run(mode, *args, devices):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(HERE), mode, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{proc.args} failed:\n{err[-4000:]}"
    return out.strip().splitlines()[-1]  # the report; gloo prints its own lines before it


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from conftest import write_positional_store
    rng = np.random.default_rng(3)
    return write_positional_store(tmp_path_factory.mktemp("j") / "store",
                                  rng.integers(1, 50, size=80), shard_tokens=500)


def test_global_array_is_the_ranks_batches_in_order_and_trains(store):
    report = json.loads(finish(run("single", store, devices=4)))
    assert report["steps"] == 12 and report["losses_finite"]
    assert report["loss_went_down"]


def test_two_processes_make_one_global_array(store):
    with socket.socket() as s:  # a free port on the loopback for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [run("multi", store, port, pid, devices=2) for pid in (0, 1)]
    reports = [json.loads(finish(p)) for p in procs]
    assert [r["process"] for r in reports] == [0, 1]
    assert reports[0]["sums"] == reports[1]["sums"]  # one global reduction, seen by both


def test_a_seq_len_schedule_is_refused_naming_it(store):
    """to_jax makes one global shape: a Loader whose batches change shape at each phase is a
    one-line ConfigError (before any device or sharding is touched)."""
    from tokenmill.base.errors import ConfigError
    from tokenmill.integrations.jax import to_jax
    from tokenmill.load.loader import Loader
    with Loader(store, seq_len_schedule=[(0, 8), (2, 16)], tokens_per_step=64) as ld:
        with pytest.raises(ConfigError, match=r"to_jax needs one batch shape, but this Loader "
                           r"has seq_len_schedule=\[\[0, 8\], \[2, 16\]\]"):
            to_jax(ld, None)


# ---- the guide's example runs as written ---------------------------------------------------

def test_guide_example_runs(tmp_path):
    """docs/guide-jax.md's python blocks, in order, as one script in an empty directory."""
    from conftest import run_guide  # lazily, as above: this file is a script too
    done = run_guide("guide-jax.md", tmp_path, drop_env=("XLA_FLAGS",))
    assert "loss after 20 steps" in done.stdout


# ---- what runs in the fresh interpreters ---------------------------------------------------

def expected_global(store, step, **kw):
    """Global batch of `step`: the concatenation of the 4 ranks' own batches."""
    from tokenmill.load.loader import Loader
    parts = [Loader(store, seq_len=L, batch_size=B, rank=r, world_size=4, **kw).batch_at(step * 4 * B)
             for r in range(4)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def single(store):
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from tokenmill.base.errors import ConfigError
    from tokenmill.integrations.jax import to_jax
    from tokenmill.load.loader import Loader

    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    loader = Loader(store, seq_len=L, batch_size=4 * B, layout="packed", seed=5, num_workers=2)
    batches = to_jax(loader, sharding, depth=3)
    assert batches.global_shape == (4 * B, L)

    V, D = 64, 16
    params = {"emb": jax.random.normal(jax.random.key(0), (V, D)) * 0.1,
              "out": jax.random.normal(jax.random.key(1), (D, V)) * 0.1}

    @jax.jit
    def train_step(params, batch):
        def loss_fn(p):
            logits = p["emb"][batch["inputs"] % V] @ p["out"]
            logp = jax.nn.log_softmax(logits)
            nll = -jnp.take_along_axis(logp, (batch["targets"] % V)[..., None], -1)[..., 0]
            mask = batch["loss_mask"].astype(jnp.float32)
            return (nll * mask).sum() / jnp.maximum(mask.sum(), 1)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.5 * g, params, grads), loss

    held, losses = [], []
    for step, batch in zip(range(12), batches):
        want = expected_global(store, step, layout="packed", seed=5)
        for k, arr in batch.items():
            assert arr.sharding == sharding and arr.shape == (4 * B, L)
            for shard in arr.addressable_shards:  # device d holds rank d's rows
                rank = shard.index[0].start // B
                assert shard.device == mesh.devices[rank]
        held.append((want, batch))
        params, loss = train_step(params, batch)
        losses.append(float(loss))
    for want, batch in held:  # still intact after the loader went 12 steps on: no early reuse
        for k in want:
            np.testing.assert_array_equal(np.asarray(batch[k]), want[k])

    state = batches.state_dict()  # in-flight batches are not counted
    assert state["consumed_samples"] == 12 * 4 * B
    fresh = to_jax(Loader(store, seq_len=L, batch_size=4 * B, layout="packed", seed=5), sharding)
    fresh.load_state_dict(state)
    np.testing.assert_array_equal(np.asarray(next(iter(fresh))["inputs"]),
                                  expected_global(store, 12, layout="packed", seed=5)["inputs"])

    try:  # a loader that claims another rank's rows is refused
        to_jax(Loader(store, seq_len=L, batch_size=B, rank=1, world_size=4), sharding)
        raise AssertionError("a rank/sharding mismatch was not refused")
    except ConfigError as e:
        assert "rows [0, 8)" in str(e) and "rows [2, 4)" in str(e), e
    print(json.dumps({"steps": len(held), "losses_finite": bool(np.isfinite(losses).all()),
                      "loss_went_down": losses[-1] < losses[0]}))


def multi(store, port, pid):
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from tokenmill.integrations.jax import to_jax
    from tokenmill.load.loader import Loader

    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    loader = Loader(store, seq_len=L, batch_size=2 * B, seed=7,
                    rank=jax.process_index(), world_size=jax.process_count())
    row_sums = jax.jit(lambda x: x.astype("int64").sum(axis=1),
                       out_shardings=NamedSharding(mesh, P()))  # gathers every row
    sums = []
    for step, batch in zip(range(4), to_jax(loader, sharding)):
        assert batch["inputs"].shape == (4 * B, L)
        for shard in batch["inputs"].addressable_shards:
            want = expected_global(store, step, seed=7)["inputs"][shard.index]
            np.testing.assert_array_equal(np.asarray(shard.data), want)
        got = np.asarray(row_sums(batch["inputs"]))
        np.testing.assert_array_equal(got, expected_global(store, step, seed=7)["inputs"].sum(1))
        sums.append(got.tolist())
    print(json.dumps({"process": jax.process_index(), "sums": sums}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    mode, store_path, *rest = sys.argv[1:]
    if mode == "single":
        single(Path(store_path))
    else:
        multi(Path(store_path), int(rest[0]), int(rest[1]))
