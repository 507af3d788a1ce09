"""What the input modules share: how to read (``SourceConfig``), a piece of work (``Unit``), a
document and where it starts (``Doc``), a record passed over (``Skip``) and how a problem becomes
a ``Skip`` or an ``InputError``.

``tokenmill.inputs.readers``, ``tokenmill.inputs.columnar`` and ``tokenmill.inputs.tabular`` read formats;
``tokenmill.inputs.sources`` lists inputs and plans units. They import this module; it imports only
``tokenmill.base.errors`` and ``tokenmill.base.io``.

A file that changes while it is read. A unit carries its file's identity as planned
(``Unit.ident``: device, inode, size and mtime, for a ``file://`` URL too; another URL's size and
ETag or time). ``SameInput`` compares it with the file's before the unit is read and after, and
before a reading error is
reported (a file truncated under its reader looks like a malformed last line): a difference is
an ``InputError`` naming the file, under either policy — never part of one version and part of
another in one store.

Bad input. Each problem has a reason from REASONS. Under ``on_error="raise"`` it raises
``InputError`` naming the file and the 1-based line (or row); under ``"skip"`` a ``Skip`` takes
the record's place in the stream. Empty documents are always a ``Skip``, never an error.

Where a document starts (``Doc.line``, 1-based): the line of its first line in a .jsonl (plain or
compressed) or a .txt in lines/paragraphs mode; 1 for a whole .txt; the row in the file for
Parquet and Arrow. Every reader yields ``Doc | Skip``. One case cannot know its line alone: a
byte-range unit of a plain .jsonl/.txt that starts past byte 0 (``unit_lines_relative``) — its
reader does not know how many lines precede its first record, and counting them in every unit
would read the file from 0 for each (quadratic). So such a unit's ``Doc.line`` counts from its
first record (line 1 = the first record it owns), and its reader reports in ``LineCount`` the
"\n"s of the lines it owns (those starting in [start, stop): the bytes from its first record to
the next unit's). The process that takes the units of a file *in order* adds a running base per
file (``readers.LineBases``): lines before unit k = the "\n"s of units 0 … k-1. A run that starts
at unit k (a resume) counts the lines before unit k once, in one pass over bytes [0, start - 1).
Units of compressed streams carry their base (``Unit.line``, counted by the planner), row-based
units number rows themselves: both yield absolute lines. A new reader yields absolute lines or
rows too, unless it cuts files into byte ranges: then it counts as above (``LineCount``) and its
format joins ``unit_lines_relative``.
"""

from __future__ import annotations

import codecs
import os
import shlex
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import unquote

from tokenmill.base.errors import ConfigError, InputError, TokenmillError, check_int
from tokenmill.base.io import FileId, backend_errors, file_id, filesystem, is_url
from tokenmill.inputs.textfields import text_extensions, text_format, text_keys

REASONS = ("malformed_json", "missing_field", "non_string_field", "invalid_utf8", "empty_document",
           "empty_file", "no_match", "unreadable", "binary_file", "transform_error",
           "dropped_by_transform", "held_out", "malformed_row")
COUNTED_ONLY = ("held_out",)  # reasons counted without examples: not a problem with the input
FORMATS = ("txt", "jsonl", "jsonl.gz", "jsonl.zst", "json", "csv", "tsv", "parquet", "arrow")
EXTENSIONS = (".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".jsonl", ".json", ".csv", ".tsv",
              ".txt", ".parquet", ".arrow")  # longest first
# compressed .json is JSON Lines (C4's c4-train.00000-of-01024.json.gz): read as .jsonl.gz
ALIASES = {"json.gz": "jsonl.gz", "json.zst": "jsonl.zst"}
ROW_FORMATS = ("parquet", "arrow", "csv", "tsv")  # their Doc.line is a row, not a line
ORIGIN_KINDS = ("line", "row", "element")  # what a Doc.line counts (element: of a .json array)
COMPRESSED = ("jsonl.gz", "jsonl.zst")  # streams: no seeking, so the parent reads their units
LONG_DOCUMENT = 64 << 20  # a single document of more text than this gets a warning
TXT_MODES = ("file", "lines", "paragraphs")
POLICIES = ("raise", "skip")
_WHAT = {"malformed_json": "malformed JSON", "missing_field": "missing field",
         "non_string_field": "text is not a string", "invalid_utf8": "invalid UTF-8",
         "empty_document": "empty document", "empty_file": "empty file",
         "no_match": "no file matched", "unreadable": "cannot read file",
         "binary_file": "binary file, not text", "transform_error": "the transform failed",
         "dropped_by_transform": "dropped by the transform",
         "held_out": "held out for the other side of the split", "malformed_row": "malformed row"}
_FILE_HINT = {"no_match": "check the path or pattern", "unreadable": "check that it exists and is readable",
              "missing_field": "choose the column with --text-key"}
# byte-order marks of encodings other than UTF-8 (UTF-32 first: its LE mark starts as UTF-16's)
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32", "little-endian"),
         (b"\x00\x00\xfe\xff", "UTF-32", "big-endian"),
         (b"\xff\xfe", "UTF-16", "little-endian"), (b"\xfe\xff", "UTF-16", "big-endian"))


class Doc(NamedTuple):
    """A document and the 1-based line (or row, or array element) where it starts in its file."""

    text: str
    line: int


@dataclass(frozen=True)
class SourceConfig:
    """How to read documents; checked on construction."""

    text_key: str | tuple[str, ...] = "text"  # several: JSON fields joined (textfields.joined)
    txt_mode: str = "file"
    on_error: str = "raise"
    unit_bytes: int = 16 << 20
    storage_options: Mapping[str, Any] | None = None
    records: bool = False  # yield whole records (``Record``), not text_key: for a transform
    split: str | None = None  # of a folder holding several splits (tokenmill.inputs.splits)
    text_ext: tuple[str, ...] = ()  # extensions read as .txt ("" = none; textfields)

    def __post_init__(self):
        object.__setattr__(self, "text_key", text_keys(self.text_key))
        object.__setattr__(self, "text_ext", text_extensions(self.text_ext))
        if self.txt_mode not in TXT_MODES:
            raise ConfigError(f"txt_mode must be one of {TXT_MODES} (got txt_mode={self.txt_mode!r})")
        check_policy(self.on_error)
        object.__setattr__(self, "unit_bytes", check_int("unit_bytes", self.unit_bytes, minimum=1))
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"storage_options must be a mapping or None "
                              f"(got storage_options={self.storage_options!r})")
        if self.split is not None and (not isinstance(self.split, str) or not self.split):
            raise ConfigError(f"split must be a non-empty string or None (got split={self.split!r})")


@dataclass(frozen=True)
class Unit:
    """A piece of work: bytes [start, stop) of a text file — *decompressed* bytes for a
    compressed stream — or row groups (parquet) or record batches (Arrow stream) [start, stop).
    stop == -1 means to the end of the file. ``line``: lines before ``start`` when the planner
    counted them (compressed streams), else None (counted only if an error needs it).
    ``ident``: the file's identity when the unit was planned; reading the unit checks it
    (``SameInput``).
    """

    path: str
    start: int
    stop: int
    line: int | None = None
    # its format as planned (text_ext makes a .md "txt"); None: from the name; derived, not compared
    fmt: str | None = field(default=None, compare=False)
    # the file's identity when planned (None: unchecked); not part of what the unit is
    ident: FileId | RemoteId | None = field(default=None, compare=False)


@dataclass
class LineCount:
    """Filled by a text unit's reader: ``newlines``, the "\\n"s of the lines the unit owns (a
    running base per file adds them up, see the module docstring)."""

    newlines: int = 0


def unit_lines_relative(unit: Unit) -> bool:
    """Whether a unit's ``Doc.line`` counts from its first record rather than from the start of
    its file: a plain .jsonl/.txt byte range past byte 0 (a compressed one knows ``unit.line``).

    unit_lines_relative(Unit("a.jsonl", 5, 10)) is True
    """
    return (unit.start > 0 and unit.line is None
            and unit_format(unit) in ("jsonl", "json", "txt", *COMPRESSED))


@dataclass(frozen=True)
class Skip:
    """Something passed over: where is "line 12", "row 5 (row group 0)", "row 5 (record batch 0)",
    "row 5 (line 7)" (CSV/TSV), "element 3" (a JSON array) or "file" (all 1-based)."""

    path: str
    where: str
    reason: str
    detail: str


class Record(NamedTuple):
    """A whole input record (``SourceConfig.records``): a JSONL object or a row as a dict, its
    line or row as ``Doc.line`` counts it, and where it is for a message ("line 12", "row 5 (row
    group 0)"), computed only when asked (a line number may cost a count of the lines before
    the unit)."""

    fields: dict
    line: int
    place: Callable[[], str]


Report = Callable[[str, str, str], Skip]  # report(where, reason, detail): a Skip, or it raises


def web_path(path: str) -> str:
    """An http(s) URL without its query and fragment (other paths unchanged), the part that names
    the file: web_path("https://h/a.jsonl?sig=x#f") == "https://h/a.jsonl"."""
    if not path.lower().startswith(("http://", "https://")):
        return path
    return path.split("#", 1)[0].split("?", 1)[0]


def format_or_none(path: str, text_ext: tuple[str, ...] = ()) -> str | None:
    """The format of a file from its name, None if unsupported: format_or_none("a.TXT") == "txt";
    an http(s) URL's query is not part of its name: format_or_none("http://h/a.txt?k=v") == "txt";
    a compressed .json is JSON Lines: format_or_none("c4-train.00000-of-01024.json.gz") == "jsonl.gz"."""
    name = web_path(path).lower()
    fmt = next((ext[1:] for ext in EXTENSIONS if name.endswith(ext)), None)
    return ALIASES.get(fmt, fmt) or text_format(name, text_ext)


def kind_of_name(path: str) -> str | None:
    """What a file's ``Doc.line`` counts, when its name decides (a store records it per input
    file, ``ORIGIN_KINDS``): "row" (Parquet, Arrow, CSV, TSV), "line" (JSON Lines, text); None
    for a .json, whose content decides (an array numbers its elements), or an unsupported name.

    kind_of_name("d/b.parquet") == "row"; kind_of_name("d/c.json") is None
    """
    fmt = format_or_none(path)
    return None if fmt in (None, "json") else "row" if fmt in ROW_FORMATS else "line"


def format_of(path: str, text_ext: tuple[str, ...] = ()) -> str:
    """The format of a file, from its name: format_of("a/b.JSONL.zst") == "jsonl.zst"; an
    extension of ``text_ext`` is "txt"."""
    fmt = format_or_none(path, text_ext)
    if fmt is None:
        raise InputError(f"{path}: unsupported file type; supported: {', '.join(EXTENSIONS)}, "
                         "or a Hugging Face dataset directory; --text-ext EXT reads other "
                         "extensions as text", path=path, where="file")
    return fmt


def unit_format(unit: Unit) -> str:
    """The format of a unit's file: planned (``Unit.fmt``) or from its name."""
    return unit.fmt or format_of(unit.path)


def check_policy(on_error: str) -> None:
    """Raise a ConfigError unless on_error is "raise" or "skip"."""
    if on_error not in POLICIES:
        raise ConfigError(f"on_error must be 'raise' or 'skip' (got on_error={on_error!r})")


def io_errors() -> tuple[type[BaseException], ...]:
    """What reading a broken file may raise (pyarrow/zstandard ones only once they are loaded)."""
    errors = [OSError, EOFError, ValueError, zlib.error]
    for module, name in (("zstandard", "ZstdError"), ("pyarrow", "ArrowException")):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def describe(e: BaseException) -> str:
    """An exception as "Type: message", for details: describe(OSError("x")) == "OSError: x"."""
    return f"{type(e).__name__}: {e}"


def not_text(head: bytes, path: str) -> tuple[str, str] | None:
    """What the first bytes of a file say it is when it is not UTF-8 text: UTF-16 or UTF-32 (a
    byte-order mark, or ASCII with one byte of each pair NUL), or binary (another NUL byte); None
    otherwise. A (reason, detail) pair for ``problem``.

    not_text(b"\\xff\\xfeh\\x00i\\x00", "a.txt")[1].startswith("UTF-16 text, little-endian")
    """
    found = _marked(head) or (_utf16_unmarked(head) if b"\0" in head else None)
    if found:
        name, iconv, how = found
        return "invalid_utf8", f"{name} text, {how}; {_convert(path, iconv)}"
    if b"\0" in head:
        return "binary_file", f"NUL byte at offset {head.index(0)}"
    return None


def _marked(head: bytes) -> tuple[str, str, str] | None:
    """(encoding, iconv's name, how) of text after a UTF-16/32 byte-order mark; None if the
    bytes after the mark are not that encoding, or are UTF-8 text (FF FE is never UTF-8)."""
    for bom, name, order in _BOMS:
        rest = head[len(bom):]
        if head.startswith(bom) and _decodes(rest, f"{name}-{order[0].upper()}E") and not (
                _decodes(rest, "utf-8") and b"\0" not in rest):
            return name, name, f"{order} with byte-order mark {bom.hex(' ').upper()}"
    return None


def _utf16_unmarked(head: bytes) -> tuple[str, str, str] | None:
    """UTF-16 without a byte-order mark, as ASCII text makes it: one byte of each pair NUL."""
    even, odd = head[0::2], head[1::2]
    for iconv, order, nul, text in (("UTF-16LE", "little", odd, even),
                                    ("UTF-16BE", "big", even, odd)):
        if len(head) >= 8 and nul.count(0) >= 0.9 * len(nul) and 0 not in text:
            return "UTF-16", iconv, f"{order}-endian without a byte-order mark"
    return None


def _decodes(data: bytes, encoding: str) -> bool:
    """Whether ``data`` (the start of a file, perhaps cut inside a character) is in ``encoding``."""
    try:
        codecs.getincrementaldecoder(encoding)().decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _convert(path: str, encoding: str) -> str:
    """How to convert a file to UTF-8 with iconv (a compressed one through a pipe)."""
    if format_or_none(path) in COMPRESSED:
        return f"convert it to UTF-8: decompress it, iconv -f {encoding} -t UTF-8, compress it"
    stem, dot, ext = path.rpartition(".")
    out = f"{stem}.utf8.{ext}" if dot and "/" not in ext else f"{path}.utf8"
    return (f"convert it to UTF-8, e.g. iconv -f {encoding} -t UTF-8 {shlex.quote(path)} > "
            f"{shlex.quote(out)}")


def problem(path: str, on_error: str, where: str, reason: str, detail: str) -> Skip:
    """A Skip, or under on_error="raise" an InputError; empty documents are always a Skip."""
    if on_error == "skip" or reason == "empty_document":
        return Skip(path, where, reason, detail)
    if where.startswith("line "):
        place, hint = f"{path}:{where[5:]}", "fix the line"
    elif where.startswith(("row ", "element ")):
        place, hint = f"{path}, {where}", f"fix the {where.split()[0]}"
    else:
        place, hint = path, _FILE_HINT.get(reason, "fix or remove the file") + ","
    raise InputError(f"{place}: {_WHAT[reason]} ({detail}); {hint} or pass --on-error skip",
                     path=path, where=where, reason=reason)


# ---- a file that changes while it is read -------------------------------------------------

def local_path(path: str | os.PathLike) -> str | None:
    """The local file ``path`` names: itself, or a ``file://`` URL's path; None for other URLs.

    local_path("file:///data/a.jsonl") == "/data/a.jsonl" and local_path("s3://b/a") is None
    """
    path = os.fspath(path)
    if not is_url(path):
        return path
    return filesystem(path)[1] if path.startswith("file://") else None


def file_url_path(url: str) -> str | None:
    """The local path (or glob) a ``file:`` URL names, percent-decoded: ``file:///abs``,
    ``file:/abs`` or ``file://localhost/abs``; None for anything else (another host, a path).

    file_url_path("file:///d/x%20y.jsonl") == "/d/x y.jsonl" and file_url_path("d/x") is None
    """
    for prefix in ("file://localhost/", "file:///", "file:/"):
        if url.startswith(prefix) and (prefix != "file:/" or not url.startswith("file://")):
            return "/" + unquote(url[len(prefix):])
    return None


class RemoteId(NamedTuple):
    """What tells one version of a remote object from another, as its fsspec backend says: the
    size (None if the server will not say) and whichever of ETag, checksum, generation or
    modification time it reports (``tag``: (field, value) pairs; none if it reports none)."""

    size: int | None
    tag: tuple[tuple[str, str], ...]


_VERSION_FIELDS = ("ETag", "etag", "md5Hash", "Content-MD5", "generation", "VersionId", "blob_id",
                   "LastModified", "Last-Modified", "last_modified", "updated", "mtime")


def input_id(path: str, storage_options: Mapping[str, Any] | None = None) -> FileId | RemoteId:
    """The identity of an input file now: a local file's (a path, or a ``file://`` URL's)
    ``io.FileId``; another URL's ``RemoteId``, asked of the server (not fsspec's cache). OSError
    if it cannot be had."""
    if (local := local_path(path)) is not None:
        return file_id(os.stat(local))
    fs, p = filesystem(path, storage_options)
    with backend_errors(path):
        fs.invalidate_cache(p)
        info = fs.info(p)
    tag = tuple((k, str(info[k])) for k in _VERSION_FIELDS if info.get(k) is not None)
    return RemoteId(None if info.get("size") is None else int(info["size"]), tag)


def planned_id(path: str, storage_options: Mapping[str, Any] | None = None
               ) -> FileId | RemoteId | None:
    """``input_id`` as planning takes it: None if it cannot be had (the reader reports why)."""
    try:
        return input_id(path, storage_options)
    except (OSError, TokenmillError):
        return None


def id_change(was: FileId | RemoteId, now: FileId | RemoteId) -> str | None:
    """How an input's identity ``now`` differs from what it ``was``, in words; None if it does
    not. Device numbers are not compared (machines mounting one network filesystem number them
    differently), nor an inode recorded as 0 (unknown: see ``integrations.ray``).

    id_change(FileId(1, 7, 10, 5), FileId(1, 7, 4, 6)) == "size 10 → 4 bytes"
    """
    if was.size != now.size:
        return f"size {was.size:,} → {now.size:,} bytes" if None not in (was.size, now.size) \
            else "its size changed"
    if isinstance(was, RemoteId):
        then, it = dict(was.tag), dict(now.tag)
        return next((f"{k} {then.get(k)} → {it.get(k)}" for k in {**then, **it}
                     if then.get(k) != it.get(k)), None)
    if was.ino and was.ino != now.ino:
        return "another file was put in its place"
    return None if was.mtime_ns == now.mtime_ns else "rewritten: same size, another mtime"


class SameInput:
    """Reading ``unit`` proves its file is the one planned (``Unit.ident``): compared before the
    unit is read (a local file, named by a path or a ``file://`` URL: one ``stat``) and after
    it, or before the error that ended the read escapes (a URL: one request to its server,
    after); a difference raises ``changed``.

        with SameInput(unit, storage_options): ...  # read the unit
    """

    def __init__(self, unit: Unit, storage_options: Mapping[str, Any] | None = None):
        self.unit, self.storage_options = unit, storage_options

    def __enter__(self) -> SameInput:
        if local_path(self.unit.path) is not None:  # a file:// URL is a local file too
            self.check()
        return self

    def __exit__(self, kind, error, tb) -> None:
        if kind is None or issubclass(kind, Exception):  # not on GeneratorExit, Ctrl-C
            self.check(error)

    def check(self, cause: BaseException | None = None) -> None:
        """Raise ``changed`` if the file is not the one planned."""
        if self.unit.ident is None:
            return
        try:
            how = id_change(self.unit.ident, input_id(self.unit.path, self.storage_options))
        except FileNotFoundError:
            if local_path(self.unit.path) is None:
                return  # fsspec's HTTP also says so when it cannot connect: its reader tells
            how = "removed"
        except (OSError, TokenmillError):
            return  # unreadable now: its reader says so
        if how is not None:
            raise changed(self.unit.path, how) from cause


def changed(path: str, how: str) -> InputError:
    """The error for an input that changed after it was planned (``how``: what differs)."""
    return InputError(f"{path}: the file changed while it was being read (replaced, truncated "
                      f"or rewritten: {how}); run again once it is stable", path=path,
                      where="file", reason="changed")
