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

``--mode loader`` measures through the Loader instead: ``world`` Loaders (ranks 0 … world−1 of
``Loader(store, layout="packed", balance=…)``) each hand out their batch of a step, and the cost
of each rank's batch is read from its segment_ids; max / mean over the ranks per step, median and
p99, balance off (plan order) against on. Then the Loader's CPU per batch (``time.thread_time``
of every rank's ``next()`` for the same steps, inline: num_workers=0, per batch), balance on and
off interleaved ``--rounds`` times ``--batches`` steps each; the medians.

    PYTHONPATH=src python benchmarks/balance.py --mode loader --store /tmp/realstore --per 4
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tokenmill import Loader
from tokenmill.load.balance import balance_rows, full_row_bound, imbalance, rank_costs, row_costs, \
    row_segments
from tokenmill.load.cpsplit import causal_pairs, cp_pairs

from cpu_per_batch import interleaved_cpu_us  # benchmarks/: the interleaved CPU clock


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


def ranks(store: str, args, per: int, balance) -> list[Loader]:
    """One Loader a simulated rank (inline: the batches are the same for any num_workers)."""
    return [Loader(store, seq_len=args.seq_len, batch_size=per, layout="packed", seed=0, rank=r,
                   world_size=args.world, num_workers=0, balance=balance)
            for r in range(args.world)]


def through_loader(store: str, args, per: int, balance) -> list[float]:
    """Per step, max / mean over the ranks of the cost of the batch each rank's Loader handed
    out (read from its segment_ids)."""
    loaders = ranks(store, args, per, balance)
    its = [iter(ld) for ld in loaders]
    out = [imbalance([row_costs(*row_segments(next(it)["segment_ids"])).sum() for it in its])
           for _ in range(args.steps)]
    for ld in loaders:
        ld.close()
    return out


def cpu_per_batch(store: str, args, per: int) -> dict[str, float]:
    """Median µs of thread CPU a batch of a rank's Loader (every rank's batches of the same
    steps: together they read the same rows either way), balance off and on, interleaved."""
    its = {name: [iter(ld) for ld in ranks(store, args, per, bal)] for name, bal in
           (("off", None), ("on", "attention"))}
    return interleaved_cpu_us(its, rounds=args.rounds, batches=args.batches)


def loader_mode(args, pers: list[int]) -> None:
    """Print the through-the-Loader table and the CPU per batch."""
    print(f"seq_len {args.seq_len}, {args.world} ranks, {args.steps} steps through the Loader; "
          "max/mean cost across ranks, median / p99\n")
    print("| rows/rank | balance off | balance on |\n|---|---|---|")
    for per in pers if not args.cpu_only else []:
        cells = []
        for bal in (None, "attention"):
            v = through_loader(args.store, args, per, bal)
            cells.append(f"{np.median(v):.3f} / {np.percentile(v, 99):.3f}")
        print(f"| {per} | {' | '.join(cells)} |")
    print(f"\nCPU per batch (thread_time, all ranks, inline; median of {args.rounds} interleaved "
          f"rounds of {args.batches} batches)\n\n| rows/rank | balance off µs | balance on µs |"
          "\n|---|---|---|")
    for per in pers:
        us = cpu_per_batch(args.store, args, per)
        print(f"| {per} | {us['off']:.0f} | {us['on']:.0f} |")


def main() -> None:
    """Print a markdown table: corpus × rows a rank, each figure median / p99 over the steps."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", default="/tmp/realstore")
    ap.add_argument("--mode", choices=("pure", "loader"), default="pure")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--per", default="4,16", help="rows a rank a step, comma-separated")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=9, help="loader mode: CPU rounds")
    ap.add_argument("--batches", type=int, default=20, help="loader mode: steps a round")
    ap.add_argument("--cpu-only", action="store_true", help="loader mode: the CPU figures only")
    args = ap.parse_args()
    pers = [int(x) for x in args.per.split(",")]
    if args.mode == "loader":
        loader_mode(args, pers)
        return
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
