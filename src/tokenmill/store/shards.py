"""Documents in, shard files out: ``ShardWriter`` writes ``shard-NNNNN.bin``/``.idx`` pairs and,
when it records origins, each shard's ``.src`` (layouts in ``tokenmill.store.format``),
``ShardInfo`` is what the manifest records of each, and ``SkipLog`` counts what the readers
passed over.

A shard closes at the first document boundary at or past ``shard_tokens``, so where shards start
depends only on the document stream. Each file is written under a temporary name unique to the
writer (``.shard-00003.bin.tmp-<pid>-<random>``: ``io.temp_name``; the .src and .idx through
``io.atomic_write_bytes``), fsynced and renamed into place: .src, .bin, then .idx.

    w = ShardWriter("store", dtype=np.uint16, shard_tokens=1 << 26)
    closed = w.add(tokens, lengths)     # [(ShardInfo, documents of this call it holds), …]
                                        # (origins=True: w.add(tokens, lengths, Origins(…)))
    last = w.finish()                   # the last, partly filled shard, or None
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from tokenmill.inputs import sources
from tokenmill.base.io import atomic_write_bytes, no_space_is_a_store_error, redact, temp_name
from tokenmill.inputs.records import COUNTED_ONLY
from tokenmill.store.format import CODE_OF_DTYPE, Origins, idx_bytes, shard_name, src_bytes

MAX_EXAMPLES = 20


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
    src_bytes: int | None = None  # the .src sidecar (None: origins not recorded)
    src_xxh3: str | None = None

    def to_json(self) -> dict:
        """A JSON-able dict of the fields (no ``src_*`` without a sidecar: the older format)."""
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def file_sums(self) -> list[tuple[str, int, str]]:
        """(file name, size, xxh3) of each of the shard's files."""
        sums = [(f"{self.name}.bin", self.bin_bytes, self.bin_xxh3),
                (f"{self.name}.idx", self.idx_bytes, self.idx_xxh3)]
        if self.src_xxh3 is not None:
            sums.append((f"{self.name}.src", self.src_bytes, self.src_xxh3))
        return sums

    def files(self) -> tuple[str, ...]:
        """The shard's file names: .bin, .idx (and .src when origins are recorded)."""
        return tuple(name for name, _, _ in self.file_sums())


@dataclass
class SkipLog:
    """Counts and first examples of skipped inputs, in stream order."""

    by_reason: Counter = field(default_factory=Counter)
    examples: list[dict] = field(default_factory=list)

    def add(self, skip: sources.Skip) -> None:
        """Count one skip; keep it as an example if there are fewer than MAX_EXAMPLES."""
        self.by_reason[skip.reason] += 1
        if len(self.examples) < MAX_EXAMPLES and skip.reason not in COUNTED_ONLY:
            self.examples.append({"path": redact(skip.path), "where": skip.where,
                                  "reason": skip.reason, "detail": redact(skip.detail)})

    def to_json(self) -> dict:
        """The manifest's ``skipped`` entry."""
        return {"total": sum(self.by_reason.values()),
                "by_reason": dict(sorted(self.by_reason.items())), "examples": list(self.examples)}

    @classmethod
    def from_json(cls, d: dict) -> SkipLog:
        """Rebuild from a ``to_json`` dict."""
        return cls(Counter(d["by_reason"]), list(d["examples"]))

    def reasons(self) -> str:
        """"reason: count, …" or "none"."""
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.by_reason.items())) or "none"


class ShardWriter:
    """Streams documents into shards, closing a shard at the first document boundary at or past
    ``shard_tokens``; each shard is written under temporary names and renamed when complete.
    ``origins``: every ``add`` brings the documents' ``Origins``, written to each shard's .src."""

    def __init__(self, out_dir: str | os.PathLike, *, dtype: np.dtype, shard_tokens: int,
                 first_shard: int = 0, on_start: Callable[[int], None] | None = None,
                 origins: bool = False):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1 (got {shard_tokens=})")
        self.out_dir = Path(out_dir)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        self.shard_tokens = shard_tokens
        self.next_index = first_shard
        self.on_start = on_start  # called with a shard's index before its first byte is written
        self._file = None
        self._tmp: Path | None = None  # the open shard's .bin, under a name unique to this writer
        self._hash = None
        self._lengths: list[np.ndarray] = []
        self._tokens = 0
        self.origins = origins
        self._origins: list[Origins] = []

    def add(self, tokens: np.ndarray, lengths: np.ndarray,
            origins: Origins | None = None) -> list[tuple[ShardInfo, int]]:
        """Append documents (with their origins, in lockstep, if this writer records them);
        returns the shards closed meanwhile, each with how many of *these* documents it holds
        up to its end (so the caller can record a resume cursor)."""
        closed = []
        lengths = np.asarray(lengths, dtype=np.int64)
        if self.origins != (origins is not None) or (
                origins is not None and len(origins.lines) != len(lengths)):
            raise ValueError(f"origins are {'required' if self.origins else 'not recorded'} here, "
                             "one per document")
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
            if origins is not None:
                self._origins.append(origins.part(doc, stop))
            doc, tok = stop, stop_tok
            if cut <= len(lengths):
                closed.append((self.close_shard(), doc))
        return closed

    def _write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if self._tmp is None:
            self._tmp = temp_name(self.out_dir / f"{shard_name(self.next_index)}.bin")
        with no_space_is_a_store_error(self._tmp):
            if self._file is None:
                if self.on_start is not None:
                    self.on_start(self.next_index)
                self._file = open(self._tmp, "wb")
                self._hash = xxhash.xxh3_64()
            data = tokens.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
            self._file.write(data)
        self._hash.update(data)
        self._lengths.append(lengths)
        self._tokens += len(tokens)

    def close_shard(self) -> ShardInfo:
        """Finish the open shard (fsync, write its index, rename both into place)."""
        if self._file is None:
            self._write(np.zeros(0, self.dtype), np.zeros(0, np.int64))
        with no_space_is_a_store_error(self._tmp):
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        idx = idx_bytes(lengths, self.dtype)
        name = shard_name(self.next_index)
        src = src_bytes(Origins.concat(self._origins)) if self.origins else None
        info = ShardInfo(name=name, num_documents=len(lengths), num_tokens=self._tokens,
                         bin_bytes=self._tokens * self.dtype.itemsize, idx_bytes=len(idx),
                         bin_xxh3=self._hash.hexdigest(), idx_xxh3=xxhash.xxh3_64_hexdigest(idx),
                         src_bytes=None if src is None else len(src),
                         src_xxh3=None if src is None else xxhash.xxh3_64_hexdigest(src))
        if src is not None:
            atomic_write_bytes(self.out_dir / f"{name}.src", src)
        os.replace(self._tmp, self.out_dir / f"{name}.bin")
        atomic_write_bytes(self.out_dir / f"{name}.idx", idx)
        self._file, self._tmp, self._hash, self._lengths, self._tokens = None, None, None, [], 0
        self._origins = []
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
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None
