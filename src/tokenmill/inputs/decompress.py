"""Compressed inputs as streams of bounded pieces: ``.jsonl.gz`` and ``.jsonl.zst``.

A gzip member or a zstd frame cannot be entered in the middle, so a unit of a compressed file is a
range of *decompressed* bytes that its reader reaches by decompressing from the start and dropping
what precedes it (``skip_bytes``), or that the parent process reads for it in one sequential pass
over the file (``StreamPayloads``) and ships with the task.

Memory stays bounded however compressible the data is. gzip: ``GzipFile`` decompresses with a
size limit. zstd: 64 KiB of zstd input can stand for gigabytes of output (a run of one byte is a
few bytes per 128 KiB block), so ``_ZstdStream`` walks the frames' block headers (RFC 8878: a
frame header, blocks of a 3-byte header each — last-block flag, type, size — then an optional
4-byte checksum; skippable frames are passed over) and feeds the decompressor one block at a time:
at most 128 KiB of output per call. Walking the headers also tells a file cut inside a frame
(``EOFError``), which zstandard's own ``stream_reader`` does not.
"""

from __future__ import annotations

import contextlib
import gzip
import io
from collections.abc import Iterator

from tokenmill.base.errors import require
from tokenmill.base.io import open_binary
from tokenmill.inputs.records import Unit, io_errors

_CHUNK = 1 << 20  # decompressed bytes read at a time
_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A50  # skippable frames: magic 0x184D2A50 … 0x184D2A5F, a 4-byte size, data


@contextlib.contextmanager
def open_decompressed(path: str, fmt: str, storage_options) -> Iterator:
    """The decompressed bytes of a .jsonl.gz or .jsonl.zst file, as a readable file object."""
    with open_binary(path, storage_options) as raw:
        if fmt == "jsonl.gz":
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                yield f
        else:
            with io.BufferedReader(_ZstdStream(raw), buffer_size=_CHUNK) as f:
                yield f


def skip_bytes(f, n: int) -> None:
    """Read and drop the next n bytes of a stream, 1 MiB at a time; EOFError if it ends first."""
    left = n
    while left > 0:
        got = len(f.read(min(_CHUNK, left)))
        if not got:
            raise EOFError(f"the stream ends at decompressed byte {n - left:,}, before byte "
                           f"{n:,} where this unit starts: did the file change since it was planned?")
        left -= got


class _ZstdStream(io.RawIOBase):
    """Concatenated zstd frames, decompressed one block at a time; EOFError if cut in a frame."""

    def __init__(self, source):
        zstandard = require("zstandard", "zstd", "reading .zst files")  # max_window_size: accept
        # files made with zstd --long=31
        self._dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)
        self._pieces, self._obj, self._out = _zstd_pieces(source), None, memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            piece = next(self._pieces, None)
            if piece is None:
                return 0
            starts_frame, data = piece
            if starts_frame:
                self._obj = self._dctx.decompressobj()
            self._out = memoryview(self._obj.decompress(data))
        n = min(len(buffer), len(self._out))
        buffer[:n], self._out = self._out[:n], self._out[n:]
        return n


def _zstd_pieces(source) -> Iterator[tuple[bool, bytes]]:
    """(starts a frame, bytes): each frame's header, then its blocks one by one, then its checksum."""
    while head := source.read(4):
        magic = int.from_bytes(_exact(source, 4, head), "little")
        if magic & ~0xF == _SKIPPABLE:
            left = int.from_bytes(_exact(source, 4), "little")
            while left > 0:
                left -= len(_exact(source, min(left, _CHUNK)))
            continue
        if magic != _ZSTD_MAGIC:
            raise ValueError(f"not a zstd frame (magic number {magic:#010x})")
        descriptor = _exact(source, 1)
        d = descriptor[0]  # content-size flag (2 bits), single segment, -, -, checksum, dict id (2)
        single = d >> 5 & 1
        size = (not single) + (0, 1, 2, 4)[d & 3] + (single, 2, 4, 8)[d >> 6]
        yield True, head + descriptor + _exact(source, size)
        last = False
        while not last:
            header = _exact(source, 3)
            bits = int.from_bytes(header, "little")
            last, kind, size = bits & 1, bits >> 1 & 3, bits >> 3
            if kind == 3:
                raise ValueError("zstd block of the reserved type 3: the file is damaged")
            yield False, header + _exact(source, 1 if kind == 1 else size)  # RLE: one byte
        if d & 4:
            yield False, _exact(source, 4)


def _exact(source, n: int, have: bytes = b"") -> bytes:
    data = have + source.read(n - len(have)) if n > len(have) else have
    if len(data) < n:
        raise EOFError("zstd stream ends inside a frame; the file is truncated")
    return data


class StreamPayloads:
    """The decompressed bytes of compressed-stream units asked for in file order, read in one
    sequential pass per file (one stream open at a time; a unit before the position reopens it)."""

    def __init__(self, storage_options):
        self._options, self._stack = storage_options, contextlib.ExitStack()
        self._path, self._f, self._pos, self._broken = None, None, 0, set()

    def read(self, unit: Unit, fmt: str) -> bytes | None:
        """Bytes [unit.start, unit.stop) decompressed; None if they cannot be read (the unit's own
        reader then meets the error and reports it)."""
        if unit.path in self._broken:
            return None
        try:
            if unit.path != self._path or unit.start < self._pos:
                self.close()
                self._f = self._stack.enter_context(
                    open_decompressed(unit.path, fmt, self._options))
                self._path, self._pos = unit.path, 0
            skip_bytes(self._f, unit.start - self._pos)
            self._pos = unit.start
            data = self._f.read(unit.stop - unit.start)
            self._pos += len(data)
            if len(data) != unit.stop - unit.start:
                raise EOFError("the stream ends inside the unit")
            return data
        except io_errors():
            self._broken.add(unit.path)
            self.close()
            return None
        except MemoryError:  # a line too long to hold: the unit's reader names it
            self.close()
            return None

    def close(self) -> None:
        """Close the open stream, if any (idempotent)."""
        self._stack.close()
        self._path, self._f, self._pos = None, None, 0

    def __enter__(self) -> StreamPayloads:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
