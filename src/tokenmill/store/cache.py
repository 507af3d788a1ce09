"""The local shard cache of remote stores, shared by processes.

A store may live at any fsspec URL (``s3://bucket/store``, ``gs://…``). Readers download each
shard file once into a local cache and memory-map the cached copy (``RemoteShards``);
``prepare`` stages shards in a local directory and uploads them (``tokenmill.store.upload``).
Endpoint and credentials come from the usual places (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``~/.aws``, …) or from ``storage_options``, passed to fsspec as they are.

The cache directory (``$TOKENMILL_CACHE_DIR``, default ``~/.cache/tokenmill``)::

    shards/
      .lock                            held (exclusive) while usage is counted and entries
                                       evicted, and while a download is renamed into place
      <xxh3>-<size>.bin                a verified copy, named by its content: a store prepared
      <xxh3>-<size>.bin.lock             again with other bytes never hits a stale copy
      <xxh3>-<size>.bin.tmp-<pid>-<n>  a download in progress (or left by a killed process)
    stores/<hash of url>/              per-store local files (e.g. the loader's packed layouts)
    staging/<hash of url>/             prepare --out URL: the shard being written and .progress/

Rules, each held with ``fcntl.flock`` on the entry's ``.lock`` file so that threads and processes
sharing the directory agree:

- a download holds the lock exclusively, writes a temporary file, checks size and xxh3 against the
  manifest (one ranged GET per 8 MiB of the size the manifest records: no HEAD, no LIST), fsyncs
  and renames (under ``.lock``: a count never misses the file between its two
  names): a data file is always complete and verified;
- a reader holds it shared for as long as the file is memory-mapped (a *pin*);
- eviction takes, least recently used first (mtime, set on every use), only entries whose lock it
  gets exclusively without waiting, so a pinned shard is never evicted; usage counts data files
  and downloads in progress (their temporary file is sized up front) against ``max_bytes``, a
  hard bound on the bytes in ``shards/``, pinned files included: a download that would pass it
  waits for downloads in flight, then raises CacheFullError;
- a temporary file whose lock nobody holds is debris of a killed download: the next download of
  that entry, or the next eviction pass, deletes it.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import xxhash

from tokenmill.base.errors import StoreError
from tokenmill.base.io import (BackgroundJobs, filesystem, lock_file, parse_bytes, redact,
                               stop_background_jobs, unlock)

CACHE_ENV = "TOKENMILL_CACHE_DIR"
CACHE_BYTES_ENV = "TOKENMILL_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 16 << 30  # 16 GiB: 128 shards of the default 128 MiB
_CHUNK = 8 << 20  # download chunk (a module attribute: tests shrink it)
RESERVE_WAIT_S = 300.0  # how long a download waits for others in flight to land
_tmp_counter = itertools.count()
_HEX16 = re.compile(r"[0-9a-f]{16}")
_SUFFIX = re.compile(r"(\.[A-Za-z0-9]{1,8})?")


def default_cache_dir() -> Path:
    """``$TOKENMILL_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenmill``, else ``~/.cache/tokenmill``."""
    if env := os.environ.get(CACHE_ENV):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenmill"



def url_key(url: str) -> str:
    """A short stable name for a URL, for per-store local directories."""
    return xxhash.xxh3_64_hexdigest(url.rstrip("/").encode())


class Pin:
    """A cached file held in place (shared lock) until ``release()``; a context manager."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd
        self._guard = threading.Lock()

    def release(self) -> None:
        """Let the file be evicted again; idempotent."""
        with self._guard:
            if self._fd is not None:
                unlock(self._fd)
                self._fd = None

    @property
    def held(self) -> bool:
        """Whether the pin is still held."""
        return self._fd is not None

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


@dataclass(frozen=True)
class CacheEntry:
    """One verified file in the cache."""

    name: str
    size: int
    last_used_ns: int
    pinned: bool


class CacheFullError(StoreError):
    """The cache cannot make room: what is left is pinned by readers."""


class DownloadCancelled(StoreError):
    """A background download stopped because its store was closed or the process is exiting."""


class ShardCache:
    """Verified local copies of remote files, shared by processes, bounded by LRU eviction.

    ``ShardCache("/tmp/c", 1 << 30).fetch("s3://b/s/shard-00000.bin", size, xxh3)`` returns a
    local path whose bytes have that size and checksum; ``pin(…)`` also holds it in place.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None,
                 max_bytes: int | str | None = None, *,
                 storage_options: Mapping[str, Any] | None = None):
        self.root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        env = os.environ.get(CACHE_BYTES_ENV)
        given = max_bytes if max_bytes is not None else env or DEFAULT_CACHE_BYTES
        self.max_bytes = parse_bytes(given, what="cache size")
        self.storage_options = dict(storage_options or {})
        self.dir = self.root / "shards"
        self.dir.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"ShardCache({str(self.root)!r}, max_bytes={self.max_bytes:,})"

    # ---- public -----------------------------------------------------------------------------

    def fetch(self, url: str, size: int, xxh3: str, *,
              cancel: threading.Event | None = None) -> Path:
        """A local, verified copy of ``url`` (downloaded unless cached); not pinned. Setting
        ``cancel`` stops a download between chunks (its temporary file is removed)."""
        name = self.entry_name(url, size, xxh3)
        path = self.dir / name
        if _touch(path):
            return path
        fd = lock_file(self._lock_path(name))
        try:
            if _touch(path):  # another thread or process finished it while we waited
                return path
            for stale in self.dir.glob(f"{name}.tmp-*"):  # we hold the lock: nobody writes these
                stale.unlink(missing_ok=True)
            tmp = self.dir / f"{name}.tmp-{os.getpid()}-{next(_tmp_counter)}"
            self._reserve(tmp, size, url)
            _ACTIVE_TMP.add(tmp)
            try:
                self._download(url, tmp, size, xxh3, cancel)
                self._land(tmp, path, fd)
                fd = None  # released by _land
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            finally:
                _ACTIVE_TMP.discard(tmp)
            return path
        finally:
            if fd is not None:
                unlock(fd)

    def pin(self, url: str, size: int, xxh3: str) -> Pin:
        """Like ``fetch``, and hold the file in place (shared lock) until the Pin is released."""
        name = self.entry_name(url, size, xxh3)
        for _ in range(8):
            path = self.fetch(url, size, xxh3)
            fd = lock_file(self._lock_path(name), exclusive=False)
            if _touch(path):
                return Pin(path, fd)
            unlock(fd)  # evicted between fetch and lock: the cache is thrashing; try again
        raise CacheFullError(f"{self.root}: {redact(url)} was evicted 8 times before it could be "
                             "pinned; "
                             f"the cache ({self.max_bytes:,} bytes) is too small for the "
                             f"readers sharing it — raise {CACHE_BYTES_ENV} or cache_bytes")

    def entries(self) -> list[CacheEntry]:
        """Verified files, least recently used first."""
        out = []
        for p in self.dir.iterdir():
            if not _is_data(p.name):
                continue
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out.append(CacheEntry(p.name, st.st_size, st.st_mtime_ns, self._pinned(p.name)))
        return sorted(out, key=lambda e: (e.last_used_ns, e.name))

    def usage(self) -> int:
        """Bytes held: verified files plus downloads in progress (at most ``max_bytes``)."""
        fd = lock_file(self.dir / ".lock", exclusive=False)  # no download lands while we count
        try:
            total = 0
            for p in self.dir.iterdir():
                if _is_data(p.name) or ".tmp-" in p.name:
                    with contextlib.suppress(FileNotFoundError):  # a failed download removed
                        total += p.stat().st_size
            return total
        finally:
            unlock(fd)

    @staticmethod
    def entry_name(url: str, size: int, xxh3: str) -> str:
        """The cache file name of a remote file: its checksum, size and extension.

        ShardCache.entry_name("s3://b/s/shard-00000.bin", 10, "0123456789abcdef")
            == "0123456789abcdef-10.bin"
        """
        if not _HEX16.fullmatch(str(xxh3)) or isinstance(size, bool) or int(size) != size or size < 0:
            raise StoreError(f"{redact(url)}: the manifest records size {size!r} and xxh3 "
                             f"{xxh3!r}; "
                             "expected a byte count and 16 hex digits — the manifest is corrupt")
        suffix = os.path.splitext(url.rstrip("/").rsplit("/", 1)[-1])[1]
        if not _SUFFIX.fullmatch(suffix):
            suffix = ""
        return f"{xxh3}-{int(size)}{suffix}"

    # ---- internals --------------------------------------------------------------------------

    def _lock_path(self, name: str) -> Path:
        return self.dir / f"{name}.lock"

    def _pinned(self, name: str) -> bool:
        fd = lock_file(self._lock_path(name), wait=False)
        if fd is None:
            return True
        unlock(fd)
        return False

    def _reserve(self, tmp: Path, size: int, url: str) -> None:
        """Evict least recently used unpinned files until ``size`` more bytes fit, then create
        ``tmp`` at its full size so concurrent downloads count it too. While other downloads are
        in flight (they become evictable when they land) wait for them, up to RESERVE_WAIT_S."""
        if size > self.max_bytes:
            raise CacheFullError(f"{redact(url)}: {size:,} bytes is more than the whole cache "
                                 f"({self.max_bytes:,} bytes at {self.root}); raise "
                                 f"{CACHE_BYTES_ENV} or cache_bytes")
        deadline = time.monotonic() + RESERVE_WAIT_S
        while True:
            fd = lock_file(self.dir / ".lock")
            try:
                used, inflight = self._evict_until(self.max_bytes - size)
                if used + size <= self.max_bytes:
                    with open(tmp, "wb") as f:
                        f.truncate(size)
                    return
                if not inflight or time.monotonic() > deadline:
                    raise CacheFullError(
                        f"{redact(url)}: needs {size:,} bytes in the cache at {self.root}, but "
                        f"{used:,} of "
                        f"its {self.max_bytes:,} bytes are pinned by open stores or downloads in "
                        f"progress; raise {CACHE_BYTES_ENV} (or cache_bytes=), or close stores "
                        "you no longer read")
            finally:
                unlock(fd)
            time.sleep(0.05)

    def _evict_until(self, target: int) -> tuple[int, int]:
        """Evict LRU unpinned files until usage <= target (or nothing more can go); returns
        (usage, bytes of downloads in flight). Call with the cache's global lock held."""
        used, inflight, lru = 0, 0, []
        for p in self.dir.iterdir():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if ".tmp-" in p.name:
                if not self._stale_tmp(p):
                    used += st.st_size
                    inflight += st.st_size
            elif _is_data(p.name):
                used += st.st_size
                lru.append((st.st_mtime_ns, p.name, st.st_size))
        for _, name, nbytes in sorted(lru):
            if used <= target:
                break
            if self._evict(name):
                used -= nbytes
        return used, inflight

    def _land(self, tmp: Path, path: Path, entry_fd: int) -> None:
        """Rename a finished download into place and release its entry's lock, both under the
        cache's global lock. A rename between an eviction pass's listing and its ``stat`` would
        hide the file under both names (the pass would count neither and let a download more
        in, past ``max_bytes``); an entry lock still held after the global one is released would
        make a waiting pass take the new file for a pinned one (no download in flight, nothing
        to evict: CacheFullError)."""
        fd = lock_file(self.dir / ".lock")
        try:
            os.replace(tmp, path)
            _touch(path)
            unlock(entry_fd)
        finally:
            unlock(fd)

    def _stale_tmp(self, tmp: Path) -> bool:
        """Delete ``tmp`` if no download holds its entry's lock; True if it was stale."""
        fd = lock_file(self._lock_path(tmp.name.split(".tmp-")[0]), wait=False)
        if fd is None:
            return False
        try:
            tmp.unlink(missing_ok=True)
            return True
        finally:
            unlock(fd)

    def _evict(self, name: str) -> bool:
        fd = lock_file(self._lock_path(name), wait=False)
        if fd is None:  # pinned by a reader
            return False
        try:
            (self.dir / name).unlink(missing_ok=True)
            self._lock_path(name).unlink(missing_ok=True)
            return True
        finally:
            unlock(fd)

    def _download(self, url: str, tmp: Path, size: int, xxh3: str,
                  cancel: threading.Event | None = None) -> None:
        fs, rpath = filesystem(url, self.storage_options)
        h, n, where = xxhash.xxh3_64(), 0, redact(url)
        try:
            with _open_remote(fs, rpath, size) as src, open(tmp, "r+b") as dst:
                while n < size:
                    if cancel is not None and cancel.is_set():
                        raise DownloadCancelled(f"{redact(url)}: download cancelled")
                    chunk = src.read(want := min(_CHUNK, size - n))
                    dst.write(chunk)
                    h.update(chunk)
                    n += len(chunk)
                    if len(chunk) < want:  # the object ends early (asking past it: an error)
                        break
                dst.flush()
                os.fsync(dst.fileno())
        except FileNotFoundError as e:
            raise StoreError(f"{where}: missing; the remote store is incomplete or was deleted — "
                             "run 'tokenmill prepare' again") from e
        except StoreError:
            raise
        except Exception as e:  # OSError, or a client's own (e.g. aiohttp) error mid-stream
            raise StoreError(f"{where}: download failed ({type(e).__name__}: {redact(str(e))}); "
                             "check the "
                             "network, the endpoint and credentials (AWS_ENDPOINT_URL, "
                             "AWS_ACCESS_KEY_ID, …), then try again") from e
        name = url.rstrip("/").rsplit("/", 1)[-1]
        if n != size:
            raise StoreError(f"{where}: shard file {name} has {n:,} bytes, "
                             f"the manifest records {size:,}; the remote store is corrupt or was "
                             "replaced — run 'tokenmill verify' on it, then 'tokenmill prepare' again")
        if (got := h.hexdigest()) != xxh3:
            raise StoreError(f"{where}: shard file {name} fails its checksum (xxh3 {got}, the manifest "
                             f"records {xxh3}); the remote object is corrupt or was replaced — run "
                             "'tokenmill verify' on it, then 'tokenmill prepare' again")


class RangeReader:
    """A remote file of known ``size`` read by ranged GETs (``cat_file(start, end)``), one per
    ``read``: no HEAD, no LIST (an fsspec file object asks the object's size or ETag first). A
    longer object's tail is never read; a shorter one's end shows as a short read."""

    def __init__(self, fs, rpath: str, size: int):
        self.fs, self.rpath, self.size, self.pos = fs, rpath, size, 0

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release: each read is a request of its own."""

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes from where the last read stopped (b"" at ``size``)."""
        end = min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        data = self.fs.cat_file(self.rpath, start=self.pos, end=end)
        self.pos += len(data)
        return data


def _open_remote(fs, rpath: str, size: int) -> RangeReader:
    """The remote file as a binary stream (a seam for tests that inject a failing stream)."""
    return RangeReader(fs, rpath, size)


def _is_data(name: str) -> bool:
    return not name.startswith(".") and not name.endswith(".lock") and ".tmp-" not in name


def _touch(path: Path) -> bool:
    """Mark ``path`` used now (its mtime orders the LRU); False if it does not exist."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
        return True
    except FileNotFoundError:
        return False


_ACTIVE_TMP: set[Path] = set()  # this process's downloads in progress


@atexit.register
def _at_exit() -> None:
    """Stop background downloads and remove their temporary files. They are not waited for:
    during interpreter exit a new connection can no longer be made (its resolver needs a thread
    pool that is already shut down) and the client would retry for seconds."""
    stop_background_jobs(timeout=0.1)
    for tmp in list(_ACTIVE_TMP):
        tmp.unlink(missing_ok=True)


class RemoteShards:
    """The files of a remote store seen through a ShardCache: fetched on demand (or ahead, when
    asked) and checked against the manifest's size and xxh3 as they land, memory-mapped while
    pinned. Opening costs no request: the store is never listed."""

    def __init__(self, url: str, manifest: dict, *, cache_dir: str | os.PathLike | None = None,
                 cache_bytes: int | str | None = None,
                 storage_options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.cache = ShardCache(cache_dir, cache_bytes, storage_options=storage_options)
        self.files: dict[str, tuple[int, str]] = {}
        for s in manifest["shards"]:
            self.files[f"{s['name']}.bin"] = (int(s["bin_bytes"]), s["bin_xxh3"])
            self.files[f"{s['name']}.idx"] = (int(s["idx_bytes"]), s["idx_xxh3"])
        self._prefetcher = BackgroundJobs("tokenmill-prefetch")

    @property
    def local_dir(self) -> Path:
        """A local directory for files derived from this store (created on first use)."""
        d = self.cache.root / "stores" / url_key(self.url)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def fetch(self, name: str) -> Path:
        """A verified local copy of one of the store's files (not pinned)."""
        size, digest = self.files[name]
        return self.cache.fetch(f"{self.url}/{name}", size, digest)

    def pin(self, name: str) -> Pin:
        """A verified local copy, held in the cache until released."""
        size, digest = self.files[name]
        return self.cache.pin(f"{self.url}/{name}", size, digest)

    def map(self, name: str, dtype) -> np.ndarray:
        """The file as a read-only array; pinned until the array and every view of it are gone."""
        pin = self.pin(name)
        try:
            mm = np.memmap(pin.path, dtype=dtype, mode="r")
        except BaseException:
            pin.release()
            raise
        weakref.finalize(mm, pin.release)
        # a plain ndarray view (fast slicing); it keeps ``mm``, and so the pin, alive
        return mm.view(np.ndarray)

    def prefetch(self, names: list[str]) -> Future:
        """Fetch ``names`` in order in the background; the Future is done when all are cached."""
        def job(cancel: threading.Event) -> list[Path]:
            return [self.cache.fetch(f"{self.url}/{n}", *self.files[n], cancel=cancel)
                    for n in names]
        return self._prefetcher.submit(job)

    def close(self) -> None:
        """Cancel background fetches: queued ones at once, the running one at its next chunk
        (waited for, up to 5 s, so no download of this store outlives it)."""
        self._prefetcher.close(wait=5.0)
