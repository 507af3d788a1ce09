"""Sources: paths, globs and URLs → files → deterministic work units → documents.

Formats, by extension: ``.txt`` (one document per file, per line or per paragraph, see
``SourceConfig.txt_mode``), ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (one JSON object per line,
text under ``text_key``; ``.json.gz`` / ``.json.zst`` too), ``.json`` (JSON Lines, or one
top-level array of objects), ``.csv`` / ``.tsv`` (a header row; column ``text_key``), ``.parquet``
(column ``text_key``) and ``.arrow`` (an Arrow IPC stream, column ``text_key``). Local paths are read with ``open``; anything containing
``://`` goes through fsspec (``tokenmill.base.io``) with ``storage_options``: ``hf://datasets/org/name``
through ``huggingface_hub``'s filesystem (a Hub dataset is a folder). The readers live in
``tokenmill.inputs.readers`` (text), ``tokenmill.inputs.columnar`` and ``tokenmill.inputs.tabular`` (CSV/TSV, .json);
the shared types in ``tokenmill.inputs.records``.

Hugging Face datasets. A directory holding a ``state.json`` with ``_data_files`` (what
``Dataset.save_to_disk`` writes) is a dataset: listing gives its ``data-*.arrow`` files, as
``state.json`` names them, and never descends into it for other files (``cache-*.arrow`` files
there are not part of it). A walk or glob takes no other ``.arrow`` file, unless the pattern itself
ends in ``.arrow``, and no metadata ``.json`` (``dataset_info.json``, …); a file named explicitly is
always taken. A folder holding several splits (a ``DatasetDict``: one dataset per split; a Hub
dataset's ``data/train-*.parquet``, ``data/validation-*``) needs ``split`` (``--split``), or a
split named as ``dir/train``: see ``tokenmill.inputs.splits``. What a walk or glob passes over
(unsupported types, loose ``.arrow`` files) is counted by extension: ``Ignored``. Hidden names,
links to folders and files reached twice: one rule for walks and globs, ``tokenmill.inputs.walk``.

Work units (see ``tokenmill.inputs.readers`` for the byte-range rules). A plain ``.jsonl``, or a ``.txt``
in lines/paragraphs mode, is cut into byte ranges of about ``unit_bytes``; a range owns the records
that *start* inside it. A ``.jsonl.gz`` / ``.jsonl.zst`` is cut into ranges of about ``unit_bytes``
of decompressed text at line ends, by one pass over the stream; workers cannot seek in it, so the
parent reads those units' bytes in order (``unit_payloads``) and ships them with the task
(``read_unit(unit, config, payload)``). Parquet is cut by row groups, Arrow streams by record
batches. A CSV/TSV and a ``.json`` array are one unit per file (``tokenmill.inputs.tabular``); a
``.json`` of JSON Lines is cut like a ``.jsonl``. A ``.txt`` in file mode is one unit (``stop=-1``:
to the end); one of more than 64 MiB gets a warning (it becomes one document, tokenized whole).

Bad input: see ``tokenmill.inputs.records``. File-level problems (empty, binary, missing or non-string
column) are reported once, by the unit that starts at 0; "unreadable" is reported by every unit
that fails to read. In a .jsonl a blank line (only spaces, tabs, CR, FF, VT) is ignored silently:
trailing newlines are common. A UTF-8 byte-order mark is dropped in line-based modes and kept in
.txt file mode (verbatim).
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple

from tokenmill.inputs import columnar, readers, splits, tabular, walk
from tokenmill.inputs.decompress import StreamPayloads
from tokenmill.base.errors import ConfigError, InputError, TokenmillError
from tokenmill.base.io import file_size, filesystem, is_url, read_bytes
from tokenmill.inputs.records import (COMPRESSED, EXTENSIONS, FORMATS, LONG_DOCUMENT, REASONS, Doc,
                                      LineCount, SameInput, Skip, SourceConfig, Unit, check_policy,
                                      describe, file_url_path, format_of, format_or_none, io_errors,
                                      planned_id, problem, unit_format, web_path)
from tokenmill.inputs.walk import Ignored, Passed

__all__ = ["DATASET_STATE", "Doc", "FORMATS", "Ignored", "Listing", "REASONS", "Skip", "SourceConfig",
           "Unit", "dataset_files", "format_of", "list_files", "list_inputs", "needs_payload",
           "plan_units", "read_documents", "read_unit", "unit_payloads"]

_COLUMNAR = {"parquet": (columnar.plan_parquet, columnar.read_parquet),
             "arrow": (columnar.plan_arrow, columnar.read_arrow)}
DATASET_STATE = "state.json"  # Dataset.save_to_disk: {"_data_files": [{"filename": …}, …], …}
_WARNED: set[str] = set()
_WARNED_LONG: set[str] = set()  # files with a document over LONG_DOCUMENT characters, warned once


class Listing(NamedTuple):
    """What inputs stand for: files to read (sorted, each file once), skipped patterns, what was
    passed over (files by type, hidden names, repeats: tokenmill.inputs.walk)."""

    files: list[str]
    skips: list[Skip]
    ignored: Ignored


def list_inputs(inputs: str | os.PathLike | Sequence[str | os.PathLike], *, on_error: str = "raise",
                storage_options: Mapping[str, Any] | None = None, split: str | None = None,
                text_ext: Sequence[str] = ()) -> Listing:
    """Expand files, directories (recursively), globs and URLs into a Listing; a directory holding
    several splits gives those of ``split`` (tokenmill.inputs.splits); ``text_ext``: see textfields."""
    check_policy(on_error)
    text_ext = SourceConfig(split=split, text_ext=text_ext).text_ext  # checks them
    patterns = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else list(map(os.fspath, inputs))
    files, skips, passed = set(), [], Passed()
    for pattern in patterns:
        before, hidden = len(passed), len(passed.hidden)
        local = file_url_path(pattern)  # a file: URL is listed as the local path it names
        target = pattern if local is None else local
        found = (_expand_url(target, storage_options, passed, text_ext) if is_url(target)
                 else _expand_local(target, passed, text_ext))
        found = _of_split(target, found, split, storage_options)
        if local is not None:  # spelled as the user did: a store records file:// names
            found = ["file://" + os.path.abspath(f) for f in found]
        if not found:
            here = Ignored.of(passed[before:], passed.hidden[hidden:])
            detail = _no_match_detail(pattern) + (f"; found only {here.summary()}" if here else "")
            skips.append(problem(pattern, on_error, "file", "no_match", detail))
        files.update(found)
    files = walk.distinct(files, passed)  # a file reached twice is read once (tokenmill.inputs.walk)
    ignored = Ignored.of(sorted(set(passed)), passed.hidden, passed.repeats)
    if not files:
        raise InputError(f"no input file matched: {', '.join(patterns) or '(no inputs)'}; "
                         f"supported files end in {', '.join(EXTENSIONS)}"
                         + (f"; {ignored}" if ignored else ""), reason="no_match")
    return Listing(files, skips, ignored)


def list_files(inputs: str | os.PathLike | Sequence[str | os.PathLike],
               **options: Any) -> tuple[list[str], list[Skip]]:
    """(files, skips) of ``list_inputs(inputs, **options)``, without the passed-over files."""
    listing = list_inputs(inputs, **options)
    return listing.files, listing.skips


def plan_units(files: Sequence[str], config: SourceConfig) -> list[Unit]:
    """Cut files into units, deterministically; any unit can be read on its own, in any process
    (a compressed stream's unit best with its payload, see unit_payloads). Each unit carries its
    file's identity, taken before planning it: reading checks it (``records.SameInput``)."""
    units = []
    for path in files:
        ident = planned_id(path, config.storage_options)
        fmt = format_of(path, config.text_ext)  # Unit.fmt: readers need not know text_ext
        units += [replace(u, ident=ident, fmt=fmt) for u in _plan_file(path, fmt, config)]
    return units


def needs_payload(unit: Unit) -> bool:
    """Whether unit_payloads reads this unit's bytes for its worker: a compressed stream's range
    (a worker cannot seek in a gzip/zstd stream; without the payload it decompresses from 0)."""
    return unit.stop >= 0 and format_or_none(unit.path) in COMPRESSED


def unit_payloads(units: Sequence[Unit], first: int, config: SourceConfig) -> Iterator[bytes | None]:
    """For units[first:], in order: the decompressed bytes of each unit that needs_payload, read in
    one sequential pass per file (resuming at ``first`` decompresses and drops what precedes it),
    else None (its worker reads it). None too when the bytes cannot be read: the unit's reader
    then meets the error and reports it."""
    with StreamPayloads(config.storage_options) as payloads:
        for unit in units[first:]:
            yield payloads.read(unit, unit_format(unit)) if needs_payload(unit) else None


def read_unit(unit: Unit, config: SourceConfig, payload: bytes | None = None,
              count: LineCount | None = None) -> Iterator[Doc | Skip]:
    """The unit's documents (``Doc``: text and line or row) in file order, with a Skip in the
    place of each record passed over; ``payload``: its bytes from unit_payloads (compressed
    streams only; None: read them here); ``count``: filled with the "\\n"s of the lines a text
    unit owns (see ``records``: lines of units past byte 0 count from their first record)."""
    if payload is not None and not needs_payload(unit):
        raise TypeError(f"{unit}: a payload is only for a compressed stream's unit")
    report = partial(problem, unit.path, config.on_error)
    fmt = unit_format(unit)
    with SameInput(unit, config.storage_options):  # the file planned, or an error naming it
        yield from _unit_docs(unit, fmt, config, report, payload, count)


def _unit_docs(unit: Unit, fmt: str, config: SourceConfig, report, payload: bytes | None,
               count: LineCount | None) -> Iterator[Doc | Skip]:
    try:
        if fmt in _COLUMNAR:
            docs = _COLUMNAR[fmt][1](unit.path, unit.start, unit.stop, config, report)
        elif fmt in tabular.FORMATS and _whole_record_file(unit, fmt, config):
            docs = (tabular.read_csv(unit.path, fmt, config, report) if fmt != "json"
                    else tabular.read_json(unit.path, config, report))
        else:  # a .json that is not an array is JSON Lines
            docs = readers.read_text(unit, "jsonl" if fmt == "json" else fmt, config, report,
                                     payload, count)
        if fmt == "txt" and config.txt_mode == "file":
            yield from docs  # a whole file is one document: warned about when planned
        else:
            yield from _warn_long_documents(unit.path, docs)
    except io_errors() as e:
        yield report("file", "unreadable", describe(e))


def _whole_record_file(unit: Unit, fmt: str, config: SourceConfig) -> bool:
    """A CSV/TSV, or a .json array (or object): read whole by tabular (not JSON Lines)."""
    return fmt != "json" or tabular.json_whole_unit(unit, config.storage_options)


def _warn_long_documents(path: str, docs: Iterator[Doc | Skip]) -> Iterator[Doc | Skip]:
    """``docs`` unchanged; warns once per file at the first document of more than LONG_DOCUMENT
    characters (a jsonl line, a row, a txt line or paragraph), tokenized whole in memory."""
    for doc in docs:
        if isinstance(doc, Doc) and len(doc.text) > LONG_DOCUMENT:
            n = len(doc.text)
            message = (f"tokenmill: {path}: a single document of {n:,} characters, "
                       f"tokenized whole in memory (~{n // 4:,} tokens of a typical BPE); "
                       "cut such documents into smaller ones (.txt: --txt-mode lines or paragraphs)")
            if path not in _WARNED_LONG:
                _WARNED_LONG.add(path)
                warnings.warn(message, stacklevel=2)
        yield doc


def read_documents(inputs: str | os.PathLike | Sequence[str | os.PathLike],
                   config: SourceConfig | None = None) -> Iterator[str | Skip]:
    """Every document of the inputs, in order: list_files, plan_units and read_unit chained."""
    config = config or SourceConfig()
    files, skips = list_files(inputs, on_error=config.on_error, storage_options=config.storage_options,
                              split=config.split, text_ext=config.text_ext)
    yield from skips
    units = plan_units(files, config)
    for unit, payload in zip(units, unit_payloads(units, 0, config)):
        for item in read_unit(unit, config, payload):
            yield item.text if isinstance(item, Doc) else item


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


# ---- planning --------------------------------------------------------------------------------

def _plan_file(path: str, fmt: str, config: SourceConfig) -> list[Unit]:
    if fmt in COMPRESSED:
        ranges, error = readers.plan_compressed(path, fmt, config)
        if error is not None:  # under "skip", the reader of the last range meets it again
            problem(path, config.on_error, "file", "unreadable", describe(error))
        return [Unit(path, start, stop, line) for start, stop, line in ranges]
    if fmt == "txt" and config.txt_mode == "file":
        _warn_if_long(path, config)
        return [Unit(path, 0, -1)]
    plan = (_COLUMNAR[fmt][0] if fmt in _COLUMNAR else partial(tabular.plan, fmt=fmt)
            if fmt in tabular.FORMATS else readers.plan_ranges)
    try:
        return [Unit(path, start, stop) for start, stop in plan(path, config)]
    except io_errors() as e:  # under "skip", read_unit meets the error again and reports it
        problem(path, config.on_error, "file", "unreadable", describe(e))
        return [Unit(path, 0, -1)]


def _warn_if_long(path: str, config: SourceConfig) -> None:
    """Warn once per file when a .txt read whole (txt_mode='file') is one huge document."""
    try:
        size = file_size(path, config.storage_options)
    except io_errors():
        return  # its reader reports it
    message = (f"tokenmill: {path}: {size:,} bytes of text become ONE document "
               f"(txt_mode='file'), tokenized whole in memory (~{size // 4:,} tokens of a typical "
               "BPE); use txt_mode='lines' or 'paragraphs' (--txt-mode) to cut it into documents")
    if size > LONG_DOCUMENT and message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=4)


# ---- listing ---------------------------------------------------------------------------------

def _walkable(path: str, text_ext: Sequence[str] = ()) -> bool:
    """A file a directory walk takes: a supported type (or of ``text_ext``), loose .arrow files
    and the metadata files of datasets (dataset_info.json, …) excepted."""
    return format_or_none(path, text_ext) not in (None, "arrow") and not _metadata(path)


def _metadata(path: str) -> bool:
    """A file ``datasets`` writes beside data (never read, never counted as ignored)."""
    return path.rpartition("/")[2].rpartition(os.sep)[2] in _METADATA


# what ``datasets`` writes or ignores beside data (its FILES_TO_IGNORE), never taken by a walk
_METADATA = {"config.json", "dataset_info.json", "dataset_infos.json", splits.DATASET_DICT,
             DATASET_STATE}


def _of_split(pattern: str, found: list[str], split: str | None, storage_options) -> list[str]:
    """The files ``found`` for a directory ``pattern``, narrowed to its split (tokenmill.inputs.splits)."""
    if _has_magic(web_path(pattern)) or not found:
        return found
    if is_url(pattern):
        root = pattern.rstrip("/")
        if not all(f.startswith(root + "/") for f in found):
            return found  # a file (or a URL spelled otherwise than its listing)
        relative, names = (lambda f: f[len(root) + 1:]), f"{root}/{splits.DATASET_DICT}"
    elif os.path.isdir(pattern):
        relative = partial(os.path.relpath, start=pattern)
        names = os.path.join(pattern, splits.DATASET_DICT)
    else:
        return found
    try:
        data = read_bytes(names, storage_options) if is_url(names) else _read_local(names)
    except (OSError, TokenmillError):
        data = None  # no DatasetDict here
    return splits.choose(pattern, found, relative, split, splits.dict_splits(data))


def _has_magic(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _no_match_detail(pattern: str) -> str:
    if pattern.startswith("hf://") and not pattern.startswith("hf://datasets/"):
        return "not found; a Hub dataset is hf://datasets/ORG/NAME"
    if _has_magic(pattern):
        return "no supported file matches"
    return "no supported file inside" if os.path.isdir(pattern) else "not found, or no supported file inside"


def _read_local(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _taken(paths: list[str], arrow_ok: bool, passed: list[str], text_ext=()) -> list[str]:
    """The paths a walk or glob takes; the others are added to ``passed``."""
    keep = [p for p in paths if _walkable(p, text_ext) or (arrow_ok and format_or_none(p) == "arrow")]
    passed += [p for p in paths if not (_walkable(p, text_ext) or _metadata(p)
                                        or (arrow_ok and format_or_none(p) == "arrow"))]
    return keep


def _expand_local(pattern: str, passed: list[str], text_ext=()) -> list[str]:
    """Files a local path or glob stands for; a named file of unknown type is an error."""
    if not _has_magic(pattern):
        if os.path.isdir(pattern):
            return _walk(pattern, passed, text_ext)
        if not os.path.exists(pattern):
            return []
        format_of(pattern, text_ext)  # raises for an unsupported type
        _refuse_special(pattern)
        return [os.path.normpath(pattern)]
    matches = walk.glob(pattern, passed)
    folders = walk.outermost(m for m in matches if os.path.isdir(m))  # d/**: walk d once
    found = [f for m in folders for f in _walk(m, passed, text_ext)]
    files = [os.path.normpath(m) for m in matches if not os.path.isdir(m)]
    return found + _regular(_taken(files, pattern.lower().endswith(".arrow"), passed, text_ext), passed)


def _walk(root: str, passed: Passed, text_ext=()) -> list[str]:
    """The files a folder walk takes (tokenmill.inputs.walk: hidden names skipped, each folder once)."""
    found = []
    for d, dirs, names in walk.walk(root, passed):
        if (data := dataset_files(d)) is not None:
            found += data
            dirs.clear()  # a dataset's folder holds nothing else to read
            continue
        if _is_store(names):  # prepare's own --out inside its input folder, a stream's cache:
            passed += [os.path.join(d, n) for n in names]  # tokens, not text (its manifest is
            dirs.clear()  # no .json input: reading it made an identical rerun "other settings")
            continue
        found += _taken([os.path.join(d, n) for n in names], False, passed, text_ext)
    return _regular([os.path.normpath(f) for f in found], passed)


def _regular(paths: list[str], passed: list[str]) -> list[str]:
    """The paths that are regular files (or links to one); the others (a FIFO would block its
    reader for ever, a device never ends) are added to ``passed``, never opened."""
    special = [walk.special(p) for p in paths]
    passed += [p for p, s in zip(paths, special) if s]
    return [p for p, s in zip(paths, special) if not s]


def _refuse_special(path: str, kind: str | None = None) -> None:
    """An input named explicitly that is not a regular file is an InputError saying what it is."""
    if kind := kind or walk.special(path):
        raise InputError(f"{path}: is {kind}, not a regular file; tokenmill reads files: write "
                         "its data to a file and name that", path=path, where="file",
                         reason="unreadable")


def _is_store(names: Sequence[str]) -> bool:
    """Whether a folder's file names are a tokenmill store's (manifest.json and shard files)."""
    return "manifest.json" in names and any(n.startswith("shard-") for n in names)


def _unreachable(e: BaseException | None) -> bool:
    """True if ``e`` or an exception it came from is a failure to connect (refused, no route, DNS):
    fsspec's HTTP backend reports one as FileNotFoundError from aiohttp's ClientConnectorError."""
    while e is not None:
        if isinstance(e, ConnectionError) or type(e).__name__ in _CONNECT_ERRORS or (
                isinstance(e, OSError) and e.errno in _CONNECT_ERRNOS):
            return True
        e = e.__cause__ or e.__context__
    return False


_CONNECT_ERRORS = {"ClientConnectorError", "ClientConnectorDNSError", "EndpointConnectionError",
                   "ConnectTimeoutError", "gaierror"}
_CONNECT_ERRNOS = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT}


def _root_cause(e: BaseException) -> BaseException:
    """The first exception of the chain that led to ``e``."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return e


def _expand_url(url: str, storage_options, passed: list[str], text_ext=()) -> list[str]:
    """Files an fsspec URL (file, directory or glob) stands for, as URLs; an http(s) URL with a
    query (a signed URL) is one file: its '?' is not a glob character."""
    try:
        fs, root = filesystem(url, storage_options)
        if _has_magic(web_path(root)):
            infos = fs.glob(root, detail=True)
        else:
            try:
                infos = {root: fs.info(root)}
            except FileNotFoundError as e:
                if _unreachable(e):
                    raise
                return []
            if infos[root]["type"] != "directory":
                format_of(url, text_ext)  # raises for an unsupported type
                if infos[root]["type"] == "other":  # fsspec's local files: a FIFO, a device
                    _refuse_special(url, "a special file (a FIFO, a socket or a device)")
        arrow_ok = _has_magic(web_path(root)) and web_path(root).lower().endswith(".arrow")
        found, skipped = [], Passed()
        for path, info in infos.items():
            if info["type"] == "directory":
                found += _walk_fs(fs, path, skipped, text_ext)
            else:
                found += _taken([path], arrow_ok, skipped, text_ext)
        passed += [fs.unstrip_protocol(p) for p in skipped]
        passed.hidden += [fs.unstrip_protocol(p) for p in skipped.hidden]
        return [fs.unstrip_protocol(p) for p in found]
    except ConfigError:
        raise  # a missing fsspec backend: its message says what to install
    except (OSError, ValueError, ImportError) as e:
        if _unreachable(e):
            raise InputError(f"{url}: cannot reach its host ({describe(_root_cause(e))}); check the "
                             "host name and port, and that the server is running", path=url,
                             where="file", reason="unreadable") from e
        raise InputError(f"{url}: cannot list ({describe(e)}); check the URL, storage_options "
                         "and that the fsspec backend is installed", path=url, where="file",
                         reason="unreadable") from e


def _walk_fs(fs, root: str, passed: Passed, text_ext=()) -> list[str]:
    """_walk on an fsspec filesystem: dataset folders give their data files, nothing else;
    hidden names are passed over (tokenmill.inputs.walk's rule)."""
    infos = fs.find(root, detail=True)
    hidden = {p: walk.hidden_part(root, p) for p in infos}  # the rule of local walks
    passed.hidden += sorted({h for h in hidden.values() if h})
    infos = {p: info for p, info in infos.items() if not hidden[p]}
    files = [p for p, info in infos.items() if info.get("type") != "other"]
    passed += [p for p, info in infos.items() if info.get("type") == "other"]  # a local FIFO…
    datasets = {}
    for p in files:
        folder, _, name = p.rpartition("/")
        if name == DATASET_STATE and (data := dataset_files(folder, fs.cat_file)) is not None:
            datasets[folder + "/"] = data
    inside = tuple(datasets)
    return _taken([p for p in files if not p.startswith(inside)], False, passed, text_ext) + \
        [f for data in datasets.values() for f in data]
