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

``--stratify`` adds the global batches of stratified rows (``Loader(..., stratify=True)``,
``balanced.stratified_rows``): in the pure mode a second table, the real rows as a stratified
Loader orders them and the synthetic rows stratified block by block (``balance.stratified_order``);
in the loader mode a third column. ``--mode order`` reports what stratifying does to the mix of
each global batch: distinct documents a global batch, the share of its rows holding a document
another of its rows holds too, and the span of plan positions it draws from, plain against
stratified.

    PYTHONPATH=src python benchmarks/balance.py --store /tmp/realstore --per 4,16 --stratify

``--exact K`` (pure mode, needs scipy) solves the K steps the deal leaves worst exactly — the
least max / mean of any equal-count assignment of the step's rows (a MILP; rows of one whole-row
segment as one integer count a rank) — and reports the median / p99 with those replaced: the
floor within a global batch's rows (valid for the p99 while K exceeds 1% of the steps).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tokenmill import Loader
from tokenmill.load.balance import CostModel, balance_rows, full_row_bound, imbalance, rank_costs, \
    row_costs, row_segments, stratified_order
from tokenmill.load.balanced import stratified_rows, strata_block
from tokenmill.load.cpsplit import causal_pairs, cp_pairs
from tokenmill.load.cuts import row_parts
from tokenmill.load.plan import global_positions

from cpu_per_batch import interleaved_cpu_us  # benchmarks/: the interleaved CPU clock


def real_rows(store: str, seq_len: int, rows: int, stratify: bool = False) -> list[np.ndarray]:
    """Segment lengths of the first ``rows`` packed rows of the store (epochs repeat), in plan
    order or (``stratify``) as the stratified order deals them: one rank's global batches."""
    out: list[np.ndarray] = []
    more = {"balance": "attention", "stratify": True} if stratify else {}
    loader = Loader(store, seq_len=seq_len, batch_size=64, layout="packed", seed=0,
                    num_workers=0, **more)
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


def stratified(rows: list) -> list:
    """Rows dealt by ``balance.stratified_order`` block by block (blocks as ``strata_block``
    cuts one epoch of them), each block's offset its index times an odd constant."""
    out, j = [], 0
    costs = np.array([row_costs(r, [0, len(r)])[0] for r in rows])
    while j < len(rows):
        b, first, end = strata_block(len(rows), j)
        out += [rows[first + i] for i in stratified_order(costs[first:end], b * 0x2545F491)]
        j = end
    return out


def halves(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Causal pairs of the first and second half of a row's queries (the contiguous CP split)."""
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    mid = seq_len // 2
    cut = np.clip(mid - start, 0, lengths)  # the part of each document before the middle
    return np.array([causal_pairs(0, cut).sum(), causal_pairs(cut, lengths).sum()])


def per_step(rows: list[np.ndarray], world: int, per: int, steps: int) -> list[float]:
    """Per step (``world`` × ``per`` rows each, in turn), max / mean cost over the ranks of the
    rows dealt by ``balance_rows``: what a balanced Loader's ranks hand out."""
    n = world * per
    out = []
    for k in range(min(steps, len(rows) // n)):
        batch = rows[k * n:(k + 1) * n]
        costs = row_costs(np.concatenate(batch), np.concatenate([[0], np.cumsum(
            [len(r) for r in batch])]))
        out.append(imbalance(rank_costs(costs, balance_rows(costs, world=world))))
    return out


def exact_max_mean(costs: np.ndarray, world: int, full: float) -> float:
    """The least max / mean rank cost of any equal-count assignment of ``costs`` to ``world``
    ranks (scipy's MILP): y[r] the rows of cost ``full`` rank r takes, x[i, r] another row's rank,
    t the largest rank cost; minimise t."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    whole = np.isclose(costs, full)
    other, per, k = costs[~whole], len(costs) // world, int(whole.sum())
    m = len(other)
    nv = world + m * world + 1
    x = world + np.arange(m * world).reshape(m, world)  # variable index of x[i, r]
    A, lo, hi = [], [], []

    def add(at, values, low, high):
        a = np.zeros(nv)
        a[at] = values
        A.append(a), lo.append(low), hi.append(high)
    add(np.arange(world), 1, k, k)  # every whole row on some rank
    for i in range(m):
        add(x[i], 1, 1, 1)  # every other row on one rank
    for r in range(world):
        add(np.r_[r, x[:, r]], 1, per, per)  # per rows a rank
        add(np.r_[r, x[:, r], nv - 1], np.r_[full, other, -1], -np.inf, 0)  # its cost <= t
        if r + 1 < world:  # ranks by whole rows, descending: fewer equal solutions to search
            add([r, r + 1], [1, -1], 0, np.inf)
    ub = np.r_[np.full(world, per), np.ones(m * world), np.inf]
    res = milp(np.eye(nv)[-1], constraints=LinearConstraint(np.array(A), lo, hi),
               bounds=Bounds(np.zeros(nv), ub), integrality=np.r_[np.ones(nv - 1), 0],
               options={"time_limit": 120})
    if res.status != 0:
        raise RuntimeError(f"the MILP did not finish ({res.message}); lower --exact")
    return float(res.x[-1] / (costs.sum() / world))


def with_exact(rows: list[np.ndarray], world: int, per: int, steps: int, seq_len: int,
               worst: int) -> tuple[float, float]:
    """Median / p99 over the steps of the deal's max / mean with its ``worst`` steps solved
    exactly (``exact_max_mean``)."""
    got = np.array(per_step(rows, world, per, steps))
    n, full = world * per, seq_len * (seq_len + 1) / 2
    for k in np.argsort(-got, kind="stable")[:worst]:
        batch = rows[k * n:(k + 1) * n]
        costs = np.array([row_costs(r, [0, len(r)])[0] for r in batch])
        got[k] = min(got[k], exact_max_mean(costs, world, full))
    return float(np.median(got)), float(np.percentile(got, 99))


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


def ranks(store: str, args, per: int, balance, **more) -> list[Loader]:
    """One Loader a simulated rank (inline: the batches are the same for any num_workers)."""
    return [Loader(store, seq_len=args.seq_len, batch_size=per, layout="packed", seed=0, rank=r,
                   world_size=args.world, num_workers=0, balance=balance, **more)
            for r in range(args.world)]


def through_loader(store: str, args, per: int, balance, **more) -> list[float]:
    """Per step, max / mean over the ranks of the cost of the batch each rank's Loader handed
    out (read from its segment_ids)."""
    loaders = ranks(store, args, per, balance, **more)
    its = [iter(ld) for ld in loaders]
    out = [imbalance([row_costs(*row_segments(next(it)["segment_ids"])).sum() for it in its])
           for _ in range(args.steps)]
    for ld in loaders:
        ld.close()
    return out


CONTENDERS = (("off", None, {}), ("on", "attention", {}),
              ("stratified", "attention", {"stratify": True}))


def cpu_per_batch(store: str, args, per: int) -> dict[str, float]:
    """Median µs of thread CPU a batch of a rank's Loader (every rank's batches of the same
    steps: together they read the same rows either way), balance off, on (and stratified),
    interleaved."""
    its = {name: [iter(ld) for ld in ranks(store, args, per, bal, **more)] for name, bal, more
           in CONTENDERS[:3 if args.stratify else 2]}
    return interleaved_cpu_us(its, rounds=args.rounds, batches=args.batches)


def loader_mode(args, pers: list[int]) -> None:
    """Print the through-the-Loader table and the CPU per batch."""
    print(f"seq_len {args.seq_len}, {args.world} ranks, {args.steps} steps through the Loader; "
          "max/mean cost across ranks, median / p99\n")
    used = CONTENDERS[:3 if args.stratify else 2]
    print("| rows/rank | " + " | ".join(f"balance {name}" for name, _, _ in used) + " |\n|---|" +
          "---|" * len(used))
    for per in pers if not args.cpu_only else []:
        cells = []
        for _, bal, more in used:
            v = through_loader(args.store, args, per, bal, **more)
            cells.append(f"{np.median(v):.3f} / {np.percentile(v, 99):.3f}")
        print(f"| {per} | {' | '.join(cells)} |")
    heads = " | ".join(f"balance {name} µs" for name, _, _ in used)
    print(f"\nCPU per batch (thread_time, all ranks, inline; median of {args.rounds} interleaved "
          f"rounds of {args.batches} batches)\n\n| rows/rank | {heads} |\n|---|" +
          "---|" * len(used))
    for per in pers:
        us = cpu_per_batch(args.store, args, per)
        print(f"| {per} | " + " | ".join(f"{us[name]:.0f}" for name, _, _ in used) + " |")


def order_of(plan, positions: np.ndarray) -> tuple[int, float, int]:
    """A global batch's mix: distinct documents, the share of its rows holding a document
    another of its rows holds, and the span (max − min) of the plan positions it draws from."""
    p = row_parts(plan, positions)
    keep = np.minimum(p.offset + p.length, plan.seq_len) > p.offset
    store = plan.sources[0].store
    docs, rows = store.docs_at(p.start[keep]), p.row[keep]
    pairs = np.unique(np.stack([docs, rows]), axis=1)  # (document, row), each once
    distinct, counts = np.unique(pairs[0], return_counts=True)
    shared = np.isin(pairs[0], distinct[counts > 1])
    return (len(distinct), len(np.unique(pairs[1][shared])) / len(positions),
            int(positions.max() - positions.min()))


def order_mode(args, pers: list[int]) -> None:
    """Print the mix of the global batches, plan order against stratified, median over steps."""
    print(f"seq_len {args.seq_len}, {args.world} ranks, {args.steps} global batches; median "
          "over them (mean in brackets)\n\n| rows/rank | order | distinct documents | rows "
          "sharing a document | span of plan positions |\n|---|---|---|---|---|")
    with Loader(args.store, seq_len=args.seq_len, batch_size=1, layout="packed", seed=0,
                num_workers=0) as ld:
        for per in pers:
            n = args.world * per
            for name in ("plan", "stratified"):
                got = []
                for k in range(args.steps):
                    pos = global_positions(k * n, batch_size=n, rank=0, world_size=1)
                    if name == "stratified":
                        pos = stratified_rows(ld.plan, pos, CostModel())[0]
                    got.append(order_of(ld.plan, pos))
                cells = " | ".join(f"{np.median(v):.3g} ({np.mean(v):.3g})" for v in zip(*got))
                print(f"| {per} | {name} | {cells} |")


def main() -> None:
    """Print a markdown table: corpus × rows a rank, each figure median / p99 over the steps."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", default="/tmp/realstore")
    ap.add_argument("--mode", choices=("pure", "loader", "order"), default="pure")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--per", default="4,16", help="rows a rank a step, comma-separated")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=9, help="loader mode: CPU rounds")
    ap.add_argument("--batches", type=int, default=20, help="loader mode: steps a round")
    ap.add_argument("--cpu-only", action="store_true", help="loader mode: the CPU figures only")
    ap.add_argument("--stratify", action="store_true", help="add stratified global batches")
    ap.add_argument("--exact", type=int, default=0, help="pure mode: solve this many worst "
                    "steps exactly (scipy)")
    args = ap.parse_args()
    pers = [int(x) for x in args.per.split(",")]
    if args.mode != "pure":
        (loader_mode if args.mode == "loader" else order_mode)(args, pers)
        return
    need = args.world * max(pers) * args.steps
    sets = {"real": real_rows(args.store, args.seq_len, need),
            "lognormal": synthetic_rows(args.seq_len, need)}
    if args.stratify:
        sets.update({"real, stratified": real_rows(args.store, args.seq_len, need, True),
                     "lognormal, stratified": stratified(sets["lognormal"])})
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
    for name, rows in sets.items() if args.exact else ():
        for per in pers:
            med, p99 = with_exact(rows, args.world, per, args.steps, args.seq_len, args.exact)
            print(f"\n{name}, {per} rows a rank: the least max/mean of any equal-count "
                  f"assignment (the {args.exact} worst steps solved exactly): {med:.3f} / {p99:.3f}")


if __name__ == "__main__":
    main()
