"""Streaming layouts: what packed rows and a mixture of text sources cost against concat windows.

    python benchmarks/stream_layouts.py [--steps 300] [--seq-len 2048] [--batch-size 8]
                                        [--workers 1]

Input: the standard library's *.py files as documents (one JSONL per half, so that the mixture
has two sources of the same total), the "bytes" tokenizer. Each layout runs twice on a fresh
cache directory: from the text (tokenizing, cache written) and again from the complete cache
(no tokenizing: assembly alone). Printed: seconds per step (median of 5 blocks) and the ratio to
concat within the same run; the packed layout's padding for the pass.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

from tokenmill import Loader


def corpus(root: Path) -> dict[str, str]:
    """Two sources: the stdlib's .py files, alternately; one JSONL each."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("**/*.py"))
    out = {}
    for i, name in enumerate(("a", "b")):
        (root / name).mkdir(parents=True, exist_ok=True)
        with open(root / name / "docs.jsonl", "w") as f:
            for p in files[i::2]:
                f.write(json.dumps({"text": p.read_text(errors="replace")}) + "\n")
        out[name] = str(root / name)
    return out


def timed(make, steps: int) -> float:
    """Median seconds per step over 5 blocks of steps // 5."""
    with make() as ld:
        it = iter(ld)
        next(it)  # the first batch waits for the workers to start
        block, times = max(1, steps // 5), []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(block):
                next(it)
            times.append((time.perf_counter() - t0) / block)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tm-stream-layouts-"))
    try:
        sources = corpus(root / "data")
        common = dict(tokenizer="bytes", seq_len=args.seq_len, batch_size=args.batch_size,
                      num_workers=args.workers)
        runs = {
            "concat": lambda c: Loader.from_text(list(sources.values()), cache_dir=c, **common),
            "packed": lambda c: Loader.from_text(list(sources.values()), cache_dir=c,
                                                 layout="packed", **common),
            "mixture of 2": lambda c: Loader.from_text(
                sources, cache_dir=c, mixture=[(0, {"a": 0.5, "b": 0.5})], **common),
        }
        results = {}
        for name, make in runs.items():
            cache = root / f"cache-{name.replace(' ', '-')}"
            text = timed(lambda: make(cache), args.steps)
            with make(cache) as ld:  # to the end of the pass: the cache is complete
                for _ in ld:
                    if all(Path(s.store_path, "manifest.json").exists()
                           for s in getattr(ld, "sources", [ld])):
                        break
            results[name] = (text, timed(lambda: make(cache), args.steps))
        base = results["concat"]
        print(f"seq_len {args.seq_len}, batch {args.batch_size}, workers {args.workers}; "
              f"seconds per step (median), ratio to concat")
        for name, (text, cached) in results.items():
            print(f"  {name:13s} from text {text * 1e3:8.2f} ms ({text / base[0]:.2f}x)   "
                  f"from the cache {cached * 1e3:7.3f} ms ({cached / base[1]:.2f}x)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
