"""Equal attention work across data-parallel ranks: a cost per row, and the rows of a global batch
assigned to (rank, microbatch) with equal counts so the ranks' costs are near equal. Pure numpy functions of their arguments: no RNG, no I/O, ties broken
by index, so every rank computes the same answer from the same global batch.

A global batch's rows are given as their segments' lengths, flat, with row offsets (a CSR)::

    lengths [3, 4, 8, 2, 2, 2]      offsets [0, 2, 3, 6]    → row 0: 3+4, row 1: 8, row 2: 2+2+2

Cost of a row = a·Σ len² + b·Σ len over its segments (``CostModel``). The defaults a = b = ½ count
the (query, key) pairs a causal document mask keeps, n(n+1)/2 a document of n tokens: what the
attention kernels' FLOPs are proportional to. ``CostModel.transformer(d_model)`` adds the linear
layers' work (QKV/O projections and a 4× MLP: 24·d² FLOPs a token a layer against 4·d a pair,
so 6·d pairs' worth a token).

Which rows make up a global batch can be stratified too (``stratified_order``): a block's rows
dealt to its places so that every run of consecutive places — a global batch of any size — holds
a cost mix like the block's, which the per-step deal can balance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.base.errors import ConfigError, check_int

__all__ = ["CostModel", "balance_rows", "cost_model_of", "full_row_bound", "imbalance",
           "microbatch_rows", "rank_costs", "row_costs", "row_segments", "stratified_order"]

REFINE_ROUNDS = 64  # pair swaps tried after the greedy deal: each lowers the heaviest rank
REFINE_GAIN = 1e-4  # ... by at least this fraction of the mean rank cost (512 rows: 3.6 → 0.8 ms)
GOLDEN64 = 0x9E3779B97F4A7C15  # 2**64 / φ: i·GOLDEN64 mod 2**64 spreads any run of i places evenly


@dataclass(frozen=True)
class CostModel:
    """cost(row) = a·Σ len² + b·Σ len over the row's segments (a, b >= 0, not both 0).

    CostModel().segment_costs(np.array([1, 3])).tolist() == [1.0, 6.0]
    """

    a: float = 0.5
    b: float = 0.5

    def __post_init__(self):
        for name in ("a", "b"):
            v = getattr(self, name)
            if not isinstance(v, (int, float, np.floating, np.integer)) or isinstance(v, bool) \
                    or not np.isfinite(v) or v < 0:
                raise ConfigError(f"CostModel.{name} must be a finite number >= 0 (got {name}={v!r})")
        if self.a == 0 and self.b == 0:
            raise ConfigError("CostModel(a=0, b=0) makes every row free; give a > 0 (attention) "
                              "or b > 0 (tokens)")

    @classmethod
    def transformer(cls, d_model: int) -> CostModel:
        """Causal attention pairs plus the linear layers of a transformer of width ``d_model``
        (6·d_model pairs' worth of work a token).

        CostModel.transformer(1024).b == 0.5 + 6 * 1024
        """
        d = check_int("d_model", d_model, minimum=1)
        return cls(a=0.5, b=0.5 + 6.0 * d)

    def segment_costs(self, lengths) -> np.ndarray:
        """float64 cost of each segment on its own."""
        n = np.asarray(lengths, dtype=np.float64)
        return self.a * n * n + self.b * n


def cost_model_of(balance) -> CostModel | None:
    """A Loader's ``balance`` setting as a CostModel: None (off), "attention" (``CostModel()``)
    or a CostModel; else ConfigError.

    cost_model_of("attention") == CostModel()
    """
    if balance is None or isinstance(balance, CostModel):
        return balance
    if isinstance(balance, str) and balance == "attention":
        return CostModel()
    raise ConfigError(f"balance must be None, 'attention' or a tokenmill.load.balance.CostModel (got "
                      f"balance={balance!r}); e.g. balance='attention' for causal document-masked "
                      "attention, CostModel.transformer(d_model) to count the linear layers too")


def _rows(lengths, offsets) -> tuple[np.ndarray, np.ndarray]:
    """The (lengths, offsets) CSR checked: offsets rise from 0 to len(lengths), lengths >= 0."""
    lengths = np.asarray(lengths)
    offsets = np.asarray(offsets)
    if lengths.ndim != 1 or offsets.ndim != 1 or (lengths.size and lengths.dtype.kind not in "iu") \
            or offsets.dtype.kind not in "iu":
        raise ConfigError(f"lengths and offsets must be 1-d integer arrays (got lengths "
                          f"{lengths.dtype} {lengths.shape}, offsets {offsets.dtype} {offsets.shape})")
    if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(lengths) or \
            np.any(np.diff(offsets) < 0):
        raise ConfigError(f"offsets must rise from 0 to len(lengths)={len(lengths)} (got "
                          f"{offsets[:4].tolist()}…{offsets[-2:].tolist()}); pass the row "
                          "pointers of the segments, e.g. from row_segments(segment_ids)")
    if lengths.size and lengths.min() < 0:
        raise ConfigError(f"segment lengths must be >= 0 (got {int(lengths.min())} at segment "
                          f"{int(np.argmin(lengths))})")
    return lengths.astype(np.int64, copy=False), offsets.astype(np.int64, copy=False)


def row_segments(segment_ids) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, offsets) of the segments of packed rows, from a (B, L) ``segment_ids`` (a
    Loader(..., layout="packed") batch's); padding (id 0) is no segment and costs nothing.

    [a.tolist() for a in row_segments([[1, 1, 2, 0], [1, 1, 1, 1]])] == [[2, 1, 4], [0, 2, 3]]
    """
    seg = np.asarray(segment_ids)
    if seg.ndim != 2 or seg.dtype.kind not in "iu":
        raise ConfigError(f"segment_ids must be a 2-d integer array (batch, seq_len) (got "
                          f"{seg.dtype}, shape {seg.shape})")
    b = seg.shape[0]
    start = seg != 0
    start[:, 1:] &= seg[:, 1:] != seg[:, :-1]
    end = seg != 0
    end[:, :-1] &= seg[:, :-1] != seg[:, 1:]
    first = np.flatnonzero(start.ravel())
    last = np.flatnonzero(end.ravel())
    offsets = np.zeros(b + 1, np.int64)
    np.cumsum(start.sum(axis=1), out=offsets[1:])
    return (last - first + 1).astype(np.int64), offsets


def row_costs(lengths, offsets, model: CostModel = CostModel()) -> np.ndarray:
    """float64 cost of each row: the sum of its segments' costs.

    row_costs([3, 4, 8], [0, 2, 3]).tolist() == [16.0, 36.0]
    """
    lengths, offsets = _rows(lengths, offsets)
    row = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    return np.bincount(row, weights=model.segment_costs(lengths), minlength=len(offsets) - 1)


def rank_costs(costs, assignment) -> np.ndarray:
    """Each rank's cost, (world,): the sum over its microbatches of its rows' costs."""
    a = np.asarray(assignment)
    return np.asarray(costs, dtype=np.float64)[a.reshape(a.shape[0], -1)].sum(axis=1)


def imbalance(costs) -> float:
    """max / mean of per-rank costs: 1.0 is perfect balance; the slowest rank's excess.

    imbalance([2.0, 1.0, 3.0]) == 1.5
    """
    c = np.asarray(costs, dtype=np.float64)
    mean = c.mean()
    return float(c.max() / mean) if mean > 0 else 1.0


def balance_rows(costs, *, world: int, micro: int = 1) -> np.ndarray:
    """Row indices of a global batch dealt to ``world`` ranks × ``micro`` microbatches, equal
    counts each, so that the ranks' costs are as equal as rows allow: (world, micro, per) int64.

    Heaviest rows first, each round of ``world`` rows to the ranks lightest so far; then pair
    swaps between the heaviest rank and any other while that lowers the heaviest. In a rank its
    rows go heaviest first, microbatch by microbatch, so microbatch m of every rank is alike.

    balance_rows([5.0, 1.0, 4.0, 2.0], world=2).tolist() == [[[0, 1]], [[2, 3]]]
    """
    c = np.asarray(costs, dtype=np.float64)
    world = check_int("world", world, minimum=1)
    micro = check_int("micro", micro, minimum=1)
    if c.ndim != 1 or len(c) % (world * micro) or not np.all(np.isfinite(c)):
        raise ConfigError(f"a global batch of {c.size} rows cannot be dealt to world={world} × "
                          f"micro={micro} with equal counts (or has a non-finite cost); make "
                          "batch_size a multiple of micro")
    per = len(c) // world
    owner = _deal(c, world, per)
    _refine(c, owner, world)
    rows = np.argsort(owner, kind="stable").reshape(world, per)  # rows of a rank by index
    heavy_first = np.argsort(-c[rows], axis=1, kind="stable")
    return np.take_along_axis(rows, heavy_first, axis=1).reshape(world, micro, per // micro)


def microbatch_rows(costs, rows, *, micro: int) -> np.ndarray:
    """A rank's ``rows`` (indices into ``costs``) in ``micro`` microbatches of equal count, dealt
    as ``balance_rows`` deals ranks so their costs are as equal as rows allow, flat: microbatch i
    is entries [i·n, (i+1)·n), n = len(rows) / micro, each microbatch's rows ascending.

    microbatch_rows([5.0, 1.0, 4.0, 2.0], [0, 1, 2, 3], micro=2).tolist() == [0, 1, 2, 3]
    """
    rows = np.asarray(rows, dtype=np.int64)
    dealt = balance_rows(np.asarray(costs, dtype=np.float64)[rows], world=micro)
    return np.sort(rows[dealt.reshape(micro, -1)], axis=1).ravel()


def _deal(c: np.ndarray, world: int, per: int) -> np.ndarray:
    """Owner rank of each row: rows heaviest first in rounds of ``world``, a round's heaviest to
    the rank lightest so far (ties: the lower rank, the lower row)."""
    order = np.argsort(-c, kind="stable").reshape(per, world)
    load = np.zeros(world)
    owner = np.empty(len(c), np.int64)
    for rnd in order:
        lightest = np.argsort(load, kind="stable")
        owner[rnd] = lightest
        load[lightest] += c[rnd]
    return owner


def _refine(c: np.ndarray, owner: np.ndarray, world: int) -> None:
    """Swap a row of the heaviest rank with a lighter row of another rank, the swap that leaves
    the pair's larger cost least, while that lowers the heaviest rank by at least REFINE_GAIN
    of the mean (in place)."""
    load = np.bincount(owner, weights=c, minlength=world)
    enough = load.mean() * REFINE_GAIN
    for _ in range(REFINE_ROUNDS if world > 1 else 0):
        hi = int(np.argmax(load))
        mine = np.flatnonzero(owner == hi)
        other = np.flatnonzero(owner != hi)
        d = c[mine][:, None] - c[other][None, :]  # cost moved off rank hi by each swap
        after = np.maximum(load[hi] - d, load[owner[other]][None, :] + d)
        after[d <= 0] = np.inf
        k = int(np.argmin(after))
        if not after.flat[k] < load[hi] - enough:
            return
        x, y = mine[k // len(other)], other[k % len(other)]
        lo = owner[y]
        owner[x], owner[y] = lo, hi
        load[hi] -= c[x] - c[y]
        load[lo] += c[x] - c[y]


def full_row_bound(lengths, offsets, *, world: int, capacity: int,
                   model: CostModel = CostModel()) -> float:
    """A floor under the imbalance (max / mean rank cost) of *any* equal-count assignment of
    these rows, even one moving whole documents between rows: a segment of ``capacity`` tokens
    fills a row alone, so some rank holds ⌈k / world⌉ of the k such segments.

    full_row_bound([4, 4, 4, 1, 1, 1, 1], [0, 1, 2, 3, 7], world=2, capacity=4) == 20 / 17
    """
    lengths, offsets = _rows(lengths, offsets)
    world = check_int("world", world, minimum=1)
    full = int(np.count_nonzero(lengths == check_int("capacity", capacity, minimum=1)))
    mean = float(model.segment_costs(lengths).sum()) / world
    floor = -(-full // world) * float(model.segment_costs(np.array([capacity]))[0])
    return max(1.0, floor / mean) if mean > 0 else 1.0


def stratified_order(costs, offset: int) -> np.ndarray:
    """The rows of a block dealt to its places by cost, int64 (place i gets row out[i]): place i
    takes the row whose cost rank is the rank of (offset + i·GOLDEN64) mod 2**64 among the
    places', so any n consecutive places — whatever n — hold rows spread evenly over the block's
    cost quantiles (the golden-ratio sequence: n points cut the circle into gaps of at most three
    sizes, none above ~2.6 / n). Rows of equal cost keep their order; exact integer arithmetic.

    stratified_order([4.0, 3.0, 2.0, 1.0], 0).tolist() == [3, 1, 2, 0]
    """
    c = np.asarray(costs, dtype=np.float64)
    with np.errstate(over="ignore"):
        q = np.uint64(offset % 2**64) + np.arange(len(c), dtype=np.uint64) * np.uint64(GOLDEN64)
    out = np.empty(len(c), np.int64)
    out[np.argsort(q, kind="stable")] = np.argsort(c, kind="stable")
    return out
