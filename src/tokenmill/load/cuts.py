"""Documents cut by the rows a loader hands out, counted from the plan's layout (issue 25: long
context, nothing cut silently).

A row is seq_len + 1 tokens of its store's stream: its inputs and, last, the final target. A row's
*parts* are the runs of one document in it. A part that is not its whole document is a *piece*:

* packed rows: a document longer than a row is cut into pieces starting every seq_len tokens
  (overlapping by one token: every (input, target) pair once), and a window short of rows may cut
  a document across rows (``layout_stats["documents_cut"]``);
* concat windows: a document crossing a window's edge (windows overlap by one token).

Counted over rows, for the parts with at least one input token: ``pieces``, their input
``tokens``, and ``documents`` — cut documents, each once, at the part holding its first token.
Nothing is dropped by either rule but, in concat, the tokens before an epoch's offset and after
its last window (``left_out``: under two rows' worth a store an epoch, other ones each epoch).
Read from the layout and the stores' indexes alone, never the tokens::

    documents of 3 and 9 tokens, packed at seq_len 4: [3-token doc | pad] [9: 0..5) [9: 4..9)
    → rows 3, pieces 2, documents 1 (the 9-token one), tokens 4 + 4
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tokenmill.base.arrays import distinct, exclusive_cumsum, ranges
from tokenmill.load.pack import window_segments

__all__ = ["Parts", "Tally", "count_cuts", "left_out", "row_parts"]

KEYS = ("rows", "pieces", "documents", "tokens")


class Parts(NamedTuple):
    """The parts of some rows, rows in the order given, each row's parts in order."""

    row: np.ndarray  # int64: the row (index into the positions) of each part
    source: np.ndarray  # int64: the store it is from (the plan's source index)
    start: np.ndarray  # int64: its first token in that store's stream
    length: np.ndarray  # int64: its tokens in the row (the last target counts)
    offset: np.ndarray  # int64: its first column in the row


def _source_parts(source, addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row index into ``addrs``, first token, length) of every part of those rows of one
    source, each row's parts in order."""
    if source.packed is None:  # concat windows: the documents they cross, from the index
        at, lengths, _ = window_segments(source.store, addrs, source.config.seq_len)
        row, off = np.divmod(at, source.config.seq_len + 1)
        return row, addrs[row] + off, lengths
    rows, starts, lengths = [], [], []
    for window, which, local in source.packed.locate(addrs):
        ptr = window.layout.row_ptr
        counts = ptr[local + 1] - ptr[local]
        seg = ranges(ptr[local], counts)
        rows.append(np.repeat(which, counts))
        starts.append(window.layout.seg_start[seg])
        lengths.append(window.layout.seg_len[seg])
    return np.concatenate(rows), np.concatenate(starts), np.concatenate(lengths)


def row_parts(plan, positions: np.ndarray) -> Parts:
    """The parts of the rows at global ``positions`` of ``plan`` (a ``load.plan.BatchPlan``),
    from its layout: packed windows, or the store's document index for concat windows."""
    sid, addr = plan.resolve(np.asarray(positions, np.int64))
    got = []
    for s in distinct(sid):
        sel = np.flatnonzero(sid == s)
        r, start, n = _source_parts(plan.sources[s], addr[sel])
        got.append((sel[r], np.full(len(r), s, np.int64), start, n))
    row, source, start, n = (np.concatenate(x).astype(np.int64) for x in zip(*got))
    order = np.argsort(row, kind="stable")
    row, source, start, n = row[order], source[order], start[order], n[order]
    counts = np.bincount(row, minlength=len(sid))
    cum = exclusive_cumsum(n)
    offset = cum - np.repeat(np.append(cum, 0)[exclusive_cumsum(counts)], counts)
    return Parts(row, source, start, n, offset)


def count_cuts(plan, positions: np.ndarray) -> dict[str, int]:
    """{"rows", "pieces", "documents", "tokens"} of the rows at ``positions`` (see above)."""
    p = row_parts(plan, positions)
    inputs = np.minimum(p.offset + p.length, plan.seq_len) - p.offset
    keep = inputs > 0  # a part holding only a row's last target is in the next row's inputs
    doc_start, doc_len = np.empty(len(p.row), np.int64), np.empty(len(p.row), np.int64)
    for s in distinct(p.source):
        sel = np.flatnonzero(keep & (p.source == s))
        store = plan.sources[s].store
        doc_start[sel], doc_len[sel] = store.doc_spans(store.docs_at(p.start[sel]))
    piece = keep & ((p.start != doc_start) | (p.length != doc_len))
    return {"rows": len(positions), "pieces": int(piece.sum()),
            "documents": int((piece & (p.start == doc_start)).sum()),
            "tokens": int(inputs[piece].sum())}


def left_out(plan) -> int:
    """Tokens of a concat plan's stores that no window of an epoch holds: a store of T tokens
    has n windows of seq_len + 1 tokens overlapping by one, n·seq_len + 1 tokens (0: packed)."""
    if plan.packed:
        return 0
    return sum(s.store.num_tokens - s.num_samples * plan.seq_len - 1 for s in plan.sources)


class Tally:
    """``count_cuts`` summed over the steps a Loader handed out since ``since`` (its consumed
    samples when it was built or its state loaded), counted when asked, from where the last
    count stopped: a pure function of the steps, whatever was prefetched."""

    def __init__(self, since: int):
        self.since = self.upto = since
        self.totals = dict.fromkeys(KEYS, 0)

    def count(self, loader) -> dict[str, int]:
        """The totals up to ``loader.consumed_samples`` (each step's rows ``loader.positions``
        of its first sample, ``loader.global_batch_size`` samples a step), and the tokens an
        epoch's windows leave out (``left_out``)."""
        while self.upto < loader.consumed_samples:
            for k, v in count_cuts(loader.plan, loader.positions(self.upto)).items():
                self.totals[k] += v
            self.upto += loader.global_batch_size
        return {"since_sample": self.since, **self.totals,
                "epoch_tokens_left_out": left_out(loader.plan)}
