"""Small I/O helpers every layer may use: URLs (fsspec, resolved in one place), atomic writes,
memory maps, checksums (also watched in the background), sizes, credential redaction, file locks
and a background-jobs thread.

Nothing here imports from tokenmill except ``errors``. fsspec is imported on first use of a URL,
so local-only work never pays for it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import errno
import fcntl
import io
import json
import mmap
import os
import queue
import secrets
import stat
import threading
import time
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, NamedTuple

import numpy as np
import xxhash

from tokenmill.base.errors import (ConfigError, DiskFullError, StoreError,  # noqa: F401 (io.redact is public)
                                   TokenmillError, redact)
from tokenmill.base.procs import after_fork

CHUNK = 8 << 20  # checksums and copies read 8 MiB at a time
READ_BUFFER = 1 << 20  # buffered readers of inputs: memory stays bounded whatever the unit size
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # disk full, quota, file-size limit

# ---- URLs -----------------------------------------------------------------------------------


def is_url(path: str | os.PathLike) -> bool:
    """True for an fsspec URL: is_url("s3://b/store") and not is_url("store/")."""
    return "://" in os.fspath(path)


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None):
    """``(fs, path)`` for an fsspec URL: the one place a URL is resolved to a filesystem.

    A missing backend (``s3fs`` for ``s3://``, …) is a ConfigError (a ValueError) that says what
    to install; the URL in the message has its credentials redacted.
    """
    try:
        import fsspec.core
        return fsspec.core.url_to_fs(os.fspath(url), **(storage_options or {}))
    except ImportError as e:
        hint = ("pip install huggingface_hub" if os.fspath(url).startswith("hf://")
                else "install the fsspec backend it names (for s3://: pip install 'tokenmill[s3]')")
        raise ConfigError(f"{redact(os.fspath(url))}: cannot open ({e}); {hint}") from e


@contextlib.contextmanager
def backend_errors(url: str) -> Iterator[None]:
    """Turn a storage backend's own exception types (botocore's NoCredentialsError,
    EndpointConnectionError, …: not OSErrors) into an OSError naming the URL, so every caller's
    OSError handling applies; tokenmill's own errors pass through."""
    try:
        yield
    except (OSError, TokenmillError):
        raise
    except Exception as e:  # any backend type: there is no common base class to name
        raise OSError(errno.EIO, f"{type(e).__name__}: {e}", redact(url)) from e


def open_binary(path: str, storage_options: Mapping[str, Any] | None = None) -> BinaryIO:
    """A buffered binary file object: plain ``open`` for local paths, fsspec for URLs."""
    if not is_url(path):
        return open(path, "rb", buffering=READ_BUFFER)
    fs, p = filesystem(path, storage_options)
    with backend_errors(path):
        # fsspec's files lack readline(size), which the byte-range readers use: buffer them
        return io.BufferedReader(fs.open(p, "rb"), buffer_size=READ_BUFFER)


def file_size(path: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """Size in bytes of a local file or a URL."""
    if not is_url(path):
        return os.path.getsize(path)
    fs, p = filesystem(path, storage_options)
    with backend_errors(path):
        return int(fs.size(p))


def read_bytes(url: str, storage_options: Mapping[str, Any] | None = None, *,
               one_request: bool = False) -> bytes | None:
    """The whole object at ``url``; None if it does not exist. ``one_request``: one GET of
    ``bytes=0-``, for an object that is never empty (a manifest): s3fs asks the size (a HEAD)
    before a plain whole-object read, and S3 refuses that range for an empty object."""
    fs, rpath = filesystem(url, storage_options)
    try:
        with backend_errors(url):
            return fs.cat_file(rpath, start=0) if one_request else fs.cat_file(rpath)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StoreError(redact(f"{url}: cannot read ({e}); check the URL, the endpoint and "
                                "credentials (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, …)")) from e


def list_sizes(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, int]:
    """File name → size of the objects directly under ``url`` (fresh, not from fsspec's cache).

    A listing without sizes (a plain HTTP server's index page) costs one HEAD per file instead."""
    fs, root = filesystem(url, storage_options)
    fs.invalidate_cache(root)
    try:
        with backend_errors(url):
            infos = fs.ls(root, detail=True)
            return {i["name"].rstrip("/").rsplit("/", 1)[-1]: _size_of(fs, i)
                    for i in infos if i.get("type") != "directory"}
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise StoreError(redact(f"{url}: cannot list ({e}); check the URL, the endpoint and "
                                "credentials (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, …)")) from e


def _size_of(fs, info: Mapping[str, Any]) -> int:
    """A listed file's size; asked of the server (HEAD) when the listing has none; 0 if the
    server will not say either."""
    if info.get("size") is not None:
        return int(info["size"])
    try:
        return int(fs.size(info["name"]) or 0)
    except FileNotFoundError:  # listed, yet gone (or an index page's link to elsewhere)
        return 0


# ---- writing --------------------------------------------------------------------------------


@contextlib.contextmanager
def no_space_is_a_store_error(path: str | os.PathLike) -> Iterator[None]:
    """Turn a full disk (or quota, or file-size limit) while writing ``path`` into a DiskFullError
    that says so and what to do; other errors pass through."""
    try:
        yield
    except OSError as e:
        if e.errno not in _NO_SPACE:
            raise
        reason = os.strerror(e.errno)
        raise DiskFullError(f"{path}: cannot write ({reason}): the disk is full; free some space "
                            "and run the same command again (it resumes where it stopped)",
                            path=str(path), reason=reason) from e


def temp_name(path: str | os.PathLike) -> Path:
    """A temporary sibling of ``path`` unique to this writer (pid and 32 random bits)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` only if the block ends without an error: written under
    a temporary name unique to the writer, fsynced and renamed into place; removed on failure.

    with atomic_output("out.bin") as f: f.write(b"…")
    """
    path = Path(path)
    check_replaceable(path)
    tmp = temp_name(path)
    try:
        with no_space_is_a_store_error(path), open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        check_replaceable(path)  # again: the writing may have taken long
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def special_kind(mode: int) -> str | None:
    """What a file of this ``st_mode`` is when it is not a regular file, in words; else None.

    special_kind(stat.S_IFIFO) == "a named pipe (FIFO)"
    """
    return next((what for test, what in _KINDS if test(mode)), None)


def check_replaceable(path: str | os.PathLike) -> None:
    """Refuse an output path that holds anything but a regular file: the rule of every atomic
    writer. A symbolic link (to anything, or dangling), a FIFO, a socket, a device or a directory
    is a ConfigError saying what it is; it is never replaced, nor written through."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    what = special_kind(st.st_mode)
    if what is None:
        return
    target = f" to {os.readlink(path)}" if stat.S_ISLNK(st.st_mode) else ""
    raise ConfigError(f"{path}: is {what}{target}, not a regular file; outputs are written to a "
                      "temporary file renamed into place, which would replace it: name a regular "
                      "file (for a link, its target)")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename; on failure the
    temporary file is removed."""
    with atomic_output(path) as f:
        f.write(data)


def json_bytes(obj: Any) -> bytes:
    """``obj`` as indented, key-sorted JSON with a final newline (how manifests are written)."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON, atomically."""
    atomic_write_bytes(path, json_bytes(obj))


# ---- reading --------------------------------------------------------------------------------


def xxh3_file(path: str | os.PathLike, cancel: threading.Event | None = None,
              storage_options: Mapping[str, Any] | None = None) -> str | None:
    """xxh3-64 hex digest of a whole file (local, or a URL read through fsspec), read in 8 MiB
    chunks; None if ``cancel`` is set before the end."""
    h = xxhash.xxh3_64()
    with (open_binary(os.fspath(path), storage_options) if is_url(path) else open(path, "rb")
          ) as f, backend_errors(os.fspath(path)):
        while chunk := f.read(CHUNK):
            if cancel is not None and cancel.is_set():
                return None
            h.update(chunk)
    return h.hexdigest()


class FileId(NamedTuple):
    """What tells one file from another at the same path: a file written to a temporary name
    and renamed over it (as prepare does) has another inode, and a rewrite another mtime."""

    dev: int
    ino: int
    size: int
    mtime_ns: int


def file_id(st: os.stat_result) -> FileId:
    """The identity of a file from its ``stat`` or ``fstat``."""
    return FileId(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


StatCheck = Callable[[os.stat_result], None]  # called with a file's fstat; raises to refuse it


def map_file(path: str | os.PathLike, dtype: Any, *, check: StatCheck | None = None
             ) -> np.ndarray:
    """A read-only array over a whole non-empty local file, memory-mapped (one map, holding one
    descriptor until the array and every view of it are gone); ~10 µs, np.memmap takes ~50.
    ``check``, if given, is called with the ``fstat`` of the very file mapped, before mapping
    it (raise to refuse it: e.g. a file replaced since it was first seen)."""
    with open(path, "rb") as f:
        if check is not None:
            check(os.fstat(f.fileno()))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mm, dtype=dtype)


def parse_bytes(value: int | str, *, what: str = "size") -> int:
    """A size in bytes from an int or a string with a binary suffix: parse_bytes("2G") == 2**31."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in _UNITS else ""
        try:
            n = int(float(text[:len(text) - len(unit)]) * _UNITS[unit])
        except ValueError:
            raise ConfigError(f"{what} must be bytes or a size like '16G' "
                              f"(got {value!r})") from None
    if n < 1:
        raise ConfigError(f"{what} must be >= 1 byte (got {value!r})")
    return n


# ---- file locks -----------------------------------------------------------------------------


def lock_file(path: str | os.PathLike, *, exclusive: bool = True, wait: bool = True) -> int | None:
    """An fd holding ``flock`` on ``path`` (created if missing); None if busy and not ``wait``.

    Release it with ``unlock(fd)``. A lock file may be unlinked by another holder (a cache
    evicting an entry); an fd locked on an unlinked inode protects nothing, so check the inode
    and retry.
    """
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, mode)
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


def unlock(fd: int) -> None:
    """Release a lock taken by ``lock_file`` (closing the fd drops the flock)."""
    os.close(fd)


# ---- background jobs ------------------------------------------------------------------------


class QueuedJob(NamedTuple):
    """One queued background job and the Future that carries its outcome."""

    run: Callable[[threading.Event], Any]
    future: Future


class BackgroundJobs:
    """One daemon thread that runs jobs in order; a job's Future carries its outcome.

    Jobs are called with a ``threading.Event`` that ``close()`` sets (a download or a checksum
    stops between chunks). The thread starts with the first job; ``close()`` ends it. At
    interpreter exit every instance is closed.
    """

    def __init__(self, name: str = "tokenmill-background"):
        self.name = name
        self._closed = False
        self.cancel = threading.Event()
        _LIVE_JOBS.add(self)
        after_fork(self)  # its thread, queue and guard: made afresh in a forked child

    def submit(self, job: Callable[[threading.Event], Any]) -> Future:
        """Run ``job(cancel_event)`` in the background thread."""
        fut: Future = Future()
        with self._guard:
            if self._closed:
                fut.cancel()
                return fut
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put(QueuedJob(job, fut))
        return fut

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            if not item.future.set_running_or_notify_cancel():
                continue
            try:
                item.future.set_result(item.run(self.cancel))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                item.future.set_exception(e)

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
                    item.future.cancel()
            if self._thread is not None:
                self._jobs.put(None)
        self.join(wait)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the background thread to finish."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and timeout > 0:
            thread.join(timeout)

    def after_fork(self) -> None:
        """No thread, no jobs (in a forked child: the parent's queued then never run here)."""
        self._guard, self._thread = threading.Lock(), None
        self._jobs: queue.Queue[QueuedJob | None] = queue.Queue()


_LIVE_JOBS: "weakref.WeakSet[BackgroundJobs]" = weakref.WeakSet()


def stop_background_jobs(timeout: float = 0.1) -> None:
    """Close every BackgroundJobs of the process, waiting at most ``timeout`` s in all."""
    live = list(_LIVE_JOBS)
    for jobs in live:
        jobs.close(wait=0)
    deadline = time.monotonic() + timeout
    for jobs in live:
        jobs.join(max(0.0, deadline - time.monotonic()))


atexit.register(stop_background_jobs)


# ---- checksums of files in use ----------------------------------------------------------------

# (device, inode, size, mtime, expected xxh3) → "" when the file matched, else the problem: a
# file is checked once per process, again only once it is replaced or rewritten
_CHECKED: dict[tuple, str] = {}
_CHECKED_LOCK = threading.Lock()


class ChecksumWatch:
    """Checks files against their expected xxh3 in a background thread, each file once per
    process; a mismatch is kept in ``failure`` (a message naming the file) for the reader to
    raise at its next read.

    ``watch = ChecksumWatch(); watch.add(path, xxh3); …; watch.wait(); watch.failure`` is None
    while every file checked so far matches.
    """

    def __init__(self, *, enabled: bool = True, hint: str = ""):
        self.enabled = enabled
        self.hint = hint
        self.failure: str | None = None
        self._jobs: BackgroundJobs | None = None
        self._pending: list[Future] = []

    def add(self, path: str | os.PathLike, xxh3: str) -> None:
        """Check ``path`` against ``xxh3`` soon, unless it was checked already in this process."""
        if not self.enabled:
            return
        try:
            st = os.stat(path)
        except OSError:
            return  # reading it reports that
        key = (*file_id(st), xxh3)
        with _CHECKED_LOCK:
            known = _CHECKED.get(key)
        if known is not None:
            self._fail(known)
            return
        if self._jobs is None:
            self._jobs = BackgroundJobs("tokenmill-checksums")
        if len(self._pending) >= 64:
            self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._jobs.submit(lambda cancel: self._check(path, key, cancel)))

    def _check(self, path, key: tuple, cancel: threading.Event) -> None:
        got = xxh3_file(path, cancel)
        if got is None:
            return
        want = key[-1]
        problem = "" if got == want else (f"{path}: checksum mismatch (xxh3 {got}, the manifest "
                                          f"records {want}): the file changed after it was "
                                          f"written{self.hint}")
        with _CHECKED_LOCK:
            _CHECKED[key] = problem
        self._fail(problem)

    def _fail(self, problem: str) -> None:
        if problem and self.failure is None:
            self.failure = problem

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the checks under way are done (or ``timeout`` s)."""
        concurrent.futures.wait(list(self._pending), timeout=timeout)

    def close(self) -> None:
        """Stop: queued checks are dropped, the running one ends at its next chunk (waited for,
        up to 5 s, so no file of the caller stays open)."""
        if self._jobs is not None:
            self._jobs.close(wait=5.0)

    def __del__(self):
        if self._jobs is not None:  # let the thread end with its last owner
            self._jobs.close(wait=0)
