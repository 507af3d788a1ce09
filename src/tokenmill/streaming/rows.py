"""Packed rows in streaming mode: documents packed window by window, as the text is read.

The store ``Loader`` packs all of a store's documents at once (``pack.pack_documents``: best-fit
decreasing, documents longer than a row cut in pieces); a stream cannot wait for the last
document. So the pass is cut into *packing windows* of W = pack_window · (seq_len + 1) tokens,
and each window's documents are packed on their own by that same function:

- a window begins at a document and closes with the first document that brings it to W tokens
  or more (so each window but the last holds W to W + one document's tokens); the windows are a
  pure function of the document lengths, and a resume at a window's start finds the same ones;
- the pass's rows are the rows of window 0, then those of window 1, …: row i of the pass is a
  pure function of (inputs, tokenizer, options, seq_len, max_segments, pack_window, seed, i);
- a document is split only if it is longer than a row (the store rule), never at a window edge;
- best-fit decreasing makes the rows of long documents first, so a window's rows are put in the
  order of a permutation keyed by (seed, the window's first token) (``shuffled_rows``) before
  the shuffle buffer mixes them further.

    pass_layout(np.array([3, 2, 4]), seq_len=4, window=5).row_ptr.tolist() == [0, 2, 3]

With a window larger than the input (pack_window · (seq_len + 1) > its tokens) the pass's rows
are exactly the rows of ``pack_documents`` of all documents — the store Loader's packed rows —
in another order.

``PackedText`` packs from the text (on top of ``windows.TextWindows``); ``StoreRows`` reads the
same rows back from the complete cache store. Both are ``WindowSource``s of packed rows.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from tokenmill.load import pack
from tokenmill.base.arrays import exclusive_cumsum, ranges
from tokenmill.base.errors import ConfigError
from tokenmill.load.plan import batch_arrays
from tokenmill.load.sampler import epoch_permutation
from tokenmill.store.reader import TokenStore
from tokenmill.streaming.plan import Cursor, StreamPlan
from tokenmill.streaming.windows import TextWindows

ROW_SALT = 0x726F7773  # "rows": separates the order of a window's rows from other permutations


def window_ends(ends: np.ndarray, open_start: int, window: int) -> list[int]:
    """The documents (by index; ``ends``: their global end tokens, increasing) that close a
    packing window, the open one beginning at token ``open_start``.

    window_ends(np.array([3, 5, 9, 12]), 0, 5) == [1, 3]
    """
    out = []
    while (j := int(np.searchsorted(ends, open_start + window, side="left"))) < len(ends):
        out.append(j)
        open_start = int(ends[j])
    return out


def shuffled_rows(layout: pack.PackedLayout, *, seed: int, key: int) -> pack.PackedLayout:
    """The same rows in the order of a permutation keyed by (seed, key)."""
    n = layout.num_rows
    order = epoch_permutation(max(n, 1), seed=seed, epoch=key, salt=ROW_SALT)(np.arange(n))
    counts = np.diff(layout.row_ptr)[order]
    seg = ranges(layout.row_ptr[order], counts)
    return dataclasses.replace(
        layout, row_ptr=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        seg_start=layout.seg_start[seg], seg_len=layout.seg_len[seg], seg_doc=layout.seg_doc[seg])


def pack_window(lengths: np.ndarray, *, first_token: int, first_doc: int, seq_len: int,
                max_segments: int | None, seed: int | None = None) -> pack.PackedLayout:
    """One window's documents packed as the store packs (``pack_documents``), placed at global
    token ``first_token`` and document ``first_doc``; rows shuffled unless ``seed`` is None."""
    layout = pack.pack_documents(np.asarray(lengths, np.int64), seq_len, max_segments)
    moved = dataclasses.replace(layout, seg_start=layout.seg_start + first_token,
                                seg_doc=layout.seg_doc + first_doc)
    if seed is not None:
        moved = shuffled_rows(moved, seed=seed, key=first_token)
    for a in (moved.row_ptr, moved.seg_start, moved.seg_len, moved.seg_doc):
        a.flags.writeable = False
    return moved


def pass_layout(doc_lengths: np.ndarray, *, seq_len: int, window: int,
                max_segments: int | None = None, seed: int | None = None) -> pack.PackedLayout:
    """The pass's packed rows over all documents: each packing window packed on its own (its
    rows shuffled by ``seed``, unless None), the windows' rows one after the other."""
    lengths = np.asarray(doc_lengths, np.int64)
    starts = exclusive_cumsum(lengths)
    cuts = [j + 1 for j in window_ends(starts + lengths, 0, window)]
    bounds = sorted({0, *cuts, len(lengths)})
    parts = [pack_window(lengths[a:b], first_token=int(starts[a]) if a < len(lengths) else 0,
                         first_doc=a, seq_len=seq_len, max_segments=max_segments, seed=seed)
             for a, b in zip(bounds, bounds[1:])]
    if not parts:
        parts = [pack.pack_documents(lengths, seq_len, max_segments)]
    counts = np.concatenate([np.diff(p.row_ptr) for p in parts])
    layout = pack.PackedLayout(
        seq_len=seq_len, row_ptr=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        seg_start=np.concatenate([p.seg_start for p in parts]),
        seg_len=np.concatenate([p.seg_len for p in parts]),
        seg_doc=np.concatenate([p.seg_doc for p in parts]),
        num_truncated=sum(p.num_truncated for p in parts),
        num_dropped_tokens=sum(p.num_dropped_tokens for p in parts), max_segments=max_segments)
    return layout


def store_pass_layout(plan: StreamPlan, store: TokenStore) -> pack.PackedLayout:
    """The pass's packed rows of the complete cache store ``store``."""
    return pass_layout(store.doc_lengths, seq_len=plan.seq_len, window=plan.window_tokens,
                       max_segments=plan.order_settings.max_segments, seed=plan.seed)


def pass_length(plan: StreamPlan, store: TokenStore) -> int:
    """Samples in the pass of ``plan`` over its complete cache store: windows, or packed rows."""
    if plan.packed:
        return store_pass_layout(plan, store).num_rows
    return pack.concat_num_samples(store.num_tokens, plan.seq_len)


def new_batch(plan: StreamPlan, batch_size: int) -> dict[str, np.ndarray]:
    """Empty batch arrays: int32 inputs/targets, and for packed rows the store Loader's
    metadata arrays."""
    return batch_arrays(batch_size, plan.seq_len, np.int32, plan.packed)




class StoreRows:
    """The pass's packed rows read back from the complete cache store: no tokenizing."""

    def __init__(self, plan: StreamPlan):
        self.store = TokenStore(plan.store_dir)
        self.layout = store_pass_layout(plan, self.store)
        self.num_windows: int | None = self.layout.num_rows
        self.peak = 0

    def confirm(self, windows: int) -> None:
        """Every row is there already; a shard whose background checksum failed is raised."""
        self.store.check()

    def copy(self, windows: np.ndarray, out: dict[str, np.ndarray], rows: np.ndarray) -> None:
        """Packed rows ``windows`` of the pass from the store's memory map into rows ``rows``."""
        pack.fill_packed_rows(self.layout, windows, self.store.tokens, out, rows)

    def release(self, window: int) -> None:
        """Nothing is held."""

    def resume_from(self, window: int) -> Cursor | None:
        """A resume reads the store again: no cursor needed."""
        return None

    def close(self) -> None:
        """Close the store; idempotent."""
        self.store.close()


class Packed(NamedTuple):
    """One packing window's rows: the pass's rows [first_row, first_row + layout.num_rows)."""

    first_row: int
    layout: pack.PackedLayout
    cursor: Cursor  # where reading restarts to pack this window again (its row = first_row)


class PackedText:
    """The pass's packed rows from the text: each packing window is packed once its last
    document is read. Keeps the windows from the one holding the oldest row still needed."""

    def __init__(self, plan: StreamPlan, text: TextWindows, start: Cursor):
        self.plan, self.text = plan, text
        self.done: list[Packed] = []  # packed windows still needed, in order
        self.firsts: list[int] = []  # their first rows (for bisect)
        self.rows = start.row  # the next window's first row
        self.open: list[np.ndarray] = []  # lengths of the open window's documents so far
        self.open_cursor = start  # where the open window begins
        self.num_windows: int | None = None
        text.on_unit = self._unit

    @property
    def peak(self) -> int:
        """The most tokens held at once."""
        return self.text.peak

    def _unit(self, at: Cursor, lengths: np.ndarray) -> None:
        """A unit's documents (from document at.doc, at global token at.token) were read."""
        lengths = np.asarray(lengths, np.int64)
        ends = at.token + np.cumsum(lengths)
        first = 0
        for j in window_ends(ends, self.open_cursor.token, self.plan.window_tokens):
            self.open.append(lengths[first:j + 1])
            end = int(ends[j])
            after = (Cursor(at.unit, at.doc + j + 1, end) if j + 1 < len(lengths)
                     else Cursor(at.unit + 1, 0, end))
            self._close(after)
            first = j + 1
        if first < len(lengths):
            self.open.append(lengths[first:])

    def _close(self, after: Cursor) -> None:
        """Pack the open window; the next one begins at ``after``."""
        lengths = np.concatenate(self.open) if self.open else np.zeros(0, np.int64)
        start = self.open_cursor
        layout = pack_window(lengths, first_token=start.token, first_doc=0,
                             seq_len=self.plan.seq_len, seed=self.plan.seed,
                             max_segments=self.plan.order_settings.max_segments)
        if layout.num_rows:
            self.done.append(Packed(self.rows, layout, start._replace(row=self.rows)))
            self.firsts.append(self.rows)
            self.rows += layout.num_rows
        self.open = []
        self.open_cursor = after._replace(row=self.rows)

    def confirm(self, windows: int) -> None:
        """Read until rows [0, windows) are packed (or the input ends)."""
        while self.num_windows is None and self.rows < windows:
            self.text.pull()
            if self.text.ended:
                self._close(self.text.next)
                if self.rows == 0:
                    raise ConfigError("the inputs hold no document to pack (every record was "
                                      "empty or skipped)")
                self.num_windows = self.rows

    def drain(self) -> None:
        """Read to the end of the input."""
        self.confirm(1 << 62)

    def copy(self, windows: np.ndarray, out: dict[str, np.ndarray], rows: np.ndarray) -> None:
        """Packed rows ``windows`` of the pass into rows ``rows`` of the batch arrays: one fill
        per packing window they come from."""
        at = np.searchsorted(np.array(self.firsts, np.int64), windows, side="right") - 1
        assert (at >= 0).all(), f"rows {windows[at < 0].tolist()} were released"
        for i in np.unique(at).tolist():
            p, sel = self.done[i], at == i
            local = windows[sel] - p.first_row
            assert (local < p.layout.num_rows).all(), "a row past its packing window"
            pack.fill_packed_rows(p.layout, local, self.text.tokens, out, rows[sel])

    def release(self, window: int) -> None:
        """Forget the packing windows whose rows all come before row ``window``, and the units
        that hold only their tokens."""
        drop = 0
        while drop < len(self.done) and \
                self.done[drop].first_row + self.done[drop].layout.num_rows <= window:
            drop += 1
        del self.done[:drop], self.firsts[:drop]
        self.text.release_before(self._cursor().token)

    def _cursor(self) -> Cursor:
        return self.done[0].cursor if self.done else self.open_cursor

    def resume_from(self, window: int) -> Cursor | None:
        """Where reading restarts to pack row ``window`` again (the start of its window)."""
        cursor = self._cursor()
        return cursor if cursor.row <= window else None

    def close(self) -> None:
        """Stop reading; idempotent."""
        self.text.close()
