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
from typing import Iterator, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).parent))

NAMES = ("bare", "limit", "default", "torch", "packed")


def interleaved_cpu_us(groups: Mapping[str, Sequence[Iterator]], *, rounds: int,
                       batches: int) -> dict[str, float]:
    """Median µs of thread CPU a batch (one ``next`` of one iterator) of each group: one ``next``
    of every iterator first, then ``rounds`` rounds, each timing ``batches`` steps of every group
    in turn (a step: one ``next`` of each of the group's iterators)."""
    for group in groups.values():
        for it in group:
            next(it)
    took = {name: [] for name in groups}
    for _ in range(rounds):
        for name, group in groups.items():
            t0 = time.thread_time()
            for _ in range(batches):
                for it in group:
                    next(it)
            took[name].append((time.thread_time() - t0) / (batches * len(group)) * 1e6)
    return {name: statistics.median(v) for name, v in took.items()}


def main(argv=None) -> int:
    import loader as bench  # the contenders of benchmarks/loader.py
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batches", type=int, default=3000)
    args = ap.parse_args(argv)
    import torch  # noqa: F401 - for the torch contender, imported before any clock
    store = Path(args.store)
    us = interleaved_cpu_us({n: [bench.make(n, store, 2048, 8)[0]] for n in NAMES},
                            rounds=args.rounds, batches=args.batches)
    print(f"$ python benchmarks/cpu_per_batch.py {' '.join(argv or sys.argv[1:])}")
    for name in NAMES:
        print(f"{bench.LABELS[name]}: {us[name]:.2f} µs CPU a batch, {us['bare'] / us[name]:.2f}× "
              "bare")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
