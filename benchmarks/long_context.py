"""Long context: memory beyond the batch at seq_len 8k, 128k and 1M (issue 25), on a corpus of
documents of about 1M tokens each.

The store is sparse (uint16 zeros that take no disk; the ``.idx`` files and checksums are real):
``--docs`` documents of 1M ± 20% tokens (seed 0), written once under ``--dir`` and reused. Each
case — a seq_len and a layout (``packed``, ``concat``, ``masks``: concat with document_masks) —
reads the same tokens: batches of 2**20 tokens (batch_size = 2**20 // seq_len), ``--batches`` of
them, inline (num_workers=0), each batch let go before the next. Every case runs ``--repeats``
times, each in a fresh process; the figures are medians:

- ``peak``: the process's peak RSS (VmHWM) minus its RSS after imports, before the Loader;
- ``store pages``: what file-backed RSS grew by: the store's pages mapped in, which are the
  kernel's page cache (shared, reclaimable) and follow the reads, not the loader: a page fault
  maps up to 64 KB around it, so 128 scattered rows of 8k map ~4× the bytes they read;
- ``batch``: the bytes of one batch's arrays (the one the loop holds; the ring reuses it);
- ``beyond``: peak − store pages − batch: what loading takes besides the batch;
- ``first`` / ``next``: seconds to the first batch (the Loader built and one ``next()``), and the
  median of the rest.

    PYTHONPATH=src python benchmarks/long_context.py --dir /tmp/long1m [--docs 48]
        [--seq-lens 8192,131072,1048576] [--layouts packed,concat,masks] [--batches 20]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import xxhash

TOKENS_A_BATCH = 1 << 20
KB, MB = 1024, 2 ** 20
LAYOUTS = {"packed": {"layout": "packed"}, "concat": {"layout": "concat"},
           "masks": {"layout": "concat", "document_masks": True}}


def xxh3_file(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def make_store(out: Path, docs: int) -> Path:
    """A valid sparse store of ``docs`` documents of 1M ± 20% uint16 zeros, two shards; reused."""
    from tokenmill.base.io import atomic_write_json
    from tokenmill.store import ShardInfo, build_manifest, idx_bytes, shard_name
    if (out / "manifest.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    lengths = np.random.default_rng(0).integers(800_000, 1_200_000, docs)
    infos = []
    for i, part in enumerate(np.array_split(lengths, 2)):
        name, n = shard_name(i), int(part.sum())
        with open(out / f"{name}.bin", "wb") as f:
            f.truncate(2 * n)  # sparse: no blocks written
        (out / f"{name}.idx").write_bytes(idx_bytes(part.astype(np.int64), np.uint16))
        infos.append(ShardInfo(name, len(part), n, 2 * n, (out / f"{name}.idx").stat().st_size,
                               xxh3_file(out / f"{name}.bin"), xxh3_file(out / f"{name}.idx")))
    manifest = build_manifest(tokenizer={"kind": "sparse-bench", "vocab_size": 65000},
                              dtype=np.uint16, shards=infos, settings={}, skipped={"total": 0})
    atomic_write_json(out / "manifest.json", manifest)
    return out


def status_kb(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status, in kB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in keys:
            out[name] = int(value.split()[0])
    return out


def child(store: str, seq_len: int, layout: str, batches: int) -> dict:
    """One case in this (fresh) process."""
    from tokenmill import Loader
    start = status_kb("VmRSS", "RssFile")
    t0 = time.perf_counter()
    loader = Loader(store, seq_len=seq_len, batch_size=TOKENS_A_BATCH // seq_len, seed=0,
                    num_workers=0, **LAYOUTS[layout])
    it, times = iter(loader), []
    batch = next(it)
    times.append(time.perf_counter() - t0)
    nbytes = sum(a.nbytes for a in batch.values())
    for _ in range(batches - 1):
        del batch
        t = time.perf_counter()
        batch = next(it)
        times.append(time.perf_counter() - t)
    end = status_kb("VmHWM", "RssFile")
    cuts = loader.stats()["cuts"]
    loader.close()
    peak, pages = end["VmHWM"] - start["VmRSS"], end["RssFile"] - start["RssFile"]
    return {"peak": peak * KB, "pages": pages * KB, "batch": nbytes,
            "beyond": (peak - pages) * KB - nbytes, "first": times[0],
            "next": statistics.median(times[1:] or [0.0]), "cuts": cuts}


def run_case(args, store: Path, seq_len: int, layout: str) -> dict:
    runs = []
    for _ in range(args.repeats):
        done = subprocess.run([sys.executable, __file__, "--child", str(store), "--seq-lens",
                               str(seq_len), "--layouts", layout, "--batches", str(args.batches)],
                              capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) if k != "cuts" else runs[0][k]
            for k in runs[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/tokenmill-long1m", help="the sparse store (reused)")
    ap.add_argument("--docs", type=int, default=48)
    ap.add_argument("--seq-lens", default="8192,131072,1048576")
    ap.add_argument("--layouts", default="packed,concat,masks")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    if args.child:
        print(json.dumps(child(args.child, seq_lens[0], args.layouts, args.batches)))
        return 0
    store = make_store(Path(args.dir), args.docs)
    m = json.loads((store / "manifest.json").read_text())
    print(f"$ python benchmarks/long_context.py {' '.join(argv or sys.argv[1:])}\nstore {store}: "
          f"{m['num_tokens']:,} tokens, {m['num_documents']} documents; batches of "
          f"{TOKENS_A_BATCH:,} tokens, {args.batches} a case, median of {args.repeats} processes")
    print("| layout | seq_len | batch MB | peak RSS − start MB | store pages MB "
          "| beyond the batch MB | first batch s | next s | cuts: pieces / documents / tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for layout in args.layouts.split(","):
        for seq_len in seq_lens:
            r = run_case(args, store, seq_len, layout)
            c = r["cuts"]
            print(f"| {layout} | {seq_len:,} | {r['batch'] / MB:.1f} | {r['peak'] / MB:.1f} | "
                  f"{r['pages'] / MB:.1f} | {r['beyond'] / MB:.1f} | {r['first']:.2f} | "
                  f"{r['next']:.3f} | {c['pieces']:,} / {c['documents']:,} / {c['tokens']:,} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
