"""Sources: paths, globs and URLs → files → deterministic work units → documents.

Formats, by extension: ``.txt`` (one document per file, per line or per paragraph, see
``SourceConfig.txt_mode``), ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (one JSON object per line,
text under ``text_key``), ``.parquet`` (column ``text_key``) and ``.arrow`` (an Arrow IPC stream,
column ``text_key``). Local paths are read with ``open``; anything containing ``://`` goes through
fsspec with ``storage_options``. The readers themselves live in ``tokenmill.readers``.

Hugging Face datasets. A directory holding a ``state.json`` with ``_data_files`` (what
``Dataset.save_to_disk`` writes) is a dataset: listing gives its ``data-*.arrow`` files, as
``state.json`` names them, and never descends into it for other files (``cache-*.arrow`` files
there are not part of it). A walk or glob takes no other ``.arrow`` file, unless the pattern itself
ends in ``.arrow``; a file named explicitly is always taken. A ``DatasetDict`` directory holds one
dataset per split, so every split is listed: name ``dir/train`` for one.

Work units (see ``tokenmill.readers`` for the byte-range rules). A plain ``.jsonl``, or a ``.txt``
in lines/paragraphs mode, is cut into byte ranges of about ``unit_bytes``; a range owns the records
that *start* inside it. Parquet is cut by row groups, Arrow streams by record batches. Compressed
files and ``.txt`` in file mode are one unit each (``stop=-1``: to the end).

Bad input. Each problem has a reason from REASONS. Under ``on_error="raise"`` it raises
``InputError`` naming the file and the 1-based line (or row); under ``"skip"`` a ``Skip`` takes
the record's place in the stream. Empty documents are always a ``Skip``, never an error.
File-level problems (empty, binary, missing or non-string column) are reported once, by the
unit that starts at 0; "unreadable" is reported by every unit that fails to read. In a .jsonl a
blank line (only spaces, tabs, CR, FF, VT) is ignored silently: trailing newlines are common.
A UTF-8 byte-order mark is dropped in line-based modes and kept in .txt file mode (verbatim).
"""

from __future__ import annotations

import glob as globlib
import json
import os
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from tokenmill import readers
from tokenmill.errors import ConfigError, InputError

REASONS = ("malformed_json", "missing_field", "non_string_field", "invalid_utf8", "empty_document",
           "empty_file", "no_match", "unreadable", "binary_file")
FORMATS = ("txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow")
_EXTENSIONS = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".txt", ".parquet", ".arrow")  # longest first
_COLUMNAR = {"parquet": (readers.plan_parquet, readers.read_parquet),
             "arrow": (readers.plan_arrow, readers.read_arrow)}
DATASET_STATE = "state.json"  # Dataset.save_to_disk: {"_data_files": [{"filename": …}, …], …}
_TXT_MODES = ("file", "lines", "paragraphs")
_POLICIES = ("raise", "skip")
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
    """A piece of work: bytes [start, stop) of a text file, or row groups (parquet) or record
    batches (Arrow stream) [start, stop). stop == -1 means to the end of the file.
    """

    path: str
    start: int
    stop: int


@dataclass(frozen=True)
class Skip:
    """Something passed over: where is "line 12", "row 5 (row group 0)", "row 5 (record batch 0)"
    or "file" (lines and rows 1-based)."""

    path: str
    where: str
    reason: str
    detail: str


def format_of(path: str) -> str:
    """The format of a file, from its name: format_of("a/b.JSONL.zst") == "jsonl.zst"."""
    fmt = _format_or_none(path)
    if fmt is None:
        raise InputError(f"{path}: unsupported file type; supported: {', '.join(_EXTENSIONS)}, "
                         "or a Hugging Face dataset directory", path=path, where="file")
    return fmt


def list_files(inputs: str | os.PathLike | Sequence[str | os.PathLike], *, on_error: str = "raise",
               storage_options: Mapping[str, Any] | None = None) -> tuple[list[str], list[Skip]]:
    """Expand files, directories (recursively), globs and URLs into (sorted unique files, skips)."""
    _check_policy(on_error)
    patterns = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else list(map(os.fspath, inputs))
    files, skips = set(), []
    for pattern in patterns:
        found = _expand_url(pattern, storage_options) if readers.is_url(pattern) else _expand_local(pattern)
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
        if fmt not in _COLUMNAR and not splittable:
            units.append(Unit(path, 0, -1))
            continue
        plan = _COLUMNAR[fmt][0] if fmt in _COLUMNAR else readers.plan_ranges
        try:
            units += [Unit(path, start, stop) for start, stop in plan(path, config)]
        except _io_errors() as e:  # under "skip", read_unit meets the error again and reports it
            _problem(path, config.on_error, "file", "unreadable", _describe(e))
            units.append(Unit(path, 0, -1))
    return units


def read_unit(unit: Unit, config: SourceConfig) -> Iterator[str | Skip]:
    """The unit's documents in file order, with a Skip in the place of each record passed over."""
    report = partial(_problem, unit.path, config.on_error)
    fmt = format_of(unit.path)
    try:
        if fmt in _COLUMNAR:
            yield from _COLUMNAR[fmt][1](unit.path, unit.start, unit.stop, config, report)
        else:
            yield from readers.read_text(unit.path, unit.start, unit.stop, fmt, config, report)
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


def dataset_files(directory: str, read: Callable[[str], bytes] | None = None) -> list[str] | None:
    """The data files of a Hugging Face dataset saved with save_to_disk, in order; None if
    ``directory`` is not one. ``read`` reads a file's bytes (default: local files)."""
    state = f"{directory.rstrip('/')}/{DATASET_STATE}"
    try:
        obj = json.loads((read or _read_local)(state))
        names = [entry["filename"] for entry in obj["_data_files"]]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not names or not all(isinstance(n, str) and n and "/" not in n for n in names):
        return None
    return [f"{directory.rstrip('/')}/{n}" for n in names]


# ---- listing ---------------------------------------------------------------------------------

def _format_or_none(path: str) -> str | None:
    name = path.lower()
    return next((ext[1:] for ext in _EXTENSIONS if name.endswith(ext)), None)


def _walkable(path: str) -> bool:
    """A file a directory walk takes: a supported type, loose .arrow files excepted."""
    return _format_or_none(path) not in (None, "arrow")


def _has_magic(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _no_match_detail(pattern: str) -> str:
    if _has_magic(pattern):
        return "no supported file matches"
    return "no supported file inside" if os.path.isdir(pattern) else "not found, or no supported file inside"


def _check_policy(on_error: str) -> None:
    if on_error not in _POLICIES:
        raise ConfigError(f"on_error must be 'raise' or 'skip' (got on_error={on_error!r})")


def _read_local(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _expand_local(pattern: str) -> list[str]:
    """Files a local path or glob stands for; a named file of unknown type is an error."""
    if not _has_magic(pattern):
        if os.path.isdir(pattern):
            return _walk(pattern)
        if not os.path.exists(pattern):
            return []
        format_of(pattern)  # raises for an unsupported type
        return [os.path.normpath(pattern)]
    arrow_ok = pattern.lower().endswith(".arrow")
    matches = globlib.glob(pattern, recursive=True)
    return [f for m in matches for f in (_walk(m) if os.path.isdir(m) else [os.path.normpath(m)])
            if _walkable(f) or (arrow_ok and _format_or_none(f) == "arrow")]


def _walk(root: str) -> list[str]:
    found = []
    for d, dirs, names in os.walk(root):
        if (data := dataset_files(d)) is not None:
            found += data
            dirs.clear()  # a dataset's folder holds nothing else to read
            continue
        found += [os.path.join(d, n) for n in names if _walkable(n)]
    return [os.path.normpath(f) for f in found]


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
        arrow_ok = _has_magic(root) and root.lower().endswith(".arrow")
        found = []
        for path, info in infos.items():
            if info["type"] == "directory":
                found += _walk_fs(fs, path)
            elif _walkable(path) or (arrow_ok and _format_or_none(path) == "arrow"):
                found.append(path)
        return [fs.unstrip_protocol(p) for p in found]
    except (OSError, ValueError, ImportError) as e:
        raise InputError(f"{url}: cannot list ({_describe(e)}); check the URL, storage_options "
                         "and that the fsspec backend is installed", path=url, where="file",
                         reason="unreadable") from e


def _walk_fs(fs, root: str) -> list[str]:
    """_walk on an fsspec filesystem: dataset folders give their data files, nothing else."""
    files = fs.find(root)
    datasets = {}
    for p in files:
        folder, _, name = p.rpartition("/")
        if name == DATASET_STATE and (data := dataset_files(folder, fs.cat_file)) is not None:
            datasets[folder + "/"] = data
    inside = tuple(datasets)
    return [p for p in files if _walkable(p) and not p.startswith(inside)] + \
        [f for data in datasets.values() for f in data]


# ---- problems --------------------------------------------------------------------------------

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
