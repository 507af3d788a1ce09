"""The token store on disk: shard writer, memory-mapped reader, manifest and checksums.

A store is a directory::

    store/
      manifest.json            written last, atomically: a store without it is incomplete
      shard-00000.bin          token ids of every document, back to back, no header
      shard-00000.idx          Megatron-LM indexed-dataset index (MMIDIDX v1), layout below
      shard-00001.bin/.idx …

Each ``.bin``/``.idx`` pair is a valid Megatron-LM indexed dataset, so Megatron, NeMo and
GPT-NeoX read a shard as it is. ``.idx`` layout, little-endian, no padding::

    offset  size      field
    0       9         magic  b"MMIDIDX\\x00\\x00"
    9       8         uint64 version = 1
    17      1         uint8  dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                          6 float64, 7 float32, 8 uint16)
    18      8         uint64 N, sequence count (one sequence per document here)
    26      8         uint64 M, document-index count = N + 1
    34      4·N       int32[N]  sequence lengths, in tokens
    34+4N   8·N       int64[N]  byte offset of each sequence in .bin
    34+12N  8·M       int64[M]  document boundaries 0, 1, …, N

Every file is written under a temporary name and renamed into place. Checksums are xxh3-64 of
the whole file, hex.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import xxhash

from tokenmill import remote
from tokenmill.errors import StoreError

FORMAT = "tokenmill-store"
VERSION = 1
MANIFEST = "manifest.json"
IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_VERSION = 1
IDX_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, M: 34 bytes
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_CHUNK = 8 << 20
READAHEAD = 2  # remote shards fetched in the background past the one just mapped


def shard_name(index: int) -> str:
    """File stem of shard ``index``.

    shard_name(3) == "shard-00003"
    """
    return f"shard-{index:05d}"


def xxh3_file(path: str | os.PathLike) -> str:
    """xxh3-64 hex digest of a whole file, read in 8 MiB chunks."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # disk full, quota, file-size limit


@contextlib.contextmanager
def no_space_is_a_store_error(path: str | os.PathLike) -> Iterator[None]:
    """Turn a full disk (or quota, or file-size limit) while writing ``path`` into a StoreError
    that says so and what to do; other errors pass through."""
    try:
        yield
    except OSError as e:
        if e.errno not in _NO_SPACE:
            raise
        raise StoreError(f"{path}: cannot write ({os.strerror(e.errno)}): the disk is full; free "
                         "some space and run the same command again ('tokenmill prepare' resumes "
                         "where it stopped)") from e


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename; on failure the
    temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with no_space_is_a_store_error(path), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def json_bytes(obj: Any) -> bytes:
    """``obj`` as indented, key-sorted JSON with a final newline (how manifests are written)."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON, atomically."""
    atomic_write_bytes(path, json_bytes(obj))


def idx_bytes(lengths: np.ndarray, dtype: np.dtype) -> bytes:
    """The ``.idx`` file for documents of the given token lengths (one sequence each)."""
    dtype = np.dtype(dtype)
    n = len(lengths)
    lengths = np.asarray(lengths, dtype=np.int64)
    if n and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise StoreError(f"document length out of int32 range: {lengths.max()}")
    pointers = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    header = IDX_HEADER.pack(IDX_MAGIC, IDX_VERSION, CODE_OF_DTYPE[dtype], n, n + 1)
    return b"".join([header, lengths.astype("<i4").tobytes(), pointers.astype("<i8").tobytes(),
                     np.arange(n + 1, dtype="<i8").tobytes()])


@dataclass(frozen=True)
class IdxArrays:
    """The parsed, memory-mapped content of one ``.idx`` file."""

    dtype: np.dtype
    lengths: np.ndarray  # int32[N]
    pointers: np.ndarray  # int64[N], byte offsets into .bin
    doc_idx: np.ndarray  # int64[N + 1]


def read_idx(path: str | os.PathLike) -> IdxArrays:
    """Memory-map an ``.idx`` file, checking magic, version, dtype and size."""
    path = Path(path)
    size = _size_or_raise(path)
    with open(path, "rb") as f:
        head = f.read(IDX_HEADER.size)
    if len(head) < IDX_HEADER.size:
        raise StoreError(f"{path}: {size} bytes is too short for an index header "
                         f"({IDX_HEADER.size} bytes); the file is truncated — run "
                         "'tokenmill prepare' again to rebuild it")
    magic, version, code, n, m = IDX_HEADER.unpack(head)
    if magic != IDX_MAGIC:
        raise StoreError(f"{path}: not a Megatron indexed-dataset index (magic {magic!r})")
    if version != IDX_VERSION:
        raise StoreError(f"{path}: index version {version}, this tokenmill reads {IDX_VERSION}")
    if code not in DTYPE_CODES:
        raise StoreError(f"{path}: unknown dtype code {code}")
    want = IDX_HEADER.size + 12 * n + 8 * m
    if size != want:
        raise StoreError(f"{path}: expected {want:,} bytes for {n:,} documents, found {size:,}; "
                         "the file is truncated or corrupt — run 'tokenmill prepare' again")
    off = IDX_HEADER.size
    lengths = np.memmap(path, dtype="<i4", mode="r", offset=off, shape=(n,)) if n else np.zeros(0, np.int32)
    pointers = (np.memmap(path, dtype="<i8", mode="r", offset=off + 4 * n, shape=(n,))
                if n else np.zeros(0, np.int64))
    doc_idx = np.memmap(path, dtype="<i8", mode="r", offset=off + 12 * n, shape=(m,))
    return IdxArrays(np.dtype(DTYPE_CODES[code]), lengths, pointers, doc_idx)


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records of one finished shard."""

    name: str
    num_documents: int
    num_tokens: int
    bin_bytes: int
    idx_bytes: int
    bin_xxh3: str
    idx_xxh3: str

    def to_json(self) -> dict:
        """A JSON-able dict of the fields."""
        return dict(self.__dict__)


class ShardWriter:
    """Streams documents into shards, closing a shard at the first document boundary at or past
    ``shard_tokens``; each shard is written under temporary names and renamed when complete."""

    def __init__(self, out_dir: str | os.PathLike, *, dtype: np.dtype, shard_tokens: int,
                 first_shard: int = 0):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1 (got {shard_tokens=})")
        self.out_dir = Path(out_dir)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        self.shard_tokens = shard_tokens
        self.next_index = first_shard
        self._file = None
        self._hash = None
        self._lengths: list[np.ndarray] = []
        self._tokens = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> list[tuple[ShardInfo, int]]:
        """Append documents; returns the shards closed meanwhile, each with how many of
        *these* documents it holds up to its end (so the caller can record a resume cursor)."""
        closed = []
        lengths = np.asarray(lengths, dtype=np.int64)
        ends = np.cumsum(lengths)
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        assert len(tokens) == (ends[-1] if len(ends) else 0), "tokens and lengths disagree"
        doc, tok = 0, 0
        while doc < len(lengths):
            need = self.shard_tokens - self._tokens
            # first document whose end reaches the shard size: close the shard right after it
            cut = int(np.searchsorted(ends, tok + need, side="left")) + 1
            stop = min(cut, len(lengths))
            stop_tok = int(ends[stop - 1])
            self._write(tokens[tok:stop_tok], lengths[doc:stop])
            doc, tok = stop, stop_tok
            if cut <= len(lengths):
                closed.append((self.close_shard(), doc))
        return closed

    def _write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        with no_space_is_a_store_error(self._tmp(".bin")):
            if self._file is None:
                self._file = open(self._tmp(".bin"), "wb")
                self._hash = xxhash.xxh3_64()
            data = tokens.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
            self._file.write(data)
        self._hash.update(data)
        self._lengths.append(lengths)
        self._tokens += len(tokens)

    def _tmp(self, suffix: str) -> Path:
        return self.out_dir / f".{shard_name(self.next_index)}{suffix}.tmp"

    @property
    def pending_documents(self) -> int:
        """Documents written to the open shard but not yet closed."""
        return int(sum(len(x) for x in self._lengths))

    def close_shard(self) -> ShardInfo:
        """Finish the open shard (fsync, write its index, rename both into place)."""
        if self._file is None:
            self._write(np.zeros(0, self.dtype), np.zeros(0, np.int64))
        with no_space_is_a_store_error(self._tmp(".bin")):
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        idx = idx_bytes(lengths, self.dtype)
        name = shard_name(self.next_index)
        bin_tmp, idx_tmp = self._tmp(".bin"), self._tmp(".idx")
        with no_space_is_a_store_error(idx_tmp), open(idx_tmp, "wb") as f:
            f.write(idx)
            f.flush()
            os.fsync(f.fileno())
        info = ShardInfo(name=name, num_documents=len(lengths), num_tokens=self._tokens,
                         bin_bytes=self._tokens * self.dtype.itemsize, idx_bytes=len(idx),
                         bin_xxh3=self._hash.hexdigest(), idx_xxh3=xxhash.xxh3_64_hexdigest(idx))
        os.replace(bin_tmp, self.out_dir / f"{name}.bin")
        os.replace(idx_tmp, self.out_dir / f"{name}.idx")
        self._file, self._hash, self._lengths, self._tokens = None, None, [], 0
        self.next_index += 1
        return info

    def finish(self) -> ShardInfo | None:
        """Close the last, partly filled shard, if any documents are pending."""
        return self.close_shard() if self._lengths and self._tokens else None

    def abort(self) -> None:
        """Drop the open shard's temporary file."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # the disk is full: the buffered rest cannot be written, nor matters
                pass
            self._file = None
        for suffix in (".bin", ".idx"):
            self._tmp(suffix).unlink(missing_ok=True)


def store_fingerprint(manifest: dict) -> str:
    """A hash of what defines a store's content: tokenizer, dtype and every shard checksum."""
    core = {"tokenizer": manifest["tokenizer"], "dtype": manifest["dtype"],
            "shards": [(s["bin_xxh3"], s["idx_xxh3"]) for s in manifest["shards"]]}
    return xxhash.xxh3_64_hexdigest(json.dumps(core, sort_keys=True).encode())


def build_manifest(*, tokenizer: dict, dtype: np.dtype, shards: list[ShardInfo],
                   settings: dict, skipped: dict) -> dict:
    """The manifest dict for a finished store."""
    manifest = {
        "format": FORMAT, "version": VERSION, "tokenizer": tokenizer,
        "dtype": np.dtype(dtype).name,
        "num_documents": sum(s.num_documents for s in shards),
        "num_tokens": sum(s.num_tokens for s in shards),
        "shards": [s.to_json() for s in shards],
        "settings": settings, "skipped": skipped,
    }
    manifest["fingerprint"] = store_fingerprint(manifest)
    manifest[MANIFEST_CHECKSUM] = manifest_checksum(manifest)
    return manifest


MANIFEST_CHECKSUM = "manifest_xxh3"


def manifest_checksum(manifest: dict) -> str:
    """xxh3-64 of the manifest as written, without its own checksum field: any change to any
    field (a flipped byte in a path, a count, a key name) shows."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}
    return xxhash.xxh3_64_hexdigest(json_bytes(body))


_REQUIRED = ("format", "version", "tokenizer", "dtype", "num_documents", "num_tokens", "shards")


def read_manifest(path: str | os.PathLike, *, storage_options: dict | None = None) -> dict:
    """Load and check a store's manifest: present, parseable, right format and version.

    ``path`` may be an fsspec URL (``s3://bucket/store``); ``storage_options`` go to fsspec.
    """
    if remote.is_url(path):
        return _read_remote_manifest(os.fspath(path).rstrip("/"), storage_options)
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        raise StoreError(f"{path}: no such store directory")
    if not mpath.exists():
        partial = any(path.glob("shard-*")) or (path / ".progress").exists()
        raise StoreError(f"{mpath}: missing — {_missing_manifest_hint(partial)}")
    return parse_manifest(mpath.read_bytes(), str(mpath))


def _read_remote_manifest(url: str, storage_options) -> dict:
    data = remote.read_bytes(f"{url}/{MANIFEST}", storage_options)
    if data is None:
        partial = any(n.startswith("shard-") for n in remote.list_sizes(url, storage_options))
        raise StoreError(f"{url}/{MANIFEST}: missing — {_missing_manifest_hint(partial)}")
    return parse_manifest(data, f"{url}/{MANIFEST}")


def _missing_manifest_hint(partial: bool) -> str:
    return ("prepare did not finish; run the same 'tokenmill prepare' command again to finish it"
            if partial else "is this a tokenmill store? Create one with 'tokenmill prepare'")


def parse_manifest(data: bytes | str, where: str) -> dict:
    """Parse and check manifest JSON read from ``where`` (a path or URL, for messages)."""
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{where}: not valid JSON ({e}); the manifest is corrupt — "
                         "run 'tokenmill prepare' again") from None
    if not isinstance(manifest, dict) or any(k not in manifest for k in _REQUIRED):
        missing = [k for k in _REQUIRED if not isinstance(manifest, dict) or k not in manifest]
        raise StoreError(f"{where}: missing fields {missing}; the manifest is corrupt")
    if manifest["format"] != FORMAT:
        raise StoreError(f"{where}: format {manifest['format']!r}, expected {FORMAT!r}")
    if manifest["version"] != VERSION:
        raise StoreError(f"{where}: store version {manifest['version']}, this tokenmill reads "
                         f"version {VERSION}; re-run 'tokenmill prepare' with this version")
    if MANIFEST_CHECKSUM in manifest and manifest[MANIFEST_CHECKSUM] != manifest_checksum(manifest):
        raise StoreError(f"{where}: checksum mismatch: the manifest was changed or is damaged; "
                         "run 'tokenmill verify', then 'tokenmill prepare' again")
    return manifest


def _size_or_raise(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; the store is incomplete — run 'tokenmill prepare' "
                         "again, or 'tokenmill verify' to see what else is wrong") from None


def check_sizes(path: str | os.PathLike, manifest: dict) -> None:
    """Raise StoreError naming the first shard file whose size differs from the manifest."""
    path = Path(path)
    for s in manifest["shards"]:
        for ext, key in ((".bin", "bin_bytes"), (".idx", "idx_bytes")):
            f = path / f"{s['name']}{ext}"
            got = _size_or_raise(f)
            if got != s[key]:
                raise StoreError(f"{f}: expected {s[key]:,} bytes, found {got:,}; the shard is "
                                 "truncated or was replaced — run 'tokenmill verify', then "
                                 "'tokenmill prepare' again")


class TokenStore:
    """A read-only, memory-mapped view of a store: documents, token ranges, lengths.

    Opening reads the manifest and each shard's index (O(number of shards)); token data is never
    read until asked for. ``path`` may be an fsspec URL (``TokenStore("s3://b/store")``): shards
    are then downloaded on first use into a local cache (``cache_dir``, default
    ``$TOKENMILL_CACHE_DIR`` or ``~/.cache/tokenmill``; at most ``cache_bytes``, default
    ``$TOKENMILL_CACHE_BYTES`` or 16 GiB), verified, and memory-mapped from there; see
    ``tokenmill.remote``.
    """

    def __init__(self, path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                 cache_bytes: int | str | None = None, storage_options: dict | None = None):
        self._remote = None
        if remote.is_url(path):
            self.path = self.url = os.fspath(path).rstrip("/")
            self.manifest = read_manifest(self.url, storage_options=storage_options)
            self._remote = remote.RemoteShards(self.url, self.manifest, cache_dir=cache_dir,
                                               cache_bytes=cache_bytes,
                                               storage_options=storage_options)
            self._open_args = {"path": self.url, "cache_dir": str(self._remote.cache.root),
                               "cache_bytes": self._remote.cache.max_bytes,
                               "storage_options": storage_options}
            self._remote.fetch_many([f"{s['name']}.idx" for s in self.manifest["shards"]])
        else:
            self.path, self.url = Path(path), None
            self.manifest = read_manifest(self.path)
            check_sizes(self.path, self.manifest)
            self._open_args = {"path": str(self.path)}
        self.dtype = np.dtype(self.manifest["dtype"])
        shards = self.manifest["shards"]
        self._bins: list[np.ndarray | None] = []
        self._idx: list[IdxArrays] = []
        self._map_locks = [threading.Lock() for _ in shards]
        self._mapped: OrderedDict[int, int] = OrderedDict()  # remote shards mapped, oldest first
        self._mapped_lock = threading.Lock()
        for s in shards:
            idx = self._read_idx(s["name"])
            if idx.dtype != self.dtype or len(idx.lengths) != s["num_documents"]:
                raise StoreError(f"{self.path}/{s['name']}.idx: holds {len(idx.lengths):,} "
                                 f"{idx.dtype} documents, the manifest says "
                                 f"{s['num_documents']:,} {self.dtype}; run 'tokenmill verify'")
            self._idx.append(idx)
            if not s["num_tokens"]:
                self._bins.append(np.zeros(0, self.dtype))
            elif self._remote is not None:
                self._bins.append(None)  # mapped on first use, through the cache
            else:
                # a plain ndarray view of the memmap: np.memmap's Python-level __getitem__ costs
                # ~2 µs per slice, more than copying a 2048-token window
                self._bins.append(np.memmap(self.path / f"{s['name']}.bin", dtype=self.dtype,
                                            mode="r").view(np.ndarray))
        self.shard_doc_starts = np.cumsum([0] + [s["num_documents"] for s in shards], dtype=np.int64)
        self.shard_token_starts = np.cumsum([0] + [s["num_tokens"] for s in shards], dtype=np.int64)

    def _read_idx(self, name: str) -> IdxArrays:
        if self._remote is None:
            return read_idx(self.path / f"{name}.idx")
        with self._remote.pin(f"{name}.idx") as pin:  # copied to memory: no pin held after
            idx = read_idx(pin.path)
            return IdxArrays(idx.dtype, np.array(idx.lengths), np.array(idx.pointers),
                             np.array(idx.doc_idx))

    def _bin(self, i: int) -> np.ndarray:
        b = self._bins[i]
        return b if b is not None else self._map(i)

    def _map(self, i: int) -> np.ndarray:
        """Map remote shard ``i`` from the cache (downloading it if needed), then fetch the next
        shards in the background. The store keeps at most half the cache mapped (oldest maps
        dropped first) so that processes sharing a cache leave each other room; a view handed
        out keeps its shard pinned regardless. If the cache is full of pinned shards, drop all of
        this store's own maps and try once more."""
        with self._map_locks[i]:
            if (b := self._bins[i]) is not None:
                return b
            name = f"{self.manifest['shards'][i]['name']}.bin"
            try:
                b = self._remote.map(name, self.dtype)
            except remote.CacheFullError:
                self._drop_maps(keep=0, newest=False)
                b = self._remote.map(name, self.dtype)
            with self._mapped_lock:
                self._bins[i] = b
                self._mapped[i] = b.nbytes
            self._drop_maps(keep=self._remote.cache.max_bytes // 2)
        ahead = [f"{s['name']}.bin" for j, s in enumerate(self.manifest["shards"])
                 if i < j <= i + READAHEAD and self._bins[j] is None]
        if ahead:
            self._remote.prefetch(ahead)  # errors are the reader's to meet, when it gets there
        return b

    def _drop_maps(self, keep: int, newest: bool = True) -> None:
        """Forget the oldest of this store's maps until they total at most ``keep`` bytes
        (keeping the newest if ``newest``); the cache may evict a shard once no view remains."""
        with self._mapped_lock:
            while len(self._mapped) > newest and sum(self._mapped.values()) > keep:
                j, _ = self._mapped.popitem(last=False)
                self._bins[j] = None

    def prefetch(self, shards: Iterable[int] | None = None) -> Future:
        """Download shards (default: all) into the cache in a background thread, in order.

        ``store.prefetch().result()`` waits until they are all cached; a local store returns a
        finished Future. Only what fits in the cache next to pinned shards stays there.
        """
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
        return (f"TokenStore({str(self.path)!r}, documents={len(self):,}, "
                f"tokens={self.num_tokens:,}, shards={self.num_shards})")

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop the memory maps (views handed out stay valid until they are released; a remote
        shard stays pinned in the cache until then)."""
        self._bins, self._idx = [], []
        self._mapped.clear()
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
        """The whole token memmap of shard ``i`` (a remote shard is fetched on first use)."""
        return self._bin(i)

    @cached_property
    def doc_lengths(self) -> np.ndarray:
        """int64 token count of every document, in store order (checked against the manifest:
        each shard's lengths are >= 0 and sum to its token count)."""
        if not self._idx:
            return np.zeros(0, np.int64)
        parts = [np.asarray(i.lengths, dtype=np.int64) for i in self._idx]
        for part, s in zip(parts, self.manifest["shards"]):
            if (len(part) and part.min() < 0) or int(part.sum()) != s["num_tokens"]:
                raise StoreError(f"{self.path}/{s['name']}.idx: document lengths sum to "
                                 f"{int(part.sum()):,} tokens, the manifest says "
                                 f"{s['num_tokens']:,}; the index is damaged — run 'tokenmill "
                                 "verify'")
        return np.concatenate(parts)

    @cached_property
    def doc_starts(self) -> np.ndarray:
        """int64 global token offset of every document (exclusive cumulative sum of lengths)."""
        starts = np.zeros(len(self), dtype=np.int64)
        np.cumsum(self.doc_lengths[:-1], out=starts[1:])
        return starts

    def __getitem__(self, i: int) -> np.ndarray:
        """The token array of document ``i``: a zero-copy view into its shard."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for a store of {n:,} documents")
        i %= n
        s = int(np.searchsorted(self.shard_doc_starts, i, side="right")) - 1
        local = i - int(self.shard_doc_starts[s])
        idx = self._idx[s]
        start = int(idx.pointers[local]) // self.dtype.itemsize
        return self._bin(s)[start:start + int(idx.lengths[local])]

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
                yield self._bin(s)[start - base:end - base]
            start = end
            s += 1


def _reopen(args: dict) -> TokenStore:
    return TokenStore(**args)


def verify_store(path: str | os.PathLike, *, storage_options: dict | None = None) -> list[str]:
    """Check structure and every checksum; returns the problems found (empty when intact).

    For a URL every file is downloaded (to a temporary directory, never from the cache, so the
    remote objects themselves are checked) and deleted after its check.
    """
    if remote.is_url(path):
        return _verify_remote(os.fspath(path).rstrip("/"), storage_options)
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except StoreError as e:
        return [str(e)]
    problems = []
    if MANIFEST_CHECKSUM not in manifest:
        problems.append(f"{path / MANIFEST}: no {MANIFEST_CHECKSUM} field (damaged, or edited)")
    elif (path / MANIFEST).read_bytes() != json_bytes(manifest):
        problems.append(f"{path / MANIFEST}: same fields, other bytes than tokenmill writes "
                        "(damaged, or edited)")
    for s in manifest["shards"]:
        for ext, size_key, sum_key in ((".bin", "bin_bytes", "bin_xxh3"),
                                       (".idx", "idx_bytes", "idx_xxh3")):
            f = path / f"{s['name']}{ext}"
            if not f.exists():
                problems.append(f"{f}: missing")
                continue
            size = f.stat().st_size
            if size != s[size_key]:
                problems.append(f"{f}: expected {s[size_key]:,} bytes, found {size:,}")
                continue
            got = xxh3_file(f)
            if got != s[sum_key]:
                problems.append(f"{f}: checksum mismatch (xxh3 {got}, manifest {s[sum_key]})")
        f = path / f"{s['name']}.idx"
        if not any(p.startswith(str(f)) for p in problems):
            problems.extend(_check_idx_structure(f, s, np.dtype(manifest["dtype"])))
    if not problems:
        problems += _check_totals(manifest, path / MANIFEST)
    return problems


def _verify_remote(url: str, storage_options: dict | None) -> list[str]:
    import tempfile
    try:
        manifest = read_manifest(url, storage_options=storage_options)
    except StoreError as e:
        return [str(e)]
    sizes = remote.list_sizes(url, storage_options)
    problems = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-verify-") as tmp:
        cache = remote.ShardCache(tmp, 1 << 62, storage_options=storage_options)
        for s in manifest["shards"]:
            for ext, size_key, sum_key in ((".bin", "bin_bytes", "bin_xxh3"),
                                           (".idx", "idx_bytes", "idx_xxh3")):
                f = f"{url}/{s['name']}{ext}"
                got = sizes.get(f"{s['name']}{ext}")
                if got is None or got != s[size_key]:
                    problems.append(f"{f}: missing" if got is None else
                                    f"{f}: expected {s[size_key]:,} bytes, found {got:,}")
                    continue
                try:
                    local = cache.fetch(f, s[size_key], s[sum_key])
                except StoreError as e:
                    problems.append(str(e))
                    continue
                if ext == ".idx":
                    problems += [p.replace(str(local), f) for p in
                                 _check_idx_structure(local, s, np.dtype(manifest["dtype"]))]
                local.unlink()
    if not problems:
        problems += _check_totals(manifest, f"{url}/{MANIFEST}")
    return problems


def _check_totals(manifest: dict, where) -> list[str]:
    total = sum(s["num_tokens"] for s in manifest["shards"])
    docs = sum(s["num_documents"] for s in manifest["shards"])
    if total != manifest["num_tokens"] or docs != manifest["num_documents"]:
        return [f"{where}: totals ({manifest['num_documents']:,} documents, "
                f"{manifest['num_tokens']:,} tokens) disagree with its shards ({docs:,}, {total:,})"]
    return []


def _check_idx_structure(f: Path, shard: dict, dtype: np.dtype) -> list[str]:
    try:
        idx = read_idx(f)
    except StoreError as e:
        return [str(e)]
    lengths = np.asarray(idx.lengths, dtype=np.int64)
    want_ptr = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1] * dtype.itemsize, out=want_ptr[1:])
    if idx.dtype != dtype:
        return [f"{f}: dtype {idx.dtype}, manifest says {dtype}"]
    if (lengths < 0).any() or int(lengths.sum()) != shard["num_tokens"]:
        return [f"{f}: sequence lengths sum to {int(lengths.sum()):,}, "
                f"manifest says {shard['num_tokens']:,} tokens"]
    if not np.array_equal(idx.pointers, want_ptr):
        return [f"{f}: sequence offsets are not contiguous"]
    if not np.array_equal(idx.doc_idx, np.arange(len(lengths) + 1)):
        return [f"{f}: document index is not 0..{len(lengths)}"]
    return []
