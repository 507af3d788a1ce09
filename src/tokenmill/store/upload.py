"""Writing a store to a URL: ``prepare(out="s3://…")`` stages each shard locally and uploads it
as it finishes, in a background thread; the manifest goes last (a remote store without one is
incomplete). Endpoint and credentials come from the usual places or from ``storage_options``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from tokenmill.base.errors import ConcurrentWriterError, StoreError
from tokenmill.base.io import CHUNK, filesystem, json_bytes, list_sizes, read_bytes, redact
from tokenmill.base.procs import running
from tokenmill.store.cache import default_cache_dir, url_key
from tokenmill.store.format import MANIFEST


class RemoteOut:
    """Where ``prepare(out="s3://…")`` puts a store: staged locally, uploaded shard by shard in a
    background thread, the manifest last (a remote store without one is incomplete)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = filesystem(self.url, self.storage_options)
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
        return read_bytes(f"{self.url}/{MANIFEST}", self.storage_options)

    def clear(self) -> None:
        """Delete the remote store: manifest first (so it reads as incomplete), then shards."""
        names = self.sizes()
        if MANIFEST in names:
            self.fs.rm_file(self._rpath(MANIFEST))
        for n in names:
            if n.startswith("shard-"):
                self.fs.rm_file(self._rpath(n))
        self._listing = None

    def has_shard(self, info) -> bool:
        """Every file of a committed shard is in place at its recorded size."""
        sizes = self.sizes()
        return all(sizes.get(name) == size for name, size, _ in info.file_sums())

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
                for name in info.files():
                    (staging / name).unlink(missing_ok=True)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                self._error = e

    def upload_shard(self, staging: Path, info) -> None:
        """Upload the shard's files, then check each object's size (and MD5 ETag if single-part)."""
        for name, size, _ in info.file_sums():
            local, rpath = staging / name, self._rpath(name)
            url = redact(f"{self.url}/{name}")
            with upload_errors(url):
                self.fs.put_file(str(local), rpath)
                self.fs.invalidate_cache(rpath)
                remote = self.fs.info(rpath)
            if int(remote.get("size") or 0) != size:
                raise StoreError(f"{url}: uploaded {size:,} bytes, the object has "
                                 f"{remote.get('size')}; run the same prepare again to resume")
            etag = str(remote.get("ETag") or remote.get("etag") or "").strip('"')
            if len(etag) == 32 and "-" not in etag and etag != _md5_file(local):
                raise StoreError(f"{url}: the object's MD5 (ETag {etag}) differs from the staged "
                                 f"file's; the upload was corrupted — run the same prepare again")

    def write_manifest(self, data: bytes) -> None:
        """Put the manifest: the last write of a prepare, after every shard is uploaded."""
        with upload_errors(redact(f"{self.url}/{MANIFEST}")):
            self.fs.pipe_file(self._rpath(MANIFEST), data)
        self._listing = None


@contextlib.contextmanager
def upload_errors(url: str) -> Iterator[None]:
    """Turn a failed write to ``url`` (an OSError, or the client's own error, e.g. aiohttp's for
    an HTTP URL) into a StoreError naming it, credentials redacted."""
    try:
        yield
    except StoreError:
        raise
    except Exception as e:  # noqa: BLE001 - each client has its own errors
        raise StoreError(f"{url}: upload failed ({type(e).__name__}: {redact(str(e))}); check the "
                         "URL (can it be written?), the endpoint and credentials "
                         "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, …), then run the same prepare "
                         "again to resume") from e


def _md5_file(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


# ---- a URL output's lock ------------------------------------------------------------------------

LEASE = ".lease.json"  # a URL output's lock (see Lease)
LEASE_S = 120.0


class Lease:
    """A URL output's claim on other machines: ``<url>/.lease.json`` ({"pid", "host", "token",
    "expires"}), renewed every LEASE_S / 4 seconds while held, deleted on release. Object stores
    have no flock; a writer whose lease is live is refused (clocks must roughly agree), unless its
    process is known dead: taken on this machine by a pid that no longer runs."""

    def __init__(self, remote: RemoteOut, where: str):
        self.remote, self.url = remote, f"{remote.url}/{LEASE}"
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "token": secrets.token_hex(8)}
        held = self.read()
        if held and held.get("expires", 0) > time.time() and not self.dead(held):
            until = time.strftime("%H:%M:%S", time.localtime(held["expires"]))
            raise ConcurrentWriterError(
                f"{where}: another tokenmill process (pid {held.get('pid')} on "
                f"{held.get('host')}) is writing this store right now (its lease runs until "
                f"{until} unless renewed); wait for it to finish (if it died, rerun after that "
                "time), or choose another --out", path=where, pid=held.get("pid"))
        with upload_errors(redact(self.url)):  # e.g. an HTTP server that takes no PUT
            remote.fs.makedirs(remote.root, exist_ok=True)  # a no-op on object stores
        self.write()
        self.stop = threading.Event()
        threading.Thread(target=self.renew, daemon=True, name="tokenmill-lease").start()

    def dead(self, held: dict) -> bool:
        """A lease taken on this machine by a process that is gone (killed: never released)."""
        if held.get("host") != self.me["host"] or not isinstance(held.get("pid"), int):
            return False
        return not running(held["pid"])

    def read(self) -> dict | None:
        """The lease in the bucket, if any."""
        try:
            data = read_bytes(self.url, self.remote.storage_options)
            return json.loads(data) if data else None
        except ValueError:
            return None

    def write(self) -> None:
        """Put our lease, good for LEASE_S seconds."""
        with upload_errors(redact(self.url)):
            self.remote.fs.pipe_file(f"{self.remote.root}/{LEASE}",
                                     json_bytes({**self.me, "expires": time.time() + LEASE_S}))

    def renew(self) -> None:
        """Keep the lease alive until released."""
        while not self.stop.wait(LEASE_S / 4):
            try:
                self.write()
            except StoreError:  # a blip: the next renewal tries again
                pass

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours."""
        self.stop.set()
        if (self.read() or {}).get("token") == self.me["token"]:
            with upload_errors(redact(self.url)):
                self.remote.fs.rm_file(f"{self.remote.root}/{LEASE}")
