"""``tokenmill bench``: tokenmill and its peers on one store, with the same sampling, in one run.

Every contender draws batches of random seq_len-token windows (inputs, and targets shifted by
one) from the same store with the same seed. Each runs in its own child process, so that time to
first batch and peak RSS are its own. In the child, in this order:

    step alone   --steps steps of a fixed CPU job (calibrated once to --step-ms), no loader
    first batch  from building the loader to its first batch       time_to_first_batch_s
    no model     batches drawn for --seconds, nothing else          tokens_per_s
    with model   --steps steps of the same job, under a Meter       data_wait_pct, wait_p99_ms
    slowdown     median step with the loader / median step alone − 1   step_slowdown_pct

The parent sums the RSS of the child's process tree every 50 ms. A loader's workers compete
with the step for the cores; that cost shows as slowdown, not as wait, so judge a loader on
both figures.

    report = run("store/", seq_len=2048, batch_size=8)
    print(format_report(report))
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import ConfigError, TokenmillError
from tokenmill.metrics import Meter, count_tokens
from tokenmill.store import TokenStore, atomic_write_json, shard_name

Factory = Callable[[str, int, int, int], Iterator[Any]]
CONTENDERS: dict[str, Factory] = {}  # name -> (store_path, seq_len, batch_size, seed) -> batches
REQUIRES: dict[str, str] = {}  # an optional peer's name -> the module it needs
NOTES: dict[str, str] = {}  # what a factory chose, e.g. pin_memory; set in the child, reported
BASELINE = "naive"
WORK_FLOATS = 20_000  # the step's array: 160 kB, one np.sin pass ~0.15 ms, GIL released inside
RSS_EVERY_S = 0.05
SCAN_EVERY = 4  # find new processes of the tree every 4th sample: a scan reads all of /proc
_CHILD = "import sys; from tokenmill.bench import _child; sys.exit(_child(sys.argv[1]))"


def contender(name: str, requires: str | None = None):
    """Register a factory under ``name``; ``requires`` names the module of an optional peer."""
    def register(fn: Factory) -> Factory:
        CONTENDERS[name] = fn
        if requires:
            REQUIRES[name] = requires
        return fn
    return register


# ---- the contenders ---------------------------------------------------------------------------

def naive_batches(store: TokenStore, seq_len: int, batch: int, seed: int = 0) -> Iterator[dict]:
    """A synchronous loader that builds each sample in Python lists, at random token offsets."""
    rnd = random.Random(seed)
    n = store.num_tokens - seq_len - 1
    while True:
        xs, ys = [], []
        for _ in range(batch):
            s = rnd.randrange(n)
            window = store.tokens(s, s + seq_len + 1).tolist()
            xs.append(window[:-1])
            ys.append(window[1:])
        yield {"inputs": np.array(xs, dtype=np.int64), "targets": np.array(ys, dtype=np.int64)}


def nanogpt_batches(data: np.ndarray, seq_len: int, batch: int, seed: int = 0) -> Iterator[dict]:
    """nanoGPT's get_batch: random offsets into one memmap, a list of int64 slices, np.stack."""
    rng = np.random.default_rng(seed)
    while True:
        ix = rng.integers(len(data) - seq_len - 1, size=batch)
        x = np.stack([data[i:i + seq_len].astype(np.int64) for i in ix])
        y = np.stack([data[i + 1:i + 1 + seq_len].astype(np.int64) for i in ix])
        yield {"inputs": x, "targets": y}


class WindowDataset:
    """Map-style dataset: item i is the window of tokens [i·L, i·L + L] as int64 inputs/targets.

    Pickles as its path (each worker maps the store itself); also a Grain data source.
    len(WindowDataset(store, seq_len=4)) == (store.num_tokens - 1) // 4
    """

    def __init__(self, path: str | os.PathLike, seq_len: int):
        self.path, self.seq_len = str(path), seq_len
        self._store: TokenStore | None = None
        self._len = (TokenStore(path).num_tokens - 1) // seq_len

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self._len:
            raise IndexError(f"window {i} out of range [0, {self._len})")
        if self._store is None:
            self._store = TokenStore(self.path)
        s = int(i) * self.seq_len
        window = self._store.tokens(s, s + self.seq_len + 1).astype(np.int64)
        return {"inputs": window[:-1], "targets": window[1:]}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_store": None}


@contender(BASELINE)
def _naive(path, seq_len, batch_size, seed):
    return naive_batches(TokenStore(path), seq_len, batch_size, seed)


@contender("nanogpt")
def _nanogpt(path, seq_len, batch_size, seed):
    store = TokenStore(path)  # nanoGPT reads one file: the store's largest shard
    big = max(range(store.num_shards), key=lambda i: len(store.shard(i)))
    data = np.memmap(Path(path) / f"{shard_name(big)}.bin", dtype=store.dtype, mode="r")
    NOTES["nanogpt"] = (f"one np.memmap of the largest shard ({len(data):,} of "
                        f"{store.num_tokens:,} tokens), as nanoGPT's get_batch reads train.bin")
    return nanogpt_batches(data, seq_len, batch_size, seed)


TOKENMILL_SETTINGS = {"tokenmill": {}, "tokenmill-threads2": {"num_workers": 2},
                      "tokenmill-process2": {"num_workers": 2, "worker_type": "process"}}


def _tokenmill(name, path, seq_len, batch_size, seed):
    from tokenmill.loader import Loader
    settings = TOKENMILL_SETTINGS[name]
    NOTES[name] = f"Loader({', '.join(f'{k}={v!r}' for k, v in settings.items()) or 'defaults'})"
    with Loader(path, seq_len=seq_len, batch_size=batch_size, seed=seed, rank=0, world_size=1,
                **settings) as loader:
        yield from loader


for _name in TOKENMILL_SETTINGS:
    contender(_name)(functools.partial(_tokenmill, _name))


@contender("torch-dataloader", requires="torch")
def _torch_dataloader(path, seq_len, batch_size, seed):
    import torch
    pin = torch.cuda.is_available()
    NOTES["torch-dataloader"] = (f"shuffle, 2 worker processes, persistent; pin_memory "
                                 f"{'on' if pin else 'off (no CUDA: it would only cost time)'}")
    loader = torch.utils.data.DataLoader(
        WindowDataset(path, seq_len), batch_size=batch_size, shuffle=True, num_workers=2,
        pin_memory=pin, persistent_workers=True, generator=torch.Generator().manual_seed(seed))
    while True:  # epoch after epoch, as a training loop would
        yield from loader


@contender("grain", requires="grain")
def _grain(path, seq_len, batch_size, seed):
    import grain
    try:
        from tokenmill.integrations.grain import source
        records, origin = source(path, seq_len), "tokenmill.integrations.grain.source"
    except ImportError:
        from absl import flags
        if not flags.FLAGS.is_parsed():  # mp_prefetch reads absl flags; nothing parsed them
            flags.FLAGS.mark_as_parsed()
        records, origin = WindowDataset(path, seq_len), "bench.WindowDataset"
    NOTES["grain"] = f"MapDataset({origin}) shuffle + batch, mp_prefetch, 2 worker processes"
    it = iter(grain.MapDataset.source(records).shuffle(seed=seed).repeat(None).batch(batch_size)
              .to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    try:
        yield from it
    finally:
        it.close()


# ---- what a child measures --------------------------------------------------------------------

def step_work(passes: int, base: np.ndarray, work: np.ndarray) -> None:
    """The simulated training step: the same ``passes`` of np.sin over a copy of ``base``, on
    one thread (numpy releases the GIL inside, as a real step's kernels do)."""
    work[:] = base
    for _ in range(passes):
        np.sin(work, out=work)


def _arrays() -> tuple[np.ndarray, np.ndarray]:
    base = np.random.default_rng(0).random(WORK_FLOATS)
    return base, base.copy()


def step_times(passes: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` simulated steps run back to back."""
    base, work = _arrays()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step_work(passes, base, work)
        out.append(time.perf_counter() - t0)
    return out


def calibrate_step(step_ms: float) -> int:
    """Passes of ``step_work`` that take ``step_ms`` here, now (fastest of 5 probes)."""
    probe = 50
    fastest = min(step_times(probe, 5)) / probe
    return max(1, round(step_ms / 1e3 / fastest))


def tokens_per_s(it: Iterator, seconds: float) -> float:
    """Tokens per second drawn from ``it`` for ``seconds`` with no consumer."""
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        n += count_tokens(next(it))
    return n / dt


def measure_steps(it: Iterator, passes: int, steps: int) -> dict[str, Any]:
    """The Meter's summary over ``steps`` simulated steps, each fed a batch from ``it``."""
    meter = Meter(it)
    base, work = _arrays()
    for n, _batch in enumerate(meter):
        if n == steps:
            break
        step_work(passes, base, work)
    return meter.summary()


def measure(name: str, store: str, *, seq_len: int, batch_size: int, seed: int, seconds: float,
            steps: int, passes: int) -> dict[str, Any]:
    """Every figure of one contender, measured in this process.

    The step alone is timed before the loader exists and again after it is closed; the faster
    median counts, so that another tenant's burst during one of the two does not read as speed.
    """
    before = 1e3 * statistics.median(step_times(passes, max(1, steps // 2)))
    t0 = time.perf_counter()
    it = CONTENDERS[name](store, seq_len, batch_size, seed)
    next(it)
    first = time.perf_counter() - t0
    rate = tokens_per_s(it, seconds)
    s = measure_steps(it, passes, steps)
    it.close()
    after = 1e3 * statistics.median(step_times(passes, max(1, steps // 2)))
    alone = min(before, after)
    return {"tokens_per_s": rate, "time_to_first_batch_s": first,
            "data_wait_pct": s["data_wait_pct"], "wait_p99_ms": s["wait_p99_ms"],
            "step_ms_alone": alone, "step_ms_alone_before_after": [before, after],
            "step_ms_with_loader": s["step_p50_ms"],
            "step_slowdown_pct": 100 * (s["step_p50_ms"] / alone - 1)}


def _child(spec_json: str) -> int:
    spec = json.loads(spec_json)
    name, out = spec.pop("name"), spec.pop("out")
    result = {"name": name, **_measure_or_why(name, spec), "note": NOTES.get(name),
              "version": _version(REQUIRES[name]) if name in REQUIRES else None}
    Path(out).write_text(json.dumps({k: v for k, v in result.items() if v is not None}))
    return 0


def _measure_or_why(name: str, spec: dict) -> dict[str, Any]:
    try:  # before the clock: importing a framework is not loading data
        if name in REQUIRES:
            importlib.import_module(REQUIRES[name])
    except ImportError as e:
        return {"skipped": f"not installed ({e})"}
    try:
        return measure(name, **spec)
    except Exception as e:  # the report says which contender failed and why; the rest go on
        return {"error": f"{type(e).__name__}: {e}"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except Exception:
        return None


# ---- the parent -------------------------------------------------------------------------------

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
    _check(store, seq_len=seq_len, batch_size=batch_size, steps=steps, step_ms=step_ms,
           seconds=seconds, seed=seed)
    passes = calibrate_step(step_ms)  # here, before any loader runs
    spec = {"store": str(store), "seq_len": seq_len, "batch_size": batch_size, "seed": seed,
            "seconds": seconds, "steps": steps, "passes": passes}
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
            "results": results, "notes": _notes(results, passes, step_ms)}


def _check(store, **settings) -> None:
    for key in ("seq_len", "batch_size", "steps", "seed"):
        low = 0 if key == "seed" else 1
        if not isinstance(settings[key], int) or settings[key] < low:
            raise ConfigError(f"{key} must be an int >= {low} (got {key}={settings[key]!r})")
    for key in ("step_ms", "seconds"):
        if not isinstance(settings[key], (int, float)) or not settings[key] > 0:
            raise ConfigError(f"{key} must be a number > 0 (got {key}={settings[key]!r})")
    need = (settings["batch_size"] + 1) * settings["seq_len"] + 1
    if (have := TokenStore(store).num_tokens) < need:
        raise ConfigError(f"{store}: {have:,} tokens is too few for batch_size × seq_len "
                          f"(need at least {need:,}); lower --batch-size or --seq-len")
    _psutil()


def _psutil():
    try:
        import psutil
    except ImportError:
        raise TokenmillError("bench needs psutil to measure memory: pip install psutil") from None
    return psutil


def run_child(name: str, spec: dict, timeout: float) -> dict[str, Any]:
    """One contender's figures from a child process, plus its process tree's peak RSS."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
        out, err = Path(tmp) / "result.json", Path(tmp) / "stderr.txt"
        argv = [sys.executable, "-c", _CHILD, json.dumps({**spec, "name": name, "out": str(out)})]
        with open(err, "wb") as errf:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=errf)
            (peak, peak_anon), tree = _watch(proc, timeout, out)
            timed_out = _reap(proc, tree)
        if out.exists():
            result = json.loads(out.read_text())
        else:
            tail = " | ".join(err.read_text(errors="replace").strip().splitlines()[-3:])
            why = f"timed out after {timeout:.0f} s" if timed_out else f"exit {proc.returncode}"
            result = {"name": name, "error": f"child process failed ({why}): {tail}"}
    if "tokens_per_s" in result:
        result.update(peak_rss_mb=peak / 2**20, peak_anon_mb=peak_anon / 2**20)
    return result


def _watch(proc: subprocess.Popen, timeout: float, done: Path) -> tuple[tuple[int, int], dict]:
    """Wait for ``proc`` (at most ``timeout`` s, 10 s once ``done`` exists): the peaks of its
    tree's summed RSS and anonymous RSS, sampled every 50 ms; every process of the tree seen."""
    psutil = _psutil()
    peak = (0, 0)
    try:
        tree: dict[int, Any] = {proc.pid: psutil.Process(proc.pid)}
    except psutil.Error:  # gone already
        return peak, {}
    n, deadline = 0, time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if n % SCAN_EVERY == 0:
            try:
                for p in tree[proc.pid].children(recursive=True):
                    tree.setdefault(p.pid, p)
            except psutil.Error:
                pass
        now = [_rss(p, psutil) for p in tree.values()]
        peak = (max(peak[0], sum(r for r, _ in now)), max(peak[1], sum(a for _, a in now)))
        if done.exists():
            deadline = min(deadline, time.monotonic() + 10)
        n += 1
        time.sleep(RSS_EVERY_S)
    return peak, tree


def _rss(p, psutil) -> tuple[int, int]:
    """(RSS, anonymous RSS) of one process: anonymous = RSS less file-backed and shmem pages."""
    try:
        m = p.memory_info()
        return m.rss, m.rss - m.shared
    except psutil.Error:
        return 0, 0


def _reap(proc: subprocess.Popen, tree: dict) -> bool:
    """End the child if still running and any of its processes left behind; True on timeout."""
    psutil = _psutil()
    timed_out = proc.poll() is None
    if timed_out:
        proc.kill()
    proc.wait()
    left = [p for pid, p in tree.items() if pid != proc.pid and p.is_running()]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    return timed_out


def _add_ratios(results: list[dict]) -> None:
    base = next((r["tokens_per_s"] for r in results
                 if r["name"] == BASELINE and "tokens_per_s" in r), None)
    for r in results:
        if base and "tokens_per_s" in r:
            r["vs_naive"] = r["tokens_per_s"] / base


def _notes(results: list[dict], passes: int, step_ms: float) -> list[str]:
    notes = [f"step: {passes} passes of np.sin over {WORK_FLOATS:,} float64 on one thread, "
             f"calibrated in the parent to {step_ms:g} ms with no loader running; slowdown = "
             "median step with the loader / median step alone - 1, alone being the faster of "
             "the medians timed in the same child before the loader starts and after it closes",
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
    return {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)), "cpu": cpu,
            "python": platform.python_version(), "numpy": np.__version__}


# ---- output -----------------------------------------------------------------------------------

_HEAD = ("contender", "tokens/s", "× naive", "1st batch", "peak RSS", "anon", "data wait",
         "p99 wait", "step slowdown")


def _row(r: dict) -> tuple[str, ...]:
    if "tokens_per_s" not in r:
        return (r["name"], "skipped" if "skipped" in r else "failed") + ("",) * 7
    ratio = f"{r['vs_naive']:,.1f}" if "vs_naive" in r else "-"
    first = r["time_to_first_batch_s"]
    return (r["name"], f"{r['tokens_per_s'] / 1e6:,.2f} M", ratio,
            f"{first * 1e3:,.1f} ms" if first < 1 else f"{first:,.2f} s",
            f"{r['peak_rss_mb']:,.0f} MB", f"{r['peak_anon_mb']:,.0f} MB",
            f"{r['data_wait_pct']:.1f}%",
            f"{r['wait_p99_ms']:,.2f} ms", f"{r['step_slowdown_pct']:+.1f}%")


def format_table(results: list[dict]) -> str:
    """The results as an aligned text table, one row per contender."""
    rows = [_HEAD] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEAD))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                     for row in rows)


def format_report(report: dict) -> str:
    """Command, machine, settings, the table and the notes."""
    m, s = report["machine"], report["settings"]
    lines = [f"$ {report['command']}"] if report.get("command") else []
    lines += [f"machine: {m['cores']} cores ({m['usable_cores']} usable), {m['cpu']}, python "
              f"{m['python']}, numpy {m['numpy']}; load average "
              f"{report['loadavg_before'][0]:.2f} before, {report['loadavg_after'][0]:.2f} after",
              f"store {s['store']}: seq_len {s['seq_len']}, batch {s['batch_size']}, seed "
              f"{s['seed']}; no model for {s['seconds']:g} s; {s['steps']} steps of "
              f"{s['step_ms']:g} ms CPU", "", format_table(report["results"]), "", "notes:"]
    return "\n".join(lines + [f"  - {n}" for n in report["notes"]])


def write_plot(report: dict, path: str | os.PathLike) -> None:
    """A PNG bar chart per contender: tokens/s with no model, data wait %, step slowdown %."""
    try:
        from matplotlib.figure import Figure  # no pyplot: the caller's backend stays as it is
    except ImportError:
        raise TokenmillError("--plot needs matplotlib: pip install 'tokenmill[plot]'") from None
    rows = [r for r in report["results"] if "tokens_per_s" in r]
    names = [r["name"] for r in rows]
    colors = ["#d0833a" if n.startswith("tokenmill") else "#4672b4" for n in names]
    fig = Figure(figsize=(13, 1.6 + 0.4 * len(rows)))
    panels = (("tokens_per_s", 1e-6, "%.3g", "M tokens/s, no model (log scale)"),
              ("data_wait_pct", 1, "%.1f", "data wait % under the step"),
              ("step_slowdown_pct", 1, "%+.1f", "step slowdown %"))
    for ax, (key, scale, fmt, title) in zip(fig.subplots(1, 3, sharey=True), panels):
        ax.bar_label(ax.barh(names, [r[key] * scale for r in rows], color=colors),
                     fmt=fmt, padding=2, fontsize=8)
        ax.margins(x=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log" if key == "tokens_per_s" else "linear")
    fig.axes[0].invert_yaxis()
    s = report["settings"]
    fig.suptitle(f"tokenmill bench: seq_len {s['seq_len']}, batch {s['batch_size']}, step "
                 f"{s['step_ms']:g} ms, {report['machine']['cores']} cores")
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


# ---- the command line -------------------------------------------------------------------------

_OPTIONS = (("--seq-len", int, 2048, "tokens per sample"),
            ("--batch-size", int, 8, "samples per batch"),
            ("--steps", int, 200, "simulated training steps"),
            ("--step-ms", float, 20.0, "CPU milliseconds of one simulated step"),
            ("--seconds", float, 3.0, "seconds of drawing batches with no model"),
            ("--seed", int, 0, "sampling seed"))


def add_arguments(parser) -> None:
    """The arguments of ``tokenmill bench`` on an argparse parser."""
    parser.add_argument("store", help="a token store directory")
    for flag, kind, default, what in _OPTIONS:
        parser.add_argument(flag, type=kind, default=default, help=f"{what} (default {default:g})")
    parser.add_argument("--json", metavar="FILE", help="write the whole report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write a bar chart")
    parser.add_argument("--only", metavar="NAMES",
                        help=f"comma-separated contenders to run, of: {', '.join(CONTENDERS)}")
    parser.add_argument("--skip", metavar="NAMES", help="comma-separated contenders to leave out")


def run_from_args(args) -> int:
    """Run ``tokenmill bench`` from parsed arguments: 0, or 1 if a contender failed."""
    names = select(args.only, args.skip)
    report = run(args.store, seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps,
                 step_ms=args.step_ms, seconds=args.seconds, seed=args.seed, names=names,
                 progress=lambda line: print(line, file=sys.stderr, flush=True))
    report["command"] = _command()
    print(format_report(report), flush=True)
    if args.json:
        atomic_write_json(args.json, report)
    if args.plot:
        write_plot(report, args.plot)
    return 1 if any("error" in r for r in report["results"]) else 0


def _command() -> str:
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "tokenmill"
    prog = "python -m tokenmill" if prog == "__main__.py" else prog
    return " ".join([prog, *map(shlex.quote, sys.argv[1:])])
