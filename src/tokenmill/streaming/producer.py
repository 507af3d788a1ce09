"""The producer: the loader's background thread that assembles this rank's batches.

From global position k it reads the pass's windows — from the text (``TextWindows``, which also
feeds the cache writer) or, once the cache store is complete, from that store
(``StoreWindows``) — puts them in the order of ``order``, copies this rank's rows of each global
batch and queues them, each with the state after it. Past the end of the pass it goes on with
the store's later epochs (``StoreEpochs``: epochs 1, 2, … of the store Loader's order).

    producer = Producer(plan, tok, BatchSlice(rank=0, world_size=1, batch_size=8),
                        StartAt(consumed=0, hint=None, pass_samples=None), stats)
    msg = producer.get()   # StepReady(batch, consumed, resume_from, pass_samples) | StreamFailed
    producer.close()
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from tokenmill.base.errors import ConfigError, StoreError
from tokenmill.load.plan import BatchPlan, LayoutConfig, batch_at
from tokenmill.streaming.cache import CacheWriter, claim_writer, store_complete, wait_store
from tokenmill.streaming.order import (emission_order, emission_time, emitted_before, look_ahead,
                                       oldest_buffered)
from tokenmill.streaming.plan import START, Cursor, StreamPlan
from tokenmill.streaming.rows import PackedText, StoreRows, new_batch, pass_length
from tokenmill.streaming.units import POLL_S, Stopped, UnitResults
from tokenmill.streaming.windows import StoreWindows, TextWindows, WindowSource
from tokenmill.tokenizer import Tokenizer

READY_BATCHES = 8  # batches assembled ahead of the consumer


# ---- what crosses from the producer to the loader ------------------------------------------------

class StepReady(NamedTuple):
    """One batch of this rank, and the state after it."""

    batch: dict[str, np.ndarray]
    consumed: int  # global samples handed out once this batch is
    resume_from: Cursor | None  # where reading may restart for a resume at ``consumed``
    pass_samples: int | None  # windows in the pass, once known


class StreamFailed(NamedTuple):
    """The producer stopped on this exception; the loader raises it at every later ``next()``."""

    error: BaseException


class StartAt(NamedTuple):
    """Where a producer starts: global position, the state's cursor hint, its pass length."""

    consumed: int
    hint: Cursor | None
    pass_samples: int | None


@dataclass(frozen=True)
class BatchSlice:
    """This rank's part of each global batch: rows [rank·B, (rank + 1)·B)."""

    rank: int
    world_size: int
    batch_size: int

    @property
    def global_batch(self) -> int:
        """Samples per step across all ranks."""
        return self.batch_size * self.world_size


@dataclass
class StreamStats:
    """What the producer measures: stage seconds (for the Meter) and the buffer's peak."""

    seconds: dict[str, float] = field(
        default_factory=lambda: {"tokenization": 0.0, "write": 0.0, "assemble": 0.0})
    peak_tokens: int = 0


# ---- the batches ready for the consumer ----------------------------------------------------------

class Ready:
    """Batches ready for the consumer. Once full, the producer sleeps until the consumer has
    taken half, then refills: it wakes every size/2 steps, not at every step, so it rarely holds
    the GIL just when the training loop asks for a batch."""

    def __init__(self, size: int):
        self.items: deque = deque()
        self.size = size
        self.cond = threading.Condition()

    def put(self, item, stop: threading.Event) -> None:
        """Queue ``item``; raises Stopped if the loader closes while the queue is full."""
        with self.cond:
            full = len(self.items) >= self.size
            while len(self.items) > self.size // 2 and full:
                if stop.is_set():
                    raise Stopped
                self.cond.wait(POLL_S)
        if full:  # woken by the consumer: let it return to its step before taking the GIL
            time.sleep(0.002)
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()

    def get(self, alive) -> StepReady | StreamFailed:
        """The next item; a RuntimeError if the producer ended without one."""
        with self.cond:
            while not self.items:
                if not alive():
                    raise RuntimeError("the stream loader's thread ended without a result")
                self.cond.wait(POLL_S)
            item = self.items.popleft()
            if len(self.items) == self.size // 2:
                self.cond.notify_all()
            return item

    def qsize(self) -> int:
        """Batches waiting."""
        return len(self.items)

    def wake(self) -> None:
        """Wake a producer waiting for room (the loader is closing)."""
        with self.cond:
            self.cond.notify_all()


# ---- the store's epochs --------------------------------------------------------------------------

class StoreEpochs:
    """This rank's batches in the store Loader's order (``plan.batch_at``): epochs 1, 2, …

    Global position p >= n (the pass's samples) is the store Loader's position
    p − n + samples_per_epoch. For concat the pass *is* the store's epoch 0 (the same n); packed
    rows of the pass are packed window by window, so n may differ from the store's rows."""

    def __init__(self, plan: StreamPlan, part: BatchSlice):
        self.part = part
        o = plan.order_settings
        self.plan = BatchPlan.open(plan.store_dir, LayoutConfig(
            seq_len=plan.seq_len, layout=o.layout, seed=plan.seed, max_segments=o.max_segments))
        self.samples_per_epoch = self.plan.samples_per_epoch
        self.pass_samples = (pass_length(plan, self.plan.sources[0].store) if plan.packed
                             else self.samples_per_epoch)

    def batch_at(self, consumed: int) -> dict[str, np.ndarray]:
        """This rank's batch of the global batch starting at sample ``consumed``."""
        self.plan.check_stores()  # a store re-prepared or corrupted underneath fails loudly
        shifted = consumed - self.pass_samples + self.samples_per_epoch
        return batch_at(self.plan, shifted, batch_size=self.part.batch_size,
                        rank=self.part.rank, world_size=self.part.world_size)

    def close(self) -> None:
        """Release the store."""
        self.plan.close()


# ---- the producer thread -------------------------------------------------------------------------

class Producer:
    """The loader's background thread: runs the pass from position k and queues this rank's
    batches, each with the state after it; then the store's later epochs."""

    def __init__(self, plan: StreamPlan, tokenizer: Tokenizer, part: BatchSlice, start: StartAt,
                 stats: StreamStats, ready: int = READY_BATCHES):
        self.plan, self.tok, self.part, self.start, self.stats = plan, tokenizer, part, start, stats
        self.out = Ready(ready)
        self.stop = threading.Event()
        self.epochs: StoreEpochs | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="tokenmill-stream")
        self.thread.start()

    def get(self) -> StepReady | StreamFailed:
        """The next batch and the state after it, or the error that stopped the producer."""
        return self.out.get(self.thread.is_alive)

    def close(self) -> None:
        """Stop the thread, its workers and the store it reads; idempotent."""
        self.stop.set()
        self.out.wake()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=60)
        if self.epochs is not None:
            self.epochs.close()
            self.epochs = None

    def _run(self) -> None:
        try:
            self._produce()
        except Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - the consumer raises it at next()
            try:
                self._put(StreamFailed(e))
            except Stopped:
                pass

    def _put(self, item: StepReady | StreamFailed) -> None:
        self.out.put(item, self.stop)

    def _check_pass(self, n: int | None) -> None:
        """Refuse a global batch larger than the pass (it would hold a sample twice), as the
        store Loader refuses one larger than an epoch; checked once the pass's length is known,
        before a batch is made (such a batch is the first one, and it needs the length)."""
        if n is not None and n < self.part.global_batch:
            what = "packed rows" if self.plan.packed else "windows"
            raise ConfigError(f"batch_size × world_size = {self.part.global_batch:,} samples is "
                              f"more than one pass over the text holds ({n:,} {what} of seq_len "
                              f"{self.plan.seq_len}): a batch would hold the same sample twice; "
                              "lower batch_size or seq_len, or give more text")

    def _produce(self) -> None:
        k, claimed = self.start.consumed, self.start.pass_samples
        complete = store_complete(self.plan)
        if not complete and claimed is not None and k >= claimed:
            self._later_epochs(k, claimed, measured=False)  # past the pass: the store alone
            return
        if complete:
            source = StoreRows(self.plan) if self.plan.packed else StoreWindows(self.plan)
        else:
            source = self._text_source(k, claim_writer(self.plan, self.tok, self.stats.seconds))
        try:
            k = self._emit(source, k)
        finally:
            source.close()
            self.stats.peak_tokens = max(self.stats.peak_tokens, source.peak)
        self._later_epochs(k, source.num_windows, measured=True)

    def _text_source(self, k: int | None, writer: CacheWriter | None) -> WindowSource:
        """Windows (or packed rows) read from the text, from the earliest of: the writer's
        cursor, and the place that replays the shuffle buffer of position k (``hint`` if early
        enough, else 0)."""
        plan, starts = self.plan, []
        if k is not None:
            # the pass length is not trusted here: with fewer windows, sample k leaves no earlier
            t = emission_time(k, **plan.order)
            oldest = oldest_buffered(t, shuffle_buffer=plan.shuffle_buffer)
            hint = self.start.hint
            early = hint is not None and (hint.row <= oldest if plan.packed
                                          else hint.token <= plan.window_start(oldest))
            starts.append(hint if early else START)
        if writer is not None:  # after the hint: on a tie, the hint (it knows its row) wins
            starts.append(writer.resume_cursor)
        start = min(starts, key=lambda c: (c.token, c.unit, c.doc))
        rows = plan.packed and k is not None  # finishing the cache alone needs no rows
        if rows and start.row == 0 and start.token > 0:
            start = START  # the rows before a writer's cursor are unknown: pack from the start
        try:
            units = UnitResults(plan, self.tok, first=start.unit, stop=self.stop,
                                stats=self.stats.seconds)
        except BaseException:
            if writer is not None:
                writer.abort()  # release the cache for another process
            raise
        text = TextWindows(plan, start, writer, units, self.stop)
        return PackedText(plan, text, start) if rows else text

    def _start_time(self, source: WindowSource, k: int) -> int:
        """When sample k leaves the buffer; reads far enough to know whether the pass ends first."""
        order = self.plan.order
        t = emission_time(k, num_windows=source.num_windows, **order)
        if source.num_windows is None:
            source.confirm(t + 1)  # either the pass holds more than t windows, or it is known
            if source.num_windows is not None:
                t = emission_time(k, num_windows=source.num_windows, **order)
        return t

    def _emit(self, source: WindowSource, k: int) -> int:
        """Queue batches from global position k to the end of the pass; returns where it stops."""
        plan, GB = self.plan, self.part.global_batch
        S, order = plan.shuffle_buffer, plan.order
        delta = look_ahead(GB, S)
        t_hi = self._start_time(source, k)
        skip = k - emitted_before(t_hi, num_windows=source.num_windows, **order)
        ids = times = np.zeros(0, np.int64)  # windows of positions k, k+1, … and their times
        while (n := source.num_windows) is None or k < n:
            while len(ids) < (GB if n is None else min(GB, n - k)):
                assert n is None or t_hi < n + S, "the pass emitted fewer windows than it holds"
                source.confirm(t_hi + delta)
                n = source.num_windows
                more, more_t = emission_order(t_hi, t_hi + delta, num_windows=n, **order)
                ids = np.concatenate([ids, more[skip:]])
                times = np.concatenate([times, more_t[skip:]])
                skip, t_hi = 0, t_hi + delta
            want = GB if n is None else min(GB, n - k)
            t0 = time.perf_counter()
            batch = self._assemble(source, ids[:want], k, n)
            self.stats.seconds["assemble"] += time.perf_counter() - t0
            ids, times, k = ids[want:], times[want:], k + GB
            oldest = oldest_buffered(int(times[0]) if len(times) else t_hi, shuffle_buffer=S)
            source.release(oldest)
            self._put(StepReady(batch, k, source.resume_from(oldest), source.num_windows))
        return k

    def _assemble(self, source: WindowSource, windows: np.ndarray, k: int, n: int | None) -> dict:
        """This rank's rows of the global batch at k; rows past the pass come from the store."""
        self._check_pass(n)
        B = self.part.batch_size
        out = new_batch(self.plan, B)
        q = self.part.rank * B + np.arange(B)
        late = q >= len(windows)
        source.copy(np.asarray(windows, np.int64)[q[~late]], out, np.flatnonzero(~late))
        if late.any():  # the global batch runs past the end of the pass: epoch 1 of the store
            other = self._store_epochs(n, measured=True).batch_at(k)
            for name in out:
                out[name][late] = other[name][late]
        return out

    def _later_epochs(self, k: int, n: int, *, measured: bool) -> None:
        """Queue the store's batches from global position k on (k at or past the pass's end)."""
        self._check_pass(n)
        epochs = self._store_epochs(n, measured=measured)
        while True:
            if self.stop.is_set():
                raise Stopped
            t0 = time.perf_counter()
            batch = epochs.batch_at(k)
            self.stats.seconds["assemble"] += time.perf_counter() - t0
            k += self.part.global_batch
            self._put(StepReady(batch, k, None, n))

    def _store_epochs(self, n: int, *, measured: bool) -> StoreEpochs:
        """The complete cache store's epochs, checked to hold the ``n`` windows of the pass
        (``measured``: counted by reading the text; else the loaded state's pass_samples)."""
        if self.epochs is None:
            plan = self.plan
            if not wait_store(plan, self.tok, self.stats.seconds, self.stop, self._write_store):
                raise Stopped
            self.epochs = StoreEpochs(self.plan, self.part)
            have = self.epochs.pass_samples
            if have != n and measured:
                raise StoreError(f"{self.plan.store_dir}: holds {have:,} windows, the pass "
                                 f"streamed {n:,}; delete it and run again")
            if have != n:
                raise ConfigError(f"the loaded state's pass_samples={n} does not match the pass, "
                                  f"which holds {have:,} windows: the state was edited or comes "
                                  "from another run")
        return self.epochs

    def _write_store(self, writer: CacheWriter) -> None:
        """Read the whole input into ``writer``: nobody else is writing the cache store."""
        source = self._text_source(None, writer)
        try:
            source.drain()
        finally:
            source.close()
