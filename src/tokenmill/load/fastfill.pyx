# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Rows of segments filled in one compiled pass: tokens, segment ids, positions, loss mask.

The numpy path (``pack.fill_packed_rows``, ``segments.fill_metadata``) is the reference and the
fallback when this module is not built; both write the same bytes (``tests/test_fastpath.py``).
A batch row holds segments back to back from column 0: its token c (of seq_len + 1) is
``inputs[c]`` for c < seq_len and ``targets[c - 1]`` for c >= 1; after its segments, padding 0.
Segment j of a row has segment id j + 1, positions 0, 1, … and loss mask 1 except on its last
token (no target in its document); padding has 0 in all three.

Per segment: two binary searches (its shard, then that shard's slot among the mapped ones), no
index array per token; a numpy path builds ~6 temporary arrays the size of the batch.
"""

from cpython.buffer cimport PyBUF_ANY_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint8_t, uint16_t, int32_t, uint32_t, int64_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc, qsort
from libc.string cimport memcpy, memset

__all__ = ["fill_metadata_rows", "fill_packed", "shards_of"]

# the store dtypes it reads, by buffer format character ('l' and 'q' are both int64 here)
CODES = {"B": 0, "H": 1, "i": 2, "I": 3, "l": 4, "q": 4}
SIZES = (1, 2, 4, 4, 8)

cdef extern from *:
    void __builtin_prefetch(const void*) nogil

ctypedef fused out_t:
    int32_t
    int64_t

ctypedef fused tok_t:
    uint8_t
    uint16_t
    int32_t
    uint32_t
    int64_t


cdef inline Py_ssize_t upper(const int64_t[::1] a, int64_t x) noexcept nogil:
    """The first index whose value is > x (``bisect_right``)."""
    cdef Py_ssize_t lo = 0, hi = a.shape[0], mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline void copy_run(const tok_t* src, out_t* inp, out_t* tgt, Py_ssize_t at, Py_ssize_t n,
                          Py_ssize_t L) noexcept nogil:
    """Row tokens [at, at + n) from ``src`` into inputs (columns < L) and targets (shifted)."""
    cdef Py_ssize_t k, e
    cdef out_t v
    if at + n <= L and at > 0:  # the usual segment, inside the row: one pass writes both
        tgt = tgt - 1
        for k in range(n):
            v = <out_t>src[k]
            inp[at + k] = v
            tgt[at + k] = v
        return
    e = at + n if at + n < L else L
    for k in range(at, e):
        inp[k] = <out_t>src[k - at]
    cdef Py_ssize_t b = at - 1 if at > 0 else 0
    cdef Py_ssize_t e2 = at + n - 1 if at + n - 1 < L else L
    for k in range(b, e2):
        tgt[k] = <out_t>src[k + 1 - at]


cdef inline Py_ssize_t slot_of(const int64_t[::1] mapped, Py_ssize_t k) noexcept nogil:
    """Shard k's place among the mapped shards (ascending), or -1 when it is not mapped."""
    cdef Py_ssize_t m = upper(mapped, k) - 1
    return m if m >= 0 and mapped[m] == k else -1


cdef inline const char* source_of(const int64_t[::1] bounds, const int64_t[::1] mapped,
                                  const uint64_t* ptrs, int64_t s, Py_ssize_t size
                                  ) noexcept nogil:
    """Where global token s lies in the mapped shards, or NULL when its shard is not mapped."""
    cdef Py_ssize_t k = upper(bounds, s) - 1, m
    if k < 0 or k >= bounds.shape[0] - 1:
        return NULL
    m = slot_of(mapped, k)
    return NULL if m < 0 else (<const char*><uintptr_t>ptrs[m]) + (s - bounds[k]) * size


cdef int rows_of(const tok_t* kind, const int64_t[::1] row_ptr, const int64_t[::1] seg_start,
                 const int64_t[::1] seg_len, const int64_t[::1] ids, const int64_t[::1] dest,
                 const int64_t[::1] bounds, const int64_t[::1] mapped, const uint64_t* ptrs,
                 out_t[:, ::1] inputs, out_t[:, ::1] targets, bint partial) noexcept nogil:
    """Tokens of packed rows ``ids`` into batch rows ``dest``; 1 if a segment is not inside one
    shard or overfills its row, or (unless ``partial``: then it is left for another call with
    its shard) its shard is not mapped — nothing is then trusted: the caller goes the numpy way.
    Every segment's memory is asked for first (prefetches: the batch's short runs of tokens lie
    all over the shards), then copied, so that their latencies overlap."""
    cdef Py_ssize_t i, j, r, at, n, L = inputs.shape[1], k, m, c
    cdef int64_t s
    cdef const tok_t* src
    cdef const char* ahead
    for i in range(ids.shape[0]):
        for j in range(row_ptr[ids[i]], row_ptr[ids[i] + 1]):
            ahead = source_of(bounds, mapped, ptrs, seg_start[j], sizeof(tok_t))
            if ahead != NULL:
                for c in range(0, seg_len[j] * <Py_ssize_t>sizeof(tok_t), 64):
                    __builtin_prefetch(ahead + c)
    for i in range(ids.shape[0]):
        r = dest[i]
        at = 0
        for j in range(row_ptr[ids[i]], row_ptr[ids[i] + 1]):
            n = seg_len[j]
            s = seg_start[j]
            k = upper(bounds, s) - 1
            if k < 0 or k >= bounds.shape[0] - 1 or s + n > bounds[k + 1] or at + n > L + 1:
                return 1
            m = slot_of(mapped, k)
            if m < 0:
                if not partial:
                    return 1
                at += n
                continue
            src = (<const tok_t*><uintptr_t>ptrs[m]) + (s - bounds[k])
            copy_run(src, &inputs[r, 0], &targets[r, 0], at, n, L)
            at += n
        if at < L:
            memset(&inputs[r, at], 0, (L - at) * sizeof(out_t))
        k = at - 1 if at > 0 else 0
        if k < L:
            memset(&targets[r, k], 0, (L - k) * sizeof(out_t))
    return 0


cdef extern from "wchar.h":
    ctypedef int wchar_t
    wchar_t* wmemset(wchar_t* s, wchar_t c, size_t n) nogil

# libc's memcpy and wmemset pick the machine's widest stores at run time (this module is built
# for the baseline instruction set): a segment's positions are copied from IOTA, its id set by
# wmemset where wchar_t is 32 bits. Per short segment that is what the loops' time went to.
cdef enum:
    IOTA_N = 4096
cdef int32_t IOTA[IOTA_N]
cdef Py_ssize_t _i
for _i in range(IOTA_N):
    IOTA[_i] = <int32_t>_i


cdef inline void fill_ids(int32_t* to, int32_t value, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t c
    if sizeof(wchar_t) == sizeof(int32_t):
        wmemset(<wchar_t*>to, <wchar_t>value, n)
    else:
        for c in range(n):
            to[c] = value


cdef inline void fill_positions(int32_t* to, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t c
    if n <= IOTA_N:
        memcpy(to, IOTA, n * sizeof(int32_t))
    else:
        for c in range(n):
            to[c] = <int32_t>c


cdef void metadata(const int64_t[::1] row_ptr, const int64_t[::1] seg_len,
                   const int64_t[::1] ids, const int64_t[::1] dest, int32_t[:, ::1] sid,
                   int32_t[:, ::1] pos, uint8_t[:, ::1] mask) noexcept nogil:
    """Segment ids, positions and loss mask of rows ``ids`` (segments
    ``seg_len[row_ptr[id]:row_ptr[id + 1]]``) into batch rows ``dest``."""
    cdef Py_ssize_t i, j, r, at, n, e, c, first, L = sid.shape[1]
    cdef int32_t* sp
    cdef int32_t* pp
    cdef uint8_t* mp
    for i in range(dest.shape[0]):
        r = dest[i]
        sp = &sid[r, 0]
        pp = &pos[r, 0]
        mp = &mask[r, 0]
        at = 0
        first = row_ptr[ids[i]]
        for j in range(first, row_ptr[ids[i] + 1]):
            n = seg_len[j]
            e = at + n if at + n < L else L
            if e > at:
                fill_ids(&sp[at], <int32_t>(j - first + 1), e - at)
                fill_positions(&pp[at], e - at)
                memset(&mp[at], 1, e - at)
            if n > 0 and at + n - 1 < L:
                mp[at + n - 1] = 0  # a segment's last token has no target in it
            at += n
        if at < L:
            memset(&sp[at], 0, (L - at) * sizeof(int32_t))
            memset(&pp[at], 0, (L - at) * sizeof(int32_t))
            memset(&mp[at], 0, L - at)


cdef int tokens_any(int code, const int64_t[::1] row_ptr, const int64_t[::1] seg_start,
                    const int64_t[::1] seg_len, const int64_t[::1] ids, const int64_t[::1] dest,
                    const int64_t[::1] bounds, const int64_t[::1] mapped, const uint64_t* ptrs,
                    out_t[:, ::1] inputs, out_t[:, ::1] targets, bint partial) noexcept nogil:
    if code == 0:
        return rows_of(<const uint8_t*>NULL, row_ptr, seg_start, seg_len, ids, dest, bounds,
                       mapped, ptrs, inputs, targets, partial)
    if code == 1:
        return rows_of(<const uint16_t*>NULL, row_ptr, seg_start, seg_len, ids, dest, bounds,
                       mapped, ptrs, inputs, targets, partial)
    if code == 2:
        return rows_of(<const int32_t*>NULL, row_ptr, seg_start, seg_len, ids, dest, bounds,
                       mapped, ptrs, inputs, targets, partial)
    if code == 3:
        return rows_of(<const uint32_t*>NULL, row_ptr, seg_start, seg_len, ids, dest, bounds,
                       mapped, ptrs, inputs, targets, partial)
    return rows_of(<const int64_t*>NULL, row_ptr, seg_start, seg_len, ids, dest, bounds,
                   mapped, ptrs, inputs, targets, partial)


cdef bint runs_sound(const int64_t[::1] row_ptr, Py_ssize_t segments,
                     const int64_t[::1] ids) noexcept nogil:
    """Every row ``ids[i]`` a run of segments inside arrays ``segments`` long."""
    cdef Py_ssize_t i
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] + 1 >= row_ptr.shape[0]:
            return False
        if row_ptr[ids[i]] < 0 or row_ptr[ids[i]] > row_ptr[ids[i] + 1] or \
                row_ptr[ids[i] + 1] > segments:
            return False
    return True


cdef bint rows_sound(const int64_t[::1] row_ptr, const int64_t[::1] seg_len,
                     Py_ssize_t segments, const int64_t[::1] ids) noexcept nogil:
    """``runs_sound``, and every segment's length >= 0: what the loops below take on trust."""
    cdef Py_ssize_t i, j
    if not runs_sound(row_ptr, segments, ids):
        return False
    for i in range(ids.shape[0]):
        for j in range(row_ptr[ids[i]], row_ptr[ids[i] + 1]):
            if seg_len[j] < 0:
                return False
    return True


cdef inline bint same_shape(Py_ssize_t* a, Py_ssize_t* b) noexcept nogil:
    return a[0] == b[0] and a[1] == b[1]


cdef bint in_range(const int64_t[::1] a, int64_t n) noexcept nogil:
    """Every value of ``a`` in [0, n)."""
    cdef Py_ssize_t i
    for i in range(a.shape[0]):
        if a[i] < 0 or a[i] >= n:
            return False
    return True


def fill_packed(const int64_t[::1] row_ptr, const int64_t[::1] seg_start,
                const int64_t[::1] seg_len, const int64_t[::1] ids, const int64_t[::1] dest,
                const int64_t[::1] bounds, const int64_t[::1] mapped, list arrays,
                out_t[:, ::1] inputs, out_t[:, ::1] targets,
                int32_t[:, ::1] segment_ids=None, int32_t[:, ::1] positions=None,
                uint8_t[:, ::1] loss_mask=None, bint partial=False) -> bool:
    """Packed rows ``ids`` (a layout's CSR ``row_ptr`` → global ``seg_start``, ``seg_len``) into
    batch rows ``dest``; shard ``mapped[m]``'s tokens (global from ``bounds[mapped[m]]``) are the
    contiguous 1-D array ``arrays[m]``. False, and nothing to trust in the rows, when a row id or
    batch row is out of range, the arrays differ in dtype or are not one it reads, or a segment
    is not inside a mapped shard or overfills its row. ``partial``: the segments of shards not
    in ``mapped`` are left for another call (their rows' metadata and padding are written)."""
    cdef Py_ssize_t m, n = len(arrays)
    cdef int code = -1, bad = 0
    cdef Py_buffer* views
    cdef uint64_t* ptrs
    cdef int64_t k
    if n != mapped.shape[0] or ids.shape[0] != dest.shape[0] or \
            targets.shape[0] != inputs.shape[0] or targets.shape[1] != inputs.shape[1]:
        return False
    if not rows_sound(row_ptr, seg_len, min(seg_start.shape[0], seg_len.shape[0]), ids) or \
            not in_range(dest, inputs.shape[0]):
        return False
    if segment_ids is not None and (positions is None or loss_mask is None or not (
            same_shape(segment_ids.shape, inputs.shape) and same_shape(positions.shape,
            inputs.shape) and same_shape(loss_mask.shape, inputs.shape))):
        return False
    views = <Py_buffer*>malloc(n * sizeof(Py_buffer) + 1)
    ptrs = <uint64_t*>malloc(n * sizeof(uint64_t) + 1)
    if views == NULL or ptrs == NULL:
        free(views)
        free(ptrs)
        raise MemoryError()
    held = 0
    try:
        for m in range(n):
            PyObject_GetBuffer(arrays[m], &views[m], PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT)
            held += 1
            c = CODES.get((<bytes>views[m].format).decode()[-1:], -1)
            if views[m].ndim != 1 or (code != -1 and c != code) or c == -1 or \
                    views[m].itemsize != SIZES[c]:
                return False
            k = mapped[m]
            if k < 0 or k >= bounds.shape[0] - 1 or \
                    views[m].len // views[m].itemsize < bounds[k + 1] - bounds[k]:
                return False  # a shard shorter than its bounds say: never read past its end
            code = c
            ptrs[m] = <uintptr_t>views[m].buf
        with nogil:
            bad = tokens_any(code, row_ptr, seg_start, seg_len, ids, dest, bounds, mapped, ptrs,
                             inputs, targets, partial)
            if not bad and segment_ids is not None:
                metadata(row_ptr, seg_len, ids, dest, segment_ids, positions, loss_mask)
    finally:
        for m in range(held):
            PyBuffer_Release(&views[m])
        free(views)
        free(ptrs)
    return not bad


cdef int by_value(const void* a, const void* b) noexcept nogil:
    cdef int64_t x = (<const int64_t*>a)[0], y = (<const int64_t*>b)[0]
    return (x > y) - (x < y)


def shards_of(const int64_t[::1] row_ptr, const int64_t[::1] seg_start, const int64_t[::1] ids,
              const int64_t[::1] bounds) -> list:
    """The distinct shards (ascending) that the segments of rows ``ids`` start in."""
    cdef Py_ssize_t i, j, n = 0, total = 0, out = 0
    if not runs_sound(row_ptr, seg_start.shape[0], ids):
        raise IndexError("a row id, or its segments, out of range")
    for i in range(ids.shape[0]):
        total += row_ptr[ids[i] + 1] - row_ptr[ids[i]]
    cdef int64_t* found = <int64_t*>malloc(total * sizeof(int64_t) + 8)
    if found == NULL:
        raise MemoryError()
    try:
        with nogil:
            for i in range(ids.shape[0]):
                for j in range(row_ptr[ids[i]], row_ptr[ids[i] + 1]):
                    found[n] = upper(bounds, seg_start[j]) - 1
                    n += 1
            qsort(found, n, sizeof(int64_t), by_value)
            for i in range(n):
                if i == 0 or found[i] != found[out - 1]:
                    found[out] = found[i]
                    out += 1
        return [found[i] for i in range(out)]
    finally:
        free(found)


def fill_metadata_rows(const int64_t[::1] row_ptr, const int64_t[::1] seg_len,
                       const int64_t[::1] ids, const int64_t[::1] dest,
                       int32_t[:, ::1] segment_ids, int32_t[:, ::1] positions,
                       uint8_t[:, ::1] loss_mask) -> bool:
    """Segment ids, positions and loss mask of rows ``ids`` (row i holds the segments
    ``seg_len[row_ptr[i]:row_ptr[i + 1]]`` back to back from column 0) into batch rows ``dest``;
    False when an id, a row or a segment is out of range, or the three differ in shape."""
    if ids.shape[0] != dest.shape[0] or not rows_sound(row_ptr, seg_len, seg_len.shape[0], ids) \
            or not in_range(dest, segment_ids.shape[0]) or not same_shape(
                positions.shape, segment_ids.shape) or not same_shape(loss_mask.shape,
                                                                       segment_ids.shape):
        return False
    with nogil:
        metadata(row_ptr, seg_len, ids, dest, segment_ids, positions, loss_mask)
    return True
