"""Streaming mode, the pass: the shuffle-buffer order and the thread that makes the batches.

The order is a set of pure functions of (seed, S, window / time / position): window i waits
d_i = hash(DELAY_TAG, seed, i) mod min(S, i + 1) steps and windows leave in order of (i + d_i, i);
``emission_time`` inverts it, so the buffer is never stored (see ``tokenmill.stream``).

``_Producer`` is the loader's background thread. From global position k it reads windows — from
the text (``streampool._TextWindows``, which also feeds the cache writer of ``streamcache``) or,
once the cache store is complete, from that store (``_StoreWindows``) — orders them, assembles
this rank's rows of each global batch and queues them in ``_Ready`` with the state after each.
At the end of the pass it hands over a store Loader for epochs 1, 2, …

    producer = _Producer(plan, tok, rank=0, batch_size=8, world_size=1, start=(k, hint, n), …)
    producer.get()  # ("batch", arrays, consumed, resume_from, n) | ("store", …) | ("error", e)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from tokenmill import pack
from tokenmill.errors import StoreError
from tokenmill.loader import Loader
from tokenmill.sampler import hash_ints
from tokenmill.store import MANIFEST, TokenStore
from tokenmill.streamcache import _CacheWriter, _claim_writer, _wait_store
from tokenmill.streampool import _POLL, Cursor, _Stopped, _TextWindows, _UnitPool

if TYPE_CHECKING:
    from tokenmill.stream import _Plan

DELAY_TAG = 0x64656C79  # "dely": separates shuffle-buffer delays from other uses of hash_ints
READY_BATCHES = 8  # batches assembled ahead of the consumer


# ---- the order: pure functions of (seed, S, window / time / position) ---------------------------

def window_delays(windows: np.ndarray, *, seed: int, shuffle_buffer: int) -> np.ndarray:
    """How many steps each concat window waits in the shuffle buffer: in [0, min(S, i + 1)).

    window_delays(np.arange(3), seed=0, shuffle_buffer=1).tolist() == [0, 0, 0]
    """
    i = np.asarray(windows, dtype=np.int64)
    h = hash_ints(DELAY_TAG, seed, i)
    # window i < S waits at most i steps: the stream starts at once instead of filling the buffer
    return (h % np.minimum(i + 1, shuffle_buffer).astype(np.uint64)).astype(np.int64)


def emission_order(t0: int, t1: int, *, seed: int, shuffle_buffer: int,
                   num_windows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The windows that leave the buffer at times [t0, t1), in order, and their times.

    emission_order(0, 5, seed=0, shuffle_buffer=1)[0].tolist() == [0, 1, 2, 3, 4]
    """
    lo = max(0, t0 - shuffle_buffer + 1)
    hi = t1 if num_windows is None else min(t1, num_windows)
    i = np.arange(lo, max(lo, hi), dtype=np.int64)
    t = i + window_delays(i, seed=seed, shuffle_buffer=shuffle_buffer)
    keep = (t >= t0) & (t < t1)
    i, t = i[keep], t[keep]
    order = np.lexsort((i, t))
    return i[order], t[order]


def emitted_before(t: int, *, seed: int, shuffle_buffer: int,
                   num_windows: int | None = None) -> int:
    """How many windows leave the buffer before time t (every window i <= t - S has left).

    emitted_before(10, seed=0, shuffle_buffer=1) == 10
    """
    lo = max(0, t - shuffle_buffer + 1)
    done = lo if num_windows is None else min(lo, num_windows)
    hi = t if num_windows is None else min(t, num_windows)
    if hi <= lo:
        return done
    i = np.arange(lo, hi, dtype=np.int64)
    delays = window_delays(i, seed=seed, shuffle_buffer=shuffle_buffer)
    return done + int(np.count_nonzero(i + delays < t))


def emission_time(k: int, *, seed: int, shuffle_buffer: int,
                  num_windows: int | None = None) -> int:
    """The time at which sample k of the pass leaves the buffer (binary search, O(S log k)).

    emission_time(7, seed=0, shuffle_buffer=1) == 7
    """
    order = {"seed": seed, "shuffle_buffer": shuffle_buffer, "num_windows": num_windows}
    lo, hi = 0, k + shuffle_buffer  # emitted_before(k + S) >= k + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if emitted_before(mid, **order) <= k:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _look_ahead(global_batch: int, shuffle_buffer: int) -> int:
    """Δ: the times ordered at once, in windows (a batch at least; at most 256 so that a chunk of
    them never asks for many units at once)."""
    return max(global_batch, min(shuffle_buffer // 4, 256), 1)


# ---- windows of the complete cache store --------------------------------------------------------

class _StoreWindows:
    """The pass's windows read from the complete cache store: the same tokens, no tokenizing."""

    def __init__(self, plan: _Plan, store: TokenStore):
        self.plan, self.store = plan, store
        self.num_windows = pack.concat_num_samples(store.num_tokens, plan.seq_len)
        self.peak = 0

    def confirm(self, windows: int) -> None:
        pass

    def copy(self, window: int, out: dict, row: int) -> None:
        L = self.plan.seq_len
        s = self.plan.offset + window * L
        data = self.store.tokens(s, s + L + 1)
        out["inputs"][row] = data[:-1]
        out["targets"][row] = data[1:]

    def release(self, token: int) -> None:
        pass

    def resume_from(self, token: int) -> Cursor | None:
        return None

    def close(self) -> None:
        pass


# ---- the producer thread ------------------------------------------------------------------------

class _Ready:
    """Batches ready for the consumer. Once full, the producer sleeps until the consumer has
    taken half, then refills: it wakes every size/2 steps, not at every step, so it rarely holds
    the GIL just when the training loop asks for a batch."""

    def __init__(self, size: int):
        self.items: deque = deque()
        self.size = size
        self.cond = threading.Condition()

    def put(self, item, stop: threading.Event) -> None:
        with self.cond:
            full = len(self.items) >= self.size
            while len(self.items) > self.size // 2 and full:
                if stop.is_set():
                    raise _Stopped
                self.cond.wait(_POLL)
        if full:  # woken by the consumer: let it return to its step before taking the GIL
            time.sleep(0.002)
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()

    def get(self, alive) -> tuple:
        with self.cond:
            while not self.items:
                if not alive():
                    raise RuntimeError("the stream loader's thread ended without a result")
                self.cond.wait(_POLL)
            item = self.items.popleft()
            if len(self.items) == self.size // 2:
                self.cond.notify_all()
            return item

    def qsize(self) -> int:
        return len(self.items)


class _Producer:
    """The loader's background thread: runs the pass from position k and queues this rank's
    batches, each with the state after it; then hands over a store Loader for what follows."""

    def __init__(self, plan: _Plan, tokenizer, *, rank: int, batch_size: int, world_size: int,
                 start: tuple[int, Cursor | None, int | None], stats: dict, memory: dict):
        self.plan, self.tok = plan, tokenizer
        self.rank, self.B, self.W = rank, batch_size, world_size
        self.k, self.hint, self.n = start
        self.stats, self.memory = stats, memory
        self.out = _Ready(READY_BATCHES)
        self.stop = threading.Event()
        self.inner: Loader | None = None
        self.pools: list[_UnitPool] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name="tokenmill-stream")
        self.thread.start()

    def get(self) -> tuple:
        """The next item: ("batch", arrays, consumed, resume_from, pass_samples), ("store",
        loader, consumed) or ("error", exception)."""
        return self.out.get(self.thread.is_alive)

    def close(self) -> None:
        """Stop the thread, the workers and the inner loader it did not hand over; idempotent."""
        self.stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=60)
        for pool in self.pools:
            pool.shutdown()
        if self.inner is not None:
            self.inner.close()
            self.inner = None

    def _run(self) -> None:
        try:
            self._produce()
        except _Stopped:
            pass
        except BaseException as e:
            try:
                self._put(("error", e))
            except _Stopped:
                pass

    def _put(self, item: tuple) -> None:
        self.out.put(item, self.stop)

    def _produce(self) -> None:
        k, n = self.k, self.n
        store = self._open_store()
        if store is not None:
            n = pack.concat_num_samples(store.num_tokens, self.plan.seq_len)
        if n is None or k < n:
            source = (_StoreWindows(self.plan, store) if store is not None
                      else self._text_source(k, _claim_writer(self.plan, self.tok, self.stats)))
            try:
                k = self._emit(source, k)
            finally:
                source.close()
                self.memory["peak_tokens"] = max(self.memory["peak_tokens"], source.peak)
            n = source.num_windows
        self._put(("store", self._store_loader(n), k))

    def _text_source(self, k: int | None, writer: _CacheWriter | None) -> _TextWindows:
        """Windows read from the text, from the earliest of: the writer's cursor, and the place
        that replays the shuffle buffer of position k (``resume_from`` if early enough, else 0)."""
        starts = [writer.resume_cursor] if writer is not None else []
        if k is not None:
            t = emission_time(k, num_windows=self.n, **self.plan.order())
            need = self.plan.offset + max(0, t - self.plan.shuffle_buffer + 1) * self.plan.seq_len
            usable = self.hint is not None and self.hint[2] <= need
            starts.append(self.hint if usable else (0, 0, 0))
        start = min(starts, key=lambda c: (c[2], c[0], c[1]))
        pool = _UnitPool(self.plan, self.tok, start[0], self.stop, self.stats)
        self.pools.append(pool)
        return _TextWindows(self.plan, start, writer, pool)

    def _emit(self, source, k: int) -> int:
        """Queue batches from global position k to the end of the pass; returns where it stops."""
        plan, GB = self.plan, self.B * self.W
        S, L, order = plan.shuffle_buffer, plan.seq_len, plan.order()
        delta = _look_ahead(GB, S)

        def windows() -> int | None:  # in the pass, once known (from the source or the state)
            return source.num_windows if source.num_windows is not None else self.n

        t_hi = emission_time(k, num_windows=windows(), **order)
        skip = k - emitted_before(t_hi, num_windows=windows(), **order)
        ids = times = np.zeros(0, np.int64)  # windows of positions k, k+1, … and their times
        while (n := windows()) is None or k < n:
            want = GB if n is None else min(GB, n - k)
            while len(ids) < want:
                assert n is None or t_hi < n + S, "the pass emitted fewer windows than it holds"
                source.confirm(t_hi + delta)
                n = windows()
                more, more_t = emission_order(t_hi, t_hi + delta, num_windows=n, **order)
                ids = np.concatenate([ids, more[skip:]])
                times = np.concatenate([times, more_t[skip:]])
                skip, t_hi = 0, t_hi + delta
                want = GB if n is None else min(GB, n - k)
            t0 = time.perf_counter()
            batch = self._assemble(source, ids[:want], k, n)
            self.stats["assemble"] += time.perf_counter() - t0
            ids, times, k = ids[want:], times[want:], k + GB
            need = plan.offset + max(0, (int(times[0]) if len(times) else t_hi) - S + 1) * L
            source.release(need)
            self._put(("batch", batch, k, source.resume_from(need), windows()))
        return k

    def _assemble(self, source, windows: np.ndarray, k: int, n: int | None) -> dict:
        """This rank's rows of the global batch at k; rows past the pass come from the store."""
        B, L = self.B, self.plan.seq_len
        out = {"inputs": np.empty((B, L), np.int32), "targets": np.empty((B, L), np.int32)}
        q = self.rank * B + np.arange(B)
        for row, j in enumerate(q.tolist()):
            if j < len(windows):
                source.copy(int(windows[j]), out, row)
        late = q >= len(windows)
        if late.any():  # the global batch runs past the end of the pass: epoch 1 of the store
            other = self._store_loader(n).batch_at(k)
            for name in out:
                out[name][late] = other[name][late]
        return out

    def _store_loader(self, n: int | None) -> Loader:
        if self.inner is None:
            self._wait_store()
            self.inner = Loader(self.plan.store_dir, seq_len=self.plan.seq_len, batch_size=self.B,
                                seed=self.plan.seed, rank=self.rank, world_size=self.W)
            if n is not None and self.inner.samples_per_epoch != n:
                raise StoreError(f"{self.plan.store_dir}: holds {self.inner.samples_per_epoch:,} "
                                 f"windows, the pass streamed {n:,}; delete it and run again")
        return self.inner

    def _open_store(self) -> TokenStore | None:
        done = (self.plan.store_dir / MANIFEST).exists()
        return TokenStore(self.plan.store_dir) if done else None

    def _wait_store(self) -> None:
        """Until the cache store is complete: wait for its writer, or write it if nobody does."""
        if not _wait_store(self.plan, self.tok, self.stats, self.stop, self._write_store):
            raise _Stopped

    def _write_store(self, writer: _CacheWriter) -> None:
        """Read the whole input into ``writer``: nobody else is writing the cache store."""
        source = self._text_source(None, writer)
        try:
            source.drain()
        finally:
            source.close()
