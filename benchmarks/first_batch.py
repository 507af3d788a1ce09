"""Time to first batch: ``Loader(store, seq_len=2048, batch_size=8)`` built and ``next()`` once.

The store is made sparse (files of zeros that take no disk: opening and planning, not page
contents, are what is timed): ``--tokens`` uint16 tokens in ``--shards`` shards of documents of
``--doc-tokens`` tokens each, written once under ``--dir`` and reused. Every repeat runs in a fresh
Python process (imports excluded from the time, like a training script that imported tokenmill
already); the figure is the median.

    python benchmarks/first_batch.py --dir /tmp/perf16/sparse [--tokens 1e9 --shards 128]
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

CHUNK = 1 << 24


def file_xxh3(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def make_store(out: Path, *, tokens: int, shards: int, doc_tokens: int) -> Path:
    """A valid store of ``tokens`` zeros (sparse files) in ``shards`` shards; reused if made."""
    from tokenmill.base.io import atomic_write_json
    from tokenmill.store import ShardInfo, build_manifest, idx_bytes, shard_name
    if (out / "manifest.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    per = tokens // shards
    infos = []
    for i in range(shards):
        n = per if i < shards - 1 else tokens - per * (shards - 1)
        lengths = np.full(-(-n // doc_tokens), doc_tokens, np.int64)
        lengths[-1] = n - doc_tokens * (len(lengths) - 1)
        name = shard_name(i)
        with open(out / f"{name}.bin", "wb") as f:
            f.truncate(2 * n)  # sparse: no blocks written
        (out / f"{name}.idx").write_bytes(idx_bytes(lengths, np.uint16))
        infos.append(ShardInfo(name, len(lengths), n, 2 * n, (out / f"{name}.idx").stat().st_size,
                               file_xxh3(out / f"{name}.bin"), file_xxh3(out / f"{name}.idx")))
    manifest = build_manifest(tokenizer={"kind": "sparse-bench", "vocab_size": 65000},
                              dtype=np.uint16, shards=infos, settings={}, skipped={"total": 0})
    atomic_write_json(out / "manifest.json", manifest)
    return out


def child(store: str, layout: str) -> dict:
    """In a fresh process: construction and first next() of the default Loader, timed apart."""
    from tokenmill import Loader
    t0 = time.perf_counter()
    loader = Loader(store, seq_len=2048, batch_size=8, layout=layout)
    t1 = time.perf_counter()
    next(iter(loader))
    t2 = time.perf_counter()
    loader.close()
    return {"construct_ms": (t1 - t0) * 1e3, "first_next_ms": (t2 - t1) * 1e3,
            "first_batch_ms": (t2 - t0) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="where the sparse store is made (or reused)")
    ap.add_argument("--tokens", type=float, default=1e9)
    ap.add_argument("--shards", type=int, default=128)
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layout", default="concat")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.layout)))
        return 0
    store = make_store(Path(args.dir), tokens=int(args.tokens), shards=args.shards,
                       doc_tokens=args.doc_tokens)
    m = json.loads((store / "manifest.json").read_text())
    print(f"$ python benchmarks/first_batch.py {' '.join(argv or sys.argv[1:])}\nstore {store}: "
          f"{m['num_tokens']:,} tokens, {len(m['shards'])} shards, {m['num_documents']:,} documents")
    runs = []
    for _ in range(args.repeats):
        res = subprocess.run([sys.executable, __file__, "--dir", args.dir, "--child", str(store),
                              "--layout", args.layout], capture_output=True, text=True, check=True)
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    for key in runs[0]:
        values = [r[key] for r in runs]
        print(f"{key}: median {statistics.median(values):.2f} ms "
              f"(runs: {', '.join(f'{v:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
