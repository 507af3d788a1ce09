"""Streaming mode: raw text is tokenized inside the loader's workers and cached as a store.

    loader = Loader.from_text(["data/*.jsonl.zst"], tokenizer="tokenizer.json", seq_len=2048,
                              batch_size=8, cache_dir="cache/")
    for batch in loader: ...     # {"inputs", "targets"}: int32 (8, 2048); state_dict() resumes

This module owns ``StreamLoader`` — the batch interface, what a pass depends on (``_Plan``), the
state and resume — and re-exports the order's functions. The work is done by:

- ``streampass``: the shuffle-buffer order (``emission_order`` …) and the producer thread that
  assembles batches and hands over to a store Loader at the end of the pass;
- ``streampool``: the tokenizing worker processes, their results in unit order, and the windows
  held from them;
- ``streamcache``: writing the cache store while streaming (lock, progress file, takeover).

The pass (epoch 0). Spawn-started worker processes read and tokenize the work units of
``sources.plan_units``, as ``prepare`` does; results are consumed strictly in unit order, so the
token stream (documents + EOS, back to back) is the one ``prepare`` writes, for any worker count.
It is cut into the store Loader's epoch-0 concat windows — window i is tokens
[o + i·L, o + i·L + L] with o = ``pack.concat_offset(L, seed=seed, epoch=0)`` — and a shuffle
buffer of S windows reorders them without any RNG state: window i waits
d_i = hash(DELAY_TAG, seed, i) mod min(S, i + 1) steps and windows leave in order of (i + d_i, i).
(The min lets the stream start at once instead of after filling the buffer; the first S windows
are mixed less.) Sample k of the pass is therefore a pure function of (inputs, L, seed, S, k); no
window moves by S or more, and the tokens held stay under (S + 2Δ + 2)·L plus two units, with
Δ = max(global batch, min(S // 4, 256)) windows, the times ordered at once.

Resume. The buffer is never stored. From k alone, a binary search over ``emitted_before`` finds
the time t of emission k; the windows still buffered are those from t − S + 1 on, so reading
restarts at ``resume_from`` = (unit, doc, token), the start of the unit holding that window's
first token, and the buffer is replayed exactly. A missing or too-late ``resume_from`` only makes
reading start earlier (at the cache writer's cursor, or at the beginning): slower, never different.

The cache (``streamcache``). The documents are written to ``cache_dir/stream-<key>/`` as they
are read, byte for byte the store ``prepare(inputs, out=…)`` makes with the same options, by the
one process holding its lock; a crashed pass resumes its writing. Once the store is complete,
epoch 0 is served from it in the same order without tokenizing, and global samples from
``pass_samples`` on are the store Loader's (global shuffle, epochs 1, 2, …).

Ranks: every rank streams the whole input and takes its slice of each global batch, as the store
Loader does: the order does not depend on world size and every rank gets the same step count.
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import xxhash

from tokenmill import pack, sources
from tokenmill.errors import ConfigError
from tokenmill.loader import STATE_VERSION as LOADER_STATE_VERSION
from tokenmill.loader import LayoutConfig, resolve_rank
from tokenmill.prepare import PrepareConfig
from tokenmill.streampass import _look_ahead, _Producer
from tokenmill.streampool import CURSOR_FIELDS, UNITS_PER_WORKER, _load_tokenizer, _resolve_workers
from tokenmill.tokenizer import token_dtype

# re-exported: the order's functions (tests, docs/streaming.md) and the names that lived here
from tokenmill.streamcache import PROGRESS_FILE, WAIT_WARNING_S  # noqa: F401
from tokenmill.streampass import (DELAY_TAG, READY_BATCHES, emission_order,  # noqa: F401
                                  emission_time, emitted_before, window_delays)
from tokenmill.streampool import Cursor  # noqa: F401

STATE_VERSION = 1
DEFAULT_SHUFFLE_BUFFER = 4096  # windows: 8 Mi tokens at seq_len 2048, 16 MiB as uint16


# ---- what a pass depends on ---------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    """Everything a pass depends on, fixed when the loader is built."""

    config: PrepareConfig
    storage_options: Mapping | None
    units: tuple
    list_skips: tuple
    settings: dict
    key: str
    store_dir: Path
    lock_path: Path
    dtype: np.dtype
    seq_len: int
    seed: int
    shuffle_buffer: int
    num_workers: int

    @property
    def offset(self) -> int:
        """Where epoch 0's windows start (the store Loader's epoch-0 offset)."""
        return pack.concat_offset(self.seq_len, seed=self.seed, epoch=0)

    def order(self) -> dict:
        return {"seed": self.seed, "shuffle_buffer": self.shuffle_buffer}


def _file_stamps(files: Sequence[str], storage_options) -> tuple[dict[str, int], list]:
    """Each file's size (as prepare records it) and modification time."""
    sizes, mtimes = {}, []
    for f in files:
        try:
            if "://" in f:
                import fsspec
                fs, p = fsspec.core.url_to_fs(f, **(storage_options or {}))
                info = fs.info(p)
                sizes[f] = int(fs.size(p) or 0)
                mtimes.append(str(info.get("mtime") or info.get("LastModified") or ""))
            else:
                st = os.stat(f)
                sizes[f] = st.st_size
                mtimes.append(st.st_mtime_ns)
        except OSError:
            sizes[f] = 0
            mtimes.append(0)
    return sizes, mtimes


# ---- the loader ---------------------------------------------------------------------------------

class StreamLoader:
    """Batches straight from raw text (tokenized by worker processes), cached as a store.

    Made by ``Loader.from_text``; the same batch interface as ``Loader``: dicts of int32
    ``inputs``/``targets`` of shape (batch_size, seq_len), ``state_dict``/``load_state_dict``,
    ``close``, ``stage_times``/``queue_depth`` for the Meter.
    """

    def __init__(self, inputs: str | os.PathLike | Sequence, *, tokenizer: str = "bytes",
                 seq_len: int, batch_size: int, cache_dir: str | os.PathLike, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None,
                 num_workers: int | str = "auto", shuffle_buffer: int | None = None,
                 storage_options: dict | None = None, **options: Any):
        self.config = LayoutConfig(seq_len=seq_len, layout="concat", seed=seed)
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1 (got batch_size={batch_size!r})")
        S = DEFAULT_SHUFFLE_BUFFER if shuffle_buffer is None else shuffle_buffer
        if isinstance(S, bool) or not isinstance(S, (int, np.integer)) or S < 1:
            raise ConfigError(f"shuffle_buffer must be an int >= 1 (windows; got "
                              f"shuffle_buffer={S!r})")
        if cache_dir is None:
            raise ConfigError("cache_dir is required: the first pass is cached there as a store")
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.batch_size, self.shuffle_buffer = int(batch_size), int(S)
        self.epochs = self.total_steps = None  # streams run until you stop
        config = PrepareConfig(tokenizer=os.fspath(tokenizer), **options)
        self._tok = _load_tokenizer(config)
        if config.add_bos and self._tok.bos_id is None:
            raise ConfigError(f"add_bos=True but tokenizer {config.tokenizer!r} has no BOS token; "
                              "pass bos='…'")
        if isinstance(inputs, (str, os.PathLike)):
            inputs = [inputs]
        inputs = [os.fspath(i) for i in inputs]
        files, list_skips = sources.list_files(inputs, on_error=config.on_error,
                                               storage_options=storage_options)
        sizes, mtimes = _file_stamps(files, storage_options)
        settings = config.settings(inputs, files, sizes)
        # the store's bytes depend on these; the cursors in progress files and states on units too
        content = _digest({"settings": settings, "mtimes": mtimes,
                           "tokenizer": self._tok.identity()})[:16]
        key = _digest({"content": content, "unit_bytes": config.unit_bytes})
        cache_dir = Path(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        units = sources.plan_units(files, config.source_config(storage_options))
        self._plan = _Plan(config=config, storage_options=storage_options, units=tuple(units),
                           list_skips=tuple(list_skips), settings=settings, key=key,
                           store_dir=cache_dir / f"stream-{content}",
                           lock_path=cache_dir / f"stream-{content}.lock",
                           dtype=token_dtype(self._tok.vocab_size), seq_len=int(seq_len),
                           seed=int(seed), shuffle_buffer=self.shuffle_buffer,
                           num_workers=_resolve_workers(num_workers))
        self.fingerprint = _digest({"stream": STATE_VERSION, "key": key, "seq_len": int(seq_len),
                                    "seed": int(seed), "shuffle_buffer": self.shuffle_buffer})[:16]
        self._consumed, self._hint, self._pass_samples = 0, None, None
        self._stats = {"tokenization": 0.0, "write": 0.0, "assemble": 0.0}
        self._memory = {"peak_tokens": 0}
        self._parts: list = [None, None]  # the producer, the store Loader of later epochs
        self._error: BaseException | None = None
        self._closed = False
        self._iterating = None
        self._finalizer = weakref.finalize(self, _shutdown, self._parts)

    # ---- the stream -------------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        """Tokenizing worker processes (0: tokenize in the loader's thread)."""
        return self._plan.num_workers

    @property
    def store_path(self) -> Path:
        """Where the first pass is cached as a store (complete once it holds manifest.json)."""
        return self._plan.store_dir

    @property
    def global_batch_size(self) -> int:
        """Samples per step across all ranks."""
        return self.batch_size * self.world_size

    @property
    def consumed_samples(self) -> int:
        """Global samples handed out so far (all ranks), prefetched ones excluded."""
        return self._consumed

    @property
    def pass_samples(self) -> int | None:
        """Samples in one epoch (concat windows of the whole input); None until the pass ends."""
        return self._pass_samples

    def __len__(self) -> int:
        """Steps per epoch, once the first pass has ended."""
        if self._pass_samples is None:
            raise TypeError("steps per epoch are unknown until the first pass over the text ends")
        return self._pass_samples // self.global_batch_size

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        if self._closed:
            raise RuntimeError("this loader is closed")
        self._iterating = token = object()
        return self._batches(token)

    def _batches(self, token) -> Iterator[dict[str, np.ndarray]]:
        while self._iterating is token:
            if self._error is not None:
                raise self._error
            inner = self._parts[1]
            if inner is not None:
                for batch in inner:
                    self._consumed = inner.consumed_samples
                    yield batch
                    if self._iterating is not token:
                        return
                return
            if self._parts[0] is None:
                self._parts[0] = _Producer(
                    self._plan, self._tok, rank=self.rank, batch_size=self.batch_size,
                    world_size=self.world_size, stats=self._stats, memory=self._memory,
                    start=(self._consumed, self._hint, self._pass_samples))
            item = self._parts[0].get()
            if item[0] == "error":
                self._error = item[1]
                self._stop_producer()
                raise self._error
            if item[0] == "store":
                _, inner, k = item
                inner.load_state_dict({"version": LOADER_STATE_VERSION, "consumed_samples": k,
                                       "fingerprint": inner.fingerprint})
                self._parts[0].inner = None  # handed over: ours to close now
                self._stop_producer()
                self._parts[1], self._hint = inner, None
                self._pass_samples = inner.samples_per_epoch
                continue
            _, batch, self._consumed, self._hint, n = item
            self._pass_samples = n if n is not None else self._pass_samples
            yield batch

    def _stop_producer(self) -> None:
        if self._parts[0] is not None:
            self._parts[0].close()
            self._parts[0] = None

    # ---- what the Meter reads (metrics.Instrumented) -----------------------------------------

    def stage_times(self) -> dict[str, float]:
        """Cumulative seconds: reading + tokenizing (workers), writing the cache, assembling."""
        times = dict(self._stats)
        if self._parts[1] is not None:
            times["assemble"] += self._parts[1].stage_times()["assemble"]
        return times

    def queue_depth(self) -> int:
        """Batches assembled and waiting for the consumer."""
        if self._parts[1] is not None:
            return self._parts[1].queue_depth()
        return self._parts[0].out.qsize() if self._parts[0] is not None else 0

    def buffer_bytes(self) -> int:
        """Bytes of tokens the pass holds at most: the shuffle buffer and look-ahead, (S + 2Δ + 2)
        windows, plus two units held and the units in flight (a unit of unit_bytes of text is at
        most unit_bytes tokens with a byte-level tokenizer, plus its longest line), in the store's
        token dtype. Ready batches (8) and the workers' memory come on top (docs/streaming.md)."""
        p = self._plan
        delta = _look_ahead(self.global_batch_size, p.shuffle_buffer)
        units = (UNITS_PER_WORKER * p.num_workers + 3) * p.config.unit_bytes
        return ((p.shuffle_buffer + 2 * delta + 2) * p.seq_len + units) * p.dtype.itemsize

    @property
    def buffer_peak_tokens(self) -> int:
        """The most tokens the shuffle buffer held at once, in passes that ended or stopped."""
        return self._memory["peak_tokens"]

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position (and where reading may restart): small, JSON-able, independent of ranks."""
        resume = None if self._hint is None else dict(zip(CURSOR_FIELDS, map(int, self._hint)))
        return {"version": STATE_VERSION, "mode": "stream", "fingerprint": self.fingerprint,
                "consumed_samples": int(self._consumed), "pass_samples": self._pass_samples,
                "resume_from": resume}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; refuses one of other inputs, tokenizer, options, seq_len, seed
        or shuffle_buffer."""
        if (not isinstance(state, Mapping) or state.get("version") != STATE_VERSION
                or state.get("mode") != "stream"):
            raise ConfigError(f"unsupported stream loader state (want version {STATE_VERSION}, "
                              f"mode 'stream'): {state!r}")
        if state.get("fingerprint") != self.fingerprint:
            raise ConfigError(f"loader state fingerprint {state.get('fingerprint')!r} does not "
                              f"match this loader's {self.fingerprint!r}: the inputs (or their "
                              "sizes/times), tokenizer, options, seq_len, seed or shuffle_buffer "
                              "differ")
        k, n = state.get("consumed_samples"), state.get("pass_samples")
        resume = state.get("resume_from")
        if not isinstance(k, int) or k < 0 or not (n is None or isinstance(n, int) and n > 0):
            raise ConfigError(f"consumed_samples must be an int >= 0 and pass_samples None or an "
                              f"int > 0 (got {k!r}, {n!r})")
        hint = None
        if resume is not None:
            if isinstance(resume, Mapping):
                hint = tuple(resume.get(f) for f in CURSOR_FIELDS)
            if (hint is None or not all(isinstance(x, int) and x >= 0 for x in hint)
                    or hint[0] > len(self._plan.units)):
                raise ConfigError(f"resume_from must hold ints >= 0 {CURSOR_FIELDS} "
                                  f"(got {resume!r})")
        self._stop_producer()
        inner = self._parts[1]
        if inner is not None and n is not None and k >= n:
            inner.load_state_dict({"version": LOADER_STATE_VERSION, "consumed_samples": k,
                                   "fingerprint": inner.fingerprint})
        elif inner is not None:
            inner.close()
            self._parts[1] = None
        self._consumed, self._pass_samples, self._hint = k, n, hint
        self._iterating, self._error = None, None

    # ---- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the thread and the worker processes, release the cache; safe to call twice."""
        self._closed = True
        self._iterating = None
        self._finalizer()

    def __enter__(self) -> StreamLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shutdown(parts: list) -> None:
    producer, inner = parts
    parts[:] = [None, None]
    if producer is not None:
        producer.close()
    if inner is not None:
        inner.close()


def _digest(obj: Any) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(obj, sort_keys=True).encode())
