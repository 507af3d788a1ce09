"""CPU time per batch (``time.thread_time``) of the loaders of benchmarks/loader.py, in one process.

On a machine shared with other jobs, wall-clock tokens/s of fresh processes scatter by ±30%; the
CPU time a batch costs the consumer's thread is disturbed less. Contenders are interleaved: each
round draws ``--batches`` from every one; the figure is the median over ``--rounds``.

    python benchmarks/cpu_per_batch.py --store /tmp/ab/store
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import loader as bench  # noqa: E402 - the contenders of benchmarks/loader.py

NAMES = ("bare", "limit", "default", "torch", "packed")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batches", type=int, default=3000)
    args = ap.parse_args(argv)
    import torch  # noqa: F401 - for the torch contender, imported before any clock
    store = Path(args.store)
    its = {n: bench.make(n, store, 2048, 8)[0] for n in NAMES}
    for it in its.values():
        next(it)
    took = {n: [] for n in NAMES}
    for _ in range(args.rounds):
        for name, it in its.items():
            t0 = time.thread_time()
            for _ in range(args.batches):
                next(it)
            took[name].append((time.thread_time() - t0) / args.batches * 1e6)
    base = statistics.median(took["bare"])
    print(f"$ python benchmarks/cpu_per_batch.py {' '.join(argv or sys.argv[1:])}")
    for name in NAMES:
        us = statistics.median(took[name])
        print(f"{bench.LABELS[name]}: {us:.2f} µs CPU a batch, {base / us:.2f}× bare")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
