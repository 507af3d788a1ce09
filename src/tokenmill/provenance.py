"""Where every row of a batch came from: the store, and each document piece's shard, document
number and token offset — so a loss spike at step 51,234 can be traced to its documents.

    origins = explain_positions(plan, loader.positions(51_234 * loader.global_batch_size))
    origins[0].pieces[0].document   # the store's document number of row 0's first piece

A concat row is the L + 1 tokens [a, a + L] of the store's token stream (inputs and targets), so
it may span several documents; a packed row lists its segments. Stores do not record yet which
input file and line a document came from: ``source`` says "source unknown".
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tokenmill import sampler
from tokenmill.plan import BatchPlan, SampleSource

__all__ = ["Piece", "RowOrigin", "SOURCE_UNKNOWN", "explain_positions"]

SOURCE_UNKNOWN = "source unknown"  # stores made before prepare records its sources


class Piece(NamedTuple):
    """One document's tokens in a row."""

    shard: int  # shard-NNNNN of the store
    document: int  # document number within the store
    shard_document: int  # document number within its shard (the Megatron .idx's index)
    token_offset: int  # offset in the document of the piece's first token
    tokens: int  # tokens of the document in the row (inputs and targets: up to seq_len + 1)
    source: str


class RowOrigin(NamedTuple):
    """Row ``row`` of a batch: global sample ``position``, draw ``draw`` of store ``store``."""

    row: int
    position: int
    store: str
    draw: int
    pieces: tuple[Piece, ...]


def _piece(source: SampleSource, doc: int, lo: int, hi: int) -> Piece:
    store = source.store
    shard = int(np.searchsorted(store.shard_doc_starts, doc, side="right")) - 1
    return Piece(shard, doc, doc - int(store.shard_doc_starts[shard]),
                 lo - int(store.doc_starts[doc]), hi - lo, SOURCE_UNKNOWN)


def _pieces(source: SampleSource, address: int) -> tuple[Piece, ...]:
    if source.packed is not None:
        p = source.packed
        segs = range(int(p.row_ptr[address]), int(p.row_ptr[address + 1]))
        return tuple(_piece(source, int(p.seg_doc[s]), int(p.seg_start[s]),
                            int(p.seg_start[s] + p.seg_len[s])) for s in segs)
    starts = source.store.doc_starts
    lo, hi = address, address + source.config.seq_len + 1
    first = int(np.searchsorted(starts, lo, side="right")) - 1
    last = int(np.searchsorted(starts, hi - 1, side="right")) - 1
    ends = np.append(starts[1:], source.store.num_tokens)
    return tuple(_piece(source, d, max(lo, int(starts[d])), min(hi, int(ends[d])))
                 for d in range(first, last + 1))


def explain_positions(plan: BatchPlan, positions: np.ndarray) -> list[RowOrigin]:
    """The origin of the sample at each global position, one per row."""
    positions = np.asarray(positions, dtype=np.int64)
    if plan.schedule is None:
        sid, draws = np.zeros(len(positions), np.int64), positions
    else:
        sid, draws = sampler.assign_phased(plan.schedule, positions)
    out = []
    for row, (p, s, d) in enumerate(zip(positions.tolist(), sid.tolist(), draws.tolist())):
        source = plan.sources[s]
        address = int(source.addresses(np.array([d], dtype=np.int64))[0])
        out.append(RowOrigin(row, p, plan.mixture.names[s], d, _pieces(source, address)))
    return out
