"""``StreamLoader``: batches straight from raw text, with the batch interface of ``Loader``.

    loader = Loader.from_text(["data/*.jsonl.zst"], tokenizer="tokenizer.json", seq_len=2048,
                              batch_size=8, cache_dir="cache/")
    for batch in loader: ...     # {"inputs", "targets"}: int32 (8, 2048); state_dict() resumes

It owns the state and the resume; the batches are made by a ``producer.Producer`` thread. The
state is small and JSON-able:

    {"version": 1, "mode": "stream", "fingerprint": "…", "consumed_samples": k,
     "pass_samples": n or null,
     "resume_from": {"unit": u, "doc": d, "token": T, "check": "…"} or null}

``resume_from`` is only a hint where reading may restart: one that is missing, has no check
(states of earlier versions) or starts later than needed makes reading start earlier (slower,
never different); one whose check does not match its numbers was edited, and is refused.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import asdict
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from tokenmill.load import pack
from tokenmill.base.errors import ConfigError, check_int
from tokenmill.load.lifetime import Iteration, OneIterator
from tokenmill.load.plan import LayoutConfig, resolve_rank
from tokenmill.load.ranks import CheckedFirst, agree
from tokenmill.load.state import STATE_VERSION, consumed_of, count_of
from tokenmill.prepare.pool import UNITS_PER_WORKER
from tokenmill.prepare.tokenize import PrepareConfig
from tokenmill.store.format import read_manifest
from tokenmill.store.reader import TokenStore
from tokenmill.streaming.cache import store_complete
from tokenmill.streaming.order import look_ahead
from tokenmill.streaming.plan import (Cursor, OrderSettings, StreamPlan, cursor_check,
                                      load_stream_tokenizer, plan_stream, resolve_stream_workers)
from tokenmill.streaming.producer import (READY_BATCHES, BatchSlice, Producer, StartAt, StepReady,
                                          StreamFailed, StreamStats)
from tokenmill.streaming.rows import pass_length
from tokenmill.tokenizer import Tokenizer

CURSOR_FIELDS = Cursor._fields


def open_single(inputs: str | os.PathLike | Sequence, *, tokenizer: str = "bytes", seq_len: int,
                batch_size: int, cache_dir: str | os.PathLike, seed: int = 0,
                rank: int | None = None, world_size: int | None = None,
                num_workers: int | str = "auto", shuffle_buffer: int | None = None,
                layout: str = "concat", max_segments: int | None = None,
                pack_window: int | None = None, storage_options: dict | None = None,
                **options: Any) -> StreamLoader:
    """A StreamLoader over ``inputs`` (what ``Loader.from_text`` returns); ``options`` are
    prepare's (text_key, txt_mode, on_error, shard_tokens, unit_bytes, add_bos, …)."""
    given = {"shuffle_buffer": shuffle_buffer, "pack_window": pack_window}
    order = OrderSettings(seq_len=seq_len, seed=seed, layout=layout, max_segments=max_segments,
                          **{k: v for k, v in given.items() if v is not None})
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if cache_dir is None:
        raise ConfigError("cache_dir is required: the first pass is cached there as a store")
    rank, world_size = resolve_rank(check_int("rank", rank, minimum=0, optional=True),
                                    check_int("world_size", world_size, minimum=1, optional=True))
    workers = resolve_stream_workers(num_workers)
    config = PrepareConfig(tokenizer=os.fspath(tokenizer), **options)
    tok = load_stream_tokenizer(config)
    plan = plan_stream(inputs, config, tok, cache_dir=cache_dir, order=order,
                       num_workers=workers, storage_options=storage_options)
    return StreamLoader(plan, tok, BatchSlice(rank=rank, world_size=world_size,
                                              batch_size=batch_size))


class StreamLoader(OneIterator):
    """Batches straight from raw text (tokenized by worker processes), cached as a store.

    Made by ``Loader.from_text`` (``open_single``); the same batch interface as ``Loader``: dicts
    of int32 ``inputs``/``targets`` of shape (batch_size, seq_len), ``state_dict``/
    ``load_state_dict``, ``close``, ``stage_times``/``queue_depth`` for the Meter.
    """

    def __init__(self, plan: StreamPlan, tokenizer: Tokenizer, part: BatchSlice):
        o = plan.order_settings
        self.config = LayoutConfig(seq_len=plan.seq_len, layout=o.layout, seed=plan.seed,
                                   max_segments=o.max_segments)
        self.rank, self.world_size, self.batch_size = part.rank, part.world_size, part.batch_size
        self.shuffle_buffer = plan.shuffle_buffer
        self.epochs = self.total_steps = None  # streams run until you stop
        self.fingerprint = plan.fingerprint
        self._plan, self._tok, self._part = plan, tokenizer, part
        self._consumed, self._hint, self._pass_samples = 0, None, None
        self._stats = StreamStats()
        self.ready_batches = READY_BATCHES  # batches the producer assembles ahead
        self._producer: list[Producer | None] = [None]  # shared with the finalizer
        self._error: BaseException | None = None
        self._finalizer = weakref.finalize(self, _shutdown, self._producer)

    # ---- the stream -------------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        """Tokenizing worker processes (0: tokenize in the loader's thread)."""
        return self._plan.num_workers

    @property
    def plan(self) -> StreamPlan:
        """What the pass depends on (inputs, options, order, layout, cache place)."""
        return self._plan

    @property
    def store_path(self):
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

    def _pass(self, token: Iteration) -> CheckedFirst:
        """The pass's batches, after the ranks agree."""
        return CheckedFirst(self.check_ranks, self._batches())

    def check_ranks(self) -> None:
        """Refuse, on every rank at once, settings or a position that differ from another
        rank's (``ranks.agree``); run at the first ``next()`` of each pass."""
        settings = {**asdict(self._plan.order_settings), "batch_size": self.batch_size,
                    "fingerprint": self.fingerprint, "consumed_samples": self._consumed}
        agree("stream loader", settings, rank=self.rank, world_size=self.world_size)

    def _batches(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            if self._error is not None:
                raise self._error
            if self._producer[0] is None:
                self._producer[0] = Producer(
                    self._plan, self._tok, self._part,
                    StartAt(self._consumed, self._hint, self._pass_samples), self._stats,
                    self.ready_batches)
            msg = self._producer[0].get()
            if isinstance(msg, StreamFailed):
                self._error = msg.error
                self._stop_producer()
                raise self._error
            assert isinstance(msg, StepReady)
            self._consumed, self._hint = msg.consumed, msg.resume_from
            if msg.pass_samples is not None:
                self._pass_samples = msg.pass_samples
            yield msg.batch

    def _stop_producer(self) -> None:
        if self._producer[0] is not None:
            self._producer[0].close()
            self._producer[0] = None

    # ---- what the Meter reads (metrics.Instrumented) -----------------------------------------

    def stage_times(self) -> dict[str, float]:
        """Cumulative seconds: reading + tokenizing (workers), writing the cache, assembling."""
        return dict(self._stats.seconds)

    def queue_depth(self) -> int:
        """Batches assembled and waiting for the consumer."""
        producer = self._producer[0]
        return producer.out.qsize() if producer is not None else 0

    def buffer_bytes(self) -> int:
        """Bytes of tokens the pass holds at most: the shuffle buffer and look-ahead, (S + 2Δ + 2)
        windows (packed: rows of seq_len + 1, plus two packing windows: the oldest row's and the
        one being read, each up to a document longer than W), plus two units held and the units
        in flight (a unit of unit_bytes of text is at most unit_bytes tokens with a byte-level
        tokenizer, plus its longest line), in the store's token dtype. Ready batches (8) and the
        workers' memory come on top (docs/streaming.md)."""
        p = self._plan
        delta = look_ahead(self.global_batch_size, p.shuffle_buffer)
        units = (UNITS_PER_WORKER * p.num_workers + 3) * p.config.unit_bytes
        window = 2 * p.window_tokens if p.packed else 0
        return ((p.shuffle_buffer + 2 * delta + 2) * (p.seq_len + p.packed) + window + units) \
            * p.dtype.itemsize

    @property
    def buffer_peak_tokens(self) -> int:
        """The most tokens the shuffle buffer held at once, in passes that ended or stopped."""
        return self._stats.peak_tokens

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position (and where reading may restart): small, JSON-able, independent of ranks."""
        resume = None
        if self._hint is not None:
            fields = CURSOR_FIELDS if self._plan.packed else CURSOR_FIELDS[:3]
            resume = {**{f: int(x) for f, x in zip(fields, self._hint)},
                      "check": cursor_check(self.fingerprint, self._hint)}
        return {"version": STATE_VERSION, "mode": "stream", "fingerprint": self.fingerprint,
                "consumed_samples": int(self._consumed), "pass_samples": self._pass_samples,
                "resume_from": resume, "settings": asdict(self._plan.order_settings)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; refuses one of other inputs, tokenizer, options, seq_len, seed
        or shuffle_buffer, and one whose resume_from or pass_samples contradicts this stream."""
        k, n, hint = check_state(state, self._plan)
        self._stop_producer()
        self._loaded(k)
        self._consumed, self._pass_samples, self._hint = k, n, hint
        self._error = None

def _shutdown(holder: list) -> None:
    producer, holder[0] = holder[0], None
    if producer is not None:
        producer.close()


# ---- checking a state at the door ---------------------------------------------------------------

def check_state(state: Mapping[str, Any],
                plan: StreamPlan) -> tuple[int, int | None, Cursor | None]:
    """(consumed_samples, pass_samples, resume_from) of a stream state, checked against the plan."""
    settings = state.get("settings") if isinstance(state, Mapping) else None
    k = consumed_of(state, plan.fingerprint, mode="stream", kind="stream loader",
                    differs=what_differs(settings, plan.order_settings, "the inputs (or their "
                                         "sizes/times), tokenizer or options"))
    n = count_of("pass_samples", state.get("pass_samples"), minimum=1, optional=True)
    if n is not None and store_complete(plan):
        have = pass_samples_of(plan)
        if have != n:
            raise ConfigError(f"pass_samples={n} in the loaded state does not match the pass, "
                              f"which holds {have:,} windows (cache store {plan.store_dir}): the "
                              "state was edited or comes from another run")
    return k, n, check_cursor(state.get("resume_from"), plan)


def what_differs(saved: Any, order: OrderSettings, others: str) -> str:
    """The end of a fingerprint message: the settings that differ from a state's record of them
    (``settings``: seq_len, seed, shuffle_buffer, layout, max_segments, pack_window), the saved
    run's value first; when none does, ``others`` (what else the fingerprint holds) differ."""
    now = asdict(order)
    if order.layout != "packed":  # concat: max_segments and pack_window take no part
        now = {k: v for k, v in now.items() if k not in ("max_segments", "pack_window")}
    if not isinstance(saved, Mapping):  # a state saved before the record: name every part
        return f"{others}, or {', '.join(now)} differ"
    diffs = [f"{k} {saved.get(k)!r} → {v!r}" for k, v in now.items() if saved.get(k) != v]
    if diffs:
        return (f"{', '.join(diffs)} (the saved run's → this loader's); make the loader with "
                "the saved run's settings to resume it")
    return f"{others} differ ({', '.join(now)} agree)"


def check_cursor(resume: Any, plan: StreamPlan) -> Cursor | None:
    """The state's resume_from as a Cursor: None when absent or unchecked (a state of an earlier
    version: reading starts earlier, never elsewhere); a ConfigError when it contradicts itself."""
    if resume is None or not isinstance(resume, Mapping) or "check" not in resume:
        return None  # no check: nothing ties it to this pass, so it is not even range-checked
    fields = CURSOR_FIELDS if plan.packed else CURSOR_FIELDS[:3]
    cursor = Cursor(*(count_of(f"resume_from[{f!r}]", resume.get(f),
                               maximum=len(plan.units) if f == "unit" else None) for f in fields))
    if resume["check"] != cursor_check(plan.fingerprint, cursor):
        raise ConfigError(f"resume_from={dict(resume)!r} does not match its check: it was edited "
                          "or mixed from another state, and would replay the wrong tokens; "
                          "set resume_from to None to resume by reading from the start")
    return cursor


def pass_samples_of(plan: StreamPlan) -> int:
    """Samples in the pass, from its complete cache store (concat: from the manifest alone)."""
    if not plan.packed:
        return pack.concat_num_samples(read_manifest(plan.store_dir)["num_tokens"], plan.seq_len)
    store = TokenStore(plan.store_dir)
    try:
        return pass_length(plan, store)
    finally:
        store.close()

