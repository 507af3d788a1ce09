"""Loader: exact batches on self-describing stores, resume, ranks, mixtures, workers, lifetime."""

import gc
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import (assert_resumes_exactly, assert_worker_death_is_an_error, same,
                      stdlib_texts, take, write_jsonl, write_positional_store)
from tokenmill.load import plan as plan_mod
from tokenmill import prepare
from tokenmill.base.errors import ConfigError, StoreError
from tokenmill.load.loader import MAX_PREFETCH, Loader, StaleIterator

L = 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Documents of varied lengths, token = global position, over several shards."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 60, size=200)
    k = -(-int(lengths.sum()) // (48 * L))  # total = (48k + 1)·L tokens: 48k concat samples
    lengths[-1] += (48 * k + 1) * L - lengths.sum()
    return write_positional_store(tmp_path_factory.mktemp("s") / "store", lengths, shard_tokens=1500)


@pytest.fixture(scope="module")
def store_b(tmp_path_factory):
    rng = np.random.default_rng(8)
    return write_positional_store(tmp_path_factory.mktemp("b") / "store",
                                  rng.integers(5, 40, size=120), shard_tokens=800, offset=10**8)


def test_concat_windows_are_contiguous_with_shifted_targets(store):
    with Loader(store, seq_len=L, batch_size=4, seed=0, rank=0, world_size=1) as loader:
        for b in take(loader, 30):
            assert b["inputs"].dtype == np.int32 and b["inputs"].shape == (4, L)
            for row_in, row_tg in zip(b["inputs"], b["targets"]):
                assert np.array_equal(row_in, np.arange(row_in[0], row_in[0] + L))
                assert np.array_equal(row_tg, row_in + 1)


def test_golden_first_batches_seed_0(store):
    # Only update if you mean to break users' reproducibility: these pin the order for seed 0.
    with Loader(store, seq_len=L, batch_size=4, seed=0, rank=0, world_size=1) as loader:
        firsts = [b["inputs"][:, 0].tolist() for b in take(loader, 3)]
    assert firsts == GOLDEN_FIRSTS


# seed 0, seq_len 16, batch 4: the first token of every row of the first three batches
GOLDEN_FIRSTS = [[4611, 3971, 3075, 5203], [1731, 3587, 1091, 3827], [6067, 2691, 2115, 835]]


def test_cut_points_move_each_epoch(store):
    with Loader(store, seq_len=L, batch_size=4, seed=0, rank=0, world_size=1) as loader:
        n = loader.samples_per_epoch
        starts = [set(), set()]
        for pos in range(0, 2 * n, 4):
            b = loader.batch_at(pos)
            starts[pos // n].update((b["inputs"][:, 0] % L).tolist())
    assert len(starts[0]) == 1 and len(starts[1]) == 1 and starts[0] != starts[1]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ranks_partition_an_epoch_exactly(store, world):
    B = 2
    loaders = [Loader(store, seq_len=L, batch_size=B, rank=r, world_size=world, seed=3)
               for r in range(world)]
    n = loaders[0].samples_per_epoch
    assert n % (B * world) == 0
    steps = n // (B * world)
    assert all(len(ld) == steps for ld in loaders)
    seen = []
    for ld in loaders:
        seen += [int(x) for b in take(ld, steps) for x in b["inputs"][:, 0]]
        ld.close()
    assert len(seen) == n and len(set(seen)) == n  # disjoint and complete
    offset = seen[0] % L
    assert sorted(seen) == [offset + i * L for i in range(n)]


def test_elastic_resume_from_4_to_2_ranks(store):
    def global_batches(world, batch, start, steps):
        per_rank = []
        for r in range(world):
            with Loader(store, seq_len=L, batch_size=batch, rank=r, world_size=world, seed=5) as ld:
                ld.load_state_dict({**ld.state_dict(), "consumed_samples": start})
                per_rank.append(take(ld, steps))
        return [np.concatenate([per_rank[r][s]["inputs"] for r in range(world)])
                for s in range(steps)]

    uninterrupted = global_batches(4, 2, 0, 30)
    with Loader(store, seq_len=L, batch_size=2, rank=0, world_size=4, seed=5) as ld:
        take(ld, 11)
        state = ld.state_dict()
    resumed = global_batches(2, 4, state["consumed_samples"], 19)
    assert all(np.array_equal(a, b) for a, b in zip(uninterrupted[11:], resumed))


@pytest.mark.parametrize("layout", ["concat", "packed"])
def test_resumes_exactly_at_every_step_across_epochs(store, layout):
    probe = Loader(store, seq_len=L, batch_size=8, layout=layout, rank=0, world_size=1)
    steps = len(probe) + 5  # crosses an epoch boundary
    probe.close()
    assert_resumes_exactly(lambda: Loader(store, seq_len=L, batch_size=8, layout=layout, seed=1,
                                          rank=0, world_size=1), steps)


def test_mixture_resumes_exactly(store, store_b):
    assert_resumes_exactly(lambda: Loader({store: 0.7, store_b: 0.3}, seq_len=L, batch_size=4,
                                          seed=2, rank=0, world_size=1), 40)


def test_mixture_proportions_within_one_on_every_prefix(store, store_b):
    with Loader({store: 0.7, store_b: 0.3}, seq_len=L, batch_size=5, seed=0, rank=0,
                world_size=1) as ld:
        from_b = np.concatenate([b["inputs"][:, 0] >= 10**8 for b in take(ld, 200)])
        assert ld.layout_stats["mixture_weights"] == pytest.approx([0.7, 0.3])
    counts = np.cumsum(from_b)
    n = np.arange(1, len(from_b) + 1)
    assert np.all(np.abs(counts - 0.3 * n) <= 1)
    assert np.all(np.abs((n - counts) - 0.7 * n) <= 1)


def test_packed_rows_agree_with_documents(store):
    from tokenmill.store import TokenStore
    ts = TokenStore(store)
    starts, lengths = ts.doc_spans(np.arange(len(ts)))
    with Loader(store, seq_len=L, batch_size=1, layout="packed", rank=0, world_size=1) as ld:
        stats = ld.layout_stats
        assert 0 <= stats["padding_at_most"] < 0.5
        pairs, split_short = [], set()
        for b in take(ld, len(ld)):  # batch 1: one epoch of steps = every row once
            for r in range(1):
                inp, tgt, seg = b["inputs"][r], b["targets"][r], b["segment_ids"][r]
                pos, mask = b["positions"][r], b["loss_mask"][r]
                for s in np.unique(seg[seg > 0]):
                    cols = np.flatnonzero(seg == s)
                    toks = inp[cols]
                    doc = int(np.searchsorted(starts, toks[0], side="right") - 1)
                    # a segment is consecutive tokens of one document, positions restart at 0
                    assert np.array_equal(toks, np.arange(toks[0], toks[0] + len(cols)))
                    assert toks[-1] < starts[doc] + lengths[doc]
                    assert np.array_equal(pos[cols], np.arange(len(cols)))
                    if lengths[doc] <= L and not (toks[0] == starts[doc] and
                                                  len(cols) >= lengths[doc] - 1):
                        split_short.add(doc)  # a short document cut to fit its window's rows
                    m = cols[mask[cols] == 1]
                    assert np.array_equal(tgt[m], inp[m] + 1)
                    pairs += zip(inp[m].tolist(), tgt[m].tolist())
                assert not mask[seg == 0].any()
        assert len(split_short) <= ld.layout_stats["documents_cut"]  # each one counted
        # every within-document (input, target) pair appears (one epoch of rows = every row once)
    want = sum(int(n) - 1 for n in lengths)
    assert len(pairs) >= want - len(ld) * 0  # (rows dropped by batching would show here)


@pytest.mark.parametrize("workers,kind", [(0, "thread"), (1, "thread"), (4, "thread"),
                                          (1, "process"), (2, "process")])
def test_identical_batches_for_any_worker_setting(store, workers, kind):
    def run(w, k):
        with Loader(store, seq_len=L, batch_size=4, layout="packed", num_workers=w, worker_type=k,
                    rank=0, world_size=1, seed=9) as ld:
            return take(ld, 25)
    assert same(run(workers, kind), run(0, "thread"))


def test_kept_batches_are_never_overwritten(store):
    with Loader(store, seq_len=L, batch_size=4, num_workers=2, rank=0, world_size=1) as ld:
        kept = [b for _, b in zip(range(40), ld)]  # no copies: the loader must not reuse these
        for k, b in enumerate(kept):
            want = ld.batch_at(k * 4)
            assert np.array_equal(b["inputs"], want["inputs"]), f"batch {k} was overwritten"


def test_prefetched_batches_do_not_count_as_consumed(store):
    with Loader(store, seq_len=L, batch_size=4, num_workers=2, prefetch=6, rank=0,
                world_size=1) as ld:
        it = iter(ld)
        for _ in range(3):
            next(it)
        time.sleep(0.1)
        assert ld.state_dict()["consumed_samples"] == 12


def test_epochs_stop_and_len(store):
    with Loader(store, seq_len=L, batch_size=4, epochs=2, rank=0, world_size=1) as ld:
        assert len(ld) == ld.samples_per_epoch // 4
        assert len(take(ld, 10**6)) == 2 * ld.samples_per_epoch // 4


def test_worker_exception_surfaces_with_its_message(store, monkeypatch):
    from tokenmill.load import plan as plan_mod

    def boom(self, *args, **kwargs):
        raise ValueError("boom from a worker")
    monkeypatch.setattr(plan_mod.SampleSource, "fill_at", boom)
    with Loader(store, seq_len=L, batch_size=4, num_workers=2, rank=0, world_size=1) as ld:
        with pytest.raises(ValueError, match="boom from a worker"):
            next(iter(ld))


def test_process_worker_error_names_the_shard(tmp_path, store):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    with Loader(copy, seq_len=L, batch_size=4, num_workers=1, worker_type="process", rank=0,
                world_size=1) as ld:
        with open(copy / "shard-00001.bin", "r+b") as f:
            f.truncate(100)
        with pytest.raises(StoreError, match="shard-00001.bin"):
            next(iter(ld))


def test_dead_worker_process_is_an_error_not_a_hang(store):
    import psutil
    with Loader(store, seq_len=L, batch_size=4, num_workers=1, worker_type="process", rank=0,
                world_size=1) as ld:
        it = iter(ld)
        next(it)
        workers = [c for c in psutil.Process().children() if "tokenmill.base.child" in c.cmdline()]
        assert len(workers) == 1
        # what was computed ahead: at most MAX_PREFETCH batches (the ring: and two more)
        error = assert_worker_death_is_an_error(it, workers, budget=MAX_PREFETCH + 2)
        assert "killed by SIGKILL" in str(error)  # the real exit reason


def test_nothing_left_after_close_or_gc(store):
    before_threads = set(threading.enumerate())
    for kind in ("thread", "process"):
        ld = Loader(store, seq_len=L, batch_size=4, num_workers=2, worker_type=kind, rank=0,
                    world_size=1)
        take(ld, 5)
        ld.close()
        ld.close()  # idempotent
        ld = Loader(store, seq_len=L, batch_size=4, num_workers=2, worker_type=kind, rank=0,
                    world_size=1)
        take(ld, 5)
        del ld
        gc.collect()
    deadline = time.monotonic() + 60  # a hang guard only (5 s: a busy machine can be slower)
    while time.monotonic() < deadline and (set(threading.enumerate()) - before_threads or
                                           _worker_children()):
        time.sleep(0.05)
    assert set(threading.enumerate()) - before_threads == set()
    assert _worker_children() == []


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_close_returns_every_descriptor_and_nothing_keeps_the_plan_alive(store, kind):
    import weakref
    gc.collect()
    before = sorted(os.listdir("/proc/self/fd"))
    ld = Loader(store, seq_len=L, batch_size=4, num_workers=2, worker_type=kind, rank=0,
                world_size=1, layout="packed")
    take(ld, 20)
    plan = weakref.ref(ld.plan)
    ld.close()
    assert sorted(os.listdir("/proc/self/fd")) == before  # shard maps, pipes, stderr files
    del ld
    gc.collect()
    assert plan() is None  # no cache (an lru_cache on a method, say) holds a closed plan


def _worker_children():
    import psutil
    return [c for c in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(c.cmdline())]


def test_resume_in_a_fresh_process(store, tmp_path):
    code = f"""
import json, sys
from tokenmill import Loader
ld = Loader({str(store)!r}, seq_len={L}, batch_size=4, num_workers=1, worker_type="process", rank=0, world_size=1, seed=4)
if sys.argv[1] == "save":
    for _, b in zip(range(7), ld): pass
    json.dump(ld.state_dict(), open(sys.argv[2], "w"))
else:
    ld.load_state_dict(json.load(open(sys.argv[2])))
    print(json.dumps([b["inputs"].tolist() for _, b in zip(range(5), ld)]))
ld.close()
"""
    state = tmp_path / "state.json"
    subprocess.run([sys.executable, "-c", code, "save", str(state)], check=True)
    out = subprocess.run([sys.executable, "-c", code, "load", str(state)], check=True,
                         capture_output=True, text=True).stdout
    with Loader(store, seq_len=L, batch_size=4, rank=0, world_size=1, seed=4) as ld:
        want = [b["inputs"].tolist() for b in take(ld, 12)[7:]]
    assert json.loads(out) == want


def test_incompatible_state_is_refused(store, store_b):
    with Loader(store, seq_len=L, batch_size=4, rank=0, world_size=1) as a:
        state = a.state_dict()
    for other in (dict(source=store_b), dict(source=store, seed=1), dict(source=store, layout="packed")):
        src = other.pop("source")
        with Loader(src, seq_len=L, batch_size=4, rank=0, world_size=1, **other) as b:
            with pytest.raises(ConfigError, match="fingerprint"):
                b.load_state_dict(state)


@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_len=0, batch_size=1), "seq_len=0"),
    (dict(seq_len=L, batch_size=10**6), "batch_size × world_size"),
    (dict(seq_len=L, batch_size=1, layout="zigzag"), "zigzag"),
    (dict(seq_len=L, batch_size=0), "batch_size=0"),
    (dict(seq_len=10**6, batch_size=1), "too few"),
])
def test_bad_config_is_refused_with_the_value(store, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Loader(store, rank=0, world_size=1, **kwargs)


def test_options_are_keywords_and_a_misspelt_one_is_named(store):
    with Loader(store, seq_len=L, batch_size=2, rank=0, world_size=1, epochs=1, prefetch=3,
                dtype="int64", worker_type="thread", cache_dir=None) as ld:
        assert (ld.epochs, ld.prefetch, ld.plan.dtype.name) == (1, 3, "int64")
    with pytest.raises(TypeError, match="'worker_typ'"):
        Loader(store, seq_len=L, batch_size=2, rank=0, world_size=1, worker_typ="process")
    for bad in (dict(prefetch=0), dict(epochs=True), dict(worker_type="fork"), dict(dtype="u8")):
        with pytest.raises(ConfigError, match=repr(next(iter(bad.values())))):
            Loader(store, seq_len=L, batch_size=2, rank=0, world_size=1, **bad)


def test_bad_mixture_weights(store, store_b):
    for w in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="weights"):
            Loader({store: 1.0, store_b: w}, seq_len=L, batch_size=1, rank=0, world_size=1)


def test_rank_from_environment(store, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with Loader(store, seq_len=L, batch_size=2) as ld:
        assert (ld.rank, ld.world_size) == (1, 3)


class VirtualClock:
    """A perf_counter that moves only when told to: the loader's measured waits and wall time
    become what the test says, whatever else the machine is doing."""

    def __init__(self):
        self.now, self.lock = 1000.0, threading.Lock()

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


def test_auto_prefetch_deepens_only_while_waiting(store, monkeypatch):
    import types
    from tokenmill.load import loader as loader_mod
    real_fill = plan_mod.BatchPlan.fill
    clock = VirtualClock()
    monkeypatch.setattr(loader_mod, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(loader_mod, "TUNE_WINDOW", 10)

    def slow_fill(self, positions, out):  # 2 ms of assembly, on the worker, while we wait
        real_fill(self, positions, out)
        clock.advance(0.002)
    with Loader(store, seq_len=L, batch_size=4, rank=0, world_size=1, num_workers=1) as fast_consumer:
        start = fast_consumer.prefetch
        monkeypatch.setattr(plan_mod.BatchPlan, "fill", slow_fill)
        for _, b in zip(range(60), fast_consumer):  # no step at all: every batch is waited for
            pass
        assert fast_consumer.prefetch > start
        assert fast_consumer.buffer_bytes() <= loader_mod.PREFETCH_MEMORY_BUDGET
    monkeypatch.setattr(plan_mod.BatchPlan, "fill", real_fill)  # assembly takes no time at all
    with Loader(store, seq_len=L, batch_size=4, rank=0, world_size=1, num_workers=1) as slow_consumer:
        start = slow_consumer.prefetch
        for _, b in zip(range(40), slow_consumer):
            clock.advance(0.005)  # the step dominates: nothing to gain from a deeper queue
        assert slow_consumer.prefetch == start


def test_meter_reads_the_loaders_stages(store):
    from tokenmill import Meter
    with Loader(store, seq_len=L, batch_size=4, rank=0, world_size=1, num_workers=1) as ld:
        meter = Meter(ld)
        for _, b in zip(range(30), meter):
            pass
        s = meter.summary()
    assert s["stage_s"]["assemble"] > 0 and s["queue_depth"] is not None
    assert s["steps"] == 30 and s["tokens_per_s"] > 0


def test_memory_plan_matches_the_buffers(store):
    from tokenmill.load.loader import memory_plan
    for layout in ("concat", "packed"):
        with Loader(store, seq_len=L, batch_size=4, layout=layout, rank=0, world_size=1,
                    num_workers=1, prefetch=3) as ld:
            plan = memory_plan(seq_len=L, batch_size=4, layout=layout, prefetch=3)
            assert plan["batch_ring"] == ld.buffer_bytes()


# ---- one live iterator (issue 12.4) ------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_a_second_iter_continues_the_stream_and_the_earlier_iterator_raises(store, workers):
    def make():
        return Loader(store, seq_len=L, batch_size=4, num_workers=workers, rank=0, world_size=1)
    with make() as ref_loader:
        ref = take(ref_loader, 9)
    with make() as ld:
        first = iter(ld)
        got = take(first, 3)
        second = iter(ld)  # e.g. a peek inside the training loop: `next(iter(loader))`
        got += take(second, 2)
        for _ in range(2):  # loudly, every time: it never ends quietly
            with pytest.raises(StaleIterator, match="iterated again.*consumed_samples=12"):
                next(first)
        got += take(second, 3)
        assert same(got, ref[:8]) and ld.consumed_samples == 8 * 4  # nothing lost, nothing twice
        ld.load_state_dict({**ld.state_dict(), "consumed_samples": 4})
        with pytest.raises(StaleIterator, match="load_state_dict"):
            next(second)
        third = iter(ld)
        assert same(take(third, 1), ref[1:2])
    with pytest.raises(StaleIterator, match="closed"):
        next(third)


def test_a_second_thread_iterating_stops_the_first_loudly_even_mid_batch(store, monkeypatch):
    real_fill = plan_mod.BatchPlan.fill
    inside = threading.Event()

    def slow_fill(self, positions, out):
        inside.set()
        time.sleep(0.3)
        real_fill(self, positions, out)
    with Loader(store, seq_len=L, batch_size=4, num_workers=1, prefetch=1, rank=0,
                world_size=1) as ld:
        first = iter(ld)
        next(first)
        monkeypatch.setattr(plan_mod.BatchPlan, "fill", slow_fill)
        inside.clear()
        loop, outcome = in_thread(lambda: next(first))  # waits inside next(): the other takes over
        assert inside.wait(5)
        second = iter(ld)
        loop.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], StaleIterator), outcome
        monkeypatch.setattr(plan_mod.BatchPlan, "fill", real_fill)
        assert same(take(second, 1), [ld.batch_at(4)])  # the second goes on from batch 1



def in_thread(body) -> tuple[threading.Thread, list]:
    """Run ``body`` in a started thread; what it returns or raises lands in the list."""
    outcome: list = []

    def run():
        try:
            outcome.append(body())
        except BaseException as e:  # noqa: BLE001 - record what the loop meets
            outcome.append(e)
    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("workers", [0, 1])
def test_close_from_another_thread_stops_its_iterator_with_stale_iterator(store, monkeypatch,
                                                                         workers):
    # close() while a training loop waits inside next(): that loop meets StaleIterator, not the
    # store error, CancelledError or worker error that closing caused underneath it
    real_fill = plan_mod.BatchPlan.fill
    inside, go = threading.Event(), threading.Event()

    def held_fill(self, positions, out):
        inside.set()
        go.wait(5)
        real_fill(self, positions, out)
    ld = Loader(store, seq_len=L, batch_size=4, num_workers=workers, prefetch=1, rank=0,
                world_size=1)
    it = iter(ld)
    next(it)
    monkeypatch.setattr(plan_mod.BatchPlan, "fill", held_fill)

    def training_loop():
        while True:
            next(it)
    inside.clear()
    loop, outcome = in_thread(training_loop)
    assert inside.wait(5)
    closing = threading.Thread(target=ld.close)
    closing.start()
    time.sleep(0.2)  # close() under way: the stores closed, the pool shutting down
    go.set()
    closing.join(10)
    loop.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], StaleIterator), outcome
    assert "closed" in str(outcome[0])


# ---- the store under the loader (12.3, 12.14) -------------------------------------------------

@pytest.mark.parametrize("kind,when", [("process", "iterating"), ("thread", "iterating"),
                                       ("process", "before its workers start")])
def test_a_store_re_prepared_underneath_is_a_store_error_never_new_data(tmp_path, kind, when):
    texts = stdlib_texts(300_000)
    write_jsonl(tmp_path / "a.jsonl", texts)
    write_jsonl(tmp_path / "b.jsonl", [t[::-1] for t in texts])  # other text, the same size
    out = tmp_path / "store"
    prepare(str(tmp_path / "a.jsonl"), out=out, tokenizer="bytes", workers=1, progress=False)
    with Loader(out, seq_len=64, batch_size=4, num_workers=0, rank=0, world_size=1) as ref_ld:
        ref = take(ref_ld, 4)
    with Loader(out, seq_len=64, batch_size=4, num_workers=1, worker_type=kind, rank=0,
                world_size=1) as ld:
        it = iter(ld)
        old = ld.state_dict()["fingerprint"]
        if when == "iterating":
            assert same(take(it, 3), ref[:3])
        prepare(str(tmp_path / "b.jsonl"), out=out, tokenizer="bytes", workers=1,
                progress=False, overwrite=True)
        time.sleep(plan_mod.WATCH_INTERVAL_S)
        with pytest.raises(StoreError, match="re-prepared or replaced underneath"):
            next(it)
        assert ld.state_dict()["fingerprint"] == old


def test_a_shard_changed_since_prepare_fails_next_naming_it(tmp_path, store):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    shard = copy / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    deadline = time.monotonic() + 20
    with Loader(copy, seq_len=L, batch_size=4, num_workers=0, rank=0, world_size=1) as ld:
        with pytest.raises(StoreError, match="shard-00001.bin"):
            for _ in ld:  # the background check fails one of the next next()s
                assert time.monotonic() < deadline, "the damaged shard was never noticed"


# ---- mixtures of tokenizers (12.12) -------------------------------------------------------------

def test_stores_of_different_tokenizers_are_not_mixed(tmp_path, real_texts, bpe_tokenizer):
    from tokenmill.store import TokenStore
    write_jsonl(tmp_path / "c.jsonl", real_texts[:20])
    stores = {}
    for name, tok in (("bytes", "bytes"), ("bytes2", "bytes"), ("bpe", bpe_tokenizer)):
        stores[name] = tmp_path / name
        prepare(str(tmp_path / "c.jsonl"), out=stores[name], tokenizer=tok, workers=1,
                progress=False)
    with pytest.raises(ConfigError, match="different tokenizers") as e:
        Loader({stores["bpe"]: 0.7, stores["bytes"]: 0.3}, seq_len=L, batch_size=2, rank=0,
               world_size=1)
    for name in ("bpe", "bytes"):  # the message names both stores and both tokenizers
        assert str(stores[name]) in str(e.value)
        assert json.dumps(TokenStore(stores[name]).tokenizer, sort_keys=True) in str(e.value)
    with Loader({stores["bytes"]: 0.5, stores["bytes2"]: 0.5}, seq_len=L, batch_size=2, rank=0,
                world_size=1) as ld:  # the same tokenizer mixes
        assert len(take(ld, 2)) == 2


# ---- load_state_dict validates consumed_samples (12.17) ---------------------------------------

@pytest.mark.parametrize("bad", [True, False, 1.0, 8.0, "8", -1, 2**63, 2**64 + 1, None, [8]])
def test_a_bad_consumed_samples_is_refused_at_load_showing_the_value(store, bad):
    import re
    with Loader(store, seq_len=L, batch_size=4, rank=0, world_size=1) as ld:
        with pytest.raises(ConfigError, match=re.escape(f"(got consumed_samples={bad!r}")):
            ld.load_state_dict({**ld.state_dict(), "consumed_samples": bad})
        assert ld.consumed_samples == 0  # refused: nothing changed


def test_numpy_integer_states_load_and_the_last_position_still_loads(store):
    with Loader(store, seq_len=L, batch_size=4, rank=0, world_size=1) as ld:
        want = take(ld, 3)[2:]
        for n in (np.int64(8), np.uint32(8), np.int16(8)):
            ld.load_state_dict({**ld.state_dict(), "consumed_samples": n})
            assert ld.state_dict()["consumed_samples"] == 8 and type(ld.consumed_samples) is int
            assert same(take(ld, 1), want)
        ld.load_state_dict({**ld.state_dict(), "consumed_samples": 2**62})
        for b in take(ld, 2):  # whole windows, no OverflowError far along the range
            assert np.array_equal(b["targets"], b["inputs"] + 1)
        stepped = ld.state_dict()  # what the loader saves after stepping loads again, and resumes
        assert stepped["consumed_samples"] == 2**62 + 8
        want = take(ld, 1)
        ld.load_state_dict(stepped)
        assert same(take(ld, 1), want)
        ld.load_state_dict({**stepped, "consumed_samples": plan_mod.MAX_CONSUMED})  # 2**63 - 1
        with pytest.raises(ConfigError, match=r"past 2\*\*63-1 .*end of its range"):
            take(ld, 1)  # the end of int64: an error, never a state that would not load
        assert ld.state_dict()["consumed_samples"] == plan_mod.MAX_CONSUMED


# ---- worker processes from a plain script (12.15) ---------------------------------------------

SCRIPT_WITHOUT_MAIN_GUARD = """
import sys
from tokenmill import Loader
print("top level ran", flush=True)
loader = Loader(sys.argv[1], seq_len=16, batch_size=4, num_workers=2, worker_type="process",
                rank=0, world_size=1, seed=4)
for _, batch in zip(range(5), loader):
    print(batch["inputs"][:, 0].tolist(), flush=True)
loader.close()
"""


def test_process_workers_work_from_a_script_without_a_main_guard(store, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT_WITHOUT_MAIN_GUARD)
    done = subprocess.run([sys.executable, "train.py", str(store)], cwd=tmp_path, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    with Loader(store, seq_len=16, batch_size=4, rank=0, world_size=1, seed=4) as ld:
        want = [str(b["inputs"][:, 0].tolist()) for b in take(ld, 5)]
    assert done.stdout.splitlines() == ["top level ran", *want]  # the workers never re-ran it


def test_two_threads_taking_from_one_ring_never_hand_out_a_held_buffer():
    # a retired pass may still take a buffer while the new pass does: check-then-pop of the
    # handed-out queue must not interleave (it would free a buffer someone holds)
    import sys
    import threading
    from tokenmill.load.ring import Ring
    ring = Ring(lambda: {"inputs": np.zeros(4, np.int64)}, size=64)
    bad, held = [], []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def work(me: int) -> None:
        for i in range(40_000):
            bufs = ring.take()
            bufs["inputs"][:] = me * 10**6 + i
            batch = ring.hand_out(bufs)
            if i % 7 == 0:
                held.append((me * 10**6 + i, batch))  # kept: must never change
    try:
        threads = [threading.Thread(target=work, args=(m,)) for m in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    bad = [(want, int(b["inputs"][0])) for want, b in held if (b["inputs"] != want).any()]
    assert not bad, bad[:5]
