"""Sources: paths, globs and URLs → files → deterministic work units → documents.

Formats, by extension: ``.txt`` (one document per file, per line or per paragraph, see
``SourceConfig.txt_mode``), ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (one JSON object per line,
text under ``text_key``) and ``.parquet`` (column ``text_key``). Local paths are read with ``open``;
anything containing ``://`` goes through fsspec with ``storage_options``.

Work units. A plain ``.jsonl``, or a ``.txt`` in lines/paragraphs mode, is cut into byte ranges of
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
documents of the whole file. Parquet is cut by row groups; compressed files and ``.txt`` in file
mode are one unit each (``stop=-1``: to the end).

Bad input. Each problem has a reason from REASONS. Under ``on_error="raise"`` it raises
``InputError`` naming the file and the 1-based line (or row); under ``"skip"`` a ``Skip`` takes
the record's place in the stream. Empty documents are always a ``Skip``, never an error.
File-level problems (empty, binary, missing or non-string column) are reported once, by the
unit that starts at 0; "unreadable" is reported by every unit that fails to read. In a .jsonl a
blank line (only spaces, tabs, CR, FF, VT) is ignored silently: trailing newlines are common.
A UTF-8 byte-order mark is dropped in line-based modes and kept in .txt file mode (verbatim).
"""

from __future__ import annotations

import contextlib
import glob as globlib
import gzip
import io
import json
import os
import sys
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from tokenmill.errors import ConfigError, InputError

REASONS = ("malformed_json", "missing_field", "non_string_field", "invalid_utf8", "empty_document",
           "empty_file", "no_match", "unreadable", "binary_file")
FORMATS = ("txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet")
_EXTENSIONS = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".txt", ".parquet")  # longest suffix first
_TXT_MODES = ("file", "lines", "paragraphs")
_POLICIES = ("raise", "skip")
_CHUNK = 1 << 20  # read 1 MiB blocks of whole lines: memory stays bounded whatever unit_bytes is
_SNIFF = 8192  # a NUL byte in the first 8 KiB of content marks a binary file
_WS, _WS_BYTES = " \t\r\f\v", b" \t\r\f\v"  # what a blank line may hold
_BOM = b"\xef\xbb\xbf"
_WHAT = {"malformed_json": "malformed JSON", "missing_field": "missing field",
         "non_string_field": "text is not a string", "invalid_utf8": "invalid UTF-8",
         "empty_document": "empty document", "empty_file": "empty file",
         "no_match": "no file matched", "unreadable": "cannot read file",
         "binary_file": "binary file, not text"}
_FILE_HINT = {"no_match": "check the path or pattern", "unreadable": "check that it exists and is readable",
              "missing_field": "choose the column with --text-key"}


@dataclass(frozen=True)
class SourceConfig:
    """How to read documents; checked on construction."""

    text_key: str = "text"
    txt_mode: str = "file"
    on_error: str = "raise"
    unit_bytes: int = 16 << 20
    storage_options: Mapping[str, Any] | None = None

    def __post_init__(self):
        if not isinstance(self.text_key, str) or not self.text_key:
            raise ConfigError(f"text_key must be a non-empty string (got text_key={self.text_key!r})")
        if self.txt_mode not in _TXT_MODES:
            raise ConfigError(f"txt_mode must be one of {_TXT_MODES} (got txt_mode={self.txt_mode!r})")
        _check_policy(self.on_error)
        if isinstance(self.unit_bytes, bool) or not isinstance(self.unit_bytes, int) or self.unit_bytes < 1:
            raise ConfigError(f"unit_bytes must be an int >= 1 (got unit_bytes={self.unit_bytes!r})")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"storage_options must be a mapping or None "
                              f"(got storage_options={self.storage_options!r})")


@dataclass(frozen=True)
class Unit:
    """A piece of work: bytes [start, stop) of a text file, or row groups [start, stop) of a parquet.

    stop == -1 means to the end of the file.
    """

    path: str
    start: int
    stop: int


@dataclass(frozen=True)
class Skip:
    """Something passed over: where is "line 12", "row 5 (row group 0)" or "file" (1-based)."""

    path: str
    where: str
    reason: str
    detail: str


def format_of(path: str) -> str:
    """The format of a file, from its name: format_of("a/b.JSONL.zst") == "jsonl.zst"."""
    fmt = _format_or_none(path)
    if fmt is None:
        raise InputError(f"{path}: unsupported file type; supported: {', '.join(_EXTENSIONS)}",
                         path=path, where="file")
    return fmt


def list_files(inputs: str | os.PathLike | Sequence[str | os.PathLike], *, on_error: str = "raise",
               storage_options: Mapping[str, Any] | None = None) -> tuple[list[str], list[Skip]]:
    """Expand files, directories (recursively), globs and URLs into (sorted unique files, skips)."""
    _check_policy(on_error)
    patterns = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else list(map(os.fspath, inputs))
    files, skips = set(), []
    for pattern in patterns:
        found = _expand_url(pattern, storage_options) if _is_url(pattern) else _expand_local(pattern)
        if not found:
            skips.append(_problem(pattern, on_error, "file", "no_match", _no_match_detail(pattern)))
        files.update(found)
    if not files:
        raise InputError(f"no input file matched: {', '.join(patterns) or '(no inputs)'}; "
                         f"supported files end in {', '.join(_EXTENSIONS)}", reason="no_match")
    return sorted(files), skips


def plan_units(files: Sequence[str], config: SourceConfig) -> list[Unit]:
    """Cut files into units, deterministically; any unit can be read on its own, in any process."""
    units = []
    for path in files:
        fmt = format_of(path)
        splittable = fmt == "jsonl" or (fmt == "txt" and config.txt_mode != "file")
        if fmt != "parquet" and not splittable:
            units.append(Unit(path, 0, -1))
            continue
        try:
            units += _plan_parquet(path, config) if fmt == "parquet" else _plan_ranges(path, config)
        except _io_errors() as e:  # under "skip", read_unit meets the error again and reports it
            _problem(path, config.on_error, "file", "unreadable", _describe(e))
            units.append(Unit(path, 0, -1))
    return units


def read_unit(unit: Unit, config: SourceConfig) -> Iterator[str | Skip]:
    """The unit's documents in file order, with a Skip in the place of each record passed over."""
    report = partial(_problem, unit.path, config.on_error)
    try:
        if format_of(unit.path) == "parquet":
            yield from _read_parquet(unit, config, report)
        else:
            yield from _read_text(unit, config, report)
    except _io_errors() as e:
        yield report("file", "unreadable", _describe(e))


def read_documents(inputs: str | os.PathLike | Sequence[str | os.PathLike],
                   config: SourceConfig | None = None) -> Iterator[str | Skip]:
    """Every document of the inputs, in order: list_files, plan_units and read_unit chained."""
    config = config or SourceConfig()
    files, skips = list_files(inputs, on_error=config.on_error, storage_options=config.storage_options)
    yield from skips
    for unit in plan_units(files, config):
        yield from read_unit(unit, config)


# ---- listing ---------------------------------------------------------------------------------

def _format_or_none(path: str) -> str | None:
    name = path.lower()
    return next((ext[1:] for ext in _EXTENSIONS if name.endswith(ext)), None)


def _is_url(path: str) -> bool:
    return "://" in path


def _has_magic(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _no_match_detail(pattern: str) -> str:
    if _has_magic(pattern):
        return "no supported file matches"
    return "no supported file inside" if os.path.isdir(pattern) else "not found, or no supported file inside"


def _check_policy(on_error: str) -> None:
    if on_error not in _POLICIES:
        raise ConfigError(f"on_error must be 'raise' or 'skip' (got on_error={on_error!r})")


def _expand_local(pattern: str) -> list[str]:
    """Files a local path or glob stands for; a named file of unknown type is an error."""
    if not _has_magic(pattern):
        if os.path.isdir(pattern):
            return _walk(pattern)
        if not os.path.exists(pattern):
            return []
        format_of(pattern)  # raises for an unsupported type
        return [os.path.normpath(pattern)]
    matches = globlib.glob(pattern, recursive=True)
    return [f for m in matches for f in (_walk(m) if os.path.isdir(m) else [os.path.normpath(m)])
            if _format_or_none(f)]


def _walk(root: str) -> list[str]:
    return [os.path.normpath(os.path.join(d, n)) for d, _, names in os.walk(root)
            for n in names if _format_or_none(n)]


def _expand_url(url: str, storage_options) -> list[str]:
    """Files an fsspec URL (file, directory or glob) stands for, as URLs."""
    try:
        import fsspec.core
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        if _has_magic(root):
            infos = fs.glob(root, detail=True)
        else:
            try:
                infos = {root: fs.info(root)}
            except FileNotFoundError:
                return []
            if infos[root]["type"] != "directory":
                format_of(url)  # raises for an unsupported type
        found = []
        for path, info in infos.items():
            if info["type"] == "directory":
                found += [p for p in fs.find(path) if _format_or_none(p)]
            elif _format_or_none(path):
                found.append(path)
        return [fs.unstrip_protocol(p) for p in found]
    except (OSError, ValueError, ImportError) as e:
        raise InputError(f"{url}: cannot list ({_describe(e)}); check the URL, storage_options "
                         "and that the fsspec backend is installed", path=url, where="file",
                         reason="unreadable") from e


# ---- planning --------------------------------------------------------------------------------

def _plan_ranges(path: str, config: SourceConfig) -> list[Unit]:
    size = _size(path, config.storage_options)
    step = config.unit_bytes
    return [Unit(path, s, min(s + step, size)) for s in range(0, size, step)] or [Unit(path, 0, -1)]


def _plan_parquet(path: str, config: SourceConfig) -> list[Unit]:
    """Consecutive row groups, grouped until their text column reaches unit_bytes."""
    with _parquet(path, config.storage_options) as pf:
        md = pf.metadata
        units, first, acc = [], 0, 0
        for g in range(md.num_row_groups):
            acc += _group_bytes(md.row_group(g), config.text_key)
            if acc >= config.unit_bytes:
                units.append(Unit(path, first, g + 1))
                first, acc = g + 1, 0
        if first < md.num_row_groups or not units:
            units.append(Unit(path, first, md.num_row_groups))
        return units


def _group_bytes(group, key: str) -> int:
    for c in range(group.num_columns):
        if group.column(c).path_in_schema == key:
            return group.column(c).total_uncompressed_size
    return group.total_byte_size


def _size(path: str, storage_options) -> int:
    if not _is_url(path):
        return os.path.getsize(path)
    import fsspec.core
    fs, p = fsspec.core.url_to_fs(path, **(storage_options or {}))
    return int(fs.size(p))


# ---- reading ---------------------------------------------------------------------------------

def _open(path: str, storage_options):
    """A binary file object: plain ``open`` for local paths, fsspec for URLs."""
    if not _is_url(path):
        return open(path, "rb", buffering=_CHUNK)
    import fsspec
    return fsspec.open(path, "rb", **(storage_options or {})).open()


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


@contextlib.contextmanager
def _parquet(path: str, storage_options):
    import pyarrow.parquet as pq
    with (_open(path, storage_options) if _is_url(path) else contextlib.nullcontext(path)) as src:
        pf = pq.ParquetFile(src)
        try:
            yield pf
        finally:
            pf.close()


def _io_errors() -> tuple[type[BaseException], ...]:
    """What reading a broken file may raise (pyarrow/zstandard ones only once they are loaded)."""
    errors = [OSError, EOFError, ValueError, zlib.error]
    for module, name in (("zstandard", "ZstdError"), ("pyarrow", "ArrowException")):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _problem(path: str, on_error: str, where: str, reason: str, detail: str) -> Skip:
    """A Skip, or under on_error="raise" an InputError; empty documents are always a Skip."""
    if on_error == "skip" or reason == "empty_document":
        return Skip(path, where, reason, detail)
    if where.startswith("line "):
        place, hint = f"{path}:{where[5:]}", "fix the line"
    elif where.startswith("row "):
        place, hint = f"{path}, {where}", "fix the row"
    else:
        place, hint = path, _FILE_HINT.get(reason, "fix or remove the file") + ","
    raise InputError(f"{place}: {_WHAT[reason]} ({detail}); {hint} or pass --on-error skip",
                     path=path, where=where, reason=reason)


def _read_text(unit: Unit, config: SourceConfig, report) -> Iterator[str | Skip]:
    fmt, mode = format_of(unit.path), config.txt_mode
    with _open(unit.path, config.storage_options) as raw, _decompressed(raw, fmt) as f:
        head = f.read(_SNIFF)
        if not head or b"\0" in head:
            if unit.start == 0:  # a file-level problem: reported once, by the first unit
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
            pos = _seek_record(f, unit.start)
            foreign = fmt == "txt" and mode == "paragraphs" and unit.start > 0 and not _prev_blank(f, pos)
            f.seek(pos)
            blocks = _blocks(f, pos, unit.stop)
        base = _line_base(f, pos)
        if fmt != "txt":
            yield from _jsonl_docs(blocks, config.text_key, report, base)
        elif mode == "lines":
            yield from _line_docs(blocks, report, base)
        else:
            yield from _paragraph_docs(blocks, f, report, base, foreign)


def _seek_record(f, start: int) -> int:
    """Offset of the first record starting at or after byte start (after "\\n" or at 0)."""
    if start == 0:
        return 0
    f.seek(start - 1)
    return start - 1 + len(f.readline())


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


def _read_parquet(unit: Unit, config: SourceConfig, report) -> Iterator[str | Skip]:
    key = config.text_key
    with _parquet(unit.path, config.storage_options) as pf:
        md = pf.metadata
        problem = _column_problem(pf.schema_arrow, key) if md.num_rows else ("empty_file", "0 rows")
        if problem:
            if unit.start == 0:
                yield report("file", *problem)
            return
        stop = md.num_row_groups if unit.stop < 0 else unit.stop
        row = sum(md.row_group(g).num_rows for g in range(unit.start))
        for g in range(unit.start, stop):
            texts = pf.read_row_group(g, columns=[key]).column(0).to_pylist()
            for i, text in enumerate(texts):
                yield text if text else report(f"row {row + i + 1} (row group {g})", *(
                    ("empty_document", f"{key!r} is empty") if text == "" else
                    ("non_string_field", f"{key!r} is null")))
            row += len(texts)


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
