"""The cache store written while streaming: the pass's documents as a store, by one process.

The documents are written to ``cache_dir/stream-<key>/`` by the one resumable store writer
(``store.writer.StoreWriter``) with prepare's shard size and settings, so the finished store is
byte for byte the one ``prepare(inputs, out=…)`` makes with the same options, written the same
way: its lock, its progress records (a crashed pass resumes its writing from the last committed
shard), the manifest last. One process writes a cache — the one holding the writer's lock
(released by the kernel if it dies); the others stream too and, at the end of the pass, wait for
its manifest, or take the lock and finish the store themselves if its writer went away.

    writer = claim_writer(plan, tokenizer, stats)   # None: another process writes it, or done
    writer.add(u, d0, tokens, lengths, skips, digest, writer.origins(u, res).part(d0))
                                                    # unit by unit, in order; then finish()

Origins are recorded as prepare records them (each shard's ``.src``, the manifest's
``sources`` and ``source_kinds``), so ``explain`` names the input file and line of a streamed pass's documents too.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import numpy as np

from tokenmill.inputs import sources
from tokenmill.base.errors import ConcurrentWriterError, DiskFullError
from tokenmill.prepare.run import input_check, inputs_finished, inputs_record, origins_of
from tokenmill.prepare.tokenize import engine_record
from tokenmill.store.format import MANIFEST, Origins
from tokenmill.store.writer import StoreWriter, WriterConfig
from tokenmill.streaming.plan import Cursor, StreamPlan
from tokenmill.tokenizer import Tokenizer

WAIT_WARNING_S = 60.0  # warn this often while waiting for another process's cache writer
WAIT_POLL_S = 0.2


class CacheWriter:
    """The pass's documents into the cache store through the one store writer, timed."""

    def __init__(self, plan: StreamPlan, writer: StoreWriter, identity: dict, stats: dict,
                 engine: dict | None = None):
        self.plan, self.writer, self.identity, self.stats = plan, writer, identity, stats
        self.engine = engine  # the manifest's tokenizer_engine, as prepare records it
        if not writer.shards:  # a fresh store: what listing the inputs passed over counts too
            for skip in plan.list_skips:
                writer.skips.add(skip)
        token = sum(info.num_tokens for info in writer.shards)
        self.resume_cursor = Cursor(*writer.cursor, token)  # where its committed shards end
        self.files = list(dict.fromkeys(unit.path for unit in plan.units))  # every file has units
        self.origins = origins_of(self.files, plan.units, plan.storage_options)  # units in order
        self.inputs = inputs_record(self.files, plan.units, plan.storage_options)  # as planned

    def add(self, u: int, d0: int, tokens: np.ndarray, lengths: np.ndarray,
            skips: list[tuple[int, sources.Skip]], digest: str | None,
            origins: Origins | None = None) -> None:
        """Unit u's documents from document d0 on (``origins``: theirs, from ``self.origins``);
        those already committed are dropped."""
        t0 = time.perf_counter()
        with cache_disk(self.plan):
            self.writer.add(u, d0, tokens, lengths, skips, digest, origins)
        self.stats["write"] += time.perf_counter() - t0

    def finish(self) -> None:
        """Close the last shard, write the manifest (last, atomically), release the lock."""
        t0 = time.perf_counter()
        extra = inputs_finished(self.inputs, self.plan.units, self.writer,
                                self.plan.storage_options)
        if self.engine is not None:
            extra["tokenizer_engine"] = self.engine
        with cache_disk(self.plan):
            self.writer.finish(self.identity, self.plan.settings, extra)
        self.stats["write"] += time.perf_counter() - t0

    def abort(self) -> None:
        """Drop the open shard (committed ones stay for the next writer) and release the lock."""
        self.writer.abort()


@contextlib.contextmanager
def cache_disk(plan: StreamPlan) -> Iterator[None]:
    """A full disk while writing the cache store: say so of ``cache_dir`` (not of prepare)."""
    try:
        yield
    except DiskFullError as e:
        raise DiskFullError(
            f"{e.path}: cannot write ({e.reason}): the disk holding cache_dir "
            f"{plan.store_dir.parent} is full; free some space or pass a cache_dir on a disk "
            "with room, then run again (the cache store keeps its finished shards, and "
            "load_state_dict resumes the stream)", path=e.path, reason=e.reason) from e


def store_complete(plan: StreamPlan) -> bool:
    """True once the cache store holds its manifest (written last)."""
    return (plan.store_dir / MANIFEST).exists()


def writer_config(plan: StreamPlan) -> WriterConfig:
    """The store writer's settings: prepare's, keyed by the plan (inputs, options, unit size)."""
    return WriterConfig(dtype=plan.dtype.name, shard_tokens=plan.config.shard_tokens,
                        key={"settings": plan.settings, "stream": plan.key}, origins=True)


def claim_writer(plan: StreamPlan, tokenizer: Tokenizer, stats: dict) -> CacheWriter | None:
    """The cache's writer if this process takes its lock and the store is not complete yet."""
    if store_complete(plan):
        return None
    try:
        # committed shards whose inputs' bytes changed since (whatever size and time say) are redone
        check = input_check(lambda: list(plan.units), plan.storage_options, None)
        with cache_disk(plan):
            writer = StoreWriter(plan.store_dir, writer_config(plan), check=check)
    except ConcurrentWriterError:
        return None
    if writer.manifest is not None:  # finished meanwhile
        writer.close()
        return None
    try:
        return CacheWriter(plan, writer, tokenizer.identity(), stats, engine_record(tokenizer))
    except BaseException:
        writer.close()
        raise


def wait_store(plan: StreamPlan, tokenizer: Tokenizer, stats: dict, stop: threading.Event,
               write: Callable[[CacheWriter], None]) -> bool:
    """Until the cache store is complete: wait for its writer, or ``write`` it if nobody does.
    False if ``stop`` is set first."""
    since = time.monotonic()
    while not store_complete(plan):
        if (writer := claim_writer(plan, tokenizer, stats)) is not None:  # nobody writes it: we do
            write(writer)
            continue
        if stop.wait(WAIT_POLL_S):
            return False
        if time.monotonic() - since > WAIT_WARNING_S:
            since = time.monotonic()
            warnings.warn(f"tokenmill: waiting for the process writing {plan.store_dir} to "
                          "finish the cache store", stacklevel=1)
    return True
