"""Text readers behind ``tokenmill.inputs.sources``: planning a .txt / .jsonl[.gz|.zst] into ranges,
reading a range.

Byte ranges. A plain ``.jsonl``, or a ``.txt`` in lines/paragraphs mode, is cut into byte ranges of
``unit_bytes``; a range owns the records whose first byte lies inside it::

    bytes   a b c \\n d e \\n \\n f \\n          unit_bytes = 5
    units   [0 ......... 5)[5 ...... 10)
    lines   "abc" starts at 0, "de" at 4   → unit 0 (it reads past 5 to finish "de")
            "" starts at 7, "f" at 8        → unit 1

A reader of [start, stop) seeks to start-1 and skips past the next "\\n" (so a record starting
exactly at start is kept), then reads whole lines while they start before stop. A paragraph is
owned by the unit that owns its first line; a reader looks back at the line before its first one
to know whether it lands inside a paragraph (then it skips to the next blank line), and reads past
stop to finish its last paragraph. So the units of a file, read one after another, give exactly the
documents of the whole file. A ``.txt`` in file mode is one unit (``stop=-1``: to the end).

Compressed streams (``.jsonl.gz``, ``.jsonl.zst``) cannot seek, so one pass decompresses the file
in 1 MiB blocks and cuts it after the first "\\n" at or past every ``unit_bytes`` of *decompressed*
text (``cuts``): a range is [start, stop) of decompressed bytes holding whole lines, with the number
of lines before it (so errors name the line). An empty, binary or UTF-16 stream, one JSON value
(an array or a pretty-printed object: a compressed .json is JSON Lines; its reader says how to
convert it), and what follows a read error, is one range to the end (``stop=-1``). Reading a
range decompresses from the start and drops what precedes it, unless the caller hands in its
bytes (``decompress.StreamPayloads`` reads every range of a file in one sequential pass: what
prepare's parent process ships to its workers).

Memory stays bounded by a block plus the longest line. A line too long to hold in memory (a
``MemoryError``) is an ``InputError`` naming the file and line under either policy: what a store
holds must not depend on how much memory the machine had.

Every reader takes a ``report(where, reason, detail)`` function and yields what it returns in the
place of a bad record (a ``Skip``, or it raises); documents are ``Doc(text, line)``. A byte-range
unit past byte 0 numbers its lines from its first record and counts the "\\n"s of the lines it
owns (``LineCount``); ``LineBases`` turns those into lines of the file (see ``tokenmill.inputs.records``).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from tokenmill.inputs.decompress import open_decompressed, skip_bytes
from tokenmill.base.errors import InputError
from tokenmill.base.io import file_size, open_binary
from tokenmill.inputs.jsonl import NOT_JSON_LINES, json_reader, one_value
from tokenmill.inputs.records import (COMPRESSED, Doc, LineCount, Report, Skip, SourceConfig,
                                      Unit, format_of, io_errors, not_text, unit_lines_relative)

_CHUNK = 1 << 20  # read 1 MiB blocks of whole lines: memory stays bounded whatever unit_bytes is
_SNIFF = 8192  # a NUL byte in the first 8 KiB of content marks a binary file
_WS, _WS_BYTES = " \t\r\f\v", b" \t\r\f\v"  # what a blank line may hold
_BOM = b"\xef\xbb\xbf"

Range = tuple[int, int, int]  # (start, stop, lines before start) of a compressed stream


# ---- planning --------------------------------------------------------------------------------


def plan_ranges(path: str, config: SourceConfig) -> list[tuple[int, int]]:
    """Byte ranges of ``unit_bytes``; a 12-byte file, unit_bytes=5: [(0, 5), (5, 10), (10, 12)]."""
    size = file_size(path, config.storage_options)
    step = config.unit_bytes
    return [(s, min(s + step, size)) for s in range(0, size, step)] or [(0, -1)]


def plan_compressed(path: str, fmt: str,
                    config: SourceConfig) -> tuple[list[Range], BaseException | None]:
    """Ranges of a compressed stream from one pass over it, and the read error that ended the
    pass early, if any (then the last range runs to the end, stop -1: its reader meets the error
    again). An empty or binary stream, or one JSON value, is one range (0, -1, 0), which its
    reader reports."""
    ranges, start, line = [], 0, 0
    try:
        with open_decompressed(path, fmt, config.storage_options) as f:
            head = f.read(_SNIFF)
            if _stream_problem(head, path):
                return [(0, -1, 0)], None
            for stop, lines in cuts(_chunks(f, head), config.unit_bytes):
                ranges.append((start, stop, line))
                start, line = stop, lines
    except io_errors() as e:
        return ranges + [(start, -1, line)], e
    return ranges, None


def cuts(blocks: Iterable[bytes], unit_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, lines before it) where each unit ends: after the first "\\n" at or past
    unit_bytes from the unit's start, and at the end of the data.

    list(cuts([b"ab\\ncd\\n", b"e\\nf"], 4)) == [(6, 2), (9, 3)]
    """
    pos = lines = last = 0  # offset of the block, "\n"s before it, the last cut
    target = unit_bytes
    for block in blocks:
        end, seen, n = pos + len(block), 0, lines  # n: the "\n"s before block[seen:]
        while target <= end:
            i = block.find(b"\n", max(target - 1 - pos, seen))
            if i < 0:
                break  # the line goes on in the next block
            n, seen = n + block.count(b"\n", seen, i + 1), i + 1
            last, target = pos + seen, pos + seen + unit_bytes
            yield last, n
        lines, pos = n + block.count(b"\n", seen), end
    if pos > last:
        yield pos, lines


def _chunks(f, head: bytes) -> Iterator[bytes]:
    yield head
    while data := f.read(_CHUNK):
        yield data


# ---- reading ---------------------------------------------------------------------------------


@dataclass
class _Track:
    """Where a reader is, for the message of a MemoryError."""

    base: Callable[[], int] = lambda: 0  # lines before the unit's first record
    done: int = 0  # lines of the unit in the blocks before the current one
    line: int = 1  # the current block's last line (1-based in the unit): only it can be long
    whole: bool = False  # .txt file mode: the document is the whole file
    newlines: int = 0  # "\n"s of the lines the unit owns (those its blocks hold)


def read_text(unit: Unit, fmt: str, config: SourceConfig, report: Report,
              payload: bytes | None = None, count: LineCount | None = None) -> Iterator[Doc | Skip]:
    """The documents of a text unit (stop -1: to the end). A compressed stream's unit reads
    ``payload`` when given (its decompressed bytes), else decompresses from the start.
    ``count``: filled with the "\\n"s of the lines the unit owns once it is read."""
    track = _Track()
    reader = _stream_docs if fmt in COMPRESSED else _plain_docs
    try:
        yield from reader(unit, fmt, config, report, payload, track)
    except MemoryError:
        raise _too_long(unit.path, track) from None
    if count is not None:
        count.newlines = track.newlines


def lines_before(unit: Unit, storage_options=None) -> int:
    """Lines of the file before the first record of a text unit: one pass over its bytes before
    ``unit.start`` (what a resumed run pays once; a run in order adds up ``LineCount``s)."""
    fmt = format_of(unit.path)
    if unit.start == 0 or unit.line is not None:
        return unit.line or 0
    if fmt in COMPRESSED:  # a cut falls at a line's end
        return _line_base(unit.path, fmt, unit.start, storage_options)()
    # the unit's first record follows the "\n" that ends the line holding byte start - 1
    return _line_base(unit.path, fmt, unit.start - 1, storage_options)() + 1


class LineBases:
    """Lines of the file for documents of units taken in order (``Doc.line`` of a unit for which
    ``unit_lines_relative`` counts from its first record): a running base per file, counted
    from 0 once (``lines_before``) when a run starts in the middle of a file."""

    def __init__(self, units, storage_options=None):
        self.units, self.storage_options = units, storage_options
        self.expect: tuple[int, int] = (-1, 0)  # (the next unit of the file read last, its base)

    def absolute(self, u: int, lines: np.ndarray, newlines: int) -> np.ndarray:
        """Unit ``u``'s document lines as lines of its file; ``newlines``: its ``LineCount``."""
        unit = self.units[u]
        if not unit_lines_relative(unit):
            if unit.start == 0:
                self.expect = (u + 1, newlines)
            return lines
        nxt, base = self.expect
        if nxt != u or self.units[u - 1].path != unit.path:
            base = lines_before(unit, self.storage_options)
        self.expect = (u + 1, base + newlines)
        return lines + base


def _plain_docs(unit: Unit, fmt: str, config: SourceConfig, report: Report, payload,
                track: _Track) -> Iterator[Doc | Skip]:
    if payload is not None:
        raise TypeError(f"{unit.path}: a payload is only for a compressed stream's unit")
    start, stop, mode = unit.start, unit.stop, config.txt_mode
    with open_binary(unit.path, config.storage_options) as f:
        head = f.read(_SNIFF)
        if problem := _sniff(head, unit.path):
            if start == 0:  # a file-level problem: reported once, by the first unit
                yield report("file", *problem)
            return
        if fmt == "txt" and mode == "file":
            track.whole = True
            yield _whole_file(head + f.read(), report)
            return
        pos = _seek_record(f, start, stop)
        foreign = fmt == "txt" and mode == "paragraphs" and start > 0 and not _prev_blank(f, pos)
        f.seek(pos)
        track.base = base = _line_base(unit.path, fmt, pos, config.storage_options)
        blocks = _blocks(f, stop - pos if stop >= 0 else -1, track, bom=pos == 0)
        if fmt != "txt":
            yield from json_reader(config)(blocks, config.text_key, report, base, 0)
        elif mode == "lines":
            yield from _line_docs(blocks, report, base)
        else:
            yield from _paragraph_docs(blocks, f, report, base, foreign, track)


def _stream_docs(unit: Unit, fmt: str, config: SourceConfig, report: Report, payload,
                 track: _Track) -> Iterator[Doc | Skip]:
    with contextlib.ExitStack() as stack:
        if payload is not None:
            f = io.BytesIO(payload)
        else:
            f = stack.enter_context(open_decompressed(unit.path, fmt, config.storage_options))
            skip_bytes(f, unit.start)
        limit = unit.stop - unit.start if unit.stop >= 0 else -1
        head = b""
        if unit.start == 0:
            head = f.read(_SNIFF if limit < 0 else min(_SNIFF, limit))
            # one JSON value: planned as one range to the end, as plan_compressed saw it
            if problem := (_stream_problem if limit < 0 else _sniff)(head, unit.path):
                yield report("file", *problem)
                return
        line = unit.line
        base = (lambda: line) if line is not None else _line_base(
            unit.path, fmt, unit.start, config.storage_options)
        track.base = base
        blocks = _blocks(f, limit, track, carry=head, bom=unit.start == 0)
        yield from json_reader(config)(blocks, config.text_key, report, base, line or 0)


def _stream_problem(head: bytes, path: str) -> tuple[str, str] | None:
    """``_sniff``, and one JSON value (``one_value``): a compressed stream is JSON Lines."""
    if problem := _sniff(head, path):
        return problem
    if value := one_value(head, whole=len(head) < _SNIFF):
        return "malformed_json", NOT_JSON_LINES[value]
    return None


def _sniff(head: bytes, path: str) -> tuple[str, str] | None:
    """A file-level problem seen in the first bytes: empty, UTF-16/32 or binary (``not_text``)."""
    return ("empty_file", "0 bytes") if not head else not_text(head, path)


def _too_long(path: str, track: _Track) -> InputError:
    if track.whole:
        return InputError(f"{path}: the file is one document (txt_mode='file') too big to hold "
                          "in memory (MemoryError); read it with --txt-mode lines or paragraphs, "
                          "or give the process more memory", path=path, where="file",
                          reason="unreadable")
    try:
        n = track.base() + track.line
    except io_errors():
        n = track.line
    return InputError(f"{path}:{n}: line {n} is too long to hold in memory (MemoryError); split "
                      "it into smaller records, or give the process more memory", path=path,
                      where=f"line {n}", reason="unreadable")


def _seek_record(f, start: int, stop: int = -1) -> int:
    """Offset of the first record starting at or after byte start (after "\\n" or at 0); stop
    if none starts before stop. Reads at most up to stop: a unit inside one long line costs its
    own bytes, not the rest of the line (units × line length, for a line of many units)."""
    if start == 0:
        return 0
    f.seek(start - 1)
    if stop < 0:
        return start - 1 + len(f.readline())
    line = f.readline(stop - start + 1)  # bytes [start - 1, stop) at most
    found = line.endswith(b"\n") or len(line) < stop - start + 1  # a "\n", or the end of file
    return start - 1 + len(line) if found else stop


def _blocks(f, limit: int, track: _Track, carry: bytes = b"", bom: bool = False) -> Iterator[bytes]:
    """Chunks of whole lines read from f: the lines that start in its next ``limit`` bytes
    (-1: to the end). ``carry``: bytes already read from f; ``bom``: drop a leading BOM."""
    read = 0
    while limit < 0 or read < limit:
        want = _CHUNK if limit < 0 else min(_CHUNK, limit - read)
        data, carry = carry + f.read(max(want - len(carry), 0)), b""
        if not data:
            return
        n = data.count(b"\n")
        track.line = track.done + n
        if data[-1] != 10:  # finish the last line, even past the limit: it started before
            track.line += 1
            data += f.readline()
            n += data[-1] == 10
        track.newlines += n
        read += len(data)
        yield data[3:] if bom and data.startswith(_BOM) else data
        track.done, bom = track.line, False


def _line_base(path: str, fmt: str, pos: int, storage_options) -> Callable[[], int]:
    """A function giving the number of lines before byte pos; counted once, only if asked."""
    cache = []

    def base() -> int:
        if not cache:
            opened = open_decompressed(path, fmt, storage_options) if fmt in COMPRESSED \
                else open_binary(path, storage_options)
            n, left = 0, pos
            with opened as f:
                while left > 0 and (chunk := f.read(min(_CHUNK, left))):
                    n, left = n + chunk.count(b"\n"), left - len(chunk)
            cache.append(n)
        return cache[0]
    return (lambda: 0) if pos == 0 else base


def _prev_blank(f, pos: int) -> bool:
    """Whether the line ending at byte pos - 1 (a "\\n") holds only whitespace."""
    end = pos - 1
    while end > 0:
        size = min(_SNIFF, end)
        f.seek(end - size)
        rest = f.read(size).rstrip(_WS_BYTES)
        if end == size and rest == _BOM:
            return True  # the file's byte-order mark alone: no content (the readers drop it)
        if rest:
            return rest[-1] == 10  # reached the "\n" before it through whitespace only
        end -= size
    return True


def _lines(data: bytes) -> tuple[list[str | None], dict[int, str]]:
    """Lines of a block (without "\\n"); an undecodable line is None, its error in the dict.

    Decoded line by line, not as one block: "\\n" is never inside a UTF-8 sequence, so the
    lines are the same, and one wide character (an emoji) no longer widens a whole 1 MiB str to
    4 bytes a character — 0.23 s → 0.06 s for 100 MB of Debian docs.
    """
    lines: list[str | None] = []
    bad = {}
    for i, raw in enumerate(data.split(b"\n")):
        try:
            lines.append(raw.decode())
        except UnicodeDecodeError as e:
            lines.append(None)
            bad[i] = f"{e.reason} at column {e.start + 1}"
    if data.endswith(b"\n"):
        lines.pop()
    return lines, bad


def _line_docs(blocks, report, base) -> Iterator[Doc | Skip]:
    done, new = 0, tuple.__new__
    for data in blocks:
        lines, bad = _lines(data)
        for i, line in enumerate(lines):
            if line and line[-1] == "\r":
                line = line[:-1]
            if line:
                yield new(Doc, (line, done + i + 1))  # Doc(line, …), at half the cost
            else:
                yield report(f"line {base() + done + i + 1}", *(
                    ("invalid_utf8", bad[i]) if line is None else ("empty_document", "empty line")))
        done += len(lines)


def _unit_lines(blocks, f, more, track: _Track) -> Iterator[tuple[str | None, str | None]]:
    """(line, utf8 error) for the unit's lines, then for the lines past stop while more()."""
    for data in blocks:
        lines, bad = _lines(data)
        for i, line in enumerate(lines):
            yield line, bad.get(i)
    track.line = track.done + 1
    while more() and (raw := f.readline()):
        lines, bad = _lines(raw)
        yield lines[0], bad.get(0)
        track.done, track.line = track.line, track.line + 1


def _paragraph_docs(blocks, f, report, base, foreign: bool, track: _Track) -> Iterator[Doc | Skip]:
    """Blocks of non-blank lines joined by "\\n"; foreign: the unit starts inside a paragraph."""
    doc, bad_at, at = [], None, 0  # bad_at: (where, detail) of the first undecodable line
    for n, (line, error) in enumerate(_unit_lines(blocks, f, lambda: bool(doc), track)):
        if line is not None and not line.strip(_WS):
            if doc:
                yield _paragraph(doc, at, bad_at, report)
                doc, bad_at = [], None
            foreign = False
        elif not foreign:
            if line is None:
                bad_at = bad_at or (f"line {base() + n + 1}", error)
            at = at if doc else n + 1  # the paragraph's first line (unit-relative)
            doc.append(line[:-1] if line and line[-1] == "\r" else line or "")
    if doc:
        yield _paragraph(doc, at, bad_at, report)


def _paragraph(doc: list[str], at: int, bad_at: tuple[str, str] | None, report) -> Doc | Skip:
    return report(bad_at[0], "invalid_utf8", bad_at[1]) if bad_at else Doc("\n".join(doc), at)


def _whole_file(data: bytes, report) -> Doc | Skip:
    """The decoded file, verbatim; invalid UTF-8 is reported at its line."""
    try:
        return Doc(data.decode(), 1)
    except UnicodeDecodeError as e:
        line, column = data.count(b"\n", 0, e.start) + 1, e.start - data.rfind(b"\n", 0, e.start)
        return report(f"line {line}", "invalid_utf8", f"{e.reason} at column {column}")
