"""Loader: batches as a pure function of the step, assembled ahead by workers, exactly resumable.

What batch k holds is ``plan.batch_at`` (the pure plan: stores, layout, seed, rank slices). This
module adds the state — ``consumed_samples``, so ``state_dict()`` is a number, a fingerprint and a
small record of what the stream depends on (``describe()``, for ``resume``'s explanations) — and the
machinery that makes it fast: batches are computed ``prefetch`` steps ahead by thread or process
workers (``num_workers`` never changes the output) and filled in place into a small ring of
preallocated buffers; a buffer is reused only when nothing outside the loader still references
it (checked by reference count), so a batch you keep is never overwritten.

Batches are dicts of numpy arrays (batch_size, seq_len): ``inputs``, ``targets`` and, packed or
concat with ``document_masks=True``, ``segment_ids``, ``positions``, ``loss_mask``; ``thd=True``
adds the varlen ``cu_seqlens`` and ``max_seqlen`` (``load.thd``: token-budget batches).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Iterator, Mapping

import numpy as np

from tokenmill.load import pacing
from tokenmill.load.balanced import balance_of, balanced_fingerprint, balanced_positions, recorded, \
    step_balance
from tokenmill.base.errors import ConfigError, StaleIterator, check_int
from tokenmill.load.lengthplan import length_plan, one_shape, schedule_of
from tokenmill.load.cuts import Tally
from tokenmill.load.lifetime import Iteration, OneIterator, Pass
from tokenmill.load.mixture import described_phases
from tokenmill.load.options import LoaderOptions, loader_prefetch, loader_workers
from tokenmill.load.pacing import Pacer
from tokenmill.load.packing import plans_packing
from tokenmill.load.plan import BatchPlan, LayoutConfig, fingerprint_of, global_positions, \
    resolve_rank
from tokenmill.load.provenance import RowOrigin, explain_positions
from tokenmill.load.ranks import CheckedFirst, agree
from tokenmill.load.resume import consumed_from, report
from tokenmill.load.ring import Ring, memory_plan
from tokenmill.load.state import STATE_VERSION, Difference, respelled
from tokenmill.load.thd import batch_form
from tokenmill.store.reader import TokenStore
from tokenmill.load.workers import ProcessPool

__all__ = ["Loader", "LoaderOptions", "StaleIterator", "memory_plan"]

TUNE_WINDOW = 50  # steps between prefetch decisions
TUNE_WAIT_FRACTION = 0.01  # deepen prefetch while data wait is above 1%
MAX_PREFETCH = 64
PREFETCH_MEMORY_BUDGET = 1 << 30  # never let prefetch buffers grow past 1 GiB


class Loader(OneIterator):
    """Batches of (batch_size, seq_len) token arrays from one store or a weighted mixture.

    ``for batch in Loader("store/", seq_len=2048, batch_size=8): ...``; batch k is the same for
    any num_workers, and ``load_state_dict(state_dict())`` resumes bit for bit. Less common
    settings are keywords too (``LoaderOptions``: prefetch, epochs, dtype, worker_type,
    cache_dir, max_segments, document_masks, mixture, balance, thd). Named stores with
    ``mixture=[(0, {"web": 0.9, "code": 0.1}), (80_000, {…})]`` change the mix at those global
    samples (docs/mixing.md). ``document_masks=True`` (concat) adds the documents' segment_ids,
    positions and loss_mask to each window (the Llama 3 recipe; docs/guide-torch.md).
    ``balance="attention"`` deals each global batch's rows to the ranks by attention cost
    (docs/balance.md). ``seq_len_schedule=[(0, 2048), (100, 8192)], tokens_per_step=2**20``, in
    place of seq_len and batch_size, changes seq_len at those steps (concat; docs/guide-torch.md).

    One live iterator: ``iter(loader)`` continues from ``consumed_samples``, and an iterator made
    before the last ``iter()``, ``load_state_dict()`` or ``close()`` raises ``StaleIterator`` at
    its next ``next()`` (it never ends quietly, and never hands out a batch twice). Keep one
    iterator (``it = iter(loader)``) to peek with ``next(it)`` inside a loop over it.

    A store deleted, re-prepared or replaced underneath an open Loader makes ``next()`` raise
    StoreError (looked at every 50 ms, and by every process worker per batch); so does a shard
    whose checksum fails the store's background verification.
    """

    _pickle_hint = "; for torch DataLoader workers, pass tokenmill.torch.TokenDataset(loader)"

    def __init__(self, source: str | os.PathLike | TokenStore | Mapping, *,
                 seq_len: int | None = None, batch_size: int | None = None,
                 layout: str = "concat", seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, num_workers: int | str = "auto", **options: Any):
        self.options = opts = LoaderOptions.of(options)
        self.seq_len_schedule = sched = schedule_of(  # its plan: chunks of C = sched.chunk_tokens
            opts, seq_len=seq_len, batch_size=batch_size, layout=layout, source=source)
        self.config = LayoutConfig(seq_len=seq_len if sched is None else sched.chunk_tokens,
                                   layout=layout, seed=seed, max_segments=opts.max_segments,
                                   document_masks=opts.document_masks)
        self.balance = balance_of(opts, self.config, batch_size, source)
        self.form = batch_form(opts.thd, self.config, batch_size, sched, opts.microbatches)
        self.batch_size = None if sched else check_int("batch_size", batch_size, minimum=1)
        self.rank, self.world_size = resolve_rank(
            check_int("rank", rank, minimum=0, optional=True),
            check_int("world_size", world_size, minimum=1, optional=True))
        self.epochs, self.worker_type = opts.epochs, opts.worker_type
        self.num_workers = loader_workers(num_workers)
        # "auto": inline or one worker ahead, decided by measured times (pacing.Pacer)
        self.pacer = Pacer(handoff_s=pacing.HANDOFF_S) if num_workers == "auto" and \
            self.num_workers else None
        self.prefetch = loader_prefetch(opts.prefetch, self.num_workers)
        self.plan = BatchPlan.open(source, self.config, dtype=opts.dtype, mixture=opts.mixture)
        self._finalizer = weakref.finalize(self, _shutdown, None)
        self.weights = self.plan.weights
        self.lengths = length_plan(self.plan, sched, self.world_size)  # None: one seq_len
        self._rows = self.lengths or self.plan  # what fills a step's rows
        self.fingerprint = self.lengths.fingerprint if self.lengths else \
            balanced_fingerprint(self.plan.fingerprint, self.balance)
        self.samples_per_epoch = None if sched else self.plan.samples_per_epoch  # rows vary
        if sched is None and self.samples_per_epoch < self.global_batch_size:
            self.plan.close()
            raise ConfigError(f"batch_size × world_size = {self.global_batch_size:,} samples is "
                              f"more than one epoch holds ({self.samples_per_epoch:,} samples of "
                              f"seq_len {seq_len}); lower batch_size or seq_len")
        self._consumed, self._cuts = 0, Tally(0)  # cuts: counted when stats() asks
        self._auto_prefetch = opts.prefetch == "auto"
        self._tuning = {"wait": 0.0, "steps": 0, "since": None}
        self._assemble_s, self._ready, self._pool = 0.0, 0, None
        self._spans = None  # record_spans: where stage spans go (a trace), or None
        self._stage_lock = threading.Lock()
        self._new_buffers = lambda: self.form.buffers(self.plan.new_buffers(self.batch_size))
        self._ring = Ring(self.lengths.new_buffers if self.lengths else self._new_buffers,
                          size=self.prefetch + 2)

    # ---- the stream -------------------------------------------------------------------------

    @property
    def global_batch_size(self) -> int | None:
        """Samples per step across all ranks (None with a seq_len_schedule: they vary)."""
        return None if self.lengths else self.batch_size * self.world_size

    def __len__(self) -> int:
        """Steps per epoch (an epoch = every sample of every store once; a schedule's: every
        token of its chunks once)."""
        return self.lengths.steps_per_epoch if self.lengths else \
            self.samples_per_epoch // self.global_batch_size

    @property
    def total_steps(self) -> int | None:
        """Steps until the end of ``epochs``, counted from the start (None: runs forever)."""
        if self.epochs is None or self.lengths is not None:  # a schedule's epochs: in tokens
            return None if self.epochs is None else self.lengths.total_steps(self.epochs)
        return self.epochs * self.samples_per_epoch // self.global_batch_size

    def positions(self, consumed: int) -> np.ndarray:
        """This rank's global sample positions of the step that starts at ``consumed``."""
        if self.balance is not None:
            return balanced_positions(self.plan, consumed, batch_size=self.batch_size,
                                      rank=self.rank, world_size=self.world_size,
                                      balance=self.balance)
        rows = self.lengths.shape_at(consumed)[0] if self.lengths else self.batch_size
        return global_positions(consumed, batch_size=rows, rank=self.rank,
                                world_size=self.world_size)

    def _take(self, consumed: int) -> dict[str, np.ndarray]:
        """Ring buffers for the step at ``consumed`` (a schedule: of its phase's shape)."""
        return self._ring.take(self.lengths.shape_at(consumed) if self.lengths else None)

    def batch_at(self, consumed: int, out: dict[str, np.ndarray] | None = None) -> dict:
        """The batch of the step starting at global sample ``consumed`` (pure; for tests/tools)."""
        if out is None:
            out = self.lengths.new_buffers(self.lengths.shape_at(consumed)) if self.lengths \
                else self._new_buffers()
        self._rows.fill(self.positions(consumed), out)
        return self.form.finish(out)

    def explain(self, step: int) -> list[RowOrigin]:
        """Where each row of this rank's batch at ``step`` (of this loader's batch size) came from:
        store, draw, and per document piece the shard, document number and token offset."""
        step = check_int("step", step, minimum=0)  # -1 explained another step's rows
        one_shape(self.seq_len_schedule, "Loader.explain", "explain a run of one seq_len")
        return explain_positions(self.plan, self.positions(step * self.global_batch_size))

    def _remaining(self) -> int | None:
        if self.epochs is None or self.lengths is not None:
            return None if self.epochs is None else self.lengths.remaining(self._consumed,
                                                                           self.epochs)
        end = self.total_steps * self.global_batch_size
        return max(0, (end - self._consumed) // self.global_batch_size)

    def __iter__(self) -> Pass:
        return self.iterate()

    def iterate(self, view=None) -> Pass:
        """A new pass, as ``iter(loader)``; with ``view`` (e.g. ``torch.from_numpy``) it hands
        out ``view(array)`` for each batch array instead — no copy, and a buffer is reused only
        once nothing outside holds it or a view of it — for this pass only."""
        batches = super().__iter__()  # not started yet
        self._ring.set_view(view)  # after the retire: no batch of the last pass is in flight
        return batches

    def _pass(self, token: Iteration) -> CheckedFirst:
        """The pass's batches: inline, ahead on workers, or paced between the two."""
        batches = self._paced(token) if self.pacer else \
            self._inline(token) if self.num_workers == 0 else self._ahead(token)
        return CheckedFirst(self.check_ranks, batches)

    def check_ranks(self) -> None:
        """Refuse, on every rank at once, a loader whose batch-shaping settings or position
        differ from another rank's (``ranks.agree``: one all-gather when torch.distributed or
        JAX runs world_size processes); run at the first ``next()`` of each pass."""
        d = self.describe()
        # an unnamed store is named by its path, which may differ between machines
        stores = d["stores"] if self.plan.mixture.named else [fp for _, fp in d["stores"]]
        agree("Loader", {"stores": stores, "weights": d["weights"], "mixture": d["mixture"],
                         **{k: d[k] for k in ("seq_len", "layout", "max_segments", "seed",
                                              "batch_size")},
                         "fingerprint": self.fingerprint, "consumed_samples": self._consumed},
              rank=self.rank, world_size=self.world_size)

    def _hand_out(self, token: Iteration, bufs: dict) -> dict:
        """Check, count and hand out a filled batch (StaleIterator, StoreError refuse it)."""
        if not self._live(token):  # retired while it waited, by another thread
            self._ring.reclaim(bufs)
            raise StaleIterator(token.why or "this loader was iterated again, loaded or closed")
        self.plan.check_stores()
        self._consumed += self.world_size * len(bufs["inputs"])  # the step's rows, all ranks
        return self._ring.hand_out(self.form.finish(bufs))

    def _inline(self, token: Iteration) -> Iterator[dict[str, np.ndarray]]:
        remaining = self._remaining()
        while remaining is None or remaining > 0:
            bufs = self._take(self._consumed)
            self._timed_fill(self.positions(self._consumed), bufs)
            remaining = None if remaining is None else remaining - 1
            yield self._hand_out(token, bufs)

    def _ahead(self, token: Iteration) -> Iterator[dict[str, np.ndarray]]:
        pool = self._ensure_pool()
        ahead: deque[tuple[Future, dict]] = deque()
        nxt, n_left, W = self._consumed, self._remaining(), self.world_size
        clock = time.perf_counter
        try:
            while True:
                while len(ahead) < self.prefetch and (n_left is None or n_left > 0):
                    bufs = self._take(nxt)
                    ahead.append((pool.submit(self._timed_fill, self.positions(nxt), bufs), bufs))
                    nxt += W * len(bufs["inputs"])
                    n_left = None if n_left is None else n_left - 1
                if not ahead:
                    return
                fut, bufs = ahead.popleft()
                self._ready = sum(f.done() for f, _ in ahead) + fut.done()
                t0 = clock()
                self._waited(fut)
                batch = self._hand_out(token, bufs)
                self._tune(clock() - t0, clock())
                yield batch
        finally:
            self._cancel(ahead)

    def _paced(self, token: Iteration) -> Iterator[dict[str, np.ndarray]]:
        """The default: inline while assembling is cheap, ahead on a worker while the Pacer's
        measurements say it is not; prefetched batches drain in order before going inline."""
        ahead: deque[tuple[Future, dict]] = deque()
        nxt, n_left, W = self._consumed, self._remaining(), self.world_size
        clock = time.perf_counter
        try:
            while True:
                while self.pacer.mode == "ahead" and len(ahead) < self.prefetch and \
                        (n_left is None or n_left > 0):
                    bufs = self._take(nxt)
                    ahead.append((self._ensure_pool().submit(self._timed_fill,
                                                             self.positions(nxt), bufs), bufs))
                    nxt += W * len(bufs["inputs"])
                    n_left = None if n_left is None else n_left - 1
                t0, waited = clock(), None
                if ahead:
                    fut, bufs = ahead.popleft()
                    self._ready = sum(f.done() for f, _ in ahead) + fut.done()
                    took = self._waited(fut)
                    waited = clock() - t0
                elif n_left is None or n_left > 0:
                    bufs = self._take(nxt)
                    took = self._timed_fill(self.positions(nxt), bufs)
                    nxt += W * len(bufs["inputs"])
                    n_left = None if n_left is None else n_left - 1
                else:
                    return
                batch = self._hand_out(token, bufs)
                if ahead:
                    self._tune(clock() - t0, clock())
                handed = clock()
                yield batch
                resumed = clock()
                if self.pacer.handoff == "assumed" and self.worker_type == "thread":
                    # once, after the first batch (not in its latency): pacing.handoff_cost
                    self.pacer.measured(pacing.handoff_cost(self._ensure_pool().submit),
                                        pacing.HANDOFF_HOW)
                self.pacer.observe(assemble_s=took, step_s=resumed - handed, wait_s=waited)
        finally:
            self._cancel(ahead)

    def _cancel(self, ahead: deque) -> None:
        for fut, bufs in ahead:  # prefetched, never handed out: not consumed
            fut.cancel()
            try:
                fut.result()
            except BaseException:
                pass
            self._ring.reclaim(bufs)

    def _timed_fill(self, positions: np.ndarray, bufs: dict) -> float:
        t0 = time.perf_counter()
        if (spans := self._spans) is None:
            self._rows.fill(positions, bufs)
        else:  # traced: the plan (positions → addresses) and the gather (the copies) apart
            resolved = self._rows.resolve(positions)
            t1 = time.perf_counter()
            self._rows.fill_resolved(resolved, bufs)
            spans("plan", t0, t1)
            spans("gather", t1, time.perf_counter())
        took = time.perf_counter() - t0
        with self._stage_lock:
            self._assemble_s += took
        return took

    def _waited(self, fut: Future):
        """``fut.result()``; traced: the time blocked in it, as a "wait" span."""
        t0 = time.perf_counter()
        try:
            return fut.result()  # a worker's exception surfaces here with its own traceback
        finally:
            if self._spans is not None:
                self._spans("wait", t0, time.perf_counter())

    def record_spans(self, sink) -> None:
        """Report every stage as ``sink(name, start, end)`` (perf_counter seconds, from the
        thread that ran it) from now on: "plan", "gather" (thread workers and inline) and
        "wait" (blocked on a batch computed ahead); None stops. ``Watch(trace=)`` sets it."""
        self._spans = sink

    def stats(self) -> dict[str, Any]:
        """Where batches are assembled and why ({"mode": "inline" | "ahead", "why", "workers", …}:
        pacing.Pacer's measurements), and the documents cut so far ("cuts": ``cuts.Tally``)."""
        if self.pacer is not None:
            info = self.pacer.stats()
        elif self.num_workers == 0:
            info = {"mode": "inline", "why": "num_workers=0 given"}
        else:
            info = {"mode": "ahead", "why": f"num_workers={self.num_workers} given"}
        return {**info, "workers": self.num_workers, "worker_type": self.worker_type,
                "prefetch": self.prefetch, **self._balance_stats(),
                **({"seq_len_phase": self.lengths.stats(self._consumed)} if self.lengths
                   else {"cuts": self._cuts.count(self)})}

    def _balance_stats(self) -> dict[str, Any]:
        """{"balance": …} when on, of the last step handed out (else the first): max / mean cost
        across ranks, balanced and in plan order (``balanced.step_balance``)."""
        return {"balance": step_balance(
            self.plan, max(0, self._consumed - self.global_batch_size), batch_size=self.batch_size,
            world_size=self.world_size, balance=self.balance)} if self.balance else {}

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
        bufs = self.lengths.new_buffers(self.lengths.shape_at(0)) if self.lengths else \
            self._new_buffers()  # a schedule: every phase's the same bytes
        per_batch = sum(a.nbytes for a in bufs.values())
        return per_batch * ((self.prefetch if prefetch is None else prefetch) + 2)

    def _ensure_pool(self):
        if self._pool is None:
            if self.worker_type == "thread":
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="tokenmill")
            else:
                self._pool = ProcessPool(self.num_workers, self.plan.spec())
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _shutdown, self._pool)
        return self._pool

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The smallest state that reproduces the stream — JSON-able, independent of world size —
        and a small record of what the stream depends on (``describe()``), for the resume to
        explain what differs."""
        return {"version": STATE_VERSION, "consumed_samples": int(self._consumed),
                "fingerprint": self.fingerprint, "stream": self.describe()}

    def describe(self) -> dict[str, Any]:
        """What this loader's stream depends on (and the settings that may change on resume)."""
        mix, config = self.plan.mixture, self.config
        return {"stores": [[n, s.store.fingerprint] for n, s in zip(mix.names, self.plan.sources)],
                "weights": None if mix.named else list(mix.weights),
                "mixture": described_phases(mix) if mix.named else None,
                "seq_len": config.seq_len, "layout": config.layout, "seed": config.seed,
                "max_segments": config.max_segments, "batch_size": self.batch_size,
                "world_size": self.world_size, "num_workers": self.num_workers,
                **({"packing": plans_packing([s.packed for s in self.plan.sources])}
                   if config.layout == "packed" else {}),
                **({"document_masks": True} if config.document_masks else {}),
                **recorded(self.balance),
                **(self.lengths.describe() if self.lengths else {})}

    def resume_report(self, state: Mapping[str, Any]) -> list[Difference]:
        """How ``state`` and this loader differ (``Difference(what, safe)``, unsafe first); a
        three-key state without a record is compared by fingerprint alone."""
        return report(state, self.describe(), self.fingerprint)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; refuses a state from other stores or another layout/seed, a
        past mixture phase edited, and a ``consumed_samples`` that is not an int in [0, 2**63)
        (numpy integers are fine), saying what differs."""
        consumed = consumed_from(state, self.describe(), self.fingerprint,
                                 also=self._respelled_fingerprint(state))
        if self.lengths:
            self.lengths.step(consumed)  # the first row of a step, or a ConfigError
        self._loaded(consumed, "load_state_dict, or a new pass of a wrapper such as to_torch")
        self._consumed, self._cuts = consumed, Tally(consumed)

    def _respelled_fingerprint(self, state: Mapping[str, Any]) -> tuple[str, ...]:
        """This stream's fingerprint under the state's spelling of its fixed weights when that
        is another (``{a: 0.9, b: 0.1}`` saved, ``{a: 9, b: 1}`` now: the same draws)."""
        saved = state.get("stream") if isinstance(state, Mapping) else None
        mix = self.plan.mixture
        weights = respelled(saved.get("weights"), mix.weights) \
            if isinstance(saved, Mapping) and not mix.named else None
        if weights is None:
            return ()
        plan = fingerprint_of(self.plan.sources, replace(mix, phases=((0, weights),)),
                              self.config)
        return (balanced_fingerprint(plan, self.balance),)

    @property
    def consumed_samples(self) -> int:
        """Global samples handed out so far (all ranks), prefetched ones excluded."""
        return self._consumed

    @property
    def layout_stats(self) -> dict[str, Any]:
        """Samples per epoch; packed: an upper bound on padding (from the rows an epoch is
        allotted), and over the windows this process has packed so far: documents packed, cut
        across rows beyond what packing each window alone cuts (``documents_cut``), longer than
        a row (``num_truncated``), the most segments a row holds; the max_segments cap."""
        stats: dict[str, Any] = {"samples_per_epoch": self.samples_per_epoch,
                                 "steps_per_epoch": len(self)}
        if self.plan.packed:
            plans = [s.packed.stats() for s in self.plan.sources]
            rows = sum(p["rows"] for p in plans)
            stats["padding_at_most"] = sum(p["padding_at_most"] * p["rows"] for p in plans) / rows
            for key in ("windows_packed", "documents_packed", "documents_cut", "num_truncated"):
                stats[key] = sum(p[key] for p in plans)
            stats["max_segments"] = self.config.max_segments
            stats["most_segments"] = max(p["most_segments"] for p in plans)
        if self.plan.schedule is not None:
            stats["mixture_weights"] = [float(w) for w in self.plan.schedule.weights]
        return stats

    # ---- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop workers, release buffers and close the stores it opened; safe to call twice.

        (A Loader dropped without close() stops its workers when it is garbage collected; its
        stores are released with the last reference to them.)
        """
        super().close()
        self.plan.close()


def _shutdown(pool) -> None:
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
