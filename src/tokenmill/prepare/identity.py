"""What a finished store records of its input files, and the check a rerun makes that they are
still those: an input rewritten under the same size and mtime (``touch -r`` after an edit) must
not leave a stale store called "already complete".

The manifest's ``input_ids``, one entry per ``sources`` entry, in its order::

    {"ino": …, "size": …, "mtime_ns": …, "ctime_ns": …, "xxh3": "…"}   # a local file
    {"size": …, "tag": [["ETag", "…"], …]}                             # a URL
    null                                                                # could not be had

- a local file: its ``stat`` when the run that finished the store started (not the device:
  machines mounting one network filesystem number it differently), and the xxh3-64 of its bytes,
  read once more when the store is finished (the bytes of a file whose identity changed during
  the run are first compared with what its units read, ``tokenize.unit_digest``: other bytes
  fail the run, as a file changed while it was read does, and the rerun redoes its shards);
- a URL: its size and the version fields its fsspec backend reports (``records.RemoteId``).

A rerun that finds the store complete stats each input and reads none whose identity is the
recorded one. ctime cannot be set by users, so an edit shows whatever the size and mtime say.
When the inode or a time differs (also after a ``touch``, a ``chmod``, a copy put back), the
file's bytes are hashed and compared with ``xxh3``: the same bytes keep the store, others refuse
the rerun naming the file (``--overwrite`` redoes it). A URL whose size or version differs is
refused: comparing its bytes would download it again. Stores made before this record are not
checked. The record depends on neither the worker count nor the unit size.

    ids = input_ids(files, storage_options)                                # a run starts
    manifest[INPUT_IDS] = finished_ids(ids, names, units, digests, so)     # it ends
    check_unchanged(manifest, files, storage_options, where)               # a rerun: raises
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from tokenmill import sources
from tokenmill.errors import ConfigError, TokenmillError
from tokenmill.io import is_url, redact, xxh3_file
from tokenmill.prepare.tokenize import input_name, unit_digest
from tokenmill.records import RemoteId, changed, id_change, input_id
from tokenmill.store.format import INPUT_IDS, SOURCES

STAT_FIELDS = ("ino", "size", "mtime_ns", "ctime_ns")


def input_ids(files: Sequence[str], storage_options: Mapping | None) -> list[dict | None]:
    """Each file's identity now (a local file: one ``stat``; a URL: one request); None for one
    that cannot be had (its reader reports why)."""
    ids: list[dict | None] = []
    for f in files:
        try:
            if is_url(f):
                remote = input_id(f, storage_options)
                ids.append({"size": remote.size, "tag": [list(t) for t in remote.tag]})
            else:
                ids.append(local_id(f))
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
    redoes that file's shards)."""
    of_file: dict[str, list[int]] = {}
    for i, u in enumerate(units):
        of_file.setdefault(input_name(u.path), []).append(i)
    out: list[dict | None] = []
    for name, was in zip(names, ids):
        if was is None or "tag" in was:
            out.append(was)
            continue
        try:
            content, now = xxh3_file(name), local_id(name)
        except OSError:
            raise changed(name, "unreadable now") from None
        if not same_id(was, now):  # touched, or rewritten: do the bytes still read as they did?
            if any(unit_digest(units[i], storage_options) != digests.get(i)
                   for i in of_file.get(name, ())):
                raise changed(name, "its bytes differ from those its units read")
            was = now
        out.append({**was, "xxh3": content})
    return out


def check_unchanged(manifest: dict, files: Sequence[str], storage_options: Mapping | None,
                    where: str) -> None:
    """Raise ConfigError naming the first input of the finished store ``manifest`` that changed
    since it was prepared (see the module docstring); nothing for a store without the record."""
    recorded = manifest.get(INPUT_IDS)
    if not isinstance(recorded, list):
        return
    was = dict(zip(manifest.get(SOURCES) or [], recorded))
    for f in files:
        old = was.get(input_name(f))
        if not isinstance(old, dict):
            continue
        how = change_of(f, old, storage_options)
        if how is not None:
            raise ConfigError(
                f"{where}: already holds a store prepared from another version of {redact(f)} "
                f"({how}); pass --overwrite to prepare it again from the input as it is now, "
                "or choose another --out")


def change_of(path: str, old: dict, storage_options: Mapping | None) -> str | None:
    """How input ``path`` differs from its recorded identity ``old``, in words; None if it is
    the same file, or the same bytes under another inode or times, or cannot be had now."""
    try:
        if is_url(path):
            tag = tuple(tuple(t) for t in old.get("tag") or ())
            return id_change(RemoteId(old.get("size"), tag), input_id(path, storage_options))
        now = local_id(path)
        if same_id(now, old):
            return None
        if now["size"] != old.get("size"):
            return f"size {old.get('size')} → {now['size']} bytes"
        if xxh3_file(path) == old.get("xxh3"):
            return None  # touched, chmod-ed or copied back: the same bytes
    except (OSError, TokenmillError):
        return None  # unreadable now: its listing or reader says so
    same = "same size and modification time" if now["mtime_ns"] == old.get("mtime_ns") \
        else "same size"
    return f"{same}, other bytes"
