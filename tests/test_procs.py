"""procs + child: the one way tokenmill starts a worker process (real processes, real signals)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tokenmill.base.errors import ConfigError
from tokenmill.base.procs import (Failed, RemoteError, RemoteTraceback, Worker, WorkerDied,
                                  exit_reason, resolve_workers, stop_all, usable_cores)

SRC = str(Path(__file__).resolve().parents[1] / "src")


# ---- targets (module level: the child imports this module by name) ---------------------------

def echo_double(conn) -> None:
    while True:
        try:
            x = conn.recv()
        except EOFError:
            return
        conn.send(x * 2)


def raise_value_error(conn, text: str) -> None:
    conn.recv()
    raise ValueError(text)


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("cannot pickle me")


def raise_unpicklable(conn) -> None:
    raise Unpicklable("a lock inside")


def wait_forever(conn) -> None:
    conn.send(os.getpid())
    while True:
        time.sleep(1)  # never reads: only the parent-watch or a signal ends it


def write_stderr_then_exit(conn, code: int) -> None:
    conn.recv()
    sys.stderr.write("line one\nsomething bad happened: disk on fire\n")
    sys.stderr.flush()
    os._exit(code)


def exit_once_all_saw_eof(conn, folder: str, i: int, n: int) -> None:
    """Say ready; at EOF mark it, then exit only once all n siblings have marked theirs (a
    worker stopped before its siblings' connections close would wait here until signalled)."""
    conn.send(i)
    with contextlib.suppress(EOFError):
        conn.recv()
    Path(folder, f"eof-{i}").touch()
    while len(list(Path(folder).glob("eof-*"))) < n:
        time.sleep(0.01)


def report_sigint(conn) -> None:
    conn.send(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
    conn.recv()


def gone(pid: int, timeout: float) -> bool:
    """True once ``pid`` no longer runs (a zombie counts as gone), within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


# ---- tests ------------------------------------------------------------------------------------

def test_round_trip_in_order():
    with Worker(echo_double, name="echo") as w:
        for i in range(50):
            w.send(i)
        assert [w.recv() for _ in range(50)] == [2 * i for i in range(50)]
        assert w.alive() and w.pid != os.getpid()
    assert not w.alive()


def test_large_messages_both_ways_never_deadlock():
    # both socket buffers full: the parent blocked sending the next task while the child is
    # blocked sending its result — the child's read-ahead inbox must keep the parent's send moving
    import threading
    blob = b"x" * (8 << 20)
    with Worker(echo_double, name="big") as w:
        sent = threading.Event()

        def send_all():
            for _ in range(4):
                w.send(blob)
            sent.set()

        t = threading.Thread(target=send_all, daemon=True)
        t.start()
        t.join(timeout=60)
        if not sent.is_set():
            w.stop(timeout=1)
            pytest.fail("parent and child deadlocked on full socket buffers")
        assert [len(w.recv()) for _ in range(4)] == [16 << 20] * 4


def test_exception_is_reraised_with_the_workers_traceback():
    with Worker(raise_value_error, "bad value 42", name="boom") as w:
        w.send("go")
        msg = w.recv()
        assert isinstance(msg, Failed)
        with pytest.raises(ValueError, match="bad value 42") as info:
            msg.reraise()
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert "raise_value_error" in str(cause) and "bad value 42" in str(cause)


def test_an_unpicklable_exception_arrives_as_a_stand_in_naming_its_type():
    with Worker(raise_unpicklable, name="odd") as w:
        msg = w.recv()
        with pytest.raises(RemoteError, match="Unpicklable: a lock inside"):
            msg.reraise()


def test_sigkill_is_named_in_death():
    with Worker(wait_forever, name="prepare-1") as w:
        pid = w.recv()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDied) as info:
            w.recv()
    text = str(info.value)
    assert f"worker 'prepare-1' (pid {pid}) was killed by SIGKILL (out of memory?)" in text


def test_exit_code_and_stderr_tail_are_reported():
    with Worker(write_stderr_then_exit, 3, name="w3") as w:
        w.send("go")
        with pytest.raises(WorkerDied) as info:
            w.recv()
    text = str(info.value)
    assert "exited with code 3" in text
    assert "something bad happened: disk on fire" in text.split("stderr:")[1]


def test_an_exception_in_the_target_lands_in_the_stderr_tail_too():
    w = Worker(raise_value_error, "visible in stderr", name="tb")
    w.send("go")
    assert isinstance(w.recv(), Failed)
    with pytest.raises(WorkerDied) as info:
        w.recv()
    assert "exited with code 1" in str(info.value)
    assert "ValueError: visible in stderr" in str(info.value)
    w.stop()


def test_child_ignores_sigint_and_sits_in_its_own_process_group():
    with Worker(report_sigint, name="int") as w:
        assert w.recv() is True
        assert os.getpgid(w.pid) != os.getpgid(0)
        os.kill(w.pid, signal.SIGINT)
        time.sleep(0.3)
        assert w.alive()


def test_stop_is_idempotent_and_ends_a_child_that_never_reads():
    w = Worker(wait_forever, name="busy")
    pid = w.recv()
    w.stop(timeout=0.2)
    w.stop()  # a no-op: the first stop ended it
    assert gone(pid, 0.1)
    # ended by the SIGTERM after the closed connection, never left for the SIGKILL: no clock
    # needed (before: "within 3 s", which a busy machine can pass the SIGTERM's 1 s wait and break)
    assert "SIGTERM" in repr(w)


def test_stop_all_ends_many_workers_in_parallel(tmp_path):
    # each worker exits by itself only once every worker has seen its connection close: stopped
    # one after another, the first would wait for the others' EOF until SIGTERM ended it
    ws = [Worker(exit_once_all_saw_eof, str(tmp_path), i, 3, name=f"e{i}") for i in range(3)]
    assert [w.recv() for w in ws] == [0, 1, 2]
    stop_all(ws, timeout=120)  # a hang guard only: they end as soon as all three see EOF
    assert not any(w.alive() for w in ws)
    assert all("exited with code 0" in repr(w) for w in ws), [repr(w) for w in ws]


def test_a_child_exits_by_itself_when_its_parent_is_killed(tmp_path):
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from tokenmill.base.procs import Worker
        from test_procs import wait_forever
        w = Worker(wait_forever, name="orphan")
        print(w.recv(), flush=True)
        time.sleep(60)
    """))
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        child = int(proc.stdout.readline())
        assert not gone(child, 0.3)
        proc.kill()
        proc.wait()
        assert gone(child, 3), "the child outlived its parent killed with SIGKILL"
    finally:
        proc.kill()


def test_a_script_without_a_main_guard_starts_workers_and_runs_once(tmp_path):
    (tmp_path / "helpers.py").write_text(textwrap.dedent("""
        def triple(conn):
            while True:
                try:
                    conn.send(3 * conn.recv())
                except EOFError:
                    return
    """))
    script = tmp_path / "user_script.py"
    runs = tmp_path / "runs.txt"
    script.write_text(textwrap.dedent(f"""
        from tokenmill.base.procs import Worker
        from helpers import triple
        with open({str(runs)!r}, "a") as f:
            f.write("ran\\n")
        workers = [Worker(triple, name=f"t{{i}}") for i in range(2)]
        for i, w in enumerate(workers):
            w.send(i + 1)
        print(sum(w.recv() for w in workers))
        for w in workers:
            w.stop()
    """))
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "9"
    assert runs.read_text().splitlines() == ["ran"]


def test_exit_reason_words():
    assert exit_reason(0) == "exited with code 0"
    assert exit_reason(-signal.SIGKILL) == "was killed by SIGKILL (out of memory?)"
    assert exit_reason(-signal.SIGSEGV) == "was killed by SIGSEGV"
    assert exit_reason(None) == "is still running"


def test_resolve_workers():
    assert resolve_workers("auto") == usable_cores() >= 1
    assert resolve_workers(3) == 3
    assert resolve_workers(0, name="num_workers", minimum=0) == 0
    for bad in (0, -1, True, 2.0, "4", None):
        with pytest.raises(ConfigError, match="workers"):
            resolve_workers(bad)
    with pytest.raises(ConfigError, match=r"num_workers=-1"):
        resolve_workers(-1, name="num_workers", minimum=0)


def test_a_user_script_without_a_main_guard_prepares_with_two_workers_once(tmp_path):
    """Issue 12.15: the README's example saved as a file, no ``if __name__ == "__main__":``."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"text": "document number {i} " }}\n' for i in range(4000)))
    runs = tmp_path / "runs.txt"
    script = tmp_path / "example.py"
    script.write_text(textwrap.dedent(f"""
        import tokenmill
        with open({str(runs)!r}, "a") as f:
            f.write("top-level code ran\\n")
        m = tokenmill.prepare([{str(data)!r}], out={str(tmp_path / "store")!r}, workers=2,
                              unit_bytes=16_000, progress=False)
        print(m["num_documents"])
    """))
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "4000"
    assert runs.read_text().splitlines() == ["top-level code ran"]


# ---- SIGTERM, and processes a library left behind ---------------------------------------------

def test_sigterm_raises_terminated_once_and_the_old_handler_comes_back():
    from tokenmill.base.errors import Terminated
    from tokenmill.base.procs import sigterm_exits
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated) as caught:
        with sigterm_exits():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # a signal handler runs between bytecodes: never reached
    assert caught.value.code == 143  # uncaught, the process exits as a shell reports SIGTERM
    with pytest.raises(Terminated) as caught:
        with sigterm_exits() as handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a library replaced it …
            handler.arm()  # … and it is put back
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except Terminated:
                os.kill(os.getpid(), signal.SIGTERM)  # while cleaning up: only noted
                time.sleep(0.01)
                raise SystemExit(1)  # what ray.wait makes of it: still Terminated outside
    assert isinstance(caught.value.__cause__, SystemExit) and handler.received
    assert signal.getsignal(signal.SIGTERM) == before
    with pytest.raises(ValueError):  # nothing received: an error is itself
        with sigterm_exits() as handler:
            handler.quiet = True
            raise ValueError("x")


def test_end_trees_ends_children_and_what_they_started():
    from tokenmill.base.procs import children, end_trees
    # a child that ignores SIGTERM (SIGKILL after the grace), and its own child, a grandchild
    script = "import signal, subprocess, sys, time\n" \
             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" \
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n" \
             "print('started', flush=True); time.sleep(300)\n"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "started\n"
    parent_of = {p: Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]
                 for p in os.listdir("/proc") if p.isdigit() and Path(f"/proc/{p}/stat").exists()}
    grandchildren = [p for p, ppid in parent_of.items() if ppid == str(proc.pid)]
    assert proc.pid in children() and len(grandchildren) == 1
    end_trees({proc.pid}, grace_s=0.5)
    assert not Path(f"/proc/{proc.pid}").exists()  # ended (it ignored SIGTERM) and reaped
    stat = Path(f"/proc/{grandchildren[0]}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    proc.stdout.close()


def state_of(pid: int) -> str | None:
    """The state letter /proc shows for ``pid`` (None when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_running_is_false_for_a_killed_child_before_and_after_it_is_reaped():
    from tokenmill.base.procs import running
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    assert running(proc.pid) and running(os.getpid())
    proc.kill()
    while state_of(proc.pid) != "Z":  # killed, not yet reaped: a zombie
        time.sleep(0.01)
    assert not running(proc.pid)
    proc.wait()
    assert not running(proc.pid)
