"""Reading a store: ``TokenStore``, a read-only, memory-mapped view of its documents and tokens,
local or remote (shards of a remote store are read through the local cache).

Opening reads the manifest (its totals checked against its shards) and checks each shard file's
size (a ``stat``, no descriptor kept; the file's identity — device, inode, size, mtime — is
remembered; a remote store: the manifest alone, one GET, and a shard's ``.idx`` is fetched when the
shard is first read); shards are mapped when first read, and at most ``max_open`` files (default a
sixteenth of the descriptor limit, 32–1,024) stay mapped, least recently used dropped first — a
store of 100,000 shards opens in well under a second and holds a bounded number of descriptors.
Every map (and re-map) first proves, by an ``fstat`` of the descriptor it maps, that the file is
the one seen at open: a store re-prepared underneath a reader fails with a StoreError instead of
serving other tokens. When a shard is first read, its ``.idx`` is checked against the manifest —
dtype, documents, tokens (where its last document ends), and the .bin's bytes for that many tokens:
a manifest that lies about a shard's counts is a StoreError naming the shard — and, unless
``verify="off"``, the xxh3 of its ``.bin`` and ``.idx`` is computed once per process in a
background thread: a mismatch fails the next read (and ``check()``), naming the file.
"""

from __future__ import annotations

import os
import threading
from array import array
from collections import OrderedDict
from concurrent.futures import Future
from functools import cached_property, partial
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from tokenmill.base.arrays import by_value
from tokenmill.base.errors import ConfigError, StoreError, check_int
from tokenmill.base.io import ChecksumWatch, file_id, is_url, map_file, redact
from tokenmill.base.procs import after_fork, default_max_open
from tokenmill.store.cache import CacheFullError, RemoteShards
from tokenmill.store.format import (MANIFEST, IdxArrays, check_offsets, read_idx,
                                    read_idx_entries, read_manifest, size_or_raise)

MAX_OPEN = default_max_open()  # shard files a store keeps mapped at once
VERIFY_MODES = ("background", "off")
VERIFY_HINT = ("; reading it would give other tokens than were prepared — run 'tokenmill "
               "verify', then 'tokenmill prepare' again")
DISAGREE = ("the shard and the manifest disagree (the manifest was edited or written by another "
            "tool, or the shard is damaged) — run 'tokenmill verify'")


def check_sizes(path: str | os.PathLike, manifest: dict) -> array:
    """Raise StoreError naming the first shard file whose size differs from the manifest; else
    the identity of every shard file: ``ids[2 * i]`` is ``hash(file_id(stat))`` of shard ``i``'s
    ``.bin``, ``ids[2 * i + 1]`` of its ``.idx`` (8 bytes a file, not a 200-byte tuple: 1.6 MB
    for 100,000 shards). One ``stat`` per file, ~2 µs: 0.4 s for 100,000 shards."""
    base = os.fspath(path)
    ids = array("q")
    for s in manifest["shards"]:
        for ext, key in ((".bin", "bin_bytes"), (".idx", "idx_bytes")):
            f = f"{base}/{s['name']}{ext}"
            try:
                st = os.stat(f)
            except FileNotFoundError:
                size_or_raise(Path(f))  # raises, naming the file
                st = os.stat(f)  # it came back meanwhile
            if st.st_size != s[key]:
                raise StoreError(f"{Path(f)}: expected {s[key]:,} bytes, found {st.st_size:,}; "
                                 "the shard is truncated or was replaced — run 'tokenmill "
                                 "verify', then 'tokenmill prepare' again")
            ids.append(hash(file_id(st)))  # a tuple of ints hashes the same in every run
    return ids


def check_options(verify: str, max_open: int) -> int:
    """``max_open`` as an int; ConfigError for a ``verify`` or ``max_open`` it does not take."""
    if verify not in VERIFY_MODES:
        raise ConfigError(f"verify must be one of {VERIFY_MODES} (got {verify=})")
    return check_int("max_open", max_open, minimum=2)


class TokenStore:
    """A read-only, memory-mapped view of a store: documents, token ranges, lengths.

    Token data is never read until asked for. ``path`` may be an fsspec URL
    (``TokenStore("s3://b/store")``): shards are then downloaded on first use into a local cache
    (``cache_dir``, default ``$TOKENMILL_CACHE_DIR`` or ``~/.cache/tokenmill``; at most
    ``cache_bytes``, default ``$TOKENMILL_CACHE_BYTES`` or 16 GiB), verified, and memory-mapped
    from there; see ``tokenmill.store.cache``. ``verify="background"`` (the default) checks each
    local shard's checksum once per process when it is first mapped; ``"off"`` skips that.
    ``close()`` drops every map (views handed out stay valid until released).
    """

    def __init__(self, path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                 cache_bytes: int | str | None = None, storage_options: dict | None = None,
                 verify: str = "background", max_open: int = MAX_OPEN):
        max_open = check_options(verify, max_open)
        self._remote: RemoteShards | None = None
        self._ids: array | None = None  # local: identities of the shard files seen at open
        if is_url(path):
            self.path = self.url = os.fspath(path).rstrip("/")
            self.manifest = read_manifest(self.url, storage_options=storage_options)
            self._remote = RemoteShards(self.url, self.manifest, cache_dir=cache_dir,
                                        cache_bytes=cache_bytes, storage_options=storage_options)
            self._open_args = {"path": self.url, "cache_dir": str(self._remote.cache.root),
                               "cache_bytes": self._remote.cache.max_bytes,
                               "storage_options": storage_options}
        else:
            self.path, self.url = Path(path), None
            self.manifest = read_manifest(self.path)
            self._ids = check_sizes(self.path, self.manifest)
            self._open_args = {"path": str(self.path)}
        self._open_args.update({"verify": verify, "max_open": max_open})
        self.verify, self.max_open = verify, max_open
        self.dtype = np.dtype(self.manifest["dtype"])
        shards = self.manifest["shards"]
        self.shard_doc_starts = np.cumsum([0] + [s["num_documents"] for s in shards], dtype=np.int64)
        self.shard_token_starts = np.cumsum([0] + [s["num_tokens"] for s in shards], dtype=np.int64)
        self._base = str(self.path)  # shard files are f"{_base}/{name}.bin"
        self._where = redact(self._base)
        self._check_totals()
        self._bins: list[np.ndarray | None] = [None] * len(shards)
        self._idx: list[IdxArrays | None] = [None] * len(shards)
        self._seen, self._offsets_ok = bytearray(len(shards)), bytearray(len(shards))  # checked
        self._maps: OrderedDict[int, int] = OrderedDict()  # .bin i, .idx -1 - i → bytes, LRU 1st
        after_fork(self)  # its locks: made afresh in a forked child
        self._remote_bytes = 0  # bytes of remote .bin maps (at most half the cache)
        self._checks = ChecksumWatch(enabled=verify == "background" and self._remote is None,
                                     hint=VERIFY_HINT)
        self._closed = False

    def after_fork(self) -> None:
        """Fresh locks (in a forked child: the parent's thread mapping a shard held its lock)."""
        self._lock, self._shard_locks = threading.Lock(), {}

    def _index(self, i: int) -> IdxArrays:
        if (x := self._idx[i]) is None:
            return self._map_idx(i)
        try:
            self._maps.move_to_end(-1 - i)
        except KeyError:
            pass
        return x

    def _file(self, i: int, ext: str) -> str:
        return f"{self._where}/{self.manifest['shards'][i]['name']}{ext}"

    def _same_file(self, i: int, ext: str):
        """A ``StatCheck`` that refuses shard ``i``'s ``ext`` file unless it is the one seen when
        the store was opened (None for a remote store: its cache verifies checksums)."""
        if self._ids is None:
            return None
        return partial(self._check_same, i, ext)

    def _check_same(self, i: int, ext: str, st: os.stat_result) -> None:
        if hash(file_id(st)) != self._ids[2 * i + (ext == ".idx")]:
            raise StoreError(f"{self._file(i, ext)}: the store changed since it was opened (this "
                             "shard file was replaced or rewritten: re-prepared underneath this "
                             "reader?); open the store again — for a Loader, create a new Loader "
                             "(a state saved from the old store does not resume on a new one)")

    def _shard_lock(self, i: int) -> threading.Lock:
        return self._shard_locks.setdefault(i, threading.Lock())

    def _map_bin(self, i: int) -> np.ndarray:
        with self._shard_lock(i):
            if (b := self._bins[i]) is not None:
                return b
            if self._closed:
                raise StoreError(f"{self._where}: the store is closed; open it again to read it")
            s = self.manifest["shards"][i]
            if not self._seen[i]:
                self._first_use(i)
            if not s["num_tokens"]:
                b = self._bins[i] = np.zeros(0, self.dtype)  # nothing to map
                return b
            if self._remote is not None:
                b = self._map_remote_bin(f"{s['name']}.bin")
            else:
                # a plain ndarray (not np.memmap, whose Python-level __getitem__ costs ~2 µs per
                # slice, more than copying a 2048-token window)
                b = map_file(f"{self._base}/{s['name']}.bin", self.dtype,
                             check=self._same_file(i, ".bin"))
            self._keep(i, b)
        return b

    def _first_use(self, i: int) -> None:
        """Check shard ``i``'s index against the manifest and queue its checksums. A remote
        shard's index is fetched here, when the shard is first read, and kept; a local one is
        mapped for the check alone (every index read is checked: ``_read_index``)."""
        s = self.manifest["shards"][i]
        if self._remote is not None or self._idx[i] is not None:
            self._index(i)
        else:
            self._read_index(i, in_memory=False)  # mapped for the check; unmapped after
        if self._remote is None:
            self._checks.add(f"{self._base}/{s['name']}.bin", s["bin_xxh3"])
            self._checks.add(f"{self._base}/{s['name']}.idx", s["idx_xxh3"])
        self._seen[i] = 1

    def _check_totals(self) -> None:
        """Raise StoreError unless the manifest's totals are the sums of its shards' counts."""
        docs, tokens = int(self.shard_doc_starts[-1]), int(self.shard_token_starts[-1])
        if (docs, tokens) != (len(self), self.num_tokens):
            raise StoreError(f"{self._where}/{MANIFEST}: totals ({len(self):,} documents, "
                             f"{self.num_tokens:,} tokens) disagree with its shards ({docs:,}, "
                             f"{tokens:,}); the manifest was edited or is damaged — run "
                             "'tokenmill verify'")

    def _check_index(self, i: int, x: IdxArrays) -> None:
        """Raise StoreError naming shard ``i``'s file unless its index holds what the manifest
        says: dtype, documents, tokens, and a .bin of that many tokens. Its tokens are where its
        last document ends (offset + length): the sum of its lengths, as the offsets of an index
        are contiguous (``verify`` checks it; the checksum holds it), read in O(1) — a pass over
        the lengths of a 2^31-document shard takes half a minute."""
        n = len(x.lengths)
        tokens = int(x.pointers[-1]) // x.dtype.itemsize + int(x.lengths[-1]) if n else 0
        self._check_counts(i, x.dtype, n, tokens)

    def _check_counts(self, i: int, dtype: np.dtype, n: int, tokens: int) -> None:
        """``_check_index`` of an index holding ``n`` documents of ``dtype``, ``tokens`` in all."""
        s = self.manifest["shards"][i]
        if dtype != self.dtype or n != s["num_documents"] or tokens != s["num_tokens"]:
            raise StoreError(f"{self._file(i, '.idx')}: holds {n:,} {dtype} "
                             f"documents of {tokens:,} tokens, the manifest says "
                             f"{s['num_documents']:,} {self.dtype} documents of "
                             f"{s['num_tokens']:,} tokens; {DISAGREE}")
        if s["bin_bytes"] != s["num_tokens"] * self.dtype.itemsize:
            raise StoreError(f"{self._file(i, '.bin')}: holds {s['bin_bytes']:,} bytes "
                             f"({s['bin_bytes'] / self.dtype.itemsize:,.1f} {self.dtype} tokens), "
                             f"the manifest says {s['num_tokens']:,} tokens; {DISAGREE}")

    def _map_idx(self, i: int) -> IdxArrays:
        with self._shard_lock(-1 - i):
            if (x := self._idx[i]) is not None:
                return x
            if self._closed:
                raise StoreError(f"{self._where}: the store is closed; open it again to read it")
            x = self._read_index(i, in_memory=self._remote is not None)
            self._keep(-1 - i, x)
            return x

    def _read_index(self, i: int, *, in_memory: bool) -> IdxArrays:
        """Shard ``i``'s index, mapped or (remote: always) copied into memory, checked."""
        name = f"{self.manifest['shards'][i]['name']}.idx"
        if self._remote is None:
            x = read_idx(f"{self._base}/{name}", in_memory=in_memory,
                         check=self._same_file(i, ".idx"))
        else:
            with self._remote.pin(name) as pin:  # copied to memory: no pin held after
                x = read_idx(pin.path, in_memory=True)
        self._check_index(i, x)
        return x

    def _map_remote_bin(self, name: str) -> np.ndarray:
        """Map a remote shard from the cache (downloading it if needed); if the cache is full of
        pinned shards, drop all of this store's own maps and try once more."""
        try:
            return self._remote.map(name, self.dtype)
        except CacheFullError:
            with self._lock:
                for key in [k for k in self._maps if k >= 0]:
                    self._forget(key)
            return self._remote.map(name, self.dtype)

    def _keep(self, key: int, array) -> None:
        """Record a new map; drop the least recently used ones past ``max_open`` files (and, for a
        remote store, past half the cache, so processes sharing it leave each other room)."""
        nbytes = array.nbytes if key >= 0 else 0
        with self._lock:
            if key >= 0:
                self._bins[key] = array
            else:
                self._idx[-1 - key] = array
            self._maps[key] = nbytes
            if self._remote is not None and key >= 0:
                self._remote_bytes += nbytes
            budget = self._remote.cache.max_bytes // 2 if self._remote is not None else 0
            for old in list(self._maps):
                too_many = len(self._maps) > self.max_open
                if not too_many and self._remote_bytes <= budget:
                    break
                if old != key and (too_many or old >= 0):
                    self._forget(old)

    def _forget(self, key: int) -> None:
        """Drop one map (call with ``_lock`` held); views handed out keep it alive."""
        nbytes = self._maps.pop(key)
        if key >= 0:
            self._bins[key] = None
            if self._remote is not None:
                self._remote_bytes -= nbytes
        else:
            self._idx[-1 - key] = None

    def check(self, wait: bool = False) -> None:
        """Raise the StoreError of a shard file whose background checksum failed (the message
        names the file); with ``wait``, first wait for the checks under way. Reads raise it too;
        a Loader calls this at every ``next()`` so that cached views cannot bypass it."""
        if wait:
            self._checks.wait()
        if self._checks.failure is not None:
            raise StoreError(self._checks.failure)

    def prefetch(self, shards: Iterable[int] | None = None) -> Future:
        """Download shards (default: all) into the cache in a background thread, in order.

        ``store.prefetch().result()`` waits until they are all cached; a local store returns a
        finished Future. Only what fits in the cache next to pinned shards stays there."""
        if self._remote is None:
            fut: Future = Future()
            fut.set_result([])
            return fut
        idx = range(self.num_shards) if shards is None else shards
        names = [f"{self.manifest['shards'][i]['name']}.bin" for i in idx]
        return self._remote.prefetch(names)

    @property
    def local_dir(self) -> Path:
        """A local directory for files derived from the store (e.g. layouts): the store itself,
        or for a remote store its own folder in the cache."""
        return self.path if self._remote is None else self._remote.local_dir

    def open_args(self) -> dict:
        """Keyword arguments that open this same store in another process: TokenStore(**args)."""
        return dict(self._open_args)

    def __reduce__(self):
        # pickles as how to reopen it (a few bytes), never as the mapped tokens
        return _reopen, (self.open_args(),)

    def __len__(self) -> int:
        return int(self.manifest["num_documents"])

    def __repr__(self) -> str:
        return (f"TokenStore({self._where!r}, documents={len(self):,}, "
                f"tokens={self.num_tokens:,}, shards={self.num_shards})")

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop every map and stop the background checks; idempotent. Views handed out stay
        valid until they are released (a remote shard stays pinned in the cache until then)."""
        self._closed = True
        self._checks.close()
        with self._lock:
            for key in list(self._maps):
                self._forget(key)
            self._bins = [None] * self.num_shards  # also empty shards' arrays
        if self._remote is not None:
            self._remote.close()

    @property
    def num_tokens(self) -> int:
        """Total tokens over all documents (EOS included)."""
        return int(self.manifest["num_tokens"])

    @property
    def fingerprint(self) -> str:
        """The store's content hash, from its manifest."""
        return self.manifest["fingerprint"]

    @property
    def tokenizer(self) -> dict:
        """The tokenizer identity recorded at prepare time."""
        return self.manifest["tokenizer"]

    @property
    def num_shards(self) -> int:
        """Number of shard pairs."""
        return len(self.manifest["shards"])

    def shard(self, i: int) -> np.ndarray:
        """The whole token memmap of shard ``i`` (mapped, or fetched if remote, on first use)."""
        if self._checks.failure is not None:
            raise StoreError(self._checks.failure)
        b = self._bins[i]
        if b is None:
            return self._map_bin(i)
        try:  # try/except, not contextlib.suppress: this runs for every row of every batch
            self._maps.move_to_end(i)
        except KeyError:  # dropped meanwhile: ``b`` stays valid
            pass
        return b

    @cached_property
    def doc_lengths(self) -> np.ndarray:
        """int64 token count of every document, in store order (checked against the manifest:
        each shard's lengths are >= 0 and sum to its token count). Reads every index once."""
        parts = []
        for i, s in enumerate(self.manifest["shards"]):
            x = self._idx[i]
            part = np.asarray((x or self._read_index(i, in_memory=True)).lengths, dtype=np.int64)
            if (len(part) and part.min() < 0) or int(part.sum()) != s["num_tokens"]:
                raise StoreError(f"{self._file(i, '.idx')}: document lengths sum to "
                                 f"{int(part.sum()):,} tokens, the manifest says "
                                 f"{s['num_tokens']:,}; the index is damaged — run 'tokenmill "
                                 "verify'")
            parts.append(part)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def doc_spans(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global first token and length (int64) of each document id (len(store): the stream's
        end, (num_tokens, 0)), read from the indexes of the shards the ids fall in alone.

        store.doc_spans(np.array([0]))[0].tolist() == [0]
        """
        ids = np.asarray(ids, dtype=np.int64)
        n, top = len(self), int(ids.max(initial=-1))
        if ids.size and (ids.min() < 0 or top > n):
            raise IndexError(f"document ids must be in [0, {n:,}] (got {ids.min()}..{top})")
        if len(self.shard_doc_starts) == 2 and top < n:  # one shard: no grouping by shard
            pointers, lengths = self._entries(0, ids)
            return pointers // self.dtype.itemsize, lengths
        shard = np.searchsorted(self.shard_doc_starts, ids, side="right") - 1
        starts = np.full(ids.shape, self.num_tokens, np.int64)  # id n: the stream's end
        lengths = np.zeros(ids.shape, np.int64)
        groups = by_value(np.where(ids < n, shard, -1))  # -1 first: the ids at the end
        for s, sel in groups[1:] if groups and groups[0][0] < 0 else groups:
            local = ids[sel] - int(self.shard_doc_starts[s])
            pointers, lengths[sel] = self._entries(s, local)
            starts[sel] = int(self.shard_token_starts[s]) + pointers // self.dtype.itemsize
        return starts, lengths

    def _entries(self, i: int, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(byte offsets, lengths) of shard ``i``'s documents ``local``: from its index if mapped,
        remote or a quarter of it is asked for (mapped once, its offsets checked once), else read
        alone (a pass over many shards maps no index: read_idx_entries)."""
        x = self._idx[i]
        if x is None and (self._remote is not None or
                          4 * len(local) >= self.manifest["shards"][i]["num_documents"]):
            x = self._index(i)
        if x is not None:
            if not self._offsets_ok[i]:  # whoever mapped it; damaged: raises at every call
                check_offsets(self._file(i, ".idx"), 0, x.lengths, x.pointers, x.dtype.itemsize)
                self._offsets_ok[i] = 1
            return np.take(x.pointers, local), np.take(x.lengths, local).astype(np.int64)  # 4× x[]
        name = f"{self._base}/{self.manifest['shards'][i]['name']}.idx"
        got = read_idx_entries(name, local, check=self._same_file(i, ".idx"))
        self._check_counts(i, got.dtype, got.num_documents, got.num_tokens)
        return got.pointers, got.lengths

    def docs_at(self, tokens: np.ndarray) -> np.ndarray:
        """The id of the document holding each global token, read from its shard's index.

        store.docs_at(np.array([0])).tolist() == [0]
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.num_tokens):
            raise IndexError(f"tokens must be in [0, {self.num_tokens:,}) (got "
                             f"{tokens.min()}..{tokens.max()})")
        shard = np.searchsorted(self.shard_token_starts, tokens, side="right") - 1
        out = np.empty(tokens.shape, np.int64)
        for s, sel in by_value(shard):
            byte = (tokens[sel] - int(self.shard_token_starts[s])) * self.dtype.itemsize
            local = np.searchsorted(self._index(s).pointers, byte, side="right") - 1
            out[sel] = int(self.shard_doc_starts[s]) + local
        return out

    def __getitem__(self, i: int) -> np.ndarray:
        """The token array of document ``i``: a zero-copy view into its shard."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for a store of {n:,} documents")
        i %= n
        s = int(np.searchsorted(self.shard_doc_starts, i, side="right")) - 1
        local = i - int(self.shard_doc_starts[s])
        idx = self._index(s)
        start = int(idx.pointers[local]) // self.dtype.itemsize
        return self.shard(s)[start:start + int(idx.lengths[local])]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Global tokens [start, stop): a view inside one shard, a new array across shards."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        parts = list(self._pieces(start, stop))
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def copy_tokens(self, start: int, out: np.ndarray) -> None:
        """Copy global tokens [start, start + len(out)) into ``out``, casting, across shards."""
        pos = 0
        for part in self._pieces(start, start + len(out)):
            out[pos:pos + len(part)] = part
            pos += len(part)

    def _pieces(self, start: int, stop: int) -> Iterator[np.ndarray]:
        s = int(np.searchsorted(self.shard_token_starts, start, side="right")) - 1
        while start < stop:
            base = int(self.shard_token_starts[s])
            end = min(stop, int(self.shard_token_starts[s + 1]))
            if end > start:
                yield self.shard(s)[start - base:end - base]
            start = end
            s += 1


def _reopen(args: dict) -> TokenStore:
    return TokenStore(**args)
