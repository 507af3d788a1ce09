"""Fault-suite sizes, figures and leak checks.

``TOKENMILL_FAULTS_SIZE=quick`` (default: part of ``make test``, a few minutes on 2 cores) or
``soak`` (``make soak``). Every test reads its counts from ``SIZE``; every test adds the figures
it measured to ``FIGURES``, printed at the end of the run and, with ``TOKENMILL_FAULTS_REPORT=path``,
written there as JSON (docs/reliability.md quotes them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest

HERE = Path(__file__).resolve().parent
PROGRAMS = HERE / "programs.py"  # the child processes the tests start and kill
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Size:
    """How much each fault test does."""

    train_kills: int  # SIGKILLs of a training process, in a row
    prepare_kills: int  # SIGKILLs of prepare, each followed by a rerun
    interrupts: int  # SIGINTs, for the loader and for prepare each
    fuzz_examples: int  # generated inputs per in-process reader fuzz test (x2 policies)
    fuzz_prepare: int  # generated inputs through a full prepare (x2 policies)
    atheris_runs: int  # atheris (libFuzzer) executions
    soak_batches: int  # batches through a process-worker Loader while RSS is watched
    full_index: bool  # scale test writes the whole >2^31-document index, not only its tail
    flip_masks: tuple[int, ...]  # every byte of manifests and indexes is flipped with each mask
    resume_scenarios: int  # random resume scenarios run in-process (tests/faults/test_resume_fuzz)
    resume_kills: int  # random resume scenarios with one leg a training script killed with -9
    prepare_scenarios: int  # random prepare scenarios (kill -9, rerun, compare every file)


SIZES = {
    "quick": Size(train_kills=20, prepare_kills=10, interrupts=4, fuzz_examples=2_000,
                  fuzz_prepare=60, atheris_runs=3_000, soak_batches=20_000, full_index=False,
                  flip_masks=(0x01,), resume_scenarios=200, resume_kills=6,
                  prepare_scenarios=25),
    "soak": Size(train_kills=100, prepare_kills=40, interrupts=20, fuzz_examples=25_000,
                 fuzz_prepare=600, atheris_runs=200_000, soak_batches=1_000_000, full_index=True,
                 flip_masks=(0x01, 0x20, 0x80), resume_scenarios=2_000, resume_kills=60,
                 prepare_scenarios=300),
}
SIZE_NAME = os.environ.get("TOKENMILL_FAULTS_SIZE", "quick")
if SIZE_NAME not in SIZES:
    raise pytest.UsageError(f"TOKENMILL_FAULTS_SIZE must be one of {sorted(SIZES)} "
                            f"(got {SIZE_NAME!r})")
SIZE = SIZES[SIZE_NAME]

FIGURES: dict[str, dict] = {}
COUNTERS: set[tuple[str, str]] = set()  # (name, key) of the figures that ``add`` counts


def record(name: str, **figures) -> None:
    """Add figures under ``name`` (merged with what is there)."""
    FIGURES.setdefault(name, {}).update(figures)


def add(name: str, key: str, n: int) -> None:
    """Add ``n`` to a counter figure."""
    COUNTERS.add((name, key))
    FIGURES.setdefault(name, {})
    FIGURES[name][key] = FIGURES[name].get(key, 0) + n


def pytest_terminal_summary(terminalreporter):
    if not FIGURES or hasattr(terminalreporter.config, "workerinput"):  # an xdist worker: relays
        return
    terminalreporter.section(f"tokenmill fault figures (size={SIZE_NAME})")
    for name, figs in FIGURES.items():
        terminalreporter.write_line(f"{name}: " + ", ".join(f"{k}={v}" for k, v in figs.items()))
    if out := os.environ.get("TOKENMILL_FAULTS_REPORT"):
        Path(out).write_text(json.dumps({"size": SIZE_NAME, "sizes": asdict(SIZE),
                                         "figures": FIGURES}, indent=1, sort_keys=True) + "\n")


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its figures to the controller (``make test`` runs the suite in
    two workers), which merges them (``merge``) and prints them: see tests/conftest.py."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["fault_figures"] = {
            "figures": FIGURES, "counters": sorted(COUNTERS)}


def merge(relayed: dict) -> None:
    """Add a worker's relayed figures to this process's: counters summed, the rest set."""
    for name, figs in relayed["figures"].items():
        for key, value in figs.items():
            if (name, key) in {tuple(c) for c in relayed["counters"]}:
                add(name, key, value)
            else:
                record(name, **{key: value})


# ---- leak checks ----------------------------------------------------------------------------

def shm_in_use(procs: list[psutil.Process]) -> set[str]:
    """/dev/shm names (POSIX shared memory, named semaphores) that ``procs`` map or hold open.

    Taken right before a kill, this is exactly what the killed processes own: other programs on
    the machine may use /dev/shm at the same time, so a before/after listing would blame them.
    """
    names = set()
    for p in procs:
        try:
            for m in p.memory_maps(grouped=True):
                if m.path.startswith(f"{SHM}/"):
                    names.add(m.path[len(str(SHM)) + 1:].removesuffix(" (deleted)"))
            for f in p.open_files():
                if f.path.startswith(f"{SHM}/"):
                    names.add(f.path[len(str(SHM)) + 1:])
        except (psutil.Error, OSError):
            continue
    return names


def stale_shm(names: set[str], timeout: float = 5.0) -> list[str]:
    """Those of ``names`` still in /dev/shm after ``timeout`` seconds of cleanup (by
    multiprocessing's resource tracker, once the last process holding them is gone)."""
    deadline = time.monotonic() + timeout
    while (left := sorted(n for n in names if (SHM / n).exists())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (workers, multiprocessing's resource tracker, …)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def survivors(procs: list[psutil.Process], timeout: float = 5.0) -> list[psutil.Process]:
    """Those of ``procs`` still alive after ``timeout`` seconds (zombies count as gone)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_and_kill(proc: subprocess.Popen) -> tuple[list[psutil.Process], set[str], bool]:
    """SIGSTOP ``proc`` where it is, list its descendants and the /dev/shm names they hold (the
    scan takes tens of ms, in which a running program would go on), then SIGKILL it: (its
    descendants, their /dev/shm names, whether it was still running)."""
    try:
        proc.send_signal(signal.SIGSTOP)
        alive = proc.poll() is None  # if so, not reaped: psutil sees it (a zombie at worst)
        kids = descendants(proc.pid) if alive else []
        shm = shm_in_use([psutil.Process(proc.pid), *kids]) if alive else set()
    finally:
        proc.kill()
        proc.wait()
    return kids, shm, alive


def files_under(path: Path) -> list[str]:
    """Every file below ``path``, relative, sorted (hidden ones too)."""
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file())


def child_env(tmpdir: Path, **extra) -> dict[str, str]:
    """Environment for a child process: its own empty TMPDIR (checked afterwards), unbuffered."""
    tmpdir.mkdir(parents=True, exist_ok=True)
    src = str(HERE.parents[1] / "src")
    return dict(os.environ, TMPDIR=str(tmpdir), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join([src, str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
                **extra)


def program(*args) -> list[str]:
    """Command line of a child program from programs.py."""
    return [sys.executable, str(PROGRAMS), *map(str, args)]


# ---- Ctrl-C -----------------------------------------------------------------------------------

@dataclass
class Interrupt:
    """What a Ctrl-C did: the exit code, stderr, seconds from SIGINT to exit, seconds from start
    to ready (the same program's own pace on this machine, now), and the processes and /dev/shm
    names the program had right before it."""

    code: int
    err: str
    seconds: float
    startup: float
    kids: list[psutil.Process]
    shm: set[str]


def press_ctrl_c(cmd: list[str], env: dict, *, ready: Callable[[subprocess.Popen], None],
                 delay: float, stdout=subprocess.PIPE, timeout: float = 120) -> Interrupt:
    """Run ``cmd`` in its own session; once ``ready(proc)`` returns, wait ``delay`` seconds, then
    press Ctrl-C as a terminal does (SIGINT to the whole foreground process group); its exit,
    timed (killed if it takes over ``timeout`` s: a hang)."""
    t_start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        ready(proc)
        startup = time.monotonic() - t_start
        time.sleep(delay)
        kids = descendants(proc.pid)
        shm = shm_in_use([psutil.Process(proc.pid), *kids])
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=timeout)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()
    return Interrupt(code, err, seconds, startup, kids, shm)


def assert_exits_promptly(hit: Interrupt) -> None:
    """A Ctrl-C ended the program within twice its own start-up time (start to ready, measured
    on the same run), and at most 2 s on a machine where it starts faster than 1 s: no fixed
    wall-clock bound that a loaded machine breaks, yet a cleanup that waits out a timeout, or
    hangs, still fails."""
    bound = max(2.0, 2 * hit.startup)
    assert hit.seconds < bound, (f"took {hit.seconds:.2f} s to exit after Ctrl-C; it started in "
                                 f"{hit.startup:.2f} s, so the bound is {bound:.2f} s")


def assert_nothing_left(kids: list[psutil.Process], shm: set[str], tmpdir: Path,
                        what: str = "") -> None:
    """After a program ended (Ctrl-C, kill -9, …): none of its workers ``kids`` outlived it, none
    of its /dev/shm names ``shm`` and no temporary file under ``tmpdir`` is left behind."""
    assert not survivors(kids), f"{what}orphans: {survivors(kids)}"
    assert stale_shm(shm) == [], f"{what}stale shared memory"
    assert files_under(tmpdir) == [], f"{what}temp files left: {files_under(tmpdir)}"


# ---- fuzzers (resume_scenarios, prepare_scenarios) ---------------------------------------------

class ScenarioFailed(AssertionError):
    """A fuzz scenario broke a promise: the message says what, the scenario in one line, and the
    command that replays it."""


@contextlib.contextmanager
def watchdog(seconds: float, line: str) -> Iterator[None]:
    """A scenario still running after ``seconds`` hangs: print its line and every thread's stack,
    then end the process (a hang cannot be interrupted from inside)."""
    timer = threading.Timer(seconds, _hung, args=(seconds, line))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _hung(seconds: float, line: str) -> None:
    import faulthandler
    sys.__stderr__.write(f"\nscenario hung for {seconds:.0f} s: {line}\n")
    faulthandler.dump_traceback(sys.__stderr__, all_threads=True)
    sys.__stderr__.flush()
    os._exit(3)
