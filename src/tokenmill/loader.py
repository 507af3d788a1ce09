"""Loader: batches as a pure function of the step, assembled ahead by workers, exactly resumable.

Batch k of rank r is a function of (store fingerprints, layout config, seed, k, rank,
world_size) alone: the global batch g holds global sample positions [g·B·W, (g+1)·B·W), rank r
takes its B of them, a mixture schedule sends each position to a store, and the store's epoch
permutation picks the sample. So ``state_dict()`` is three numbers, any worker can compute any
batch, and ``num_workers`` never changes the output.

Batches are dicts of numpy arrays of shape (batch_size, seq_len): ``inputs``, ``targets`` and, for
the packed layout, ``segment_ids``, ``positions``, ``loss_mask``. They are filled in place into a
small ring of preallocated buffers; a buffer is reused only when nothing outside the loader still
references it (checked by reference count), so a batch you keep is never overwritten.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import xxhash

from tokenmill import pack, sampler
from tokenmill.errors import ConfigError
from tokenmill.store import TokenStore

STATE_VERSION = 1
LAYOUTS = ("concat", "packed")
TUNE_WINDOW = 50  # steps between prefetch decisions
TUNE_WAIT_FRACTION = 0.01  # deepen prefetch while data wait is above 1%
MAX_PREFETCH = 64
PREFETCH_MEMORY_BUDGET = 1 << 30  # never let prefetch buffers grow past 1 GiB


@dataclass(frozen=True)
class LayoutConfig:
    """What decides the content of the sample stream (and so goes into the fingerprint)."""

    seq_len: int
    layout: str = "concat"
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.seq_len, (int, np.integer)) or self.seq_len < 1:
            raise ConfigError(f"seq_len must be an int >= 1 (got seq_len={self.seq_len!r})")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {LAYOUTS} (got layout={self.layout!r})")
        if not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ConfigError(f"seed must be an int >= 0 (got seed={self.seed!r})")


class SampleSource:
    """One store seen through a layout: how many samples an epoch has and how to fill rows."""

    def __init__(self, store: TokenStore, config: LayoutConfig, salt: int, cache_dir=None):
        self.store, self.config, self.salt = store, config, salt
        L = config.seq_len
        if config.layout == "concat":
            if store.num_tokens < 2 * L:
                raise ConfigError(f"{store.path}: {store.num_tokens:,} tokens is too few for "
                                  f"seq_len={L} (need at least {2 * L:,})")
            self.num_samples = pack.concat_num_samples(store.num_tokens, L)
            self.packed = None
        else:
            key = f"{store.fingerprint}"
            self.packed = pack.load_or_build_packed(
                Path(cache_dir) if cache_dir else Path(store.local_dir) / "layouts", key=key,
                doc_lengths=store.doc_lengths, seq_len=L)
            self.num_samples = self.packed.num_rows
        self._shard_starts = store.shard_token_starts
        self._shard_start_list = store.shard_token_starts.tolist()
        self._shards = [store.shard(i) for i in range(store.num_shards)]

    def addresses(self, draws: np.ndarray) -> np.ndarray:
        """Where this store's draws number ``draws`` (0, 1, 2, …) live: the first token of a
        concat window, or the id of a packed row."""
        epochs, idx = np.divmod(draws, self.num_samples)
        out = np.empty_like(idx)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            perm = sampler.epoch_permutation(self.num_samples, seed=self.config.seed, epoch=e,
                                             salt=self.salt)
            ids = perm(idx[sel])
            if self.packed is None:
                offset = pack.concat_offset(self.config.seq_len, seed=self.config.seed, epoch=e)
                ids = pack.concat_starts(ids, seq_len=self.config.seq_len, offset=offset)
            out[sel] = ids
        return out

    def fill(self, addrs: np.ndarray, rows: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Write the samples at ``addrs`` into rows ``rows`` of the batch arrays ``out``."""
        if self.packed is not None:
            pack.fill_packed_rows(self.packed, addrs, self.store.tokens, out, rows)
            return
        L = self.config.seq_len
        shard = np.searchsorted(self._shard_starts, addrs, side="right") - 1
        inputs, targets = out["inputs"], out["targets"]
        starts = self._shard_start_list
        for row, s, k in zip(rows.tolist(), addrs.tolist(), shard.tolist()):
            local = s - starts[k]
            data = self._shards[k]
            if local + L + 1 <= len(data):  # the usual case: one shard, two slice copies
                inputs[row] = data[local:local + L]
                targets[row] = data[local + 1:local + L + 1]
            else:
                self.store.copy_tokens(s, inputs[row])
                self.store.copy_tokens(s + 1, targets[row])


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size: as given, else torch.distributed's if initialised, else RANK/WORLD_SIZE."""
    if rank is None or world_size is None:
        dist = sys.modules.get("torch.distributed")  # never import torch ourselves
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"need 0 <= rank < world_size (got rank={rank}, world_size={world_size})")
    return rank, world_size


def _open_sources(source, config: LayoutConfig, cache_dir) -> tuple[list[SampleSource], list[float]]:
    if isinstance(source, Mapping):
        items = list(source.items())
        if not items:
            raise ConfigError("a mixture needs at least one store (got an empty mapping)")
    else:
        items = [(source, 1.0)]
    stores, weights = [], []
    for i, (s, w) in enumerate(items):
        if not isinstance(w, (int, float)) or not np.isfinite(w) or w <= 0:
            raise ConfigError(f"mixture weights must be finite and > 0 (got {w!r} for {s})")
        store = s if isinstance(s, TokenStore) else TokenStore(s)
        stores.append(SampleSource(store, config, salt=i, cache_dir=cache_dir))
        weights.append(float(w))
    return stores, weights


def fingerprint_of(sources: list[SampleSource], weights: list[float], config: LayoutConfig) -> str:
    """Hash of everything the sample stream depends on, except batch size and world size."""
    core = {"stores": [(s.store.fingerprint, w) for s, w in zip(sources, weights)],
            "seq_len": config.seq_len, "layout": config.layout, "seed": config.seed}
    return xxhash.xxh3_64_hexdigest(json.dumps(core, sort_keys=True).encode())


class BatchPlan:
    """Pure mapping from global sample positions to filled batch rows (no state but a cache)."""

    BLOCK = 4096  # positions resolved at once: one vectorized permutation call per block

    def __init__(self, sources: list[SampleSource], weights: list[float], dtype: np.dtype):
        self.sources = sources
        self.schedule = sampler.mixture_schedule(weights) if len(sources) > 1 else None
        self.dtype = np.dtype(dtype)
        self.packed = sources[0].packed is not None
        self.seq_len = sources[0].config.seq_len
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def new_buffers(self, batch_size: int) -> dict[str, np.ndarray]:
        """Freshly allocated arrays for one batch."""
        shape = (batch_size, self.seq_len)
        bufs = {"inputs": np.empty(shape, self.dtype), "targets": np.empty(shape, self.dtype)}
        if self.packed:
            bufs.update(segment_ids=np.empty(shape, np.int32), positions=np.empty(shape, np.int32),
                        loss_mask=np.empty(shape, np.uint8))
        return bufs

    def resolve(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(store id, address) of every global sample position."""
        first, last = int(positions[0]), int(positions[-1])
        b = first // self.BLOCK
        if last // self.BLOCK == b and last - first == len(positions) - 1:  # the usual case
            sid, addr = self._block(b)
            lo = first - b * self.BLOCK
            return sid[lo:lo + len(positions)], addr[lo:lo + len(positions)]
        blocks = positions // self.BLOCK
        parts = [self.resolve(positions[blocks == b]) for b in np.unique(blocks)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if (hit := self._blocks.get(b)) is not None:
                return hit
        pos = np.arange(b * self.BLOCK, (b + 1) * self.BLOCK, dtype=np.int64)
        if self.schedule is None:
            sid, draws = np.zeros(len(pos), np.int64), pos
        else:
            sid, draws = sampler.assign(self.schedule, pos)
        addr = np.empty(len(pos), np.int64)
        for s in np.unique(sid).tolist():
            sel = sid == s
            addr[sel] = self.sources[s].addresses(draws[sel])
        with self._lock:
            if len(self._blocks) >= 8:  # a few blocks cover prefetch across a block boundary
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[b] = (sid, addr)
        return sid, addr

    @functools.lru_cache(maxsize=4)
    def _rows(self, n: int) -> np.ndarray:
        return np.arange(n)

    def fill(self, positions: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Fill ``out`` with the samples at global ``positions`` (one per row)."""
        sid, addr = self.resolve(positions)
        if self.schedule is None:
            self.sources[0].fill(addr, self._rows(len(positions)), out)
            return
        for s in np.unique(sid).tolist():
            rows = np.flatnonzero(sid == s)
            self.sources[s].fill(addr[rows], rows, out)


class _Ring:
    """Reusable batch buffers; one is reused only when no outside reference to it remains."""

    def __init__(self, make, size: int):
        self.make, self.size = make, size
        self.free: deque[dict] = deque()
        self.free_refs: list[int] = []
        self.out: deque[dict] = deque()  # handed to the user, oldest first

    def take(self) -> dict[str, np.ndarray]:
        """A buffer set that nothing else references (reclaimed or new)."""
        while self.out and _refcounts(self.out[0]) == self.free_refs:
            self.free.append(self.out.popleft())
        if self.free:
            return self.free.popleft()
        if len(self.out) >= self.size:  # the user keeps old batches: let them own those
            self.out.popleft()
        bufs = self.make()
        # what an array's count reads when only the ring's dict holds it, measured the same way
        self.free_refs = _refcounts(bufs)
        return bufs

    def hand_out(self, bufs: dict) -> dict:
        """Record ``bufs`` as given to the user; returns a new dict over the same arrays."""
        self.out.append(bufs)
        return dict(bufs)

    def reclaim(self, bufs: dict) -> None:
        """Return a buffer set that was never handed out."""
        self.free.append(bufs)


def _refcounts(bufs: dict) -> list[int]:
    # a user's dict, a view (its .base) or a tensor from from_numpy each add one reference
    return [sys.getrefcount(a) for a in bufs.values()]


class Loader:
    """Batches of (batch_size, seq_len) token arrays from one store or a weighted mixture.

    ``for batch in Loader("store/", seq_len=2048, batch_size=8): ...``; batch k is the same for
    any num_workers, and ``load_state_dict(state_dict())`` resumes bit for bit.
    """

    def __init__(self, source: str | os.PathLike | TokenStore | Mapping, *, seq_len: int,
                 batch_size: int, layout: str = "concat", seed: int = 0,
                 rank: int | None = None, world_size: int | None = None,
                 num_workers: int | str = "auto", prefetch: int | str = "auto",
                 epochs: int | None = None, dtype: str = "int32", worker_type: str = "thread",
                 cache_dir: str | os.PathLike | None = None):
        self.config = LayoutConfig(seq_len=seq_len, layout=layout, seed=seed)
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1 (got batch_size={batch_size!r})")
        if np.dtype(dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise ConfigError(f"dtype must be 'int32' or 'int64' (got dtype={dtype!r})")
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise ConfigError(f"epochs must be None or an int >= 1 (got epochs={epochs!r})")
        if worker_type not in ("thread", "process"):
            raise ConfigError(f"worker_type must be 'thread' or 'process' (got {worker_type!r})")
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.batch_size = int(batch_size)
        self.epochs = epochs
        self.worker_type = worker_type
        self.num_workers = _resolve_workers(num_workers)
        self.prefetch = _resolve_prefetch(prefetch, self.num_workers)
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        sources, self.weights = _open_sources(source, self.config, self.cache_dir)
        self.plan = BatchPlan(sources, self.weights, np.dtype(dtype))
        self.fingerprint = fingerprint_of(sources, self.weights, self.config)
        self.samples_per_epoch = sum(s.num_samples for s in sources)
        global_batch = self.batch_size * self.world_size
        if self.samples_per_epoch < global_batch:
            raise ConfigError(f"batch_size × world_size = {global_batch:,} samples is more than "
                              f"one epoch holds ({self.samples_per_epoch:,} samples of "
                              f"seq_len {seq_len}); lower batch_size or seq_len")
        self._consumed = 0
        self._auto_prefetch = prefetch == "auto"
        self._tuning = {"wait": 0.0, "steps": 0, "since": None}
        self._assemble_s = 0.0
        self._stage_lock = threading.Lock()
        self._ready = 0
        self._pool = None
        self._closed = False
        self._iterating = None
        self._finalizer = weakref.finalize(self, _shutdown, [None])
        self._ring = _Ring(lambda: self.plan.new_buffers(self.batch_size),
                           size=self.prefetch + 2)

    @classmethod
    def from_text(cls, inputs, *, tokenizer: str = "bytes", seq_len: int, batch_size: int,
                  cache_dir: str | os.PathLike, seed: int = 0, rank: int | None = None,
                  world_size: int | None = None, num_workers: int | str = "auto",
                  shuffle_buffer: int | None = None, **options: Any):
        """Streaming mode: batches straight from raw text, no prepare step (a StreamLoader).

        Worker processes tokenize ``inputs`` as batches are needed; the first pass is shuffled
        through a buffer of ``shuffle_buffer`` windows and cached as a store under ``cache_dir``,
        which later epochs read. ``options`` are ``prepare``'s (text_key, shard_tokens, …).
        See docs/streaming.md.
        """
        from tokenmill.stream import StreamLoader
        return StreamLoader(inputs, tokenizer=tokenizer, seq_len=seq_len, batch_size=batch_size,
                            cache_dir=cache_dir, seed=seed, rank=rank, world_size=world_size,
                            num_workers=num_workers, shuffle_buffer=shuffle_buffer, **options)

    # ---- the stream -------------------------------------------------------------------------

    @property
    def global_batch_size(self) -> int:
        """Samples per step across all ranks."""
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        """Steps per epoch (an epoch = every sample of every store once)."""
        return self.samples_per_epoch // self.global_batch_size

    @property
    def total_steps(self) -> int | None:
        """Steps until the end of ``epochs``, counted from the start (None: runs forever)."""
        if self.epochs is None:
            return None
        return self.epochs * self.samples_per_epoch // self.global_batch_size

    def positions(self, consumed: int) -> np.ndarray:
        """This rank's global sample positions of the step that starts at ``consumed``."""
        start = consumed + self.rank * self.batch_size
        return np.arange(start, start + self.batch_size, dtype=np.int64)

    def batch_at(self, consumed: int, out: dict[str, np.ndarray] | None = None) -> dict:
        """The batch of the step starting at global sample ``consumed`` (pure; for tests/tools)."""
        out = self.plan.new_buffers(self.batch_size) if out is None else out
        self.plan.fill(self.positions(consumed), out)
        return out

    def _remaining(self) -> int | None:
        if self.epochs is None:
            return None
        end = self.total_steps * self.global_batch_size
        return max(0, (end - self._consumed) // self.global_batch_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        if self._closed:
            raise RuntimeError("this Loader is closed")
        self._iterating = object()
        return self._batches(self._iterating)

    def _batches(self, token) -> Iterator[dict[str, np.ndarray]]:
        gb = self.global_batch_size
        remaining = self._remaining()
        if self.num_workers == 0:
            while remaining is None or remaining > 0:
                bufs = self._ring.take()
                self._timed_fill(self.positions(self._consumed), bufs)
                if self._iterating is not token:
                    return
                self._consumed += gb
                remaining = None if remaining is None else remaining - 1
                yield self._ring.hand_out(bufs)
            return
        pool = self._ensure_pool()
        ahead: deque[tuple[Future, dict]] = deque()
        nxt = self._consumed
        n_left = remaining
        clock = time.perf_counter
        try:
            while True:
                while len(ahead) < self.prefetch and (n_left is None or n_left > 0):
                    bufs = self._ring.take()
                    ahead.append((pool.submit(self._timed_fill, self.positions(nxt), bufs), bufs))
                    nxt += gb
                    n_left = None if n_left is None else n_left - 1
                if not ahead:
                    return
                fut, bufs = ahead.popleft()
                self._ready = sum(f.done() for f, _ in ahead) + fut.done()
                t0 = clock()
                fut.result()  # a worker's exception surfaces here with its own traceback
                if self._iterating is not token:
                    return
                self._consumed += gb
                self._tune(clock() - t0, clock())
                yield self._ring.hand_out(bufs)
        finally:
            for fut, bufs in ahead:  # prefetched, never handed out: not consumed
                fut.cancel()
                try:
                    fut.result()
                except BaseException:
                    pass
                self._ring.reclaim(bufs)

    def _timed_fill(self, positions: np.ndarray, bufs: dict) -> None:
        t0 = time.perf_counter()
        self.plan.fill(positions, bufs)
        with self._stage_lock:
            self._assemble_s += time.perf_counter() - t0

    def _tune(self, waited: float, now: float) -> None:
        """prefetch="auto": one batch deeper whenever a window of steps waited over 1% of its
        wall time, within the memory budget."""
        if not self._auto_prefetch:
            return
        t = self._tuning
        if t["since"] is None:  # the first batch is never prefetched: start counting after it
            t["since"] = now
            return
        t["wait"] += waited
        t["steps"] += 1
        if t["steps"] < TUNE_WINDOW:
            return
        wall = now - t["since"]
        deeper = self.prefetch + 1
        if (wall > 0 and t["wait"] / wall > TUNE_WAIT_FRACTION and deeper <= MAX_PREFETCH and
                self.buffer_bytes(deeper) <= PREFETCH_MEMORY_BUDGET):
            self.prefetch = deeper
            self._ring.size = deeper + 2
        t.update(wait=0.0, steps=0, since=now)

    # ---- what the Meter reads (metrics.Instrumented) -----------------------------------------

    def stage_times(self) -> dict[str, float]:
        """Cumulative seconds spent assembling batches (in workers, or inline)."""
        pool_s = getattr(self._pool, "assemble_s", 0.0)
        return {"assemble": self._assemble_s + pool_s}

    def queue_depth(self) -> int:
        """Batches computed ahead and ready when the last one was handed out."""
        return self._ready

    def buffer_bytes(self, prefetch: int | None = None) -> int:
        """Host memory the batch buffers take at a prefetch depth (ring = depth + 2 batches)."""
        per_batch = sum(a.nbytes for a in self.plan.new_buffers(self.batch_size).values())
        return per_batch * ((self.prefetch if prefetch is None else prefetch) + 2)

    def _ensure_pool(self):
        if self._pool is None:
            if self.worker_type == "thread":
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="tokenmill")
            else:
                from tokenmill.workers import ProcessPool
                self._pool = ProcessPool(self.num_workers, self._plan_spec())
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _shutdown, [self._pool])
        return self._pool

    def _plan_spec(self) -> dict:
        """What a worker process needs to rebuild the same BatchPlan."""
        # open arguments (path or URL, cache, storage options), reopened inside the worker's
        # error handling so a bad store becomes the consumer's error, not a dead worker
        return {"stores": [s.store.open_args() for s in self.plan.sources], "weights": self.weights,
                "seq_len": self.config.seq_len, "layout": self.config.layout,
                "seed": self.config.seed, "dtype": self.plan.dtype.name,
                "cache_dir": self.cache_dir, "batch_size": self.batch_size}

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The smallest state that reproduces the stream: JSON-able, independent of world size."""
        return {"version": STATE_VERSION, "consumed_samples": int(self._consumed),
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; refuses a state from other stores or another layout/seed."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ConfigError(f"unsupported loader state (want version {STATE_VERSION}): {state!r}")
        if state.get("fingerprint") != self.fingerprint:
            raise ConfigError(f"loader state fingerprint {state.get('fingerprint')!r} does not match "
                              f"this loader's {self.fingerprint!r}: the stores, seq_len, layout, "
                              "seed or mixture weights differ from the run that saved it")
        consumed = state.get("consumed_samples")
        if not isinstance(consumed, int) or consumed < 0:
            raise ConfigError(f"consumed_samples must be an int >= 0 (got {consumed!r})")
        self._iterating = None  # an iterator from before the load stops
        self._consumed = consumed

    @property
    def consumed_samples(self) -> int:
        """Global samples handed out so far (all ranks), prefetched ones excluded."""
        return self._consumed

    @property
    def layout_stats(self) -> dict[str, Any]:
        """Samples per epoch, and for packed rows the padding fraction and truncation count."""
        stats: dict[str, Any] = {"samples_per_epoch": self.samples_per_epoch,
                                 "steps_per_epoch": len(self)}
        if self.plan.packed:
            rows = sum(s.packed.num_rows for s in self.plan.sources)
            stats["padding_fraction"] = sum(s.packed.padding_fraction * s.packed.num_rows
                                            for s in self.plan.sources) / rows
            stats["num_truncated"] = sum(s.packed.num_truncated for s in self.plan.sources)
        if self.plan.schedule is not None:
            stats["mixture_weights"] = [float(w) for w in self.plan.schedule.weights]
        return stats

    # ---- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop workers and release buffers; safe to call twice."""
        self._closed = True
        self._iterating = None
        self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shutdown(holder: list) -> None:
    pool = holder[0]
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def _resolve_workers(num_workers: int | str) -> int:
    if num_workers == "auto":
        # one background thread: batch k+1 is assembled while the step runs (numpy copies
        # release the GIL); a pool that competes with the training step for 2 cores loses
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return 1 if (cores or 1) > 1 else 0
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be an int >= 0 or 'auto' (got {num_workers!r})")
    return num_workers


def _resolve_prefetch(prefetch: int | str, num_workers: int) -> int:
    if prefetch == "auto":
        return 2 * max(1, num_workers)  # a starting depth; deepened while data wait > 1%
    if not isinstance(prefetch, int) or prefetch < 1:
        raise ConfigError(f"prefetch must be an int >= 1 or 'auto' (got {prefetch!r})")
    return prefetch


def memory_plan(*, seq_len: int, batch_size: int, layout: str = "concat", dtype: str = "int32",
                prefetch: int = 2, num_documents: int = 0) -> dict[str, int]:
    """Bytes the Loader's buffers take for a config: batch ring, and the packed layout if any.

    memory_plan(seq_len=2048, batch_size=8, prefetch=2)["batch_ring"] == 2 * 8 * 2048 * 4 * 4
    """
    per_row = seq_len * np.dtype(dtype).itemsize * 2
    if layout == "packed":
        per_row += seq_len * (4 + 4 + 1)  # segment_ids, positions, loss_mask
    ring = per_row * batch_size * (prefetch + 2)
    # packed layout: row_ptr + (start, len, doc) per segment, about 1.1 segments per document
    packed = int(num_documents * 1.1 * 24 + num_documents * 8) if layout == "packed" else 0
    return {"batch_ring": ring, "packed_layout": packed, "total": ring + packed}
