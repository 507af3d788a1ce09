"""What the input modules share: how to read (``SourceConfig``), a piece of work (``Unit``), a
document and where it starts (``Doc``), a record passed over (``Skip``) and how a problem becomes
a ``Skip`` or an ``InputError``.

``tokenmill.readers``, ``tokenmill.columnar`` and ``tokenmill.tabular`` read formats;
``tokenmill.sources`` lists inputs and plans units. They import this module; it imports only
``tokenmill.errors``.

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
import shlex
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from tokenmill.errors import ConfigError, InputError

REASONS = ("malformed_json", "missing_field", "non_string_field", "invalid_utf8", "empty_document",
           "empty_file", "no_match", "unreadable", "binary_file", "transform_error",
           "dropped_by_transform", "held_out", "malformed_row")
COUNTED_ONLY = ("held_out",)  # reasons counted without examples: not a problem with the input
FORMATS = ("txt", "jsonl", "jsonl.gz", "jsonl.zst", "json", "csv", "tsv", "parquet", "arrow")
EXTENSIONS = (".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".jsonl", ".json", ".csv", ".tsv",
              ".txt", ".parquet", ".arrow")  # longest first
# compressed .json is JSON Lines (C4's c4-train.00000-of-01024.json.gz): read as .jsonl.gz
ALIASES = {"json.gz": "jsonl.gz", "json.zst": "jsonl.zst"}
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

    text_key: str = "text"
    txt_mode: str = "file"
    on_error: str = "raise"
    unit_bytes: int = 16 << 20
    storage_options: Mapping[str, Any] | None = None
    records: bool = False  # yield whole records (``Record``), not text_key: for a transform
    split: str | None = None  # of a folder holding several splits (tokenmill.splits)

    def __post_init__(self):
        if not isinstance(self.text_key, str) or not self.text_key:
            raise ConfigError(f"text_key must be a non-empty string (got text_key={self.text_key!r})")
        if self.txt_mode not in TXT_MODES:
            raise ConfigError(f"txt_mode must be one of {TXT_MODES} (got txt_mode={self.txt_mode!r})")
        check_policy(self.on_error)
        if isinstance(self.unit_bytes, bool) or not isinstance(self.unit_bytes, int) or self.unit_bytes < 1:
            raise ConfigError(f"unit_bytes must be an int >= 1 (got unit_bytes={self.unit_bytes!r})")
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
    """

    path: str
    start: int
    stop: int
    line: int | None = None


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
            and format_or_none(unit.path) in ("jsonl", "json", "txt", *COMPRESSED))


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


def format_or_none(path: str) -> str | None:
    """The format of a file from its name, None if unsupported: format_or_none("a.TXT") == "txt";
    an http(s) URL's query is not part of its name: format_or_none("http://h/a.txt?k=v") == "txt";
    a compressed .json is JSON Lines: format_or_none("c4-train.00000-of-01024.json.gz") == "jsonl.gz"."""
    name = web_path(path).lower()
    fmt = next((ext[1:] for ext in EXTENSIONS if name.endswith(ext)), None)
    return ALIASES.get(fmt, fmt)


def format_of(path: str) -> str:
    """The format of a file, from its name: format_of("a/b.JSONL.zst") == "jsonl.zst"."""
    fmt = format_or_none(path)
    if fmt is None:
        raise InputError(f"{path}: unsupported file type; supported: {', '.join(EXTENSIONS)}, "
                         "or a Hugging Face dataset directory", path=path, where="file")
    return fmt


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
