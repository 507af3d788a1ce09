"""Which packing a store's packed plan uses, by the name its fingerprint and resume state carry,
and how its windows are sized (documents a window, a run, the memory a plan holds).

A name changes whenever the rows a step holds would: a state saved under one packing is refused
by a plan of another (``resume``), never read as a different stream under the same name. A store
of short documents (``ordered_packing``) fills its windows with runs of a row's worth of
consecutive documents (``docs_per_run``) and packs them in order (``pack._open_fit``): a row's
documents lie back to back in the store, so filling it reads one or two runs of memory, as a
concat window does, instead of one scattered read a document.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK_DOCS", "BLOCK_WINDOWS", "CACHED_WINDOWS", "ORDERED_SHORTER", "ORDERED_SLACK",
           "PACKING", "PACKING_CAPPED", "PACKING_ORDERED", "ROWS_PER_WINDOW", "docs_per_run",
           "docs_per_window", "ordered_packing", "packing_name", "plans_packing", "window_memory"]

PACKING = "strata-v1"  # goes into the fingerprint: batches change when this does
PACKING_CAPPED = "strata-v2"  # under max_segments: β from the first block of windows + 4 σ
PACKING_ORDERED = "strata-ordered-v2"  # short documents: rows of neighbours (``ordered_packing``)
# v1 (one release: 2026-11-26) took one document a stratum into a window; v2 takes a run of a
# row's worth (``docs_per_run``): a row's documents are back to back in the store
ORDERED_SHORTER = 16  # documents a row holds on average, at least, for ordered packing
ORDERED_SLACK = 0.001  # rows packing in order may take beyond best-fit decreasing's (samples)
ROWS_PER_WINDOW = 4096  # rows a window aims at: a row of margin a window costs 0.025% padding
MIN_WINDOW, MAX_WINDOW = 64, 1 << 16  # documents a window
CACHED_WINDOWS = 8  # packed windows a plan keeps
BLOCK_WINDOWS, BLOCK_DOCS = 8, 1 << 18  # windows whose documents one pass reads: ≤ 6 MB


def packing_name(max_segments: int | None, ordered: bool = False) -> str:
    """The packing algorithm's name for the fingerprint and resume state.

    packing_name(None) == "strata-v1"
    """
    if max_segments is not None:
        return PACKING_CAPPED
    return PACKING_ORDERED if ordered else PACKING


def ordered_packing(num_docs: int, num_tokens: int, seq_len: int, max_segments: int | None
                    ) -> bool:
    """Whether a store's windows may be packed in order (``pack._open_fit``) rather than by
    best-fit decreasing: no cap, and a row holds ORDERED_SHORTER documents or more on average
    (the plan then packs its sample windows both ways and keeps the order only within
    ORDERED_SLACK of best fit's rows: ``PackedPlan._order_fits``). Rows of documents that lie
    near each other in the store are read from a few pages, not one page a document: on short
    paragraphs a packed batch's fill costs a third less.

    ordered_packing(225_000, 11_000_000, 2048, None) is True
    """
    return max_segments is None and num_tokens * ORDERED_SHORTER <= num_docs * (seq_len + 1)


def docs_per_run(num_docs: int, num_tokens: int, seq_len: int) -> int:
    """Consecutive documents a window takes from a stratum when it packs in order: a row's worth
    at the store's mean length (a row then holds one run, or the ends of two).

    docs_per_run(225_000, 11_000_000, 2048) == 42
    """
    return max(1, -(-(seq_len + 1) * num_docs // max(1, num_tokens)))


def plans_packing(plans: list) -> str:
    """The packing name of a mixture's plans: the one name, or each store's joined by '+'."""
    names = [p.packing for p in plans]
    return names[0] if len(set(names)) == 1 else "+".join(names)


def docs_per_window(num_docs: int, num_tokens: int, seq_len: int) -> int:
    """K, documents a window: about ROWS_PER_WINDOW rows' worth at the store's mean length.

    docs_per_window(10**8, 10**11, 2048) == 8393
    """
    mean = max(1.0, num_tokens / max(1, num_docs))
    k = int(np.ceil(ROWS_PER_WINDOW * (seq_len + 1) / mean))
    return max(1, min(num_docs, max(MIN_WINDOW, min(MAX_WINDOW, k))))


def window_memory(num_docs: int, num_tokens: int, seq_len: int) -> int:
    """Bytes a packed plan holds at most: CACHED_WINDOWS packed windows (24 bytes a segment, 16
    a row) and two blocks of read index entries (24 bytes a document); bounded by the window
    size, whatever the store's.

    window_memory(10**8, 10**11, 2048) < 64 * 2**20
    """
    k = docs_per_window(max(1, num_docs), max(2, num_tokens), seq_len)
    rows = -(-k * max(1, num_tokens // max(1, num_docs)) // (seq_len + 1))
    window = int(k * 1.1) * 24 + (rows + 1) * 16
    block = max(1, min(BLOCK_WINDOWS, BLOCK_DOCS // k)) * k * 24
    return CACHED_WINDOWS * window + 2 * block
