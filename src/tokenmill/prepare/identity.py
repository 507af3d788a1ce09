"""What a finished store records of its input files, and the check a rerun makes that they are
still those: an input rewritten under the same size and mtime (``touch -r`` after an edit) must
not leave a stale store called "already complete".

The manifest's ``input_ids``, one entry per ``sources`` entry, in its order::

    {"ino": …, "size": …, "mtime_ns": …, "ctime_ns": …, "xxh3": "…"}   # a local file
    {"size": …, "tag": [["ETag", "…"], …]}                             # a URL
    {"size": …, "tag": [["Last-Modified", "…"]], "xxh3": "…"}          # a URL, a time only
    null                                                                # could not be had

- a local file (a path, or a ``file://`` URL: ``records.local_path``): its ``stat`` when the
  run that finished the store started (not the device: machines mounting one network filesystem
  number it differently), and the xxh3-64 of its bytes, read once more when the store is
  finished (the bytes of a file whose identity changed during the run are first compared with
  what its units read, ``tokenize.unit_digest``: other bytes fail the run, as a file changed
  while it was read does, and the rerun redoes its shards);
- a URL: its size and the version fields its fsspec backend reports (``records.RemoteId``). A
  backend that reports no version of the content (ETag, checksum, generation, version id), only
  a modification time or nothing (``python -m http.server``, sftp, ftp), also gets the xxh3 of
  the bytes: such an input is read once more when the store is finished, and once more by every
  rerun that finds the store complete (its size and time alone cannot tell an edit).

A rerun that finds the store complete first compares the input files' names with ``sources``
(one added or removed is refused, naming it), then stats each input and reads none whose
identity is the recorded one. ctime cannot be set by users, so an edit shows whatever the size
and mtime say. When the inode or a time differs (also after a ``touch``, a ``chmod``, a copy put
back), the file's bytes are hashed and compared with ``xxh3``: the same bytes keep the store,
others refuse the rerun naming the file (``--overwrite`` redoes it). A URL whose size or version
differs is refused: comparing its bytes would download it again. This check runs before the
settings are compared, so a change that also shows in a setting (the sizes in ``files_xxh3``, a
transform's output on the first records) is reported as the input that changed. Stores made
before this record are not checked. The record depends on neither the worker count nor the unit
size.

    ids = input_ids(files, storage_options)                                # a run starts
    manifest[INPUT_IDS] = finished_ids(ids, names, units, digests, so)     # it ends
    check_unchanged(manifest, files, storage_options, where)               # a rerun: raises
    changed_output(units, writer.unit_texts, config, so)                   # a resume: None?

A transform's outputs on resume. A transform is known by its name, its module's source and what
it makes of the first records (``transform.transform_identity``, part of the settings); that
cannot see a helper loaded by ``importlib.import_module`` or ``exec``, or a data file read at
import (a stopword list), edited between a kill and the rerun for records past the first. So
every unit of a run with a transform records the ``split.texts_sum`` of its documents' texts with
its shard (``UnitResult.texts``), and a resume replays the transform on REPLAYED_UNITS of the
committed units (spread over them, the first and the last among them) and compares: other
texts refuse the resume, naming the transform and the file (``--overwrite`` starts the run over)
— never a store of documents made by two versions of it. A change that touches only records of
committed units that are not replayed is not seen (replaying every committed unit would cost as
much as the transform did); progress recorded before this record is not checked.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from tokenmill.inputs import sources
from tokenmill.base.errors import ConfigError, TokenmillError
from tokenmill.base.io import redact, xxh3_file
from tokenmill.prepare.split import text_hashes, texts_sum
from tokenmill.prepare.tokenize import PrepareConfig, input_name, read_unit_items, unit_digest
from tokenmill.inputs.records import Doc, RemoteId, changed, id_change, input_id, local_path
from tokenmill.store.format import INPUT_IDS, SOURCES

STAT_FIELDS = ("ino", "size", "mtime_ns", "ctime_ns")
# what some backends report that says when an object was written, not which content it holds
TIME_FIELDS = ("LastModified", "Last-Modified", "last_modified", "updated", "mtime")
SHOWN = 3  # changed, added or removed files a refusal names before "and N more"
REPLAYED_UNITS = 4  # committed units a resume with a transform replays (each ~unit_bytes of input)


def input_ids(files: Sequence[str], storage_options: Mapping | None) -> list[dict | None]:
    """Each file's identity now (a local file: one ``stat``; a URL: one request); None for one
    that cannot be had (its reader reports why)."""
    ids: list[dict | None] = []
    for f in files:
        try:
            local = local_path(f)
            if local is None:
                remote = input_id(f, storage_options)
                ids.append({"size": remote.size, "tag": [list(t) for t in remote.tag]})
            else:
                ids.append(local_id(local))
        except (OSError, TokenmillError):
            ids.append(None)
    return ids


def local_id(path: str) -> dict:
    """A local file's identity as recorded: inode, size, mtime and ctime (nanoseconds)."""
    st = os.stat(path)
    return {"ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def same_id(a: Mapping, b: Mapping) -> bool:
    """Whether two local identities are of one version of one file (device aside)."""
    return all(a.get(k) == b.get(k) for k in STAT_FIELDS)


def finished_ids(ids: Sequence[dict | None], names: Sequence[str],
                 units: Sequence[sources.Unit], digests: Mapping[int, str],
                 storage_options: Mapping | None) -> list[dict | None]:
    """The manifest's ``input_ids`` once every unit is written: ``ids`` (``input_ids`` of the
    files ``names``, as ``sources`` records them, when the run started), each local file's with
    the xxh3 of its bytes now. A file whose identity changed since must still hold the bytes its
    units read (``digests``, by unit index); else ``records.changed`` (the run fails; its rerun
    redoes that file's shards). A URL with no version field gets the xxh3 of its bytes too."""
    of_file: dict[str, list[int]] = {}
    urls: dict[str, str] = {}  # a URL with its credentials (names are redacted)
    for i, u in enumerate(units):
        of_file.setdefault(input_name(u.path), []).append(i)
        urls[input_name(u.path)] = u.path
    out: list[dict | None] = []
    for name, was in zip(names, ids):
        if was is None or ("tag" in was and (versioned(was) or name not in urls)):
            out.append(was)  # (a URL of no unit holds no document: nothing to compare)
        elif "tag" in was:
            out.append({**was, "xxh3": remote_content(urls[name], was, storage_options)})
        else:
            out.append(local_content(name, was, {i: units[i] for i in of_file.get(name, ())},
                                     digests, storage_options))
    return out


def local_content(path: str, was: dict, units: Mapping[int, sources.Unit],
                  digests: Mapping[int, str], storage_options: Mapping | None) -> dict:
    """A local input's finished record: ``was`` (or its identity now, if its bytes still read as
    its ``units``, by index, did) with the xxh3 of its bytes; ``records.changed`` if not."""
    local = local_path(path) or path
    try:
        content, now = xxh3_file(local), local_id(local)
    except OSError:
        raise changed(path, "unreadable now") from None
    if not same_id(was, now):  # touched, or rewritten: do the bytes still read as they did?
        if any(unit_digest(u, storage_options) != digests.get(i) for i, u in units.items()):
            raise changed(path, "its bytes differ from those its units read")
        was = now
    return {**was, "xxh3": content}


def versioned(record: Mapping) -> bool:
    """Whether a URL's recorded ``tag`` names its content (an ETag, a checksum, a generation),
    not only when it was written."""
    return any(k not in TIME_FIELDS for k, _ in record.get("tag") or ())


def remote_content(url: str, was: dict, storage_options: Mapping | None) -> str:
    """The xxh3 of the bytes of a URL whose backend reports no version, read once more now;
    ``records.changed`` if its size or time are no longer those recorded when the run started."""
    try:
        how = id_change(remote_id(was), input_id(url, storage_options))
        content = None if how else xxh3_file(url, storage_options=storage_options)
    except (OSError, TokenmillError):
        raise changed(redact(url), "unreadable now") from None
    if how or content is None:
        raise changed(redact(url), how or "unreadable now")
    return content


def remote_id(record: Mapping) -> RemoteId:
    """A URL's recorded identity as ``records.input_id`` gives it."""
    return RemoteId(record.get("size"), tuple(tuple(t) for t in record.get("tag") or ()))


def check_unchanged(manifest: dict, files: Sequence[str], storage_options: Mapping | None,
                    where: str) -> None:
    """Raise ConfigError naming the inputs of the finished store ``manifest`` that changed since
    it was prepared, or were added or removed (see the module docstring); nothing for a store
    without the record."""
    recorded = manifest.get(INPUT_IDS)
    if not isinstance(recorded, list):
        return
    was = dict(zip(manifest.get(SOURCES) or [], recorded))
    names = {input_name(f): f for f in files}
    parts = [f"added: {listed([f for n, f in names.items() if n not in was])}",
             f"removed: {listed([n for n in was if n not in names])}"]
    parts = [p for p in parts if not p.endswith(": ")]
    if parts:
        raise ConfigError(
            f"{where}: already holds a store prepared from other input files ({'; '.join(parts)}); "
            "pass --overwrite to prepare it again from the inputs as they are now, or choose "
            "another --out")
    changes = [f"{redact(f)} ({how})" for f, how in changed_inputs(manifest, files,
                                                                  storage_options).items()]
    if changes:
        raise ConfigError(
            f"{where}: already holds a store prepared from another version of {listed(changes)}; "
            "pass --overwrite to prepare it again from the input as it is now, or choose another "
            "--out")


def changed_inputs(manifest: dict, files: Sequence[str],
                   storage_options: Mapping | None) -> dict[str, str]:
    """Each of ``files`` that the finished store ``manifest`` records (``input_ids``) and that
    differs from its record now, with how in words (``change_of``); names it does not record are
    left to the caller."""
    recorded = manifest.get(INPUT_IDS)
    if not isinstance(recorded, list):
        return {}
    was = dict(zip(manifest.get(SOURCES) or [], recorded))
    return {f: how for f in files if isinstance(old := was.get(input_name(f)), dict)
            and (how := change_of(f, old, storage_options)) is not None}


def listed(items: Sequence[str]) -> str:
    """The first few of ``items``, in words.

    listed(["a", "b", "c", "d", "e"]) == "a, b, c and 2 more"
    """
    more = len(items) - SHOWN
    return ", ".join(redact(i) for i in items[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def change_of(path: str, old: dict, storage_options: Mapping | None) -> str | None:
    """How input ``path`` differs from its recorded identity ``old``, in words; None if it is
    the same file, or the same bytes under another inode or times, or cannot be had now."""
    try:
        if "tag" in old:
            return remote_change(path, old, storage_options)
        now = local_id(local_path(path) or path)
        if same_id(now, old):
            return None
        if now["size"] != old.get("size"):
            return f"size {old.get('size'):,} → {now['size']:,} bytes"
        if xxh3_file(local_path(path) or path) == old.get("xxh3"):
            return None  # touched, chmod-ed or copied back: the same bytes
    except (OSError, TokenmillError):
        return None  # unreadable now: its listing or reader says so
    same = "same size and modification time" if now["mtime_ns"] == old.get("mtime_ns") \
        else "same size"
    return f"{same}, other bytes"


def remote_change(url: str, old: dict, storage_options: Mapping | None) -> str | None:
    """How URL ``url`` differs from its record ``old``: its size or version, else (a URL with no
    version field, whose record holds the xxh3 of its bytes) its bytes read again."""
    how = id_change(remote_id(old), input_id(url, storage_options))
    if how is not None or "xxh3" not in old:
        return how
    if xxh3_file(url, storage_options=storage_options) == old["xxh3"]:
        return None
    fields = " and ".join(k for k, _ in old.get("tag") or ())
    return f"same size{' and ' + fields if fields else ''}, other bytes"


def changed_output(units: Sequence[sources.Unit], committed: Mapping[int, str],
                   config: PrepareConfig, storage_options: Mapping | None) -> str | None:
    """How ``config``'s transform, replayed on a few units an interrupted run committed
    (``replayed``), makes other texts of them than it made then, in words; None if it makes the
    same (``committed``: unit → ``split.texts_sum`` of its documents' texts, from the progress
    records), or there is no transform."""
    if config.transform is None:
        return None
    for u in replayed(units, committed):
        read = read_unit_items(units[u], config, storage_options)
        texts = [item.text for item in read.items if type(item) is Doc]
        if texts_sum(text_hashes(texts)) != committed[u]:
            return (f"transform {config.transform} made other texts of "
                    f"{redact(units[u].path)} (work unit {u}, committed) than it makes now")
    return None


def replayed(units: Sequence[sources.Unit], committed: Mapping[int, str]) -> list[int]:
    """Up to REPLAYED_UNITS of the committed units, spread evenly, the first and the last among
    them; a compressed stream's unit only if it starts its file (the others would decompress
    the file from its start).

    replayed([sources.Unit("a.txt", 0, -1)] * 9, dict.fromkeys(range(9), "")) == [0, 2, 5, 8]
    """
    kept = [u for u in sorted(committed) if u < len(units)
            and (not sources.needs_payload(units[u]) or units[u].start == 0)]
    if len(kept) <= REPLAYED_UNITS:
        return kept
    step = len(kept) - 1
    return sorted({kept[step * i // (REPLAYED_UNITS - 1)] for i in range(REPLAYED_UNITS)})
