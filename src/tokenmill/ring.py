"""The Loader's batch buffers: a small ring reused only when nothing outside still holds a batch.

A buffer set handed to the user is reused once its arrays' reference counts are back to what the
ring alone holds (``refcounts``), so a batch you keep is never overwritten::

    ring = Ring(lambda: {"inputs": np.empty((8, 2048), np.int32)}, size=4)
    bufs = ring.take(); batch = ring.hand_out(bufs)
"""

from __future__ import annotations

import sys
from collections import deque

__all__ = ["Ring", "refcounts"]


class Ring:
    """Reusable batch buffers; one is reused only when no outside reference to it remains."""

    def __init__(self, make, size: int):
        self.make, self.size = make, size
        self.free: deque[dict] = deque()
        self.free_refs: list[int] = []
        self.out: deque[dict] = deque()  # handed to the user, oldest first

    def take(self) -> dict[str, np.ndarray]:
        """A buffer set that nothing else references (reclaimed or new)."""
        while self.out and refcounts(self.out[0]) == self.free_refs:
            self.free.append(self.out.popleft())
        if self.free:
            return self.free.popleft()
        if len(self.out) >= self.size:  # the user keeps old batches: let them own those
            self.out.popleft()
        bufs = self.make()
        # what an array's count reads when only the ring's dict holds it, measured the same way
        self.free_refs = refcounts(bufs)
        return bufs

    def hand_out(self, bufs: dict) -> dict:
        """Record ``bufs`` as given to the user; returns a new dict over the same arrays."""
        self.out.append(bufs)
        return dict(bufs)

    def reclaim(self, bufs: dict) -> None:
        """Return a buffer set that was never handed out."""
        self.free.append(bufs)


def refcounts(bufs: dict) -> list[int]:
    # a user's dict, a view (its .base) or a tensor from from_numpy each add one reference
    return [sys.getrefcount(a) for a in bufs.values()]
