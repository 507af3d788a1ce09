"""Filling batch rows from a store's shards: concat windows and packed rows by slice copies.

Each row is ``seq_len + 1`` tokens, copied once from its shard into a per-thread scratch array
of the store's dtype; ``inputs`` and ``targets`` are then written for the whole batch in two
casts (``inputs = rows[:, :-1]``, ``targets = rows[:, 1:]``) instead of two copies a row::

    filler = RowFiller(store, store.shard_token_starts, seq_len=2048, dtype=store.dtype)
    filler.windows(np.array([0, 4096]), np.arange(2), out)   # out: {"inputs", "targets"} (2, 2048)

The store is read through two methods (``Shards``), looked up per row and never held across rows:
a store maps shards on demand, a bounded number at a time. A row that crosses a shard's end is
copied piece by piece (``copy_tokens``). Packed rows of a batch with few segments (the usual case:
~1.1 documents a row) take the same path, and their metadata is written for the whole batch as
if every row were one document, then corrected on the rows that are not.
"""

from __future__ import annotations

import mmap
import threading
import time
from bisect import bisect_right
from functools import cached_property
from typing import Protocol

import numpy as np

from tokenmill.base.arrays import distinct, ranges
from tokenmill.load import fastpath

__all__ = ["RowFiller", "SLICE_SEGMENTS", "Shards", "as_slice", "one_piece_starts", "row_at"]

SLICE_SEGMENTS = 32  # up to this many ranges a batch, slice copies beat building index arrays
SLOW_COPY_S = 500e-6  # a batch's copies this slow read pages from disk (warm: ~10 µs)
ADVISE_BATCHES = 64  # then ask for the next batches' pages at once (madvise), this many
PAGE = mmap.PAGESIZE


class Shards(Protocol):
    """What a RowFiller reads: a store's shard arrays and a copy across shard ends."""

    def shard(self, i: int) -> np.ndarray:
        """The token array of shard ``i``."""

    def copy_tokens(self, start: int, out: np.ndarray) -> None:
        """Global tokens [start, start + len(out)) into ``out``, across shards."""


class RowFiller:
    """Rows of a batch from one store's shards (a scratch array per thread: workers fill
    batches concurrently)."""

    def __init__(self, store: Shards, shard_starts: np.ndarray, *, seq_len: int, dtype):
        self.store, self.seq_len, self.dtype = store, seq_len, np.dtype(dtype)
        self.bounds = np.asarray(shard_starts, dtype=np.int64)  # token start of each shard, total
        self.starts = self.bounds.tolist()
        self.local = threading.local()
        self.advising = 0  # batches left that ask the kernel for their pages first

    @cached_property
    def ramp(self) -> np.ndarray:
        """Positions 0, 1, 2, … of a segment (made when first needed: 4 MB at seq_len 2^20,
        which the compiled filler never needs)."""
        return np.arange(self.seq_len + 1, dtype=np.int32)

    def scratch(self, rows: int, dtype: np.dtype) -> np.ndarray:
        """This thread's (rows, seq_len + 1) array of ``dtype`` (made once per shape)."""
        buf = getattr(self.local, "rows", None)
        if buf is None or buf.shape[0] != rows or buf.dtype != dtype:
            buf = self.local.rows = np.empty((rows, self.seq_len + 1), dtype)
        return buf

    def copy(self, start: int, out: np.ndarray) -> None:
        """Global tokens [start, start + len(out)) into ``out``: one slice copy inside a shard."""
        k = bisect_right(self.starts, start) - 1  # the shard holding token ``start``
        local = start - self.starts[k]
        data = self.store.shard(k)
        if local + len(out) <= len(data):
            out[:] = data[local:local + len(out)]
        else:
            self.store.copy_tokens(start, out)

    def windows(self, starts: list[int], dest: slice | np.ndarray, out: dict) -> None:
        """Rows of seq_len + 1 tokens starting at global tokens ``starts`` (concat windows) into
        batch rows ``dest`` (a slice, or ascending distinct indices) of ``out``."""
        buf = self.scratch(len(starts), self.dtype)  # the store's: cast once, in _inputs_targets
        self._copy_rows(starts, buf)
        self._inputs_targets(buf, dest, out)

    def _copy_rows(self, starts: list[int], buf: np.ndarray) -> None:
        """``buf[i]`` = global tokens [s, s + seq_len + 1) for every ``s = starts[i]`` >= 0 (a
        row marked -1 is left alone). This is the hot loop: a shard is looked up only when a
        row is not inside the previous row's shard."""
        n, bounds, shard_of = self.seq_len + 1, self.starts, self.store.shard
        t0 = time.perf_counter()
        if self.advising:  # pages were read from disk lately: ask for all of this batch's at once
            self.advising -= 1
            for s in starts:
                if s >= 0:
                    self.will_need(s, n)
        lo = hi = 0
        data = buf  # replaced at the first row: every row starts outside [0, 0)
        for i, s in enumerate(starts):
            if s < lo or s + n > hi:
                if s < 0:
                    continue
                k = bisect_right(bounds, s) - 1
                lo, hi, data = bounds[k], bounds[k + 1], shard_of(k)
                if s + n > hi:  # across the shard's end: piece by piece
                    self.store.copy_tokens(s, buf[i])
                    lo = hi = 0
                    continue
            buf[i] = data[s - lo:s - lo + n]
        if time.perf_counter() - t0 > SLOW_COPY_S:
            self.advising = ADVISE_BATCHES

    def will_need(self, start: int, n: int) -> None:
        """Ask the kernel to read global tokens [start, start + n) now, in the background
        (``madvise(MADV_WILLNEED)``): a batch's reads then overlap instead of one page fault —
        and its 128 KiB read-around — after another (cold pages: ~2.5 ms a batch → ~0.1 ms)."""
        k = bisect_right(self.starts, start) - 1
        data = self.store.shard(k)
        mm = getattr(data.base, "obj", None)  # the mmap under a mapped shard (store.io.map_file)
        if not hasattr(mm, "madvise"):
            return
        size = data.itemsize
        at = (start - self.starts[k]) * size // PAGE * PAGE
        end = min((start - self.starts[k] + n) * size, len(mm))
        if end > at:
            mm.madvise(mmap.MADV_WILLNEED, at, end - at)

    def _inputs_targets(self, buf: np.ndarray, dest: slice | np.ndarray, out: dict) -> None:
        out["inputs"][dest] = buf[:, :-1]
        out["targets"][dest] = buf[:, 1:]

    def packed(self, layout, addrs: np.ndarray, dest: slice | np.ndarray, out: dict) -> bool:
        """Packed rows ``addrs`` of ``layout`` (a ``pack.PackedLayout``) into batch rows ``dest``
        by slice copies, if the rows that are not one piece of one document
        (``one_piece_starts``) hold at most SLICE_SEGMENTS segments (else False: nothing
        written); the same bytes as ``pack.fill_packed_rows``: padding 0, segment ids from 1,
        positions from 0 in each segment, loss_mask 0 on a segment's last token and on padding.
        The compiled filler (``fastpath``), when built, takes any number of segments."""
        if fastpath.packed_rows(layout, addrs, dest, out, self.bounds, self.store.shard):
            return True
        starts = one_piece_starts(layout, addrs)
        odd = [i for i, s in enumerate(starts) if s < 0]  # usually none, or one
        ptr = layout.row_ptr
        segs = [(i, int(ptr[a]), int(ptr[a + 1])) for i, a in ((i, int(addrs[i])) for i in odd)]
        if sum(b - a for _, a, b in segs) > SLICE_SEGMENTS:
            return False
        buf = self.scratch(len(starts), self.dtype)  # the store's: cast once, in _inputs_targets
        self._copy_rows(starts, buf)
        pieces = []
        for i, a, b in segs:
            lengths = layout.seg_len[a:b].tolist()
            at = 0
            for s, n in zip(layout.seg_start[a:b].tolist(), lengths):
                self.copy(s, buf[i, at:at + n])
                at += n
            buf[i, at:] = 0
            pieces.append((row_at(dest, i), lengths))
        self._inputs_targets(buf, dest, out)
        if "segment_ids" in out:
            out["segment_ids"][dest] = 1  # one segment filling the row: the common case
            out["positions"][dest] = self.ramp[:-1]
            out["loss_mask"][dest] = 1
            for row, lengths in pieces:
                self._metadata(out, row, lengths)
        return True

    def _metadata(self, out: dict, dst: int, lengths: list[int]) -> None:
        L, at = self.seq_len, 0
        sid, pos, mask = out["segment_ids"][dst], out["positions"][dst], out["loss_mask"][dst]
        for j, n in enumerate(lengths):
            e = min(at + n, L)
            sid[at:e] = j + 1
            pos[at:e] = self.ramp[:e - at]
            mask[at:e] = 1
            if at + n - 1 < L:
                mask[at + n - 1] = 0  # a segment's last token has no target in it
            at += n
        if at < L:  # padding
            sid[at:], pos[at:], mask[at:] = 0, 0, 0

    def gather(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Tokens of the global ranges [start, start + length) back to back: slice copies for a
        few ranges, else one gather through one index array per shard touched (same bytes)."""
        bounds = self.bounds
        shard = np.searchsorted(bounds, starts, side="right") - 1
        local = starts - bounds[shard]
        out = np.empty(int(lengths.sum()), self.dtype)
        if len(starts) <= SLICE_SEGMENTS or np.any(local + lengths > bounds[shard + 1] -
                                                   bounds[shard]):  # few, or crossing an end
            at = 0
            for s, n in zip(starts.tolist(), lengths.tolist()):
                self.copy(s, out[at:at + n])
                at += n
            return out
        at = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], out=at[1:])
        for k in distinct(shard):
            sel = np.flatnonzero(shard == k)  # the store maps shards on demand: one at a time
            out[ranges(at[sel], lengths[sel])] = \
                self.store.shard(k)[ranges(local[sel], lengths[sel])]
        return out


def as_slice(rows: np.ndarray) -> slice | np.ndarray:
    """Ascending distinct ``rows`` as a slice when they are consecutive (a slice assigns faster
    than an index array).

    as_slice(np.arange(2, 5)) == slice(2, 5)
    """
    first, last = int(rows[0]), int(rows[-1])
    if last - first == len(rows) - 1:
        return slice(first, last + 1)
    return rows


def row_at(dest: slice | np.ndarray, i: int) -> int:
    """The batch row that item ``i`` of ``dest`` (a slice or an index array) goes to.

    row_at(slice(4, 8), 1) == 5
    """
    return dest.start + i if isinstance(dest, slice) else int(dest[i])


def one_piece_starts(layout, ids: np.ndarray) -> list[int]:
    """Per packed row id of ``layout``, the global token its row starts at if the row is one
    piece of one document filling it (the usual row), else -1.

    one_piece_starts(pack_documents(np.array([5, 2]), seq_len=4), np.array([0, 1])) == [0, -1]
    """
    first = layout.row_ptr[ids]
    one = np.flatnonzero(layout.row_ptr[ids + 1] - first == 1)  # an empty row has no seg_len
    out = np.full(len(first), -1, np.int64)
    whole = one[layout.seg_len[first[one]] == layout.capacity]
    out[whole] = layout.seg_start[first[whole]]
    return out.tolist()


