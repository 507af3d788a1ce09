"""Per-format readers behind ``tokenmill.sources``: planning a file into ranges, reading a range.

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
documents of the whole file. Compressed files and ``.txt`` in file mode are one unit each
(``stop=-1``: to the end).

Columnar files. A parquet file is cut by row groups, an Arrow IPC *stream* (the ``data-*.arrow``
files of a Hugging Face dataset saved with ``save_to_disk``) by record batches: consecutive groups
(their whole size) or batches (their text column) until they reach ``unit_bytes``. A local stream
is memory-mapped (``pa.memory_map`` + ``pa.ipc.open_stream``), so passing over the batches before
a range copies nothing; a remote one is a single unit. Rows are numbered from 1 within the file.

Every reader takes a ``report(where, reason, detail)`` function and yields what it returns in the
place of a bad record (a ``sources.Skip``, or it raises); this module knows nothing of units.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.sources import SourceConfig, Skip

Report = Callable[[str, str, str], "Skip"]

_CHUNK = 1 << 20  # read 1 MiB blocks of whole lines: memory stays bounded whatever unit_bytes is
_SNIFF = 8192  # a NUL byte in the first 8 KiB of content marks a binary file
_WS, _WS_BYTES = " \t\r\f\v", b" \t\r\f\v"  # what a blank line may hold
_BOM = b"\xef\xbb\xbf"


def is_url(path: str) -> bool:
    """Whether a path goes through fsspec: is_url("s3://b/a.jsonl") == True."""
    return "://" in path


def file_size(path: str, storage_options) -> int:
    """Size in bytes of a local file or a URL."""
    if not is_url(path):
        return os.path.getsize(path)
    import fsspec.core
    fs, p = fsspec.core.url_to_fs(path, **(storage_options or {}))
    return int(fs.size(p))


def open_binary(path: str, storage_options):
    """A binary file object: plain ``open`` for local paths, fsspec for URLs."""
    if not is_url(path):
        return open(path, "rb", buffering=_CHUNK)
    import io
    import fsspec
    # fsspec's files lack readline(size), which the byte-range readers use: buffer them
    return io.BufferedReader(fsspec.open(path, "rb", **(storage_options or {})).open(),
                             buffer_size=_CHUNK)


# ---- planning --------------------------------------------------------------------------------


def plan_ranges(path: str, config: SourceConfig) -> list[tuple[int, int]]:
    """Byte ranges of ``unit_bytes``; a 12-byte file, unit_bytes=5: [(0, 5), (5, 10), (10, 12)]."""
    size = file_size(path, config.storage_options)
    step = config.unit_bytes
    return [(s, min(s + step, size)) for s in range(0, size, step)] or [(0, -1)]


def plan_parquet(path: str, config: SourceConfig) -> list[tuple[int, int]]:
    """Ranges of consecutive row groups, grouped until their uncompressed size reaches unit_bytes.

    Row-group sizes only: pyarrow's per-column metadata accessor (``row_group(g).column(c)``)
    aborts the whole process on some damaged footers (a C++ exception it does not catch).
    """
    with _parquet(path, config.storage_options) as pf:
        md = pf.metadata
        sizes = [md.row_group(g).total_byte_size for g in range(md.num_row_groups)]
    return _group(sizes, config.unit_bytes)


def plan_arrow(path: str, config: SourceConfig) -> list[tuple[int, int]]:
    """Ranges of consecutive record batches of an Arrow stream (a remote stream: one range)."""
    if is_url(path):
        return [(0, -1)]
    with _arrow_stream(path, None) as reader:
        has_key = reader.schema.get_field_index(config.text_key) >= 0
        sizes = [(b.column(config.text_key) if has_key else b).get_total_buffer_size()
                 for b in reader]
    return _group(sizes, config.unit_bytes)


def _group(sizes: list[int], unit_bytes: int) -> list[tuple[int, int]]:
    """Consecutive parts grouped until they reach unit_bytes.

    _group([5, 1, 9, 2], 6) == [(0, 2), (2, 3), (3, 4)]
    """
    ranges, first, acc = [], 0, 0
    for g, size in enumerate(sizes):
        acc += size
        if acc >= unit_bytes:
            ranges.append((first, g + 1))
            first, acc = g + 1, 0
    if first < len(sizes) or not ranges:
        ranges.append((first, len(sizes)))
    return ranges


# ---- text: .txt, .jsonl[.gz|.zst] --------------------------------------------------------------


def _decompressed(raw, fmt: str):
    if fmt == "jsonl.gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if fmt == "jsonl.zst":
        return io.BufferedReader(_ZstdStream(raw), buffer_size=_CHUNK)
    return contextlib.nullcontext(raw)


class _ZstdStream(io.RawIOBase):
    """Concatenated zstd frames, decompressed; a stream that ends inside a frame raises EOFError.

    (zstandard's own stream_reader stops silently at a truncated frame.)
    """

    def __init__(self, source):
        import zstandard  # max_window_size: accept files made with zstd --long=31
        self._source, self._dctx = source, zstandard.ZstdDecompressor(max_window_size=1 << 31)
        self._obj, self._in_frame, self._out = self._dctx.decompressobj(), False, memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            data = b""
            if self._obj.eof:
                data, self._obj = self._obj.unused_data, self._dctx.decompressobj()
            data = data or self._source.read(1 << 18)
            if not data:
                if self._in_frame:
                    raise EOFError("zstd stream ends inside a frame; the file is truncated")
                return 0
            self._out = memoryview(self._obj.decompress(data))
            self._in_frame = not self._obj.eof
        n = min(len(buffer), len(self._out))
        buffer[:n], self._out = self._out[:n], self._out[n:]
        return n


def read_text(path: str, start: int, stop: int, fmt: str, config: SourceConfig,
              report: Report) -> Iterator[str | Skip]:
    """The documents of bytes [start, stop) of a text file (stop -1: to the end)."""
    mode = config.txt_mode
    with open_binary(path, config.storage_options) as raw, _decompressed(raw, fmt) as f:
        head = f.read(_SNIFF)
        if not head or b"\0" in head:
            if start == 0:  # a file-level problem: reported once, by the first unit
                yield report("file", *(("empty_file", "0 bytes") if not head else
                                       ("binary_file", f"NUL byte at offset {head.index(0)}")))
            return
        if fmt == "txt" and mode == "file":
            yield _whole_file(head + f.read(), report)
            return
        foreign = False  # paragraphs: the unit starts inside a paragraph owned by an earlier unit
        if fmt != "jsonl" and fmt != "txt":  # compressed: one stream, one unit
            pos, blocks = 0, _blocks(f, 0, -1, carry=head)
        else:
            pos = _seek_record(f, start, stop)
            foreign = fmt == "txt" and mode == "paragraphs" and start > 0 and not _prev_blank(f, pos)
            f.seek(pos)
            blocks = _blocks(f, pos, stop)
        base = _line_base(f, pos)
        if fmt != "txt":
            yield from _jsonl_docs(blocks, config.text_key, report, base)
        elif mode == "lines":
            yield from _line_docs(blocks, report, base)
        else:
            yield from _paragraph_docs(blocks, f, report, base, foreign)


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


def _blocks(f, pos: int, stop: int, carry: bytes = b"") -> Iterator[bytes]:
    """Chunks of whole lines read from pos: the lines that start before stop (-1: to the end)."""
    first = pos == 0
    while stop < 0 or pos < stop:
        want = _CHUNK if stop < 0 else min(_CHUNK, stop - pos)
        data, carry = carry + f.read(max(want - len(carry), 0)), b""
        if not data:
            return
        if data[-1] != 10:  # finish the last line, even past stop: it started before
            data += f.readline()
        pos += len(data)
        yield data[3:] if first and data.startswith(_BOM) else data
        first = False


def _line_base(f, pos: int):
    """A function giving the number of lines before byte pos; counted once, only if asked."""
    cache = []

    def base() -> int:
        if not cache:
            here, left, n = f.tell(), pos, 0
            f.seek(0)
            while left > 0 and (chunk := f.read(min(_CHUNK, left))):
                n, left = n + chunk.count(b"\n"), left - len(chunk)
            f.seek(here)
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
    """Lines of a block (without "\\n"); an undecodable line is None, its error in the dict."""
    try:
        lines, bad = data.decode().split("\n"), {}
    except UnicodeDecodeError:
        lines, bad = [], {}
        for i, raw in enumerate(data.split(b"\n")):
            try:
                lines.append(raw.decode())
            except UnicodeDecodeError as e:
                lines.append(None)
                bad[i] = f"{e.reason} at column {e.start + 1}"
    if data.endswith(b"\n"):
        lines.pop()
    return lines, bad


def _jsonl_docs(blocks, key: str, report, base) -> Iterator[str | Skip]:
    loads, done = json.loads, 0  # done: lines of the unit in earlier blocks
    for data in blocks:
        lines, bad = _lines(data)
        for i, line in enumerate(lines):
            try:
                text = loads(line)[key]
            except (ValueError, TypeError, KeyError, RecursionError):
                if problem := _json_problem(line, bad.get(i), key):
                    yield report(f"line {base() + done + i + 1}", *problem)
                continue
            if type(text) is str and text:
                yield text
            else:
                yield report(f"line {base() + done + i + 1}", *(
                    ("empty_document", f"{key!r} is empty") if text == "" else
                    ("non_string_field", f"{key!r} is {_kind(text)}")))
        done += len(lines)


def _json_problem(line: str | None, utf8_error: str | None, key: str) -> tuple[str, str] | None:
    """(reason, detail) for a JSONL line that gave no text; None for a blank line."""
    if line is None:
        return "invalid_utf8", utf8_error
    if not line.strip(_WS):
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return "malformed_json", f"{e.msg}: column {e.colno}"
    except RecursionError:
        return "malformed_json", "nested too deeply"
    except ValueError as e:  # not a JSONDecodeError: an integer of more than 4,300 digits
        return "malformed_json", str(e)
    if not isinstance(obj, dict):
        return "malformed_json", f"expected a JSON object, got {_kind(obj)}"
    return "missing_field", f"no {key!r} key; keys are {', '.join(map(repr, list(obj)[:5])) or 'none'}"


_KINDS = {type(None): "null", bool: "a boolean", int: "a number", float: "a number",
          str: "a string", list: "an array", dict: "an object"}


def _kind(value) -> str:
    """What a decoded JSON value is, for messages: _kind(None) == "null", _kind([]) == "an array"."""
    return _KINDS.get(type(value), type(value).__name__)


def _line_docs(blocks, report, base) -> Iterator[str | Skip]:
    done = 0
    for data in blocks:
        lines, bad = _lines(data)
        for i, line in enumerate(lines):
            if line and line[-1] == "\r":
                line = line[:-1]
            if line:
                yield line
            else:
                yield report(f"line {base() + done + i + 1}", *(
                    ("invalid_utf8", bad[i]) if line is None else ("empty_document", "empty line")))
        done += len(lines)


def _unit_lines(blocks, f, more) -> Iterator[tuple[str | None, str | None]]:
    """(line, utf8 error) for the unit's lines, then for the lines past stop while more()."""
    for data in blocks:
        lines, bad = _lines(data)
        for i, line in enumerate(lines):
            yield line, bad.get(i)
    while more() and (raw := f.readline()):
        lines, bad = _lines(raw)
        yield lines[0], bad.get(0)


def _paragraph_docs(blocks, f, report, base, foreign: bool) -> Iterator[str | Skip]:
    """Blocks of non-blank lines joined by "\\n"; foreign: the unit starts inside a paragraph."""
    doc, bad_at = [], None  # bad_at: (where, detail) of the paragraph's first undecodable line
    for n, (line, error) in enumerate(_unit_lines(blocks, f, lambda: bool(doc))):
        if line is not None and not line.strip(_WS):
            if doc:
                yield _paragraph(doc, bad_at, report)
                doc, bad_at = [], None
            foreign = False
        elif not foreign:
            if line is None:
                bad_at = bad_at or (f"line {base() + n + 1}", error)
            doc.append(line[:-1] if line and line[-1] == "\r" else line or "")
    if doc:
        yield _paragraph(doc, bad_at, report)


def _paragraph(doc: list[str], bad_at: tuple[str, str] | None, report) -> str | Skip:
    return report(bad_at[0], "invalid_utf8", bad_at[1]) if bad_at else "\n".join(doc)


def _whole_file(data: bytes, report) -> str | Skip:
    """The decoded file, verbatim; invalid UTF-8 is reported at its line."""
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        line, column = data.count(b"\n", 0, e.start) + 1, e.start - data.rfind(b"\n", 0, e.start)
        return report(f"line {line}", "invalid_utf8", f"{e.reason} at column {column}")


# ---- columnar: parquet, Arrow IPC streams --------------------------------------------------------


@contextlib.contextmanager


def _parquet(path: str, storage_options):
    import pyarrow.parquet as pq
    with (open_binary(path, storage_options) if is_url(path) else contextlib.nullcontext(path)) as src:
        pf = pq.ParquetFile(src)
        try:
            yield pf
        finally:
            pf.close()


@contextlib.contextmanager


def _arrow_stream(path: str, storage_options):
    """A RecordBatchStreamReader over a memory-mapped local file, or an fsspec file."""
    import pyarrow as pa
    source = open_binary(path, storage_options) if is_url(path) else pa.memory_map(path, "r")
    with source:
        yield pa.ipc.open_stream(source)


def read_parquet(path: str, start: int, stop: int, config: SourceConfig,
                 report: Report) -> Iterator[str | Skip]:
    """The documents of row groups [start, stop) of a parquet file (stop -1: to the end)."""
    key = config.text_key
    with _parquet(path, config.storage_options) as pf:
        md = pf.metadata
        problem = _column_problem(pf.schema_arrow, key) if md.num_rows else ("empty_file", "0 rows")
        if problem:
            if start == 0:
                yield report("file", *problem)
            return
        stop = md.num_row_groups if stop < 0 else stop
        counts = [md.row_group(g).num_rows for g in range(stop)]
        if min(counts, default=0) < 0:  # rows are numbered from these: they must be right
            raise ValueError(f"damaged footer: row group {counts.index(min(counts))} has "
                             f"{min(counts)} rows")
        row = sum(counts[:start])
        for g in range(start, stop):
            texts = pf.read_row_group(g, columns=[key]).column(0).to_pylist()
            if len(texts) != counts[g]:
                raise ValueError(f"damaged file: row group {g} holds {len(texts)} rows, its "
                                 f"footer says {counts[g]}")
            yield from _column_docs(texts, row, f"row group {g}", key, report)
            row += len(texts)


def read_arrow(path: str, start: int, stop: int, config: SourceConfig,
               report: Report) -> Iterator[str | Skip]:
    """The documents of record batches [start, stop) of an Arrow IPC stream (stop -1: to the end)."""
    key = config.text_key
    with _arrow_stream(path, config.storage_options) as reader:
        if problem := _column_problem(reader.schema, key):
            if start == 0:
                yield report("file", *problem)
            return
        row = 0
        for b, batch in enumerate(reader):
            if 0 <= stop <= b:  # past the unit; the first unit looks on for a row, to know
                if start or row or batch.num_rows:  # whether the file is empty
                    return
                continue
            if b >= start:
                column = batch.column(key)
                # an IPC stream has no checksum: damaged offsets would read out of bounds
                column.validate(full=True)  # (a SystemError, or worse); now an ArrowInvalid
                texts = column.to_pylist()
                yield from _column_docs(texts, row, f"record batch {b}", key, report)
            row += batch.num_rows
        if start == 0 and not row:  # reached the end: the whole file holds no row
            yield report("file", "empty_file", "0 rows")


def _column_docs(texts: list, row: int, part: str, key: str, report: Report) -> Iterator[str | Skip]:
    """The texts of one row group or batch; rows numbered from row + 1 within the file."""
    for i, text in enumerate(texts):
        yield text if text else report(f"row {row + i + 1} ({part})", *(
            ("empty_document", f"{key!r} is empty") if text == "" else
            ("non_string_field", f"{key!r} is null")))


def _column_problem(schema, key: str) -> tuple[str, str] | None:
    import pyarrow as pa
    i = schema.get_field_index(key)
    if i < 0:
        return "missing_field", f"no column {key!r}; columns are {', '.join(schema.names[:8])}"
    t = schema.field(i).type
    t = t.value_type if pa.types.is_dictionary(t) else t
    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    if pa.types.is_string(t) or pa.types.is_large_string(t) or is_view(t):
        return None
    return "non_string_field", f"column {key!r} has type {t}"
