"""The ordered pool: work units read and tokenized by worker processes, results in unit order.

Each worker is a ``procs.Worker`` (``python -m tokenmill.base.child``: it never re-runs the user's
main module) running ``serve``: it loads the tokenizer once, then tokenizes each ``UnitTask`` it
receives and answers ``UnitDone`` (or ``UnitFailed``). A unit goes to the least busy worker; at
most ``2 × workers`` units are sent and not yet handed back, so memory stays bounded whatever the
corpus size, and the results come back strictly in unit order — the store is the same for any
worker count.

    for u, result in ordered_results(units, first=0, workers=2, config=config):
        ...                                     # u = 0, 1, 2, … in order

    with UnitPool(2, config) as pool:           # the same, driven by hand (streaming does)
        pool.submit(0, units[0]); done = pool.wait(0)

A worker's exception is raised in the parent with the worker's traceback as its cause; a worker
that dies is a ``WorkerError`` giving its real exit reason, the tail of its stderr and the pool
owner's ``Advice`` (prepare: run the same command again; streaming: create the loader again).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Iterable, Iterator, Mapping, Sequence

from tokenmill.inputs import sources
from tokenmill.base.errors import WorkerError
from tokenmill.prepare.tokenize import (PrepareConfig, UnitResult, encode_unit, read_unit_items,
                                        tokenize_unit, tokenizer_of)
from tokenmill.base.procs import Failed, Worker, WorkerDied, stop_all
from tokenmill.tokenizer import Tokenizer

UNITS_PER_WORKER = 2  # units sent and not yet handed back, per worker


@dataclass(frozen=True)
class UnitTask:
    """Parent → worker: read (or take ``payload``) and tokenize unit ``index``."""

    index: int
    unit: sources.Unit
    payload: bytes | None = None


@dataclass(frozen=True)
class UnitDone:
    """Worker → parent: unit ``index`` tokenized in ``seconds``; the warnings it raised (a
    worker's stderr is not the user's: the parent raises them again)."""

    index: int
    result: UnitResult
    seconds: float
    warned: tuple[str, ...] = ()


@dataclass(frozen=True)
class UnitFailed:
    """Worker → parent: reading or tokenizing unit ``index`` raised."""

    index: int
    failed: Failed


def serve(conn, config: PrepareConfig, storage_options: Mapping | None) -> None:
    """A worker's body: tokenize each ``UnitTask`` received until the connection closes."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    tok = tokenizer_of(config)  # raising here sends a Failed to the parent
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                res = tokenize_unit(task.unit, config, storage_options, tok, task.payload)
        except Exception as e:  # noqa: BLE001 - every failure goes to the parent, in order
            conn.send(UnitFailed(task.index, Failed.of(e)))
            continue
        conn.send(UnitDone(task.index, res, time.perf_counter() - t0,
                           tuple(str(w.message) for w in caught)))


@dataclass(frozen=True)
class Advice:
    """What to tell the user after a worker of a pool died: when it was killed (SIGKILL,
    SIGTERM: out of memory, an operator), starting over can help; when it crashed, it cannot."""

    killed: str
    crashed: str = "rerunning would fail the same way; its stderr above says why"


PREPARE_ADVICE = Advice(killed="run the same command again: it resumes where it stopped (use "
                               "fewer --workers if memory ran out)")


def death_message(err: WorkerDied, unit: sources.Unit | None, *, name: str = "prepare",
                  advice: Advice = PREPARE_ADVICE) -> str:
    """What to tell the user about a dead worker of the ``name`` pool: why it died, where, and
    the ``advice`` that fits (whether starting over can help)."""
    text = str(err)
    path = getattr(unit, "path", None)
    where = f" while tokenizing {path}" if path is not None else ""
    killed = any(f"by {s.name}" in text for s in (signal.SIGKILL, signal.SIGTERM))
    return f"a {name} worker died{where}: {text}\n{advice.killed if killed else advice.crashed}"


class UnitPool:
    """``workers`` worker processes tokenizing units; see the module docstring. ``name`` names
    the workers (``prepare-1``, …) and the pool in errors; ``advice`` is what a death says."""

    def __init__(self, workers: int, config: PrepareConfig, storage_options: Mapping | None = None,
                 *, name: str = "prepare", advice: Advice = PREPARE_ADVICE):
        self.name, self.advice = name, advice
        self.workers: list[Worker] = []
        try:
            for i in range(workers):
                self.workers.append(Worker(serve, config, storage_options, name=f"{name}-{i + 1}"))
        except BaseException:
            self.close()
            raise
        self.sent: dict[Worker, dict[int, sources.Unit]] = {w: {} for w in self.workers}
        self.done: dict[int, UnitDone | UnitFailed] = {}

    def submit(self, index: int, unit: sources.Unit, payload: bytes | None = None) -> None:
        """Send unit ``index`` to the least busy worker."""
        w = min(self.workers, key=lambda w: len(self.sent[w]))
        try:
            w.send(UnitTask(index, unit, payload))
        except WorkerDied as e:
            raise WorkerError(self._death(e, unit)) from None
        self.sent[w][index] = unit

    def wait(self, index: int, timeout: float | None = None) -> UnitDone | None:
        """Unit ``index``'s result once it is in (a worker's exception is raised here); None
        if it is not within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while index not in self.done:
            busy = {w.conn: w for w, units in self.sent.items() if units}
            if not busy:
                raise ValueError(f"unit {index} was never submitted")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait_any(list(busy), timeout=left)
            if not ready:
                return None
            for conn in ready:
                self._receive(busy[conn])
        msg = self.done.pop(index)
        if isinstance(msg, UnitFailed):
            msg.failed.reraise()
        for text in msg.warned:
            warnings.warn(text, UserWarning, stacklevel=2)
        return msg

    def _receive(self, w: Worker) -> None:
        try:
            msg = w.recv()
        except WorkerDied as e:
            units = self.sent[w]
            raise WorkerError(self._death(e, units[min(units)] if units else None)) from None
        if isinstance(msg, Failed):  # it could not start (e.g. its tokenizer)
            msg.reraise()
        del self.sent[w][msg.index]
        self.done[msg.index] = msg

    def _death(self, err: WorkerDied, unit: sources.Unit | None) -> str:
        return death_message(err, unit, name=self.name, advice=self.advice)

    def close(self) -> None:
        """Stop the workers (they hold nothing worth waiting for); idempotent."""
        workers, self.workers = self.workers, []
        stop_all(workers, timeout=0.5)

    def __enter__(self) -> UnitPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ordered_results(units: Sequence[sources.Unit], first: int, workers: int,
                    config: PrepareConfig, storage_options: Mapping | None = None,
                    tokenizer: Tokenizer | None = None,
                    payloads: Iterable[bytes | None] | None = None,
                    pool: UnitPool | None = None,
                    ahead: ReadAhead | None = None) -> Iterator[tuple[int, UnitResult]]:
    """(unit index, result) for units ``first``… in order; ``payloads`` (one per unit from
    ``first``, None for a unit its worker reads itself) go with their units. One worker:
    tokenized inline with ``tokenizer``. ``pool``: workers already started (the caller's to
    close), used when ``workers`` > 1; ``ahead``: a ``ReadAhead`` already started, used (and
    closed) when ``workers`` is 1."""
    feed = iter(payloads) if payloads is not None else None
    if workers <= 1:
        yield from inline_results(units, first, config, storage_options,
                                  tokenizer or tokenizer_of(config), feed, ahead)
        return
    with UnitPool(workers, config, storage_options) if pool is None else nullcontext(pool) as p:
        nxt = first
        for u in range(first, len(units)):
            while nxt < len(units) and nxt - u < UNITS_PER_WORKER * len(p.workers):
                p.submit(nxt, units[nxt], next(feed) if feed is not None else None)
                nxt += 1
            yield u, p.wait(u).result



READ_AHEAD = 8  # units read and parsed ahead of the encoder (8 x 4 MiB units: ~70 MB of str)


def inline_results(units: Sequence[sources.Unit], first: int, config: PrepareConfig,
                   storage_options: Mapping | None, tok: Tokenizer,
                   feed: Iterator[bytes | None] | None,
                   ahead: ReadAhead | None = None) -> Iterator[tuple[int, UnitResult]]:
    """``ordered_results`` in this process: a ``ReadAhead`` thread reads and parses units while
    this thread encodes (fastokens releases the GIL while it encodes: 100 MB of JSONL, 0.2 CPU-s
    of reading and parsing run beside 0.76 CPU-s of encoding instead of before it). ``ahead``:
    one started earlier (prepare starts it before loading the tokenizer), used if it reads
    exactly these units. A reading error is raised here, at its unit, as when read inline."""
    if ahead is None or not ahead.reads(units[first:]):
        if ahead is not None:
            ahead.close()
        ahead = ReadAhead(units[first:], config, storage_options, feed)
    try:
        for u in range(first, len(units)):
            yield u, encode_unit(ahead.take(), config, tok)
    finally:
        ahead.close()


class ReadAhead:
    """A thread reading ``units`` in order (``read_unit_items``), at most ``depth`` ahead of
    ``take``; ``feed``: their payloads (see ``sources.unit_payloads``), taken by that thread."""

    def __init__(self, units: Sequence[sources.Unit], config: PrepareConfig,
                 storage_options: Mapping | None = None,
                 feed: Iterator[bytes | None] | None = None, depth: int = READ_AHEAD):
        self.units = list(units)
        self.queue: queue.Queue = queue.Queue(depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(config, storage_options, feed),
                                       name="tokenmill-read", daemon=True)
        self.thread.start()

    def _run(self, config, storage_options, feed) -> None:
        for unit in self.units:
            try:
                payload = next(feed) if feed is not None else None
                out = (True, read_unit_items(unit, config, storage_options, payload))
            except BaseException as e:  # noqa: BLE001 - raised in the consumer, at its unit
                out = (False, e)
            while not self.stopped.is_set():
                try:
                    self.queue.put(out, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if self.stopped.is_set() or not out[0]:
                return

    def reads(self, units: Sequence[sources.Unit]) -> bool:
        """Whether this reads exactly ``units``, in this order, of the same files (identities
        as planned), and has not been closed."""
        return (not self.stopped.is_set() and self.units == list(units)
                and [u.ident for u in self.units] == [u.ident for u in units])

    def take(self) -> tuple[list, str | None]:
        """The next unit's ``read_unit_items`` (or raise what reading it raised)."""
        ok, value = self.queue.get()
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Stop reading (a unit being read is finished first); idempotent."""
        self.stopped.set()
        self.thread.join()
        while not self.queue.empty():
            self.queue.get_nowait()
