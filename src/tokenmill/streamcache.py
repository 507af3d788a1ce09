"""Streaming mode, the cache: the pass's documents written as a store, resumably, by one process.

Documents are written to ``cache_dir/stream-<key>/`` with the ShardWriter, shard size and
settings of ``prepare`` — the store is byte-identical to ``prepare(inputs, out=…)`` with the same
options — and ``.stream-progress.json`` is committed after each shard, so a crashed pass resumes
its writing; the manifest comes last. One process writes a cache (an flock on
``stream-<key>.lock``, released by the kernel if it dies); the others stream too and wait for
its manifest at the end of the pass, or take the lock and finish the store themselves if its
writer went away.

    writer = _claim_writer(plan, tokenizer, stats)   # None: another process holds the lock
    writer.add(u, d0, tokens, lengths, skips)        # unit by unit, in order; then finish()
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tokenmill import sources
from tokenmill.errors import InputError
from tokenmill.prepare import SkipLog
from tokenmill.prepare import _shard_intact
from tokenmill.store import MANIFEST, ShardInfo, ShardWriter, atomic_write_json, build_manifest

if TYPE_CHECKING:
    from tokenmill.stream import _Plan
    from tokenmill.streampool import Cursor

PROGRESS_FILE = ".stream-progress.json"
WAIT_WARNING_S = 60.0


class _CacheWriter:
    """Writes the pass's documents into the cache store exactly as prepare would; resumable.

    Holds the cache's lock. After each shard, ``.stream-progress.json`` records every committed
    shard with the input cursor (unit, doc) after it and the skips so far; a new writer keeps the
    committed shards whose checksums verify and continues from the last cursor.
    """

    def __init__(self, plan: _Plan, identity: dict, lock_fd: int, stats: dict):
        self.plan, self.identity, self.lock_fd, self.stats = plan, identity, lock_fd, stats
        plan.store_dir.mkdir(parents=True, exist_ok=True)
        self.records = self._load()
        if self.records:
            self.cursor = tuple(self.records[-1]["cursor"])
            self.skips = SkipLog.from_json(self.records[-1]["skipped"])
        else:
            self.cursor, self.skips = (0, 0), SkipLog()
            for s in plan.list_skips:
                self.skips.add(s)
        token = sum(r["shard"]["num_tokens"] for r in self.records)
        self.resume_cursor: Cursor = (*self.cursor, token)
        self.pending: list[tuple[int, int, sources.Skip]] = []
        self.shards = ShardWriter(plan.store_dir, dtype=plan.dtype,
                                  shard_tokens=plan.config.shard_tokens,
                                  first_shard=len(self.records))

    def _load(self) -> list[dict]:
        d = self.plan.store_dir
        records = []
        try:
            data = json.loads((d / PROGRESS_FILE).read_text())
            if data.get("key") == self.plan.key:
                for rec in data["records"]:
                    if not _shard_intact(d, ShardInfo(**rec["shard"])):
                        break
                    records.append(rec)
        except (OSError, ValueError, KeyError, TypeError):
            records = []
        for p in d.iterdir():  # whatever comes after the kept shards is written again
            stem = p.name.split(".")[0]
            if (p.name.startswith(".") and ".tmp" in p.name) or (
                    stem.startswith("shard-") and int(stem[6:] or 0) >= len(records)):
                p.unlink(missing_ok=True)
        return records

    def add(self, u: int, d0: int, tokens: np.ndarray, lengths: np.ndarray, skips) -> None:
        """Unit u's documents from document d0 on; those before the cursor are already written."""
        cu, cd = self.cursor
        if u < cu:
            return
        t0 = time.perf_counter()
        if u == cu and cd > d0:
            tokens, lengths, d0 = tokens[int(lengths[:cd - d0].sum()):], lengths[cd - d0:], cd
        self.pending.extend((u, o, s) for o, s in skips if o >= d0)
        for info, n_docs in self.shards.add(tokens, lengths):
            self._commit(info, (u, d0 + n_docs))
        self.cursor = (u + 1, 0)
        self.stats["write"] += time.perf_counter() - t0

    def _commit(self, info: ShardInfo, cursor: tuple[int, int]) -> None:
        keep = []
        for u, o, s in self.pending:  # prepare's rule: a skip counts once its place is written
            (self.skips.add(s) if (u, o) < cursor else keep.append((u, o, s)))
        self.pending = keep
        self.records.append({"shard": info.to_json(), "cursor": list(cursor),
                             "skipped": self.skips.to_json()})
        atomic_write_json(self.plan.store_dir / PROGRESS_FILE,
                          {"key": self.plan.key, "records": self.records})

    def finish(self) -> None:
        """Close the last shard, write the manifest (last, atomically), release the lock."""
        t0 = time.perf_counter()
        if (info := self.shards.finish()) is not None:
            self._commit(info, (len(self.plan.units), 0))
        for _, _, s in self.pending:
            self.skips.add(s)
        if not self.records:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skips.by_reason.items()))
            raise InputError(f"no documents found in the inputs (skipped: {reasons or 'none'})")
        manifest = build_manifest(tokenizer=self.identity, dtype=self.plan.dtype,
                                  shards=[ShardInfo(**r["shard"]) for r in self.records],
                                  settings=self.plan.settings, skipped=self.skips.to_json())
        atomic_write_json(self.plan.store_dir / MANIFEST, manifest)
        (self.plan.store_dir / PROGRESS_FILE).unlink(missing_ok=True)
        self.stats["write"] += time.perf_counter() - t0
        self.release()

    def abort(self) -> None:
        """Drop the open shard (committed ones stay for the next writer) and release the lock."""
        self.shards.abort()
        self.release()

    def release(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


# ---- who writes the cache -----------------------------------------------------------------------

def _try_lock(path: Path) -> int | None:
    """An open, exclusively flock-ed descriptor on ``path``, or None if another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def _claim_writer(plan: _Plan, tokenizer, stats: dict) -> _CacheWriter | None:
    """The cache's writer if this process takes its lock and the store is not complete yet."""
    fd = _try_lock(plan.lock_path)
    if fd is None:
        return None
    if (plan.store_dir / MANIFEST).exists():  # finished meanwhile
        os.close(fd)
        return None
    try:
        return _CacheWriter(plan, tokenizer.identity(), fd, stats)
    except BaseException:
        os.close(fd)
        raise


def _wait_store(plan: _Plan, tokenizer, stats: dict, stop: threading.Event,
                write: Callable[[_CacheWriter], None]) -> bool:
    """Until the cache store is complete: wait for its writer, or ``write`` it if nobody does.
    False if ``stop`` is set first."""
    since = time.monotonic()
    while not (plan.store_dir / MANIFEST).exists():
        if (writer := _claim_writer(plan, tokenizer, stats)) is not None:  # nobody writes it: we do
            write(writer)
            continue
        if stop.wait(0.2):
            return False
        if time.monotonic() - since > WAIT_WARNING_S:
            since = time.monotonic()
            warnings.warn(f"tokenmill: waiting for the process holding "
                          f"{plan.lock_path} to finish the cache store", stacklevel=1)
    return True
