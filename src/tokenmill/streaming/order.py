"""The order of the pass: a shuffle buffer of S windows that holds no random state.

Window i waits d_i = hash_ints(DELAY_TAG, seed, i) mod min(S, i + 1) steps and windows leave in
the order of (i + d_i, i). No window moves by S places or more, and the k-th sample of the pass
is a pure function of (seed, S, k) and the number of windows. ``emission_time`` inverts the
order, so the buffer is never stored: resuming at sample k replays it from window t_k − S + 1.

    emission_order(0, 5, seed=0, shuffle_buffer=1)[0].tolist() == [0, 1, 2, 3, 4]
"""

from __future__ import annotations

import numpy as np

from tokenmill.load.sampler import hash_ints

DELAY_TAG = 0x64656C79  # "dely": separates shuffle-buffer delays from other uses of hash_ints


def window_delays(windows: np.ndarray, *, seed: int, shuffle_buffer: int) -> np.ndarray:
    """How many steps each concat window waits in the shuffle buffer: in [0, min(S, i + 1)).

    window_delays(np.arange(3), seed=0, shuffle_buffer=1).tolist() == [0, 0, 0]
    """
    i = np.asarray(windows, dtype=np.int64)
    h = hash_ints(DELAY_TAG, seed, i)
    # window i < S waits at most i steps: the stream starts at once instead of filling the buffer
    return (h % np.minimum(i + 1, shuffle_buffer).astype(np.uint64)).astype(np.int64)


def emission_order(t0: int, t1: int, *, seed: int, shuffle_buffer: int,
                   num_windows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The windows that leave the buffer at times [t0, t1), in order, and their times.

    emission_order(0, 5, seed=0, shuffle_buffer=1)[0].tolist() == [0, 1, 2, 3, 4]
    """
    lo = max(0, t0 - shuffle_buffer + 1)
    hi = t1 if num_windows is None else min(t1, num_windows)
    i = np.arange(lo, max(lo, hi), dtype=np.int64)
    t = i + window_delays(i, seed=seed, shuffle_buffer=shuffle_buffer)
    keep = (t >= t0) & (t < t1)
    i, t = i[keep], t[keep]
    order = np.lexsort((i, t))
    return i[order], t[order]


def emitted_before(t: int, *, seed: int, shuffle_buffer: int,
                   num_windows: int | None = None) -> int:
    """How many windows leave the buffer before time t (every window i <= t - S has left).

    emitted_before(10, seed=0, shuffle_buffer=1) == 10
    """
    lo = max(0, t - shuffle_buffer + 1)
    done = lo if num_windows is None else min(lo, num_windows)
    hi = t if num_windows is None else min(t, num_windows)
    if hi <= lo:
        return done
    i = np.arange(lo, hi, dtype=np.int64)
    delays = window_delays(i, seed=seed, shuffle_buffer=shuffle_buffer)
    return done + int(np.count_nonzero(i + delays < t))


def emission_time(k: int, *, seed: int, shuffle_buffer: int,
                  num_windows: int | None = None) -> int:
    """The time at which sample k of the pass leaves the buffer (binary search, O(S log k)).

    emission_time(7, seed=0, shuffle_buffer=1) == 7
    """
    order = {"seed": seed, "shuffle_buffer": shuffle_buffer, "num_windows": num_windows}
    lo, hi = 0, k + shuffle_buffer  # emitted_before(k + S) >= k + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if emitted_before(mid, **order) <= k:
            lo = mid
        else:
            hi = mid - 1
    return lo


def oldest_buffered(t: int, *, shuffle_buffer: int) -> int:
    """The oldest window that may still be in the buffer at time t: t − S + 1 (or 0).

    oldest_buffered(10, shuffle_buffer=4) == 7
    """
    return max(0, t - shuffle_buffer + 1)


def look_ahead(global_batch: int, shuffle_buffer: int) -> int:
    """Δ: the times ordered at once, in windows (a global batch at least; at most 256 so that a
    chunk of them never asks for many units at once).

    look_ahead(8, 4096) == 256
    """
    return max(global_batch, min(shuffle_buffer // 4, 256), 1)
