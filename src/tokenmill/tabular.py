"""Readers of record files behind ``tokenmill.sources``: CSV / TSV (a column of every row) and
``.json`` files, which are either JSON Lines (the Hugging Face Hub's common form) or one top-level
JSON array of objects.

A ``.json`` file's layout is sniffed from its first byte that is not whitespace (after a UTF-8
byte-order mark): ``[`` is an array, anything else JSON Lines. JSON Lines are cut into byte ranges
and read by ``tokenmill.readers`` exactly as a ``.jsonl`` (units in parallel). An array is one unit
per file, parsed one element at a time (``json.JSONDecoder.raw_decode`` over a buffer of 1 MiB
reads, doubled while an element does not fit): memory holds one element and a read, never the
whole file. A malformed element ends the file (what follows cannot be found reliably): under
``on_error="skip"`` it is one Skip, ``element N`` (1-based), and nothing after it is read.

CSV / TSV: one unit per file (a quoted field may hold newlines, so a byte range cannot tell where
a row starts without reading from the top). The first row is the header; ``text_key`` names the
column (a missing column is a file-level problem naming the columns there are). Rows are numbered
from 1 after the header, blank lines not counted (as pandas and pyarrow number them); a Skip's
place is ``row N (line L)``, L the physical line where the row starts. Read with the ``csv``
module (RFC 4180 quoting, ``""`` inside quotes; TSV the same with tabs), strictly: a quoted field
left open, or text after a closing quote, is a malformed row, never the rest of the file
swallowed into one field. Its field size limit is raised process-wide to 2 GiB (the default,
128 KiB, refuses long documents). Lines are decoded 1 MiB at a time; bytes that are not UTF-8 are
reported per row (``invalid_utf8``), never for the whole file.

Every reader takes a ``report(where, reason, detail)`` function and yields what it returns in the
place of a bad record (a ``Skip``, or it raises); documents are ``records.Doc(text, line)``, line
the 1-based row or array element.
"""

from __future__ import annotations

import codecs
import csv
import itertools
import json
import re
from collections.abc import Iterator

from tokenmill import records
from tokenmill.io import open_binary
from tokenmill.jsonl import kind
from tokenmill.readers import plan_ranges
from tokenmill.records import Doc, Record, Report, Skip, SourceConfig, Unit

FORMATS = ("json", "csv", "tsv")
_CHUNK = 1 << 20  # an array is read 1 MiB at a time (more while one element does not fit)
_SNIFF = 8192  # a NUL byte in the first 8 KiB marks a binary file
_FIELD_LIMIT = (1 << 31) - 1  # csv's limit on one field, in characters
_WS = " \t\r\n"  # JSON whitespace
_NUMBER = "0123456789.eE+-"  # what may continue a JSON number
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a bad byte


def json_layout(path: str, storage_options=None) -> str:
    """"array" if the file's first byte that is not whitespace is "[", else "lines"."""
    with open_binary(path, storage_options) as f:
        head = f.read(_SNIFF).removeprefix(b"\xef\xbb\xbf")  # a byte-order mark
        while head and not head.lstrip(_WS.encode()):
            head = f.read(_SNIFF)
    return "array" if head.lstrip(_WS.encode())[:1] == b"[" else "lines"


def json_array_unit(unit: Unit, storage_options=None) -> bool:
    """Whether a .json unit is read as one array: the whole file (JSON Lines are cut into byte
    ranges), "[" first."""
    return unit.stop < 0 and json_layout(unit.path, storage_options) == "array"


def origin_kind(unit: Unit, storage_options=None) -> str | None:
    """What the ``Doc.line`` of a unit's documents counts, as its reader decides: "row", "line",
    or "element" (a .json array); None for an unsupported name. Raises what reading the head of a
    .json raises."""
    kind = records.kind_of_name(unit.path)
    if kind is None and records.format_or_none(unit.path) == "json":
        return "element" if json_array_unit(unit, storage_options) else "line"
    return kind


def plan(path: str, config: SourceConfig, fmt: str) -> list[tuple[int, int]]:
    """Units of a record file: one for a CSV/TSV or a JSON array, byte ranges for JSON Lines."""
    if fmt == "json" and json_layout(path, config.storage_options) == "lines":
        return plan_ranges(path, config)
    return [(0, -1)]


# ---- CSV / TSV -------------------------------------------------------------------------------

def read_csv(path: str, fmt: str, config: SourceConfig, report: Report) -> Iterator[Doc | Skip]:
    """The documents of a CSV (fmt "csv") or TSV ("tsv") file: column text_key of every row."""
    key = config.text_key
    csv.field_size_limit(max(csv.field_size_limit(), _FIELD_LIMIT))
    with open_binary(path, config.storage_options) as raw:
        head = raw.peek(_SNIFF)[:_SNIFF] if hasattr(raw, "peek") else b""
        if b"\0" in head:
            yield report("file", "binary_file", f"NUL byte at offset {head.index(0)}")
            return
        lines = _Lines(raw)
        rows = csv.reader(lines, delimiter="\t" if fmt == "tsv" else ",", strict=True)
        try:
            header = next(rows, None)
        except csv.Error as e:
            yield report("file", "malformed_row", f"the header: {_csv_problem(e)}")
            return
        if not header:
            yield report("file", "empty_file", "no header row")
            return
        if key not in header and not config.records:
            yield report("file", "missing_field", f"no column {key!r}; columns are "
                         f"{', '.join(map(repr, header[:8]))}")
            return
        if header.count(key) > 1 and not config.records:
            yield report("file", "malformed_row", f"the header names column {key!r} "
                         f"{header.count(key)} times; rename all but one")
            return
        index = header.index(key) if key in header else -1
        yield from _rows(rows, lines.bad, (index, len(header)), key, report,
                         header if config.records else None)


class _Lines:
    """The lines of a binary file as str (with their line ends, as csv wants them); a line that
    is not UTF-8 is decoded with surrogateescape and its number kept in ``bad``."""

    def __init__(self, f):
        self.f, self.bad = f, []

    def __iter__(self) -> Iterator[str]:
        done, rest, first = 0, b"", True  # lines in earlier blocks; a block's unfinished line
        while block := self.f.read(max(_CHUNK, len(rest))):  # a long line: O(n), not O(n²)
            block, first = (rest + block).removeprefix(b"\xef\xbb\xbf" if first else b""), False
            end = block.rfind(b"\n") + 1  # "\n" is never inside a UTF-8 sequence: cut there
            block, rest = block[:end], block[end:]
            yield from self._decoded(block, done)
            done += block.count(b"\n")
        yield from self._decoded(rest, done)

    def _decoded(self, block: bytes, done: int) -> Iterator[str]:
        """The lines of a block: one decode for the block, line by line if it fails. Split at
        "\n" alone (not str.splitlines): csv ends a record where an unquoted line's str ends."""
        try:
            *lines, last = block.decode().split("\n")
        except UnicodeDecodeError:
            *raws, last_raw = block.split(b"\n")
            raws = [r + b"\n" for r in raws] + [last_raw] * bool(last_raw)
            for n, raw in enumerate(raws, done + 1):
                try:
                    yield raw.decode()
                except UnicodeDecodeError:
                    self.bad.append(n)
                    yield raw.decode(errors="surrogateescape")
            return
        yield from (line + "\n" for line in lines)
        if last:
            yield last


def _rows(rows, bad: list[int], shape: tuple[int, int], key: str, report: Report,
          header: list[str] | None = None) -> Iterator[Doc | Record | Skip]:
    """Column ``index`` of the rows after the header (``header`` given: whole rows as dicts, for
    a transform); rows numbered from 1, blank lines skipped."""
    (index, width), row, line = shape, 0, rows.line_num  # line: the physical lines read so far
    while True:
        try:
            fields = next(rows)
        except StopIteration:
            if not row:
                yield report("file", "empty_file", "a header and no rows")
            return
        except csv.Error as e:  # the reader goes on at the next line
            fields = e
        start, line = line + 1, rows.line_num
        if not fields:
            continue  # a blank line: trailing newlines are common
        row += 1
        where = f"row {row} (line {start})"
        if isinstance(fields, csv.Error):
            yield report(where, "malformed_row", _csv_problem(fields))
        elif len(fields) != width:
            yield report(where, "malformed_row",
                         f"{len(fields)} fields, the header has {width}; is a field with a "
                         "delimiter or newline not quoted?")
        elif header is not None:
            yield Record(dict(zip(header, fields)), row, _place(where))
        elif bad and bad[-1] >= start and (error := _not_utf8(text := fields[index], key)):
            yield report(where, "invalid_utf8", error)
        elif text := fields[index]:
            yield Doc(text, row)
        else:
            yield report(where, "empty_document", f"{key!r} is empty")


# ---- JSON arrays -----------------------------------------------------------------------------

def read_json_array(path: str, config: SourceConfig, report: Report) -> Iterator[Doc | Skip]:
    """The documents of a file holding one JSON array of objects: field text_key of each."""
    key = config.text_key
    with open_binary(path, config.storage_options) as f:
        buf = _Buffer(f)
        for n, value in enumerate(_elements(buf), 1):
            if isinstance(value, _Malformed):
                yield report("file" if value.whole else f"element {n}", value.reason,
                             value.detail)
                return
            if config.records and isinstance(value, dict):
                yield Record(value, n, _place(f"element {n}"))
            else:
                yield _element_doc(value, n, key, report, buf.dirty)


def _place(where: str):
    """A Record's place: ``where``, already known."""
    return lambda: where


def _csv_problem(e: csv.Error) -> str:
    """What a csv.Error means, for a person."""
    if "new-line character" in str(e):
        return ("a carriage return (\\r) alone ends a line; save the file with \\n or \\r\\n "
                "line ends")
    if "unexpected end of data" in str(e):
        return "a quoted field is not closed before the end of the file"
    return f"{e}; a quote inside a quoted field is written twice (\"\")"


def _not_utf8(text: str, key: str) -> str | None:
    """Where ``text`` holds a byte that was not UTF-8 (decoded with surrogateescape), if it does."""
    if bad := _NOT_UTF8.search(text):
        return f"byte 0x{ord(bad.group()) - 0xdc00:02x} at character {bad.start() + 1} of {key!r}"
    return None


def _element_doc(value, n: int, key: str, report: Report, check: bool) -> Doc | Skip:
    """Field ``key`` of element n (1-based) as a Doc, or the report of what is wrong with it;
    ``check``: look for bytes that were not UTF-8."""
    where = f"element {n}"
    if not isinstance(value, dict):
        return report(where, "malformed_json", f"expected a JSON object, got {kind(value)}")
    if key not in value:
        return report(where, "missing_field", f"no {key!r} key; keys are "
                      f"{', '.join(map(repr, list(value)[:5])) or 'none'}")
    text = value[key]
    if type(text) is not str:
        return report(where, "non_string_field", f"{key!r} is {kind(text)}")
    if check and (error := _not_utf8(text, key)):
        return report(where, "invalid_utf8", error)
    return Doc(text, n) if text else report(where, "empty_document", f"{key!r} is empty")


class _Malformed:
    """What _elements yields in the place of an element it cannot parse (and then stops)."""

    def __init__(self, detail: str, whole: bool = False, reason: str = "malformed_json"):
        self.detail, self.whole, self.reason = detail, whole, reason


class _Buffer:
    """Decoded text of a binary file, read on demand; ``pos`` is where parsing stands."""

    def __init__(self, f):
        self.f, self.text, self.pos, self.eof = f, "", 0, False
        self.dirty = False  # bytes that were not UTF-8 were read (decoded with surrogateescape)
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")()

    def more(self) -> bool:
        """Read more (at least as much as is held: an element longer than a read costs
        O(n log n), not O(n²)); False at the end of the file."""
        if self.eof:
            return False
        data = self.f.read(max(_CHUNK, len(self.text) - self.pos))
        self.text, self.pos = self.text[self.pos:] + self._decode(data), 0
        self.eof = not data
        return True

    def _decode(self, data: bytes) -> str:
        """``data`` decoded: strictly (fast) until a byte is not UTF-8, then surrogateescape."""
        state = self.decoder.getstate()
        try:
            return self.decoder.decode(data, final=not data)
        except UnicodeDecodeError:
            self.decoder.setstate(state)
            self.decoder.errors, self.dirty = "surrogateescape", True
            return self.decoder.decode(data, final=not data)

    def skip_space(self) -> str:
        """The next character that is not whitespace ("" at the end of the file)."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in _WS:
                self.pos += 1
            if self.pos < len(self.text) or not self.more():
                return self.text[self.pos:self.pos + 1]


def _elements(buf: _Buffer) -> Iterator[object]:
    """The elements of a top-level JSON array, one at a time; a _Malformed ends them."""
    if buf.skip_space() != "[":
        yield _Malformed("not a JSON array", whole=True)
        return
    buf.pos += 1
    if buf.skip_space() == "]":
        yield _Malformed("an empty array", whole=True, reason="empty_file")
        return
    for n in itertools.count(1):
        value = _element(buf)
        yield value
        if isinstance(value, _Malformed):
            return
        c = buf.skip_space()
        if c == "]":
            break
        if c != ",":
            yield (_Malformed(f"expected ',' or ']' after element {n}, found {c!r}") if c
                   else _Malformed("the array is not closed (the file ends)", whole=True))
            return
        buf.pos += 1
        buf.skip_space()
    buf.pos += 1
    if rest := buf.skip_space():
        yield _Malformed(f"extra data after the array: {rest!r}", whole=True)


def _element(buf: _Buffer) -> object:
    """The element at buf.pos (reading more until it is whole), buf.pos moved past it."""
    decode = json.JSONDecoder().raw_decode
    while True:
        try:
            value, end = decode(buf.text, buf.pos)
            # a number may go on in the next read ("0" of "0.5"): whole once a character that
            # cannot continue it follows
            if isinstance(value, (dict, list, str)) or buf.eof or (
                    end < len(buf.text) and buf.text[end] not in _NUMBER):
                buf.pos = end
                return value
        except json.JSONDecodeError as e:
            if buf.eof:
                return _Malformed(f"{e.msg} (character {e.pos - buf.pos + 1} of the element)")
        except RecursionError:
            return _Malformed("nested too deeply")
        buf.more()
