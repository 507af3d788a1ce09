"""The body of every tokenmill worker process: ``python -m tokenmill.base.child FD PARENT_PID``.

Started by ``procs.Worker`` (see there for the wire). It imports only tokenmill and what the
target needs, never the user's main module. SIGINT is ignored (the parent decides how to stop);
the process exits when its parent dies or the connection closes.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from tokenmill.base.procs import PARENT_POLL_S, Failed, Start


def watch_parent(parent: int) -> None:
    """Exit this process as soon as ``parent`` is no longer its parent (it died, even by SIGKILL)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


class Inbox:
    """The child's end of the wire, its incoming messages read ahead by a thread.

    Both directions share one socketpair: a parent sending a large task while the child sends a
    large result would block both sides forever once both socket buffers fill (a 4 MiB unit of
    decompressed text one way, its tokens the other). Reading ahead means the child never leaves
    the parent's send waiting; the parent bounds how many tasks are in flight.
    """

    def __init__(self, conn: Connection):
        self.conn = conn
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True, name="tokenmill-inbox").start()

    def _read(self) -> None:
        while True:
            try:
                self.inbox.put(self.conn.recv())
            except BaseException as e:  # noqa: BLE001 - EOF or a broken pipe ends the inbox
                self.inbox.put(Closed(e))
                return

    def recv(self):
        """The next message; the connection's own EOFError/OSError once it is closed."""
        msg = self.inbox.get()
        if isinstance(msg, Closed):
            self.inbox.put(msg)  # every later recv raises too
            raise msg.error
        return msg

    def send(self, obj) -> None:
        """Send ``obj`` to the parent (the read-ahead thread only ever receives)."""
        self.conn.send(obj)


class Closed:
    """The inbox's end: the exception that ended reading."""

    def __init__(self, error: BaseException):
        self.error = error


def main(argv: list[str]) -> int:
    """Receive ``Start``, run ``target(conn, *args)``; 0 when it returns, 1 when it raises."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides how to stop
    fd, parent = int(argv[1]), int(argv[2])
    threading.Thread(target=watch_parent, args=(parent,), daemon=True,
                     name="tokenmill-watch-parent").start()
    conn = Connection(fd)
    try:
        start = conn.recv()
    except (EOFError, OSError):
        return 0  # the parent stopped us before we began
    assert isinstance(start, Start), f"expected Start, got {type(start).__name__}"
    try:
        sys.path[:] = start.sys_path
        target, args = pickle.loads(start.payload)
        target(Inbox(conn), *args)
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        traceback.print_exc()
        try:
            conn.send(Failed.of(e))
        except (OSError, ValueError):
            pass  # the parent is gone or stopped listening
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stderr.flush()
    os._exit(code)  # no atexit handlers or lingering non-daemon threads keep a worker alive
