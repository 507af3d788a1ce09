"""What a bench child process measures of one contender, in this order:

    step alone   --steps steps of a fixed CPU job (calibrated once to --step-ms), no loader
    first batch  from building the loader to its first batch       time_to_first_batch_s
    no model     batches drawn for --seconds, nothing else          tokens_per_s
    with model   --steps steps of the same job, under a Meter       data_wait_pct, wait_p99_ms
    slowdown     median step fed by the loader / median step alone − 1, from alternating blocks
                 of each (``slowdown``): drifts of a shared machine hit both alike
                                                                    step_slowdown_pct
"""

from __future__ import annotations

import importlib
import importlib.metadata
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from tokenmill.observe.bench.contenders import CONTENDERS, NOTES, REQUIRES
from tokenmill.observe.metrics import Meter, count_tokens

WORK_FLOATS = 20_000  # the step's array: 160 kB, one np.sin pass ~0.15 ms, GIL released inside
DROPPED = 3  # steps at the start of an alone block: a loader's workers may finish prefetching


def step_work(passes: int, base: np.ndarray, work: np.ndarray) -> None:
    """The simulated training step: the same ``passes`` of np.sin over a copy of ``base``, on
    one thread (numpy releases the GIL inside, as a real step's kernels do)."""
    work[:] = base
    for _ in range(passes):
        np.sin(work, out=work)


def _arrays() -> tuple[np.ndarray, np.ndarray]:
    base = np.random.default_rng(0).random(WORK_FLOATS)
    return base, base.copy()


def step_times(passes: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` simulated steps run back to back."""
    base, work = _arrays()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step_work(passes, base, work)
        out.append(time.perf_counter() - t0)
    return out


def calibrate_step(step_ms: float) -> int:
    """Passes of ``step_work`` that take ``step_ms`` here, now (fastest of 5 probes)."""
    probe = 50
    fastest = min(step_times(probe, 5)) / probe
    return max(1, round(step_ms / 1e3 / fastest))


def tokens_per_s(it: Iterator, seconds: float) -> float:
    """Tokens per second drawn from ``it`` for ``seconds`` with no consumer."""
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        n += count_tokens(next(it))
    return n / dt


def measure_steps(it: Iterator, passes: int, steps: int) -> dict[str, Any]:
    """The Meter's summary over ``steps`` simulated steps, each fed a batch from ``it``."""
    meter = Meter(it)
    base, work = _arrays()
    for n, _batch in enumerate(meter):
        if n == steps:
            break
        step_work(passes, base, work)
    return meter.summary()


def slowdown(it: Iterator, passes: int, *, blocks: int, per: int) -> dict[str, float]:
    """Median step fed by ``it`` and median step alone (ms) and the slowdown (%), from
    ``blocks`` pairs of blocks: ``per`` steps each after a ``next(it)``, then ``per`` steps alone
    (their first DROPPED left out). Interleaved, so that another tenant's burst or a clock
    change hits both sides alike (measuring alone before and after read ±2% at a 2 ms step).
    The noise (%): how much the blocks' median alone steps differ (max / min - 1; None for one
    block): a slowdown within it is the machine's variation, not the loader's cost."""
    if blocks < 1:
        raise ValueError(f"blocks must be an int >= 1 (got {blocks=})")
    if per <= DROPPED:
        raise ValueError(f"per must be an int > {DROPPED} (got {per=}): the first {DROPPED} "
                         "steps of each alone block are not timed")
    base, work = _arrays()
    fed, alone, block_medians = [], [], []
    for _ in range(blocks):
        for _ in range(per):
            next(it)
            t0 = time.perf_counter()
            step_work(passes, base, work)
            fed.append(time.perf_counter() - t0)
        for i in range(per):
            t0 = time.perf_counter()
            step_work(passes, base, work)
            if i >= DROPPED:
                alone.append(time.perf_counter() - t0)
        block_medians.append(statistics.median(alone[-(per - DROPPED):]))
    with_ms, alone_ms = 1e3 * statistics.median(fed), 1e3 * statistics.median(alone)
    noise = 100 * (max(block_medians) / min(block_medians) - 1) if blocks > 1 else None
    return {"step_ms_with_loader": with_ms, "step_ms_alone": alone_ms,
            "step_slowdown_pct": 100 * (with_ms / alone_ms - 1), "step_slowdown_noise_pct": noise}


def measure(name: str, store: str, *, seq_len: int, batch_size: int, seed: int, seconds: float,
            steps: int, passes: int) -> dict[str, Any]:
    """Every figure of one contender, measured in this process (the slowdown from ``steps``
    more steps, half of them alone: ``slowdown``)."""
    t0 = time.perf_counter()
    it = CONTENDERS[name](store, seq_len, batch_size, seed)
    next(it)
    first = time.perf_counter() - t0
    rate = tokens_per_s(it, seconds)
    s = measure_steps(it, passes, steps)
    per = max(DROPPED + 2, min(25, steps // 8))
    cost = slowdown(it, passes, blocks=max(1, steps // (2 * per)), per=per)
    it.close()
    return {"tokens_per_s": rate, "time_to_first_batch_s": first,
            "data_wait_pct": s["data_wait_pct"], "wait_p99_ms": s["wait_p99_ms"], **cost}


def measure_or_skip(name: str, spec: dict) -> dict[str, Any]:
    """``measure``'s figures, or ``{"skipped": why}`` for a peer that is not installed, or
    ``{"error": what}`` when the contender failed (the other contenders go on)."""
    try:  # before the clock: importing a framework is not loading data
        if name in REQUIRES:
            importlib.import_module(REQUIRES[name])
    except ImportError as e:
        return {"skipped": f"not installed ({e})"}
    try:
        return measure(name, **spec)
    except Exception as e:  # the report says which contender failed and why; the rest go on
        return {"error": f"{type(e).__name__}: {e}"}


def child_result(name: str, spec: dict) -> dict[str, Any]:
    """One contender's result record, as a bench child reports it."""
    result = {"name": name, **measure_or_skip(name, spec), "note": NOTES.get(name),
              "version": _version(REQUIRES[name]) if name in REQUIRES else None}
    return {k: v for k, v in result.items() if v is not None}


def serve_one(conn, name: str, spec: dict) -> None:
    """A bench worker's target (``procs.Worker``): measure ``name``, send the result record."""
    conn.send(child_result(name, spec))


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except Exception:
        return None
