"""Worker processes for the Loader (``worker_type="process"``), spawn-started.

Each worker rebuilds the same pure ``BatchPlan`` from a small spec, fills batches for the
positions it is sent, and sends the arrays back through a pipe. No shared memory is used, so a
crash of either side leaves no segment behind. A collector thread in the parent copies results
into the loader's buffers and turns a worker's exception into the consumer's exception; a worker
that dies becomes an error, never a hang.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
import traceback
from concurrent.futures import Future
from multiprocessing import get_context
from queue import Empty

import numpy as np


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a worker process."""

    def __str__(self) -> str:
        return self.args[0]


@contextlib.contextmanager
def children_ignore_sigint():
    """Start worker processes inside this block: they ignore SIGINT from their first instruction.

    A spawned child inherits an ignored SIGINT (and Python then leaves it ignored), so a Ctrl-C
    cannot kill a worker half-way through its imports with a traceback; the parent alone decides
    how to stop. Only the main thread may change handlers; elsewhere this does nothing. A Ctrl-C
    in the few milliseconds a start takes is lost (press it again).
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is None:  # None: a handler we could not put back
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _plan_from_spec(spec: dict):
    from tokenmill.loader import BatchPlan, LayoutConfig, _open_sources
    config = LayoutConfig(seq_len=spec["seq_len"], layout=spec["layout"], seed=spec["seed"])
    from tokenmill.store import TokenStore
    stores = [TokenStore(**args) for args in spec["stores"]]
    source = stores[0] if len(stores) == 1 else dict(zip(stores, spec["weights"]))
    sources, weights = _open_sources(source, config, spec["cache_dir"])
    return BatchPlan(sources, weights, np.dtype(spec["dtype"]))


def _worker_main(spec: dict, tasks, results, parent: int) -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        plan = _plan_from_spec(spec)
    except BaseException as e:  # report, then wait to be stopped
        results.put((None, _pack_error(e), None))
        plan = None
    while (task := tasks.get()) is not None:
        task_id, positions = task
        if plan is None:
            continue
        try:
            t0 = time.perf_counter()
            out = plan.new_buffers(len(positions))
            plan.fill(positions, out)
            results.put((task_id, None, (out, time.perf_counter() - t0)))
        except BaseException as e:
            results.put((task_id, _pack_error(e), None))


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _pack_error(e: BaseException) -> tuple:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        import pickle
        pickle.dumps(e)
        return (e, tb)
    except Exception:
        return (RuntimeError(f"{type(e).__name__}: {e}"), tb)


class ProcessPool:
    """A fixed set of spawn-started workers that fill batches; ``submit`` returns a Future."""

    def __init__(self, num_workers: int, spec: dict):
        ctx = get_context("spawn")
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker_main, daemon=True, name=f"tokenmill-worker-{i}",
                                   args=(spec, self._tasks, self._results, os.getpid()))
                       for i in range(num_workers)]
        with children_ignore_sigint():
            for p in self._procs:
                p.start()
        self._ids = itertools.count()
        self._pending: dict[int, tuple[Future, dict]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.assemble_s = 0.0  # seconds the workers spent filling batches
        self._collector = threading.Thread(target=self._collect, daemon=True,
                                           name="tokenmill-collector")
        self._collector.start()

    def submit(self, _fill, positions: np.ndarray, bufs: dict) -> Future:
        """Ask a worker for the batch at ``positions``; the Future completes once ``bufs`` is filled."""
        fut: Future = Future()
        if self._error is not None:
            fut.set_exception(self._error)
            return fut
        task_id = next(self._ids)
        with self._lock:
            self._pending[task_id] = (fut, bufs)
        self._tasks.put((task_id, positions))
        return fut

    def _collect(self) -> None:
        while not self._stop.is_set():
            try:
                task_id, err, out = self._results.get(timeout=0.2)
            except Empty:
                self._check_alive()
                continue
            except (EOFError, OSError):
                return
            if task_id is None:  # a worker could not start
                self._fail_all(_unpack_error(err))
                continue
            with self._lock:
                fut, bufs = self._pending.pop(task_id, (None, None))
            if fut is None or fut.cancelled():
                continue
            if err is not None:
                fut.set_exception(_unpack_error(err))
                continue
            arrays, self.assemble_s = out[0], self.assemble_s + out[1]
            for k, v in arrays.items():
                bufs[k][...] = v
            fut.set_result(None)

    def _check_alive(self) -> None:
        dead = [p for p in self._procs if not p.is_alive()]
        if dead and not self._stop.is_set():
            p = dead[0]
            self._fail_all(RuntimeError(f"loader worker {p.name} (pid {p.pid}) died with exit "
                                        f"code {p.exitcode}; the loader cannot continue"))

    def _fail_all(self, exc: BaseException) -> None:
        self._error = exc
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def shutdown(self, wait: bool = True, cancel_futures: bool = True) -> None:
        """Stop the workers and the collector; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        for _ in self._procs:
            try:
                self._tasks.put(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
        self._collector.join(timeout=2)
        for q in (self._tasks, self._results):
            q.close()
            q.cancel_join_thread()
        with self._lock:
            for fut, _ in self._pending.values():
                fut.cancel()
            self._pending.clear()


def _unpack_error(err: tuple) -> BaseException:
    exc, tb = err
    exc.__cause__ = RemoteTraceback(f"\n\"\"\"\n{tb}\"\"\"")
    return exc
