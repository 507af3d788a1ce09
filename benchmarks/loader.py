"""Loader benchmark: the default tokenmill Loader against a bare memmap loader, warm and cold.

Every (contender, page cache, repeat) runs in a fresh Python process; figures are medians over
the repeats, which are interleaved (round r runs every contender once) so that noise from other
tenants hits them all alike. The baseline is the "bare" loader of issue 16, exactly: random
offsets into one ``np.memmap`` (the store's largest shard), ``np.stack`` of the 8 windows of
seq_len + 1 tokens, ``.astype(np.int64)``; inputs and targets are views of that one array. The
"limit" contender is the issue's practical limit: the same windows copied from the same memmap
into one preallocated buffer (its ratio to bare is the ceiling on this machine); "torch" is
``to_torch`` of the default Loader on CPU.

Per run, three phases, each after the page cache is set up again: "warm" reads every shard once
first; "cold" evicts the store's files (``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``, no
root needed) before each phase.

- tokens/s with no consumer (``--seconds`` of drawing batches);
- at a simulated step of 20 ms and of 2 ms (``np.sin`` passes calibrated to that time, one
  thread): data wait % (the Meter's: time in ``next()`` / wall) and step slowdown (median step
  with the loader running ÷ median step alone, - 1), from alternating blocks of steps fed by the
  loader and steps alone (``tokenmill.observe.bench.measure.slowdown``), so that the machine's drifts
  hit both alike.

The bare loader reads the store's largest shard: on a store of several shards it reads a fraction
of the data the others read, and so maps fewer pages (a fresh process pays a page fault per
64 KiB it first touches, ~2 µs each): prepare the store as one shard (``--shard-tokens``) to
compare like with like; the table says which.

    python benchmarks/loader.py --store /tmp/ab/store [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CONTENDERS = ("bare", "limit", "default", "torch", "inline", "thread", "packed")
LABELS = {
    "bare": "bare memmap (random offsets, np.stack of 8, .astype(int64))",
    "limit": "practical limit: 8 × 2049 windows copied from the memmap into one buffer",
    "torch": "to_torch(default Loader) on CPU",
    "default": "tokenmill default: Loader(store, seq_len=2048, batch_size=8)",
    "inline": "tokenmill num_workers=0 (inline)",
    "thread": "tokenmill num_workers=1 (always a thread ahead)",
    "packed": "tokenmill default, layout='packed'",
}
STEPS = {20.0: 150, 2.0: 400}  # simulated step ms -> steps measured
BLOCKS = {20.0: (4, 20), 2.0: (8, 40)}  # slowdown: (pairs of blocks, steps a block)


def evict(store: Path) -> None:
    """Drop the store's files from the page cache (no root needed)."""
    for f in sorted(store.glob("shard-*")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(store: Path) -> None:
    for f in sorted(store.glob("shard-*")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def bare_batches(store: Path, seq_len: int, batch_size: int):
    """The issue's bare loader over the store's largest shard (seed 0, like the others)."""
    m = json.loads((store / "manifest.json").read_text())
    biggest = max(m["shards"], key=lambda s: s["num_tokens"])
    data = np.memmap(store / f"{biggest['name']}.bin", dtype=m["dtype"], mode="r")
    rng = np.random.default_rng(0)
    while True:
        ix = rng.integers(0, len(data) - seq_len - 1, batch_size)
        w = np.stack([data[i:i + seq_len + 1] for i in ix]).astype(np.int64)  # 8 × 2049 windows
        yield {"inputs": w[:, :-1], "targets": w[:, 1:]}


def limit_batches(store: Path, seq_len: int, batch_size: int):
    """The issue's practical limit: the bare loader's windows copied from the same memmap into
    one preallocated buffer (no stack, no cast): what any loader of this memmap must do. Read
    through a plain ndarray view of the memmap: slicing an ``np.memmap`` makes a memmap object
    per window (~1 µs each), which is overhead, not a limit."""
    m = json.loads((store / "manifest.json").read_text())
    biggest = max(m["shards"], key=lambda s: s["num_tokens"])
    data = np.asarray(np.memmap(store / f"{biggest['name']}.bin", dtype=m["dtype"], mode="r"))
    rng = np.random.default_rng(0)
    buf = np.empty((batch_size, seq_len + 1), data.dtype)
    while True:
        for row, i in enumerate(rng.integers(0, len(data) - seq_len - 1, batch_size).tolist()):
            buf[row] = data[i:i + seq_len + 1]
        yield {"inputs": buf[:, :-1], "targets": buf[:, 1:]}


def make(name: str, store: Path, seq_len: int, batch_size: int):
    if name in ("bare", "limit"):
        return (bare_batches if name == "bare" else limit_batches)(store, seq_len, batch_size), None
    from tokenmill import Loader
    kw = {"inline": {"num_workers": 0}, "thread": {"num_workers": 1},
          "packed": {"layout": "packed"}}.get(name, {})
    loader = Loader(store, seq_len=seq_len, batch_size=batch_size, **kw)
    if name == "torch":
        from tokenmill.integrations.torch import to_torch
        return iter(to_torch(loader)), loader
    return iter(loader), loader


def child(args) -> dict:
    """One contender, one page-cache state, in this fresh process: every phase's figures."""
    from tokenmill.observe.bench import calibrate_step, measure_steps, slowdown, tokens_per_s
    store, out = Path(args.store), {}
    prepare = evict if args.cache == "cold" else warm
    passes = {ms: calibrate_step(ms) for ms in STEPS}
    if args.child == "torch":
        import torch  # noqa: F401 - imported before the clock, as a training script has
    prepare(store)
    t0 = time.perf_counter()
    it, loader = make(args.child, store, args.seq_len, args.batch_size)
    next(it)
    out["first_batch_ms"] = (time.perf_counter() - t0) * 1e3
    out["tokens_per_s"] = tokens_per_s(it, args.seconds)
    for ms, steps in STEPS.items():
        prepare(store)
        m = measure_steps(it, passes[ms], steps)  # the same iterator: its pacer carries on
        out[f"wait_pct@{ms:g}"] = m["data_wait_pct"]
        blocks, per = BLOCKS[ms]
        out[f"slowdown_pct@{ms:g}"] = slowdown(it, passes[ms], blocks=blocks,
                                               per=per)["step_slowdown_pct"]
        if loader is not None:
            out[f"mode@{ms:g}"] = loader.stats()["mode"]
    if loader is not None:
        out["stats"] = loader.stats()
        loader.close()
    return out


def run_child(args, name: str, cache: str) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--cache", cache, "--store", args.store,
           "--seconds", str(args.seconds)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        return {"error": res.stderr.strip().splitlines()[-1:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def table(results: dict, cache: str) -> list[str]:
    base = statistics.median(r["tokens_per_s"] for r in results[("bare", cache)])
    lines = [f"\npage cache {cache} (medians of {len(results[('bare', cache)])} fresh processes)",
             "| loader | M tokens/s | × bare | wait @20 ms | slowdown @20 ms | wait @2 ms | "
             "slowdown @2 ms | mode (20 / 2 ms) |", "|---|---|---|---|---|---|---|---|"]
    for name in [n for n in CONTENDERS if (n, cache) in results]:
        rs = [r for r in results[(name, cache)] if "error" not in r]
        if not rs:
            lines.append(f"| {LABELS[name]} | error: {results[(name, cache)][0]['error']} |")
            continue
        med = {k: statistics.median(r[k] for r in rs)
               for k in rs[0] if isinstance(rs[0][k], (int, float))}
        modes = " / ".join(rs[-1].get(f"mode@{ms:g}", "-") for ms in STEPS)
        lines.append(f"| {LABELS[name]} | {med['tokens_per_s'] / 1e6:.0f} | "
                     f"{med['tokens_per_s'] / base:.2f} | {med['wait_pct@20']:.2f}% | "
                     f"{med['slowdown_pct@20']:+.1f}% | {med['wait_pct@2']:.2f}% | "
                     f"{med['slowdown_pct@2']:+.1f}% | {modes} |")
    rate = {n: statistics.median(r["tokens_per_s"] for r in results[(n, cache)] if "error" not in r)
            for n in ("default", "torch", "limit") if (n, cache) in results}
    if "torch" in rate and "default" in rate:
        lines.append(f"\nto_torch on CPU vs the numpy default: {rate['torch'] / rate['default'] - 1:+.1%}")
    if "limit" in rate:
        lines.append(f"ceiling (practical limit ÷ bare): {rate['limit'] / base:.2f}×")
    stats = [r.get("stats") for r in results.get(("default", cache), []) if r.get("stats")]
    if stats:
        lines.append(f"default's measured hand-off: {[s.get('handoff_us') for s in stats]} µs "
                     f"({stats[-1].get('handoff')})")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a store of >= 100M tokens of real text")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--caches", default="warm,cold")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="warm", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    print("$ python benchmarks/loader.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    m = json.loads((Path(args.store) / "manifest.json").read_text())
    print(f"machine: {os.cpu_count()} cores, {platform.machine()}, python "
          f"{platform.python_version()}, numpy {np.__version__}; store {args.store}: "
          f"{m['num_tokens']:,} tokens, {len(m['shards'])} shards, {m['dtype']}")
    biggest = max(m["shards"], key=lambda s: s["num_tokens"])["num_tokens"]
    print(f"bare reads the largest shard: {biggest:,} of the {m['num_tokens']:,} tokens the "
          "others read" + ("" if biggest == m["num_tokens"] else " (not like with like: see the "
                                                               "docstring)"))
    caches = args.caches.split(",")
    names = args.contenders.split(",")
    results = {(n, c): [] for n in names for c in caches}
    for r in range(args.repeats):  # interleaved rounds
        for cache in caches:
            for name in names:
                results[(name, cache)].append(run_child(args, name, cache))
                print(f"round {r + 1} {cache} {name}: {results[(name, cache)][-1]}",
                      file=sys.stderr, flush=True)
    for cache in caches:
        print("\n".join(table(results, cache)))
    if args.json:
        Path(args.json).write_text(json.dumps({f"{n}/{c}": v for (n, c), v in results.items()},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
