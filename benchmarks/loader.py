"""Loader benchmark: tokenmill vs a bare nanoGPT-style memmap loader vs a naive Python loader.

Everything runs in one process and one run, on the same store (a >= 500M-token store prepared
from the real-text corpus of ``benchmarks/corpus.py``), page cache warmed first. Figures:

- tokens/s with no consumer (median of --repeats interleaved rounds), and ratios;
- data wait % under a simulated training step of --step-ms of real single-thread CPU work;
- time to first batch (fresh Loader, layout cached) on this store and on a 50M-token slice;
- packed layout build time per million documents; permutation memory at n = 1e6 vs 1e12.

    python benchmarks/loader.py [--store DIR] [--seq-len 2048] [--batch-size 8] [--json OUT]
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
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from tokenmill import Loader, TokenStore, prepare  # noqa: E402
from tokenmill import pack, sampler  # noqa: E402
from tokenmill.bench import (calibrate_step, measure_steps, naive_batches,  # noqa: E402
                             nanogpt_batches, tokens_per_s)


def build_store(data: Path, copies: int) -> Path:
    """A bytes-tokenized store of ``copies`` passes over the corpus (>= 500M tokens at 3)."""
    from corpus import build_corpus
    corpus = build_corpus(data, target_mb=220)
    out = data / f"store-bytes-x{copies}"
    if (out / "manifest.json").exists():
        return out
    links = data / "loader-inputs"
    links.mkdir(exist_ok=True)
    inputs = []
    for i in range(copies):  # distinct names: the same text read again, not repeated in place
        link = links / f"pass{i}.jsonl"
        if not link.exists():
            link.symlink_to(corpus.resolve())
        inputs.append(str(link))
    prepare(inputs, out=out, tokenizer="bytes", workers=2)
    return out


def warm(store: Path) -> None:
    """Read every shard once so all loaders start from the page cache."""
    for f in sorted(store.glob("shard-*.bin")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def rate(make, seconds: float) -> float:
    """Tokens/s of a fresh iterator from ``make()``, its first batch drawn before the clock."""
    it = make()
    next(it)
    return tokens_per_s(it, seconds)


def tokenmill_iter(store, args, **kw):
    return iter(Loader(store, seq_len=args.seq_len, batch_size=args.batch_size, seed=0, rank=0,
                       world_size=1, **kw))


def time_to_first_batch(store: Path, seq_len: int, batch: int, layout: str) -> float:
    """Seconds from Loader() to the first batch, in a fresh interpreter (imports excluded)."""
    code = ("import time,sys; from tokenmill import Loader; t=time.perf_counter(); "
            f"ld=Loader(sys.argv[1], seq_len={seq_len}, batch_size={batch}, layout='{layout}', "
            "rank=0, world_size=1); next(iter(ld)); print(time.perf_counter()-t)")
    out = subprocess.run([sys.executable, "-c", code, str(store)], check=True,
                         capture_output=True, text=True).stdout
    return float(out)


def slice_store(src: Path, dst: Path, max_tokens: int) -> Path:
    """A store made of the first shards of ``src`` up to ``max_tokens`` (hard links, new manifest)."""
    from tokenmill.store import atomic_write_json, store_fingerprint
    m = json.loads((src / "manifest.json").read_text())
    if (dst / "manifest.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    shards, total = [], 0
    for s in m["shards"]:
        if total >= max_tokens:
            break
        for ext in (".bin", ".idx"):
            if not (dst / f"{s['name']}{ext}").exists():
                os.link(src / f"{s['name']}{ext}", dst / f"{s['name']}{ext}")
        shards.append(s)
        total += s["num_tokens"]
    m.update(shards=shards, num_tokens=total, num_documents=sum(s["num_documents"] for s in shards))
    m["fingerprint"] = store_fingerprint(m)
    atomic_write_json(dst / "manifest.json", m)
    return dst


def permutation_memory() -> dict:
    """Peak Python-heap bytes to permute 100k indices at n = 1e6 and n = 1e12."""
    out = {}
    idx = np.arange(100_000, dtype=np.int64)
    for n in (10**6, 10**12):
        perm = sampler.epoch_permutation(n, seed=0, epoch=0)
        tracemalloc.start()
        perm(idx)
        out[f"n={n:.0e}"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "bench-data"))
    ap.add_argument("--store", default=None, help="an existing store (default: build one)")
    ap.add_argument("--copies", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print("$ python " + " ".join([Path(sys.argv[0]).name if sys.argv else "loader.py"] + (argv or sys.argv[1:])))
    print(f"machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}, numpy {np.__version__}")
    store_path = Path(args.store) if args.store else build_store(Path(args.data), args.copies)
    warm(store_path)
    store = TokenStore(store_path)
    print(f"store: {store_path} — {store.num_tokens:,} tokens, {len(store):,} documents, "
          f"{store.num_shards} shards, {store.dtype}")
    L, B = args.seq_len, args.batch_size
    biggest = max(range(store.num_shards), key=lambda i: len(store.shard(i)))
    # nanoGPT slices an np.memmap object; the "ndarray view" variant skips memmap's Python-level
    # __getitem__ and is the stronger baseline: both are shown
    raw_memmap = np.memmap(store_path / f"shard-{biggest:05d}.bin", dtype=store.dtype, mode="r")

    contenders = {
        "tokenmill (sync, int32)": lambda: tokenmill_iter(store_path, args, num_workers=0),
        "tokenmill (sync, int64)": lambda: tokenmill_iter(store_path, args, num_workers=0, dtype="int64"),
        "tokenmill (1 thread)": lambda: tokenmill_iter(store_path, args, num_workers=1, prefetch=4),
        "tokenmill (2 threads)": lambda: tokenmill_iter(store_path, args, num_workers=2, prefetch=4),
        "tokenmill (2 processes)": lambda: tokenmill_iter(store_path, args, num_workers=2, worker_type="process", prefetch=4),
        "bare memmap (nanoGPT)": lambda: nanogpt_batches(raw_memmap, L, B),
        "bare memmap, ndarray view": lambda: nanogpt_batches(store.shard(biggest), L, B),
        "naive python": lambda: naive_batches(store, L, B),
    }
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(args.repeats):  # interleaved rounds: noise hits every contender alike
        for name, make in contenders.items():
            secs = args.seconds if "naive" not in name else min(args.seconds, 2.0)
            rates[name].append(rate(make, secs))
    med = {k: statistics.median(v) for k, v in rates.items()}
    base = med["bare memmap (nanoGPT)"]
    print(f"\nthroughput, no consumer (seq_len {L}, batch {B}; median of {args.repeats} rounds of "
          f"{args.seconds:.0f} s)")
    tuned = med["bare memmap, ndarray view"]
    print(f"{'loader':28s} {'M tokens/s':>11s} {'× nanoGPT':>10s} {'× view':>8s} {'× naive':>9s}")
    for k, v in med.items():
        print(f"{k:28s} {v / 1e6:11.1f} {v / base:10.2f} {v / tuned:8.2f} "
              f"{v / med['naive python']:9.1f}")

    passes = calibrate_step(args.step_ms)  # a fixed job: np.sin passes that take --step-ms
    print(f"\ndata wait under a {args.step_ms:.0f} ms CPU step ({args.steps} steps, "
          f"{passes} np.sin passes)")
    waits = {}
    for name in ("tokenmill (sync, int32)", "tokenmill (1 thread)", "tokenmill (2 threads)",
                 "tokenmill (2 processes)", "bare memmap (nanoGPT)", "bare memmap, ndarray view",
                 "naive python"):
        m = measure_steps(contenders[name](), passes, args.steps)
        w = waits[name] = {"data_wait_pct": m["data_wait_pct"], "wall_s": m["wall_s"],
                           "step_ms_observed": m["step_p50_ms"]}
        print(f"{name:28s} data wait {w['data_wait_pct']:6.2f}%   observed step "
              f"{w['step_ms_observed']:6.2f} ms")

    small = slice_store(store_path, Path(args.data) / "store-50M", 50_000_000)
    ttfb = {}
    for label, path in (("50M-token slice", small), (f"{store.num_tokens / 1e6:,.0f}M-token store", store_path)):
        for layout in ("concat", "packed"):
            time_to_first_batch(path, L, B, layout)  # builds/caches the packed layout once
            ttfb[f"{label} {layout}"] = statistics.median(
                time_to_first_batch(path, L, B, layout) for _ in range(3))
    print("\ntime to first batch (fresh process, layout cached; median of 3)")
    for k, v in ttfb.items():
        print(f"  {k:36s} {v * 1e3:8.1f} ms")

    lengths = np.asarray(store.doc_lengths)
    t0 = time.perf_counter()
    layout = pack.pack_documents(lengths, L)
    pack_s = time.perf_counter() - t0
    synth = np.random.default_rng(0).lognormal(6.0, 1.0, 1_000_000).astype(np.int64) + 1
    t0 = time.perf_counter()
    pack.pack_documents(synth, L)
    synth_s = time.perf_counter() - t0
    print(f"\npacked layout build: {len(lengths):,} real documents in {pack_s:.2f} s "
          f"({pack_s / len(lengths) * 1e6:.2f} s per million), padding "
          f"{layout.padding_fraction:.2%}; 1M lognormal documents: {synth_s:.2f} s")
    mem = permutation_memory()
    print("permutation peak heap for 100k indices: " +
          ", ".join(f"{k}: {v / 1e6:.2f} MB" for k, v in mem.items()))

    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "tokens_per_s": rates, "median_tokens_per_s": med,
            "data_wait": waits, "time_to_first_batch_s": ttfb, "pack_s": pack_s,
            "pack_docs": len(lengths), "pack_1m_synthetic_s": synth_s,
            "permutation_peak_bytes": mem}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
