"""The Loader under faults and at its edges, with real worker processes.

Failure classes: off-by-one at an epoch boundary; uneven shards hanging distributed training;
tokenizer deadlocks under fork; Ctrl-C during iteration; memory that grows over a long run.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import take, write_jsonl, write_positional_store
from faults.conftest import (SIZE, add, assert_exits_promptly, assert_nothing_left, child_env,
                             press_ctrl_c, program, record)
from tokenmill import Loader

L = 8


def store_with(tmp_path, n_samples: int, shard_tokens: int, seed: int):
    """A positional store (token = global position) of exactly n_samples concat samples."""
    rng = np.random.default_rng(seed)
    total = (n_samples + 1) * L + int(rng.integers(0, L))  # (T - L) // L == n_samples
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(rng.integers(1, 3 * L)))
    lengths[-1] -= sum(lengths) - total
    if lengths[-1] == 0:
        lengths.pop()
    return write_positional_store(tmp_path / f"s{n_samples}-{seed}", lengths,
                                  shard_tokens=shard_tokens)


@pytest.mark.parametrize("n,batch,world", [(48, 4, 2), (49, 4, 2), (47, 4, 2), (53, 2, 3)])
def test_epoch_boundary_no_off_by_one(tmp_path, n, batch, world):
    """Every sample of an epoch exactly once, the remainder dropped at the end only, the next
    epoch complete and re-shuffled, the same number of steps on every rank, and resume exact at
    every step around the boundary — through worker processes."""
    store = store_with(tmp_path, n, shard_tokens=37, seed=n * 10 + batch)
    gb = batch * world

    def make(rank, workers=1, **kw):
        return Loader(store, seq_len=L, batch_size=batch, rank=rank, world_size=world, seed=4,
                      num_workers=workers, worker_type="process", **kw)

    per_rank = []
    for r in range(world):
        with make(r, epochs=2) as ld:
            assert ld.samples_per_epoch == n and len(ld) == n // gb
            assert ld.total_steps == 2 * n // gb
            per_rank.append([b["inputs"] for b in take(ld)])
    assert {len(x) for x in per_rank} == {2 * n // gb}  # every rank, the same steps
    # global order: step s holds rank 0's rows, then rank 1's, …
    starts = np.concatenate([np.concatenate([per_rank[r][s][:, 0] for r in range(world)])
                             for s in range(2 * n // gb)])
    for row in np.concatenate([x for rows in per_rank for x in rows]):
        assert np.array_equal(row, np.arange(row[0], row[0] + L))  # whole windows
    offsets = [int(starts[0]) % L, int(starts[n]) % L]
    epoch0, epoch1 = starts[:n], starts[n:]
    assert sorted(epoch0.tolist()) == [offsets[0] + L * i for i in range(n)]  # all, once
    assert len(set(epoch1.tolist())) == len(epoch1) and all(s % L == offsets[1] for s in epoch1)
    assert len(starts) == 2 * n - (2 * n) % gb  # what is dropped: the last samples only
    # resume at every step within two global batches of the boundary, in a fresh loader
    with make(0, workers=0, epochs=None) as ref_ld:
        ref = [b["inputs"] for b in take(ref_ld, (n + 3 * gb) // gb)]
    for step in range(max(0, n // gb - 2), n // gb + 2):
        with make(0, workers=0, epochs=None) as a:
            take(a, step)
            state = json.loads(json.dumps(a.state_dict()))
        assert state["consumed_samples"] == step * gb
        # the step that starts the next epoch resumes in a loader with a worker process
        with make(0, workers=int(step == n // gb), epochs=None) as b:
            b.load_state_dict(state)
            tail = [x["inputs"] for x in take(b, 3)]
        assert all(np.array_equal(x, y) for x, y in zip(tail, ref[step:step + 3]))
    add("epoch boundary", "cases", 1)
    add("epoch boundary", "resumes_checked", 4)


def test_uneven_shards_never_hang_distributed_training(tmp_path):
    """Three ranks in their own processes on a store whose shards differ 1,000-fold; each step
    is a barrier, as a collective would be: a rank with one step more would wait forever."""
    lengths = [3] * 5 + [6_000] + [7, 1] * 20 + [900] * 3 + [5]
    store = write_positional_store(tmp_path / "uneven", lengths, shard_tokens=50)
    shards = [s["num_tokens"] for s in json.loads((store / "manifest.json").read_text())["shards"]]
    assert max(shards) >= 1000 * min(shards)
    args = {"store": str(store), "seq_len": 16, "batch_size": 5, "seed": 2, "world_size": 3,
            "epochs": 1, "timeout": 30}
    t0 = time.monotonic()
    done = subprocess.run(program("ranks", json.dumps(args)), env=child_env(tmp_path / "tmp"),
                          capture_output=True, text=True, timeout=240)
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["exitcodes"] == [0, 0, 0], done.stderr[-3000:]
    steps = {r: v["steps"] for r, v in out["ranks"].items()}
    with Loader(store, seq_len=16, batch_size=5, rank=0, world_size=3) as ld:
        assert set(steps.values()) == {len(ld)}
        n = ld.samples_per_epoch
    firsts = [x for v in out["ranks"].values() for x in v["firsts"]]
    assert len(firsts) == len(set(firsts)) == 3 * 5 * (n // 15)  # disjoint, each once
    record("uneven shards", ranks=3, shard_size_ratio=max(shards) // min(shards),
           steps_per_rank=len(ld), hangs=0, seconds=round(took, 1))


def test_tokenizer_used_before_worker_processes_start_never_deadlocks(tmp_path, bpe_tokenizer,
                                                                      real_texts):
    """A Hugging Face tokenizer busy on its thread pool in the parent, then prepare's and the
    Loader's worker pools: forked children could inherit its locks held; every worker is a fresh
    ``python -m tokenmill.base.child`` (no fork without exec, no multiprocessing child), so none can."""
    (tmp_path / "t.txt").write_text(real_texts[0])
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "c.jsonl", real_texts[:60])
    args = {"tokenizer": bpe_tokenizer, "text": str(tmp_path / "t.txt"),
            "inputs": [str(tmp_path / "in")], "out": str(tmp_path / "out")}
    env = child_env(tmp_path / "tmp", TOKENIZERS_PARALLELISM="true")
    t0 = time.monotonic()
    done = subprocess.run(program("tokenize_then_start_workers", json.dumps(args)), env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["done"]
    for stage in ("prepare", "loader"):
        children = out[stage]
        assert len(children) == 2, (stage, children)  # its two workers, and nothing else
        for cmd in children:
            # exec'd: a fork of this program would show the program's own command line
            assert cmd != out["parent"] and cmd[1:3] == ["-m", "tokenmill.base.child"], (stage, cmd)
    assert "fork" not in done.stderr.lower(), done.stderr  # tokenizers warns after a fork
    record("tokenizer and fork", deadlocks=0, children=4, forked=0,
           child_start="exec python -m tokenmill.base.child", seconds=round(time.monotonic() - t0, 1))


def test_ctrl_c_during_iteration_exits_promptly_and_leaves_nothing_behind(tmp_path):
    store = write_positional_store(tmp_path / "s", np.full(400, 300), shard_tokens=20_000)
    rng = random.Random(6)
    exits = []
    for i in range(SIZE.interrupts):
        tmp = tmp_path / f"tmp{i}"
        args = {"source": str(store), "seq_len": 256, "batch_size": 16,
                "layout": ("concat", "packed")[i % 2], "num_workers": 2, "step_s": 0.002}

        def ready(proc):
            assert proc.stdout.readline().strip() == "ready"
        hit = press_ctrl_c(program("iterate", json.dumps(args)), child_env(tmp), ready=ready,
                           delay=rng.uniform(0, 0.5))
        exits.append(hit.seconds)
        assert_exits_promptly(hit)
        assert hit.code in (-signal.SIGINT, 1, 130), hit.err
        # the user's own traceback, once: no worker prints one
        assert hit.err.count("Traceback") == 1 and "KeyboardInterrupt" in hit.err, hit.err
        assert_nothing_left(hit.kids, hit.shm, tmp)
    record("Ctrl-C loader", interrupts=SIZE.interrupts, slowest_exit_s=round(max(exits), 2),
           left_behind=0)


def test_long_run_rss_stays_flat(tmp_path):
    """SIZE.soak_batches batches through 2 worker processes: memory (this process and its
    workers) after warm-up stays flat."""
    rng = np.random.default_rng(3)
    store = write_positional_store(tmp_path / "s", rng.integers(1, 500, size=4_000),
                                   shard_tokens=100_000)
    args = {"store": str(store), "seq_len": 128, "batch_size": 8, "layout": "packed",
            "num_workers": 2, "batches": SIZE.soak_batches, "samples": 100}
    done = subprocess.run(program("rss", json.dumps(args)), env=child_env(tmp_path / "tmp"),
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    series = [rss for _, rss in out["series"]]
    warm = series[len(series) // 4]  # after a quarter of the run: buffers and caches in place
    end = series[-1]
    peak_after_warm = max(series[len(series) // 4:])
    epochs = SIZE.soak_batches / out["steps_per_epoch"]
    growth = end - warm
    record("RSS soak", batches=SIZE.soak_batches, epochs=round(epochs, 1),
           rss_start_mib=round(warm / 2**20, 1), rss_end_mib=round(end / 2**20, 1),
           rss_peak_mib=round(peak_after_warm / 2**20, 1), growth_mib=round(growth / 2**20, 2),
           batches_per_s=round(SIZE.soak_batches / out["seconds"]))
    assert growth < max(4 << 20, warm // 50), f"RSS grew {growth / 2**20:.1f} MiB"
    assert peak_after_warm - warm < max(8 << 20, warm // 25)
