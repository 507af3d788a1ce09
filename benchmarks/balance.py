"""Attention work per data-parallel rank, balanced (``balance.balance_rows``) against the rows in
plan order, on the document lengths of a real corpus and of a lognormal synthetic set (issue 25).

Real: the packed rows a ``Loader(store, layout="packed", seq_len=8192)`` hands out, read from
their ``segment_ids`` (the store is only read). Synthetic: lognormal document lengths (median
600 tokens, σ 1.6, seed 0) concatenated and cut into full rows. Each step is a global batch of
``world`` ranks × ``per`` rows; the cost of a rank is its rows' causal (query, key) pairs
(``CostModel()``); reported per step is max / mean over ranks — the median and p99 over the
steps — for: rows in plan order (rank r takes rows r·per … (r+1)·per − 1), balanced, and the floor
no equal-count assignment can beat, even one moving documents between rows (``full_row_bound``).
With 2-way context parallelism inside each rank the same ratio is over the world × cp
(rank, CP rank) pairs: plan order with each row cut into two contiguous halves (the split that
ignores documents) against balanced rows split per document head–tail (``cpsplit.cp_pairs``).

    PYTHONPATH=src python benchmarks/balance.py --store /tmp/realstore [--per 4,16] [--steps 1000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tokenmill import Loader
from tokenmill.balance import balance_rows, full_row_bound, imbalance, rank_costs, row_costs, \
    row_segments
from tokenmill.cpsplit import causal_pairs, cp_pairs


def real_rows(store: str, seq_len: int, rows: int) -> list[np.ndarray]:
    """Segment lengths of the first ``rows`` packed rows of the store (epochs repeat)."""
    out: list[np.ndarray] = []
    loader = Loader(store, seq_len=seq_len, batch_size=64, layout="packed", seed=0,
                    num_workers=0)
    for batch in loader:
        lengths, offsets = row_segments(batch["segment_ids"])
        out.extend(np.split(lengths, offsets[1:-1]))
        if len(out) >= rows:
            break
    loader.close()
    return out[:rows]


def synthetic_rows(seq_len: int, rows: int) -> list[np.ndarray]:
    """Lognormal documents (median 600) back to back, cut into full rows of seq_len."""
    rng = np.random.default_rng(0)
    docs = np.maximum(1, rng.lognormal(np.log(600), 1.6, int(rows * seq_len / 600 * 2) + 10)
                      ).astype(np.int64)
    ends = np.cumsum(docs)
    docs = docs[:int(np.searchsorted(ends, rows * seq_len)) + 1]
    bounds = np.union1d(np.cumsum(docs), np.arange(1, rows + 1) * seq_len)
    bounds = bounds[bounds <= rows * seq_len]
    pieces = np.diff(np.concatenate([[0], bounds]))
    return np.split(pieces, np.searchsorted(bounds, np.arange(1, rows) * seq_len, side="right"))


def halves(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Causal pairs of the first and second half of a row's queries (the contiguous CP split)."""
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    mid = seq_len // 2
    cut = np.clip(mid - start, 0, lengths)  # the part of each document before the middle
    return np.array([causal_pairs(0, cut).sum(), causal_pairs(cut, lengths).sum()])


def measure(rows: list[np.ndarray], world: int, per: int, steps: int, seq_len: int) -> dict:
    """Per-step max/mean over ranks (and over rank × CP rank), plan order vs balanced."""
    n = world * per
    steps = min(steps, len(rows) // n)
    out = {k: [] for k in ("plan", "balanced", "floor", "cp_plan", "cp_balanced")}
    times = []
    for k in range(steps):
        batch = rows[k * n:(k + 1) * n]
        lengths = np.concatenate(batch)
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in batch])])
        costs = row_costs(lengths, offsets)
        t = time.perf_counter()
        a = balance_rows(costs, world=world)
        times.append(time.perf_counter() - t)
        plan = np.arange(n).reshape(world, 1, per)
        out["plan"].append(imbalance(rank_costs(costs, plan)))
        out["balanced"].append(imbalance(rank_costs(costs, a)))
        out["floor"].append(full_row_bound(lengths, offsets, world=world, capacity=seq_len))
        half = np.array([halves(r, seq_len) for r in batch])  # (rows, 2)
        zig = np.array([cp_pairs(r, cp=2) for r in batch])
        out["cp_plan"].append(imbalance(half[plan.reshape(world, per)].sum(axis=1).ravel()))
        out["cp_balanced"].append(imbalance(zig[a.reshape(world, per)].sum(axis=1).ravel()))
    res = {k: (float(np.median(v)), float(np.percentile(v, 99))) for k, v in out.items()}
    res["steps"], res["us"] = steps, float(np.median(times) * 1e6)
    return res


def main() -> None:
    """Print a markdown table: corpus × rows a rank, each figure median / p99 over the steps."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", default="/tmp/realstore")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--per", default="4,16", help="rows a rank a step, comma-separated")
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    pers = [int(x) for x in args.per.split(",")]
    need = args.world * max(pers) * args.steps
    sets = {"real": real_rows(args.store, args.seq_len, need),
            "lognormal": synthetic_rows(args.seq_len, need)}
    print(f"seq_len {args.seq_len}, {args.world} DP ranks; max/mean cost a rank, median / p99 "
          "over steps\n")
    print("| lengths | rows/rank | steps | plan order | balanced | floor | CP=2 plan, halves "
          "| CP=2 balanced, head–tail | balance_rows µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rows in sets.items():
        for per in pers:
            r = measure(rows, args.world, per, args.steps, args.seq_len)
            cells = " | ".join(f"{r[k][0]:.3f} / {r[k][1]:.3f}" for k in
                               ("plan", "balanced", "floor", "cp_plan", "cp_balanced"))
            print(f"| {name} | {per} | {r['steps']} | {cells} | {r['us']:.0f} |")


if __name__ == "__main__":
    main()
