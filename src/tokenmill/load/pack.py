"""Sample layouts over a store's global token stream: concat windows and packed document rows.

The stream is the store's documents (each ending in EOS) back to back; document d occupies
global tokens [starts[d], starts[d] + lengths[d]) with starts the exclusive cumsum of lengths.

concat: sample i of an epoch is the window of seq_len + 1 tokens at offset + i·seq_len, where the
offset in [0, seq_len) moves with the epoch; consecutive windows share one token, so every
(input, target) pair after the offset is seen once per epoch. With document masks a window also
carries the documents it crosses, found in the shards' indexes (``window_segments``).

packed: rows of C = seq_len + 1 tokens, each a list of segments (whole documents, or pieces of
documents longer than C), placed by best-fit decreasing; padding is token 0 and the loss mask is 0
wherever input and target do not belong to the same segment. With max_segments = m (kernels
with a segment limit) a row takes at most m segments, filled one row at a time (``_fair_fill``).
The Loader packs a store window by window (``packplan``); ``pack_documents`` packs one list of
documents, as a window, a streaming pass or ``inspect`` needs.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from tokenmill.base.arrays import exclusive_cumsum, ranges, stable_order
from tokenmill.base.errors import ConfigError
from tokenmill.load import fastpath
from tokenmill.load.sampler import hash_ints
from tokenmill.load.segments import fill_metadata

__all__ = [
    "PackedLayout",
    "concat_num_samples",
    "concat_offset",
    "concat_starts",
    "fill_packed_rows",
    "fill_window_metadata",
    "pack_documents",
    "pieces",
    "place",
    "truncation",
    "window_segments",
]

_TAG_CONCAT = 0x636F6E63  # "conc": separates concat offsets from other uses of hash_ints


def _check_seq_len(seq_len: int) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ConfigError(f"seq_len must be an int >= 1 (got {seq_len=!r})")
    return int(seq_len)


# ---------------------------------------------------------------------------------------------
# concat windows


def concat_num_samples(num_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens per epoch, the same for every epoch's offset.

    concat_num_samples(num_tokens=10, seq_len=4) == 1
    """
    seq_len = _check_seq_len(seq_len)
    n = (int(num_tokens) - seq_len) // seq_len
    if n < 1:
        raise ConfigError(f"{num_tokens:,} tokens is too few for seq_len={seq_len}: concat "
                          f"windows need at least 2·seq_len = {2 * seq_len:,} tokens")
    return n


def concat_offset(seq_len: int, *, seed: int, epoch: int) -> int:
    """Where epoch's windows start, in [0, seq_len), from a hash of (seed, epoch).

    0 <= concat_offset(2048, seed=0, epoch=3) < 2048
    """
    seq_len = _check_seq_len(seq_len)
    return int(hash_ints(_TAG_CONCAT, seed, epoch) % np.uint64(seq_len))


def concat_starts(sample_ids: np.ndarray, *, seq_len: int, offset: int) -> np.ndarray:
    """First global token of each concat window: offset + id·seq_len.

    concat_starts(np.array([0, 2]), seq_len=4, offset=1).tolist() == [1, 9]
    """
    return offset + np.asarray(sample_ids, dtype=np.int64) * _check_seq_len(seq_len)


def window_segments(store, starts: np.ndarray, seq_len: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The in-window parts of the documents concat windows cross, in row order: (flat offset in
    the (windows, seq_len + 1) tokens, length, not its row's first) — ``fill_metadata``'s input.
    ``store``: ``docs_at``/``doc_spans`` (a TokenStore reads only the indexes of the shards the
    windows touch: one search a shard, no array per document).

    Documents of 3, 4, 5 tokens, window_segments(store, np.array([2]), 4): [0, 1], [1, 4], [F, T]
    """
    capacity, s = seq_len + 1, np.asarray(starts, np.int64)
    edge = store.docs_at(np.concatenate([s, s + seq_len]))  # documents of each first, last token
    inner = edge[len(s):] - edge[:len(s)]  # documents starting inside each window
    counts = inner + 1
    first = exclusive_cumsum(counts)  # each row's first segment
    off = np.zeros(int(counts.sum()), np.int64)
    later = np.ones(len(off), bool)
    later[first] = False
    row = np.repeat(np.arange(len(s), dtype=np.int64), counts)
    off[later] = store.doc_spans(ranges(edge[:len(s)] + 1, inner))[0] - s[row[later]]
    end = np.append(off[1:], 0)
    end[first + inner] = capacity  # a row's last segment runs to the window's end
    keep = end > off  # an empty document between two others is no segment
    return (row * capacity + off)[keep], (end - off)[keep], later[keep]


def fill_window_metadata(store, starts: np.ndarray, seq_len: int, out: Mapping[str, np.ndarray],
                         dest, max_segments: int | None = None) -> None:
    """segment_ids, positions, loss_mask of the concat windows at ``starts`` (batch rows
    ``dest``) by the documents they cross, as for packed rows; with ``max_segments``, a window
    whose inputs cross more documents is refused (what it would do to a fixed cu_seqlens)."""
    at, seg_len, later = window_segments(store, starts, seq_len)
    if max_segments is not None:
        _check_cap(store, starts, seq_len, at, max_segments)
    fill_metadata(out, dest, (len(starts), seq_len + 1), at, seg_len, later)


def _check_cap(store, starts, seq_len: int, at: np.ndarray, max_segments: int) -> None:
    row, off = np.divmod(at, seq_len + 1)
    seen = np.bincount(row[off < seq_len], minlength=len(starts))  # segments among the inputs
    if seen.max(initial=0) <= max_segments:
        return
    r = int(np.argmax(seen))
    s = int(np.asarray(starts)[r])
    first, last = store.docs_at(np.array([s, s + seq_len - 1])).tolist()
    raise ConfigError(
        f"{store.path}: the concat window at global token {s:,} crosses {int(seen[r])} documents "
        f"({first:,} … {last:,}) in its {seq_len:,} inputs, more than max_segments="
        f"{max_segments}: raise max_segments (cu_seqlens then needs batch_size × max_segments "
        f"+ 1 slots) or leave it unset (batch_size × seq_len + 1 always suffices); the cap "
        "changes no batch, so a checkpoint resumes under the new one")


# ---------------------------------------------------------------------------------------------
# packed rows


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Rows of seq_len + 1 tokens as segments of the global stream (CSR: row_ptr → segments).

    pack_documents(np.array([3, 2]), seq_len=4).num_rows == 1
    """

    seq_len: int
    row_ptr: np.ndarray  # int64[num_rows + 1]: row r holds segments row_ptr[r]:row_ptr[r+1]
    seg_start: np.ndarray  # int64[S]: global token offset of each segment
    seg_len: np.ndarray  # int64[S]
    seg_doc: np.ndarray  # int64[S]: document id
    num_truncated: int  # documents longer than a row, cut into pieces
    num_dropped_tokens: int  # one-token tail pieces dropped (each is already its piece's last target)
    max_segments: int | None = None  # cap on segments per row (None: no cap)

    @property
    def capacity(self) -> int:
        """Tokens per row: seq_len + 1."""
        return self.seq_len + 1

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def padding_fraction(self) -> float:
        """1 − used tokens / (rows · capacity)."""
        if self.num_rows == 0:
            return 0.0
        return 1.0 - int(self.seg_len.sum()) / (self.num_rows * self.capacity)

    @property
    def most_segments(self) -> int:
        """The largest number of segments in one row."""
        return int(np.diff(self.row_ptr).max(initial=0))


def _pieces(doc_lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc, offset, length) of every item to place, in document then piece order.

    [a.tolist() for a in _pieces(np.array([2, 7]), 2)] == [[0, 1, 1, 1], [0, 0, 2, 4], [2, 3, 3, 3]]
    """
    capacity = seq_len + 1
    # a document longer than a row: pieces start every seq_len tokens, overlap by one token, and
    # a last piece of one token (no pair) is left out: starts s with s <= length - 2
    n_pieces = np.where(doc_lengths > capacity, (doc_lengths - 2) // seq_len + 1,
                        (doc_lengths > 0).astype(np.int64))
    doc = np.repeat(np.arange(len(doc_lengths), dtype=np.int64), n_pieces)
    offset = ranges(np.zeros(len(doc_lengths), np.int64), n_pieces) * seq_len
    length = np.minimum(capacity, doc_lengths[doc] - offset)
    return doc, offset, length


def _best_fit(lengths: np.ndarray, capacity: int, first_row: int) -> np.ndarray:
    """Row of each item (lengths >= 1, sorted decreasing) by best fit: the open row with the
    least room that fits, ties to the lowest row id; a new row when none fits.

    Items of one length come in runs; the row that takes one item of a run keeps taking the run
    while it has room (its room left is then the smallest that fits: a row with less would have
    been chosen), so a run goes to a row ``room // length`` items at a time — the result of
    placing them one by one, in one step per row instead of one per item.

    _best_fit(np.array([5, 4, 3, 2, 1]), 6, 0).tolist() == [0, 1, 2, 1, 0]
    """
    n = len(lengths)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if (fast := fastpath.best_fit(lengths, capacity, first_row)) is not None:
        return fast  # compiled: the same rows
    cuts = (np.flatnonzero(lengths[1:] != lengths[:-1]) + 1).tolist()
    sizes, rows = lengths.tolist(), [0] * n
    buckets: dict[int, list[int]] = {}  # room → heap of row ids (not a list per room: a
    # window of a few rows would pay capacity + 1 lists for a handful of rooms)
    mask = 0  # bit r set ⇔ some open row has exactly r tokens of room
    next_row = first_row
    heappop, heappush = heapq.heappop, heapq.heappush
    for i, end in zip([0] + cuts, cuts + [n]):
        length = sizes[i]
        while i < end:
            m = mask >> length
            if m:
                room = length + (m & -m).bit_length() - 1  # lowest set bit: the smallest room that fits
                bucket = buckets[room]
                row = heappop(bucket)
                if not bucket:
                    mask ^= 1 << room
            else:
                row, room = next_row, capacity
                next_row += 1
            k = room // length
            if k == 1 or end - i == 1:
                rows[i] = row
                i += 1
                room -= length
            else:
                k = min(k, end - i)
                rows[i:i + k] = [row] * k
                i += k
                room -= k * length
            if room:
                bucket = buckets.get(room)
                if bucket is None:
                    bucket = buckets[room] = []
                if not bucket:
                    mask |= 1 << room
                heappush(bucket, row)
    return np.array(rows, dtype=np.int64)


def _fair_fill(lengths: np.ndarray, capacity: int, max_segments: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Rows of at most max_segments items, filled one at a time: a row opens with the largest
    item left; then, while it has k > 1 free slots, it takes the largest item that fits its fair
    share of the room (room // k), else the largest that fits; ties to the earliest item.

    [a.tolist() for a in _fair_fill(np.array([5, 1, 1, 4]), 6, 2)] == [[0, 1, 3, 2], [0, 0, 1, 1]]
    """
    by_len = stable_order(lengths)
    bounds = np.searchsorted(lengths[by_len], np.arange(capacity + 2)).tolist()
    nxt, end, by_len, sizes = bounds[:-1], bounds[1:], by_len.tolist(), lengths.tolist()
    present = sum(1 << n for n in np.unique(lengths).tolist())  # bit l ⇔ an item of length l left

    def take(limit: int) -> int:
        nonlocal present
        fits = present & ((2 << limit) - 1)
        if not fits:
            return -1
        length = fits.bit_length() - 1
        item = by_len[nxt[length]]
        nxt[length] += 1
        if nxt[length] == end[length]:
            present ^= 1 << length
        return item

    placed, rows, row = [], [], 0
    while len(placed) < len(lengths):
        room, free = capacity, max_segments
        while free and room > 0:
            item = take(room // free) if 1 < free < max_segments else -1
            if item < 0 and (item := take(room)) < 0:
                break
            placed.append(item)
            rows.append(row)
            room -= sizes[item]
            free -= 1
        row += 1
    return np.array(placed, dtype=np.int64), np.array(rows, dtype=np.int64)


def _check_lengths(doc_lengths: np.ndarray) -> np.ndarray:
    lengths = np.asarray(doc_lengths)
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise ConfigError(f"doc_lengths must be a 1-d integer array (got {lengths.dtype}, "
                          f"shape {lengths.shape})")
    if lengths.size and lengths.min() < 0:
        raise ConfigError(f"doc_lengths must be >= 0 (got {lengths.min()} at document "
                          f"{int(np.argmin(lengths))})")
    return lengths.astype(np.int64)


def _check_max_segments(max_segments) -> int | None:
    if max_segments is not None and (isinstance(max_segments, bool) or not isinstance(
            max_segments, (int, np.integer)) or max_segments < 1):
        raise ConfigError(f"max_segments must be None or an int >= 1 (got {max_segments=!r})")
    return None if max_segments is None else int(max_segments)


OPEN_ROWS = 32  # rows open at once in ``_open_fit``: a row's items come from ~this many rows'
# worth of neighbouring items (0.06 points more padding than best-fit decreasing on short
# paragraphs at 16, none at 64)


def _open_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Row of each item (lengths >= 1, in their own order) by best fit among the OPEN_ROWS rows
    opened last: the one with the least room that fits (ties: the lowest row), else a new row
    (the oldest open one then closes). A row holds items that are near each other in the input.

    _open_fit(np.array([3, 4, 2, 1]), 5).tolist() == [0, 1, 0, 1]
    """
    if (fast := fastpath.open_fit(lengths, capacity)) is not None:
        return fast  # compiled: the same rows
    rows = np.empty(len(lengths), np.int64)
    rooms: list[tuple[int, int]] = []  # (room, row) of the open rows, sorted
    room_of: dict[int, int] = {}
    oldest = made = 0
    for i, x in enumerate(lengths.tolist()):
        at = bisect.bisect_left(rooms, (x, -1))  # the least room >= x, then the lowest row
        if at < len(rooms):
            room, row = rooms.pop(at)
        else:
            room, row = capacity, made
            made += 1
            if made - oldest > OPEN_ROWS:  # the oldest open row closes
                del rooms[bisect.bisect_left(rooms, (room_of.pop(oldest), oldest))]
                oldest += 1
        room_of[row] = room - x
        bisect.insort(rooms, (room - x, row))
        rows[i] = row
    return rows


def place(length: np.ndarray, capacity: int, max_segments: int | None = None,
          ordered: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Items of ``length`` (each <= capacity) placed into rows: (the items in row order, the
    number of items of each row), by best-fit decreasing, ``_open_fit`` in the items' order
    (``ordered``: rows of nearby items), or ``_fair_fill`` under a cap.

    [a.tolist() for a in place(np.array([3, 2, 4]), 5)] == [[2, 0, 1], [1, 2]]
    """
    if max_segments is not None:
        order, rows = _fair_fill(length, capacity, max_segments)  # already in row order
    elif ordered:
        rows = _open_fit(length, capacity)
        order = stable_order(rows)
        rows = rows[order]
    else:
        # decreasing length, ties by (document, piece): items are already in that order, stable
        order = stable_order(capacity - length)  # length <= capacity
        n_full = int(np.count_nonzero(length == capacity))  # a full piece fills a row alone
        rows = np.concatenate([np.arange(n_full, dtype=np.int64),
                               _best_fit(length[order[n_full:]], capacity, n_full)])
        # segments in row order (rows numbered by creation), within a row in the order placed
        by_row = stable_order(rows)
        order, rows = order[by_row], rows[by_row]
    return order, np.bincount(rows, minlength=int(rows.max(initial=-1)) + 1)


def pieces(doc_lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc, offset, length) of every item to place: a document, or a piece of one longer than
    a row (pieces start every seq_len tokens and overlap by one: every pair once).

    [a.tolist() for a in pieces(np.array([2, 7]), 2)] == [[0, 1, 1, 1], [0, 0, 2, 4], [2, 3, 3, 3]]
    """
    return _pieces(_check_lengths(doc_lengths), _check_seq_len(seq_len))


def truncation(doc_lengths: np.ndarray, seq_len: int) -> tuple[int, int]:
    """(documents longer than a row, one-token tail pieces dropped) of ``pieces``.

    truncation(np.array([2, 7]), 2) == (1, 0)
    """
    long = doc_lengths > seq_len + 1
    return (int(np.count_nonzero(long)),
            int(np.count_nonzero(long & ((doc_lengths - 1) % seq_len == 0))))


def pack_documents(doc_lengths: np.ndarray, seq_len: int,
                   max_segments: int | None = None) -> PackedLayout:
    """Pack documents into rows of seq_len + 1 tokens by best-fit decreasing; with a cap of
    max_segments segments a row, by ``_fair_fill`` (best-fit decreasing under a cap strands the
    short documents in rows of a few tokens: 25.6% padding against 9.5%, benchmarks/packing.py).

    pack_documents(np.array([3, 2, 4]), seq_len=4).row_ptr.tolist() == [0, 1, 3]
    """
    seq_len = _check_seq_len(seq_len)
    max_segments = _check_max_segments(max_segments)
    lengths = _check_lengths(doc_lengths)
    doc, offset, length = _pieces(lengths, seq_len)
    order, counts = place(length, seq_len + 1, max_segments)
    row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    starts = exclusive_cumsum(lengths)
    num_truncated, num_dropped = truncation(lengths, seq_len)
    layout = PackedLayout(
        seq_len=seq_len, row_ptr=row_ptr,
        seg_start=starts[doc[order]] + offset[order], seg_len=length[order], seg_doc=doc[order],
        num_truncated=num_truncated, num_dropped_tokens=num_dropped, max_segments=max_segments)
    _freeze(layout)
    return layout


def _freeze(layout: PackedLayout) -> None:
    for a in (layout.row_ptr, layout.seg_start, layout.seg_len, layout.seg_doc):
        a.flags.writeable = False


Tokens = np.ndarray | Callable[[int, int], np.ndarray]
Gather = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (starts, lengths) -> tokens back to back


def fill_packed_rows(layout: PackedLayout, row_ids: np.ndarray, tokens: Tokens,
                     out: Mapping[str, np.ndarray], rows: np.ndarray | None = None, *,
                     gather: Gather | None = None) -> None:
    """Write packed rows row_ids into batch rows `rows` (default 0..len-1) of the arrays in `out`.

    `tokens`: the flat global token array (a memmap is fine) or a `read(start, stop)` callable
    (TokenStore.tokens); `gather(starts, lengths)`, if given, returns all the batch's segments
    back to back (one gather a batch). `out` holds (B, seq_len) "inputs", "targets" and maybe
    "segment_ids" (1-based in its row, 0 on padding), "positions" (0 at each segment start) and
    "loss_mask" (1 where input and target are in the same segment). Padding token id is 0.
    """
    row_ids = np.asarray(row_ids, dtype=np.int64).ravel()
    if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= layout.num_rows):
        raise ConfigError(f"row ids must be in [0, {layout.num_rows}) (got min {row_ids.min()}, "
                          f"max {row_ids.max()})")
    dest = slice(0, len(row_ids)) if rows is None else np.asarray(rows, dtype=np.int64).ravel()
    if not isinstance(dest, slice) and np.array_equal(dest, np.arange(len(row_ids))):
        dest = slice(0, len(row_ids))  # a slice assigns faster than an index array
    if gather is None and isinstance(tokens, np.ndarray) and fastpath.packed_rows(
            layout, row_ids, dest, out, np.array([0, len(tokens)]), lambda _: tokens):
        return
    b, capacity = len(row_ids), layout.capacity
    first = layout.row_ptr[row_ids]
    n_segs = layout.row_ptr[row_ids + 1] - first
    seg = ranges(first, n_segs)  # the batch's segments, row by row
    seg_len, seg_start = layout.seg_len[seg], layout.seg_start[seg]
    tok_before = exclusive_cumsum(seg_len)  # tokens of the batch before each segment
    row_of = np.repeat(np.arange(b, dtype=np.int64), n_segs)
    in_row = tok_before - tok_before[exclusive_cumsum(n_segs)][row_of]  # segment's row offset
    total = int(seg_len.sum())
    padded = total != b * capacity  # a batch without padding needs no index array, no scatter
    flat = ranges(row_of * capacity + in_row, seg_len) if padded else None
    if gather is None and isinstance(tokens, np.ndarray):
        vals = tokens[ranges(seg_start, seg_len)]
    else:
        vals = (gather or _reads(tokens))(seg_start, seg_len)
    buf = _placed(vals, flat, b * capacity, out["inputs"].dtype).reshape(b, capacity)
    out["inputs"][dest] = buf[:, :-1]
    out["targets"][dest] = buf[:, 1:]
    if not {"segment_ids", "positions", "loss_mask"} & out.keys():
        return
    fill_metadata(out, dest, (b, capacity), row_of * capacity + in_row, seg_len, in_row > 0)


def _reads(read: Callable[[int, int], np.ndarray]) -> Gather:
    return lambda starts, lens: np.concatenate(
        [read(s, s + n) for s, n in zip(starts.tolist(), lens.tolist())] or [np.zeros(0, int)])


def _placed(values: np.ndarray, flat: np.ndarray | None, size: int, dtype) -> np.ndarray:
    """``values`` laid out at indices ``flat`` of a zeroed array of ``size`` (as is: no flat)."""
    if flat is None:
        return values
    buf = np.zeros(size, dtype=dtype)
    buf[flat] = values
    return buf
