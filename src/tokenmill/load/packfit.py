"""One window's items packed into exactly the rows the plan allots it (``packplan``).

Packed naturally first (``pack.place``: best-fit decreasing, or the fair fill under a cap); a
surplus of rows then splits the rows of most segments, a deficit moves the emptiest rows' items
into the others' room, cutting what does not fit whole (pieces of >= 2 tokens, overlapping by
one: every (input, target) pair stays in exactly one row); a window whose kept rows have no room
left is cut as one stream (``_stream``), which fits any window allotted >= (T - 1) / L rows.
"""

from __future__ import annotations

import heapq

import numpy as np

from tokenmill.base.arrays import stable_order
from tokenmill.base.errors import ConfigError
from tokenmill.load import pack

__all__ = ["fit_rows"]


def fit_rows(length: np.ndarray, capacity: int, rows: int, max_segments: int | None = None,
             ordered: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Items of ``length`` (each <= capacity) in exactly ``rows`` rows: (item, offset, length)
    of every segment in row order, the row pointers, and the number of items cut. Packed
    naturally (``pack.place``, ``ordered`` or not); then a surplus of rows splits the rows of
    most segments, a deficit moves the emptiest rows' items into the others' room, cutting what
    does not fit.

    fit_rows(np.array([3, 2, 4]), 5, 3)[3].tolist() == [0, 1, 2, 3]
    """
    order, counts = pack.place(length, capacity, max_segments, ordered)
    n = len(counts)
    row = np.repeat(np.arange(n, dtype=np.int64), counts)
    item, off, seg_len = order, np.zeros(len(order), np.int64), length[order].astype(np.int64)
    cut: set[int] = set()
    if n < rows:
        item, off, seg_len, row = _split(item, off, seg_len, row, n, rows, cut)
    elif n > rows:
        try:
            item, off, seg_len, row = _squeeze(item, off, seg_len, row, n, rows, capacity,
                                               max_segments, cut)
        except _NoRoom:
            if max_segments is not None:
                raise ConfigError(
                    f"packing a window of documents into its {rows} rows of {capacity} tokens "
                    f"under max_segments={max_segments} left tokens without a row: these "
                    "documents' lengths vary more than the plan allowed for; raise "
                    "max_segments (or leave it unset) for this store") from None
            item, off, seg_len, row = _stream(length, capacity, rows, cut)
    by_row = stable_order(row)
    counts = np.bincount(row, minlength=rows)
    row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return item[by_row], off[by_row], seg_len[by_row], row_ptr, len(cut)


def _split(item, off, seg_len, row, n: int, rows: int, cut: set):
    """New rows n … rows-1: each takes the second half of the segments of the row with the most
    (ties: the lowest row), or, when every row has one, the second half of the longest segment
    (ties: the first). Both found by heaps (stale entries skipped): O(rows · log) — a row's
    segments stay one run of indices (halving a run leaves two), so a row is (first, count),
    never a list of its segments — plus O(segments) for the longest-segment heap, built only
    when every row is down to one segment."""
    size, grow = len(item), rows - n  # a long segment's second half is appended: <= grow
    item, off, seg_len, row = (np.concatenate([np.asarray(a, np.int64), np.zeros(grow, np.int64)])
                               for a in (item, off, seg_len, row))
    cnt = np.bincount(row[:size], minlength=rows).tolist()  # segments of each row
    first = np.concatenate([[0], np.cumsum(cnt[:-1])]).tolist()  # each row's first segment
    most = [(-c, x) for x, c in enumerate(cnt[:n])]  # (-segments, row)
    heapq.heapify(most)
    longest = None  # (-length, segment), made at first need: no segment changes before
    for new in range(n, rows):
        while most and -most[0][0] != cnt[most[0][1]]:
            heapq.heappop(most)
        if most and -most[0][0] >= 2:
            r = most[0][1]
            half = cnt[r] // 2
            first[new], cnt[new], cnt[r] = first[r] + half, cnt[r] - half, half
            row[first[new]:first[new] + cnt[new]] = new
            heapq.heappush(most, (-half, r))
            heapq.heappush(most, (-cnt[new], new))
            continue
        if longest is None:
            longest = [(-x, i) for i, x in enumerate(seg_len[:size].tolist())]
            heapq.heapify(longest)
        while longest and -longest[0][0] != seg_len[longest[0][1]]:
            heapq.heappop(longest)
        if not longest or -longest[0][0] < 3:
            continue  # nothing left to split: an empty row (only for windows of tiny documents)
        at = longest[0][1]
        x = int(seg_len[at])
        g = (x + 1) // 2  # pieces [0, g) and [g - 1, x): the token at g - 1 ends one, starts one
        seg_len[at] = g
        item[size], off[size], seg_len[size], row[size] = item[at], off[at] + g - 1, x - g + 1, new
        first[new], cnt[new] = size, 1
        heapq.heappush(longest, (-g, at))
        heapq.heappush(longest, (-(x - g + 1), size))
        heapq.heappush(most, (-1, new))
        cut.add(int(item[at]))
        size += 1
    return item[:size], off[:size], seg_len[:size], row[:size]


def _squeeze(item, off, seg_len, row, n: int, rows: int, capacity: int, cap: int | None,
             cut: set):
    """Rows n - rows … emptiest dissolved; their segments, longest first, go whole to the
    kept row of least room that fits (and has a free slot), else are cut across the kept rows
    of most room (pieces >= 2 tokens: a pair each)."""
    fill = np.bincount(row, weights=seg_len, minlength=n)
    counts = np.bincount(row, minlength=n)
    gone = np.argsort(fill, kind="stable")[:n - rows]
    keep = np.setdiff1d(np.arange(n), gone)
    renumber = np.full(n, -1, np.int64)
    renumber[keep] = np.arange(rows)
    moved = np.isin(row, gone)
    out_item, out_off = item[~moved].tolist(), off[~moved].tolist()
    out_len, out_row = seg_len[~moved].tolist(), renumber[row[~moved]].tolist()
    room = (capacity - fill[keep]).astype(np.int64).tolist()
    slots = [(cap - int(c)) if cap else 1 << 30 for c in counts[keep]]
    rooms = _Rooms(room, slots)
    todo = sorted(zip(seg_len[moved].tolist(), item[moved].tolist(), off[moved].tolist()),
                  key=lambda t: -t[0])
    for x, it, o in todo:
        r = rooms.best_fit(x)
        while r < 0:  # no room takes it whole: fill the largest room, go on with the rest
            r, g = rooms.largest()
            if r < 0:
                raise _NoRoom
            rooms.take(r, g)
            out_item.append(it), out_off.append(o), out_len.append(g), out_row.append(r)
            cut.add(it)
            o, x = o + g - 1, x - g + 1
            r = rooms.best_fit(x)
        rooms.take(r, x)
        out_item.append(it), out_off.append(o), out_len.append(x), out_row.append(r)
    return tuple(np.asarray(a, np.int64) for a in (out_item, out_off, out_len, out_row))


class _NoRoom(Exception):
    """The kept rows have no room left for the dissolved rows' segments."""


def _stream(length: np.ndarray, capacity: int, rows: int, cut: set):
    """The items back to back, cut into rows of ``capacity`` tokens where they cross a row's end
    (the cut token ends one piece and starts the next): (T - 1) / (capacity - 1) rows hold any
    items; rows left over split as ``_split`` does. The last resort of a window short of rows.

    _stream(np.array([3, 4]), 5, 2, set())[2].tolist() == [3, 2, 3]   # item 1 cut: 2 + 3
    """
    item, off, seg_len, row = [], [], [], []
    r, room = 0, capacity
    for i, x in enumerate(length.tolist()):
        o = 0
        while x > room and room >= 2:  # cut: [o, o + room) here, [o + room - 1, …) next
            item.append(i), off.append(o), seg_len.append(room), row.append(r)
            cut.add(i)
            o, x, r, room = o + room - 1, x - room + 1, r + 1, capacity
        if x > room:  # a room of one token: the next row
            r, room = r + 1, capacity
        item.append(i), off.append(o), seg_len.append(x), row.append(r)
        room -= x
    used = r + 1
    if used > rows:
        raise AssertionError(f"{int(length.sum())} tokens in {used} rows, more than {rows}")
    arrays = tuple(np.asarray(a, np.int64) for a in (item, off, seg_len, row))
    return _split(*arrays, used, rows, cut) if used < rows else arrays


class _Rooms:
    """Free room of rows, by size (rows without a free slot are left out)."""

    def __init__(self, room: list[int], slots: list[int]):
        self.room, self.slots = room, slots
        self.heap = [(-r, i) for i, r in enumerate(room) if r >= 1 and slots[i] > 0]
        heapq.heapify(self.heap)  # largest room first

    def best_fit(self, x: int) -> int:
        """The row of least room >= x with a free slot (ties: lowest row), or -1."""
        best, at = -1, None
        for i, r in enumerate(self.room):
            if r >= x and self.slots[i] > 0 and (at is None or r < at):
                best, at = i, r
        return best

    def largest(self) -> tuple[int, int]:
        """(row, room) of the largest room >= 2 with a free slot, or (-1, 0)."""
        while self.heap:
            neg, i = self.heap[0]
            if -neg != self.room[i] or self.slots[i] <= 0:
                heapq.heappop(self.heap)  # stale entry
                continue
            return (i, -neg) if -neg >= 2 else (-1, 0)
        return -1, 0

    def take(self, i: int, x: int) -> None:
        """Row i takes a segment of x tokens."""
        self.room[i] -= x
        self.slots[i] -= 1
        if self.room[i] >= 1 and self.slots[i] > 0:
            heapq.heappush(self.heap, (-self.room[i], i))
