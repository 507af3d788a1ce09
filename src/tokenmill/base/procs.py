"""The one way tokenmill starts a worker process, what "auto" workers means, and how many shard
files a store may keep mapped.

A worker is ``python -m tokenmill.base.child`` started with ``subprocess`` (never multiprocessing's
spawn, which re-runs the user's main module: a script without ``if __name__ == "__main__":``
simply works). The parent and the child talk over one duplex
``multiprocessing.connection.Connection`` (a socketpair). The child

- ignores SIGINT and sits in its own process group: a Ctrl-C reaches the parent alone, which
  decides how to stop;
- exits by itself when its parent dies (it watches its parent pid) or closes the connection;
- writes its stderr (and stdout) to an unlinked temporary file whose tail the parent reports
  when the child dies: ``Worker.death()`` gives the real exit reason.

    w = Worker(tokenmill.prepare.pool.serve, config, name="prepare-1")
    w.send(task); msg = w.recv()   # a Failed(error, traceback) when the target raised
    w.stop()

The wire, parent → child, first message: ``Start(sys_path, payload)`` with ``payload`` the pickle
of ``(target, args)``, unpickled after ``sys.path`` is set (so a target's module found on the
parent's path is found in the child). ``target(conn, *args)`` then owns the connection; when it
returns the child exits 0; when it raises, the child sends ``Failed.of(exc)``, prints the
traceback to its stderr and exits 1.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, NoReturn

from tokenmill.base.errors import Terminated, TokenmillError, WorkerError, check_int

STDERR_TAIL_BYTES = 4000  # what death() quotes of a dead worker's stderr
STDERR_TAIL_LINES = 20
PARENT_POLL_S = 0.2  # how often a child checks that its parent is alive


class WorkerDied(WorkerError):
    """A worker process ended while the parent still needed it; the message says why."""


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a worker process."""

    def __str__(self) -> str:
        return self.args[0]


class RemoteError(TokenmillError):
    """Stands in for a worker's exception that could not be pickled; keeps its type and text."""


@dataclass(frozen=True)
class Failed:
    """A worker's exception and its formatted traceback; picklable even when the error is not."""

    error: BaseException
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> Failed:
        """Wrap ``exc`` for the trip to the parent (a stand-in if it does not survive pickling)."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # noqa: BLE001 - any failure to round-trip means: send a stand-in
            exc = RemoteError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")
        return cls(exc, tb)

    def reraise(self) -> NoReturn:
        """Raise the worker's exception here, the worker's traceback attached as its cause."""
        raise self.error from RemoteTraceback(f'\n"""\n{self.traceback}"""')


@dataclass(frozen=True)
class Start:
    """The first message to a child: the parent's import path, then what to run."""

    sys_path: list[str]
    payload: bytes  # pickle of (target, args)


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def resolve_workers(workers: int | str, *, name: str = "workers", minimum: int = 1) -> int:
    """``"auto"`` → ``usable_cores()``; an int ≥ ``minimum`` as it is; anything else a ConfigError.

    resolve_workers(3) == 3
    """
    if workers == "auto":
        return usable_cores()
    return check_int(name, workers, minimum=minimum, or_else="'auto'")


@contextlib.contextmanager
def children_ignore_sigint():
    """Start processes inside this block: they begin with SIGINT ignored (and Python keeps it so).

    Only the main thread may change handlers; elsewhere this does nothing (a Worker also sits in
    its own process group, so a terminal's Ctrl-C never reaches it anyway).
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


class SigtermExits:
    """The SIGTERM handler of ``sigterm_exits``: the first SIGTERM raises ``Terminated`` (unless
    ``quiet``: cleaning up already); later ones are only noted in ``received``."""

    def __init__(self):
        self.received = self.quiet = False

    def __call__(self, signum, frame) -> None:
        first, self.received = not self.received, True
        if first and not self.quiet:
            raise Terminated()

    def arm(self) -> None:
        """Put this handler (back) in place, after a library replaced it (``ray.init`` installs
        ``sys.exit`` and a C++ crash dump); main thread only."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[SigtermExits]:
    """Inside: a SIGTERM raises ``Terminated`` in the main thread, so every ``finally`` runs (as
    for Ctrl-C), and the process exits 143 unless it is caught; whatever a library made of it
    (Ray's ``ray.wait`` turns it into ``SystemExit(1)``) leaves the block as ``Terminated``.
    Yields the handler (``arm()`` it again after a library replaced it); the handler from before
    is restored at the end. Outside the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield SigtermExits()
        return
    old = signal.getsignal(signal.SIGTERM)
    handler = SigtermExits()
    handler.arm()
    try:
        yield handler
    except BaseException as e:
        if handler.received and not isinstance(e, Terminated):
            raise Terminated() from e
        raise
    finally:  # None: a handler installed outside Python (such as Ray's), not ours to put back
        signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)


def children() -> set[int]:
    """This process's live child processes (from /proc; an empty set where there is none)."""
    me = os.getpid()
    return {pid for pid, (ppid, state) in _proc_table().items() if ppid == me and state != "Z"}


def command_line(pid: int) -> str:
    """The command line of ``pid``, arguments joined by spaces ("" when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _below(roots: set[int]) -> set[int]:
    """``roots`` and every live process below them."""
    parent = {pid: ppid for pid, (ppid, state) in _proc_table().items() if state != "Z"}
    found, frontier = set(roots), set(roots)
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid → (parent pid, state letter) of every process /proc shows."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    return {int(n): st for n in entries if n.isdigit() and (st := _stat(int(n))) is not None}


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of ``pid`` from /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # "pid (comm) state ppid …"
    return int(fields[1]), fields[0].decode()


def end_trees(roots: set[int], *, grace_s: float = 10.0) -> None:
    """End processes ``roots`` (children a library started and could not stop) and every process
    below them. Each is stopped first (SIGSTOP) until no new one appears, so none can start
    another that would outlive it; then SIGTERM and SIGCONT to all, up to ``grace_s`` to exit on
    their own, then SIGKILL. Children are reaped."""
    stopped: set[int] = set()
    while new := _below(roots | stopped) - stopped:
        _signal_all(new, signal.SIGSTOP)
        stopped |= new
        deadline = time.monotonic() + grace_s
        while any((st := _stat(p)) is not None and st[1] not in "TZX" for p in new) and \
                time.monotonic() < deadline:  # stopped for real: no fork under way
            time.sleep(0.005)
    _signal_all(stopped, signal.SIGTERM)
    _signal_all(stopped, signal.SIGCONT)
    deadline, left = time.monotonic() + grace_s, stopped
    while left := {pid for pid in left if not _ended(pid)}:
        if time.monotonic() > deadline:
            _signal_all(left, signal.SIGKILL)  # cannot be refused: they go now
            deadline = float("inf")
        time.sleep(0.02)


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone, or not ours
            os.kill(pid, sig)


def _ended(pid: int) -> bool:
    """Whether ``pid`` has ended (reaping it if it is our child)."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0]:
            return True
    return not running(pid)


def running(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine: it exists (another user's counts) and has
    not ended (a zombie, exited but not reaped, has).

    running(os.getpid()) is True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    stat = _stat(pid)
    return stat is None or stat[1] != "Z"


def exit_reason(returncode: int | None) -> str:
    """How a process ended, in words.

    exit_reason(-9) == "was killed by SIGKILL (out of memory?)"
    """
    if returncode is None:
        return "is still running"
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        sig = signal.Signals(-returncode).name
    except ValueError:
        sig = f"signal {-returncode}"
    return f"was killed by {sig}" + (" (out of memory?)" if returncode == -signal.SIGKILL else "")


class Worker:
    """One worker process running ``target(conn, *args)``; see the module docstring."""

    def __init__(self, target: Callable[..., Any], *args: Any, name: str = "worker"):
        self.name = name
        payload = pickle.dumps((target, args), protocol=pickle.HIGHEST_PROTOCOL)
        self._stderr = tempfile.TemporaryFile(prefix=f"tokenmill-{name}-", suffix=".stderr")
        ours, theirs = socket.socketpair()
        try:
            with children_ignore_sigint():
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "tokenmill.base.child", str(theirs.fileno()),
                     str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=self._stderr, stderr=self._stderr,
                    pass_fds=(theirs.fileno(),), process_group=0)
        except BaseException:
            ours.close()
            self._stderr.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.pid = self._proc.pid
        self._stopped = False
        try:
            self.conn.send(Start(list(sys.path), payload))
        except OSError:  # it died at once: death() says why when the caller next reads
            pass

    def send(self, msg: Any) -> None:
        """Send one message to the worker; a WorkerDied error if it is gone."""
        try:
            self.conn.send(msg)
        except OSError:
            raise WorkerDied(self.death()) from None

    def recv(self) -> Any:
        """The worker's next message (a ``Failed`` when its target raised); WorkerDied if it died."""
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise WorkerDied(self.death()) from None

    def poll(self, timeout: float | None = 0.0) -> bool:
        """True if a message (or the end of the connection) is ready within ``timeout`` s."""
        return self.conn.poll(timeout)

    def alive(self) -> bool:
        """True while the process runs."""
        return self._proc.poll() is None

    def stderr_tail(self) -> str:
        """The last lines the worker wrote to stderr/stdout."""
        try:
            size = os.fstat(self._stderr.fileno()).st_size
            start = max(0, size - STDERR_TAIL_BYTES)
            data = os.pread(self._stderr.fileno(), size - start, start)
        except (OSError, ValueError):
            return ""
        lines = data.decode("utf-8", "replace").rstrip().splitlines()
        if start > 0 and lines:
            lines = lines[1:]  # the first line was cut in the middle
        return "\n".join(lines[-STDERR_TAIL_LINES:])

    def death(self, wait: float = 2.0) -> str:
        """Why the worker is gone: its exit code or signal, and the tail of its stderr."""
        try:
            code = self._proc.wait(timeout=wait)  # it closed the connection: reap it
        except subprocess.TimeoutExpired:
            code = None
        what = f"worker {self.name!r} (pid {self.pid}) {exit_reason(code)}"
        if code is None:
            what += " but closed its connection"
        tail = self.stderr_tail()
        return what + (f"; last lines of its stderr:\n{tail}" if tail
                       else "; it wrote nothing to stderr")

    def stop(self, timeout: float = 2.0) -> None:
        """End the worker: close the connection, then SIGTERM, then SIGKILL; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.conn.close()  # the child sees EOF, or its parent-watch notices nothing; then:
        for sig, wait in ((None, timeout), (signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
            if sig is not None and self._proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.send_signal(sig)
            try:
                self._proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self._stderr.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Worker({self.name!r}, pid={self.pid}, {exit_reason(self._proc.poll())})"


def stop_all(workers: list[Worker], timeout: float = 2.0) -> None:
    """Stop several workers at once: close every connection first, so they end in parallel."""
    for w in workers:
        if not w._stopped:
            w.conn.close()
    deadline = time.monotonic() + timeout
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for w in workers:
        w.stop(timeout=0)

def default_max_open() -> int:
    """Shard files a store keeps mapped at once (each map holds one descriptor): a sixteenth of
    this process's descriptor limit, at least 32 and at most 1,024 — a packed batch of short
    documents reads hundreds of shards, and re-mapping one costs ~60 µs; a sixteenth leaves
    room for a mixture of several stores, workers' pipes and the training job's own files.

    32 <= default_max_open() <= 1024
    """
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        soft = 1024
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(32, min(soft // 16, 1024))


_FORK_AWARE: "weakref.WeakSet[Any]" = weakref.WeakSet()


def after_fork(obj) -> None:
    """``obj.after_fork()`` now and in every forked child of this process: what a thread of the
    parent held at the fork (a lock, a job under way) is never released in the child."""
    obj.after_fork()
    _FORK_AWARE.add(obj)


os.register_at_fork(after_in_child=lambda: [obj.after_fork() for obj in list(_FORK_AWARE)])
