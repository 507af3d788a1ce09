"""Readers of record files behind ``tokenmill.inputs.sources``: CSV / TSV (a column of every row) and
``.json`` files, which are either JSON Lines (the Hugging Face Hub's common form) or one top-level
JSON array of objects. Input formats as users see them: docs/formats.md, "Input files".

A ``.json`` file's layout is sniffed from its first byte that is not whitespace (after a UTF-8
byte-order mark): ``[`` is an array, anything else JSON Lines — unless it is one object spread
over lines (``jsonl.one_value``: pretty-printed), which is reported with how to convert it. JSON
Lines are cut into byte ranges and read by ``tokenmill.inputs.readers`` exactly as a ``.jsonl`` (units in
parallel). An array is one unit per file, parsed one element at a time
(``json.JSONDecoder.raw_decode`` over a buffer of 1 MiB reads, doubled while an element does not
fit): memory holds one element and a read, never the whole file. A malformed element is one
problem, ``element N`` (1-based) with its byte offset: its end is found by scanning strings and
brackets (``_extent``), and the elements after it are read. An element naming a key twice is
malformed as a line of JSON Lines is (``jsonl.named_twice``). Where the elements after a place
cannot be told apart (a missing ',', brackets that do not match, text after the array) the file
fails with an InputError under either policy, naming the element and the byte: nothing after it
is dropped silently.

CSV / TSV: one unit per file (a quoted CSV field may hold newlines, so a byte range cannot tell
where a row starts without reading from the top). The first row is the header; ``text_key``
names the column (a missing column is a file-level problem naming the columns there are; a
column named twice too — with a transform, any column). Rows are numbered from 1 after the
header, blank lines not counted (as pandas and pyarrow number them); a Skip's place is ``row N
(line L)``, L the physical line where the row starts. CSV is read with the ``csv`` module (RFC
4180 quoting, ``""`` inside quotes), strictly: a quoted field left open, or text after a closing
quote, is a malformed row, never the rest of the file swallowed into one field. TSV has no
quoting (IANA; pandas ``sep="\\t", quoting=QUOTE_NONE``): one line is one row, a quote is text,
and a row of another width than the header is malformed. The field size limit is raised
process-wide to 2 GiB (the default, 128 KiB, refuses long documents). Lines are decoded 1 MiB at
a time; bytes that are not UTF-8 are reported per row (``invalid_utf8``), never for the whole
file — in the text column, or (a transform, which gets whole rows) in any column.

Every reader takes a ``report(where, reason, detail)`` function and yields what it returns in the
place of a bad record (a ``Skip``, or it raises); documents are ``records.Doc(text, line)``, line
the 1-based row or array element; with ``SourceConfig.records`` whole records
(``records.Record``) after the same checks.
"""

from __future__ import annotations

import codecs
import csv
import itertools
import json
import re
from collections.abc import Iterator

from tokenmill.inputs import records
from tokenmill.base.errors import InputError
from tokenmill.base.io import open_binary
from tokenmill.inputs.jsonl import NOT_JSON_LINES, decode_checked, kind, named_twice, one_value
from tokenmill.inputs.textfields import joined
from tokenmill.inputs.readers import plan_ranges
from tokenmill.inputs.records import Doc, Record, Report, Skip, SourceConfig, Unit, not_text

FORMATS = ("json", "csv", "tsv")
_CHUNK = 1 << 20  # an array is read 1 MiB at a time (more while one element does not fit)
_SNIFF = 8192  # a NUL byte in the first 8 KiB marks a binary file
_FIELD_LIMIT = (1 << 31) - 1  # csv's limit on one field, in characters
_WS = " \t\r\n"  # JSON whitespace
_NUMBER = "0123456789.eE+-"  # what may continue a JSON number
_BOM = b"\xef\xbb\xbf"
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a bad byte


def json_layout(path: str, storage_options=None) -> str:
    """"array" if the file's first byte that is not whitespace is "[", "object" if it holds one
    object spread over lines (``jsonl.one_value``), else "lines"."""
    with open_binary(path, storage_options) as f:
        head = f.read(_SNIFF).removeprefix(_BOM)
        while head and not head.lstrip(_WS.encode()):
            head = f.read(_SNIFF)
    if head.lstrip(_WS.encode())[:1] == b"[":
        return "array"
    return "object" if one_value(head, whole=len(head) < _SNIFF) == "object" else "lines"


def json_array_unit(unit: Unit, storage_options=None) -> bool:
    """Whether a .json unit is read as one array: the whole file (JSON Lines are cut into byte
    ranges), "[" first."""
    return unit.stop < 0 and json_layout(unit.path, storage_options) == "array"


def json_whole_unit(unit: Unit, storage_options=None) -> bool:
    """Whether a .json unit is read whole: an array, or one object spread over lines (to say
    what it is); JSON Lines are cut into byte ranges."""
    return unit.stop < 0 and json_layout(unit.path, storage_options) != "lines"


def origin_kind(unit: Unit, storage_options=None) -> str | None:
    """What the ``Doc.line`` of a unit's documents counts, as its reader decides: "row", "line",
    or "element" (a .json array); None for an unsupported name. Raises what reading the head of a
    .json raises."""
    kind = "line" if unit.fmt == "txt" else records.kind_of_name(unit.path)
    if kind is None and records.format_or_none(unit.path) == "json":
        return "element" if json_array_unit(unit, storage_options) else "line"
    return kind


def plan(path: str, config: SourceConfig, fmt: str) -> list[tuple[int, int]]:
    """Units of a record file: one for a CSV/TSV or a JSON array (or a lone object, reported),
    byte ranges for JSON Lines."""
    if fmt == "json" and json_layout(path, config.storage_options) == "lines":
        return plan_ranges(path, config)
    return [(0, -1)]


# ---- CSV / TSV -------------------------------------------------------------------------------

_DIALECTS = {"csv": {"delimiter": ",", "strict": True},  # RFC 4180 quoting, strictly
             "tsv": {"delimiter": "\t", "quoting": csv.QUOTE_NONE, "strict": True}}  # no quoting
_WIDTH_HINT = {"csv": "is a field with a delimiter or newline not quoted?",
               "tsv": "a TSV field cannot hold a tab (it has no quoting)"}


def read_csv(path: str, fmt: str, config: SourceConfig, report: Report) -> Iterator[Doc | Skip]:
    """The documents of a CSV (fmt "csv") or TSV ("tsv") file: column text_key of every row
    (``config.records``: every row whole, checked the same way)."""
    key = config.text_key
    csv.field_size_limit(max(csv.field_size_limit(), _FIELD_LIMIT))
    with open_binary(path, config.storage_options) as raw:
        head = raw.peek(_SNIFF)[:_SNIFF] if hasattr(raw, "peek") else b""
        if problem := not_text(head, path):
            yield report("file", *problem)
            return
        lines = _Lines(raw)
        rows = csv.reader(lines, **_DIALECTS[fmt])
        try:
            header = next(rows, None)
        except csv.Error as e:
            yield report("file", "malformed_row", f"the header: {_csv_problem(e)}")
            return
        if problem := _header_problem(header, key, config.records):
            yield report("file", *problem)
            return
        index = header.index(key) if key in header else -1
        yield from _rows(rows, lines.bad, (index, len(header)), (key, _WIDTH_HINT[fmt]), report,
                         header if config.records else None)


def _header_problem(header: list[str] | None, key: str, records: bool) -> tuple[str, str] | None:
    """What is wrong with a header row: none, no ``key`` column, or a column named twice (the
    text column; with a transform, which gets rows by column name, any column)."""
    if not header:
        return "empty_file", "no header row"
    if not records and key not in header:
        return "missing_field", f"no column {key!r}; columns are {', '.join(map(repr, header[:8]))}"
    for name in ([key] if not records else header):
        if header.count(name) > 1:
            return "malformed_row", (f"the header names column {name!r} {header.count(name)} "
                                     "times; rename all but one")
    bad = [error for name in header if records and (error := _not_utf8(name, "the header"))]
    return ("invalid_utf8", bad[0]) if bad else None


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


def _rows(rows, bad: list[int], shape: tuple[int, int], names: tuple[str, str], report: Report,
          header: list[str] | None = None) -> Iterator[Doc | Record | Skip]:
    """Column ``index`` of the rows after the header (``header`` given: whole rows as dicts, for
    a transform, with the same checks); rows numbered from 1, blank lines skipped. ``names``:
    the text column's name and what a row of another width suggests."""
    (index, width), (key, hint), row, line = shape, names, 0, rows.line_num
    while True:
        try:
            fields = next(rows)
        except StopIteration:
            if not row:
                yield report("file", "empty_file", "a header and no rows")
            return
        except csv.Error as e:  # the reader goes on at the next line
            fields = e
        start, line = line + 1, rows.line_num  # line: the physical lines read so far
        if not fields:
            continue  # a blank line: trailing newlines are common
        row += 1
        where = f"row {row} (line {start})"
        if isinstance(fields, csv.Error):
            yield report(where, "malformed_row", _csv_problem(fields))
        elif len(fields) != width:
            yield report(where, "malformed_row", f"{len(fields)} fields, the header has {width}; "
                         + hint)
        elif bad and bad[-1] >= start and (error := _row_not_utf8(fields, header, index, key)):
            yield report(where, "invalid_utf8", error)
        elif header is not None:
            yield Record(dict(zip(header, fields)), row, _place(where))
        elif text := fields[index]:
            yield Doc(text, row)
        else:
            yield report(where, "empty_document", f"{key!r} is empty")


def _row_not_utf8(fields: list[str], header: list[str] | None, index: int, key: str) -> str | None:
    """Where a row's text column (``header`` given: any column) holds a byte that was not UTF-8."""
    return _not_utf8(fields[index], key) if header is None else \
        _fields_not_utf8(dict(zip(header, fields)))


# ---- JSON files ------------------------------------------------------------------------------

def read_json(path: str, config: SourceConfig, report: Report) -> Iterator[Doc | Record | Skip]:
    """The documents of a .json read whole: one array of objects (``read_json_array``), or one
    object spread over lines, which is reported (what is supported, and how to convert it)."""
    if json_layout(path, config.storage_options) == "object":
        yield report("file", "malformed_json", NOT_JSON_LINES["object"])
        return
    yield from read_json_array(path, config, report)


def read_json_array(path: str, config: SourceConfig, report: Report) -> Iterator[Doc | Record | Skip]:
    """The documents of a file holding one JSON array of objects: field text_key of each
    (``config.records``: each object whole, checked the same way)."""
    key = config.text_key
    keys = None if config.records else (key,) if isinstance(key, str) else key
    with open_binary(path, config.storage_options) as f:
        buf = _Buffer(f)
        for n, value in enumerate(_elements(buf, path), 1):
            if isinstance(value, _Malformed):
                yield report("file" if value.whole else f"element {n}", value.reason,
                             value.detail)
                if value.last:
                    return
            elif twice := named_twice(value, buf.found, keys):
                yield report(f"element {n}", "malformed_json", twice)
            elif config.records and isinstance(value, dict):
                error = buf.dirty and _fields_not_utf8(value)
                yield report(f"element {n}", "invalid_utf8", error) if error else \
                    Record(value, n, _place(f"element {n}"))
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


def _fields_not_utf8(fields: dict) -> str | None:
    """Where a whole record (a row, an object) holds a byte that was not UTF-8: in a name, or in
    a string anywhere inside a value (what a transform is given must be what the file says)."""
    for name, value in fields.items():
        text = value if isinstance(value, str) else \
            json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else ""
        if _NOT_UTF8.search(name):
            return f"a byte that is not UTF-8 in the name {name!r}"
        if error := _not_utf8(text, name):
            return error
    return None


def _element_doc(value, n: int, key: str, report: Report, check: bool) -> Doc | Skip:
    """Field ``key`` of element n (1-based) as a Doc, or the report of what is wrong with it;
    ``check``: look for bytes that were not UTF-8."""
    where = f"element {n}"
    if not isinstance(value, dict):
        return report(where, "malformed_json", f"expected a JSON object, got {kind(value)}")
    text = joined(value, (key,) if isinstance(key, str) else key)
    if not isinstance(text, str):
        return report(where, *text)
    if check and (error := _not_utf8(text, key if isinstance(key, str) else ",".join(key))):
        return report(where, "invalid_utf8", error)
    return Doc(text, n)


class _Malformed:
    """What _elements yields in the place of an element it cannot parse; ``whole``: a problem
    of the file, not of one element; ``last``: nothing follows it."""

    def __init__(self, detail: str, whole: bool = False, reason: str = "malformed_json",
                 last: bool = False):
        self.detail, self.whole, self.reason, self.last = detail, whole, reason, last or whole


class _Buffer:
    """Decoded text of a binary file, read on demand; ``pos`` is where parsing stands, ``read``
    the bytes read so far (for the byte offsets of messages)."""

    def __init__(self, f):
        self.f, self.text, self.pos, self.eof = f, "", 0, False
        self.read = 0
        self.dirty = False  # bytes that were not UTF-8 were read (decoded with surrogateescape)
        self.found: list = []  # the objects of the last element naming a key twice (named_twice)
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")()

    def more(self) -> bool:
        """Read more (at least as much as is held: an element longer than a read costs
        O(n log n), not O(n²)); False at the end of the file."""
        if self.eof:
            return False
        data = self.f.read(max(_CHUNK, len(self.text) - self.pos))
        self.read += len(data)
        self.text, self.pos = self.text[self.pos:] + self._decode(data), 0
        self.eof = not data
        return True

    def byte(self, i: int) -> int:
        """The offset in the file of character ``i`` of ``text``: the bytes read, less those not
        decoded yet and those of text[i:] (a byte that was not UTF-8 is one character)."""
        return (self.read - len(self.decoder.getstate()[0])
                - len(self.text[i:].encode("utf-8", "surrogateescape")))

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


def _elements(buf: _Buffer, path: str) -> Iterator[object]:
    """The elements of a top-level JSON array, one at a time, a _Malformed in the place of one
    that does not parse (then on to the next); an InputError where the elements after a place
    cannot be told apart (a missing ',', brackets that do not match, text after the array)."""
    if buf.skip_space() != "[":
        yield _Malformed("not a JSON array", whole=True)
        return
    buf.pos += 1
    if buf.skip_space() == "]":
        yield _Malformed("an empty array", whole=True, reason="empty_file")
        return
    for n in itertools.count(1):
        value = _element(buf, path, n)
        yield value
        if isinstance(value, _Malformed) and value.last:
            return
        c = buf.skip_space()
        if c == "]":
            break
        if not c:
            yield _Malformed("the array is not closed (the file ends)", whole=True)
            return
        if c != ",":
            raise _broken(path, f"after element {n}", buf.byte(buf.pos),
                          f"expected ',' or ']', found {c!r}")
        buf.pos += 1
        buf.skip_space()
    buf.pos += 1
    if rest := buf.skip_space():
        raise _broken(path, "after the array", buf.byte(buf.pos),
                      f"text after its closing ']': {rest!r}")


def _element(buf: _Buffer, path: str, n: int) -> object:
    """Element n at buf.pos (reading more until it is whole), buf.pos moved past it; a
    _Malformed, buf.pos past it, when it does not parse."""
    end = None  # where the element ends (the ',' or ']' after it), once it had to be found
    while True:
        try:
            value, stop, buf.found = decode_checked(buf.text, buf.pos)
            # a number may go on in the next read ("0" of "0.5"): whole once a character that
            # cannot continue it follows
            if isinstance(value, (dict, list, str)) or buf.eof or (
                    stop < len(buf.text) and buf.text[stop] not in _NUMBER):
                buf.pos = stop
                return value
            buf.more()
        except (json.JSONDecodeError, RecursionError) as e:
            if end is not None or buf.eof:
                return _skip_malformed(buf, path, n, end, e)
            end = _extent(buf, path, n)  # reads the element whole: parse it once more
            if end is None:
                return _Malformed("the file ends inside it (is the file cut short?)", last=True)


def _skip_malformed(buf: _Buffer, path: str, n: int, end: int | None, e: Exception) -> _Malformed:
    """The _Malformed of element n, which ends at ``end`` (the ',' or ']' after it); buf.pos
    moved there."""
    start = buf.pos
    if end is None:
        end = _extent(buf, path, n)
        if end is None:
            return _Malformed("the file ends inside it (is the file cut short?)", last=True)
    where = e.pos if isinstance(e, json.JSONDecodeError) else start
    detail = ("nested too deeply" if isinstance(e, RecursionError) else
              f"{e.msg} at character {where - buf.pos + 1} of the element")
    detail += f", byte {buf.byte(where):,} of the file"
    buf.pos = end
    return _Malformed(detail)


_STRUCTURE = re.compile(r'[\[\]{},"]')
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string after its '"'
_OPENS = {"]": "[", "}": "{"}


def _extent(buf: _Buffer, path: str, n: int) -> int | None:
    """Where element n, at buf.pos, ends: the index in buf.text of the ',' or ']' that follows
    it outside any string and bracket (reading more as needed); None if the file ends first.
    Brackets that do not match are an InputError: no later element can be found."""
    i, open_ = buf.pos, []
    while True:
        m = _STRUCTURE.search(buf.text, i)
        c = m.group() if m else ""
        if c == '"':
            if s := _STRING_REST.match(buf.text, m.start() + 1):
                i = s.end()
                continue
        elif c:
            i = m.start() + 1
            if c in "[{":
                open_.append(c)
            elif c in "]}" and open_:
                if (opened := open_.pop()) != _OPENS[c]:
                    raise _broken(path, f"element {n}", buf.byte(m.start()),
                                  f"{c!r} closes {opened!r}")
            elif c == "}":
                raise _broken(path, f"element {n}", buf.byte(m.start()), "'}' closes nothing")
            elif not open_:
                return m.start()  # a ',' or ']' outside the element
            continue
        # the text read ends first, or inside a string: read more, then go on (from its '"')
        offset = (m.start() if c else len(buf.text)) - buf.pos
        if not buf.more():
            return None
        i = buf.pos + offset


def _broken(path: str, where: str, offset: int, detail: str) -> InputError:
    """The error for a place after which the array's elements cannot be told apart."""
    return InputError(f"{path}, {where} (byte {offset:,}): malformed JSON ({detail}); the "
                      "elements after it cannot be found, so the file cannot be read past it "
                      "(under --on-error skip too): fix the file", path=path, where=where,
                      reason="malformed_json")
