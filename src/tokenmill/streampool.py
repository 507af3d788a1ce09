"""Streaming mode, the text side: tokenizing worker processes and their results in unit order.

``_UnitPool`` sends the work units of ``sources.plan_units`` to spawn-started worker processes,
each reading and tokenizing whole units (``prepare.tokenize_unit``) with 2 units per worker in
flight past the one waited for, or tokenizes inline when ``num_workers=0``. It hands the results
back strictly in unit order, so the token stream is the one ``prepare`` writes for any worker
count. A worker's exception is raised in the loader's thread with the worker's traceback as its
cause; a worker that dies is a RuntimeError within ``_POLL`` seconds of being needed.

``_TextWindows`` holds those results as one token array per unit, from the unit that holds the
oldest token still needed to the newest, copies concat windows out of them, passes each unit to
the cache writer (``streamcache``) and knows where reading may restart: a ``Cursor``
(unit, doc, token).
"""

from __future__ import annotations

import bisect
import os
import queue
import threading
import time
from collections import deque
from multiprocessing import get_context
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.errors import ConfigError
from tokenmill.prepare import PrepareConfig, UnitResult, tokenize_unit
from tokenmill.tokenizer import load_tokenizer
from tokenmill.workers import _exit_with_parent, _pack_error, _unpack_error

if TYPE_CHECKING:
    from tokenmill.stream import _Plan
    from tokenmill.streamcache import _CacheWriter

UNITS_PER_WORKER = 2  # units in flight per worker process, past the one being waited for
_POLL = 0.1

Cursor = tuple  # (unit, doc, token): read from document `doc` of unit `unit`, at global `token`
CURSOR_FIELDS = ("unit", "doc", "token")


class _Stopped(Exception):
    """The loader is closing: unwind the producer thread quietly."""


# ---- worker processes -------------------------------------------------------------------------

def _unit_worker(config: PrepareConfig, storage_options, tasks, results, parent: int) -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        tok = _load_tokenizer(config)
    except BaseException as e:  # report, then wait to be stopped
        results.put((None, _pack_error(e), None))
        tok = None
    while (task := tasks.get()) is not None:
        u, unit = task
        if tok is None:
            continue
        try:
            t0 = time.perf_counter()
            res = tokenize_unit(unit, config, storage_options, tok)
            results.put((u, None, (res, time.perf_counter() - t0)))
        except BaseException as e:
            results.put((u, _pack_error(e), None))


class _UnitPool:
    """Units read and tokenized ahead by worker processes (or inline), handed back in unit order."""

    def __init__(self, plan: _Plan, tokenizer, first_unit: int, stop: threading.Event, stats: dict):
        self.plan, self.tok, self.stop, self.stats = plan, tokenizer, stop, stats
        self.next = first_unit  # the next unit to send out
        self.done: dict[int, tuple] = {}
        self.procs = []
        if plan.num_workers:
            ctx = get_context("spawn")
            self.tasks, self.results = ctx.Queue(), ctx.Queue()
            args = (plan.config, plan.storage_options, self.tasks, self.results, os.getpid())
            self.procs = [ctx.Process(target=_unit_worker, args=args, daemon=True,
                                      name=f"tokenmill-stream-{i}")
                          for i in range(plan.num_workers)]
            for p in self.procs:
                p.start()

    def result(self, u: int) -> UnitResult:
        """Unit u's tokens (units are asked for in order); a worker's exception is raised here."""
        plan = self.plan
        if not self.procs:
            t0 = time.perf_counter()
            res = tokenize_unit(plan.units[u], plan.config, plan.storage_options, self.tok)
            self.stats["tokenization"] += time.perf_counter() - t0
            return res
        while self.next < min(len(plan.units), u + 1 + UNITS_PER_WORKER * len(self.procs)):
            self.tasks.put((self.next, plan.units[self.next]))
            self.next += 1
        while u not in self.done:
            try:
                got, err, payload = self.results.get(timeout=_POLL)
            except queue.Empty:
                self._check()
                continue
            if got is None:  # a worker could not start (e.g. its tokenizer)
                raise _unpack_error(err)
            self.done[got] = (err, payload)
        err, payload = self.done.pop(u)
        if err is not None:
            raise _unpack_error(err)
        res, seconds = payload
        self.stats["tokenization"] += seconds
        return res

    def _check(self) -> None:
        if self.stop.is_set():
            raise _Stopped
        for p in self.procs:
            if not p.is_alive():
                raise RuntimeError(f"stream worker {p.name} (pid {p.pid}) died with exit code "
                                   f"{p.exitcode}; the loader cannot continue")

    def shutdown(self) -> None:
        """Stop the workers (they hold no state worth waiting for); idempotent."""
        procs, self.procs = self.procs, []
        for _ in procs:
            try:
                self.tasks.put(None)
            except (OSError, ValueError):
                pass
        for p in procs:
            p.join(timeout=0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
        if procs:
            for q in (self.tasks, self.results):
                q.close()
                q.cancel_join_thread()


# ---- where windows come from --------------------------------------------------------------------

class _TextWindows:
    """The pass's windows, read and tokenized unit by unit as the shuffle buffer needs them.

    Tokens are kept as one array per unit read (never copied into one ring), from the unit that
    holds the oldest token still needed to the newest.
    """

    def __init__(self, plan: _Plan, start: Cursor, writer: _CacheWriter | None, pool: _UnitPool):
        self.plan, self.writer, self.pool = plan, writer, pool
        self.unit, self.doc, self.end = start  # next unit to read; global token where it begins
        self.starts: list[int] = []  # global token where each kept array begins
        self.arrays: list[np.ndarray] = []
        self.held = 0  # tokens in self.arrays
        self.cursors: deque[Cursor] = deque()  # where each unit read so far began
        self.num_windows: int | None = None  # known once the last unit is read
        self.peak = 0

    def confirm(self, windows: int) -> None:
        """Read until windows [0, windows) are complete (or the input ends)."""
        L = self.plan.seq_len
        while self.num_windows is None and self.end // L - 1 < windows:
            self._pull()

    def drain(self) -> None:
        """Read to the end of the input (to finish the cache store)."""
        while self.num_windows is None:
            self._pull()

    def _pull(self) -> None:
        if self.unit == len(self.plan.units):
            return self._finish()
        res = self.pool.result(self.unit)
        tokens, lengths, d0 = res.tokens, res.lengths, self.doc
        if d0:
            tokens, lengths = tokens[int(lengths[:d0].sum()):], lengths[d0:]
        if self.writer is not None:
            self.writer.add(self.unit, d0, tokens, lengths, res.skips)
        self.cursors.append((self.unit, d0, self.end))
        if len(tokens):
            self.starts.append(self.end)
            self.arrays.append(tokens)
            self.held += len(tokens)
            self.peak = max(self.peak, self.held)
        self.unit, self.doc, self.end = self.unit + 1, 0, self.end + len(tokens)

    def _finish(self) -> None:
        if self.writer is not None:
            self.writer.finish()
            self.writer = None
        total, L = self.end, self.plan.seq_len
        if total < 2 * L:
            raise ConfigError(f"the inputs hold {total:,} tokens, too few for seq_len={L} "
                              f"(concat windows need at least {2 * L:,})")
        self.num_windows = (total - L) // L  # = pack.concat_num_samples(total, L)

    def copy(self, window: int, out: dict, row: int) -> None:
        """Window ``window`` into row ``row`` of the batch: inputs, and targets shifted by one."""
        L = self.plan.seq_len
        s = self.plan.offset + window * L
        i = bisect.bisect_right(self.starts, s) - 1
        assert i >= 0, f"window {window} was released"
        lo = s - self.starts[i]
        data = self.arrays[i][lo:lo + L + 1]
        if len(data) < L + 1:  # the window spans units: gather just its pieces
            pieces, have = [data], len(data)
            for a in self.arrays[i + 1:]:
                pieces.append(a[:L + 1 - have])
                have += len(pieces[-1])
                if have == L + 1:
                    break
            data = np.concatenate(pieces)
        out["inputs"][row] = data[:-1]
        out["targets"][row] = data[1:]

    def release(self, token: int) -> None:
        """Forget the units that end before ``token``: no window still to come starts there."""
        drop = 0
        while drop < len(self.arrays) and self.starts[drop] + len(self.arrays[drop]) <= token:
            self.held -= len(self.arrays[drop])
            drop += 1
        del self.starts[:drop], self.arrays[:drop]
        while len(self.cursors) > 1 and self.cursors[1][2] <= token:
            self.cursors.popleft()

    def resume_from(self, token: int) -> Cursor | None:
        """The latest place reading can restart from and still see token ``token``."""
        return self.cursors[0] if self.cursors and self.cursors[0][2] <= token else None

    def close(self) -> None:
        self.pool.shutdown()
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


# ---- settings the pool depends on ---------------------------------------------------------------

def _load_tokenizer(config: PrepareConfig):
    return load_tokenizer(config.tokenizer, fast=config.fast_tokenizer, eos=config.eos,
                          bos=config.bos)


def _resolve_workers(num_workers: int | str) -> int:
    if num_workers == "auto":  # leave a core to the training step; share the rest among local ranks
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        return max(1, (cores - 1) // local)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be an int >= 0 or 'auto' "
                          f"(got num_workers={num_workers!r})")
    return num_workers
