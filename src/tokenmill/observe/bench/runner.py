"""The parent side of ``tokenmill bench``: each contender in its own worker process (so time to
first batch and peak RSS are its own), the RSS of that process tree summed every 50 ms, and the
report assembled. A loader's workers compete with the step for the cores; that cost shows as
slowdown, not as wait, so judge a loader on both figures."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from tokenmill.observe.bench.contenders import BASELINE, CONTENDERS
from tokenmill.observe.bench.measure import WORK_FLOATS, calibrate_step, serve_one
from tokenmill.base.errors import ConfigError, TokenmillError, check_int
from tokenmill.base.procs import Failed, Worker, WorkerDied, usable_cores
from tokenmill.load.sampler import MAX_SEED
from tokenmill.store import TokenStore

RSS_EVERY_S = 0.05
SCAN_EVERY = 4  # find new processes of the tree every 4th sample: a scan reads all of /proc


def select(only: str | Iterable[str] | None = None, skip: str | Iterable[str] | None = None
           ) -> list[str]:
    """Contender names in registry order, kept by ``only`` and dropped by ``skip``.

    select(only="nanogpt,naive") == ["naive", "nanogpt"]
    """
    keep = _names(only) if only is not None else set(CONTENDERS)
    drop = _names(skip) if skip is not None else set()
    chosen = [n for n in CONTENDERS if n in keep and n not in drop]
    if not chosen:
        raise ConfigError(f"--only/--skip leave no contender to run (of {', '.join(CONTENDERS)})")
    return chosen


def _names(arg: str | Iterable[str]) -> set[str]:
    items = [x.strip() for x in (arg.split(",") if isinstance(arg, str) else arg) if x.strip()]
    if unknown := [x for x in items if x not in CONTENDERS]:
        raise ConfigError(f"unknown contender {', '.join(map(repr, unknown))}; the contenders "
                          f"are: {', '.join(CONTENDERS)}")
    return set(items)


def run(store: str | os.PathLike, *, seq_len: int = 2048, batch_size: int = 8, steps: int = 200,
        step_ms: float = 20.0, seconds: float = 3.0, seed: int = 0,
        names: Iterable[str] | None = None,
        progress: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Bench ``names`` (default: all) on ``store``, each in a child process; a JSON-able report."""
    names = select(only=names) if names is not None else list(CONTENDERS)
    ints = _check(store, seq_len=seq_len, batch_size=batch_size, steps=steps, step_ms=step_ms,
                  seconds=seconds, seed=seed)
    passes = calibrate_step(step_ms)  # here, before any loader runs
    spec = {"store": str(store), **ints, "seconds": seconds, "passes": passes}
    timeout = 120 + 2 * seconds + 4 * steps * step_ms / 1e3
    load_before, results = os.getloadavg(), []
    for name in names:
        t0 = time.perf_counter()
        results.append(run_child(name, spec, timeout))
        if progress:
            progress(f"bench: {name} done in {time.perf_counter() - t0:.1f} s")
    _add_ratios(results)
    return {"settings": {**spec, "step_ms": step_ms}, "machine": machine(),
            "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
            "results": results, "notes": report_notes(results, passes, step_ms)}


def _check(store, **settings) -> dict[str, int]:
    """The int settings as plain ints (numpy ones too), after checking every setting."""
    ints = {key: check_int(key, settings[key], minimum=1)
            for key in ("seq_len", "batch_size", "steps")}
    ints["seed"] = check_int("seed", settings["seed"], minimum=0, maximum=MAX_SEED)
    for key in ("step_ms", "seconds"):
        if not isinstance(settings[key], (int, float)) or not settings[key] > 0:
            raise ConfigError(f"{key} must be a number > 0 (got {key}={settings[key]!r})")
    need = (ints["batch_size"] + 1) * ints["seq_len"] + 1
    if (have := TokenStore(store).num_tokens) < need:
        raise ConfigError(f"{store}: {have:,} tokens is too few for batch_size × seq_len "
                          f"(need at least {need:,}); lower --batch-size or --seq-len")
    _psutil()
    return ints


def _psutil():
    try:
        import psutil
    except ImportError:
        raise TokenmillError("bench needs psutil to measure memory: pip install psutil") from None
    return psutil


def run_child(name: str, spec: dict, timeout: float) -> dict[str, Any]:
    """One contender's figures from a worker process, plus its process tree's peak RSS."""
    worker = Worker(serve_one, name, spec, name=f"bench-{name}")
    tree: dict[int, Any] = {}
    try:
        (peak, peak_anon), tree = watch(worker, timeout)
        result = _result_of(worker, name, timeout)
    finally:
        worker.stop()
        _reap(tree, worker.pid)
    if "tokens_per_s" in result:
        result.update(peak_rss_mb=peak / 2**20, peak_anon_mb=peak_anon / 2**20)
    return result


def _result_of(worker: Worker, name: str, timeout: float) -> dict[str, Any]:
    """The record the worker sent, or an error record saying how it failed."""
    if not worker.poll(0):
        why = f"timed out after {timeout:.0f} s; last lines of its stderr: {worker.stderr_tail()}"
    else:
        try:
            msg = worker.recv()
        except WorkerDied as e:
            msg = Failed(e, "")
        if not isinstance(msg, Failed):
            return msg
        why = str(msg.error)
    why = " | ".join(line.strip() for line in why.splitlines() if line.strip())
    return {"name": name, "error": f"child process failed: {why}"}


def watch(worker: Worker, timeout: float) -> tuple[tuple[int, int], dict]:
    """Wait for ``worker``'s result (at most ``timeout`` s): the peaks of its tree's summed RSS
    and anonymous RSS, sampled every 50 ms; every process of the tree seen."""
    psutil = _psutil()
    peak = (0, 0)
    try:
        tree: dict[int, Any] = {worker.pid: psutil.Process(worker.pid)}
    except psutil.Error:  # gone already
        return peak, {}
    n, deadline = 0, time.monotonic() + timeout
    while worker.alive() and time.monotonic() < deadline:
        if n % SCAN_EVERY == 0:
            try:
                for p in tree[worker.pid].children(recursive=True):
                    tree.setdefault(p.pid, p)
            except psutil.Error:
                pass
        now = [_rss(p, psutil) for p in tree.values()]
        peak = (max(peak[0], sum(r for r, _ in now)), max(peak[1], sum(a for _, a in now)))
        n += 1
        if worker.poll(RSS_EVERY_S):
            break
    return peak, tree


def _rss(p, psutil) -> tuple[int, int]:
    """(RSS, anonymous RSS) of one process: anonymous = RSS less file-backed and shmem pages."""
    try:
        m = p.memory_info()
        return m.rss, m.rss - m.shared
    except psutil.Error:
        return 0, 0


def _reap(tree: dict, pid: int) -> None:
    """Kill any process of the worker's tree left behind (a peer's own workers)."""
    psutil = _psutil()
    left = [p for q, p in tree.items() if q != pid and p.is_running()]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)


def _add_ratios(results: list[dict]) -> None:
    base = next((r["tokens_per_s"] for r in results
                 if r["name"] == BASELINE and "tokens_per_s" in r), None)
    for r in results:
        if base and "tokens_per_s" in r:
            r["vs_naive"] = r["tokens_per_s"] / base


def report_notes(results: list[dict], passes: int, step_ms: float) -> list[str]:
    """The report's notes: how the step and RSS were measured, then each contender's note."""
    notes = [f"step: {passes} passes of np.sin over {WORK_FLOATS:,} float64 on one thread, "
             f"calibrated in the parent to {step_ms:g} ms with no loader running; slowdown = "
             "median step with the loader / median step alone - 1, alone being the faster of "
             "the medians timed in the same child before the loader starts and after it closes; "
             "±N: how much the step alone varied over the run (max / min of its blocks' medians "
             "- 1); a slowdown within it is marked noise — the machine's variation (a busy "
             "machine: other tenants), not the loader's cost",
             "peak RSS: summed over the contender's process tree, sampled every 50 ms. It counts "
             "the pages of the store a process has mapped: the kernel maps a warm file up to 2 MB "
             "at a time, so a loader drawing random windows soon maps the whole store (page "
             "cache: shared, reclaimable). anon = RSS less file-backed and shared-memory pages, "
             "the memory the loader holds itself (a forked worker counts its parent's pages "
             "again)"]
    for r in results:
        for key, what in (("skipped", "skipped, "), ("error", "FAILED: "), ("note", "")):
            if r.get(key):
                notes.append(f"{r['name']}: {what}{r[key]}")
    return notes


def machine() -> dict[str, Any]:
    """Cores, CPU model and versions of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cores": os.cpu_count(), "usable_cores": usable_cores(), "cpu": cpu,
            "python": platform.python_version(), "numpy": np.__version__}
