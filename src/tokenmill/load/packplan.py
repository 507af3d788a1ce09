"""The packed layout as a lazy plan: nothing a rank computes at start grows with the store.

Documents are split into K *strata*, contiguous ranges of the store (K = ``docs_per_window``,
about ROWS_PER_WINDOW rows' worth of documents). Epoch e gives stratum i a random rotation
``shift_i``; *window* w takes from every stratum its document ``(shift_i + w) mod M_i`` (M_i
documents in stratum i), so each window holds K documents spread over the whole store, and over
the epoch's windows every document is taken exactly once. A window is packed on its own
(best-fit decreasing, or the fair fill under ``max_segments``: ``pack.place``) into exactly the
number of rows it is *allotted*, and its rows are shuffled::

    epoch rows  [ window 0: G(0)..G(1) | window 1: G(1)..G(2) | … ]     G(w) = ⌊(P_w + β·w) / L⌋

P_w, the tokens of the windows before w, is a sum over the strata of one contiguous range each: K
index reads, whatever the store's size. So the rows an epoch has (G at the end: from the manifest's
token count), the window a row falls in (a search over w) and the window's own rows (K document
lengths, packed) all cost O(K), never O(documents). β (tokens a window) is set once per store and
config by packing sample windows of epoch 0 (``calibrate``): a window that needs more rows than
allotted cuts a few documents into the others' free room (counted), one that needs fewer splits its
fullest rows. Without a cap, β >= L guarantees that cutting always fits (``packfit._stream``):
every token of every document is in exactly one row each epoch. Under ``max_segments`` nothing
guarantees it (a row's segment slots may all be taken), so β covers the windows of the first block
read plus Z_CAPPED standard deviations of their needs, and a window still short of rows is an error
naming it. A store of short documents whose sample windows pack as densely in order packs every
window in order (``packing.ordered_packing``, ``strata-ordered-v2``), its strata cut in runs of a
row's worth of consecutive documents (``packing.docs_per_run``): a window takes a run a stratum,
so a row's documents lie back to back in the store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass

import numpy as np

from tokenmill.load import fastpath, pack, packahead
from tokenmill.base.arrays import counting, distinct, is_run, ranges, stable_order
from tokenmill.base.errors import ConfigError
from tokenmill.load.packfit import fit_rows
from tokenmill.load.packing import BLOCK_DOCS, BLOCK_WINDOWS, CACHED_WINDOWS, ORDERED_SLACK, \
    docs_per_run, docs_per_window, ordered_packing, packing_name
from tokenmill.load.sampler import epoch_permutation, hash_ints

__all__ = ["PackedPlan", "WindowRows", "epoch_layout"]

SAMPLES = 4  # windows of epoch 0 packed to set β
MARGIN = 0.0  # β: rows above the largest of the samples' needs, per row they needed
MARGIN_CAPPED = 0.005  # under max_segments a window short of rows may not be mendable by cuts
Z_CAPPED = 4.0  # under max_segments: standard deviations of the sampled windows' needs added to
# β (a window's need is a sum over thousands of documents, near normal: 4 σ leaves ~3e-5 of
# windows short of the β their sample implies)
_TAG = 0x73747261  # "stra"


# ---- the plan ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class WindowRows:
    """One window's rows: a ``pack.PackedLayout`` (global token offsets, store document ids) and
    where its rows start in the epoch."""

    layout: pack.PackedLayout
    first_row: int
    order: np.ndarray  # the shuffle of the window's rows: epoch row first_row + i is row order[i]
    num_cut: int  # documents cut across rows that packing the window naturally kept whole


class PackedPlan:
    """The lazily packed rows of one store for (seq_len, max_segments, seed, salt): row j of
    epoch e is ``window_rows(e, w)``'s row ``j - first_row`` (shuffled), for the w holding j."""

    def __init__(self, store, *, seq_len: int, max_segments: int | None, seed: int, salt: int):
        self.store, self.seq_len, self.cap = store, seq_len, max_segments
        self.seed, self.salt = seed, salt
        self.capacity = seq_len + 1
        d, t = len(store), store.num_tokens
        if d == 0 or t < 2:
            raise ConfigError(f"{store.path}: no documents to pack (documents {d}, tokens {t})")
        self.num_docs, self.num_tokens = d, t
        self.k = docs_per_window(d, t, seq_len)
        self.block = max(1, min(BLOCK_WINDOWS, BLOCK_DOCS // self.k))  # windows read at once
        self._lock: threading.RLock  # these three made by after_fork: now, and in a forked child
        self._pending: dict[tuple[int, int], Future]
        self._ahead_busy: bool
        packahead.track(self)
        self.counts = {"windows_packed": 0, "documents_packed": 0, "documents_cut": 0,
                       "num_truncated": 0, "most_segments": 0}
        ordered = ordered_packing(d, t, seq_len, max_segments)
        self._strata(docs_per_run(d, t, seq_len) if ordered else 1)
        self.ordered = ordered and self._order_fits()
        if ordered and not self.ordered:  # best fit reorders a window anyway: strata of documents
            self._strata(1)
        self.packing = packing_name(max_segments, self.ordered)
        self.beta = self.calibrate()
        self.num_rows = self.allotted(0, self.windows, self.num_tokens)

    def _strata(self, run: int) -> None:
        """Strata of runs of ``run`` documents (the last run shorter), and empty caches."""
        self.run = run
        units = -(-self.num_docs // run)
        self.strata = max(1, min(units, round(self.k / run)))  # K: runs a window
        self.bounds = np.arange(self.strata + 1, dtype=np.int64) * units // self.strata
        self.sizes = np.diff(self.bounds)  # M_i: 1 <= M_i, all within one of each other
        self.windows = int(self.sizes.max())  # W: window w holds stratum i's run iff M_i > w
        self.merged = self.windows >= 2 and int(self.sizes.min()) < self.windows
        self._epochs: OrderedDict[int, tuple] = OrderedDict()
        self._cache: OrderedDict[tuple[int, int], WindowRows] = OrderedDict()
        self._blocks: OrderedDict[tuple[int, int], list] = OrderedDict()
        self._prefix: dict[tuple[int, int], int] = {}
        self._probes, self._natural = {}, {}  # epochs' probes; samples' rows (calibrating)
        self._counted: OrderedDict[int, bytearray] = OrderedDict()  # epoch → window marks
        self._last: tuple | None = None  # (first draw, end draw, WindowRows) of the last window

    def _first_doc(self, units: np.ndarray) -> np.ndarray:
        """The first document of each run (the number of documents for the end)."""
        return units if self.run == 1 else np.minimum(units * self.run, self.num_docs)

    # -- the allotment: G(w) = ⌊(P_w + β·w) / L⌋, β in tokens ---------------------------------

    def allotted(self, epoch: int, w: int, prefix: int | None = None) -> int:
        """G(w): rows of the epoch before window w."""
        p = self.prefix_tokens(epoch, w) if prefix is None else prefix
        return (p + self.beta * w) // self.seq_len

    def num_windows(self) -> int:
        """Windows an epoch is packed in (the last index joins the one before when short)."""
        return self.windows - 1 if self.merged else self.windows

    def _end(self, w: int) -> int:
        return self.windows if self.merged and w == self.windows - 2 else w + 1

    def _shift(self, epoch: int) -> np.ndarray:
        """The rotation of each stratum in ``epoch`` (a hash: no reading)."""
        with self._lock:
            hit = self._epochs.get(epoch)
            if hit is None:
                hit = self._epochs[epoch] = (hash_ints(
                    _TAG, self.seed, self.salt, epoch, np.arange(self.strata)) %
                    self.sizes.astype(np.uint64)).astype(np.int64)
                if len(self._epochs) > 4:
                    self._epochs.popitem(last=False)
            return hit

    def _firsts(self, epoch: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(global first token of each stratum's first document in ``epoch``, tokens of each
        stratum, global first token of each of ``ids``): what a probe of P_w starts from (read
        once per epoch, in the same pass as its first probe's ``ids``), and what it ends at."""
        key = ("firsts", epoch)
        with self._lock:
            hit = self._probes.get(key)
        if hit is not None:
            return (*hit, self.store.doc_spans(self._first_doc(ids))[0])
        shift, k = self._shift(epoch), self.strata
        starts = self.store.doc_spans(self._first_doc(np.concatenate(
            [self.bounds, self.bounds[:-1] + shift, ids])))[0]
        hit = (starts[k + 1:2 * k + 1], np.diff(starts[:k + 1]))
        with self._lock:
            if len(self._probes) >= 4:
                self._probes.clear()
            self._probes[key] = hit
        return (*hit, starts[2 * k + 1:])

    def prefix_tokens(self, epoch: int, w: int) -> int:
        """P_w: tokens of the documents of windows 0 … w-1 in ``epoch``: the P of w's block's
        first window (probed, one read a stratum, unless known) plus the windows of the block
        before w (read with the block, which packing w reads anyway)."""
        if w <= 0:
            return 0
        if w >= self.windows:
            return self.num_tokens
        key = (epoch, w)
        with self._lock:
            if key in self._prefix:
                return self._prefix[key]
        start = w // self.block * self.block
        with self._lock:  # a resume: P of windows of the block before may be known
            prev = next((x for x in range(w - 1, max(0, w - self.block) - 1, -1)
                         if (epoch, x) in self._prefix), None) if start == w else None
        if prev is not None:
            spans = [self._raw(epoch, x) for x in range(prev, w)]
            total = self.prefix_tokens(epoch, prev) + sum(t for *_, t in spans)
        elif start == w:
            total = self._probe(epoch, w)
        else:
            spans = [self._raw(epoch, x) for x in range(start, w)]
            total = self.prefix_tokens(epoch, start) + sum(t for *_, t in spans)
        with self._lock:
            self._remember(key, total)
        return total

    def _probe(self, epoch: int, w: int) -> int:
        """P_w read from the strata: each one's tokens before its w-th run this epoch."""
        q = self._shift(epoch) + np.minimum(w, self.sizes)
        wrap = q > self.sizes
        first, sizes, ends = self._firsts(
            epoch, self.bounds[:-1] + np.where(wrap, q - self.sizes, q))
        return int((ends - first).sum()) + int(sizes[wrap].sum())

    def _remember(self, key: tuple[int, int], total: int) -> None:
        if len(self._prefix) > 4096:
            self._prefix.clear()
        self._prefix[key] = total

    def window_of(self, epoch: int, j: np.ndarray) -> np.ndarray:
        """The window holding each row index ``j`` of ``epoch`` (one search per window met)."""
        order = stable_order(j)
        js, out = j[order], np.empty(len(j), np.int64)
        i = 0
        while i < len(js):
            w = self._search(epoch, int(js[i]))
            k = int(np.searchsorted(js, self.allotted(epoch, self._end(w)), side="left"))
            out[order[i:k]] = w
            i = k
        return out

    def _search(self, epoch: int, j: int) -> int:
        """The window w with G(w) <= j < G(end of w): from a guess (rows are spread nearly
        evenly over windows), galloping out to a bracket, then bisecting: a few G's, each one
        read a stratum."""
        n = self.num_windows()
        g = min(n - 1, j * self.windows // max(1, self.num_rows))
        lo, hi, step = g, g + 1, 1  # find lo with G(lo) <= j, hi with G(hi) > j (or hi = n)
        while lo > 0 and self.allotted(epoch, lo) > j:
            lo, hi, step = max(0, lo - step), lo, step * 2
        while hi < n and self.allotted(epoch, hi) <= j:
            lo, hi, step = hi, min(n, hi + step), step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.allotted(epoch, mid) <= j:
                lo = mid
            else:
                hi = mid
        return lo

    def window_docs(self, epoch: int, w: int) -> np.ndarray:
        """Document ids of window w in ``epoch``, one per stratum (two for a merged last)."""
        return np.concatenate([self._ids(epoch, x) for x in range(w, self._end(w))])

    def _ids(self, epoch: int, x: int) -> np.ndarray:
        """Document ids of raw window index x: stratum i's run (shift_i + x) mod M_i."""
        shift = self._shift(epoch)
        has = self.sizes > x
        units = self.bounds[:-1][has] + (shift[has] + x) % self.sizes[has]
        if self.run == 1:
            return units
        first = units * self.run
        return ranges(first, np.minimum(self.run, self.num_docs - first))

    def _spans(self, epoch: int, xs: list[int]) -> list[tuple]:
        """(ids, first tokens, lengths, tokens) of the documents of raw window indices ``xs``,
        read in one pass over the shards' indexes (each shard's index mapped once, however
        many); the windows' token counts from one running sum, not a numpy call a window."""
        fast = fastpath.window_ids(self.bounds, self._shift(epoch), xs, self.run, self.num_docs)
        if fast is None:
            ids = np.concatenate(parts := [self._ids(epoch, x) for x in xs])
            cut = np.cumsum([len(i) for i in parts])
        else:  # one compiled pass: a numpy call on these arrays hands the GIL about
            ids, cut = fast[0], fast[1][1:]
        starts, lengths = self.store.doc_spans(ids)
        csum = np.cumsum(lengths)
        upto = [0, *(int(csum[b - 1]) if b else 0 for b in cut)]  # tokens before each window
        return [(ids[a:b], starts[a:b], lengths[a:b], upto[i + 1] - upto[i])
                for i, (a, b) in enumerate(zip([0, *cut[:-1]], cut))]

    def _raw(self, epoch: int, x: int) -> tuple:
        """``_spans`` of one raw window index, read with the block of windows around it (the
        next windows' documents are each stratum's next ones: one pass serves many windows)."""
        b = x // self.block
        with self._lock:
            hit = self._blocks.get((epoch, b))
            if hit is None:
                xs = list(range(b * self.block, min((b + 1) * self.block, self.windows)))
                hit = self._blocks[(epoch, b)] = self._spans(epoch, xs)
                if len(self._blocks) > 2:
                    self._blocks.popitem(last=False)
            return hit[x - b * self.block]

    def window_rows(self, epoch: int, w: int) -> WindowRows:
        """Window w of ``epoch`` packed into its allotted rows (cached: the last few windows;
        a window packed by another thread meanwhile is waited for, not packed twice)."""
        key = (epoch, w)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = Future()
                mine = True
            else:
                mine = False
        if not mine:
            return pending.result()
        try:
            hit = self._packed_window(epoch, w)
        except BaseException as e:
            with self._lock:
                del self._pending[key]
            pending.set_exception(e)
            raise
        with self._lock:
            self._cache[key] = hit
            if len(self._cache) > CACHED_WINDOWS:
                self._cache.popitem(last=False)
            del self._pending[key]
        pending.set_result(hit)
        return hit

    def _packed_window(self, epoch: int, w: int) -> WindowRows:
        end = self._end(w)
        parts = [self._raw(epoch, x) for x in range(w, end)]
        # numpy calls on a window's arrays each let the training loop's thread take the GIL
        # and wait to hand it back: as few as can be (no copy of a window of one part)
        docs, starts, lengths = parts[0][:3] if len(parts) == 1 else \
            (np.concatenate(a) for a in list(zip(*parts))[:3])
        p0 = self.prefix_tokens(epoch, w)
        if end < self.windows:
            with self._lock:
                self._remember((epoch, end), p0 + sum(part[3] for part in parts))
        first, last = self.allotted(epoch, w, p0), self.allotted(epoch, end)
        shuffle = epoch_permutation(max(1, last - first), seed=self.seed, epoch=epoch,
                                    salt=int(hash_ints(_TAG, self.salt, w)))
        try:
            layout, num_cut, order = self.pack(docs, starts, lengths, last - first, shuffle)
        except ConfigError as e:  # only under max_segments: say where
            raise ConfigError(f"{self.store.path}: window {w} of epoch {epoch}: {e}") from None
        with self._lock:
            if self._first_time(epoch, w):  # counted once, however often it is packed
                for name, n in (("windows_packed", 1), ("documents_packed", len(docs)),
                                ("documents_cut", num_cut),
                                ("num_truncated", layout.num_truncated)):
                    self.counts[name] += n
                self.counts["most_segments"] = max(self.counts["most_segments"],
                                                   layout.most_segments)
        return WindowRows(layout, first, order, num_cut)

    def _first_time(self, epoch: int, w: int) -> bool:
        """Whether window w of ``epoch`` is packed here for the first time (a mark per window of
        the last two epochs: bounded, however long the run)."""
        marks = self._counted.get(epoch)
        if marks is None:
            marks = self._counted[epoch] = bytearray(self.windows)
            if len(self._counted) > 2:
                self._counted.popitem(last=False)
        first, marks[w] = not marks[w], 1
        return first

    def _ahead(self, epoch: int, w: int) -> None:
        """Pack the window after w on the pack-ahead thread (``packahead``), so that a loader
        reaching it finds it packed (a window is ~4,096 rows: packing it inline stalls one
        batch in ~500)."""
        nxt = (epoch, w + 1) if w + 1 < self.num_windows() else (epoch + 1, 0)
        with self._lock:
            if nxt in self._cache or nxt in self._pending or self._ahead_busy:
                return
            self._ahead_busy = True
        packahead.submit(lambda: self._pack_ahead(nxt))

    def _pack_ahead(self, key: tuple[int, int]) -> None:
        with suppress(BaseException):  # the loader meets it itself, in its thread
            self.window_rows(*key)
        self._ahead_busy = False

    def after_fork(self) -> None:
        """In a forked child (``packahead``): forget the windows the parent's other threads were
        packing (pending, or holding the lock): packed again here when asked for."""
        self._lock, self._pending, self._ahead_busy = threading.RLock(), {}, False

    def pack(self, docs: np.ndarray, starts: np.ndarray, lengths: np.ndarray, rows: int,
             shuffle) -> tuple[pack.PackedLayout, int, np.ndarray]:
        """Documents (ids, global first tokens, lengths) packed into exactly ``rows`` rows, the
        documents cut, and the rows' order: ``shuffle`` (a Permutation) of range(rows)."""
        fast = fastpath.pack_window(lengths, starts, docs, self.seq_len, rows, self.cap,
                                    ordered=self.ordered, order=shuffle)
        if fast is not None:  # compiled, the GIL released: the same arrays as below
            row_ptr, seg_start, seg_len, seg_doc, num_cut, truncated, dropped, order = fast
        else:
            truncated, dropped = pack.truncation(lengths, self.seq_len)
            doc, off, length = pack.pieces(lengths, self.seq_len)
            item, seg_off, seg_len, row_ptr, num_cut = fit_rows(length, self.capacity, rows,
                                                                self.cap, self.ordered)
            seg_start, seg_doc = starts[doc[item]] + off[item] + seg_off, docs[doc[item]]
            order = shuffle(np.arange(rows))  # one Feistel pass a window, not one a batch
        layout = pack.PackedLayout(
            seq_len=self.seq_len, row_ptr=row_ptr, seg_start=seg_start, seg_len=seg_len,
            seg_doc=seg_doc, num_truncated=truncated, num_dropped_tokens=dropped,
            max_segments=self.cap)
        return layout, num_cut, order

    def calibrate(self) -> int:
        """β, in tokens: at least L (then a window is allotted more than (T - 1) / L rows, which
        always hold its documents cut as a stream, ``_stream``), and enough for the first
        SAMPLES windows of epoch 0 (one read of the indexes, which the first batch reads anyway)
        to pack naturally. Under max_segments no stream cut can mend a window short of rows, so
        more windows are sampled and β adds Z_CAPPED standard deviations of what they needed."""
        samples = self._samples()
        needs = [self._beta_needed(w) for w in samples]
        beta = max(self.seq_len, max(needs))
        whole = [n for n, w in zip(needs, samples) if self._end(w) == w + 1]  # not a merged last
        if self.cap is not None and len(whole) > 1:
            beta += int(np.ceil(Z_CAPPED * np.std(whole)))
        return beta

    def _samples(self) -> list[int]:
        """The windows of epoch 0 that set β: the first SAMPLES, and under max_segments every
        window of the first block (``_raw`` reads them in the same pass: no more reads)."""
        n = self.num_windows()
        return list(range(min(n, SAMPLES if self.cap is None else max(SAMPLES, self.block))))

    def _natural_rows(self, w: int, ordered: bool) -> tuple[int, int]:
        """(rows window w of epoch 0 packs into naturally, its tokens), packed once each way."""
        if (w, ordered) not in self._natural:
            lengths = np.concatenate([self._raw(0, x)[2] for x in range(w, self._end(w))])
            length = pack.pieces(lengths, self.seq_len)[2]
            rows = len(pack.place(length, self.capacity, self.cap, ordered)[1])
            self._natural[(w, ordered)] = rows, int(lengths.sum())
        return self._natural[(w, ordered)]

    def _order_fits(self) -> bool:
        """Whether packing in order fills the sample windows within ORDERED_SLACK of best-fit
        decreasing (lengths in runs, or long documents among tiny ones, leave gaps: it does not)."""
        rows = [sum(self._natural_rows(w, o)[0] for w in self._samples()) for o in (True, False)]
        return rows[0] <= rows[1] * (1 + ORDERED_SLACK)

    def _beta_needed(self, w: int) -> int:
        """Tokens of β that window w of epoch 0 needs to pack naturally, per raw window it
        spans (the margin of MARGIN / MARGIN_CAPPED of its rows added)."""
        rows, tokens = self._natural_rows(w, self.ordered)
        rows += int(np.ceil(rows * (MARGIN_CAPPED if self.cap else MARGIN)))
        need = rows * self.seq_len - tokens  # floor((T + β·k) / L) >= rows
        return -(-need // (self._end(w) - w))

    # -- rows of draws ------------------------------------------------------------------------

    def locate(self, draws: np.ndarray, run: bool = False
               ) -> list[tuple[WindowRows, np.ndarray, np.ndarray]]:
        """Draws (the store's samples 0, 1, 2, …) → per window touched: (its rows, the indices
        into ``draws`` it serves, their row ids in its layout; read-only). ``run``: the caller
        knows the draws are consecutive."""
        draws = np.asarray(draws, np.int64)
        last = self._last  # the window of the previous call: a batch usually stays in it
        if last is not None and draws.size:  # a rank's batch, a run: bounded by its ends
            run = run or is_run(draws)
            lo, hi = (int(draws[0]), int(draws[-1])) if run else (draws.min(), draws.max())
            if last[0] <= lo and hi < last[1]:
                order, at = last[2].order, lo - last[0]
                return [(last[2], counting(0, len(draws)),
                         order[at:at + len(draws)] if run else order[draws - last[0]])]
        epochs, j = np.divmod(draws, self.num_rows)
        out = []
        for e in distinct(epochs):
            sel = np.flatnonzero(epochs == e)
            wins = self.window_of(e, j[sel])
            for w in distinct(wins):
                mine = sel[wins == w]
                rows = self.window_rows(e, w)
                out.append((rows, mine, rows.order[j[mine] - rows.first_row]))
                first = e * self.num_rows + rows.first_row
                self._last = (first, first + len(rows.order), rows)
        if out:  # the window after the last one read (one thread, not one per window read)
            self._ahead(e, w)
        return out

    def stats(self) -> dict:
        """What the allotment implies for an epoch (rows, an upper bound on padding), and the
        counts over the windows this plan has packed."""
        used = self.num_tokens  # pieces of long documents and cuts add a token each: ≤ this
        with self._lock:
            counts = dict(self.counts)
        return {"rows": self.num_rows, "packing": self.packing,
                "documents_per_window": self.strata * self.run, "documents_per_run": self.run,
                "windows": self.num_windows(), "beta_rows": self.beta / self.seq_len,
                "padding_at_most": 1 - used / (self.num_rows * self.capacity), **counts}


def epoch_layout(plan: PackedPlan, epoch: int) -> pack.PackedLayout:
    """Every row of ``epoch`` in order, as one layout: O(documents) — for inspect, tests and
    benchmarks, never for loading."""
    parts = [plan.window_rows(epoch, w) for w in range(plan.num_windows())]
    seg_ids, counts, base = [], [], 0
    for part in parts:
        lay = part.layout
        rows = part.order
        n = np.diff(lay.row_ptr)[rows]
        seg_ids.append(ranges(lay.row_ptr[rows], n) + base)
        counts.append(n)
        base += len(lay.seg_len)
    seg = np.concatenate(seg_ids)
    cat = {k: np.concatenate([getattr(p.layout, k) for p in parts])[seg]
           for k in ("seg_start", "seg_len", "seg_doc")}
    row_ptr = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)
    return pack.PackedLayout(
        seq_len=plan.seq_len, row_ptr=row_ptr, **cat, max_segments=plan.cap,
        num_truncated=sum(p.layout.num_truncated for p in parts),
        num_dropped_tokens=sum(p.layout.num_dropped_tokens for p in parts))
