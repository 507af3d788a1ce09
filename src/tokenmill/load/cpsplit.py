"""Documents cut for context parallelism and packed into token-budget microbatches (the THD
layout): pure numpy functions of the segments' lengths, no I/O.

Context parallelism, head–tail per document: with ``cp`` ranks each document (segment) is cut
into 2·cp chunks of equal size (⌊k·n / 2cp⌋ bounds), and CP rank r takes chunks r and
2cp − 1 − r of every document. Under a causal mask chunk k's queries see k·c + (c+1)/2 keys on
average, so the pair (r, 2cp−1−r) costs the same for every r: c²·(2cp−1) + c·(c+1) (query, key)
pairs for chunks of c tokens. Splitting per document — not the whole row head–tail — keeps
each rank's work equal whatever the row's documents are (a row of one long document and a row
of many short ones alike). cp = 2, a document of 8 tokens::

    chunks  [0 1][2 3][4 5][6 7]    CP rank 0: 0 1 6 7     CP rank 1: 2 3 4 5

Each CP rank's queries are its own tokens; its keys/values are its chunks' document prefixes in
the unsplit order (``kv_index``), which FlashAttention's varlen kernel takes as one key sequence
per query chunk, causal aligned bottom-right (flash-attn >= 2.1), so chunk [s, e) of a document
attends to the document's tokens [0, e).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tokenmill.base.arrays import exclusive_cumsum, ranges
from tokenmill.base.errors import ConfigError, check_int

__all__ = ["CPShard", "Microbatches", "causal_pairs", "cp_pairs", "cp_split", "thd_varlen",
           "token_budget"]


def _lengths(lengths) -> np.ndarray:
    """Segment lengths as int64, checked: 1-d integers >= 0."""
    n = np.asarray(lengths)
    if n.ndim != 1 or (n.size and (n.dtype.kind not in "iu" or n.min() < 0)):
        raise ConfigError(f"lengths must be a 1-d array of integers >= 0 (got {n.dtype}, shape "
                          f"{n.shape}, values {np.array2string(n.ravel()[:4])}…)")
    return n.astype(np.int64, copy=False)


def causal_pairs(starts, ends) -> np.ndarray:
    """(query, key) pairs a causal mask keeps for the queries at positions [s, e) of a document
    (keys 0 … query): Σ (i + 1) = (e(e+1) − s(s+1)) / 2, int64.

    causal_pairs([0, 2], [2, 4]).tolist() == [3, 7]
    """
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    return (e * (e + 1) - s * (s + 1)) // 2


class CPShard(NamedTuple):
    """One context-parallel rank's share of a token stream (a packed row, or rows flattened)."""

    index: np.ndarray  # int64: flat positions of its tokens in the unsplit stream, in its order
    positions: np.ndarray  # int32: each token's position in its document (as unsplit)
    segment_ids: np.ndarray  # int32: each token's segment, 1-based as the input's order
    cu_seqlens_q: np.ndarray  # int32: its query chunks, back to back (empty chunks left out)
    cu_seqlens_k: np.ndarray  # int32: each chunk's key sequence: its document's prefix
    kv_index: np.ndarray  # int64: flat unsplit positions of the key sequences, back to back
    max_seqlen_q: int
    max_seqlen_k: int


def _chunks(n: np.ndarray, cp: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(segment, start, end) of CP rank r's chunks: chunk r then 2cp−1−r of each segment,
    segments in order, empty chunks dropped."""
    parts = 2 * cp
    ks = np.array([r, parts - 1 - r], dtype=np.int64)
    start = (ks[None, :] * n[:, None]) // parts
    end = ((ks[None, :] + 1) * n[:, None]) // parts
    seg = np.repeat(np.arange(len(n), dtype=np.int64), 2)
    start, end = start.ravel(), end.ravel()
    keep = end > start
    return seg[keep], start[keep], end[keep]


def cp_split(lengths, *, cp: int) -> list[CPShard]:
    """Each CP rank's tokens, positions, segment ids and varlen arguments for a stream whose
    segments (documents; a row's padding is a segment too) have ``lengths``, back to back.

    [s.index.tolist() for s in cp_split([8], cp=2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    """
    n = _lengths(lengths)
    cp = check_int("cp", cp, minimum=1)
    if int(n.sum()) >= 2**31:
        raise ConfigError(f"a stream of {int(n.sum()):,} tokens: cu_seqlens are int32, keep it "
                          "under 2**31 tokens")
    first = exclusive_cumsum(n)
    out = []
    for r in range(cp):
        seg, s, e = _chunks(n, cp, r)
        q, k = e - s, e
        cu_q = np.zeros(len(q) + 1, np.int32)
        np.cumsum(q, out=cu_q[1:])
        cu_k = np.zeros(len(k) + 1, np.int32)
        np.cumsum(k, out=cu_k[1:])
        out.append(CPShard(
            index=ranges(first[seg] + s, q), positions=ranges(s, q).astype(np.int32),
            segment_ids=np.repeat(seg + 1, q).astype(np.int32), cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k, kv_index=ranges(first[seg], k),
            max_seqlen_q=int(q.max(initial=0)), max_seqlen_k=int(k.max(initial=0))))
    return out


def cp_pairs(lengths, *, cp: int) -> np.ndarray:
    """Causal (query, key) pairs each CP rank computes under ``cp_split``, (cp,) int64: equal
    when every length is a multiple of 2·cp, within O(length) pairs of equal otherwise.

    cp_pairs([8], cp=2).tolist() == [18, 18]
    """
    n = _lengths(lengths)
    cp = check_int("cp", cp, minimum=1)
    return np.array([int(causal_pairs(s, e).sum()) for _, s, e in
                     (_chunks(n, cp, r) for r in range(cp))], dtype=np.int64)


# ---- token-budget microbatches (THD) ---------------------------------------------------------

class Microbatches(NamedTuple):
    """Documents (or pieces of those longer than the budget) in microbatches, in input order."""

    doc: np.ndarray  # int64: the document of each piece
    offset: np.ndarray  # int64: where in its document the piece starts
    length: np.ndarray  # int64: its tokens
    ptr: np.ndarray  # int64[microbatches + 1]: each microbatch's pieces
    cut: int  # documents longer than the budget, cut into budget-sized pieces


def token_budget(lengths, *, budget: int, max_segments: int | None = None) -> Microbatches:
    """Documents in order, a microbatch a run of them up to ``budget`` tokens (and at most
    ``max_segments`` pieces: the fixed cu_seqlens slots); a document longer than the budget is
    cut into pieces of ``budget`` tokens, the last the rest (counted in ``cut``). Empty
    documents are left out.

    token_budget([3, 4, 2, 9], budget=8).ptr.tolist() == [0, 2, 3, 4, 5]
    """
    n = _lengths(lengths)
    budget = check_int("budget", budget, minimum=1)
    cap = check_int("max_segments", max_segments, minimum=1, optional=True) or len(n) + 1
    pieces = -(-n // budget)  # 0 for an empty document
    doc = np.repeat(np.arange(len(n), dtype=np.int64), pieces)
    offset = (np.arange(len(doc), dtype=np.int64) - np.repeat(exclusive_cumsum(pieces), pieces)) \
        * budget
    length = np.minimum(n[doc] - offset, budget)
    end = np.cumsum(length)
    ptr = [0]
    while ptr[-1] < len(length):
        i = ptr[-1]
        base = end[i - 1] if i else 0
        j = int(np.searchsorted(end, base + budget, side="right"))  # pieces that fit
        ptr.append(min(max(j, i + 1), i + cap))
    return Microbatches(doc, offset, length, np.asarray(ptr, np.int64), int(np.sum(pieces > 1)))


def thd_varlen(lengths, *, budget: int | None = None, slots: int | None = None) -> np.ndarray:
    """int32 ``cu_seqlens`` of one THD microbatch with pieces of ``lengths``; with ``budget``
    the batch is padded to that many tokens (the padding joins the last sequence, which
    causality keeps from every real token, as ``attention.varlen_args``), and with ``slots``
    the offsets are padded to exactly that many by repeating the last (empty sequences).

    thd_varlen([3, 4], budget=8, slots=5).tolist() == [0, 3, 8, 8, 8]
    """
    n = _lengths(lengths)
    cu = np.zeros(len(n) + 1, np.int64)
    np.cumsum(n, out=cu[1:])
    if budget is not None:
        if cu[-1] > check_int("budget", budget, minimum=1):
            raise ConfigError(f"a microbatch of {int(cu[-1])} tokens is over budget={budget}")
        cu = np.append(cu[:-1], budget) if len(n) else np.array([0, budget], np.int64)
    if slots is not None:
        if len(cu) > check_int("slots", slots, minimum=2):
            raise ConfigError(f"a microbatch of {len(cu) - 1} sequences needs {len(cu)} "
                              f"cu_seqlens slots, more than slots={slots}; pack with "
                              f"token_budget(..., max_segments={slots - 1})")
        cu = np.concatenate([cu, np.full(slots - len(cu), cu[-1], np.int64)])
    return cu.astype(np.int32)
