"""The batch plan: global sample positions → filled batch rows, a pure function of its inputs.

Batch k of rank r is a function of (store fingerprints, layout config, seed, k, rank, world_size)
alone. The global batch starting at sample ``consumed`` holds global positions
[consumed, consumed + B·W); rank r takes its B of them (``sampler.batch_positions``), a mixture
schedule sends each position to a store (``sampler.assign``), and the store's epoch permutation
picks the sample (``sampler.sample_ids``)::

    plan = BatchPlan.open("store/", LayoutConfig(seq_len=2048))
    batch = batch_at(plan, consumed, batch_size=8, rank=0, world_size=1)   # dict of arrays

Nothing here keeps state that changes the output: the Loader (state, prefetch, workers) and the
streaming loader's later epochs both call ``batch_at``; a worker process rebuilds the same plan
from its ``PlanSpec`` and proves it reads the stores the parent opened (``StoreIdentity``).
"""

from __future__ import annotations

import json
import operator
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple

import numpy as np
import xxhash

from tokenmill.load import pack, sampler
from tokenmill.base.arrays import as_rows, by_value, distinct, is_run
from tokenmill.base.errors import ConfigError, StoreError, check_int
from tokenmill.base.io import FileId, file_id, redact
from tokenmill.load.mixture import Mixture, mixture_of
from tokenmill.load.packing import plans_packing
from tokenmill.load.packplan import PackedPlan
from tokenmill.load.rows import RowFiller, as_slice
from tokenmill.load.state import MAX_CONSUMED
from tokenmill.store.format import MANIFEST, read_manifest
from tokenmill.store.reader import TokenStore

__all__ = [
    "BatchPlan", "LAYOUTS", "LayoutConfig", "PlanSpec", "SampleSource", "StoreIdentity",
    "batch_arrays", "batch_at", "check_identity", "check_tokenizers", "fingerprint_of",
    "global_positions", "identity_of", "open_sources", "plan_from_spec", "resolve_rank",
]

LAYOUTS = ("concat", "packed")
WATCH_INTERVAL_S = 0.05  # how often BatchPlan.check_stores looks at the manifests (one stat each)


@dataclass(frozen=True)
class LayoutConfig:
    """What decides the content of the sample stream (and so goes into the fingerprint)."""

    seq_len: int
    layout: str = "concat"
    seed: int = 0
    max_segments: int | None = None  # packed: at most this many documents (segments) a row
    document_masks: bool = False  # concat: segment_ids, positions, loss_mask by document

    def __post_init__(self):  # frozen: the ints are made plain ints once, here
        object.__setattr__(self, "seq_len", check_int("seq_len", self.seq_len, minimum=1))
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {LAYOUTS} (got layout={self.layout!r})")
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0,
                                                   maximum=sampler.MAX_SEED))
        object.__setattr__(self, "max_segments", check_int(
            "max_segments", self.max_segments, minimum=1, optional=True))
        if not isinstance(self.document_masks, (bool, np.bool_)) or \
                self.document_masks and self.layout != "concat":
            raise ConfigError(f"document_masks=True or False, for layout='concat' (got document_"
                              f"masks={self.document_masks!r}, layout={self.layout!r}); packed "
                              "rows always carry segment_ids, positions and loss_mask")
        object.__setattr__(self, "document_masks", bool(self.document_masks))
        if self.max_segments is not None and self.layout != "packed" and not self.document_masks:
            raise ConfigError(f"max_segments needs layout='packed' or document_masks=True (got "
                              f"max_segments={self.max_segments!r}, layout={self.layout!r})")


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size: as given, else torch.distributed's if initialised, else RANK/WORLD_SIZE."""
    if rank is None or world_size is None:
        dist = sys.modules.get("torch.distributed")  # never import torch ourselves
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"need 0 <= rank < world_size (got rank={rank}, world_size={world_size})")
    return rank, world_size


def global_positions(consumed: int, *, batch_size: int, rank: int, world_size: int) -> np.ndarray:
    """Rank's global sample positions of the global batch that starts at sample ``consumed``.

    global_positions(8, batch_size=2, rank=1, world_size=3).tolist() == [10, 11]; a batch past
    int64 is a ConfigError, so a loader never saves a state it could not load.
    """
    if consumed + batch_size * world_size > MAX_CONSUMED:
        raise ConfigError(f"this batch would take consumed_samples past 2**63-1 (got consumed_"
                          f"samples={consumed}, batch_size={batch_size}, world_size={world_size}):"
                          " the loader has reached the end of its range")
    return sampler.batch_positions(0, batch_size=batch_size, rank=rank, world_size=world_size,
                                   start=consumed)


# ---- one store seen through a layout ------------------------------------------------------------

class SampleSource:
    """One store seen through a layout: how many samples an epoch has and how to fill rows.

    An address is where a draw's sample lives: the first token of a concat window, or for
    packed rows the draw itself (``packplan.PackedPlan`` finds its window and row)."""

    def __init__(self, store: TokenStore, config: LayoutConfig, salt: int):
        self.store, self.config, self.salt = store, config, salt
        L = config.seq_len
        if config.layout == "concat":
            if store.num_tokens < 2 * L:
                raise ConfigError(f"{redact(str(store.path))}: {store.num_tokens:,} tokens is too "
                                  f"few for seq_len={L} (need at least {2 * L:,})")
            self.num_samples = pack.concat_num_samples(store.num_tokens, L)
            self.packed = None
        else:
            self.packed = PackedPlan(store, seq_len=L, max_segments=config.max_segments,
                                     seed=config.seed, salt=salt)
            self.num_samples = self.packed.num_rows
        self.rows = RowFiller(store, store.shard_token_starts, seq_len=L, dtype=store.dtype)

    def addresses(self, draws: np.ndarray) -> np.ndarray:
        """Where this store's draws number ``draws`` (0, 1, 2, …) live: the first token of a
        concat window, or (packed) the draw itself."""
        if self.packed is not None:
            return np.asarray(draws, dtype=np.int64)
        ids = sampler.sample_ids(draws, n=self.num_samples, seed=self.config.seed, salt=self.salt)
        epochs = sampler.epoch_of(draws, self.num_samples)
        out = np.empty_like(ids)
        for e in distinct(epochs):  # the window offset moves with the epoch
            sel = epochs == e
            offset = pack.concat_offset(self.config.seq_len, seed=self.config.seed, epoch=e)
            out[sel] = pack.concat_starts(ids[sel], seq_len=self.config.seq_len, offset=offset)
        return out

    def row_starts(self, addrs: np.ndarray) -> list[int] | None:
        """Per address, the global token its concat window starts at; None for packed rows
        (found when filled: a block of addresses would otherwise pack every window it touches
        at once, on the training loop's thread, before a pack-ahead thread could)."""
        return addrs.tolist() if self.packed is None else None

    def fill(self, addrs: np.ndarray, rows: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Write the samples at ``addrs`` into rows ``rows`` (ascending) of the batch ``out``."""
        self.fill_at(addrs, self.row_starts(addrs), as_slice(rows), out)

    def fill_at(self, addrs: np.ndarray, starts: list[int] | None, dest: slice | np.ndarray,
                out: dict[str, np.ndarray], run: bool = False) -> None:
        """``fill`` with the addresses' ``row_starts`` known, into batch rows ``dest`` (``run``:
        the addresses are consecutive draws)."""
        if self.packed is None:
            self.rows.windows(starts, dest, out)
            if self.config.document_masks:
                pack.fill_window_metadata(self.store, starts, self.config.seq_len, out, dest,
                                          self.config.max_segments)
            return
        groups = self.packed.locate(addrs, run)
        for window, which, local in groups:  # usually one window: no index array made
            mine = dest if len(groups) == 1 else as_slice(as_rows(dest)[which])
            if not self.rows.packed(window.layout, local, mine, out):  # many segments
                pack.fill_packed_rows(window.layout, local, self.store.tokens, out,
                                      as_rows(mine), gather=self.rows.gather)


def open_sources(source, config: LayoutConfig, mixture=None) -> tuple[list[SampleSource], Mixture]:
    """The sample sources and Mixture of a store (path, URL, TokenStore), a {store: weight}
    mixture or named stores with a ``mixture`` schedule (``mixture.mixture_of``); refuses bad
    weights and phases, and stores of different tokenizers."""
    mix, items = mixture_of(source, mixture)
    stores, opened = [], []
    try:
        for s in items:
            stores.append(s if isinstance(s, TokenStore) else TokenStore(s))
            if stores[-1] is not s:
                opened.append(stores[-1])
        check_tokenizers(stores)
        sources = [SampleSource(st, config, salt=i) for i, st in enumerate(stores)]
    except BaseException:
        for st in opened:  # refused: leave no store of ours open
            st.close()
        raise
    return sources, mix


def _token_identity(tokenizer: dict) -> dict:
    """What makes two tokenizers give the same ids: all of the identity but its display name."""
    return {k: v for k, v in tokenizer.items() if k != "name"}


def check_tokenizers(stores: list[TokenStore]) -> None:
    """Refuse a mixture of stores whose tokens come from different tokenizers (naming both)."""
    first = stores[0]
    for other in stores[1:]:
        if _token_identity(other.tokenizer) != _token_identity(first.tokenizer):
            raise ConfigError(
                f"cannot mix stores made with different tokenizers: {redact(str(first.path))} "
                f"has {json.dumps(first.tokenizer, sort_keys=True)}, {redact(str(other.path))} "
                f"has {json.dumps(other.tokenizer, sort_keys=True)}; their token ids mean "
                "different things — prepare every store of a mixture with the same tokenizer")


def fingerprint_of(sources: list[SampleSource], mix: Mixture, config: LayoutConfig) -> str:
    """Hash of everything the sample stream depends on, except batch size and world size; for
    named stores with a schedule, the names instead of the weights (phases are compared apart:
    future phases may change)."""
    if mix.named:
        stores = [(n, s.store.fingerprint) for n, s in zip(mix.names, sources)]
    else:
        stores = [(s.store.fingerprint, w) for s, w in zip(sources, mix.weights)]
    core = {"stores": stores, "seq_len": config.seq_len, "layout": config.layout,
            "seed": config.seed, **({"mixture": "phases"} if mix.named else {})}
    # absent when unset, so earlier fingerprints stay valid; a concat cap changes no batch
    if config.max_segments is not None and config.layout == "packed":
        core["max_segments"] = config.max_segments
    if config.document_masks:
        core["document_masks"] = True
    if config.layout == "packed":  # rows packed window by window: not the earlier whole-store rows
        core["packing"] = plans_packing([s.packed for s in sources])
    return xxhash.xxh3_64_hexdigest(json.dumps(core, sort_keys=True).encode())


# ---- proving a store is the one that was opened -------------------------------------------------

class StoreIdentity(NamedTuple):
    """Which store was opened: its fingerprint, and (local stores) its manifest file's
    ``FileId`` (device, inode, size, mtime): a cheap detector of a store re-prepared since."""

    where: str
    fingerprint: str
    manifest: FileId | None


def _manifest_stat(store: TokenStore) -> FileId | None:
    if store.url is not None:
        return None  # remote: shards come through a checksum-verified cache
    try:
        st = os.stat(Path(store.path) / MANIFEST)
    except OSError as e:
        raise StoreError(f"{redact(str(store.path))}/{MANIFEST}: {e.strerror}; the store was "
                         "deleted, or re-prepared or replaced underneath this loader — open a new "
                         "Loader once it is complete") from None
    return file_id(st)


def identity_of(store: TokenStore) -> StoreIdentity:
    """The identity of an open store (one stat of its manifest)."""
    return StoreIdentity(redact(str(store.path)), store.fingerprint, _manifest_stat(store))


def _changed(where: str, was: str, now: str) -> StoreError:
    return StoreError(f"{where}: the store changed since it was opened (fingerprint {now}, was "
                      f"{was}): it was re-prepared or replaced underneath this loader, and its "
                      "batches would no longer match the state's fingerprint — open a new Loader "
                      "(a state saved from the old store does not resume on the new one)")


def check_identity(store: TokenStore, want: StoreIdentity) -> StoreIdentity:
    """``want`` if ``store`` is still what it names, else StoreError; a manifest rewritten with
    the same fingerprint (the same tokens) passes, and its new identity is returned."""
    if store.fingerprint != want.fingerprint:
        raise _changed(want.where, want.fingerprint, store.fingerprint)
    stat = _manifest_stat(store)
    if stat == want.manifest:
        return want
    try:
        now = read_manifest(Path(store.path))["fingerprint"]
    except StoreError as e:
        raise StoreError(f"{e}; the store was re-prepared or replaced underneath this loader") \
            from None
    if now != want.fingerprint:
        raise _changed(want.where, want.fingerprint, now)
    return want._replace(manifest=stat)


@dataclass(frozen=True)
class PlanSpec:
    """What a worker process rebuilds the same BatchPlan from (small; pickled once per worker)."""

    stores: tuple[dict, ...]  # TokenStore open arguments (path or URL, cache, options)
    mixture: Mixture
    config: LayoutConfig
    dtype: str
    identities: tuple[StoreIdentity, ...]


def plan_from_spec(spec: PlanSpec) -> BatchPlan:
    """Reopen the stores of ``spec`` and build its plan; StoreError if a store is not the one the
    parent opened (re-prepared or replaced since)."""
    stores = [TokenStore(**args) for args in spec.stores]
    try:
        for store, want in zip(stores, spec.identities):
            check_identity(store, want)
        sources = [SampleSource(st, spec.config, salt=i) for i, st in enumerate(stores)]
    except BaseException:
        for st in stores:
            st.close()
        raise
    return BatchPlan(sources, spec.mixture, np.dtype(spec.dtype), closes=tuple(stores))


# ---- the plan -----------------------------------------------------------------------------------

def batch_arrays(batch_size: int, seq_len: int, dtype, masks: bool) -> dict[str, np.ndarray]:
    """Empty arrays of one batch: inputs/targets of ``dtype``, and with document masks (packed
    rows, concat with document_masks) segment_ids, positions (int32) and loss_mask (uint8)."""
    shape = (batch_size, seq_len)
    out = {"inputs": np.empty(shape, dtype), "targets": np.empty(shape, dtype)}
    if masks:
        out.update(segment_ids=np.empty(shape, np.int32), positions=np.empty(shape, np.int32),
                   loss_mask=np.empty(shape, np.uint8))
    return out


class BatchPlan:
    """Pure mapping from global sample positions to filled batch rows (no state but a cache)."""

    BLOCK = 4096  # positions resolved by one vectorized call (at most an epoch's: see __init__)

    def __init__(self, sources: list[SampleSource], mix: Mixture | list[float], dtype: np.dtype,
                 *, closes: tuple = ()):
        if not isinstance(mix, Mixture):  # plain weights, one per source
            mix = Mixture(tuple(redact(str(s.store.path)) for s in sources),
                          ((0, tuple(float(w) for w in mix)),), False)
        self.sources, self.mixture, self.weights = sources, mix, list(mix.weights)
        self.schedule = sampler.phased_schedule(mix.phases) if len(sources) > 1 else None
        self.dtype = np.dtype(dtype)
        self.packed = sources[0].packed is not None
        self.config = sources[0].config
        self.seq_len = self.config.seq_len
        self.fingerprint = fingerprint_of(sources, mix, self.config)
        self.samples_per_epoch = sum(s.num_samples for s in sources)
        self.BLOCK = min(self.BLOCK, self.samples_per_epoch)  # at most an epoch: long rows
        self.identities = [identity_of(s.store) for s in sources]
        self._closes = list(closes)  # the stores this plan opened itself
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray, list[int] | None]] = {}
        self._last: tuple = (-1, None)  # the block used last: (b, its _blocks entry)
        self._dest: dict[int, slice] = {}  # slice(0, n) per batch size
        self._lock = threading.Lock()
        self._watched = time.monotonic()

    @classmethod
    def open(cls, source, config: LayoutConfig, *, dtype: str = "int32", mixture=None) -> BatchPlan:
        """The plan of a store (path, URL, TokenStore), a {store: weight} mixture or named
        stores with a ``mixture`` schedule; the stores it opens itself are closed by ``close()``."""
        if np.dtype(dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise ConfigError(f"dtype must be 'int32' or 'int64' (got dtype={dtype!r})")
        sources, mix = open_sources(source, config, mixture)
        items = [*source, *source.values()] if isinstance(source, Mapping) else [source]
        given = {id(s) for s in items if isinstance(s, TokenStore)}
        return cls(sources, mix, np.dtype(dtype),
                   closes=tuple(s.store for s in sources if id(s.store) not in given))

    def spec(self) -> PlanSpec:
        """What a worker process rebuilds this plan from (``plan_from_spec``)."""
        return PlanSpec(stores=tuple(s.store.open_args() for s in self.sources),
                        mixture=self.mixture, config=self.config, dtype=self.dtype.name,
                        identities=tuple(self.identities))

    def new_buffers(self, batch_size: int) -> dict[str, np.ndarray]:
        """Freshly allocated arrays for one batch."""
        return batch_arrays(batch_size, self.seq_len, self.dtype,
                            self.packed or self.config.document_masks)

    def resolve(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(store id, address) of every global sample position."""
        first, last = int(positions[0]), int(positions[-1])
        b = first // self.BLOCK
        if last // self.BLOCK == b and is_run(positions):  # the usual case
            sid, addr, _ = self._block(b)
            lo = first - b * self.BLOCK
            return sid[lo:lo + len(positions)], addr[lo:lo + len(positions)]
        out = np.empty((2, len(positions)), np.int64)  # any order, e.g. a balanced rank's
        for b, at in by_value(positions // self.BLOCK):
            out[0, at], out[1, at] = (x[positions[at] - b * self.BLOCK] for x in self._block(b)[:2])
        return out[0], out[1]

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray, list[int] | None]:
        """Store ids, addresses and (one store) row starts of the positions of block ``b``."""
        last = self._last  # one tuple, read at once: no lock needed for the usual hit
        if last[0] == b:
            return last[1]
        with self._lock:
            hit = self._blocks.get(b)
        if hit is None:
            hit = self._new_block(b)
        self._last = (b, hit)
        return hit

    def _new_block(self, b: int) -> tuple[np.ndarray, np.ndarray, list[int] | None]:
        pos = np.arange(b * self.BLOCK, (b + 1) * self.BLOCK, dtype=np.int64)
        if self.schedule is None:
            sid, draws = np.zeros(len(pos), np.int64), pos
        else:
            sid, draws = sampler.assign_phased(self.schedule, pos)
        addr = np.empty(len(pos), np.int64)
        for s in distinct(sid):
            sel = sid == s
            addr[sel] = self.sources[s].addresses(draws[sel])
        # one store: where each row's tokens start, as Python ints (batches slice this list)
        starts = self.sources[0].row_starts(addr) if self.schedule is None else None
        hit = (sid, addr, starts)
        with self._lock:
            if len(self._blocks) >= 8:  # a few blocks cover prefetch across a block boundary
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[b] = hit
        return hit

    def fill(self, positions: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Fill ``out`` with the samples at global ``positions`` (one per row)."""
        n, first = len(positions), int(positions[0])
        b = first // self.BLOCK
        if self.schedule is None and (first + n - 1) // self.BLOCK == b and \
                is_run(positions):  # a rank's batch: the usual case
            _, addr, starts = self._block(b)
            lo = first - b * self.BLOCK
            dest = self._dest.get(n)
            if dest is None:
                dest = self._dest[n] = slice(0, n)
            part = None if starts is None else starts[lo:lo + n]  # packed: found when filled
            self.sources[0].fill_at(addr[lo:lo + n], part, dest, out, run=True)
            return
        self.fill_resolved(self.resolve(positions), out)

    def fill_resolved(self, resolved: tuple[np.ndarray, np.ndarray], out: dict) -> None:
        """Fill ``out`` with the samples at the (store id, address) pairs ``resolve`` gave."""
        sid, addr = resolved
        if self.schedule is None:
            self.sources[0].fill(addr, np.arange(len(addr)), out)
            return
        for s in distinct(sid):
            rows = np.flatnonzero(sid == s)
            self.sources[s].fill(addr[rows], rows, out)

    def check_stores(self, *, every: float = WATCH_INTERVAL_S) -> None:
        """Raise the StoreError of a store that failed a background checksum, or (looked at
        once per ``every`` seconds) was re-prepared or replaced since this plan opened it."""
        for s in self.sources:
            s.store.check()
        now = time.monotonic()
        if now - self._watched < every:
            return
        self._watched = now
        for i, s in enumerate(self.sources):
            self.identities[i] = check_identity(s.store, self.identities[i])

    def close(self) -> None:
        """Close the stores this plan opened itself; idempotent."""
        closes, self._closes = self._closes, []
        for store in closes:
            store.close()
        self._blocks, self._last = {}, (-1, None)


def batch_at(plan: BatchPlan, consumed: int, *, batch_size: int, rank: int = 0,
             world_size: int = 1, out: dict[str, np.ndarray] | None = None) -> dict:
    """Rank's batch of the global batch starting at sample ``consumed``: a pure function.

    batch_at(plan, 0, batch_size=8)["inputs"].shape == (8, plan.seq_len)
    """
    out = plan.new_buffers(operator.index(batch_size)) if out is None else out
    plan.fill(global_positions(consumed, batch_size=batch_size, rank=rank,
                               world_size=world_size), out)
    return out
