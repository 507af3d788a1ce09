"""The default Loader's pacing: inline while cheap, ahead while measured costly; same batches."""

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import assert_resumes_exactly, same, take, write_positional_store
from tokenmill.load import pacing
from tokenmill.load.loader import Loader
from tokenmill.observe.metrics import Meter
from tokenmill.load.pacing import GO_AHEAD, Pacer
from tokenmill.base.procs import usable_cores

L = 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    lengths = np.random.default_rng(3).integers(1, 60, size=300)
    return write_positional_store(tmp_path_factory.mktemp("p") / "store", lengths,
                                  shard_tokens=1500)


def test_cheap_batches_stay_inline_even_at_short_steps():
    p = Pacer()
    for _ in range(500):
        p.observe(assemble_s=30e-6, step_s=0.002)
    assert p.mode == "inline" and p.switches == 0


def test_costly_batches_move_ahead_after_a_few_then_back_after_a_cheap_window():
    p = Pacer()
    p.observe(assemble_s=0.05, step_s=0.02)  # the first batch never counts
    for _ in range(pacing.GO_AHEAD - 1):
        assert not p.observe(assemble_s=0.004, step_s=0.02)
    assert p.observe(assemble_s=0.004, step_s=0.02) and p.mode == "ahead"
    assert "4.00 ms" in p.reason
    for _ in range(200):
        p.observe(assemble_s=20e-6, step_s=0.02)
    assert p.mode == "inline" and p.switches == 2 and p.stats()["mode"] == "inline"


def test_no_step_to_hide_behind_stays_inline():
    p = Pacer()
    for _ in range(100):  # a loop that only draws batches: a hand-off would only add cost
        p.observe(assemble_s=0.005, step_s=1e-6)
    assert p.mode == "inline"


def test_costly_but_hidden_by_a_long_step_stays_inline():
    p = Pacer()
    for _ in range(100):  # 0.2 ms inline in a 1 s step: 0.02% wait, no reason to hand over
        p.observe(assemble_s=200e-6, step_s=1.0)
    assert p.mode == "inline"


def test_the_measured_hand_off_cost_decides():
    slow, fast = Pacer(), Pacer()
    slow.measured(2e-3, "test")  # a 2 ms hand-off: a 1 ms batch is not worth handing over
    fast.measured(50e-6, "test")
    for p in (slow, fast):
        for _ in range(10):
            p.observe(assemble_s=1e-3, step_s=0.02)
    assert slow.mode == "inline" and fast.mode == "ahead" and "hand-offs of 50 µs" in fast.reason
    assert slow.stats()["handoff_us"] == 2000.0 and slow.stats()["handoff"] == "measured: test"


def test_a_batch_just_above_an_idle_round_trip_stays_inline():
    """An idle round trip understates a hand-off under GIL contention: a warm batch of 2-3
    round trips is not handed over (it was, at a 2 ms step, and the wait grew 1.5% -> 4%)."""
    p = Pacer()
    p.measured(22e-6, "test")
    for _ in range(100):
        p.observe(assemble_s=60e-6, step_s=2e-3)
    assert p.mode == "inline"
    p.observe(assemble_s=1e-3, step_s=2e-3)  # cold pages: well above the margin
    for _ in range(GO_AHEAD):
        p.observe(assemble_s=1e-3, step_s=2e-3)
    assert p.mode == "ahead"


def test_waits_ahead_that_cost_more_than_assembling_inline_bring_it_back_and_raise_the_cost():
    p = Pacer()
    p.measured(20e-6, "round trips")  # an idle round trip: far below the real cost
    for _ in range(pacing.GO_AHEAD + 1):
        p.observe(assemble_s=100e-6, step_s=0.002)
    assert p.mode == "ahead"
    for k in range(pacing.AHEAD_TRIAL):  # the worker contends with the step: 0.4 ms waits
        switched = p.observe(assemble_s=100e-6, step_s=0.002, wait_s=400e-6)
    assert switched and p.mode == "inline" and "400 µs a batch ahead" in p.reason
    assert p.stats()["handoff_us"] == 400.0 and "while ahead" in p.stats()["handoff"]
    for _ in range(100):  # the same batches no longer go ahead
        p.observe(assemble_s=100e-6, step_s=0.002)
    assert p.mode == "inline"
    for _ in range(pacing.GO_AHEAD + 1):  # cold pages: ms a batch still go ahead
        p.observe(assemble_s=3e-3, step_s=0.02)
    assert p.mode == "ahead"
    for _ in range(3 * pacing.AHEAD_TRIAL):  # and stay there while the waits are small
        p.observe(assemble_s=3e-3, step_s=0.02, wait_s=50e-6)
    assert p.mode == "ahead"


@pytest.mark.skipif(usable_cores() < 2, reason="the default is inline-only on one core")
def test_the_default_measures_the_hand_off_once_after_the_first_batch(store):
    with Loader(store, seq_len=L, batch_size=4) as ld:
        assert ld.stats()["handoff"] == "assumed"  # nothing started before the first batch
        it = iter(ld)
        next(it)
        next(it)
        s = ld.stats()
        assert s["handoff"].startswith("measured: median of 7 round trips") and s["handoff_us"] > 0
        assert s["handoff_us"] == round(pacing.handoff_cost(None, "thread") * 1e6, 1)  # cached
    with ThreadPoolExecutor(1) as pool:
        calls = []
        t0 = time.perf_counter()
        median = pacing.round_trip_s(lambda fn: calls.append(fn) or pool.submit(fn), 3)
        elapsed = time.perf_counter() - t0
    # one round trip to start the worker, 3 measured: their median is a positive time no more
    # than half of the whole call (a relation, not a threshold: it holds on any machine)
    assert len(calls) == 4 and 0 < median <= elapsed / 2


def force_ahead(monkeypatch) -> None:
    """Every batch is costlier than a hand-off: the default goes ahead at once and stays there,
    whatever its waits."""
    monkeypatch.setattr(pacing, "HANDOFF_S", -1.0)
    monkeypatch.setattr(pacing, "handoff_cost", lambda submit, kind="thread": -1.0)
    monkeypatch.setattr(pacing, "AHEAD_TRIAL", 10**9)


@pytest.mark.skipif(usable_cores() < 2, reason="the default is inline-only on one core")
def test_default_switching_modes_mid_run_gives_the_same_batches_and_resumes(store, monkeypatch):
    with Loader(store, seq_len=L, batch_size=4, num_workers=0) as ref:
        want = take(ref, 60)
    with Loader(store, seq_len=L, batch_size=4) as ld:
        assert ld.pacer is not None and ld.stats()["mode"] == "inline"
        it, got = iter(ld), []
        for k in range(60):
            if k in (5, 25):
                ld.pacer.mode = "ahead"
            if k in (15, 40):
                ld.pacer.mode = "inline"
            got.append({n: a.copy() for n, a in next(it).items()})
        assert same(got, want) and ld.consumed_samples == 240
    # every batch "costly": goes ahead at once
    force_ahead(monkeypatch)
    assert_resumes_exactly(lambda: Loader(store, seq_len=L, batch_size=4), steps=12)


@pytest.mark.skipif(usable_cores() < 2, reason="the default is inline-only on one core")
def test_the_meter_and_stats_say_which_mode_and_why(store, monkeypatch):
    force_ahead(monkeypatch)
    monkeypatch.setattr(pacing, "WAIT_FRACTION", 0.0)
    with Loader(store, seq_len=L, batch_size=4) as ld:
        meter = Meter(ld)
        for _ in zip(range(20), meter):
            pass
        s = ld.stats()
        assert s["mode"] == "ahead" and "hand-off" in s["why"] and s["switches"] == 1
        assert meter.summary()["loader"]["mode"] == "ahead"
        assert "batches assembled ahead" in meter.summary()["verdict_detail"]
    with Loader(store, seq_len=L, batch_size=4, num_workers=0) as ld:
        s = ld.stats()
        assert s.pop("cuts")["rows"] == 0  # nothing handed out yet (tests/test_long_context.py)
        assert s == {"mode": "inline", "why": "num_workers=0 given", "workers": 0,
                     "worker_type": "thread", "prefetch": ld.prefetch}


@pytest.mark.skipif(usable_cores() < 2, reason="the default is inline-only on one core")
def test_default_with_process_workers_goes_ahead_with_the_same_batches(store, monkeypatch):
    force_ahead(monkeypatch)
    monkeypatch.setattr(pacing, "WAIT_FRACTION", 0.0)
    with Loader(store, seq_len=L, batch_size=4, num_workers=0) as ref:
        want = take(ref, 30)
    with Loader(store, seq_len=L, batch_size=4, worker_type="process") as ld:
        got = take(ld, 30)
        assert same(got, want) and ld.stats()["mode"] == "ahead"
        assert ld.stats()["worker_type"] == "process"
