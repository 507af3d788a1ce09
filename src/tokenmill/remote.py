"""Remote stores: a local shard cache shared by processes, and prepare's upload to a URL.

A store may live at any fsspec URL (``s3://bucket/store``, ``gs://…``). Readers download each
shard file once into a local cache and memory-map the cached copy; ``prepare`` stages shards in a
local directory and uploads each one as it finishes, the manifest last. Endpoint and credentials
come from the usual places (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``~/.aws``, …) or from
``storage_options``, passed to fsspec as they are.

The cache directory (``$TOKENMILL_CACHE_DIR``, default ``~/.cache/tokenmill``)::

    shards/
      .lock                            held (exclusive) while usage is counted and entries evicted
      <xxh3>-<size>.bin                a verified copy, named by its content: a store prepared
      <xxh3>-<size>.bin.lock             again with other bytes never hits a stale copy
      <xxh3>-<size>.bin.tmp-<pid>-<n>  a download in progress (or left by a killed process)
    stores/<hash of url>/              per-store local files (e.g. the loader's packed layouts)
    staging/<hash of url>/             prepare --out URL: the shard being written and .progress/

Rules, each held with ``fcntl.flock`` on the entry's ``.lock`` file so that threads and processes
sharing the directory agree:

- a download holds the lock exclusively, writes a temporary file, checks size and xxh3 against the
  manifest, fsyncs and renames: a data file is always complete and verified;
- a reader holds it shared for as long as the file is memory-mapped (a *pin*);
- eviction takes, least recently used first (mtime, set on every use), only entries whose lock it
  gets exclusively without waiting, so a pinned shard is never evicted; usage counts data files
  and downloads in progress (their temporary file is sized up front) against ``max_bytes``;
- a temporary file whose lock nobody holds is debris of a killed download: the next download of
  that entry, or the next eviction pass, deletes it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import itertools
import os
import queue
import re
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import xxhash

from tokenmill.errors import ConfigError, StoreError

CACHE_ENV = "TOKENMILL_CACHE_DIR"
CACHE_BYTES_ENV = "TOKENMILL_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 16 << 30  # 16 GiB: 128 shards of the default 128 MiB
_CHUNK = 8 << 20
RESERVE_WAIT_S = 300.0  # how long a download waits for others in flight to land
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_tmp_counter = itertools.count()
_HEX16 = re.compile(r"[0-9a-f]{16}")
_SHARD_FILE = re.compile(r"shard-(\d+)\.(?:bin|idx)")
_SUFFIX = re.compile(r"(\.[A-Za-z0-9]{1,8})?")


def is_url(path: str | os.PathLike) -> bool:
    """True for an fsspec URL: is_url("s3://b/store") and not is_url("store/")."""
    return "://" in os.fspath(path)


def default_cache_dir() -> Path:
    """``$TOKENMILL_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenmill``, else ``~/.cache/tokenmill``."""
    if env := os.environ.get(CACHE_ENV):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenmill"


def parse_bytes(value: int | str) -> int:
    """A size in bytes from an int or a string with a binary suffix: parse_bytes("2G") == 2**31."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in _UNITS else ""
        try:
            n = int(float(text[:len(text) - len(unit)]) * _UNITS[unit])
        except ValueError:
            raise ConfigError(f"cache size must be bytes or a size like '16G' (got {value!r})") from None
    if n < 1:
        raise ConfigError(f"cache size must be >= 1 byte (got {value!r})")
    return n


def url_key(url: str) -> str:
    """A short stable name for a URL, for per-store local directories."""
    return xxhash.xxh3_64_hexdigest(url.rstrip("/").encode())


def _fs(url: str, storage_options: Mapping[str, Any] | None):
    try:
        import fsspec.core
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as e:  # e.g. s3fs missing for s3://
        raise StoreError(f"{url}: cannot open ({e}); install the backend, e.g. "
                         "pip install 'tokenmill[s3]'") from e


# ---- file locks -----------------------------------------------------------------------------

def _lock(path: Path, mode: int, *, wait: bool = True) -> int | None:
    """An fd holding ``flock(mode)`` on ``path`` (created if missing); None if busy and not wait.

    The lock file may be unlinked by an evictor holding it exclusively; an fd locked on an
    unlinked inode protects nothing, so check the inode and retry.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _unlock(fd: int) -> None:
    os.close(fd)  # closing the last fd of the open file description drops the flock


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
                _unlock(self._fd)
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
        self.max_bytes = parse_bytes(max_bytes if max_bytes is not None else env or DEFAULT_CACHE_BYTES)
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
        fd = _lock(self._lock_path(name), fcntl.LOCK_EX)
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
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            finally:
                _ACTIVE_TMP.discard(tmp)
            _touch(path)
            return path
        finally:
            _unlock(fd)

    def pin(self, url: str, size: int, xxh3: str) -> Pin:
        """Like ``fetch``, and hold the file in place (shared lock) until the Pin is released."""
        name = self.entry_name(url, size, xxh3)
        for _ in range(8):
            path = self.fetch(url, size, xxh3)
            fd = _lock(self._lock_path(name), fcntl.LOCK_SH)
            if _touch(path):
                return Pin(path, fd)
            _unlock(fd)  # evicted between fetch and lock: the cache is thrashing; try again
        raise CacheFullError(f"{self.root}: {url} was evicted 8 times before it could be pinned; "
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
        """Bytes held: verified files plus downloads in progress."""
        total = 0
        for p in self.dir.iterdir():
            if _is_data(p.name) or ".tmp-" in p.name:
                with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                    total += p.stat().st_size
        return total

    @staticmethod
    def entry_name(url: str, size: int, xxh3: str) -> str:
        """The cache file name of a remote file: its checksum, size and extension.

        ShardCache.entry_name("s3://b/s/shard-00000.bin", 10, "0123456789abcdef")
            == "0123456789abcdef-10.bin"
        """
        if not _HEX16.fullmatch(str(xxh3)) or isinstance(size, bool) or int(size) != size or size < 0:
            raise StoreError(f"{url}: the manifest records size {size!r} and xxh3 {xxh3!r}; "
                             "expected a byte count and 16 hex digits — the manifest is corrupt")
        suffix = os.path.splitext(url.rstrip("/").rsplit("/", 1)[-1])[1]
        if not _SUFFIX.fullmatch(suffix):
            suffix = ""
        return f"{xxh3}-{int(size)}{suffix}"

    # ---- internals --------------------------------------------------------------------------

    def _lock_path(self, name: str) -> Path:
        return self.dir / f"{name}.lock"

    def _pinned(self, name: str) -> bool:
        fd = _lock(self._lock_path(name), fcntl.LOCK_EX, wait=False)
        if fd is None:
            return True
        _unlock(fd)
        return False

    def _reserve(self, tmp: Path, size: int, url: str) -> None:
        """Evict least recently used unpinned files until ``size`` more bytes fit, then create
        ``tmp`` at its full size so concurrent downloads count it too. While other downloads are
        in flight (they become evictable when they land) wait for them, up to RESERVE_WAIT_S."""
        if size > self.max_bytes:
            raise CacheFullError(f"{url}: {size:,} bytes is more than the whole cache "
                                 f"({self.max_bytes:,} bytes at {self.root}); raise "
                                 f"{CACHE_BYTES_ENV} or cache_bytes")
        deadline = time.monotonic() + RESERVE_WAIT_S
        while True:
            fd = _lock(self.dir / ".lock", fcntl.LOCK_EX)
            try:
                used, inflight = self._evict_until(self.max_bytes - size)
                if used + size <= self.max_bytes:
                    with open(tmp, "wb") as f:
                        f.truncate(size)
                    return
                if not inflight or time.monotonic() > deadline:
                    raise CacheFullError(
                        f"{url}: needs {size:,} bytes in the cache at {self.root}, but {used:,} of "
                        f"its {self.max_bytes:,} bytes are pinned by open stores or downloads in "
                        f"progress; raise {CACHE_BYTES_ENV} (or cache_bytes=), or close stores "
                        "you no longer read")
            finally:
                _unlock(fd)
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

    def _stale_tmp(self, tmp: Path) -> bool:
        """Delete ``tmp`` if no download holds its entry's lock; True if it was stale."""
        fd = _lock(self._lock_path(tmp.name.split(".tmp-")[0]), fcntl.LOCK_EX, wait=False)
        if fd is None:
            return False
        try:
            tmp.unlink(missing_ok=True)
            return True
        finally:
            _unlock(fd)

    def _evict(self, name: str) -> bool:
        fd = _lock(self._lock_path(name), fcntl.LOCK_EX, wait=False)
        if fd is None:  # pinned by a reader
            return False
        try:
            (self.dir / name).unlink(missing_ok=True)
            self._lock_path(name).unlink(missing_ok=True)
            return True
        finally:
            _unlock(fd)

    def _download(self, url: str, tmp: Path, size: int, xxh3: str,
                  cancel: threading.Event | None = None) -> None:
        fs, rpath = _fs(url, self.storage_options)
        h, n = xxhash.xxh3_64(), 0
        try:
            with _open_remote(fs, rpath) as src, open(tmp, "r+b") as dst:
                while n <= size and (chunk := src.read(_CHUNK)):
                    if cancel is not None and cancel.is_set():
                        raise DownloadCancelled(f"{url}: download cancelled")
                    dst.write(chunk)
                    h.update(chunk)
                    n += len(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        except FileNotFoundError as e:
            raise StoreError(f"{url}: missing; the remote store is incomplete or was deleted — "
                             "run 'tokenmill prepare' again") from e
        except StoreError:
            raise
        except Exception as e:  # OSError, or a client's own (e.g. aiohttp) error mid-stream
            raise StoreError(f"{url}: download failed ({type(e).__name__}: {e}); check the "
                             "network, the endpoint and credentials (AWS_ENDPOINT_URL, "
                             "AWS_ACCESS_KEY_ID, …), then try again") from e
        name = url.rstrip("/").rsplit("/", 1)[-1]
        if n != size:
            raise StoreError(f"{url}: shard file {name} has {n:,}{'+' if n > size else ''} bytes, "
                             f"the manifest records {size:,}; the remote store is corrupt or was "
                             "replaced — run 'tokenmill verify' on it, then 'tokenmill prepare' again")
        if (got := h.hexdigest()) != xxh3:
            raise StoreError(f"{url}: shard file {name} fails its checksum (xxh3 {got}, the manifest "
                             f"records {xxh3}); the remote object is corrupt or was replaced — run "
                             "'tokenmill verify' on it, then 'tokenmill prepare' again")


def _open_remote(fs, rpath: str):
    """The remote file as a binary stream (a seam for tests that inject a failing stream)."""
    return fs.open(rpath, "rb", block_size=_CHUNK)


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


# ---- reading a remote store -----------------------------------------------------------------

def read_bytes(url: str, storage_options: Mapping[str, Any] | None) -> bytes | None:
    """The whole object at ``url``; None if it does not exist."""
    fs, rpath = _fs(url, storage_options)
    try:
        return fs.cat_file(rpath)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StoreError(f"{url}: cannot read ({e}); check the URL, the endpoint and "
                         "credentials (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, …)") from e


def list_sizes(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, int]:
    """File name → size of the objects directly under ``url`` (fresh, not from fsspec's cache)."""
    fs, root = _fs(url, storage_options)
    fs.invalidate_cache(root)
    try:
        infos = fs.ls(root, detail=True)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise StoreError(f"{url}: cannot list ({e}); check the URL, the endpoint and "
                         "credentials (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, …)") from e
    return {i["name"].rstrip("/").rsplit("/", 1)[-1]: int(i.get("size") or 0)
            for i in infos if i.get("type") != "directory"}


class Prefetcher:
    """One daemon thread that runs fetch jobs in order; a job's Future carries its outcome.

    Jobs are called with a ``threading.Event`` that ``close()`` sets (downloads stop between
    chunks and remove their temporary file). At interpreter exit every prefetcher is closed and
    the temporary files of downloads still running are removed.
    """

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._guard = threading.Lock()
        self.cancel = threading.Event()
        _LIVE.add(self)

    def submit(self, job: Callable[[threading.Event], Any]) -> Future:
        """Run ``job(cancel_event)`` in the background thread."""
        fut: Future = Future()
        with self._guard:
            if self._closed:
                fut.cancel()
                return fut
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tokenmill-prefetch",
                                                daemon=True)
                self._thread.start()
            self._jobs.put((job, fut))
        return fut

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(job(self.cancel))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)

    def close(self, wait: float = 0.0) -> None:
        """Cancel queued jobs, stop the running one at its next chunk, wait up to ``wait`` s."""
        with self._guard:
            self._closed = True
            self.cancel.set()
            while True:
                try:
                    item = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[1].cancel()
            if self._thread is not None:
                self._jobs.put(None)
        self.join(wait)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the background thread to finish."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and timeout > 0:
            thread.join(timeout)


_LIVE: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()
_ACTIVE_TMP: set[Path] = set()  # this process's downloads in progress


@atexit.register
def _at_exit() -> None:
    """Stop background downloads and remove their temporary files. They are not waited for:
    during interpreter exit a new connection can no longer be made (its resolver needs a thread
    pool that is already shut down) and the client would retry for seconds."""
    live = list(_LIVE)
    for p in live:
        p.close(wait=0)
    deadline = time.monotonic() + 0.1
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
    for tmp in list(_ACTIVE_TMP):
        tmp.unlink(missing_ok=True)


class RemoteShards:
    """The files of a remote store seen through a ShardCache: size-checked at open, fetched on
    demand or ahead in a background thread, memory-mapped while pinned."""

    def __init__(self, url: str, manifest: dict, *, cache_dir: str | os.PathLike | None = None,
                 cache_bytes: int | str | None = None,
                 storage_options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.cache = ShardCache(cache_dir, cache_bytes, storage_options=storage_options)
        self.files: dict[str, tuple[int, str]] = {}
        for s in manifest["shards"]:
            self.files[f"{s['name']}.bin"] = (int(s["bin_bytes"]), s["bin_xxh3"])
            self.files[f"{s['name']}.idx"] = (int(s["idx_bytes"]), s["idx_xxh3"])
        self._check_sizes(list_sizes(self.url, storage_options))
        self._prefetcher = Prefetcher()

    @property
    def local_dir(self) -> Path:
        """A local directory for files derived from this store (created on first use)."""
        d = self.cache.root / "stores" / url_key(self.url)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _check_sizes(self, sizes: dict[str, int]) -> None:
        for name, (size, _) in self.files.items():
            got = sizes.get(name)
            if got is None:
                raise StoreError(f"{self.url}/{name}: missing; the remote store is incomplete — "
                                 "run 'tokenmill prepare' again, or 'tokenmill verify' on it")
            if got != size:
                raise StoreError(f"{self.url}/{name}: expected {size:,} bytes, found {got:,}; the "
                                 "shard is truncated or was replaced — run 'tokenmill verify' on "
                                 "the store, then 'tokenmill prepare' again")

    def fetch(self, name: str) -> Path:
        """A verified local copy of one of the store's files (not pinned)."""
        size, digest = self.files[name]
        return self.cache.fetch(f"{self.url}/{name}", size, digest)

    def fetch_many(self, names: list[str], threads: int = 8) -> None:
        """Fetch several files at once (small files: the index of every shard at open)."""
        if len(names) <= 1:
            for n in names:
                self.fetch(n)
            return
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(min(threads, len(names)), thread_name_prefix="tokenmill-fetch") as ex:
            for _ in ex.map(self.fetch, names):
                pass

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


# ---- prepare --out URL ------------------------------------------------------------------------

class RemoteOut:
    """Where ``prepare(out="s3://…")`` puts a store: staged locally, uploaded shard by shard in a
    background thread, the manifest last (a remote store without one is incomplete)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = _fs(self.url, self.storage_options)
        self.staging = default_cache_dir() / "staging" / url_key(self.url)
        self._listing: dict[str, int] | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=2)  # bounds staged, unuploaded shards
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _rpath(self, name: str) -> str:
        return f"{self.root}/{name}"

    def sizes(self) -> dict[str, int]:
        """Object sizes under the URL, listed once and remembered."""
        if self._listing is None:
            self._listing = list_sizes(self.url, self.storage_options)
        return self._listing

    def manifest_text(self) -> bytes | None:
        """The remote manifest's bytes, or None."""
        from tokenmill.store import MANIFEST
        return read_bytes(f"{self.url}/{MANIFEST}", self.storage_options)

    def foreign_files(self) -> list[str]:
        """Objects under the URL that no store writes."""
        from tokenmill.store import MANIFEST
        return sorted(n for n in self.sizes() if n != MANIFEST and not n.startswith("shard-"))

    def clear(self) -> None:
        """Delete the remote store: manifest first (so it reads as incomplete), then shards."""
        from tokenmill.store import MANIFEST
        names = self.sizes()
        if MANIFEST in names:
            self.fs.rm_file(self._rpath(MANIFEST))
        for n in names:
            if n.startswith("shard-"):
                self.fs.rm_file(self._rpath(n))
        self._listing = None

    def remove_from(self, first_shard: int) -> None:
        """Delete shard objects numbered ``first_shard`` and up (uploads never committed)."""
        for n in list(self.sizes()):
            if (m := _SHARD_FILE.fullmatch(n)) and int(m[1]) >= first_shard:
                self.fs.rm_file(self._rpath(n))
        self._listing = None

    def has_shard(self, info) -> bool:
        """Both files of a committed shard are in place at their recorded sizes."""
        sizes = self.sizes()
        return (sizes.get(f"{info.name}.bin") == info.bin_bytes and
                sizes.get(f"{info.name}.idx") == info.idx_bytes)

    def submit(self, staging: Path, info, on_uploaded: Callable[[], None]) -> None:
        """Upload a finished shard in the background, then call ``on_uploaded`` (which commits it)
        and delete the staged files; raises an earlier upload's error."""
        self._raise_error()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokenmill-upload", daemon=True)
            self._thread.start()
        while True:  # wait for room, but notice if the uploader died meanwhile
            try:
                self._queue.put((staging, info, on_uploaded), timeout=0.5)
                break
            except queue.Full:
                self._raise_error()

    def drain(self) -> None:
        """Wait until every submitted shard is uploaded; raises an upload's error."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._raise_error()

    def abort(self) -> None:
        """Stop after the upload in progress; queued shards stay staged and uncommitted."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue
            staging, info, on_uploaded = item
            try:
                self.upload_shard(staging, info)
                on_uploaded()
                for ext in (".bin", ".idx"):
                    (staging / f"{info.name}{ext}").unlink(missing_ok=True)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                self._error = e

    def upload_shard(self, staging: Path, info) -> None:
        """Upload ``.bin`` and ``.idx``, then check each object's size (and MD5 ETag if single-part)."""
        for ext, size in ((".bin", info.bin_bytes), (".idx", info.idx_bytes)):
            local, rpath = staging / f"{info.name}{ext}", self._rpath(f"{info.name}{ext}")
            url = f"{self.url}/{info.name}{ext}"
            try:
                self.fs.put_file(str(local), rpath)
                self.fs.invalidate_cache(rpath)
                remote = self.fs.info(rpath)
            except OSError as e:
                raise StoreError(f"{url}: upload failed ({e}); check the endpoint and credentials "
                                 "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, …), then run the same "
                                 "prepare again to resume") from e
            if int(remote.get("size") or 0) != size:
                raise StoreError(f"{url}: uploaded {size:,} bytes, the object has "
                                 f"{remote.get('size')}; run the same prepare again to resume")
            etag = str(remote.get("ETag") or remote.get("etag") or "").strip('"')
            if len(etag) == 32 and "-" not in etag and etag != _md5_file(local):
                raise StoreError(f"{url}: the object's MD5 (ETag {etag}) differs from the staged "
                                 f"file's; the upload was corrupted — run the same prepare again")

    def write_manifest(self, data: bytes) -> None:
        """Put the manifest: the last write of a prepare, after every shard is uploaded."""
        from tokenmill.store import MANIFEST
        self.fs.pipe_file(self._rpath(MANIFEST), data)
        self._listing = None


def _md5_file(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
