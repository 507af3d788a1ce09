# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Best fit of a window's pieces into rows, compiled: ``pack._best_fit``'s rows, exactly.

Items (lengths >= 1, sorted decreasing, each <= capacity) go one run of equal lengths at a time
to the open row with the least room that fits (ties: the lowest row id), else to a new row; a
row that takes one item of a run takes as many as fit at once. Rooms are found in a bitmap (the
lowest set bit at or above a length), each room's rows in a binary min-heap. The GIL is released:
a window packed ahead in a thread no longer stalls the training loop's thread.
"""

from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, qsort, realloc
from libc.string cimport memset
from cpython.buffer cimport PyBUF_FORMAT

import numpy as np

__all__ = ["OPEN_ROWS", "best_fit", "open_fit", "pack_window", "permute", "window_ids",
           "work_size"]

cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil



cdef struct Heap:
    int64_t* rows
    Py_ssize_t size
    Py_ssize_t cap


cdef int push(Heap* h, int64_t row) noexcept nogil:
    """Add ``row``; -1 when out of memory."""
    cdef Py_ssize_t i, parent
    cdef int64_t* grown
    if h.size == h.cap:
        grown = <int64_t*>realloc(h.rows, (2 * h.cap + 4) * sizeof(int64_t))
        if grown == NULL:
            return -1
        h.rows, h.cap = grown, 2 * h.cap + 4
    i = h.size
    h.size += 1
    while i > 0:
        parent = (i - 1) >> 1
        if h.rows[parent] <= row:
            break
        h.rows[i] = h.rows[parent]
        i = parent
    h.rows[i] = row
    return 0


cdef int64_t pop(Heap* h) noexcept nogil:
    """Remove and return the least row (the heap is not empty)."""
    cdef int64_t top = h.rows[0], last
    cdef Py_ssize_t i = 0, child
    h.size -= 1
    if h.size == 0:
        return top
    last = h.rows[h.size]
    while True:
        child = 2 * i + 1
        if child >= h.size:
            break
        if child + 1 < h.size and h.rows[child + 1] < h.rows[child]:
            child += 1
        if h.rows[child] >= last:
            break
        h.rows[i] = h.rows[child]
        i = child
    h.rows[i] = last
    return top


cdef Py_ssize_t lowest_at_or_above(const uint64_t* bits, Py_ssize_t words,
                                   Py_ssize_t at) noexcept nogil:
    """The lowest set bit >= ``at``, or -1."""
    cdef Py_ssize_t w = at >> 6
    cdef uint64_t word
    if w >= words:
        return -1
    word = bits[w] & (~<uint64_t>0 << (at & 63))
    while True:
        if word:
            return (w << 6) + __builtin_ctzll(word)
        w += 1
        if w >= words:
            return -1
        word = bits[w]


cdef int fit(const int64_t* lengths, Py_ssize_t n, int64_t capacity, int64_t first_row,
             int64_t* rows) noexcept nogil:
    """``rows`` of the ``n`` items; -1 when out of memory, -2 for a length outside [1, capacity]."""
    cdef Py_ssize_t i = 0, end, j, words = (capacity >> 6) + 1
    cdef Heap* heaps = <Heap*>calloc(capacity + 1, sizeof(Heap))  # pages touched when used
    cdef uint64_t* bits = <uint64_t*>calloc(words, sizeof(uint64_t))
    cdef int64_t* used = <int64_t*>malloc((n + 1) * sizeof(int64_t))  # rooms given a heap
    cdef int64_t length, room, row, k, next_row = first_row, n_used = 0
    cdef int status = 0
    if heaps == NULL or bits == NULL or used == NULL:
        status = -1
    while status == 0 and i < n:
        length = lengths[i]
        if length < 1 or length > capacity:
            status = -2
            break
        end = i + 1
        while end < n and lengths[end] == length:
            end += 1
        while i < end:
            room = lowest_at_or_above(bits, words, length)
            if room >= 0:
                row = pop(&heaps[room])
                if heaps[room].size == 0:
                    bits[room >> 6] &= ~(<uint64_t>1 << (room & 63))
            else:
                row, room = next_row, capacity
                next_row += 1
            k = room // length
            if k == 1 or end - i == 1:
                rows[i] = row
                i += 1
                room -= length
            else:
                if k > end - i:
                    k = end - i
                for j in range(i, i + k):
                    rows[j] = row
                i += k
                room -= k * length
            if room:
                if heaps[room].size == 0:
                    bits[room >> 6] |= <uint64_t>1 << (room & 63)
                if heaps[room].cap == 0:
                    used[n_used] = room
                    n_used += 1
                if push(&heaps[room], row) != 0:
                    status = -1
                    break
    if heaps != NULL and used != NULL:
        for j in range(n_used):  # not every room: a 1M-token row's heaps are 25 MB untouched
            free(heaps[used[j]].rows)
    free(heaps)
    free(bits)
    free(used)
    return status


def best_fit(lengths, int64_t capacity, int64_t first_row):
    """Row of each item of ``lengths`` (int64, >= 1, sorted decreasing, <= ``capacity``) by
    best fit, rows numbered from ``first_row``; None for a length outside [1, capacity]."""
    cdef const int64_t[::1] lens = np.ascontiguousarray(lengths, dtype=np.int64)
    out = np.empty(lens.shape[0], dtype=np.int64)
    cdef int64_t[::1] rows = out
    cdef int status
    if capacity < 1:
        return None
    if lens.shape[0] == 0:
        return out
    with nogil:
        status = fit(&lens[0], lens.shape[0], capacity, first_row, &rows[0])
    if status == -1:
        raise MemoryError("best fit: out of memory")
    return None if status == -2 else out


# ---- a whole window: pieces, best fit decreasing, rows split to the allotment --------------------

cdef struct Pairs:  # a binary min-heap of (a, b) pairs, ordered as Python orders tuples
    int64_t* a
    int64_t* b
    Py_ssize_t size


cdef inline bint less(int64_t a1, int64_t b1, int64_t a2, int64_t b2) noexcept nogil:
    return a1 < a2 or (a1 == a2 and b1 < b2)


cdef void pair_push(Pairs* h, int64_t a, int64_t b) noexcept nogil:
    """Add (a, b) (room for it was allocated)."""
    cdef Py_ssize_t i = h.size, parent
    h.size += 1
    while i > 0:
        parent = (i - 1) >> 1
        if not less(a, b, h.a[parent], h.b[parent]):
            break
        h.a[i], h.b[i] = h.a[parent], h.b[parent]
        i = parent
    h.a[i], h.b[i] = a, b


cdef void pair_pop(Pairs* h) noexcept nogil:
    """Remove the least pair (the heap is not empty)."""
    cdef Py_ssize_t i = 0, child
    cdef int64_t a, b
    h.size -= 1
    if h.size == 0:
        return
    a, b = h.a[h.size], h.b[h.size]
    while True:
        child = 2 * i + 1
        if child >= h.size:
            break
        if child + 1 < h.size and less(h.a[child + 1], h.b[child + 1], h.a[child], h.b[child]):
            child += 1
        if not less(h.a[child], h.b[child], a, b):
            break
        h.a[i], h.b[i] = h.a[child], h.b[child]
        i = child
    h.a[i], h.b[i] = a, b


cdef int split_rows(int64_t* item, int64_t* off, int64_t* seg_len, int64_t* row,
                    Py_ssize_t* size_io, Py_ssize_t n, Py_ssize_t rows, uint8_t* cut
                    ) noexcept nogil:
    """``packfit._split``, exactly: new rows n … rows-1 each take the second half of the segments
    of the row with the most (ties: the lowest row), or, when every row has one, the second half
    of the longest segment (ties: the first); -1 when out of memory."""
    cdef Py_ssize_t size = size_io[0], grow = rows - n, j, r, new, at, cap_most, cap_long
    cdef int64_t half, x, g
    cdef int64_t* cnt = <int64_t*>calloc(rows + 1, sizeof(int64_t))
    cdef int64_t* first = <int64_t*>calloc(rows + 1, sizeof(int64_t))
    cdef Pairs most, longest
    cap_most = n + 3 * grow + 1
    cap_long = size + 2 * grow + 1
    most.a = <int64_t*>malloc(cap_most * sizeof(int64_t))
    most.b = <int64_t*>malloc(cap_most * sizeof(int64_t))
    most.size = 0
    longest.a = longest.b = NULL
    longest.size = -1  # made at first need
    cdef int status = 0
    if cnt == NULL or first == NULL or most.a == NULL or most.b == NULL:
        status = -1
    else:
        for j in range(size):
            cnt[row[j]] += 1
        for r in range(1, rows):
            first[r] = first[r - 1] + cnt[r - 1]
        for r in range(n):
            pair_push(&most, -cnt[r], r)
        for new in range(n, rows):
            while most.size and -most.a[0] != cnt[most.b[0]]:
                pair_pop(&most)
            if most.size and -most.a[0] >= 2:
                r = most.b[0]
                half = cnt[r] // 2
                first[new], cnt[new], cnt[r] = first[r] + half, cnt[r] - half, half
                for j in range(first[new], first[new] + cnt[new]):
                    row[j] = new
                pair_push(&most, -half, r)
                pair_push(&most, -cnt[new], new)
                continue
            if longest.size < 0:
                longest.a = <int64_t*>malloc(cap_long * sizeof(int64_t))
                longest.b = <int64_t*>malloc(cap_long * sizeof(int64_t))
                if longest.a == NULL or longest.b == NULL:
                    status = -1
                    break
                longest.size = 0
                for j in range(size):
                    pair_push(&longest, -seg_len[j], j)
            while longest.size and -longest.a[0] != seg_len[longest.b[0]]:
                pair_pop(&longest)
            if not longest.size or -longest.a[0] < 3:
                continue  # nothing left to split: an empty row
            at = longest.b[0]
            x = seg_len[at]
            g = (x + 1) // 2
            seg_len[at] = g
            item[size], off[size], seg_len[size], row[size] = item[at], off[at] + g - 1, x - g + 1, new
            first[new], cnt[new] = size, 1
            pair_push(&longest, -g, at)
            pair_push(&longest, -(x - g + 1), size)
            pair_push(&most, -1, new)
            cut[item[at]] = 1
            size += 1
    size_io[0] = size
    free(cnt)
    free(first)
    free(most.a)
    free(most.b)
    free(longest.a)
    free(longest.b)
    return status


cdef int by_pair(const void* a, const void* b) noexcept nogil:
    cdef const int64_t* x = <const int64_t*>a
    cdef const int64_t* y = <const int64_t*>b
    if x[0] != y[0]:
        return -1 if x[0] < y[0] else 1
    return -1 if x[1] < y[1] else (1 if x[1] > y[1] else 0)


cdef int by_key(const int64_t* key, Py_ssize_t n, int64_t buckets, int64_t* out) noexcept nogil:
    """``out``: indices 0 … n-1 in stable order of ``key`` (each in [0, buckets)); -1 when out of
    memory. A counting sort, or (far more buckets than keys: a 1M-token row's lengths) a sort of
    (key, index) pairs, so that the buckets' memory never outgrows the keys'."""
    cdef int64_t* count
    cdef Py_ssize_t i
    if buckets > 4 * n + 4096:
        count = <int64_t*>malloc(2 * n * sizeof(int64_t) + 8)
        if count == NULL:
            return -1
        for i in range(n):
            count[2 * i], count[2 * i + 1] = key[i], i
        qsort(count, n, 2 * sizeof(int64_t), by_pair)
        for i in range(n):
            out[i] = count[2 * i + 1]
        free(count)
        return 0
    count = <int64_t*>calloc(buckets + 1, sizeof(int64_t))
    if count == NULL:
        return -1
    for i in range(n):
        count[key[i] + 1] += 1
    for i in range(buckets):
        count[i + 1] += count[i]
    for i in range(n):
        out[count[key[i]]] = i
        count[key[i]] += 1
    free(count)
    return 0


cdef Py_ssize_t count_pieces(const int64_t[::1] lengths, int64_t seq_len) noexcept nogil:
    """Items ``pack.pieces`` makes of these documents; -1 for a negative length."""
    cdef Py_ssize_t i, total = 0
    cdef int64_t x, cap = seq_len + 1
    for i in range(lengths.shape[0]):
        x = lengths[i]
        if x < 0:
            return -1
        total += (x - 2) // seq_len + 1 if x > cap else (1 if x > 0 else 0)
    return total


OPEN_ROWS = 32  # pack.OPEN_ROWS (checked equal by the tests)
cdef enum:
    OPEN = 32  # a power of two: a row's slot in the ring of open rows is row & (OPEN - 1)


cdef int open_fit_rows(const int64_t* lengths, Py_ssize_t n, int64_t capacity,
                       int64_t* rows) noexcept nogil:
    """``pack._open_fit``: each item to the open row (the OPEN rows made last) of least room
    that fits, ties to the lowest row, else to a new row; -2 for a length outside [1, capacity].
    The open rows are kept sorted by (room, row), so the row an item goes to is the first whose
    room fits (a binary search) and the row then moves down to its new place: 4× faster than
    scanning every open row for each item (a window's packing is mostly this loop)."""
    cdef int64_t room[OPEN + 1]
    cdef int64_t row[OPEN + 1]  # room[k], row[k]: ascending by (room, row)
    cdef Py_ssize_t i, lo, hi, mid, k, count = 0
    cdef int64_t oldest = 0, made = 0, best, x, left
    for i in range(n):
        x = lengths[i]
        if x < 1 or x > capacity:
            return -2
        lo, hi = 0, count
        while lo < hi:
            mid = (lo + hi) >> 1
            if room[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        if lo < count:
            k, best = lo, row[lo]
        else:  # none fits: a new row, last in the order (most room, highest row)
            best, k = made, count
            room[k], row[k] = capacity, best
            made += 1
            count += 1
            if made - oldest > OPEN:  # the oldest row closes
                lo = 0
                while row[lo] != oldest:
                    lo += 1
                while lo < count - 1:
                    room[lo], row[lo] = room[lo + 1], row[lo + 1]
                    lo += 1
                count -= 1
                k -= 1
                oldest += 1
        left = room[k] - x
        while k > 0 and (room[k - 1] > left or (room[k - 1] == left and row[k - 1] > best)):
            room[k], row[k] = room[k - 1], row[k - 1]
            k -= 1
        room[k], row[k] = left, best
        rows[i] = best
    return 0


def open_fit(lengths, int64_t capacity):
    """``pack._open_fit``'s rows, compiled; None for a length outside [1, capacity]."""
    cdef const int64_t[::1] lens = np.ascontiguousarray(lengths, dtype=np.int64)
    out = np.empty(lens.shape[0], dtype=np.int64)
    cdef int64_t[::1] rows = out
    cdef int status
    if lens.shape[0] == 0:
        return out
    with nogil:
        status = open_fit_rows(&lens[0], lens.shape[0], capacity, &rows[0])
    return None if status != 0 else out


cdef struct Work:
    # a window's working arrays: pieces (document, offset, length), the order placed, the rows
    # placed, and the segments (piece, offset in it, length, row) with room for split rows
    int64_t* pdoc
    int64_t* poff
    int64_t* plen
    int64_t* order
    int64_t* placed
    int64_t* perm
    int64_t* item
    int64_t* off
    int64_t* seg_len
    int64_t* row
    uint8_t* cut


cdef int window(const int64_t[::1] lengths, int64_t seq_len, Py_ssize_t rows, Py_ssize_t total,
                bint ordered, Work* w, Py_ssize_t* size_out) noexcept nogil:
    """``packfit.fit_rows(*pack.pieces(lengths, seq_len)[2:], …)`` into ``w``, before the last
    sort by row; 1 when the rows of a window that needs more than ``rows`` find no room for the
    dissolved rows' segments (the Python path cuts it as a stream), -1 when out of memory."""
    cdef Py_ssize_t i, j, k, p = 0, n_full = 0
    cdef int64_t x, cap = seq_len + 1
    for i in range(lengths.shape[0]):  # pack.pieces: documents, then pieces, in order
        x = lengths[i]
        k = (x - 2) // seq_len + 1 if x > cap else (1 if x > 0 else 0)
        for j in range(k):
            w.pdoc[p], w.poff[p] = i, j * seq_len
            w.plen[p] = cap if x - j * seq_len > cap else x - j * seq_len
            p += 1
    if ordered:  # pack.place(ordered=True): rows of nearby pieces, in their own order
        for i in range(total):
            w.order[i] = i
        k = open_fit_rows(w.plen, total, cap, w.placed)
        if k != 0:
            return 2
        return grouped(w, total, rows, cap, size_out)
    for i in range(total):  # pack.place: decreasing length, ties by piece (a stable sort)
        w.seg_len[i] = cap - w.plen[i]
    if by_key(w.seg_len, total, cap, w.order) != 0:
        return -1
    for i in range(total):
        w.seg_len[i] = w.plen[w.order[i]]
        if w.seg_len[i] == cap:
            n_full += 1
    for i in range(n_full):  # a full piece fills a row alone
        w.placed[i] = i
    if total > n_full:
        k = fit(w.seg_len + n_full, total - n_full, cap, n_full, w.placed + n_full)
        if k != 0:
            return -1 if k == -1 else 2
    return grouped(w, total, rows, cap, size_out)


cdef int grouped(Work* w, Py_ssize_t total, Py_ssize_t rows, int64_t capacity,
                 Py_ssize_t* size_out) noexcept nogil:
    """Pieces ``w.order[i]`` placed in rows ``w.placed[i]`` as segments in row order (each row
    as placed), then fitted to ``rows``: rows split (``packfit._split``) or dissolved
    (``packfit._squeeze``); 1 when the dissolved rows' segments find no room."""
    cdef Py_ssize_t i, j
    cdef int64_t n = 0
    for i in range(total):
        if w.placed[i] + 1 > n:
            n = w.placed[i] + 1
    if by_key(w.placed, total, n, w.perm) != 0:  # segments in row order, each row as placed
        return -1
    for i in range(total):
        j = w.perm[i]
        w.item[i], w.off[i], w.row[i] = w.order[j], 0, w.placed[j]
        w.seg_len[i] = w.plen[w.item[i]]
    size_out[0] = total
    if n < rows:
        return split_rows(w.item, w.off, w.seg_len, w.row, size_out, n, rows, w.cut)
    if n > rows:
        return squeeze_rows(w.item, w.off, w.seg_len, w.row, size_out, n, rows, capacity, w.cut)
    return 0


cdef Py_ssize_t least_room(const int64_t* room, Py_ssize_t rows, int64_t x) noexcept nogil:
    """The row of least room >= x (ties: the lowest), or -1 (``packfit._Rooms.best_fit``)."""
    cdef Py_ssize_t r, best = -1
    cdef int64_t at = 0
    for r in range(rows):
        if room[r] >= x and (best < 0 or room[r] < at):
            best, at = r, room[r]
    return best


cdef int squeeze_rows(int64_t* item, int64_t* off, int64_t* seg_len, int64_t* row,
                      Py_ssize_t* size_io, Py_ssize_t n, Py_ssize_t rows, int64_t capacity,
                      uint8_t* cut) noexcept nogil:
    """``packfit._squeeze`` with no cap, exactly: the n - rows emptiest rows (ties: the lowest)
    dissolved; their segments, longest first (ties: in order), each go whole to the kept row of
    least room that fits (ties: the lowest), else are cut across the kept rows of most room
    (pieces >= 2 tokens); 1 when no room is left (the Python path cuts the window as a stream),
    -1 when out of memory. Rooms are scanned: a window has a few thousand rows, and only the
    dissolved rows' segments are placed."""
    cdef Py_ssize_t size = size_io[0], j, r, m = 0, o = 0, at, big
    cdef int64_t x, it, start, g
    cdef int64_t* fill = <int64_t*>calloc(2 * n + 2, sizeof(int64_t))  # then (fill, row) pairs
    cdef int64_t* renumber = <int64_t*>malloc((n + 1) * sizeof(int64_t))
    cdef int64_t* room = <int64_t*>malloc((rows + 1) * sizeof(int64_t))
    cdef int64_t* moved = <int64_t*>malloc((3 * size + 1) * sizeof(int64_t))
    cdef int64_t* todo = <int64_t*>malloc((2 * size + 2) * sizeof(int64_t))
    cdef int status = 0
    if fill == NULL or renumber == NULL or room == NULL or moved == NULL or todo == NULL:
        status = -1
    else:
        for j in range(size):
            fill[2 * row[j]] += seg_len[j]
        for r in range(n):
            fill[2 * r + 1] = r
        qsort(fill, n, 2 * sizeof(int64_t), by_pair)  # emptiest first, ties: the lowest row
        for r in range(n):
            renumber[r] = 0
        for r in range(n - rows):
            renumber[fill[2 * r + 1]] = -1
        j = 0
        for r in range(n):
            if renumber[r] == 0:
                renumber[r] = j
                j += 1
        for j in range(rows + 1):
            room[j] = capacity
        for j in range(size):  # kept segments stay in order; the dissolved rows' are set aside
            if renumber[row[j]] < 0:
                moved[3 * m], moved[3 * m + 1], moved[3 * m + 2] = seg_len[j], item[j], off[j]
                todo[2 * m], todo[2 * m + 1] = -seg_len[j], m
                m += 1
            else:
                item[o], off[o], seg_len[o], row[o] = item[j], off[j], seg_len[j], renumber[row[j]]
                room[row[o]] -= seg_len[o]
                o += 1
        qsort(todo, m, 2 * sizeof(int64_t), by_pair)  # longest first, ties in order
        for j in range(m):
            at = todo[2 * j + 1]
            x, it, start = moved[3 * at], moved[3 * at + 1], moved[3 * at + 2]
            r = least_room(room, rows, x)
            while r < 0:  # no room takes it whole: fill the largest, go on with the rest
                big = 0
                for r in range(1, rows):
                    if room[r] > room[big]:
                        big = r
                if rows == 0 or room[big] < 2:
                    status = 1
                    break
                g = room[big]
                room[big] = 0
                item[o], off[o], seg_len[o], row[o] = it, start, g, big
                o += 1
                cut[it] = 1
                start, x = start + g - 1, x - g + 1
                r = least_room(room, rows, x)
            if status != 0:
                break
            room[r] -= x
            item[o], off[o], seg_len[o], row[o] = it, start, x, r
            o += 1
    size_io[0] = o
    free(fill)
    free(renumber)
    free(room)
    free(moved)
    free(todo)
    return status


cdef char* FORMAT = b"q"  # int64 (long long)


cdef class Owned:
    """An int64 array malloc'd without the GIL, handed to numpy (``owned``): freed with the last
    array over it."""
    cdef int64_t* data
    cdef Py_ssize_t n
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __dealloc__(self):
        free(self.data)

    def __getbuffer__(self, Py_buffer* buf, int flags):
        self.shape[0], self.strides[0] = self.n, sizeof(int64_t)
        buf.buf, buf.len = self.data, self.n * sizeof(int64_t)
        buf.obj = self
        buf.readonly, buf.itemsize, buf.ndim = 0, sizeof(int64_t), 1
        buf.format = NULL
        if flags & PyBUF_FORMAT:
            buf.format = FORMAT
        buf.shape, buf.strides = self.shape, self.strides
        buf.suboffsets, buf.internal = NULL, NULL

    def __releasebuffer__(self, Py_buffer* buf):
        pass


cdef object owned(int64_t* data, Py_ssize_t n):
    """A numpy int64 array of the ``n`` values at ``data`` (malloc'd: freed with the array)."""
    cdef Owned o = Owned.__new__(Owned)
    o.data, o.n = data, n
    return np.frombuffer(o, dtype=np.int64)


WORK_ARRAYS = 11  # int64 arrays a window's work takes, each of its pieces + rows + 1 entries


def pack_window(lengths, starts, docs, int64_t seq_len, Py_ssize_t rows, work=None,
                bint ordered=False, keys=None, int h=0):
    """A window's documents (``lengths``, their global first tokens ``starts`` and ids ``docs``)
    in exactly ``rows`` rows of seq_len + 1 tokens, as ``packplan.PackedPlan.pack`` makes them
    with no cap: (row_ptr, seg_start, seg_len, seg_doc, documents cut, documents longer than a
    row, one-token tails dropped, order); None when a window that needs more rows than that
    leaves no room for its dissolved rows (the Python path cuts it as a stream) or a length is
    negative. ``work``: a 1-D int64 array of at least ``work_size`` entries to work in (kept by
    the caller between windows: fresh memory costs a page fault per 4 KiB, most of the time on
    some machines). ``ordered``: pieces placed by ``pack._open_fit`` in their order instead of
    best fit decreasing. ``keys`` (uint64 round keys) and ``h``: order is ``permute`` of
    range(rows) under them (else None). One pass with the GIL released, its outputs made in it at
    their exact size (``owned``): each time a thread that packs ahead takes the GIL back, the
    training loop's thread may wait for it."""
    cdef const int64_t[::1] lens = np.ascontiguousarray(lengths, dtype=np.int64)
    cdef const int64_t[::1] first = np.ascontiguousarray(starts, dtype=np.int64)
    cdef const int64_t[::1] ids = np.ascontiguousarray(docs, dtype=np.int64)
    cdef const uint64_t[::1] rk
    if seq_len < 1 or rows < 0 or first.shape[0] != lens.shape[0] or ids.shape[0] != lens.shape[0]:
        return None
    if keys is not None:
        rk = np.ascontiguousarray(keys, dtype=np.uint64)
        if rows > 0 and (h < 1 or h > 31 or rk.shape[0] < 1 or rows > (1 << (2 * h))):
            raise ValueError(f"a Feistel network of 2 × {h} bits over range({rows})")
    cdef Py_ssize_t total = count_pieces(lens, seq_len), room, size = 0, i, j
    if total < 0:
        return None
    room = total + rows + 1
    if work is None or work.shape[0] < WORK_ARRAYS * room:
        work = np.empty(WORK_ARRAYS * room, dtype=np.int64)
    cdef int64_t[::1] buf = work
    cdef int64_t* at = &buf[0]
    cdef Work w
    cdef int status
    cdef int64_t num_cut = 0, it, truncated = 0, dropped = 0, x
    cdef int64_t* seg_start = NULL
    cdef int64_t* seg_len = NULL
    cdef int64_t* seg_doc = NULL
    cdef int64_t* o = NULL
    cdef bint shuffled = keys is not None
    w.pdoc, w.poff, w.plen = at, at + room, at + 2 * room
    w.order, w.placed, w.perm = at + 3 * room, at + 4 * room, at + 5 * room
    w.item, w.off, w.seg_len, w.row = at + 6 * room, at + 7 * room, at + 8 * room, at + 9 * room
    w.cut = <uint8_t*>(at + 10 * room)
    out_ptr = np.zeros(rows + 1, dtype=np.int64)
    cdef int64_t[::1] row_ptr = out_ptr
    with nogil:
        memset(w.cut, 0, room)
        status = window(lens, seq_len, rows, total, ordered, &w, &size)
        if status == 0:
            status = by_key(w.row, size, rows, w.perm)  # by row, stable (split rows too)
        if status == 0:
            seg_start = <int64_t*>malloc(size * sizeof(int64_t) + 8)
            seg_len = <int64_t*>malloc(size * sizeof(int64_t) + 8)
            seg_doc = <int64_t*>malloc(size * sizeof(int64_t) + 8)
            if shuffled:
                o = <int64_t*>malloc(rows * sizeof(int64_t) + 8)
            if seg_start == NULL or seg_len == NULL or seg_doc == NULL or \
                    (shuffled and o == NULL):
                status = -1
        if status == 0:
            for i in range(size):
                row_ptr[w.row[i] + 1] += 1
            for i in range(rows):
                row_ptr[i + 1] += row_ptr[i]
            for i in range(size):
                j = w.perm[i]
                it = w.item[j]
                seg_start[i] = first[w.pdoc[it]] + w.poff[it] + w.off[j]
                seg_len[i] = w.seg_len[j]
                seg_doc[i] = ids[w.pdoc[it]]
            for i in range(total):
                num_cut += w.cut[i]
            for i in range(lens.shape[0]):  # pack.truncation
                x = lens[i]
                if x > seq_len + 1:
                    truncated += 1
                    dropped += (x - 1) % seq_len == 0
            if shuffled:  # permute(range(rows))
                for i in range(rows):
                    o[i] = <int64_t>walk(<uint64_t>i, <uint64_t>rows, &rk[0], rk.shape[0], h)
    if status != 0:
        free(seg_start)
        free(seg_len)
        free(seg_doc)
        free(o)
        if status == -1:
            raise MemoryError("packing a window: out of memory")
        return None
    return (out_ptr, owned(seg_start, size), owned(seg_len, size), owned(seg_doc, size),
            int(num_cut), int(truncated), int(dropped), None if o == NULL else owned(o, rows))


def work_size(lengths, int64_t seq_len, Py_ssize_t rows) -> int:
    """Entries of the int64 ``work`` array ``pack_window`` takes for this window."""
    cdef const int64_t[::1] lens = np.ascontiguousarray(lengths, dtype=np.int64)
    return WORK_ARRAYS * (max(0, count_pieces(lens, seq_len)) + max(0, rows) + 1)


# ---- a window's documents: one run of each stratum ---------------------------------------------

cdef inline int64_t run_of(const int64_t[::1] bounds, const int64_t[::1] shift, Py_ssize_t i,
                           int64_t x, int64_t run, int64_t num_docs, int64_t* first) noexcept nogil:
    """Documents stratum i gives raw window x (its run (shift_i + x) mod M_i, from ``first``)."""
    cdef int64_t m = bounds[i + 1] - bounds[i]
    if not m > x >= 0:
        return 0
    first[0] = (bounds[i] + (shift[i] + x) % m) * run
    return min(run, num_docs - first[0]) if first[0] < num_docs else 0


def window_ids(const int64_t[::1] bounds, const int64_t[::1] shift, list xs, int64_t run,
               int64_t num_docs):
    """``packplan.PackedPlan._ids`` of each raw window index in ``xs``, concatenated, and where
    each one's ids start (len(xs) + 1 offsets): stratum i (runs ``bounds[i]:bounds[i + 1]``,
    M_i of them) gives window x its run (shift_i + x) mod M_i when M_i > x, a run u being the
    documents [u·run, min(u·run + run, num_docs)). Two passes with the GIL released (the ids'
    count, then the ids), one numpy array made between them."""
    cdef Py_ssize_t k = bounds.shape[0] - 1, n = len(xs), i, j, total = 0, at = 0
    cdef int64_t c, d, first = 0
    if k < 0 or shift.shape[0] < k or run < 1:
        raise ValueError("strata bounds, shifts and the run disagree")
    cdef int64_t[::1] want = np.array(xs, dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    cdef int64_t[::1] off = offsets
    with nogil:
        for j in range(n):
            for i in range(k):
                total += run_of(bounds, shift, i, want[j], run, num_docs, &first)
            off[j + 1] = total
    out = np.empty(total, dtype=np.int64)
    cdef int64_t[::1] ids = out
    with nogil:
        for j in range(n):
            for i in range(k):
                c = run_of(bounds, shift, i, want[j], run, num_docs, &first)
                for d in range(c):
                    ids[at + d] = first + d
                at += c
    return out, offsets


# ---- a window's row order: sampler's keyed Feistel network, per element -------------------------

cdef inline uint64_t mix64(uint64_t z) noexcept nogil:
    """``sampler._mix64``: the splitmix64 finalizer (wrapping)."""
    z ^= z >> 30
    z *= 0xBF58476D1CE4E5B9ULL
    z ^= z >> 27
    z *= 0x94D049BB133111EBULL
    z ^= z >> 31
    return z


cdef inline uint64_t feistel(uint64_t x, const uint64_t* keys, Py_ssize_t rounds, int h
                             ) noexcept nogil:
    cdef uint64_t mask = (1ULL << h) - 1, left = x >> h, right = x & mask, f
    cdef Py_ssize_t r
    for r in range(rounds):
        f = mix64(right ^ keys[r]) & mask
        left, right = right, left ^ f
    return (left << h) | right


cdef inline uint64_t walk(uint64_t x, uint64_t n, const uint64_t* keys, Py_ssize_t rounds, int h
                          ) noexcept nogil:
    """x through the network, again until the value falls below n (cycle walking)."""
    x = feistel(x, keys, rounds, h)
    while x >= n:
        x = feistel(x, keys, rounds, h)
    return x


def permute(const uint64_t[::1] x, uint64_t n, const uint64_t[::1] keys, int h):
    """``sampler._permute`` with one set of round keys: each value through the Feistel network
    on 2h bits, walked again until it falls below n (int64)."""
    out = np.empty(x.shape[0], dtype=np.int64)
    cdef int64_t[::1] o = out
    cdef Py_ssize_t i, rounds = keys.shape[0]
    if h < 1 or h > 31 or n < 1 or rounds < 1:
        raise ValueError(f"a Feistel network of 2 × {h} bits over range({n})")
    with nogil:
        for i in range(x.shape[0]):
            o[i] = <int64_t>walk(x[i], n, &keys[0], rounds, h)
    return out
