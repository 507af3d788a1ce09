"""The compiled paths (``fastfill``, ``fastpack``: built at install) behind a check of what they
are given.

A window of documents is packed (pieces, best fit decreasing, rows split to the allotment) by
``fastpack.pack_window`` in one pass with the GIL released, so a window packed ahead in a thread
leaves the training loop's thread alone. Packed rows and document masks are written by
``fastfill`` in one pass when it is built and the arrays fit it (C-contiguous rows of the batch
dtypes, a store dtype it reads). Otherwise the callers take the numpy / Python paths, which give
the same bytes. ``TOKENMILL_FASTFILL=0`` turns both off (to compare, or to rule them out)::

    if not fastpath.packed_rows(layout, ids, dest, out, bounds, shard):
        ...  # the numpy path
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping

import numpy as np

from tokenmill.base.arrays import as_rows

try:  # built from fastfill.pyx / fastpack.pyx by the install (optional: no C compiler, none)
    from tokenmill.load import fastfill, fastpack
except ImportError:  # pragma: no cover - depends on the install
    fastfill = fastpack = None

__all__ = ["ENABLED", "best_fit", "metadata_rows", "open_fit", "pack_window", "packed_rows",
           "permute", "status", "window_ids"]

META = ("segment_ids", "positions", "loss_mask")
ONE_SHARD = np.zeros(1, np.int64)  # the mapped shards of a one-shard store: shard 0
# shards a call holds mapped at once (each map holds a descriptor, a remote one pins its cached
# file): a batch of short documents reads hundreds of shards, filled a group at a time
GROUP = 16
# what this version calls: a build from older .pyx files (an editable install updated without a
# rebuild) lacks some, and is left out rather than failing a Loader with an AttributeError
CALLS = {fastfill: ("shards_of", "fill_packed", "fill_metadata_rows"),
         fastpack: ("best_fit", "open_fit", "pack_window", "permute", "window_ids", "work_size")}
STALE = [] if fastfill is None else \
    [f"{m.__name__.rsplit('.', 1)[-1]}.{f}" for m, fs in CALLS.items() for f in fs
     if not hasattr(m, f)]
# read once: a switch to compare the two paths, or to rule the compiled one out
ENABLED = fastfill is not None and not STALE and os.environ.get("TOKENMILL_FASTFILL", "1") != "0"


def status() -> str:
    """One line for diagnostics: which row filler this install uses, and why."""
    if fastfill is None:
        return "numpy (the compiled row filler was not built: no C compiler at install?)"
    if STALE:
        return ("numpy (the compiled row filler is older than this tokenmill: no "
                f"{', '.join(STALE)}; rebuild it: pip install -e . in the source tree)")
    if not ENABLED:
        return "numpy (TOKENMILL_FASTFILL=0)"
    return "compiled (tokenmill.load.fastfill, fastpack)"


def best_fit(lengths: np.ndarray, capacity: int, first_row: int) -> np.ndarray | None:
    """``pack._best_fit``'s rows by the compiled best fit; None when it is off or refuses."""
    if not ENABLED:
        return None
    return fastpack.best_fit(lengths, capacity, first_row)


def open_fit(lengths: np.ndarray, capacity: int) -> np.ndarray | None:
    """``pack._open_fit``'s rows by the compiled open fit; None when it is off or refuses."""
    if not ENABLED:
        return None
    return fastpack.open_fit(lengths, capacity)


def permute(x: np.ndarray, n: int, keys: np.ndarray, h: int) -> np.ndarray | None:
    """``sampler._permute`` of uint64 ``x`` under one set of round ``keys``, compiled (the GIL
    released: a window's row order is made on the pack-ahead thread); None when it is off."""
    if not ENABLED:
        return None
    return fastpack.permute(np.ascontiguousarray(x, np.uint64), n,
                            np.ascontiguousarray(keys, np.uint64), h)


def window_ids(bounds: np.ndarray, shift: np.ndarray, xs: list[int], run: int,
               num_docs: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The document ids of raw windows ``xs`` (each stratum's run (shift + x) mod M of ``run``
    documents), concatenated, and where each window's start (``fastpack.window_ids``, the GIL
    released); None when the compiled module is off."""
    if not ENABLED:
        return None
    return fastpack.window_ids(bounds, shift, xs, run, num_docs)


def pack_window(lengths: np.ndarray, starts: np.ndarray, docs: np.ndarray, seq_len: int,
                rows: int, max_segments: int | None = None, ordered: bool = False,
                order=None) -> tuple | None:
    """A window's documents packed into exactly ``rows`` rows, as ``packplan.PackedPlan.pack``
    packs them (pieces, best fit decreasing or the open fit in order, rows split or squeezed to
    the allotment) in one compiled pass with the GIL released: (row_ptr, seg_start, seg_len,
    seg_doc, documents cut, documents longer than a row, one-token tails dropped, the rows'
    order: ``order(np.arange(rows))`` for a ``sampler.Permutation`` ``order``, else None); None
    when it is off, under a cap (the fair fill is not compiled) or the rows left have no room
    for a squeezed window's segments (cut as a stream in Python)."""
    if not ENABLED or max_segments is not None:
        return None
    need = fastpack.work_size(lengths, seq_len, rows)
    with _LOCK:  # a work array kept from an earlier window: fresh pages cost more than packing
        work = _SPARE.pop() if _SPARE else None
    if work is None or len(work) < need:  # a quarter more: the next windows' needs vary
        work = np.empty(need + need // 4, np.int64)
    keys = None if order is None else np.array(order.keys, np.uint64)
    try:
        return fastpack.pack_window(lengths, starts, docs, seq_len, rows, work, ordered, keys,
                                    0 if order is None else order.half_bits)
    finally:
        with _LOCK:  # one kept (two windows packed at once, rare, make a second for a while)
            if not _SPARE and work.nbytes <= KEEP_WORK:
                _SPARE.append(work)


_SPARE: list[np.ndarray] = []  # work arrays for pack_window, kept between windows
KEEP_WORK = 1 << 24  # bytes of one kept: a window of 65,536 paragraphs takes 6 MiB; one of books
# in short rows (64 documents, 500,000 pieces) 84 MiB, not kept for the life of the process
_LOCK = threading.Lock()


def packed_rows(layout, ids: np.ndarray, dest: slice | np.ndarray, out: Mapping[str, np.ndarray],
                bounds: np.ndarray, shard: Callable[[int], np.ndarray]) -> bool:
    """Packed rows ``ids`` of ``layout`` into batch rows ``dest`` of ``out``, reading shard k's
    tokens (global tokens from ``bounds[k]``) as ``shard(k)``; False (nothing trusted written)
    when the compiled filler is off or cannot take these arrays."""
    if not ENABLED:
        return False
    meta = _meta(out)
    if meta is None:
        return False
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    rows = as_rows(dest)
    try:
        if len(bounds) == 2:  # one shard, the usual single-file or streamed store: one call
            return fastfill.fill_packed(layout.row_ptr, layout.seg_start, layout.seg_len, ids,
                                        rows, bounds, ONE_SHARD, [shard(0)], out["inputs"],
                                        out["targets"], *meta)
        mapped = np.array(fastfill.shards_of(layout.row_ptr, layout.seg_start, ids, bounds),
                          np.int64)
    except (IndexError, ValueError, TypeError, BufferError):  # a row id out of range (the
        return False  # caller's checks name it), or dtypes or strides it does not take
    partial = len(mapped) > GROUP
    try:
        for at in range(0, len(mapped), GROUP):  # a few shards held at once: descriptors bounded
            group = mapped[at:at + GROUP]
            arrays = [shard(k) for k in group.tolist()]  # held through the call: pointers valid
            if not fastfill.fill_packed(layout.row_ptr, layout.seg_start, layout.seg_len, ids,
                                        rows, bounds, group, arrays, out["inputs"],
                                        out["targets"], *(meta if at == 0 else ()),
                                        partial=partial):
                return False
            del arrays
        return True
    except (ValueError, TypeError, BufferError):  # dtypes or strides it does not take
        return False


def metadata_rows(row_ptr: np.ndarray, seg_len: np.ndarray, dest: slice | np.ndarray,
                  out: Mapping[str, np.ndarray]) -> bool:
    """Segment ids, positions and loss mask of batch rows ``dest`` (row i holds the segments
    ``seg_len[row_ptr[i]:row_ptr[i + 1]]`` back to back); False when the filler cannot."""
    meta = _meta(out) if ENABLED else None
    if not meta:
        return False
    try:
        return fastfill.fill_metadata_rows(
            np.ascontiguousarray(row_ptr, dtype=np.int64),
            np.ascontiguousarray(seg_len, dtype=np.int64),
            np.arange(len(row_ptr) - 1, dtype=np.int64), as_rows(dest), *meta)
    except (ValueError, TypeError, BufferError):
        return False


def _meta(out: Mapping[str, np.ndarray]) -> list | None:
    """The metadata arrays asked for: all three, none ([]), or None (some: the numpy path's)."""
    asked = [out[k] for k in META if k in out]
    return asked if len(asked) in (0, 3) else None

