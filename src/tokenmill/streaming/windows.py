"""Where the pass's windows come from: one protocol, two sources.

A ``WindowSource`` hands the producer the concat windows of the pass — window i is tokens
[o + i·L, o + i·L + L] of the stream, o = ``plan.offset`` — and forgets what no window still to
come needs:

- ``TextWindows`` reads and tokenizes the text unit by unit (``units.UnitResults``), passes each
  unit to the cache writer, and keeps one token array per unit from the unit holding the oldest
  token still needed to the newest;
- ``StoreWindows`` reads the same windows from the complete cache store, tokenizing nothing.

    source.confirm(t)            # windows [0, t) complete (or the input ended: num_windows set)
    source.copy(ids, out, rows)  # windows ids[j] into rows rows[j] of the batch arrays
    source.release(i)            # no window before window i is needed any more
    source.resume_from(i)        # the latest Cursor from which reading sees window i again

Packed rows have sources of the same protocol (``rows``): window i is then packed row i.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from typing import Protocol

import numpy as np

from tokenmill.load import pack
from tokenmill.base.errors import ConfigError
from tokenmill.store.reader import TokenStore
from tokenmill.streaming.cache import CacheWriter
from tokenmill.streaming.plan import Cursor, StreamPlan
from tokenmill.streaming.units import Stopped, UnitResults


class WindowSource(Protocol):
    """The pass's windows, from the text or from the cache store (see the module docstring)."""

    num_windows: int | None  # windows in the pass, once known
    peak: int  # the most tokens held at once

    def confirm(self, windows: int) -> None:
        """Make windows [0, windows) available, or learn that the pass has fewer."""

    def copy(self, windows: np.ndarray, out: dict[str, np.ndarray], rows: np.ndarray) -> None:
        """Write window ``windows[j]`` into row ``rows[j]``: inputs, and targets shifted by one."""

    def release(self, window: int) -> None:
        """Forget what no window from ``window`` on needs."""

    def resume_from(self, window: int) -> Cursor | None:
        """The latest cursor from which reading again still sees window ``window``."""

    def close(self) -> None:
        """Stop reading; idempotent."""


def pass_tokens(windows: int, seq_len: int) -> int:
    """Tokens the text must hold for the pass to hold ``windows`` concat windows: (windows + 1)·L,
    the store's rule (``pack.concat_num_samples``: (tokens − L) // L windows, whatever the
    epoch-0 offset o < L), so a streamed pass counts the windows of its cache store; the last
    of them ends at o + windows·L + 1 <= (windows + 1)·L, so each is whole.

    pass_tokens(39, seq_len=32) == 1280
    """
    return (windows + 1) * seq_len


def copy_window(data: np.ndarray, out: dict[str, np.ndarray], row: int) -> None:
    """L + 1 tokens into row ``row``: the first L as inputs, the last L as targets."""
    out["inputs"][row] = data[:-1]
    out["targets"][row] = data[1:]


class StoreWindows:
    """The pass's windows read from the complete cache store: the same tokens, no tokenizing."""

    def __init__(self, plan: StreamPlan):
        self.plan, self.store = plan, TokenStore(plan.store_dir)
        self.num_windows: int | None = pack.concat_num_samples(self.store.num_tokens,
                                                               plan.seq_len)
        self.peak = 0

    def confirm(self, windows: int) -> None:
        """Every window is there already; a shard whose background checksum failed is raised."""
        self.store.check()

    def copy(self, windows: np.ndarray, out: dict[str, np.ndarray], rows: np.ndarray) -> None:
        """Windows ``windows`` from the store's memory map into rows ``rows``."""
        for window, row in zip(windows.tolist(), rows.tolist()):
            s = self.plan.window_start(window)
            copy_window(self.store.tokens(s, s + self.plan.seq_len + 1), out, row)

    def release(self, window: int) -> None:
        """Nothing is held."""

    def resume_from(self, window: int) -> Cursor | None:
        """A resume reads the store again: no cursor needed."""
        return None

    def close(self) -> None:
        """Close the store; idempotent."""
        self.store.close()


class TextWindows:
    """The pass's windows, read and tokenized unit by unit as the shuffle buffer needs them.

    Tokens are kept as one array per unit read (never copied into one ring), from the unit that
    holds the oldest token still needed to the newest.
    """

    def __init__(self, plan: StreamPlan, start: Cursor, writer: CacheWriter | None,
                 units: UnitResults, stop: threading.Event):
        self.plan, self.writer, self.units, self.stop = plan, writer, units, stop
        self.next = Cursor(*start[:3])  # the next unit to read: from its document doc, at token
        self.starts: list[int] = []  # global token where each kept array begins
        self.arrays: list[np.ndarray] = []
        self.held = 0  # tokens in self.arrays
        self.cursors: deque[Cursor] = deque()  # where each unit read so far began
        self.num_windows: int | None = None  # known once the last unit is read (concat)
        self.ended = False  # the last unit was read
        self.on_unit = None  # packed rows: called with (cursor, lengths) of each unit read
        self.peak = 0

    def confirm(self, windows: int) -> None:
        """Read until windows [0, windows) are in the pass (or the input ends)."""
        while self.num_windows is None and self.next.token < pass_tokens(windows,
                                                                         self.plan.seq_len):
            self.pull()

    def drain(self) -> None:
        """Read to the end of the input (to finish the cache store)."""
        while not self.ended:
            self.pull()

    def pull(self) -> None:
        """Read the next unit (or, past the last, learn the number of windows)."""
        if self.stop.is_set():
            raise Stopped
        u, d0, end = self.next[:3]
        if u == len(self.plan.units):
            return self._finish()
        res = self.units.result(u)
        tokens, lengths = res.tokens, res.lengths
        if d0:
            tokens, lengths = tokens[int(lengths[:d0].sum()):], lengths[d0:]
        if self.writer is not None:
            self.writer.add(u, d0, tokens, lengths, res.skips, res.digest,
                            self.writer.origins(u, res).part(d0))
        if self.on_unit is not None:
            self.on_unit(self.next, lengths)
        self.cursors.append(self.next)
        if len(tokens):
            self.starts.append(end)
            self.arrays.append(tokens)
            self.held += len(tokens)
            self.peak = max(self.peak, self.held)
        self.next = Cursor(u + 1, 0, end + len(tokens))

    def _finish(self) -> None:
        if self.writer is not None:
            self.writer.finish()
            self.writer = None
        self.ended = True
        if self.plan.packed:
            return  # packed rows count themselves (rows.PackedText)
        total, L = self.next.token, self.plan.seq_len
        if total < 2 * L:
            raise ConfigError(f"the inputs hold {total:,} tokens, too few for seq_len={L} "
                              f"(concat windows need at least {2 * L:,})")
        self.num_windows = pack.concat_num_samples(total, L)

    def copy(self, windows: np.ndarray, out: dict[str, np.ndarray], rows: np.ndarray) -> None:
        """Windows ``windows`` into rows ``rows``: inputs, and targets shifted by one."""
        for window, row in zip(windows.tolist(), rows.tolist()):
            s = self.plan.window_start(window)
            copy_window(self.tokens(s, s + self.plan.seq_len + 1), out, row)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Global tokens [start, stop) of the units held (a view when one unit holds them)."""
        i = bisect.bisect_right(self.starts, start) - 1
        assert i >= 0, f"token {start} was released"
        lo = start - self.starts[i]
        data = self.arrays[i][lo:lo + stop - start]
        if len(data) < stop - start:  # the range spans units: gather just its pieces
            pieces, have = [data], len(data)
            for a in self.arrays[i + 1:]:
                pieces.append(a[:stop - start - have])
                have += len(pieces[-1])
                if have == stop - start:
                    break
            data = np.concatenate(pieces)
        return data

    def release(self, window: int) -> None:
        """Forget the units that end before window ``window`` starts."""
        self.release_before(self.plan.window_start(window))

    def resume_from(self, window: int) -> Cursor | None:
        """The latest place reading can restart from and still see window ``window``."""
        return self.cursor_for(self.plan.window_start(window))

    def release_before(self, token: int) -> None:
        """Forget the units that end before ``token``: no window still to come starts there."""
        drop = 0
        while drop < len(self.arrays) and self.starts[drop] + len(self.arrays[drop]) <= token:
            self.held -= len(self.arrays[drop])
            drop += 1
        del self.starts[:drop], self.arrays[:drop]
        while len(self.cursors) > 1 and self.cursors[1].token <= token:
            self.cursors.popleft()

    def cursor_for(self, token: int) -> Cursor | None:
        """The latest place reading can restart from and still see token ``token``."""
        return self.cursors[0] if self.cursors and self.cursors[0].token <= token else None

    def close(self) -> None:
        """Stop the unit workers; leave the committed cache shards for a later run."""
        self.units.close()
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
