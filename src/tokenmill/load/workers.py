"""Worker processes for the Loader (``worker_type="process"``), started by ``procs.Worker``.

A worker is ``python -m tokenmill.base.child`` running ``serve``: it never re-runs the user's main
module, so a script without ``if __name__ == "__main__":`` works. It rebuilds the parent's pure
``BatchPlan`` from its ``PlanSpec`` — refusing stores that are not the ones the parent opened
(``plan.check_identity``) — then fills the batches whose positions it is sent and sends the
arrays back over its pipe, checking after each batch that the stores were not re-prepared
meanwhile. No shared memory is used, so a crash of either side leaves nothing behind.

In the parent, ``ProcessPool.submit`` sends a task to the least busy worker and returns a Future;
a collector thread copies each result into the loader's buffer and completes the Future. A
worker's exception becomes the consumer's (with the worker's traceback as its cause); a worker
that dies becomes a WorkerError giving its real exit reason and the tail of its stderr — an
error, never a hang.

Messages, parent → worker: ``Fill``; worker → parent: ``Filled`` or ``FillFailed``, and a
``procs.Failed`` when the worker could not build its plan (it then exits).
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait

import numpy as np

from tokenmill.base.errors import WorkerError
from tokenmill.load.plan import PlanSpec, plan_from_spec
from tokenmill.base.procs import Failed, Worker, WorkerDied, stop_all


@dataclass(frozen=True)
class Fill:
    """Fill the batch rows of these global sample positions."""

    task: int
    positions: np.ndarray


@dataclass(frozen=True)
class Filled:
    """The arrays of task ``task`` and the seconds the worker spent filling them."""

    task: int
    arrays: dict[str, np.ndarray]
    seconds: float


@dataclass(frozen=True)
class FillFailed:
    """Task ``task`` raised; the worker carries on."""

    task: int
    failed: Failed


def serve(conn: Connection, spec: PlanSpec) -> None:
    """The body of a loader worker: rebuild the plan, then fill batches until the pipe closes."""
    plan = plan_from_spec(spec)  # a failure here is sent to the parent as Failed by the child
    try:
        while True:
            try:
                task = conn.recv()
            except EOFError:
                return
            conn.send(fill(plan, task))
    finally:
        plan.close()


def fill(plan, task: Fill) -> Filled | FillFailed:
    """One task done: its arrays, or the exception it raised."""
    try:
        t0 = time.perf_counter()
        out = plan.new_buffers(len(task.positions))
        plan.fill(task.positions, out)
        plan.check_stores(every=0.0)  # after the reads: were they of the store the parent opened?
        return Filled(task.task, out, time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - every failure goes to the consumer's next()
        return FillFailed(task.task, Failed.of(e))


def as_exception(failed: Failed) -> BaseException:
    """The worker's exception, its traceback attached as the cause (as ``Failed.reraise``)."""
    try:
        failed.reraise()
    except BaseException as e:  # noqa: BLE001 - we want the object, not to raise it here
        return e


@dataclass
class _Task:
    future: Future
    bufs: dict
    worker: int


class ProcessPool:
    """A fixed set of loader workers that fill batches; ``submit`` returns a Future."""

    def __init__(self, num_workers: int, spec: PlanSpec):
        self._workers = [Worker(serve, spec, name=f"loader-{i}") for i in range(num_workers)]
        self._send_locks = [threading.Lock() for _ in self._workers]
        self._busy = [0] * num_workers  # tasks in flight, per worker
        self._ids = itertools.count()
        self._pending: dict[int, _Task] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = Pipe(duplex=False)
        self._error: BaseException | None = None
        self.assemble_s = 0.0  # seconds the workers spent filling batches
        self._collector = threading.Thread(target=self._collect, daemon=True,
                                           name="tokenmill-collector")
        self._collector.start()

    def submit(self, _fill, positions: np.ndarray, bufs: dict) -> Future:
        """Ask a worker for the batch at ``positions``; the Future completes once ``bufs`` is
        filled (``_fill``, the thread pool's function, is not needed: workers have the plan)."""
        fut: Future = Future()
        with self._lock:
            if self._error is not None:
                fut.set_exception(self._error)
                return fut
            task, w = next(self._ids), min(range(len(self._workers)), key=self._busy.__getitem__)
            self._pending[task] = _Task(fut, bufs, w)
            self._busy[w] += 1
        try:
            with self._send_locks[w]:
                self._workers[w].send(Fill(task, positions))
        except WorkerDied as e:
            self._fail_all(_died(e))
        return fut

    def _collect(self) -> None:
        conns = {w.conn: i for i, w in enumerate(self._workers)}
        while conns and not self._stop.is_set():
            for conn in wait([*conns, self._wake_r], timeout=1.0):
                if conn is self._wake_r or self._stop.is_set():
                    return
                i = conns[conn]
                try:
                    msg = self._workers[i].recv()
                except WorkerDied as e:
                    del conns[conn]
                    if not self._stop.is_set():
                        self._fail_all(_died(e))
                    continue
                self._deliver(i, msg)

    def _deliver(self, worker: int, msg) -> None:
        if isinstance(msg, Failed):  # the worker could not start; it exits
            self._fail_all(as_exception(msg))
            return
        with self._lock:
            task = self._pending.pop(msg.task, None)
            self._busy[worker] -= 1
        if task is None or not task.future.set_running_or_notify_cancel():
            return  # cancelled: its buffers may be in use again, leave them alone
        if isinstance(msg, FillFailed):
            task.future.set_exception(as_exception(msg.failed))
            return
        for k, v in msg.arrays.items():
            task.bufs[k][...] = v
        self.assemble_s += msg.seconds
        task.future.set_result(msg.seconds)  # like the thread pool's fill: its seconds

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc
            pending, self._pending = self._pending, {}
        for task in pending.values():
            if not task.future.done():
                task.future.set_exception(self._error)

    def shutdown(self, wait: bool = True, cancel_futures: bool = True) -> None:
        """Stop the workers and the collector; idempotent (``wait``: as ThreadPoolExecutor's)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake_w.send(None)
        if threading.current_thread() is not self._collector:
            self._collector.join(timeout=5)
        stop_all(self._workers)
        self._wake_r.close()
        self._wake_w.close()
        with self._lock:
            pending, self._pending = self._pending, {}
        for task in pending.values():
            task.future.cancel()


def _died(e: WorkerDied) -> WorkerError:
    return WorkerError(f"a loader worker process died: {e}; the loader cannot continue — open a "
                       "new Loader and load your last state_dict() to go on")
