# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Best fit of a window's pieces into rows, compiled: ``pack._best_fit``'s rows, exactly.

Items (lengths >= 1, sorted decreasing, each <= capacity) go one run of equal lengths at a time
to the open row with the least room that fits (ties: the lowest row id), else to a new row; a
row that takes one item of a run takes as many as fit at once. Rooms are found in a bitmap (the
lowest set bit at or above a length), each room's rows in a binary min-heap. The GIL is released:
a window packed ahead in a thread no longer stalls the training loop's thread.
"""

from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport calloc, free, realloc

import numpy as np

__all__ = ["best_fit"]

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


cdef int fit(const int64_t[::1] lengths, int64_t capacity, int64_t first_row,
             int64_t[::1] rows) noexcept nogil:
    """``rows`` of every item; -1 when out of memory, -2 for a length outside [1, capacity]."""
    cdef Py_ssize_t n = lengths.shape[0], i = 0, end, j, words = (capacity >> 6) + 1
    cdef Heap* heaps = <Heap*>calloc(capacity + 1, sizeof(Heap))
    cdef uint64_t* bits = <uint64_t*>calloc(words, sizeof(uint64_t))
    cdef int64_t length, room, row, k, next_row = first_row
    cdef int status = 0
    if heaps == NULL or bits == NULL:
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
                if push(&heaps[room], row) != 0:
                    status = -1
                    break
    if heaps != NULL:
        for j in range(capacity + 1):
            free(heaps[j].rows)
    free(heaps)
    free(bits)
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
    with nogil:
        status = fit(lens, capacity, first_row, rows)
    if status == -1:
        raise MemoryError("best fit: out of memory")
    return None if status == -2 else out
