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

A Loader's batch, for one CP rank (``cp_batch``): the attention sequences of every row (a
document, or a piece of one; a row's padding joins the sequence before it, as in ``attention``)
cut head–tail as above, the rows flattened one after another (THD), padded to a length C that
every CP rank shares. Each rank takes the whole (B, L) batch of its data-parallel rank and keeps
its own tokens; keys and values come from an all-gather of every CP rank's C slots (rank-major:
rank k's at k·C … k·C + C − 1)::

    batch = next(loader)                                  # the same on every CP rank
    mine = cp_batch(batch, cp=2, cp_rank=r)               # mine.arrays["inputs"]: (C,)
    k_all = all_gather(k)                                 # (2·C, heads, dim)
    flash_attn_varlen_func(q, k_all[mine.kv_index], v_all[mine.kv_index], mine.cu_seqlens_q,
                           mine.cu_seqlens_k, mine.max_seqlen_q, mine.max_seqlen_k, causal=True)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tokenmill.base.arrays import exclusive_cumsum, ranges
from tokenmill.base.errors import ConfigError, check_int
from tokenmill.load.attention import sequence_starts

__all__ = ["CPBatch", "CPShapes", "CPShard", "Microbatches", "causal_pairs", "cp_batch",
           "cp_layout", "cp_pairs", "cp_shapes", "cp_split", "thd_varlen", "token_budget"]


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
    n, cp = _stream(lengths, cp)
    first = exclusive_cumsum(n)
    return [_shard(n, first, cp, r) for r in range(cp)]


def _stream(lengths, cp) -> tuple[np.ndarray, int]:
    """(lengths, cp) checked; a stream of 2**31 tokens or more refused (int32 cu_seqlens)."""
    n = _lengths(lengths)
    cp = check_int("cp", cp, minimum=1)
    if int(n.sum()) >= 2**31:
        raise ConfigError(f"a stream of {int(n.sum()):,} tokens: cu_seqlens are int32, keep it "
                          "under 2**31 tokens")
    return n, cp


def _tokens(n: np.ndarray, first: np.ndarray, cp: int, r: int) -> tuple[np.ndarray, ...]:
    """(index, segment ids; segment, start, end of each chunk) of CP rank r's tokens."""
    seg, s, e = _chunks(n, cp, r)
    return ranges(first[seg] + s, e - s), np.repeat(seg + 1, e - s).astype(np.int32), seg, s, e


def _shard(n: np.ndarray, first: np.ndarray, cp: int, r: int) -> CPShard:
    """CP rank r's CPShard of the stream of segments ``n`` (first tokens ``first``)."""
    index, sids, seg, s, e = _tokens(n, first, cp, r)
    q, k = e - s, e
    cu_q = np.zeros(len(q) + 1, np.int32)
    np.cumsum(q, out=cu_q[1:])
    cu_k = np.zeros(len(k) + 1, np.int32)
    np.cumsum(k, out=cu_k[1:])
    return CPShard(index=index, positions=ranges(s, q).astype(np.int32), segment_ids=sids,
                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, kv_index=ranges(first[seg], k),
                   max_seqlen_q=int(q.max(initial=0)), max_seqlen_k=int(k.max(initial=0)))


def cp_pairs(lengths, *, cp: int) -> np.ndarray:
    """Causal (query, key) pairs each CP rank computes under ``cp_split``, (cp,) int64: equal
    when every length is a multiple of 2·cp, within O(length) pairs of equal otherwise.

    cp_pairs([8], cp=2).tolist() == [18, 18]
    """
    n = _lengths(lengths)
    cp = check_int("cp", cp, minimum=1)
    return np.array([int(causal_pairs(s, e).sum()) for _, s, e in
                     (_chunks(n, cp, r) for r in range(cp))], dtype=np.int64)


# ---- a Loader's batch, one CP rank's share --------------------------------------------------

class CPBatch(NamedTuple):
    """One CP rank's share of a (B, L) batch, flattened and padded to C tokens (every CP rank's C
    is the same), and what attention over the all-gathered keys/values (cp·C slots, rank-major)
    takes: FlashAttention varlen (``cu_seqlens_*``, ``kv_index``, ``max_seqlen_*``) or a mask
    (FlexAttention: query q sees gathered key k ⇔ ``sequence_ids[q] ==
    gathered_sequence_ids[k]`` and ``gathered_index[k] <= index[q]``)."""

    arrays: dict[str, np.ndarray]  # the batch's (B, L) arrays at its tokens, (C,); 0 on padding
    index: np.ndarray  # int64 (C,): each token's place in the flat batch (row·L + col); -1 pad
    sequence_ids: np.ndarray  # int32 (C,): its attention sequence, 1… across the batch; 0 padding
    gathered_index: np.ndarray  # int64 (cp·C,): ``index`` of every CP rank, rank after rank
    gathered_sequence_ids: np.ndarray  # int32 (cp·C,)
    cu_seqlens_q: np.ndarray  # int32: its query chunks back to back, then its padding as one
    cu_seqlens_k: np.ndarray  # int32: each chunk's keys (its document's prefix); padding: itself
    kv_index: np.ndarray  # int64: the gathered slots of those keys, back to back
    max_seqlen_q: int
    max_seqlen_k: int


class CPShapes(NamedTuple):
    """Lengths of a ``CPBatch``'s arrays: tokens a CP rank (C), ``cu_seqlens`` slots, kv slots."""

    tokens: int
    slots: int
    kv: int


def cp_shapes(batch_size: int, seq_len: int, *, cp: int, max_segments: int) -> CPShapes:
    """Fixed shapes that hold any batch of (batch_size, seq_len) with at most ``max_segments``
    attention sequences a row, for any CP rank: a chunk of n tokens cut 2·cp ways is at most
    ⌈n / 2cp⌉, so a rank holds < B·L/cp + S·(2cp−1)/cp tokens of S sequences; its key
    prefixes sum to at most B·L·(2cp+1)/(2cp), plus its padding; 2 chunks a sequence, and
    the padding.

    cp_shapes(2, 8, cp=2, max_segments=1) == CPShapes(tokens=11, slots=6, kv=31)
    """
    b = check_int("batch_size", batch_size, minimum=1)
    n = b * check_int("seq_len", seq_len, minimum=1)
    cp = check_int("cp", cp, minimum=1)
    s = b * check_int("max_segments", max_segments, minimum=1)
    tokens = (n + s * (2 * cp - 1)) // cp
    return CPShapes(tokens, 2 * s + 2, n * (2 * cp + 1) // (2 * cp) + tokens)


def _batch_arrays(batch) -> dict[str, np.ndarray]:
    """The batch's arrays as numpy, checked: (B, L) each, ``inputs`` among them."""
    arrays = {k: np.asarray(v) for k, v in batch.items()}
    shape = arrays["inputs"].shape if "inputs" in arrays else None
    if shape is None or len(shape) != 2 or any(a.shape != shape for a in arrays.values()):
        got = ", ".join(f"{k} {a.shape}" for k, a in arrays.items())
        raise ConfigError(f"cp_batch takes a Loader batch: 'inputs' and the other arrays all "
                          f"of one shape (batch, seq_len) (got {got}); pass next(loader) as it "
                          "is, before any reshape")
    return arrays


def _sequence_lengths(shape: tuple[int, int], segment_ids) -> np.ndarray:
    """Lengths of the attention sequences of a (B, L) batch flattened row after row: one a row
    without ``segment_ids`` (a concat window attends to all of itself)."""
    b, length = shape
    if segment_ids is None:
        return np.full(b, length, np.int64)
    starts = np.flatnonzero(sequence_starts(segment_ids).ravel())
    return np.diff(np.append(starts, b * length)).astype(np.int64)


def cp_batch(batch, *, cp: int, cp_rank: int, max_segments: int | None = None) -> CPBatch:
    """CP rank ``cp_rank`` of ``cp``'s share of a Loader batch (numpy arrays): every attention
    sequence of every row cut head–tail (``cp_split``), rows flattened. C is the largest CP
    rank's share of this batch; with ``max_segments`` (the Loader's, or seq_len without one)
    every shape is fixed by ``cp_shapes`` (static shapes for compiled steps).

    cp_batch({"inputs": np.arange(8)[None]}, cp=2, cp_rank=1).arrays["inputs"].tolist() \
        == [2, 3, 4, 5]
    """
    arrays = _batch_arrays(batch)
    share = cp_layout(arrays["inputs"].shape, arrays.get("segment_ids"), cp=cp,
                      cp_rank=cp_rank, max_segments=max_segments)
    real = share.index >= 0
    taken = {}
    for key, a in arrays.items():
        taken[key] = np.zeros(len(real), a.dtype)
        taken[key][real] = a.reshape(-1)[share.index[real]]
    return share._replace(arrays=taken)


def cp_layout(shape: tuple[int, int], segment_ids=None, *, cp: int, cp_rank: int,
              max_segments: int | None = None) -> CPBatch:
    """``cp_batch`` of a batch of ``shape`` (B, L) and ``segment_ids`` (None: a concat batch)
    without taking its arrays (``arrays`` is empty): the indices that take them.

    cp_layout((1, 8), cp=2, cp_rank=0).index.tolist() == [0, 1, 6, 7]
    """
    b, length = shape
    n, cp = _stream(_sequence_lengths(shape, segment_ids), cp)
    r = check_int("cp_rank", cp_rank, minimum=0, maximum=cp - 1)
    first = exclusive_cumsum(n)
    tokens = [_tokens(n, first, cp, k)[:2] for k in range(cp)]  # every rank's: the gather
    shapes = _fixed([len(i) for i, _ in tokens], len(n), b, length, cp, max_segments)
    c = shapes.tokens
    gathered_index = np.full(cp * c, -1, np.int64)
    gathered_sids = np.zeros(cp * c, np.int32)
    for k, (index, sids) in enumerate(tokens):
        gathered_index[k * c:k * c + len(index)] = index
        gathered_sids[k * c:k * c + len(index)] = sids
    slot = np.empty(b * length, np.int64)  # where each token of the batch is gathered
    held = np.flatnonzero(gathered_index >= 0)
    slot[gathered_index[held]] = held
    return CPBatch({}, gathered_index[r * c:(r + 1) * c], gathered_sids[r * c:(r + 1) * c],
                   gathered_index, gathered_sids,
                   *_varlen(_shard(n, first, cp, r), slot, r * c, c, shapes))


def _fixed(sizes: list[int], sequences: int, b: int, length: int, cp: int,
           max_segments: int | None) -> CPShapes:
    """The shapes of this batch's CPBatch: ``cp_shapes`` with ``max_segments`` (a batch past
    it refused), else what this batch needs (C: the largest rank's tokens)."""
    if max_segments is None:
        return CPShapes(max(sizes), 0, 0)
    shapes = cp_shapes(b, length, cp=cp, max_segments=max_segments)
    if sequences > b * max_segments:
        raise ConfigError(f"this batch has {sequences} attention sequences, more than "
                          f"batch_size × max_segments = {b} × {max_segments}; give cp_batch the "
                          "Loader's max_segments (seq_len when it has none)")
    assert max(sizes) <= shapes.tokens, "cp_shapes' bound"
    return shapes


def _varlen(mine: CPShard, slot: np.ndarray, first: int, c: int, shapes: CPShapes) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k, kv_index, max_seqlen_q, max_seqlen_k) of a rank's chunks
    against the gathered slots, its padding (slots ``first + len(index)`` … ``first + c``) one
    more sequence attending to itself; padded to ``shapes.slots`` / ``shapes.kv`` when fixed."""
    pad = c - len(mine.index)
    q = np.diff(mine.cu_seqlens_q).astype(np.int64)
    k = np.diff(mine.cu_seqlens_k).astype(np.int64)
    kv = slot[mine.kv_index]
    if pad:
        q, k = np.append(q, pad), np.append(k, pad)
        kv = np.concatenate([kv, np.arange(first + c - pad, first + c, dtype=np.int64)])
    cu_q = np.zeros(max(len(q) + 1, shapes.slots), np.int64)
    cu_k = np.zeros(len(cu_q), np.int64)
    np.cumsum(q, out=cu_q[1:len(q) + 1])
    np.cumsum(k, out=cu_k[1:len(k) + 1])
    cu_q[len(q) + 1:], cu_k[len(k) + 1:] = cu_q[len(q)], cu_k[len(k)]  # empty sequences
    assert not shapes.kv or (len(q) < shapes.slots and len(kv) <= shapes.kv), "cp_shapes' bound"
    if len(kv) < shapes.kv:
        kv = np.concatenate([kv, np.zeros(shapes.kv - len(kv), np.int64)])  # never read
    return (cu_q.astype(np.int32), cu_k.astype(np.int32), kv, int(q.max(initial=0)),
            int(k.max(initial=0)))


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
