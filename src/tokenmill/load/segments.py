"""The per-token metadata of packed rows — segment ids, positions, loss mask — without an index
per token: markers at the segments' starts, then one cumulative sum along each row.

A row of capacity 8 holding segments of 3 and 4 tokens, then one of padding::

    segment_ids 1 1 1 2 2 2 2 0     positions 0 1 2 0 1 2 3 0     loss_mask 1 1 0 1 1 1 0 0

(inputs take the first capacity - 1 columns of each; ``pack.fill_packed_rows`` calls this.)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tokenmill.load import fastpath

__all__ = ["fill_metadata"]


def fill_metadata(out: Mapping[str, np.ndarray], dest, shape: tuple[int, int],
                   at: np.ndarray, seg_len: np.ndarray, later: np.ndarray) -> None:
    """segment_ids, positions, loss_mask of rows whose segments start at flat offsets ``at``
    (``later``: not the first of its row), from cumulative sums of markers: no per-token index."""
    b, capacity = shape
    if b == 0:
        return
    row_ptr = np.searchsorted(at // capacity, np.arange(b + 1))  # rows' segments, back to back
    if fastpath.metadata_rows(row_ptr, seg_len, dest, out):
        return
    ends = at + seg_len  # flat end of each segment; a row's last end is where padding starts
    last = np.flatnonzero(np.append(~later[1:], True))  # each row's last segment
    pads = [(r, e - r * capacity) for r, e in zip((at[last] // capacity).tolist(),
                                                  ends[last].tolist()) if e < (r + 1) * capacity]
    if "segment_ids" in out or "loss_mask" in out:
        sid = np.zeros(b * capacity, np.int32)
        sid[at[later]] = 1
        sid = np.cumsum(sid.reshape(b, capacity), axis=1, dtype=np.int32) + 1
        for r, e in pads:
            sid[r, e:] = 0
        if "segment_ids" in out:
            out["segment_ids"][dest] = sid[:, :-1]
    if "positions" in out:
        pos = np.ones(b * capacity, np.int32)
        pos[at] = 0
        pos[at[later]] = 1 - seg_len[np.flatnonzero(later) - 1]
        pos = pos.reshape(b, capacity)
        np.cumsum(pos, axis=1, out=pos)
        for r, e in pads:
            pos[r, e:] = 0
        out["positions"][dest] = pos[:, :-1]
    if "loss_mask" in out:
        mask = np.ones(b * capacity, np.uint8)
        mask[ends - 1] = 0  # a segment's last token has no target in it
        mask = mask.reshape(b, capacity)
        for r, e in pads:
            mask[r, e:] = 0
        out["loss_mask"][dest] = mask[:, :-1]
