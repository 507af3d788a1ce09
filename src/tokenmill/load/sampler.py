"""Order: epoch permutations, global batches and rank slices, weighted mixing of stores.

Every function here is pure: the sample that global position p maps to depends only on
(seed, salt, p) and the sizes involved, never on global RNG state or on what was drawn before,
so any worker can compute any batch and resume is exact.

    positions = batch_positions(step, batch_size=B, rank=r, world_size=W, start=consumed)
    ids = sample_ids(positions, n=num_samples, seed=seed)   # runs on across epochs
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache

import numpy as np

from tokenmill.base.errors import ConfigError, check_int
from tokenmill.load import fastpath

__all__ = [
    "MAX_SEED",
    "Permutation",
    "Phases",
    "Schedule",
    "assign",
    "assign_phased",
    "batch_positions",
    "epoch_of",
    "epoch_permutation",
    "hash_ints",
    "mixture_schedule",
    "phased_schedule",
    "sample_ids",
    "split_epoch",
]

MAX_SEED = (1 << 64) - 1  # seeds are hashed as uint64: 2**64 would be seed 0 again, so it is refused
MAX_N = 1 << 62  # 2h <= 62 bits keeps every Feistel value and its shifts inside uint64
ROUNDS = 6
MAX_PERIOD = 1 << 16  # mixture weights are rationalized to a common denominator <= 65536
_CHUNK = 1 << 14  # indices per Feistel pass: its ~6 uint64 temporaries stay in L2 cache

_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finalizer constants
_C2 = np.uint64(0x94D049BB133111EB)
_GOLDEN_INT, _C1_INT, _C2_INT = int(_GOLDEN), int(_C1), int(_C2)
_TAG_FEISTEL = 0x7065726D  # "perm": separates key streams from other uses of hash_ints


# ---------------------------------------------------------------------------------------------
# hashing


def _to_u64(value: int | np.ndarray) -> np.ndarray:
    """Integers (Python ints of any sign/size, or integer arrays) reduced mod 2**64 as uint64."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise ConfigError(f"expected integers, got an array of dtype {value.dtype}")
        return value.astype(np.uint64)  # int64 -1 wraps to 2**64-1, the same as -1 & _M64
    return np.uint64(_word(value))


def _word(value) -> int:
    """An integer (a Python int of any sign/size, or a numpy integer) mod 2**64."""
    try:
        return operator.index(value) & _M64
    except TypeError:
        raise ConfigError(f"expected an integer (got {value!r})") from None


def _mix64(x: np.ndarray, tmp: np.ndarray) -> None:
    """The splitmix64 finalizer in place on a uint64 array (wrapping), a bijection with full
    avalanche; tmp is scratch of the same shape."""
    with np.errstate(over="ignore"):
        np.right_shift(x, np.uint64(30), out=tmp)
        x ^= tmp
        x *= _C1
        np.right_shift(x, np.uint64(27), out=tmp)
        x ^= tmp
        x *= _C2
        np.right_shift(x, np.uint64(31), out=tmp)
        x ^= tmp


def hash_ints(*values: int | np.ndarray) -> np.ndarray:
    """A 64-bit hash of a tuple of integers, broadcast over integer arrays (uint64, 0-d for ints).

    int(hash_ints(1, 2)) != int(hash_ints(2, 1)) and hash_ints(7, np.arange(3))[1] == hash_ints(7, 1)
    """
    if not any(isinstance(v, np.ndarray) for v in values):  # plain ints: no array round trips
        return np.array(_hash_words(values), dtype=np.uint64)
    words = [_to_u64(v) for v in values]
    h = np.full(np.broadcast_shapes(*(np.shape(w) for w in words)), len(values), dtype=np.uint64)
    tmp = np.empty_like(h)
    with np.errstate(over="ignore"):
        for w in words:
            h ^= w
            h += _GOLDEN
            _mix64(h, tmp)  # a bijection: distinct words at a step give distinct states
    return h


def _hash_words(values: tuple) -> int:
    """``hash_ints`` of plain integers, in Python ints (each array step of it costs ~1 µs)."""
    h = len(values)
    for v in values:
        h = ((h ^ _word(v)) + _GOLDEN_INT) & _M64
        h ^= h >> 30
        h = (h * _C1_INT) & _M64
        h ^= h >> 27
        h = (h * _C2_INT) & _M64
        h ^= h >> 31
    return h


# ---------------------------------------------------------------------------------------------
# permutation: a keyed Feistel network with cycle walking


def _half_bits(n: int) -> int:
    """The smallest h >= 1 with 4**h >= n: the Feistel domain is 2h bits.

    [_half_bits(n) for n in (1, 4, 5, 16, 17)] == [1, 1, 2, 2, 3]
    """
    return max(1, ((n - 1).bit_length() + 1) // 2)


def _round_keys(seed: int, epoch: int | np.ndarray, salt: int) -> np.ndarray:
    """Round keys: shape (ROUNDS,) for one epoch, (ROUNDS, len(epoch)) for an array of epochs."""
    return np.stack([hash_ints(_TAG_FEISTEL, seed, epoch, salt, r) for r in range(ROUNDS)])


def _feistel(x: np.ndarray, keys: np.ndarray, h: int) -> np.ndarray:
    """One pass of the balanced Feistel network on 2h-bit values (a new array), chunk by chunk."""
    out = np.empty_like(x)
    for s in range(0, len(x), _CHUNK):
        e = s + _CHUNK
        out[s:e] = _feistel_chunk(x[s:e], keys if keys.ndim == 1 else keys[:, s:e], h)
    return out


def _feistel_chunk(x: np.ndarray, keys: np.ndarray, h: int) -> np.ndarray:
    mask, shift = np.uint64((1 << h) - 1), np.uint64(h)
    left, right = x >> shift, x & mask
    f, tmp = np.empty_like(x), np.empty_like(x)
    for r in range(ROUNDS):
        np.bitwise_xor(right, keys[r], out=f)
        _mix64(f, tmp)
        f &= mask
        left ^= f
        left, right = right, left
    left <<= shift
    left |= right
    return left


def _permute(i: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """The keyed Feistel network with cycle walking (values landing >= n are mapped again until
    they fall in range) on a 1-d uint64 array; keys is (ROUNDS,) or one column per element."""
    h = _half_bits(n)
    if keys.ndim == 1 and (fast := fastpath.permute(i, n, keys, h)) is not None:
        return fast  # compiled: the same values
    out = _feistel(i, keys, h)
    todo = np.flatnonzero(out >= np.uint64(n))
    while todo.size:  # the domain is < 4n: on average < 4 passes, over a shrinking subset
        walked = _feistel(out[todo], keys if keys.ndim == 1 else keys[:, todo], h)
        out[todo] = walked
        todo = todo[walked >= np.uint64(n)]
    return out.astype(np.int64)


def _check_n(n: int) -> int:
    return check_int("n", n, minimum=1, maximum=MAX_N)


def _check_indices(indices: np.ndarray, n: int) -> np.ndarray:
    """indices as a uint64 array, or ConfigError showing the first value outside [0, n)."""
    a = np.asarray(indices)
    if a.dtype.kind not in "iu":
        raise ConfigError(f"indices must be integers (got dtype {a.dtype})")
    if a.size and (a.min() < 0 or a.max() >= n):
        at = int(np.flatnonzero(((a < 0) | (a >= n)).ravel())[0])
        raise ConfigError(f"indices must be in [0, {n}) (got {a.flat[at]} at flat position {at})")
    return a.astype(np.uint64)


@dataclass(frozen=True)
class Permutation:
    """A keyed bijection on range(n); call it on an index array.

    sorted(epoch_permutation(5, seed=0, epoch=0)(np.arange(5)).tolist()) == [0, 1, 2, 3, 4]
    """

    n: int
    keys: tuple[int, ...] = field(repr=False)  # ROUNDS 64-bit round keys

    @property
    def half_bits(self) -> int:
        """h: the network permutes 2h-bit values (those >= n walked again)."""
        return _half_bits(self.n)

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        i = _check_indices(indices, self.n)
        shape = i.shape
        out = _permute(i.ravel(), self.n, np.array(self.keys, dtype=np.uint64))
        return out.reshape(shape)


def epoch_permutation(n: int, *, seed: int, epoch: int, salt: int = 0) -> Permutation:
    """A bijection on range(n), different for every (seed, epoch, salt); O(1) memory in n.

    epoch_permutation(10**10, seed=0, epoch=0)(np.array([3])).item() < 10**10
    """
    n = _check_n(n)
    keys = _round_keys(seed, epoch, salt)
    return Permutation(n=n, keys=tuple(int(k) for k in keys))


# ---------------------------------------------------------------------------------------------
# epochs and global batches


def _check_positions(positions: np.ndarray) -> np.ndarray:
    p = np.asarray(positions)
    if p.dtype.kind not in "iu":
        raise ConfigError(f"positions must be integers (got dtype {p.dtype})")
    if p.size and p.min() < 0:
        raise ConfigError(f"positions must be >= 0 (got {p.min()})")
    return p.astype(np.int64)


def split_epoch(positions: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Global sample positions → (epoch, index within epoch) for epochs of n samples.

    [a.tolist() for a in split_epoch(np.array([0, 4, 5]), 5)] == [[0, 0, 1], [0, 4, 0]]
    """
    n = _check_n(n)
    return np.divmod(_check_positions(positions), n)


def epoch_of(positions: np.ndarray, n: int) -> np.ndarray:
    """The epoch each global sample position falls in.

    epoch_of(np.array([0, 4, 5, 10]), 5).tolist() == [0, 0, 1, 2]
    """
    return split_epoch(positions, n)[0]


def batch_positions(step: int, *, batch_size: int, rank: int, world_size: int,
                    start: int = 0) -> np.ndarray:
    """Global sample positions of rank's slice of global batch `step` (B·W samples per step).

    batch_positions(1, batch_size=2, rank=1, world_size=3, start=5).tolist() == [13, 14]
    """
    step, batch_size, rank = operator.index(step), operator.index(batch_size), operator.index(rank)
    world_size, start = operator.index(world_size), operator.index(start)
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1 (got {batch_size=})")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1 (got {world_size=})")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, world_size) (got {rank=}, {world_size=})")
    if step < 0 or start < 0:
        raise ConfigError(f"step and start must be >= 0 (got {step=}, {start=})")
    first = start + (step * world_size + rank) * batch_size
    return np.arange(first, first + batch_size, dtype=np.int64)


def sample_ids(positions: np.ndarray, *, n: int, seed: int, salt: int = 0) -> np.ndarray:
    """Sample id for each global position: epoch e = p // n, id = epoch_permutation(n, e)(p % n).

    sorted(sample_ids(np.arange(3, 6), n=3, seed=0).tolist()) == [0, 1, 2]
    """
    epoch, i = split_epoch(positions, n)
    shape = i.shape
    epoch, i = epoch.ravel(), i.ravel()
    if i.size == 0:
        return np.zeros(shape, dtype=np.int64)
    if epoch.min() == epoch.max():  # the usual case: one epoch, shared keys
        keys = _round_keys(seed, int(epoch[0]), salt)
    else:  # keys per distinct epoch, then a column of them per element
        epochs, which = np.unique(epoch, return_inverse=True)
        keys = _round_keys(seed, epochs, salt)[:, which]
    return _permute(i.astype(np.uint64), n, keys).reshape(shape)


# ---------------------------------------------------------------------------------------------
# mixtures


@dataclass(frozen=True, eq=False)
class Schedule:
    """A periodic assignment of global positions to stores that keeps every prefix within quota.

    mixture_schedule([1, 1, 2]).period == 4
    """

    numerators: tuple[int, ...]  # m_s: draws of store s per period; sum == period
    store_of: np.ndarray  # [period] store of each position within a period
    rank_in_period: np.ndarray  # [period] index of that draw among its store's draws in the period

    @property
    def period(self) -> int:
        return len(self.store_of)

    @property
    def weights(self) -> tuple[float, ...]:
        """The achieved proportions m_s / period (what the schedule really draws)."""
        return tuple(m / self.period for m in self.numerators)


def _check_weights(weights: Sequence[float]) -> list[Fraction]:
    try:
        values = [float(w) for w in weights]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"weights must be numbers (got {weights!r})") from e
    if not values:
        raise ConfigError(f"weights must not be empty (got {weights!r})")
    if not all(math.isfinite(w) and w > 0 for w in values):
        raise ConfigError(f"weights must be finite and > 0 (got {values})")
    return [Fraction(w) for w in values]


def _rationalize(weights: list[Fraction]) -> tuple[int, ...]:
    """Numerators m_s >= 1 over a common period D <= MAX_PERIOD with sum(m) == D, close to w_s·D.

    _rationalize([Fraction(1), Fraction(2)]) == (1, 2)
    """
    total = sum(weights)
    exact = [w / total for w in weights]
    near = [q.limit_denominator(MAX_PERIOD) for q in exact]  # 0.3 → 3/10: small exact periods
    period = math.lcm(*(q.denominator for q in near))
    if period > MAX_PERIOD or min(near) == 0:
        period = max(MAX_PERIOD, len(weights))
    # largest remainder: floors, then the leftover units to the largest fractional parts
    scaled = [q * period for q in exact]
    m = [math.floor(x) for x in scaled]
    by_remainder = sorted(range(len(m)), key=lambda s: (-(scaled[s] - m[s]), s))
    for s in by_remainder[: period - sum(m)]:
        m[s] += 1
    for s in range(len(m)):  # every store with weight > 0 is drawn: take the unit from the largest
        if m[s] == 0:
            m[max(range(len(m)), key=lambda t: (m[t], -t))] -= 1
            m[s] = 1
    return tuple(m)


@lru_cache(maxsize=64)
def _one_period(numerators: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """store_of and rank_in_period for one period, by earliest-deadline-first.

    Draw j (0-based) of store s with weight w = m/D may go at position p only if j < (p+1)·w
    (else the count would pass ceil((p+1)·w)) and must go at p <= ceil((j+1)/w) - 1 (else the
    count would fall below floor((p+1)·w)). These unit jobs are feasible (each interval holds at most its length of
    them, since sum(w) = 1), and EDF schedules any feasible unit-job set, so after every prefix
    of n positions floor(n·w_s) <= count_s <= ceil(n·w_s). At n = D the counts are exactly m_s,
    so the schedule repeats with period D. (The plain largest-deficit rule does not keep this:
    weights (17, 9, 105, 1, 19, 149)/300 fall 1.05 behind.)
    """
    period, k = sum(numerators), len(numerators)
    counts = [0] * k
    deadline = [-(-period // m) - 1 for m in numerators]  # last position allowed for the next draw
    store_of = np.empty(period, dtype=np.min_scalar_type(k - 1))
    rank = np.empty(period, dtype=np.int64)
    for p in range(period):
        best = -1
        for s in range(k):
            if counts[s] * period < (p + 1) * numerators[s] and (
                    best < 0 or deadline[s] < deadline[best]):
                best = s
        store_of[p], rank[p] = best, counts[best]
        counts[best] += 1
        deadline[best] = -(-(counts[best] + 1) * period // numerators[best]) - 1
    assert counts == list(numerators), (counts, numerators)  # the theorem above, checked
    store_of.flags.writeable = rank.flags.writeable = False
    return store_of, rank


def mixture_schedule(weights: Sequence[float]) -> Schedule:
    """The schedule that mixes stores in proportion to weights (normalized, rationalized to D <= 2**16).

    mixture_schedule([0.25, 0.75]).store_of.tolist() == [1, 1, 0, 1]
    """
    numerators = _rationalize(_check_weights(weights))
    store_of, rank = _one_period(numerators)
    return Schedule(numerators=numerators, store_of=store_of, rank_in_period=rank)


def assign(schedule: Schedule, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(store id, index of that draw within its store) for each global position; O(1) each.

    [a.tolist() for a in assign(mixture_schedule([1, 3]), np.arange(5))] == [[1, 1, 0, 1, 1], [0, 1, 0, 2, 3]]
    """
    p = _check_positions(positions)
    cycle, r = np.divmod(p, schedule.period)
    store = schedule.store_of[r].astype(np.int64)
    per_period = np.array(schedule.numerators, dtype=np.int64)
    return store, cycle * per_period[store] + schedule.rank_in_period[r]


# ---------------------------------------------------------------------------------------------
# mixture schedules that change at given global positions


@dataclass(frozen=True, eq=False)
class Phases:
    """Mixture phases: from global position starts[i] on, schedules[i] mixes the stores
    stores[i]; offsets[i, s] is how many draws store s had before phase i (its cursor).

    phased_schedule([(0, [1, 0]), (4, [0, 1])]).offsets.tolist() == [[0, 0], [4, 0]]
    """

    starts: tuple[int, ...]
    schedules: tuple[Schedule, ...]
    stores: tuple[np.ndarray, ...]  # global store id of each schedule's local store
    offsets: np.ndarray  # [phases, stores] draws of each store before each phase

    @property
    def weights(self) -> tuple[float, ...]:
        """The first phase's achieved proportions, one per store (0 where it is not drawn)."""
        out = [0.0] * self.offsets.shape[1]
        for s, w in zip(self.stores[0].tolist(), self.schedules[0].weights):
            out[s] = w
        return tuple(out)


def _draws_in(schedule: Schedule, n: int, num_stores: int, stores: np.ndarray) -> np.ndarray:
    """Draws of every store in the first n positions of a schedule (stores: local → global)."""
    cycles, rest = divmod(n, schedule.period)
    local = np.array(schedule.numerators, dtype=np.int64) * cycles
    local += np.bincount(schedule.store_of[:rest], minlength=len(schedule.numerators))
    out = np.zeros(num_stores, dtype=np.int64)
    out[stores] = local
    return out


def phased_schedule(phases: Sequence[tuple[int, Sequence[float]]]) -> Phases:
    """The schedule of (first global position, weight per store) phases: sorted, the first at 0;
    a weight of 0 leaves a store out of a phase, and each store's draws run on across phases.

    assign_phased(phased_schedule([(0, [1, 0]), (2, [0, 1])]), np.arange(4))[1].tolist() == [0, 1, 0, 1]
    """
    starts = [operator.index(start) for start, _ in phases]
    if not starts or starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])):
        raise ConfigError(f"mixture phases must start at 0 and be in increasing order of their "
                          f"first sample (got starts {starts})")
    num_stores = len(phases[0][1])
    schedules, stores = [], []
    for i, (_, weights) in enumerate(phases):
        w = [float(x) for x in weights]
        if len(w) != num_stores or any(not math.isfinite(x) or x < 0 for x in w) or not any(w):
            raise ConfigError(f"phase {i} (from sample {starts[i]:,}): weights must be finite, "
                              f">= 0 and not all 0, one per store (got {w})")
        ids = np.flatnonzero(np.array(w) > 0)
        schedules.append(mixture_schedule([w[s] for s in ids]))
        stores.append(ids)
    offsets = np.zeros((len(starts), num_stores), dtype=np.int64)
    for i in range(1, len(starts)):
        offsets[i] = offsets[i - 1] + _draws_in(schedules[i - 1], starts[i] - starts[i - 1],
                                                num_stores, stores[i - 1])
    offsets.flags.writeable = False
    return Phases(tuple(starts), tuple(schedules), tuple(stores), offsets)


def assign_phased(phases: Phases, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(store id, index of that draw within its store) for each global position; O(log phases).

    [a.tolist() for a in assign_phased(phased_schedule([(0, [1, 3])]), np.arange(3))] == [[1, 1, 0], [0, 1, 0]]
    """
    p = _check_positions(positions)
    phase = np.searchsorted(np.array(phases.starts, dtype=np.int64), p, side="right") - 1
    store, draw = np.empty_like(p), np.empty_like(p)
    for i in np.unique(phase).tolist():
        sel = phase == i
        local, d = assign(phases.schedules[i], p[sel] - phases.starts[i])
        store[sel] = phases.stores[i][local]
        draw[sel] = d + phases.offsets[i][store[sel]]
    return store, draw
